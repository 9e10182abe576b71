//! Qwen3.5 with images: the vision tower ([`super::qwen_vit`], Qwen3-VL's class without
//! deepstack) and the hybrid language model's image path, as mlx-vlm 0.7.10 computes them
//! (mlx_vlm/models/qwen3_5/qwen3_5.py `Model.get_input_embeddings` / `sanitize`, language.py
//! `LanguageModel`, `Qwen3_5Model`, `Qwen3_5DecoderLayer`, `Qwen3_5Attention`,
//! `Qwen3_5GatedDeltaNet`; gated_delta.py `gated_delta_update`).
//!
//! The prompt (ids with each image's `<|vision_start|>` and its run of image tokens):
//!
//! - embeddings: `embed(ids)`, the tower's merged features copied in at the image tokens in
//!   order (`masked_scatter`); no deepstack;
//! - positions and rope delta: Qwen3-VL's `get_rope_index` ([`super::qwen_lm`]);
//!   cos / sin once for all attention layers (`MRoPERotaryEmbedding.__call__`, interleaved,
//!   over the first `head_dim · partial_rotary_factor` dims: `inv_freq` of that width);
//! - layers by `full_attention_interval` (layer i attends when (i + 1) % interval = 0, else a
//!   gated delta net), each `h += mixer(input_layernorm(h))`, `h += mlp(post_norm(h))`;
//! - attention: q and its output gate from one projection (per head [q; gate]), q / k
//!   RMSNorm'd per head, rotated by `x·cos + rotate_half(x)·sin` on the rotated dims (the rest
//!   passes), causal SDPA over the cache, `o_proj(out · σ(gate))`;
//! - gated delta net: as the text model's ([`crate::model::gated_delta`]) but for two things
//!   mlx-vlm does its own way off Metal: a prompt of more than one token runs the recurrence
//!   as `gated_delta_chunked` (chunks of 64, [`super::qwen35_gdn`]), and q / k's eps is
//!   written `1e-6 / Dk`;
//! - decoding after the prompt (`language_model(y, cache)`): the position of the token at the
//!   attention cache's offset `o` is `o + delta`, one position for all three rows.
//!
//! Weights: mlx-vlm's `Model.sanitize`: `mtp.` tensors dropped; `model.language_model` →
//! `language_model.model`, `lm_head` → `language_model.lm_head` (dropped when tied); conv
//! kernels in Hugging Face's [C, 1, K] moved to [C, K, 1]; the (1 + w) RMSNorms (layer norms,
//! q / k norms, final norm) given their 1 when the checkpoint is in Hugging Face's layout
//! (`mtp.` tensors or [C, 1, K] kernels) or the tensor's name is not `language_model.…`.
//! The gate covers f32 and bf16 checkpoints (in half precision a decode step's delta-net
//! conv is mlx-vlm's f32 depthwise sum, [`super::qwen35_gdn`]).

use std::collections::HashMap;
use std::path::Path;

use mlx_rs::error::Exception;
use mlx_rs::ops::{self, sigmoid};
use mlx_rs::Array;
use serde::Deserialize;
use serde_json::Value;

use super::qwen35_gdn::delta_forward;
use super::qwen_lm::mrope::MRope;
use super::qwen_lm::{
    attend_rotated, load_checkpoint, queries, Block, QwenImageModel, QwenMixer, Step, TextConfig,
    LANGUAGE_MODEL,
};
use super::qwen_vit::QwenVitError;
use crate::cache::{ArraysCache, Cache, KvCache};
use crate::load::weights::Weights;
use crate::model::gated_delta::{GatedDeltaNet, GdnLayout, GdnShape};
use crate::model::layers::{weak, Attention, Linear, RmsNorm, Rope};
use crate::model::qwen3_5::OFFSET_NORMS;
use crate::plant::Defect;

type R<T> = Result<T, Exception>;

/// `text_config`'s Qwen3.5 fields (mlx-vlm's qwen3_5 `TextConfig`).
#[derive(Debug, Clone, Deserialize)]
struct Qwen35Text {
    num_key_value_heads: i32,
    #[serde(default)]
    head_dim: Option<i32>,
    linear_num_value_heads: i32,
    linear_num_key_heads: i32,
    linear_key_head_dim: i32,
    linear_value_head_dim: i32,
    linear_conv_kernel_dim: i32,
    #[serde(default = "four")]
    full_attention_interval: usize,
    #[serde(default)]
    attention_bias: bool,
    #[serde(default)]
    rope_parameters: Option<Value>,
}

fn four() -> usize {
    4
}

