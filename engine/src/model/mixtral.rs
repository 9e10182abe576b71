//! `mixtral` as mlx-lm 0.32.2 implements it: Llama's attention (no biases, head_dim =
//! hidden / heads, plain `nn.RoPE` from rope_theta) and in every layer the sparse block
//! `block_sparse_moe` (`moe.rs`) with Mixtral's router: the top k gate logits, then a
//! softmax over those k.
//!
//!   h = embed(ids)
//!   for each layer:  h = h + attn(rms_norm(h));  h = h + moe(rms_norm(h))
//!   logits = head(rms_norm(h))

use mlx_rs::error::Exception;
use mlx_rs::Array;
use serde::Deserialize;

use super::layers::{Attention, Embedding, Linear, OutputHead, RmsNorm, Rope};
use super::moe::{Gate, Router, SparseMoe, SwitchGlu, MIXTRAL_EXPERT_NAMES};
use super::LanguageModel;
use crate::cache::{Cache, KvCache};
use crate::load::config::ModelConfig;
use crate::load::weights::Weights;
use crate::load::LoadError;

/// mlx-lm's `mixtral.ModelArgs`, defaults included (Mixtral-8x7B's).
#[derive(Debug, Clone, Deserialize)]
pub struct MixtralArgs {
    #[serde(default = "vocab")]
    pub vocab_size: i32,
    #[serde(default = "hidden")]
    pub hidden_size: i32,
    #[serde(default = "intermediate")]
    pub intermediate_size: i32,
    #[serde(default = "layers")]
    pub num_hidden_layers: i32,
    #[serde(default = "heads")]
    pub num_attention_heads: i32,
    #[serde(default = "two")]
    pub num_experts_per_tok: i32,
    pub num_key_value_heads: Option<i32>,
    #[serde(default = "eight")]
    pub num_local_experts: i32,
    #[serde(default = "eps")]
    pub rms_norm_eps: f32,
    #[serde(default = "theta")]
    pub rope_theta: f32,
    #[serde(default)]
    pub rope_traditional: bool,
    pub rope_scaling: Option<serde_json::Value>,
    #[serde(default)]
    pub tie_word_embeddings: bool,
}

fn vocab() -> i32 {
    32000
}
fn hidden() -> i32 {
    4096
}
fn intermediate() -> i32 {
    14336
}
fn layers() -> i32 {
    32
}
fn heads() -> i32 {
    32
}
fn two() -> i32 {
    2
}
fn eight() -> i32 {
    8
}
fn eps() -> f32 {
    1e-5
}
fn theta() -> f32 {
    1e6
}

struct Block {
    attn: Attention,
    moe: SparseMoe,
    input_norm: RmsNorm,
    post_attn_norm: RmsNorm,
}

pub struct Mixtral {
    embed: Embedding,
    blocks: Vec<Block>,
    head: OutputHead,
}

fn load_attention(w: &mut Weights, p: &str, a: &MixtralArgs) -> Result<Attention, LoadError> {
    let head_dim = a.hidden_size / a.num_attention_heads;
    let proj = |w: &mut Weights, name: &str, in_dims: i32| {
        Linear::load(w, &format!("{p}.self_attn.{name}"), false, in_dims)
    };
    Ok(Attention {
        q_proj: proj(w, "q_proj", a.hidden_size)?,
        k_proj: proj(w, "k_proj", a.hidden_size)?,
        v_proj: proj(w, "v_proj", a.hidden_size)?,
        o_proj: proj(w, "o_proj", a.num_attention_heads * head_dim)?,
        q_norm: None,
        k_norm: None,
        n_heads: a.num_attention_heads,
        n_kv_heads: a.num_key_value_heads.unwrap_or(a.num_attention_heads),
        scale: (head_dim as f32).powf(-0.5),
        norm_after_transpose: false,
        rope: Rope::Standard {
            dims: head_dim,
            traditional: a.rope_traditional,
            base: a.rope_theta,
            scale: 1.0,
        },
    })
}

