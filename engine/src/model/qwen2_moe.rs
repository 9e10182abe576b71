//! `qwen2_moe` as mlx-lm 0.32.2 implements it (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's
//! attention (q/k/v biases, head_dim = hidden / heads, plain `nn.RoPE` from rope_theta) and
//! in every layer the sparse block (`moe.rs`, softmax then the top k) plus a shared expert:
//!
//!   h = embed(ids)
//!   for each layer:  h = h + attn(rms_norm(h))
//!                    x = rms_norm(h);  h = h + moe(x) + sigmoid(shared_gate(x)) · shared(x)
//!   logits = head(rms_norm(h))

use mlx_rs::error::Exception;
use mlx_rs::Array;
use serde::Deserialize;

use super::layers::{Attention, Embedding, Glu, Linear, Mlp, OutputHead, RmsNorm, Rope};
use super::moe::{Gate, Router, SparseMoe, SwitchGlu, EXPERT_NAMES};
use super::LanguageModel;
use crate::cache::{Cache, KvCache};
use crate::load::config::ModelConfig;
use crate::load::weights::Weights;
use crate::load::LoadError;

/// mlx-lm's `qwen2_moe.ModelArgs`, defaults included.
#[derive(Debug, Clone, Deserialize)]
pub struct Qwen2MoeArgs {
    pub hidden_size: i32,
    pub num_hidden_layers: i32,
    pub intermediate_size: i32,
    pub num_attention_heads: i32,
    pub num_experts_per_tok: i32,
    pub num_experts: i32,
    pub moe_intermediate_size: i32,
    pub shared_expert_intermediate_size: i32,
    pub rms_norm_eps: f32,
    pub vocab_size: i32,
    pub num_key_value_heads: Option<i32>,
    #[serde(default = "theta")]
    pub rope_theta: f32,
    #[serde(default)]
    pub rope_traditional: bool,
    pub rope_scaling: Option<serde_json::Value>,
    #[serde(default)]
    pub tie_word_embeddings: bool,
}

fn theta() -> f32 {
    1_000_000.0
}

/// The MoE block with its shared expert (`Qwen2MoeSparseMoeBlock`).
struct SharedMoe {
    moe: SparseMoe,
    shared: Mlp,
    shared_gate: Linear,
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

struct Block {
    attn: Attention,
    mlp: SharedMoe,
    input_norm: RmsNorm,
    post_attn_norm: RmsNorm,
}

pub struct Qwen2Moe {
    embed: Embedding,
    blocks: Vec<Block>,
    head: OutputHead,
}

fn load_attention(w: &mut Weights, p: &str, a: &Qwen2MoeArgs) -> Result<Attention, LoadError> {
    let head_dim = a.hidden_size / a.num_attention_heads;
    let proj = |w: &mut Weights, name: &str, bias: bool, in_dims: i32| {
        Linear::load(w, &format!("{p}.self_attn.{name}"), bias, in_dims)
    };
    Ok(Attention {
        q_proj: proj(w, "q_proj", true, a.hidden_size)?,
        k_proj: proj(w, "k_proj", true, a.hidden_size)?,
        v_proj: proj(w, "v_proj", true, a.hidden_size)?,
        o_proj: proj(w, "o_proj", false, a.num_attention_heads * head_dim)?,
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

fn load_mlp(w: &mut Weights, p: &str, a: &Qwen2MoeArgs) -> Result<SharedMoe, LoadError> {
    let mlp = format!("{p}.mlp");
    let moe = SparseMoe {
        router: Gate {
            gate: Linear::load(w, &format!("{mlp}.gate"), false, a.hidden_size)?,
            top_k: a.num_experts_per_tok,
            kind: Router::SoftmaxLowTopK,
        },
        experts: SwitchGlu::load(
            w,
            &mlp,
            (a.hidden_size, a.moe_intermediate_size),
            a.num_experts,
            EXPERT_NAMES,
        )?,
    };
    let shared = Mlp::load(
        w,
        &format!("{mlp}.shared_expert"),
        false,
        a.hidden_size,
        a.shared_expert_intermediate_size,
        Glu::Swiglu,
    )?;
    let shared_gate = Linear::load(
        w,
        &format!("{mlp}.shared_expert_gate"),
        false,
        a.hidden_size,
    )?;
    Ok(SharedMoe {
        moe,
        shared,
        shared_gate,
    })
}

impl Qwen2Moe {
    pub fn load(config: &ModelConfig, mut w: Weights) -> Result<Self, LoadError> {
        let a: Qwen2MoeArgs = config.parse()?;
        if a.rope_scaling.as_ref().is_some_and(|v| !v.is_null()) {
            return Err(LoadError::Unsupported(
                "qwen2_moe with rope_scaling: mlx-lm's qwen2_moe accepts only `linear` and then \
                 applies no scaling (plain RoPE from rope_theta), so it is refused rather than \
                 run unscaled"
                    .into(),
            ));
        }
        if a.num_experts_per_tok <= 0 || a.num_experts_per_tok > a.num_experts {
            return Err(LoadError::Unsupported(format!(
                "qwen2_moe: num_experts_per_tok {} must be in 1..={} (num_experts)",
                a.num_experts_per_tok, a.num_experts
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
                mlp: load_mlp(&mut w, &p, &a)?,
                input_norm: norm(&mut w, "input_layernorm")?,
                post_attn_norm: norm(&mut w, "post_attention_layernorm")?,
            });
        }
        let embed = Embedding::load(&mut w, "model.embed_tokens", a.hidden_size)?;
        let norm = RmsNorm::load(&mut w, "model.norm", a.rms_norm_eps)?;
        let head = OutputHead::load(&mut w, norm, a.tie_word_embeddings, a.hidden_size, None)?;
        w.ensure_consumed(&config.model_type, |_| false)?;
        Ok(Qwen2Moe {
            embed,
            blocks,
            head,
        })
    }
}

impl LanguageModel for Qwen2Moe {
    fn model_type(&self) -> &str {
        "qwen2_moe"
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
            let r = block.mlp.forward(&block.post_attn_norm.forward(&hh)?)?;
            h = hh.add(&r)?;
        }
        self.head.forward(&self.embed, &h)
    }
}
