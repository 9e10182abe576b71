//! optiq 0.7.7's Gemma 4 "-assistant" drafter (`optiq/runtime/spec/drafters/
//! gemma_assistant.py`), and the hooks it needs from its Gemma 4 target. The drafter has no
//! K/V of its own: each draft step reads the K/V of the target's last sliding and last full
//! layer that keep a cache, the target's scaled embedding of the token it continues from,
//! and a hidden state — the target's (after its final norm) for the first draft of a pass,
//! the drafter's own projected output for the next ones. Q-only attention, f32-upcast
//! RMSNorms, a tied head; the centroid head of the small E2B/E4B drafters is refused.

use std::path::Path;

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::ops::{concatenate, repeat_axis};
use mlx_rs::{fast, Array};
use serde_json::Value;

use super::Gemma4;
use crate::cache::{Cache, RopeOffset};
use crate::load::config::RopeScaling;
use crate::load::weights::Weights;
use crate::load::LoadError;
use crate::model::layers::{Embedding, Glu, Linear, Mlp, OutputHead, RmsNorm, Rope};

type R<T> = Result<T, Exception>;

/// What an assistant drafter needs from its target model.
pub trait AssistantTarget {
    /// The hidden state after the final norm, [1, L, H]; appends the ids to the caches.
    fn hidden(&self, ids: &Array, caches: &mut [Box<dyn Cache>]) -> R<Array>;
    /// Logits of a hidden state without the final softcap (optiq verifies with these).
    fn head_uncapped(&self, hidden: &Array) -> R<Array>;
    /// The scaled input embedding of ids [1, L] → [1, L, H].
    fn embed_scaled(&self, ids: &Array) -> R<Array>;
    /// Cache indices of the last sliding-window and the last full-attention layer that keep
    /// their own K/V (the drafter's donors).
    fn donor_caches(&self) -> R<(usize, usize)>;
}

impl AssistantTarget for Gemma4 {
    fn hidden(&self, ids: &Array, caches: &mut [Box<dyn Cache>]) -> R<Array> {
        Gemma4::hidden(self, ids, caches)
    }

    fn head_uncapped(&self, hidden: &Array) -> R<Array> {
        self.head.project(&self.embed, hidden)
    }

    fn embed_scaled(&self, ids: &Array) -> R<Array> {
        Gemma4::embed_scaled(self, ids)
    }

    fn donor_caches(&self) -> R<(usize, usize)> {
        let (mut sliding, mut full) = (None, None);
        let own = self
            .blocks
            .iter()
            .enumerate()
            .filter(|(i, b)| b.kv_source == *i);
        for (cache, (_, block)) in own.enumerate() {
            if block.full {
                full = Some(cache);
            } else {
                sliding = Some(cache);
            }
        }
        sliding.zip(full).ok_or_else(|| {
            Exception::custom("the assistant drafter needs a target with both sliding-window and full-attention layers")
        })
    }
}

/// The donors' K/V in temporal order (what one draft pass reads).
pub struct DonorKv {
    pub sliding: (Array, Array),
    pub full: (Array, Array),
}

/// One drafter layer: Q-only attention over the donor's K/V, then the gelu-tanh MLP.
struct Layer {
    full: bool,
    q_proj: Linear,
    o_proj: Linear,
    q_norm: RmsNorm,
    rope: Rope,
    mlp: Mlp,
    input_norm: RmsNorm,
    post_attn_norm: RmsNorm,
    pre_ffw_norm: RmsNorm,
    post_ffw_norm: RmsNorm,
    layer_scalar: Array,
}

pub struct AssistantDrafter {
    embed: Embedding,
    layers: Vec<Layer>,
    /// `model.norm` (f32-upcast) and the head: `lm_head`, or the embedding when tied.
    head: OutputHead,
    pre_projection: Linear,
    post_projection: Linear,
    n_heads: i32,
    n_kv_heads: i32,
}

fn int(v: &Value, key: &str) -> Result<i32, LoadError> {
    v[key]
        .as_i64()
        .map(|x| x as i32)
        .ok_or_else(|| LoadError::Unsupported(format!("assistant config: `{key}` is missing")))
}

impl AssistantDrafter {
    /// Whether `dir` holds an assistant drafter (a config with `backbone_hidden_size`).
    pub fn is_assistant(dir: &Path) -> bool {
        std::fs::read_to_string(dir.join("config.json"))
            .ok()
            .and_then(|s| serde_json::from_str::<Value>(&s).ok())
            .is_some_and(|c| !c["backbone_hidden_size"].is_null())
    }