/// `sanitize_key`: a language-model tensor's name as mlx-vlm's `Model` holds it.
fn text_name(name: &str) -> String {
    if let Some(rest) = name.strip_prefix("model.language_model") {
        return format!("language_model.model{rest}");
    }
    if let Some(rest) = name.strip_prefix("lm_head") {
        return format!("language_model.lm_head{rest}");
    }
    name.to_owned()
}

/// `Model.sanitize` on the language model's tensors (see the module header).
fn sanitize(text: HashMap<String, Array>, tied: bool) -> R<Vec<(String, Array)>> {
    let text: HashMap<String, Array> = text
        .into_iter()
        .filter(|(n, _)| !n.contains("mtp."))
        .collect();
    let unsanitized_conv =
        |n: &str, a: &Array| n.contains("conv1d.weight") && a.shape().last() != Some(&1);
    let shift = text.iter().any(|(n, a)| unsanitized_conv(n, a));
    let mut out = Vec::with_capacity(text.len());
    for (original, mut a) in text {
        if tied && original == "lm_head.weight" {
            continue;
        }
        let name = text_name(&original);
        if unsanitized_conv(&name, &a) {
            a = ops::move_axis(&a, 2, 1)?;
        }
        let offset = shift || !original.starts_with("language_model.");
        if offset && a.ndim() == 1 && OFFSET_NORMS.iter().any(|s| name.ends_with(s)) {
            a = a.add(weak(1.0, &a)?)?;
        }
        out.push((name, a));
    }
    Ok(out)
}

/// A layer's mixer: a gated delta net, or attention with its output gate (q_proj gives q and
/// the gate per head, [q; gate]) rotated by precomputed M-RoPE cos / sin.
pub enum Mixer {
    Delta(Box<GatedDeltaNet>),
    Attention(Box<Attention>),
}

/// One layer's cache: a delta net's [conv state, recurrent state] or attention's K/V.
pub enum LayerCache {
    Delta(ArraysCache),
    Attention(KvCache),
}

/// A Qwen3.5 checkpoint with its image path: the tower and the language model as mlx-vlm
/// runs them; its layers gated delta nets, and gated attention every
/// `full_attention_interval` layers.
pub type Qwen35ImageModel = QwenImageModel<Mixer>;

impl Qwen35ImageModel {
    /// The checkpoint in `dir` (config.json with `vision_config` and `text_config`).
    pub fn load(dir: &Path) -> Result<Self, QwenVitError> {
        let (raw, vit, text) = load_checkpoint(dir)?;
        if !vit.config.deepstack_visual_indexes.is_empty() {
            return Err(QwenVitError::Config(
                "qwen3_5 has no deepstack (mlx-vlm refuses deepstack_visual_indexes for it): \
                 set it to []"
                    .into(),
            ));
        }
        let TextConfig {
            common: c,
            family: cfg,
        } = TextConfig::<Qwen35Text>::of(&raw)?;
        let rope = cfg.rope_parameters.clone().unwrap_or_else(|| {
            serde_json::json!({"mrope_section": [11, 11, 10], "rope_theta": 100000,
                               "partial_rotary_factor": 0.25})
        });
        let field = |k: &str| {
            rope.get(k).cloned().ok_or_else(|| {
                QwenVitError::Config(format!(
                    "text_config.rope_parameters has no `{k}` (mlx-vlm requires mrope_section, \
                     rope_theta and partial_rotary_factor)"
                ))
            })
        };
        let section: Vec<i32> = serde_json::from_value(field("mrope_section")?)
            .map_err(|e| QwenVitError::Config(format!("mrope_section: {e}")))?;
        let theta = field("rope_theta")?.as_f64().unwrap_or(100_000.0);
        let share = field("partial_rotary_factor")?.as_f64().unwrap_or(0.25);
        let tensors = sanitize(text, c.tie_word_embeddings)?;
        let mut w = Weights::from_tensors(tensors);
        let (d, eps) = (c.hidden_size, c.rms_norm_eps);
        let hd = cfg.head_dim.unwrap_or(d / c.num_attention_heads);
        let gdn = GdnShape {
            hidden: d,
            k_heads: cfg.linear_num_key_heads,
            v_heads: cfg.linear_num_value_heads,
            k_dim: cfg.linear_key_head_dim,
            v_dim: cfg.linear_value_head_dim,
            conv_kernel: cfg.linear_conv_kernel_dim,
            eps,
        };
        let interval = cfg.full_attention_interval.max(1);
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for i in 0..c.num_hidden_layers {
            let l = format!("{LANGUAGE_MODEL}.layers.{i}");
            let mixer = match (i + 1) % interval != 0 {
                true => Mixer::Delta(Box::new(GatedDeltaNet::load(
                    &mut w,
                    &format!("{l}.linear_attn"),
                    gdn,
                    GdnLayout::Split,
                )?)),
                false => {
                    let a = format!("{l}.self_attn");
                    let bias = cfg.attention_bias;
                    let lin = |w: &mut Weights, n: &str, s: [i32; 2]| {
                        Linear::load(w, &format!("{a}.{n}"), bias, s)
                    };
                    let (q_dims, kv_dims) =
                        (c.num_attention_heads * hd, cfg.num_key_value_heads * hd);
                    Mixer::Attention(Box::new(Attention {
                        q_proj: lin(&mut w, "q_proj", [2 * q_dims, d])?,
                        k_proj: lin(&mut w, "k_proj", [kv_dims, d])?,
                        v_proj: lin(&mut w, "v_proj", [kv_dims, d])?,
                        o_proj: lin(&mut w, "o_proj", [d, q_dims])?,
                        q_norm: Some(RmsNorm::load(&mut w, &format!("{a}.q_norm"), hd, eps)?),
                        k_norm: Some(RmsNorm::load(&mut w, &format!("{a}.k_norm"), hd, eps)?),
                        n_heads: c.num_attention_heads,
                        n_kv_heads: cfg.num_key_value_heads,
                        scale: (hd as f64).powf(-0.5) as f32,
                        // Rotated by the prompt's precomputed M-RoPE instead.
                        rope: Rope::None,
                        norm_after_transpose: false,
                    }))
                }
            };
            layers.push(Block::load(&mut w, &l, &c, mixer)?);
        }
        if !layers
            .iter()
            .any(|l| matches!(l.mixer, Mixer::Attention(_)))
        {
            return Err(QwenVitError::Config(format!(
                "{} layers with full_attention_interval {interval} leave no attention layer \
                 (mlx-vlm reads the rope offset from layer {}): check text_config",
                c.num_hidden_layers,
                interval - 1
            )));
        }
        // compute_inv_freq over the rotated dims only.
        let rope = MRope::new((hd as f64 * share) as i32, theta, &section)?;
        let what = "qwen3_5 language model";
        QwenImageModel::assemble((&raw, vit), w, (&c, rope), layers, hd, what)
    }
}

