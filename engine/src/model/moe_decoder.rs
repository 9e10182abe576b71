//! The decoder the mixture-of-experts families share (`qwen3_moe`, `mixtral`, `qwen2_moe`):
//!
//!   h = embed(ids)
//!   for each layer:  h = h + attn(rms_norm(h));  h = h + ffn(rms_norm(h))
//!   logits = head(rms_norm(h))
//!
//! where a layer's ffn is a dense MLP, the sparse block, or the sparse block with a shared
//! expert. Each family reads its own config and builds its layers' attention and ffn; the
//! rest — norms, embedding, head, caches, the forward — is here once.

use mlx_rs::error::Exception;
use mlx_rs::Array;

use super::layers::{Attention, Embedding, Linear, Mlp, OutputHead, RmsNorm, Rope};
use super::moe::{SparseMoe, SwitchLinear};
use super::pipeline::{self, Stage};
use super::{LanguageModel, Layered};
use crate::cache::{Cache, KvCache, Mask};
use crate::load::config::ModelConfig;
use crate::load::weights::Weights;
use crate::load::LoadError;

/// The sparse block plus a shared expert behind a sigmoid gate (`Qwen2MoeSparseMoeBlock`).
pub struct SharedMoe {
    pub moe: SparseMoe,
    pub shared: Mlp,
    pub shared_gate: Linear,
}

impl SharedMoe {
    fn forward(&self, x: &Array) -> Result<Array, Exception> {
        let (inds, scores) = self.moe.router.route(x)?;
        let y = self.moe.experts.forward(x, &inds)?;
        let y = y.multiply(scores.expand_dims(-1)?)?.sum_axis(-2, false)?;
        let shared = self.shared.forward(x)?;
        let shared = mlx_rs::ops::sigmoid(self.shared_gate.forward(x)?)?.multiply(&shared)?;
        y.add(&shared)
    }
}

/// A layer's feed-forward.
pub enum Ffn {
    Dense(Mlp),
    Sparse(SparseMoe),
    /// Boxed: it is twice the size of the others (one per layer, so the box costs nothing).
    Shared(Box<SharedMoe>),
}

impl Ffn {
    fn forward(&self, x: &Array) -> Result<Array, Exception> {
        match self {
            Ffn::Dense(mlp) => mlp.forward(x),
            Ffn::Sparse(moe) => moe.forward(x),
            Ffn::Shared(moe) => moe.forward(x),
        }
    }
}

struct Block {
    attn: Attention,
    ffn: Ffn,
    input_norm: RmsNorm,
    post_attn_norm: RmsNorm,
}

/// The model shape every MoE family's config gives.
pub struct Shape {
    pub layers: i32,
    pub hidden: i32,
    pub rms_norm_eps: f32,
    pub tie_word_embeddings: bool,
}

pub struct MoeDecoder {
    model_type: &'static str,
    embed: Embedding,
    blocks: Vec<Block>,
    head: OutputHead,
    /// Pipeline parallel: this rank's stage (`blocks` then holds only its layers).
    stage: Option<Stage>,
}

/// The attention of the MoE families: Llama's, plain `nn.RoPE` (no scaling: mlx-lm's MoE
/// modules never apply it), q/k/v biases for qwen2_moe, per-head q/k RMSNorm for qwen3_moe.
pub struct AttnShape {
    pub hidden: i32,
    pub heads: i32,
    pub kv_heads: i32,
    pub head_dim: i32,
    pub qkv_bias: bool,
    /// The q/k RMSNorms' eps, where the family has them.
    pub qk_norm_eps: Option<f32>,
    pub rope_traditional: bool,
    pub rope_base: f32,
}

pub fn load_attention(w: &mut Weights, p: &str, a: &AttnShape) -> Result<Attention, LoadError> {
    let proj = |w: &mut Weights, name: &str, bias: bool, in_dims: i32| {
        Linear::load(w, &format!("{p}.self_attn.{name}"), bias, in_dims)
    };
    let norm = |w: &mut Weights, name: &str| {
        a.qk_norm_eps
            .map(|eps| RmsNorm::load(w, &format!("{p}.self_attn.{name}"), eps))
            .transpose()
    };
    Ok(Attention {
        q_proj: proj(w, "q_proj", a.qkv_bias, a.hidden)?,
        k_proj: proj(w, "k_proj", a.qkv_bias, a.hidden)?,
        v_proj: proj(w, "v_proj", a.qkv_bias, a.hidden)?,
        o_proj: proj(w, "o_proj", false, a.heads * a.head_dim)?,
        q_norm: norm(w, "q_norm")?,
        k_norm: norm(w, "k_norm")?,
        n_heads: a.heads,
        n_kv_heads: a.kv_heads,
        scale: (a.head_dim as f32).powf(-0.5),
        norm_after_transpose: false,
        rope: Rope::Standard {
            dims: a.head_dim,
            traditional: a.rope_traditional,
            base: a.rope_base,
            scale: 1.0,
        },
    })
}

