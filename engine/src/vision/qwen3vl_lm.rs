//! Qwen3-VL with images: the vision tower ([`super::qwen_vit`]) and the language model's
//! image path, as mlx-vlm 0.7.10 computes them (mlx_vlm/models/qwen3_vl/qwen3_vl.py
//! `Model.__call__` / `get_input_embeddings`, language.py `LanguageModel`, `Qwen3VLModel`,
//! `Attention`; rope_utils.py's interleaved M-RoPE).
//!
//! The prompt (ids with each image's `<|vision_start|>` and its run of image tokens):
//!
//! - embeddings: `embed(ids)`, the tower's merged features copied in at the image tokens in
//!   order (`masked_scatter`);
//! - positions (`get_rope_index`) and angles: M-RoPE over the whole head
//!   ([`super::qwen_lm`], shared with Qwen3.5);
//! - each layer as qwen3's (RMSNorm'd q/k per head) but rotated by
//!   `x·cos + rotate_half(x)·sin` (mlx-vlm's compiled `_apply_interleaved_rotary_pos_emb_axis1`),
//!   causal SDPA over the cache; after layer `i < len(deepstack)`, deepstack feature `i` added
//!   at the image tokens (`h.at[idx].add`);
//! - decoding after the prompt (mlx-vlm's decode loop: `language_model(y, cache)`): the
//!   position of the token at cache offset `o` is `o + delta` in all three rows; no deepstack.
//!
//! Weights: mlx-vlm's `Model.sanitize` (`model.language_model` → `language_model.model`,
//! `lm_head` → `language_model.lm_head`), so Hugging Face and mlx-community layouts load.
//! Qwen3.5 shares the tower and the language model's ends ([`super::qwen_lm`]), not these layers
//! (its text model is the hybrid one).

use std::path::Path;

use mlx_rs::error::Exception;
use mlx_rs::Array;
use serde::Deserialize;
use serde_json::Value;

use super::qwen_lm::mrope::MRope;
use super::qwen_lm::{
    attend_rotated, load_checkpoint, queries, Block, QwenImageModel, QwenMixer, Step, TextConfig,
    LANGUAGE_MODEL,
};
pub use super::qwen_lm::{generate_chunks, patches_of, rope_index, Prefill, VisionIds};
use super::qwen_vit::QwenVitError;
use crate::cache::{Cache, KvCache};
use crate::load::weights::Weights;
use crate::model::layers::{Attention, RmsNorm};
use crate::plant::Defect;

/// `text_config`'s Qwen3-VL fields (mlx-vlm's `TextConfig`).
#[derive(Debug, Clone, Deserialize)]
struct Qwen3VlText {
    num_key_value_heads: Option<i32>,
    head_dim: i32,
    rope_theta: f64,
    #[serde(default)]
    rope_scaling: Option<Value>,
}

/// A Qwen3-VL checkpoint with its image path: the tower and the language model as mlx-vlm
/// runs them; each layer's mixer qwen3's attention (RMSNorm'd q / k per head) rotated by
/// M-RoPE, deepstack added after the first layers.
pub type Qwen3VlImageModel = QwenImageModel<Attention>;

/// mlx-vlm's `Model.sanitize` for a language-model name: `model.language_model` →
/// `language_model.model`, a bare `lm_head` → `language_model.lm_head`.
fn text_name(name: &str) -> String {
    if name.contains("model") {
        if name.contains("model.language_model") {
            return name.replace("model.language_model", "language_model.model");
        }
        return name.to_owned();
    }
    if name.contains("lm_head") {
        return name.replace("lm_head", "language_model.lm_head");
    }
    name.to_owned()
}

impl Qwen3VlImageModel {
    /// The checkpoint in `dir` (config.json with `vision_config` and `text_config`).
    pub fn load(dir: &Path) -> Result<Self, QwenVitError> {
        let (raw, vit, text) = load_checkpoint(dir)?;
        let TextConfig {
            common: c,
            family: cfg,
        } = TextConfig::<Qwen3VlText>::of(&raw)?;
        let section: Vec<i32> = cfg
            .rope_scaling
            .as_ref()
            .and_then(|r| r.get("mrope_section"))
            .and_then(|s| serde_json::from_value(s.clone()).ok())
            .unwrap_or_else(|| vec![24, 20, 20]);
        let mut w = Weights::from_tensors(text.into_iter().map(|(n, a)| (text_name(&n), a)));
        let (d, hd, eps) = (c.hidden_size, cfg.head_dim, c.rms_norm_eps);
        let kv_heads = cfg.num_key_value_heads.unwrap_or(c.num_attention_heads);
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for i in 0..c.num_hidden_layers {
            let l = format!("{LANGUAGE_MODEL}.layers.{i}");
            let a = format!("{l}.self_attn");
            let heads = c.num_attention_heads;
            let attn = Attention::load_projections(&mut w, &a, false, d, heads, kv_heads, hd)?;
            let attn = Attention {
                q_norm: Some(RmsNorm::load(&mut w, &format!("{a}.q_norm"), hd, eps)?),
                k_norm: Some(RmsNorm::load(&mut w, &format!("{a}.k_norm"), hd, eps)?),
                ..attn
            };
            layers.push(Block::load(&mut w, &l, &c, attn)?);
        }
        let rope = MRope::new(hd, cfg.rope_theta, &section)?;
        let what = "qwen3_vl language model";
        QwenImageModel::assemble((&raw, vit), w, (&c, rope), layers, hd, what)
    }
}

/// Qwen3-VL's mixer: attention with a KV cache.
impl QwenMixer for Attention {
    type Cache = KvCache;
    const DELTA_DROPPED: Defect = Defect::MropeDeltaDropped;

    /// mlx-vlm's `KVCache`, as mlx-lm's.
    fn make_cache(&self) -> KvCache {
        KvCache::new()
    }

    fn fresh(caches: &[KvCache], _layers: usize) -> bool {
        caches.iter().all(|c| c.offset() == 0)
    }

    fn offset(caches: &[KvCache]) -> i32 {
        caches.first().map_or(0, |c| c.offset())
    }

    fn forward(&self, x: &Array, step: &Step, cache: &mut KvCache) -> Result<Array, Exception> {
        let (b, l) = (x.shape()[0], x.shape()[1]);
        let q = self.q_proj.forward(x)?;
        let q = queries(self, &q.reshape(&[b, l, self.n_heads, step.head_dim])?)?;
        self.o_proj
            .forward(&attend_rotated(self, (x, q), step, cache)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_wrapper_sanitize() {
        assert_eq!(
            text_name("model.language_model.norm.weight"),
            "language_model.model.norm.weight"
        );
        assert_eq!(text_name("lm_head.weight"), "language_model.lm_head.weight");
        assert_eq!(
            text_name("language_model.lm_head.weight"),
            "language_model.lm_head.weight"
        );
    }
}
