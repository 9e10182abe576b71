//! The decoder the pre-norm families share, as mlx-lm 0.32.2's `LlamaModel`,
//! `Qwen3MoeModel`, `MixtralModel`, `Qwen2MoeModel`, `Phi3Model`, `Gemma3Model`,
//! `GptOssMoeModel` and `Gemma4TextModel` compute it:
//!
//!   h = embed(ids)                          (or input embeddings: `forward_embeddings`)
//!   h = h · scale                           (where the family scales it: Gemma's √hidden)
//!   side = side_inputs(ids, h)              (Gemma 4's per-layer inputs; most have none)
//!   for each layer:  h = h + post_mixer(mixer(norm_in(h)))
//!                    h = h + post_ffn(ffn(norm_post(h)))
//!                    h = tail(h, side[layer])   (Gemma 4: per-layer input gate, scalar)
//!   logits = softcap(head(norm(h)))         (head = embedding.T when tied)
//!
//! `post_mixer` / `post_ffn` are Gemma's sandwich norms (the identity elsewhere; OLMo 2's
//! post-norm layers have them and no `norm_in` / `norm_post`), the sums
//! are plain adds or Gemma's float16-clipped ones, and a layer attends fully or within a
//! window (one mask per window, from the first cache of a layer with it). A layer may keep
//! no cache and borrow the K/V an earlier layer attended over (KV sharing: Gemma 4's last
//! layers; the lender lends them within the forward). A family file
//! reads its config and builds each layer's mixer (an attention variant; open to the
//! recurrent mixers) and feed-forward (a gated MLP, a mixture of experts, experts with a
//! shared one); everything else — the loop, the masks, the caches, LoRA's targets,
//! segmented training (`Layered`), tensor-parallel sharding and pipeline stages — is here,
//! once. Which families may shard or pipeline is the registry's to say (`registry.rs`);
//! `model::load` refuses the others before a layer is touched.

use std::ops::Range;

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype};

use super::layers::{Embedding, Linear, OutputHead, RmsNorm, Softcap};
use super::moe::SwitchLinear;
use super::pipeline::{self, Stage};
use super::shard::Part;
use super::{AssistantTarget, LanguageModel, Layered};
use crate::cache::Cache;

mod layer;
/// Segmented training's view.
mod segmented;

use crate::load::config::ModelConfig;
use crate::load::weights::Weights;
use crate::load::LoadError;
use layer::Io;
pub use layer::{
    kv_cache, FeedForward, Layer, Lent, MaskKind, Masks, Mixer, NamedAttention, Residual,
    SideInputs, SoftcappedAttention, Tail, Windowed,
};

type R<T> = Result<T, Exception>;

/// What every family's config gives the skeleton.
pub struct Dims {
    pub layers: i32,
    pub hidden: i32,
    /// The embedding's rows (and the untied head's outputs): config.json's vocab_size.
    pub vocab: i32,
    pub rms_norm_eps: f32,
    pub tie_word_embeddings: bool,
    /// The feed-forward's module name within a layer (`mlp`; Mixtral's `block_sparse_moe`).
    pub ffn_module: &'static str,
}

/// `Dims` from a family's args with config.json's usual names (`num_hidden_layers`,
/// `hidden_size`, `vocab_size`, `rms_norm_eps`, `tie_word_embeddings`); the feed-forward
/// under `mlp` unless named.
macro_rules! dims_of {
    ($a:expr) => {
        $crate::model::decoder::dims_of!($a, "mlp")
    };
    ($a:expr, $ffn:expr) => {
        $crate::model::decoder::Dims {
            layers: $a.num_hidden_layers,
            hidden: $a.hidden_size,
            vocab: $a.vocab_size,
            rms_norm_eps: $a.rms_norm_eps,
            tie_word_embeddings: $a.tie_word_embeddings,
            ffn_module: $ffn,
        }
    };
}
pub(crate) use dims_of;

/// Reads an RMSNorm (`prefix`, width, eps) from the checkpoint.
pub type NormLoader = fn(&mut Weights, &str, i32, f32) -> Result<RmsNorm, LoadError>;

/// Reads a family's side inputs (Gemma 4's per-layer inputs) from the checkpoint, right
/// after the embedding.
pub type SideLoader = Box<dyn FnOnce(&mut Weights) -> Result<Box<dyn SideInputs>, LoadError>>;

