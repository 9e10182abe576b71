//! The decoder the pre-norm families share, as mlx-lm 0.32.2's `LlamaModel`,
//! `Qwen3MoeModel`, `MixtralModel`, `Qwen2MoeModel`, `Phi3Model`, `Gemma3Model` and
//! `GptOssMoeModel` compute it:
//!
//!   h = embed(ids)                          (or input embeddings: `forward_embeddings`)
//!   h = h · scale                           (where the family scales it: Gemma's √hidden)
//!   for each layer:  h = h + post_mixer(mixer(norm_in(h)))
//!                    h = h + post_ffn(ffn(norm_post(h)))
//!   logits = head(norm(h))                  (head = embedding.T when tied)
//!
//! `post_mixer` / `post_ffn` are Gemma's sandwich norms (the identity elsewhere), the sums
//! are plain adds or Gemma's float16-clipped ones, and a layer attends fully or within a
//! window (one mask per window, from the first cache of a layer with it). A family file
//! reads its config and builds each layer's mixer (an attention variant; open to the
//! recurrent mixers) and feed-forward (a gated MLP, a mixture of experts, experts with a
//! shared one); everything else — the loop, the masks, the caches, LoRA's targets,
//! segmented training (`Layered`), tensor-parallel sharding and pipeline stages — is here,
//! once. Which families may shard or pipeline is the registry's to say (`registry.rs`);
//! `model::load` refuses the others before a layer is touched.

use std::ops::Range;

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype};

use super::layers::{Attention, Embedding, Linear, Mlp, OutputHead, RmsNorm};
use super::moe::SwitchLinear;
use super::pipeline::{self, Stage};
use super::rope;
use super::shard::Part;
use super::{LanguageModel, Layered};
use crate::cache::{kv_of, Cache, KvCache, Mask, RotatingKvCache};
use crate::load::config::ModelConfig;
use crate::load::weights::Weights;
use crate::load::LoadError;

type R<T> = Result<T, Exception>;

/// A layer's token mixer: reads the normed hidden state, keeps its state in its cache.
pub trait Mixer {
    fn forward(&self, x: &Array, mask: &Mask, cache: &mut dyn Cache) -> R<Array>;
    /// A fresh cache of the kind this mixer keeps.
    fn make_cache(&self) -> Box<dyn Cache>;
    /// The attention window it reads within (its mask's); None: every position before.
    fn window(&self) -> Option<i32> {
        None
    }
    /// Its linears under mlx-lm's names within the layer (`self_attn.q_proj`), in the
    /// order LoRA attaches to them.
    fn linears(&self) -> Vec<(&'static str, &Linear)>;
    /// Keeps this rank's part (tensor parallel); `layer` is the layer's checkpoint prefix.
    fn shard(&mut self, part: Part, layer: &str) -> Result<(), LoadError>;
}

/// A layer's feed-forward; `module` is its name within the layer (`mlp`, Mixtral's
/// `block_sparse_moe`).
pub trait FeedForward {
    fn forward(&self, x: &Array) -> R<Array>;
    /// Its linears named `<module>.…`, in the order LoRA attaches to them.
    fn linears(&self, module: &str) -> Vec<(String, &Linear)>;
    /// Its stacks of experts named `<module>.switch_mlp.…` (gpt-oss: `<module>.experts.…`;
    /// none for a dense MLP).
    fn switches(&self, _module: &str) -> Vec<(String, &SwitchLinear)> {
        Vec::new()
    }
    /// Keeps this rank's part; `prefix` is the module's checkpoint path.
    fn shard(&mut self, part: Part, prefix: &str) -> Result<(), LoadError>;
}

/// A mixer of a sliding-window layer (Gemma 3's local layers, gpt-oss's
/// `sliding_attention`): it reads the windowed mask, and keeps a rotating cache of `window`
/// entries, as mlx-lm's `make_cache` gives such a layer.
pub struct Windowed<M> {
    pub mixer: M,
    pub window: i32,
}

impl<M: Mixer> Mixer for Windowed<M> {
    fn forward(&self, x: &Array, mask: &Mask, cache: &mut dyn Cache) -> R<Array> {
        self.mixer.forward(x, mask, cache)
    }

    fn make_cache(&self) -> Box<dyn Cache> {
        Box::new(RotatingKvCache::new(self.window))
    }

    fn window(&self) -> Option<i32> {
        Some(self.window)
    }

    fn linears(&self) -> Vec<(&'static str, &Linear)> {
        self.mixer.linears()
    }

    fn shard(&mut self, part: Part, layer: &str) -> Result<(), LoadError> {
        self.mixer.shard(part, layer)
    }
}

/// How a layer adds a branch back into the residual stream.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Residual {
    /// `h + r`.
    #[default]
    Add,
    /// mlx-lm's gemma3 `clip_residual`: `h + r`, except in float16, where the sum is formed
    /// in float32, clipped to ±65504 and cast back.
    ClipF16,
}

