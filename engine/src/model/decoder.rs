//! The decoder the pre-norm families share, as mlx-lm 0.32.2's `LlamaModel`,
//! `Qwen3MoeModel`, `MixtralModel`, `Qwen2MoeModel` and `Phi3Model` compute it:
//!
//!   h = embed(ids)                          (or input embeddings: `forward_embeddings`)
//!   for each layer:  h = h + mixer(norm_in(h));  h = h + ffn(norm_post(h))
//!   logits = head(norm(h))                  (head = embedding.T when tied)
//!
//! A family file reads its config and builds each layer's mixer (an attention variant; open
//! to the recurrent mixers) and feed-forward (a gated MLP, a mixture of experts, experts with
//! a shared one); everything else — the loop, the mask, the caches, LoRA's targets,
//! segmented training (`Layered`), tensor-parallel sharding and pipeline stages — is here,
//! once. Which families may shard or pipeline is the registry's to say (`registry.rs`);
//! `model::load` refuses the others before a layer is touched.

use std::ops::Range;

use mlx_rs::error::Exception;
use mlx_rs::Array;

use super::layers::{Attention, Embedding, Linear, Mlp, OutputHead, RmsNorm};
use super::moe::SwitchLinear;
use super::pipeline::{self, Stage};
use super::rope;
use super::shard::Part;
use super::{LanguageModel, Layered};
use crate::cache::{Cache, KvCache, Mask};
use crate::load::config::ModelConfig;
use crate::load::weights::Weights;
use crate::load::LoadError;

type R<T> = Result<T, Exception>;

/// A layer's token mixer: reads the normed hidden state, keeps its state in its cache.
pub trait Mixer {
    fn forward(&self, x: &Array, mask: &Mask, cache: &mut dyn Cache) -> R<Array>;
    /// A fresh cache of the kind this mixer keeps.
    fn make_cache(&self) -> Box<dyn Cache>;
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
    /// Its stacks of experts named `<module>.switch_mlp.…` (none for a dense MLP).
    fn switches(&self, _module: &str) -> Vec<(String, &SwitchLinear)> {
        Vec::new()
    }
    /// Keeps this rank's part; `prefix` is the module's checkpoint path.
    fn shard(&mut self, part: Part, prefix: &str) -> Result<(), LoadError>;
}

/// One block: `h + mixer(norm_in(h))`, then `+ ffn(norm_post(·))`.
pub struct Layer {
    pub norm_in: RmsNorm,
    pub mixer: Box<dyn Mixer>,
    pub norm_post: RmsNorm,
    pub ffn: Box<dyn FeedForward>,
}

impl Layer {
    fn forward(&self, h: Array, mask: &Mask, cache: &mut dyn Cache) -> R<Array> {
        let r = self
            .mixer
            .forward(&self.norm_in.forward(&h)?, mask, cache)?;
        let h = h.add(&r)?;
        let r = self.ffn.forward(&self.norm_post.forward(&h)?)?;
        h.add(&r)
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

pub struct Decoder {
    model_type: String,
    ffn_module: &'static str,
    embed: Embedding,
    layers: Vec<Layer>,
    head: OutputHead,
    /// Pipeline parallel: this rank's stage (`layers` then holds only its layers).
    stage: Option<Stage>,
}

impl Decoder {
    /// Loads the decoder: layer `i` (prefix `model.layers.{i}`) gets the mixer and ffn that
    /// `layer` builds, then its norms `input_layernorm` and `post_attention_layernorm`; then
    /// the embedding, the final norm and the head. The family has sanitized `w` (mlx-lm's
    /// `sanitize`); every tensor left must be used.
    pub fn load(
        config: &ModelConfig,
        mut w: Weights,
        dims: Dims,
        mut layer: impl FnMut(
            &mut Weights,
            &str,
            i32,
        ) -> Result<(Box<dyn Mixer>, Box<dyn FeedForward>), LoadError>,
    ) -> Result<Self, LoadError> {
        w.set_quantization(config.quantization.clone());
        let norm = |w: &mut Weights, name: &str| RmsNorm::load(w, name, dims.rms_norm_eps);
        let mut layers = Vec::new();
        for i in 0..dims.layers {
            let p = format!("model.layers.{i}");
            let (mixer, ffn) = layer(&mut w, &p, i)?;
            layers.push(Layer {
                mixer,
                ffn,
                norm_in: norm(&mut w, &format!("{p}.input_layernorm"))?,
                norm_post: norm(&mut w, &format!("{p}.post_attention_layernorm"))?,
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
            layers,
            head,
            stage: None,
        })
    }

    /// ids [B, L] → the first hidden state.
    pub fn embed(&self, ids: &Array) -> R<Array> {
        self.embed.forward(ids)
    }

    /// The local layers `range` over `h`, each with its cache (`caches[k]` for the k-th).
    pub fn blocks(
        &self,
        mut h: Array,
        mask: &Mask,
        range: Range<usize>,
        caches: &mut [Box<dyn Cache>],
    ) -> R<Array> {
        for (layer, cache) in self.layers[range].iter().zip(caches.iter_mut()) {
            h = layer.forward(h, mask, cache.as_mut())?;
        }
        Ok(h)
    }

    /// Final norm and output head → logits.
    pub fn head(&self, h: &Array) -> R<Array> {
        self.head.forward(&self.embed, h)
    }

    /// The forward from input embeddings [B, L, H]: one mask for every layer, from the
    /// first cache (as mlx-lm makes it), the local layers (through this rank's stage when
    /// pipelined), then the head.
    pub fn forward_embeddings(&self, h: Array, caches: &mut [Box<dyn Cache>]) -> R<Array> {
        let mask = caches[0].make_mask(h.shape()[1], None)?;
        let all = 0..self.layers.len();
        let h = pipeline::run(self.stage.as_ref(), h, caches, |h, caches| {
            self.blocks(h, &mask, all, caches)
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

    /// None on a pipeline stage: its blocks are only part of the model.
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

/// Segmented training: the blocks a few at a time, without caches.
impl Layered for Decoder {
    fn num_blocks(&self) -> usize {
        self.layers.len()
    }

    fn embed_ids(&self, ids: &Array) -> R<Array> {
        self.embed(ids)
    }

    fn run_blocks(&self, h: &Array, range: Range<usize>) -> R<Array> {
        let mut caches: Vec<Box<dyn Cache>> = range
            .clone()
            .map(|_| Box::new(crate::cache::none::PassThrough) as Box<dyn Cache>)
            .collect();
        let mask = caches[0].make_mask(h.shape()[1], None)?;
        self.blocks(h.clone(), &mask, range, &mut caches)
    }

    fn head_logits(&self, h: &Array) -> R<Array> {
        self.head(h)
    }
}

/// Multi-head attention as a mixer (llama, qwen2/3, the MoE families).
impl Mixer for Attention {
    fn forward(&self, x: &Array, mask: &Mask, cache: &mut dyn Cache) -> R<Array> {
        Attention::forward(self, x, mask, cache)
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