/// The input embeddings scaled by a constant: Gemma 3's
/// `h *= mx.array(scale, dtype).astype(h.dtype)` (the scale, an f32, rounded through
/// `through`, then cast to the embeddings' dtype), or with `through` None Gemma 4's
/// `h * scale` (a Python float: weak, the embeddings' dtype).
#[derive(Debug, Clone, Copy)]
pub struct EmbedScale {
    pub scale: f32,
    pub through: Option<Dtype>,
}

impl EmbedScale {
    fn apply(&self, h: &Array) -> R<Array> {
        let scale = Array::from_f32(self.scale)
            .as_dtype(self.through.unwrap_or(h.dtype()))?
            .as_dtype(h.dtype())?;
        h.multiply(&scale)
    }
}

/// How a family's blocks differ from the plain pre-norm ones (the default: Llama's).
pub struct Style {
    /// Every RMSNorm (the layers' and the final one): `RmsNorm::load`, Gemma's
    /// `RmsNorm::load_one_plus`.
    pub norm: NormLoader,
    /// Gemma's four norms per layer: `input_layernorm` before the mixer,
    /// `post_attention_layernorm` on its output, `pre_feedforward_layernorm` before the
    /// feed-forward, `post_feedforward_layernorm` on its output. Otherwise two:
    /// `input_layernorm` and `post_attention_layernorm` (before the feed-forward).
    pub sandwich: bool,
    /// OLMo 2's post-norm layers: no norm before the mixer or the feed-forward, only
    /// `post_attention_layernorm` and `post_feedforward_layernorm` on their outputs
    /// (`h + post_attn(mixer(h))`, `h + post_ffw(ffn(h))`).
    pub post_norms: bool,
    pub residual: Residual,
    /// The checkpoint names of the embedding, the layers, a plain layer's two norms and
    /// the final norm (LFM2's `operator_norm`, `ffn_norm`, `model.embedding_norm`; Mamba-2's
    /// `backbone.…`).
    pub names: Names,
    /// The layers' norms' eps when it is not the final norm's (Mamba-2's blocks keep
    /// `nn.RMSNorm`'s default 1e-5).
    pub layer_norm_eps: Option<f32>,
    pub embed_scale: Option<EmbedScale>,
    /// Gemma 4's per-layer inputs (the family's loader for them).
    pub side: Option<SideLoader>,
    /// `c · tanh(logits / c)` (Gemma 4's compiled `final_logit_softcapping`, Gemma 2's eager
    /// one).
    pub logit_softcap: Option<Softcap>,
    /// `lm_head(normed / d)` (MiniCPM's untied head, a Python float: weak).
    pub head_input_divisor: Option<f64>,
    /// `logits / s` (Granite's `logits_scaling`, a Python float: weak).
    pub logits_scaling: Option<f32>,
    /// `logits · m` (Falcon-H1's tied head: `lm_head_multiplier / embedding_multiplier`, a
    /// Python float formed in double precision, then weak).
    pub logits_multiplier: Option<f64>,
    /// An untied `lm_head` with a bias (phimoe's).
    pub head_bias: bool,
    /// False: no LoRA targets (`linears` is empty; the mixture-of-experts Gemma 4).
    pub lora: bool,
    /// Whether optiq's assistant drafter may draft for it (Gemma 4).
    pub assistant_target: bool,
}

impl Default for Style {
    fn default() -> Self {
        Style {
            norm: RmsNorm::load,
            sandwich: false,
            post_norms: false,
            residual: Residual::Add,
            names: Names::default(),
            layer_norm_eps: None,
            embed_scale: None,
            side: None,
            logit_softcap: None,
            head_input_divisor: None,
            logits_scaling: None,
            logits_multiplier: None,
            head_bias: false,
            lora: true,
            assistant_target: false,
        }
    }
}

/// Checkpoint names: the input embedding, the layers' prefix (`{layers}.{i}`), a plain
/// layer's two norms (within the layer; an empty name: no such norm) and the final norm.
#[derive(Debug, Clone, Copy)]
pub struct Names {
    pub embed: &'static str,
    pub layers: &'static str,
    pub input: &'static str,
    pub post: &'static str,
    pub last: &'static str,
}