/// `num_experts_per_tok` must pick at least one and at most every expert (`field` names
/// the family's expert count).
pub fn check_top_k(
    model_type: &str,
    top_k: i32,
    experts: i32,
    field: &str,
) -> Result<(), LoadError> {
    if top_k <= 0 || top_k > experts {
        return Err(LoadError::Unsupported(format!(
            "{model_type}: num_experts_per_tok {top_k} must be in 1..={experts} ({field})"
        )));
    }
    Ok(())
}

impl MoeDecoder {
    /// Loads the decoder: layer `i` (prefix `model.layers.{i}`) gets the attention and ffn
    /// that `layer` builds, then its two norms; then the embedding, final norm and head.
    /// A tied checkpoint's `lm_head` is dropped (mlx-lm's sanitize) and every other tensor
    /// must be used.
    pub fn load(
        model_type: &'static str,
        config: &ModelConfig,
        mut w: Weights,
        shape: Shape,
        mut layer: impl FnMut(&mut Weights, &str, i32) -> Result<(Attention, Ffn), LoadError>,
    ) -> Result<Self, LoadError> {
        if shape.tie_word_embeddings {
            w.discard(|n| n == "lm_head.weight");
        }
        w.set_quantization(config.quantization.clone());
        let mut blocks = Vec::new();
        for i in 0..shape.layers {
            let p = format!("model.layers.{i}");
            let (attn, ffn) = layer(&mut w, &p, i)?;
            let norm = |w: &mut Weights, n: &str| {
                RmsNorm::load(w, &format!("{p}.{n}"), shape.rms_norm_eps)
            };
            blocks.push(Block {
                attn,
                ffn,
                input_norm: norm(&mut w, "input_layernorm")?,
                post_attn_norm: norm(&mut w, "post_attention_layernorm")?,
            });
        }
        let embed = Embedding::load(&mut w, "model.embed_tokens", shape.hidden)?;
        let norm = RmsNorm::load(&mut w, "model.norm", shape.rms_norm_eps)?;
        let head = OutputHead::load(&mut w, norm, shape.tie_word_embeddings, shape.hidden, None)?;
        w.ensure_consumed(&config.model_type, |_| false)?;
        Ok(MoeDecoder {
            model_type,
            embed,
            blocks,
            head,
            stage: None,
        })
    }
}

impl Ffn {
    /// Its linears under mlx-lm's names within the block (`ffn` is the module's name):
    /// the dense MLP's three; the router `gate`; a shared expert's three and its gate.
    fn named_linears(&self, ffn: &str) -> Vec<(String, &Linear)> {
        fn mlp(prefix: String, m: &Mlp) -> [(String, &Linear); 3] {
            [
                ("gate_proj", &m.gate_proj),
                ("up_proj", &m.up_proj),
                ("down_proj", &m.down_proj),
            ]
            .map(|(n, l)| (format!("{prefix}.{n}"), l))
        }
        match self {
            Ffn::Dense(m) => mlp(ffn.to_owned(), m).into(),
            Ffn::Sparse(moe) => vec![(format!("{ffn}.gate"), &moe.router.gate)],
            Ffn::Shared(s) => std::iter::once((format!("{ffn}.gate"), &s.moe.router.gate))
                .chain(mlp(format!("{ffn}.shared_expert"), &s.shared))
                .chain([(format!("{ffn}.shared_expert_gate"), &s.shared_gate)])
                .collect(),
        }
    }

    /// Its stacked experts (`<ffn>.switch_mlp.{gate,up,down}_proj`), none for a dense MLP.
    fn named_switches(&self, ffn: &str) -> Vec<(String, &SwitchLinear)> {
        let experts = match self {
            Ffn::Dense(_) => return Vec::new(),
            Ffn::Sparse(moe) => &moe.experts,
            Ffn::Shared(s) => &s.moe.experts,
        };
        [
            ("gate_proj", &experts.gate_proj),
            ("up_proj", &experts.up_proj),
            ("down_proj", &experts.down_proj),
        ]
        .map(|(n, l)| (format!("{ffn}.switch_mlp.{n}"), l))
        .into()
    }
}

impl MoeDecoder {
    /// The feed-forward module's name in mlx-lm: Mixtral's `block_sparse_moe`, else `mlp`.
    fn ffn_name(&self) -> &'static str {
        match self.model_type {
            "mixtral" => "block_sparse_moe",
            _ => "mlp",
        }
    }
}

impl LanguageModel for MoeDecoder {
    fn model_type(&self) -> &str {
        self.model_type
    }

    fn linears(&self) -> Vec<(String, &Linear)> {
        let ffn = self.ffn_name();
        let mut all = Vec::new();
        for (i, b) in self.blocks.iter().enumerate() {
            let attn = b.attn.named_linears().map(|(n, l)| (n.to_owned(), l));
            for (n, l) in attn.into_iter().chain(b.ffn.named_linears(ffn)) {
                all.push((format!("model.layers.{i}.{n}"), l));
            }
        }
        pipeline::checkpoint_names(self.stage.as_ref(), all)
    }