impl Residual {
    fn add(self, h: &Array, r: &Array) -> R<Array> {
        if self == Residual::Add || h.dtype() != Dtype::Float16 {
            return h.add(r);
        }
        let bound = Array::from_f32(65504.0);
        let sum = h
            .as_dtype(Dtype::Float32)?
            .add(r.as_dtype(Dtype::Float32)?)?;
        mlx_rs::ops::clip(&sum, (&bound.negative()?, &bound))?.as_dtype(Dtype::Float16)
    }
}

/// One block: `h + post_mixer(mixer(norm_in(h)))`, then `+ post_ffn(ffn(norm_post(·)))`;
/// the post norms are Gemma's sandwich norms (absent elsewhere).
pub struct Layer {
    pub norm_in: RmsNorm,
    pub mixer: Box<dyn Mixer>,
    pub post_mixer_norm: Option<RmsNorm>,
    pub norm_post: RmsNorm,
    pub ffn: Box<dyn FeedForward>,
    pub post_ffn_norm: Option<RmsNorm>,
}

impl Layer {
    fn forward(&self, h: Array, mask: &Mask, cache: &mut dyn Cache, sum: Residual) -> R<Array> {
        let post = |norm: &Option<RmsNorm>, r: Array| match norm {
            Some(norm) => norm.forward(&r),
            None => Ok(r),
        };
        let r = self
            .mixer
            .forward(&self.norm_in.forward(&h)?, mask, cache)?;
        let h = sum.add(&h, &post(&self.post_mixer_norm, r)?)?;
        let r = self.ffn.forward(&self.norm_post.forward(&h)?)?;
        sum.add(&h, &post(&self.post_ffn_norm, r)?)
    }
}

/// The masks of one forward: one per attention window among the layers run (None = full
/// attention), full attention's first, each made by the cache of the first layer with that
/// window — as mlx-lm's gemma3 and gpt_oss make theirs, and as the other families make
/// their one mask from the first cache.
pub struct Masks(Vec<(Option<i32>, Mask)>);

impl Masks {
    /// For `n` new tokens through `layers`, `caches[k]` the k-th layer's.
    pub fn make(layers: &[Layer], caches: &[Box<dyn Cache>], n: i32) -> R<Self> {
        let windows: Vec<Option<i32>> = layers.iter().map(|l| l.mixer.window()).collect();
        let mut kinds: Vec<Option<i32>> = Vec::new();
        if windows.contains(&None) {
            kinds.push(None);
        }
        for w in windows.iter().filter(|w| w.is_some()) {
            if !kinds.contains(w) {
                kinds.push(*w);
            }
        }
        let masks = kinds.into_iter().map(|kind| {
            let first = windows.iter().position(|w| *w == kind).unwrap_or(0);
            Ok((kind, caches[first].make_mask(n, kind)?))
        });
        Ok(Masks(masks.collect::<R<_>>()?))
    }

    /// The mask of a layer attending within `window`.
    fn of(&self, window: Option<i32>) -> &Mask {
        let found = self.0.iter().find(|(w, _)| *w == window);
        found.map_or(&Mask::None, |(_, m)| m)
    }
}

/// What every family's config gives the skeleton.
pub struct Dims {
    pub layers: i32,
    pub hidden: i32,
    pub rms_norm_eps: f32,
    pub tie_word_embeddings: bool,
    /// The feed-forward's module name within a layer (`mlp`; Mixtral's `block_sparse_moe`).
    pub ffn_module: &'static str,
}

/// Reads an RMSNorm (`prefix`, eps) from the checkpoint.
pub type NormLoader = fn(&mut Weights, &str, f32) -> Result<RmsNorm, LoadError>;

/// The input embeddings scaled by a constant, as Gemma's
/// `h *= mx.array(scale, dtype).astype(h.dtype)`: the scale (an f32) rounded through
/// `through`, then cast to the embeddings' dtype.
#[derive(Debug, Clone, Copy)]
pub struct EmbedScale {
    pub scale: f32,
    pub through: Dtype,
}