impl Names {
    /// Mamba-2's and Nemotron-H's: `backbone.embeddings`, `backbone.layers.{i}.norm`,
    /// `backbone.norm_f` (their blocks have one norm).
    pub const BACKBONE: Names = Names {
        embed: "backbone.embeddings",
        layers: "backbone.layers",
        input: "norm",
        post: "",
        last: "backbone.norm_f",
    };
}

impl Default for Names {
    fn default() -> Self {
        Names {
            embed: "model.embed_tokens",
            layers: "model.layers",
            input: "input_layernorm",
            post: "post_attention_layernorm",
            last: "model.norm",
        }
    }
}

/// What a family builds for one layer: its mixer and feed-forward (none: Mamba-2's block),
/// and where it has them a tail and the layer it borrows K/V from (a pair converts: the
/// plain layer).
pub struct Built {
    pub mixer: Box<dyn Mixer>,
    pub ffn: Option<Box<dyn FeedForward>>,
    pub tail: Option<Box<dyn Tail>>,
    pub borrows: Option<usize>,
}

impl<F: FeedForward + 'static> From<(Box<dyn Mixer>, Box<F>)> for Built {
    fn from((mixer, ffn): (Box<dyn Mixer>, Box<F>)) -> Self {
        Built {
            mixer,
            ffn: Some(ffn),
            tail: None,
            borrows: None,
        }
    }
}

impl Built {
    /// A layer that is its mixer's residual branch alone.
    pub fn mixer_only(mixer: Box<dyn Mixer>) -> Self {
        Built {
            mixer,
            ffn: None,
            tail: None,
            borrows: None,
        }
    }
}

pub struct Decoder {
    model_type: String,
    ffn_module: &'static str,
    /// `model.layers` (Mamba-2: `backbone.layers`): LoRA's and sharding's names.
    layers_prefix: &'static str,
    /// Where mlx-lm's module tree puts this decoder, before `layers_prefix` in the paths
    /// LoRA reports: empty, or `language_model.` (Qwen 3.5's `Model` wraps its text model).
    module_root: &'static str,
    embed: Embedding,
    embed_scale: Option<EmbedScale>,
    side: Option<Box<dyn SideInputs>>,
    layers: Vec<Layer>,
    residual: Residual,
    head: OutputHead,
    logits_scaling: Option<f32>,
    logits_multiplier: Option<f64>,
    lora: bool,
    assistant_target: bool,
    /// Pipeline parallel: this rank's stage (`layers` then holds only its layers).
    stage: Option<Stage>,
    /// Tensor parallel splits an untied `lm_head` by the vocabulary (qwen3_5's `Model.shard`;
    /// the other families keep the head whole on every rank).
    vocab_sharded_head: bool,
}

/// One forward's K/V loans and side inputs, by layer.
struct Step {
    lent: Vec<Option<Lent>>,
    side: Option<Vec<Array>>,
}

impl Decoder {
    /// Loads the plain pre-norm decoder ([`Style::default`]); see [`Decoder::load_styled`].
    pub fn load<B: Into<Built>>(
        config: &ModelConfig,
        w: Weights,
        dims: Dims,
        layer: impl FnMut(&mut Weights, &str, i32) -> Result<B, LoadError>,
    ) -> Result<Self, LoadError> {
        Self::load_styled(config, w, dims, Style::default(), layer)
    }