fn load_moe(w: &mut Weights, p: &str, a: &MixtralArgs) -> Result<SparseMoe, LoadError> {
    let mlp = format!("{p}.block_sparse_moe");
    Ok(SparseMoe {
        router: Gate {
            gate: Linear::load(w, &format!("{mlp}.gate"), false, a.hidden_size)?,
            top_k: a.num_experts_per_tok,
            kind: Router::TopKSoftmax,
        },
        experts: SwitchGlu::load(
            w,
            &mlp,
            (a.hidden_size, a.intermediate_size),
            a.num_local_experts,
            MIXTRAL_EXPERT_NAMES,
        )?,
    })
}

impl Mixtral {
    pub fn load(config: &ModelConfig, mut w: Weights) -> Result<Self, LoadError> {
        let a: MixtralArgs = config.parse()?;
        if a.rope_scaling.as_ref().is_some_and(|v| !v.is_null()) {
            return Err(LoadError::Unsupported(
                "mixtral with rope_scaling: mlx-lm's mixtral applies no RoPE scaling (plain \
                 RoPE from rope_theta), so it is refused rather than run unscaled"
                    .into(),
            ));
        }
        if a.num_experts_per_tok <= 0 || a.num_experts_per_tok > a.num_local_experts {
            return Err(LoadError::Unsupported(format!(
                "mixtral: num_experts_per_tok {} must be in 1..={} (num_local_experts)",
                a.num_experts_per_tok, a.num_local_experts
            )));
        }
        if a.tie_word_embeddings {
            w.discard(|n| n == "lm_head.weight");
        }
        w.set_quantization(config.quantization.clone());
        let mut blocks = Vec::new();
        for i in 0..a.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let norm =
                |w: &mut Weights, n: &str| RmsNorm::load(w, &format!("{p}.{n}"), a.rms_norm_eps);
            blocks.push(Block {
                attn: load_attention(&mut w, &p, &a)?,
                moe: load_moe(&mut w, &p, &a)?,
                input_norm: norm(&mut w, "input_layernorm")?,
                post_attn_norm: norm(&mut w, "post_attention_layernorm")?,
            });
        }
        let embed = Embedding::load(&mut w, "model.embed_tokens", a.hidden_size)?;
        let norm = RmsNorm::load(&mut w, "model.norm", a.rms_norm_eps)?;
        let head = OutputHead::load(&mut w, norm, a.tie_word_embeddings, a.hidden_size, None)?;
        w.ensure_consumed(&config.model_type, |_| false)?;
        Ok(Mixtral {
            embed,
            blocks,
            head,
        })
    }
}

impl LanguageModel for Mixtral {
    fn model_type(&self) -> &str {
        "mixtral"
    }

    fn activation_dtype(&self) -> mlx_rs::Dtype {
        self.embed.output_dtype()
    }

    fn vocab_size(&self) -> usize {
        self.head.width(&self.embed)
    }

    fn make_caches(&self) -> Vec<Box<dyn Cache>> {
        self.blocks
            .iter()
            .map(|_| Box::new(KvCache::new()) as Box<dyn Cache>)
            .collect()
    }

    fn forward(&self, ids: &Array, caches: &mut [Box<dyn Cache>]) -> Result<Array, Exception> {
        let mut h = self.embed.forward(ids)?;
        let mask = caches[0].make_mask(ids.shape()[1], None)?;
        for (block, cache) in self.blocks.iter().zip(caches.iter_mut()) {
            let x = block.input_norm.forward(&h)?;
            let r = block.attn.forward(&x, &mask, cache.as_mut())?;
            let hh = h.add(&r)?;
            let r = block.moe.forward(&block.post_attn_norm.forward(&hh)?)?;
            h = hh.add(&r)?;
        }
        self.head.forward(&self.embed, &h)
    }
}