impl EmbedScale {
    fn apply(&self, h: &Array) -> R<Array> {
        let scale = Array::from_f32(self.scale)
            .as_dtype(self.through)?
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
    pub residual: Residual,
    pub embed_scale: Option<EmbedScale>,
}

impl Default for Style {
    fn default() -> Self {
        Style {
            norm: RmsNorm::load,
            sandwich: false,
            residual: Residual::Add,
            embed_scale: None,
        }
    }
}

/// The mixer and feed-forward a family builds for one layer.
pub type Built = (Box<dyn Mixer>, Box<dyn FeedForward>);

pub struct Decoder {
    model_type: String,
    ffn_module: &'static str,
    embed: Embedding,
    embed_scale: Option<EmbedScale>,
    layers: Vec<Layer>,
    residual: Residual,
    head: OutputHead,
    /// Pipeline parallel: this rank's stage (`layers` then holds only its layers).
    stage: Option<Stage>,
}

impl Decoder {
    /// Loads the plain pre-norm decoder ([`Style::default`]); see [`Decoder::load_styled`].
    pub fn load(
        config: &ModelConfig,
        w: Weights,
        dims: Dims,
        layer: impl FnMut(&mut Weights, &str, i32) -> Result<Built, LoadError>,
    ) -> Result<Self, LoadError> {
        Self::load_styled(config, w, dims, Style::default(), layer)
    }