    /// Loads the decoder: the embedding (and the family's side inputs), then layer `i`
    /// (prefix `model.layers.{i}`): its norms (as `style` names them), then the mixer and
    /// ffn that `layer` builds; then the final norm and the head. The family has sanitized
    /// `w` (mlx-lm's `sanitize`); every tensor left must be used. This is the order a probe
    /// lists the tensors in (`model::expected_weights`), which seeds the benchmark models'
    /// weights: changing it changes theirs.
    pub fn load_styled<B: Into<Built>>(
        config: &ModelConfig,
        mut w: Weights,
        dims: Dims,
        style: Style,
        mut layer: impl FnMut(&mut Weights, &str, i32) -> Result<B, LoadError>,
    ) -> Result<Self, LoadError> {
        w.set_quantization(config.quantization.clone());
        let (eps, hidden) = (dims.rms_norm_eps, dims.hidden);
        let names = style.names;
        let layer_eps = style.layer_norm_eps.unwrap_or(eps);
        let embed = Embedding::load(&mut w, names.embed, [dims.vocab, hidden])?;
        let side = style.side.map(|load| load(&mut w)).transpose()?;
        // Blocks with one norm (Mamba-2's, Nemotron-H's) name no post norm and build no ffn.
        let one_norm = names.post.is_empty();
        let mut layers: Vec<Layer> = Vec::new();
        for i in 0..dims.layers {
            let p = format!("{}.{i}", names.layers);
            let mut named = |n: &str| (style.norm)(&mut w, &format!("{p}.{n}"), hidden, layer_eps);
            // Post-norm layers (OLMo 2's) and blocks that norm themselves (Cohere 2's, no
            // input name) have none.
            let norm_in = match style.post_norms || names.input.is_empty() {
                true => None,
                false => Some(named(names.input)?),
            };
            let (post_mixer_norm, norm_post, post_ffn_norm) = match style.sandwich {
                _ if style.post_norms => (
                    Some(named("post_attention_layernorm")?),
                    None,
                    Some(named("post_feedforward_layernorm")?),
                ),
                false if one_norm => (None, None, None),
                false => (None, Some(named(names.post)?), None),
                true => (
                    Some(named("post_attention_layernorm")?),
                    Some(named("pre_feedforward_layernorm")?),
                    Some(named("post_feedforward_layernorm")?),
                ),
            };
            let built: Built = layer(&mut w, &p, i)?.into();
            if let Some(j) = built.borrows {
                if j >= i as usize || layers[j].borrows.is_some() {
                    return Err(LoadError::Unsupported(format!(
                        "layer {i} borrows the K/V of layer {j}, which is not an earlier layer \
                         with K/V of its own"
                    )));
                }
            }
            if built.ffn.is_some() == one_norm {
                return Err(LoadError::Unsupported(format!(
                    "layer {i}: a block with {} must {} a feed-forward",
                    if one_norm { "one norm" } else { "a post norm" },
                    if one_norm { "not build" } else { "build" },
                )));
            }
            layers.push(Layer {
                norm_in,
                mixer: built.mixer,
                post_mixer_norm,
                norm_post,
                ffn: built.ffn,
                post_ffn_norm,
                tail: built.tail,
                borrows: built.borrows,
            });
        }
        let final_norm = (style.norm)(&mut w, names.last, hidden, eps)?;
        let mut head = OutputHead::load(
            &mut w,
            final_norm,
            dims.tie_word_embeddings,
            [dims.vocab, hidden],
            style.logit_softcap,
            style.head_bias,
        )?;
        head.input_divisor = style.head_input_divisor;
        w.ensure_consumed(&config.model_type, |_| false)?;
        Ok(Decoder {
            model_type: config.model_type.clone(),
            ffn_module: dims.ffn_module,
            layers_prefix: names.layers,
            module_root: "",
            embed,
            embed_scale: style.embed_scale,
            side,
            layers,
            residual: style.residual,
            head,
            logits_scaling: style.logits_scaling,
            logits_multiplier: style.logits_multiplier,
            lora: style.lora,
            assistant_target: style.assistant_target,
            stage: None,
            vocab_sharded_head: false,
        })
    }

    /// The decoder as mlx-lm's module tree holds it under `language_model` (Qwen 3.5's
    /// `Model`): LoRA's layer paths (adapter names) carry that prefix; loading, the forward
    /// and sharding's names are unchanged.
    pub fn under_language_model(mut self) -> Self {
        self.module_root = "language_model.";
        self
    }

    /// An untied `lm_head` reads the normed state divided by `d` (MiniCPM 3).
    pub fn with_untied_head_input_divisor(mut self, d: f64) -> Self {
        self.head.untied_input_divisor = Some(d);
        self
    }

    /// Tensor parallel splits this decoder's untied `lm_head` by the vocabulary and gathers
    /// the logits after it (qwen3_5's `Model.shard`).
    pub fn with_vocab_sharded_head(mut self) -> Self {
        self.vocab_sharded_head = true;
        self
    }

    /// The module path of layer `i`'s `name` as mlx-lm's module tree spells it (an adapter's
    /// name without `.lora_a` / `.lora_b`).
    fn lora_path(&self, i: usize, name: &str) -> String {
        format!("{}{}.{i}.{name}", self.module_root, self.layers_prefix)
    }

    /// ids [B, L] → their embeddings (what `forward_embeddings` takes: not yet scaled).
    pub fn embed(&self, ids: &Array) -> R<Array> {
        self.embed.forward(ids)
    }