    pub fn load(dir: &Path) -> Result<Self, LoadError> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path)
            .map_err(|e| LoadError::Unsupported(format!("{}: {e}", path.display())))?;
        let cfg: Value = serde_json::from_str(&text)
            .map_err(|e| LoadError::Unsupported(format!("{}: {e}", path.display())))?;
        let tc = if cfg["text_config"].is_object() {
            &cfg["text_config"]
        } else {
            &cfg
        };
        let uses_centroids = cfg["use_ordered_embeddings"].as_bool().unwrap_or(false)
            && cfg["num_centroids"].as_i64().unwrap_or(0) > 0;
        if uses_centroids {
            return Err(LoadError::Unsupported(
                "assistant drafters with the centroid output head (use_ordered_embeddings) are \
                 not supported yet; the plain-head ones are"
                    .into(),
            ));
        }
        let hidden = int(tc, "hidden_size")?;
        let backbone = int(&cfg, "backbone_hidden_size")?;
        let n_heads = int(tc, "num_attention_heads")?;
        let n_kv_heads = int(tc, "num_key_value_heads")?;
        let head_dim = int(tc, "head_dim")?;
        let global_head_dim = tc["global_head_dim"]
            .as_i64()
            .map_or(head_dim, |g| g as i32);
        let eps = tc["rms_norm_eps"].as_f64().unwrap_or(1e-6) as f32;
        let tied = cfg["tie_word_embeddings"]
            .as_bool()
            .or(tc["tie_word_embeddings"].as_bool())
            .unwrap_or(true);
        let types: Vec<String> = serde_json::from_value(tc["layer_types"].clone())
            .map_err(|e| LoadError::Unsupported(format!("assistant config: layer_types: {e}")))?;
        let theta = |kind: &str, default: f64| {
            tc["rope_parameters"][kind]["rope_theta"]
                .as_f64()
                .unwrap_or(default) as f32
        };
        let partial = tc["rope_parameters"]["full_attention"]["partial_rotary_factor"]
            .as_f64()
            .unwrap_or(1.0);
        let mut w = Weights::load(dir)?;
        let mut layers = Vec::new();
        for (i, kind) in types.iter().enumerate() {
            let p = format!("model.layers.{i}");
            let full = kind == "full_attention";
            let d = if full { global_head_dim } else { head_dim };
            let rope = if full {
                let s = RopeScaling {
                    rope_type: Some("proportional".into()),
                    partial_rotary_factor: Some(partial),
                    factor: Some(1.0),
                    ..Default::default()
                };
                Rope::new(d, theta("full_attention", 1e6), false, Some(&s))?
            } else {
                Rope::new(d, theta("sliding_attention", 1e4), false, None)?
            };
            let lin = |w: &mut Weights, name: &str, in_dims: i32| {
                Linear::load(w, &format!("{p}.{name}"), false, in_dims)
            };
            let norm =
                |w: &mut Weights, name: &str| RmsNorm::load_upcast(w, &format!("{p}.{name}"), eps);
            let inter = int(tc, "intermediate_size")?;
            layers.push(Layer {
                full,
                q_proj: lin(&mut w, "self_attn.q_proj", hidden)?,
                o_proj: lin(&mut w, "self_attn.o_proj", n_heads * d)?,
                q_norm: norm(&mut w, "self_attn.q_norm")?,
                rope,
                mlp: Mlp::load(
                    &mut w,
                    &format!("{p}.mlp"),
                    false,
                    hidden,
                    inter,
                    Glu::GeluApprox,
                )?,
                input_norm: norm(&mut w, "input_layernorm")?,
                post_attn_norm: norm(&mut w, "post_attention_layernorm")?,
                pre_ffw_norm: norm(&mut w, "pre_feedforward_layernorm")?,
                post_ffw_norm: norm(&mut w, "post_feedforward_layernorm")?,
                layer_scalar: w.take(&format!("{p}.layer_scalar"))?,
            });
        }
        let embed = Embedding::load(&mut w, "model.embed_tokens", hidden)?;
        let norm = RmsNorm::load_upcast(&mut w, "model.norm", eps)?;
        let pre_projection = Linear::load(&mut w, "pre_projection", false, 2 * backbone)?;
        let post_projection = Linear::load(&mut w, "post_projection", false, hidden)?;
        let head = OutputHead::load(&mut w, norm, tied, hidden, None)?;
        Ok(AssistantDrafter {
            embed,
            head,
            pre_projection,
            post_projection,
            layers,
            n_heads,
            n_kv_heads,
        })
    }

    /// One draft step at RoPE `position`: the logits [vocab] and the next step's hidden.
    pub fn forward(
        &self,
        token_emb: &Array,
        target_hidden: &Array,
        kv: &DonorKv,
        position: i32,
    ) -> R<(Array, Array)> {
        let x = concatenate(&[token_emb, target_hidden], -1)?;
        let mut h = self.pre_projection.forward(&x)?;
        let offset = RopeOffset::Int(position);
        let groups = self.n_heads / self.n_kv_heads;
        for layer in &self.layers {
            let (k, v) = if layer.full { &kv.full } else { &kv.sliding };
            let (k, v) = if groups > 1 {
                (
                    repeat_axis::<f32>(k.clone(), groups, 1)?,
                    repeat_axis::<f32>(v.clone(), groups, 1)?,
                )
            } else {
                (k.clone(), v.clone())
            };
            let residual = h.clone();
            let x = layer.input_norm.forward(&h)?;
            let (b, l) = (x.shape()[0], x.shape()[1]);
            let q = layer
                .q_proj
                .forward(&x)?
                .reshape(&[b, l, self.n_heads, -1])?;
            let q = layer.q_norm.forward(&q)?.transpose_axes(&[0, 2, 1, 3])?;
            let q = layer.rope.forward(&q, &offset)?;
            let out = fast::scaled_dot_product_attention(q, k, v, 1.0, None, None)?;
            let out = out.transpose_axes(&[0, 2, 1, 3])?.reshape(&[b, l, -1])?;
            let attn = layer.post_attn_norm.forward(&layer.o_proj.forward(&out)?)?;
            h = residual.add(&attn)?;
            let residual = h.clone();
            let mlp = layer.mlp.forward(&layer.pre_ffw_norm.forward(&h)?)?;
            let mlp = layer.post_ffw_norm.forward(&mlp)?;
            h = residual.add(&mlp)?.multiply(&layer.layer_scalar)?;
        }
        let h = self.head.norm.forward(&h)?;
        let logits = self.head.project(&self.embed, &h)?;
        let next = self.post_projection.forward(&h)?;
        Ok((logits.index((0, 0)), next))
    }
}