    /// Loads the decoder: layer `i` (prefix `model.layers.{i}`) gets the mixer and ffn that
    /// `layer` builds, then its norms (as `style` names them); then the embedding, the final
    /// norm and the head. The family has sanitized `w` (mlx-lm's `sanitize`); every tensor
    /// left must be used.
    pub fn load_styled(
        config: &ModelConfig,
        mut w: Weights,
        dims: Dims,
        style: Style,
        mut layer: impl FnMut(&mut Weights, &str, i32) -> Result<Built, LoadError>,
    ) -> Result<Self, LoadError> {
        w.set_quantization(config.quantization.clone());
        let eps = dims.rms_norm_eps;
        let norm = |w: &mut Weights, name: &str| (style.norm)(w, name, eps);
        let mut layers = Vec::new();
        for i in 0..dims.layers {
            let p = format!("model.layers.{i}");
            let (mixer, ffn) = layer(&mut w, &p, i)?;
            let mut named = |n: &str| norm(&mut w, &format!("{p}.{n}"));
            layers.push(match style.sandwich {
                false => Layer {
                    norm_in: named("input_layernorm")?,
                    mixer,
                    post_mixer_norm: None,
                    norm_post: named("post_attention_layernorm")?,
                    ffn,
                    post_ffn_norm: None,
                },
                true => Layer {
                    norm_in: named("input_layernorm")?,
                    mixer,
                    post_mixer_norm: Some(named("post_attention_layernorm")?),
                    norm_post: named("pre_feedforward_layernorm")?,
                    ffn,
                    post_ffn_norm: Some(named("post_feedforward_layernorm")?),
                },
            });
        }
        let embed = Embedding::load(&mut w, "model.embed_tokens", dims.hidden)?;
        let final_norm = norm(&mut w, "model.norm")?;
        let head = OutputHead::load(
            &mut w,
            final_norm,
            dims.tie_word_embeddings,
            dims.hidden,
            None,
        )?;
        w.ensure_consumed(&config.model_type, |_| false)?;
        Ok(Decoder {
            model_type: config.model_type.clone(),
            ffn_module: dims.ffn_module,
            embed,
            embed_scale: style.embed_scale,
            layers,
            residual: style.residual,
            head,
            stage: None,
        })
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

    /// The masks for `n` new tokens through the local layers (`caches`, one each).
    pub fn masks(&self, caches: &[Box<dyn Cache>], n: i32) -> R<Masks> {
        Masks::make(&self.layers, caches, n)
    }

    /// The local layers `range` over `h`, each with its cache (`caches[k]` for the k-th)
    /// and the mask of its window.
    pub fn blocks(
        &self,
        mut h: Array,
        masks: &Masks,
        range: Range<usize>,
        caches: &mut [Box<dyn Cache>],
    ) -> R<Array> {
        for (layer, cache) in self.layers[range].iter().zip(caches.iter_mut()) {
            let mask = masks.of(layer.mixer.window());
            h = layer.forward(h, mask, cache.as_mut(), self.residual)?;
        }
        Ok(h)
    }

    /// Final norm and output head → logits.
    pub fn head(&self, h: &Array) -> R<Array> {
        self.head.forward(&self.embed, h)
    }

    /// The forward from input embeddings [B, L, H]: the family's scale, the masks from the
    /// caches (as mlx-lm makes them), the local layers (through this rank's stage when
    /// pipelined), then the head.
    pub fn forward_embeddings(&self, h: Array, caches: &mut [Box<dyn Cache>]) -> R<Array> {
        let h = self.scaled(h)?;
        let masks = self.masks(caches, h.shape()[1])?;
        let all = 0..self.layers.len();
        let h = pipeline::run(self.stage.as_ref(), h, caches, |h, caches| {
            self.blocks(h, &masks, all, caches)
        })?;
        self.head(&h)
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

    /// One per local layer (a pipeline stage's in its stage wrapper).
    fn make_caches(&self) -> Vec<Box<dyn Cache>> {
        let caches = self.layers.iter().map(|l| l.mixer.make_cache()).collect();
        pipeline::local_caches(self.stage.as_ref(), caches)
    }

    fn forward(&self, ids: &Array, caches: &mut [Box<dyn Cache>]) -> R<Array> {
        self.forward_embeddings(self.embed(ids)?, caches)
    }

    fn linears(&self) -> Vec<(String, &Linear)> {
        let mut all = Vec::new();
        for (i, l) in self.layers.iter().enumerate() {
            let mixer = l
                .mixer
                .linears()
                .into_iter()
                .map(|(n, l)| (n.to_owned(), l));
            for (n, lin) in mixer.chain(l.ffn.linears(self.ffn_module)) {
                all.push((format!("model.layers.{i}.{n}"), lin));
            }
        }
        pipeline::checkpoint_names(self.stage.as_ref(), all)
    }

    fn switch_linears(&self) -> Vec<(String, &SwitchLinear)> {
        let mut all = Vec::new();
        for (i, l) in self.layers.iter().enumerate() {
            for (n, s) in l.ffn.switches(self.ffn_module) {
                all.push((format!("model.layers.{i}.{n}"), s));
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

    /// Tensor parallel as mlx-lm's `Model.shard`: each layer's mixer and feed-forward keep
    /// this rank's part.
    fn shard(&mut self, part: Part) -> Result<(), LoadError> {
        for (i, l) in self.layers.iter_mut().enumerate() {
            let p = format!("model.layers.{i}");
            l.mixer.shard(part, &p)?;
            l.ffn.shard(part, &format!("{p}.{}", self.ffn_module))?;
        }
        Ok(())
    }

    /// `PipelineMixin.pipeline`: this rank keeps its stage's layers.
    fn pipeline(&mut self, part: Part) -> Result<(), LoadError> {
        let stage = Stage::new(part, self.layers.len(), &self.model_type)?;
        self.layers = stage.keep(std::mem::take(&mut self.layers));
        self.stage = Some(stage);
        Ok(())
    }
}

/// Segmented training: the blocks a few at a time, without caches (the masks as
/// `model(inputs)` makes them with no cache, windowed ones included).
impl Layered for Decoder {
    fn num_blocks(&self) -> usize {
        self.layers.len()
    }

    fn embed_ids(&self, ids: &Array) -> R<Array> {
        self.scaled(self.embed(ids)?)
    }

    fn run_blocks(&self, h: &Array, range: Range<usize>) -> R<Array> {
        let mut caches: Vec<Box<dyn Cache>> = range
            .clone()
            .map(|_| Box::new(crate::cache::none::PassThrough) as Box<dyn Cache>)
            .collect();
        let masks = Masks::make(&self.layers[range.clone()], &caches, h.shape()[1])?;
        self.blocks(h.clone(), &masks, range, &mut caches)
    }

    fn head_logits(&self, h: &Array) -> R<Array> {
        self.head(h)
    }
}

/// Multi-head attention as a mixer (llama, qwen2/3, the MoE families).
impl Mixer for Attention {
    fn forward(&self, x: &Array, mask: &Mask, cache: &mut dyn Cache) -> R<Array> {
        Attention::forward(self, x, mask, kv_of(cache)?)
    }

    /// A standard KV cache; under dynamic NTK RoPE one whose offset stays an integer (the
    /// scaled base is computed from it).
    fn make_cache(&self) -> Box<dyn Cache> {
        kv_cache(&self.rope)
    }

    fn linears(&self) -> Vec<(&'static str, &Linear)> {
        self.named_linears().into()
    }

    fn shard(&mut self, part: Part, layer: &str) -> Result<(), LoadError> {
        Attention::shard(self, part, layer)
    }
}

/// The KV cache an attention with `rope` keeps.
pub fn kv_cache(rope: &rope::Rope) -> Box<dyn Cache> {
    match rope.needs_int_offset() {
        true => Box::new(rope::IntOffsetKv(KvCache::new())),
        false => Box::new(KvCache::new()),
    }
}

/// The gated MLP as a feed-forward.
impl FeedForward for Mlp {
    fn forward(&self, x: &Array) -> R<Array> {
        Mlp::forward(self, x)
    }

    fn linears(&self, module: &str) -> Vec<(String, &Linear)> {
        [
            ("gate_proj", &self.gate_proj),
            ("up_proj", &self.up_proj),
            ("down_proj", &self.down_proj),
        ]
        .map(|(n, l)| (format!("{module}.{n}"), l))
        .into()
    }

    fn shard(&mut self, part: Part, prefix: &str) -> Result<(), LoadError> {
        Mlp::shard(self, part, prefix)
    }
}