    /// Input embeddings → the first hidden state (the family's scale, if any).
    fn scaled(&self, h: Array) -> R<Array> {
        match &self.embed_scale {
            Some(s) => s.apply(&h),
            None => Ok(h),
        }
    }

    /// The side inputs of `ids` (None for a model without them).
    fn side_inputs(&self, ids: &Array, h0: &Array) -> R<Option<Vec<Array>>> {
        self.side.as_ref().map(|s| s.make(ids, h0)).transpose()
    }

    /// The masks for `n` new tokens through the local layers (`caches`: the layers' that
    /// keep one, in order).
    pub fn masks(&self, caches: &[Box<dyn Cache>], n: i32) -> R<Masks> {
        Masks::make(&self.layers, caches, n)
    }

    /// The local layers `range` over `h`, `caches` those of the layers in it that keep one,
    /// each layer with the mask of its window.
    pub fn blocks(
        &self,
        h: Array,
        masks: &Masks,
        range: Range<usize>,
        caches: &mut [Box<dyn Cache>],
    ) -> R<Array> {
        let mut step = Step {
            lent: vec![None; self.layers.len()],
            side: None,
        };
        self.run(h, masks, range, caches, &mut step)
    }

    /// As `blocks`, with the forward's loans and side inputs.
    fn run(
        &self,
        mut h: Array,
        masks: &Masks,
        range: Range<usize>,
        caches: &mut [Box<dyn Cache>],
        step: &mut Step,
    ) -> R<Array> {
        let mut caches = caches.iter_mut();
        for i in range {
            let layer = &self.layers[i];
            let mask = masks.of(layer.mixer.as_ref());
            let io = match layer.borrows {
                Some(j) => Io::Borrow(step.lent[j].as_ref().ok_or_else(|| {
                    Exception::custom(format!("layer {i} borrows layer {j}'s K/V, not lent"))
                })?),
                None if layer.mixer.stateless() => Io::Stateless,
                None => {
                    let cache = caches
                        .next()
                        .ok_or_else(|| Exception::custom(format!("no cache for layer {i}")))?;
                    match self.lends(i) {
                        true => Io::Lend(cache.as_mut()),
                        false => Io::Own(cache.as_mut()),
                    }
                }
            };
            let side = step.side.as_ref().map(|s| &s[i]);
            let (next, lent) = layer.forward(h, mask, io, self.residual, side)?;
            h = next;
            if lent.is_some() {
                step.lent[i] = lent;
            }
        }
        Ok(h)
    }

    /// Whether a later layer borrows layer `i`'s K/V.
    fn lends(&self, i: usize) -> bool {
        self.layers.iter().any(|l| l.borrows == Some(i))
    }

    /// Final norm and output head → logits.
    pub fn head(&self, h: &Array) -> R<Array> {
        let logits = self.head.forward(&self.embed, h)?;
        let logits = match self.logits_scaling {
            Some(s) => logits.divide(crate::scalar::weak(s as f64, &logits)?)?,
            None => logits,
        };
        match self.logits_multiplier {
            Some(m) => logits.multiply(crate::scalar::weak(m, &logits)?),
            None => Ok(logits),
        }
    }

    /// The forward from input embeddings [B, L, H]: the family's scale, the masks from the
    /// caches (as mlx-lm makes them), the local layers (through this rank's stage when
    /// pipelined), then the head. A model with side inputs makes them from the ids: it
    /// takes `forward` only.
    pub fn forward_embeddings(&self, h: Array, caches: &mut [Box<dyn Cache>]) -> R<Array> {
        if self.side.is_some() {
            return Err(Exception::custom(format!(
                "{} makes per-layer inputs from the token ids: it runs from ids, not \
                 input embeddings",
                self.model_type
            )));
        }
        let h = self.hidden_states(self.scaled(h)?, None, caches)?;
        self.head(&h)
    }

    /// Input embeddings scaled as the family scales them (the first hidden state of
    /// `forward_first_hidden`).
    pub fn scale_embeddings(&self, h: Array) -> R<Array> {
        self.scaled(h)
    }