    fn switch_linears(&self) -> Vec<(String, &SwitchLinear)> {
        let ffn = self.ffn_name();
        let mut all = Vec::new();
        for (i, b) in self.blocks.iter().enumerate() {
            for (n, l) in b.ffn.named_switches(ffn) {
                all.push((format!("model.layers.{i}.{n}"), l));
            }
        }
        pipeline::checkpoint_names(self.stage.as_ref(), all)
    }

    fn activation_dtype(&self) -> mlx_rs::Dtype {
        self.embed.output_dtype()
    }

    fn vocab_size(&self) -> usize {
        self.head.width(&self.embed)
    }

    /// One per local layer (a pipeline stage's in its stage wrapper).
    fn make_caches(&self) -> Vec<Box<dyn Cache>> {
        let caches = self
            .blocks
            .iter()
            .map(|_| Box::new(KvCache::new()) as Box<dyn Cache>)
            .collect();
        pipeline::local_caches(self.stage.as_ref(), caches)
    }

    fn forward(&self, ids: &Array, caches: &mut [Box<dyn Cache>]) -> Result<Array, Exception> {
        let h = self.embed.forward(ids)?;
        let mask = caches[0].make_mask(ids.shape()[1], None)?;
        let h = pipeline::run(self.stage.as_ref(), h, caches, |h, caches| {
            self.blocks_with(h, &mask, self.blocks.iter().zip(caches.iter_mut()))
        })?;
        self.head.forward(&self.embed, &h)
    }

    /// None on a pipeline stage: its blocks are only part of the model.
    fn as_layered(&self) -> Option<&dyn Layered> {
        match self.stage {
            Some(_) => None,
            None => Some(self),
        }
    }

    /// `Qwen3MoeModel.pipeline`: this rank keeps its stage's layers. mlx-lm 0.32.2
    /// pipelines no other MoE family.
    fn pipeline(&mut self, part: super::shard::Part) -> Result<(), LoadError> {
        let stage = pipeline::stage_for(self.model_type, &["qwen3_moe"], part, self.blocks.len())?;
        self.blocks = stage.keep(std::mem::take(&mut self.blocks));
        self.stage = Some(stage);
        Ok(())
    }

    /// Tensor parallel as `qwen3_moe.Model.shard`: attention and dense MLPs as Llama's; a
    /// sparse block keeps its router whole and every expert narrowed (`moe/shard.rs`), and
    /// sums its combined output over the ranks. mlx-lm shards no other MoE family.
    fn shard(&mut self, part: super::shard::Part) -> Result<(), LoadError> {
        if self.model_type != "qwen3_moe" {
            return Err(super::shard::unsupported(
                self.model_type,
                crate::dist::Mode::Tensor,
            ));
        }
        let ffn = self.ffn_name();
        for (i, b) in self.blocks.iter_mut().enumerate() {
            let p = format!("model.layers.{i}");
            b.attn.shard(part, &p)?;
            match &mut b.ffn {
                Ffn::Dense(mlp) => mlp.shard(part, &format!("{p}.{ffn}"))?,
                Ffn::Sparse(moe) => moe.experts.shard(part, &format!("{p}.{ffn}.switch_mlp"))?,
                Ffn::Shared(_) => {
                    return Err(super::shard::unsupported(
                        self.model_type,
                        crate::dist::Mode::Tensor,
                    ))
                }
            }
        }
        Ok(())
    }
}

impl MoeDecoder {
    /// The pre-norm residual blocks over `h`, each with its cache.
    fn blocks_with<'c>(
        &self,
        mut h: Array,
        mask: &Mask,
        blocks: impl Iterator<Item = (&'c Block, &'c mut Box<dyn Cache>)>,
    ) -> Result<Array, Exception>
    where
        Self: 'c,
    {
        for (block, cache) in blocks {
            let x = block.input_norm.forward(&h)?;
            let r = block.attn.forward(&x, mask, cache.as_mut())?;
            let hh = h.add(&r)?;
            let r = block.ffn.forward(&block.post_attn_norm.forward(&hh)?)?;
            h = hh.add(&r)?;
        }
        Ok(h)
    }
}

/// Segmented training: the blocks a few at a time, without caches.
impl Layered for MoeDecoder {
    fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    fn embed_ids(&self, ids: &Array) -> Result<Array, Exception> {
        self.embed.forward(ids)
    }

    fn run_blocks(&self, h: &Array, range: std::ops::Range<usize>) -> Result<Array, Exception> {
        let mut caches: Vec<Box<dyn Cache>> = range
            .clone()
            .map(|_| Box::new(crate::cache::none::PassThrough) as Box<dyn Cache>)
            .collect();
        let mask = caches[0].make_mask(h.shape()[1], None)?;
        let blocks = self.blocks[range].iter().zip(caches.iter_mut());
        self.blocks_with(h.clone(), &mask, blocks)
    }

    fn head_logits(&self, h: &Array) -> Result<Array, Exception> {
        self.head.forward(&self.embed, h)
    }
}