impl QwenMixer for Mixer {
    type Cache = LayerCache;
    const DELTA_DROPPED: Defect = Defect::Qwen35DeltaDropped;

    /// `ArraysCache(2)` for a delta net, `KVCache` for attention.
    fn make_cache(&self) -> LayerCache {
        match self {
            Mixer::Delta(_) => LayerCache::Delta(ArraysCache::new(2)),
            Mixer::Attention(_) => LayerCache::Attention(KvCache::new()),
        }
    }

    fn fresh(caches: &[LayerCache], layers: usize) -> bool {
        caches.len() == layers
            && caches.iter().all(|c| match c {
                LayerCache::Attention(kv) => kv.offset() == 0,
                LayerCache::Delta(a) => a.get(0).is_none() && a.get(1).is_none(),
            })
    }

    /// The first attention layer's cache offset (`cache[fa_idx].offset`).
    fn offset(caches: &[LayerCache]) -> i32 {
        caches
            .iter()
            .find_map(|c| match c {
                LayerCache::Attention(kv) => Some(kv.offset()),
                LayerCache::Delta(_) => None,
            })
            .unwrap_or(0)
    }

    fn forward(&self, x: &Array, step: &Step, cache: &mut LayerCache) -> R<Array> {
        match (self, cache) {
            (Mixer::Delta(net), LayerCache::Delta(c)) => delta_forward(net, x, c),
            // Attention with its output gate: `o_proj(out · σ(gate))`.
            (Mixer::Attention(attn), LayerCache::Attention(c)) => {
                let (b, l) = (x.shape()[0], x.shape()[1]);
                let qg = attn
                    .q_proj
                    .forward(x)?
                    .reshape(&[b, l, attn.n_heads, -1])?
                    .split_equal(2, -1)?;
                let gate = qg[1].reshape(&[b, l, -1])?;
                let q = queries(attn, &qg[0])?;
                let out = attend_rotated(attn, (x, q), step, c)?;
                attn.o_proj.forward(&out.multiply(sigmoid(&gate)?)?)
            }
            _ => Err(Exception::custom(
                "a layer's cache is not of its kind: make the caches with make_caches",
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_qwen3_5_sanitize_key() {
        assert_eq!(
            text_name("model.language_model.norm.weight"),
            "language_model.model.norm.weight"
        );
        assert_eq!(text_name("lm_head.weight"), "language_model.lm_head.weight");
        assert_eq!(
            text_name("language_model.model.norm.weight"),
            "language_model.model.norm.weight"
        );
    }
}