    /// The forward from a first hidden state (already scaled), the side inputs made from
    /// `side_ids` and it: what mlx-vlm's gemma4 runs from merged image embeddings, whose
    /// per-layer inputs read image tokens as 0. `overlay` (boolean, [1, 1, L, L], fresh
    /// caches only): positions it allows are attended to whatever the causal or windowed
    /// mask says (gemma4's image blocks), every attention mask then an explicit array.
    pub fn forward_first_hidden(
        &self,
        h: Array,
        side_ids: &Array,
        overlay: Option<&Array>,
        caches: &mut [Box<dyn Cache>],
    ) -> R<Array> {
        let side = self.side_inputs(side_ids, &h)?;
        let n = h.shape()[1];
        let mut masks = self.masks(caches, n)?;
        if let Some(o) = overlay {
            masks = masks.or_overlay(o, n, caches)?;
        }
        let h = self.hidden_states_masked(h, side, caches, masks)?;
        self.head(&h)
    }

    /// The first hidden state and side inputs through the local layers (this rank's stage
    /// when pipelined): the hidden state before the final norm.
    fn hidden_states(
        &self,
        h: Array,
        side: Option<Vec<Array>>,
        caches: &mut [Box<dyn Cache>],
    ) -> R<Array> {
        let masks = self.masks(caches, h.shape()[1])?;
        self.hidden_states_masked(h, side, caches, masks)
    }

    /// As `hidden_states`, with the masks given.
    fn hidden_states_masked(
        &self,
        h: Array,
        side: Option<Vec<Array>>,
        caches: &mut [Box<dyn Cache>],
        masks: Masks,
    ) -> R<Array> {
        let all = 0..self.layers.len();
        let mut step = Step {
            lent: vec![None; self.layers.len()],
            side,
        };
        pipeline::run(self.stage.as_ref(), h, caches, |h, caches| {
            self.run(h, &masks, all, caches, &mut step)
        })
    }

    /// ids → the hidden state before the final norm.
    fn run_ids(&self, ids: &Array, caches: &mut [Box<dyn Cache>]) -> R<Array> {
        let h = self.scaled(self.embed(ids)?)?;
        let side = self.side_inputs(ids, &h)?;
        self.hidden_states(h, side, caches)
    }
}

impl LanguageModel for Decoder {
    fn model_type(&self) -> &str {
        &self.model_type
    }

    fn activation_dtype(&self) -> mlx_rs::Dtype {
        self.embed.output_dtype()
    }

    fn vocab_size(&self) -> usize {
        self.head.width(&self.embed)
    }

    /// One per local layer that keeps one (a pipeline stage's in its stage wrapper).
    fn make_caches(&self) -> Vec<Box<dyn Cache>> {
        let keepers = self.layers.iter().filter(|l| l.keeps_cache());
        let caches = keepers.map(|l| l.mixer.make_cache()).collect();
        pipeline::local_caches(self.stage.as_ref(), caches)
    }

    fn forward(&self, ids: &Array, caches: &mut [Box<dyn Cache>]) -> R<Array> {
        self.head(&self.run_ids(ids, caches)?)
    }

    /// Refused on a pipeline stage: its layers are only part of the model.
    fn final_hidden(&self, ids: &Array, caches: &mut [Box<dyn Cache>]) -> R<Array> {
        if self.stage.is_some() {
            return Err(Exception::custom(format!(
                "{}: a pipeline stage holds only some layers; its final hidden states are \
                 another rank's",
                self.model_type
            )));
        }
        self.head.norm.forward(&self.run_ids(ids, caches)?)
    }

    fn linears(&self) -> Vec<(String, &Linear)> {
        if !self.lora {
            return Vec::new();
        }
        let mut all = Vec::new();
        // Planted: a recurrent mixer's input projections are no LoRA target.
        let planted = crate::plant::is(crate::plant::Defect::RecurrentInProjLoraDropped);
        for (i, l) in self.layers.iter().enumerate() {
            let dropped = |n: &str| planted && l.mixer.recurrent() && n.contains(".in_proj");
            let mixer = l.mixer.linears().into_iter().filter(|(n, _)| !dropped(n));
            let tail = l.tail.iter().flat_map(|t| t.linears());
            let mixer = mixer.map(|(n, l)| (n.to_owned(), l));
            let tail = tail.map(|(n, l)| (n.to_owned(), l));
            let ffn = l.ffn.iter().flat_map(|f| f.linears(self.ffn_module));
            for (n, lin) in mixer.chain(ffn).chain(tail) {
                all.push((self.lora_path(i, &n), lin));
            }
        }
        pipeline::checkpoint_names(self.stage.as_ref(), all)
    }

    fn block_norms(&self) -> Vec<(String, &RmsNorm)> {
        let mut all = Vec::new();
        for (i, l) in self.layers.iter().enumerate() {
            let named = [
                ("input_layernorm", &l.norm_in),
                ("post_attention_layernorm", &l.norm_post),
            ];
            for (n, norm) in named {
                if let Some(norm) = norm {
                    all.push((self.lora_path(i, n), norm));
                }
            }
        }
        all
    }

    fn switch_linears(&self) -> Vec<(String, &SwitchLinear)> {
        if !self.lora {
            return Vec::new();
        }
        let mut all = Vec::new();
        for (i, l) in self.layers.iter().enumerate() {
            let mixer = l
                .mixer
                .switches()
                .into_iter()
                .map(|(n, s)| (n.to_owned(), s));
            let ffn = l.ffn.iter().flat_map(|f| f.switches(self.ffn_module));
            for (n, s) in mixer.chain(ffn) {
                all.push((self.lora_path(i, &n), s));
            }
        }
        pipeline::checkpoint_names(self.stage.as_ref(), all)
    }

    /// None on a pipeline stage: its blocks are only part of the model. (Whether a family
    /// may train segmented is the registry's `segmented`, which the trainer asks.)
    fn as_layered(&self) -> Option<&dyn Layered> {
        match self.stage {
            Some(_) => None,
            None => Some(self),
        }
    }

    fn as_assistant_target(&self) -> Option<&dyn AssistantTarget> {
        match self.assistant_target && self.stage.is_none() {
            true => Some(self),
            false => None,
        }
    }

    /// Tensor parallel as mlx-lm's `Model.shard`: each layer's mixer and feed-forward keep
    /// this rank's part (and the untied head its part of the vocabulary, where the family
    /// splits it).
    fn shard(&mut self, part: Part) -> Result<(), LoadError> {
        if self.vocab_sharded_head {
            self.head.shard_vocab(part)?;
        }
        for (i, l) in self.layers.iter_mut().enumerate() {
            let p = format!("{}.{i}", self.layers_prefix);
            l.mixer.shard(part, &p)?;
            if let Some(ffn) = l.ffn.as_mut() {
                ffn.shard(part, &format!("{p}.{}", self.ffn_module))?;
            }
        }
        Ok(())
    }

    /// `PipelineMixin.pipeline`: this rank keeps its stage's layers. Refused where a layer
    /// borrows K/V or reads side inputs: a stage would lack what the earlier one made.
    fn pipeline(&mut self, part: Part) -> Result<(), LoadError> {
        if self.side.is_some() || self.layers.iter().any(|l| l.borrows.is_some()) {
            return Err(LoadError::Unsupported(format!(
                "{}: pipeline stages cannot split layers that share K/V or per-layer inputs",
                self.model_type
            )));
        }
        let stage = Stage::new(part, self.layers.len(), &self.model_type)?;
        self.layers = stage.keep(std::mem::take(&mut self.layers));
        self.stage = Some(stage);
        Ok(())
    }
}

/// optiq's assistant drafter reads its target through these.
impl AssistantTarget for Decoder {
    fn hidden(&self, ids: &Array, caches: &mut [Box<dyn Cache>]) -> R<Array> {
        self.head.norm.forward(&self.run_ids(ids, caches)?)
    }

    fn head_uncapped(&self, hidden: &Array) -> R<Array> {
        self.head.project(&self.embed, hidden)
    }

    fn embed_scaled(&self, ids: &Array) -> R<Array> {
        self.scaled(self.embed(ids)?)
    }

    /// The caches of the last sliding-window and the last full-attention layer that keep
    /// their own K/V.
    fn donor_caches(&self) -> R<(usize, usize)> {
        let (mut sliding, mut full) = (None, None);
        let keepers = self.layers.iter().filter(|l| l.keeps_cache());
        for (cache, layer) in keepers.enumerate() {
            if layer.mixer.recurrent() {
                continue;
            }
            match layer.mixer.window() {
                None => full = Some(cache),
                Some(_) => sliding = Some(cache),
            }
        }
        sliding.zip(full).ok_or_else(|| {
            Exception::custom(
                "the assistant drafter needs a target with both sliding-window and \
                 full-attention layers",
            )
        })
    }
}
