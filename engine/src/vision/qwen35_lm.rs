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
//! - positions and rope delta: Qwen3-VL's `get_rope_index` ([`super::qwen3vl_lm::rope_index`]);
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
use mlx_rs::{Array, Dtype};
use serde::Deserialize;
use serde_json::Value;

use super::qwen35_gdn::delta_forward;
use super::qwen3vl_lm::{apply_interleaved, cos_sin, rope_index, Prefill, VisionIds};
use super::qwen_vit::{tower_name, QwenVit, QwenVitError};
use crate::cache::{ArraysCache, AttentionCache, Cache, KvCache, Mask};
use crate::load::weights::Weights;
use crate::model::gated_delta::{GatedDeltaNet, GdnLayout, GdnShape};
use crate::model::layers::{weak, Embedding, Glu, Linear, Mlp, RmsNorm};
use crate::plant::{self, Defect};

type R<T> = Result<T, Exception>;

/// config.json's `text_config` fields the image path reads (mlx-vlm's qwen3_5 `TextConfig`).
#[derive(Debug, Clone, Deserialize)]
struct TextConfig {
    num_hidden_layers: usize,
    hidden_size: i32,
    intermediate_size: i32,
    num_attention_heads: i32,
    num_key_value_heads: i32,
    #[serde(default)]
    head_dim: Option<i32>,
    rms_norm_eps: f32,
    vocab_size: i32,
    linear_num_value_heads: i32,
    linear_num_key_heads: i32,
    linear_key_head_dim: i32,
    linear_value_head_dim: i32,
    linear_conv_kernel_dim: i32,
    #[serde(default = "four")]
    full_attention_interval: usize,
    #[serde(default)]
    tie_word_embeddings: bool,
    #[serde(default)]
    attention_bias: bool,
    #[serde(default)]
    rope_parameters: Option<Value>,
}

fn four() -> usize {
    4
}

/// The (1 + w) RMSNorms (`NORM_WEIGHT_SUFFIXES`).
const OFFSET_NORMS: [&str; 5] = [
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    "model.norm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
];

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

/// Qwen3.5's attention with its output gate, rotated by precomputed M-RoPE cos / sin.
struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
}

enum Mixer {
    Delta(Box<GatedDeltaNet>),
    Attention(Box<Attention>),
}

struct Layer {
    mixer: Mixer,
    input_norm: RmsNorm,
    post_norm: RmsNorm,
    mlp: Mlp,
}

/// One layer's cache: a delta net's [conv state, recurrent state] or attention's K/V.
pub enum LayerCache {
    Delta(ArraysCache),
    Attention(KvCache),
}

/// A Qwen3.5 checkpoint with its image path: the tower and the language model as mlx-vlm
/// runs them.
pub struct Qwen35ImageModel {
    pub vit: QwenVit,
    pub ids: VisionIds,
    embed: Embedding,
    layers: Vec<Layer>,
    norm: RmsNorm,
    lm_head: Option<Linear>,
    heads: i32,
    kv_heads: i32,
    head_dim: i32,
    scale: f32,
    inv_freq: Array,
    selector: Array,
}

impl Qwen35ImageModel {
    /// The checkpoint in `dir` (config.json with `vision_config` and `text_config`).
    pub fn load(dir: &Path) -> Result<Self, QwenVitError> {
        let raw = crate::load::read_json(&dir.join("config.json"))?;
        let all = crate::load::weights::Weights::load(dir)?.into_tensors();
        let (tower, text): (HashMap<_, _>, HashMap<_, _>) =
            all.into_iter().partition(|(n, _)| tower_name(n).is_some());
        let vit = QwenVit::from_checkpoint(&raw, tower)?;
        if !vit.config.deepstack_visual_indexes.is_empty() {
            return Err(QwenVitError::Config(
                "qwen3_5 has no deepstack (mlx-vlm refuses deepstack_visual_indexes for it): \
                 set it to []"
                    .into(),
            ));
        }
        let cfg: TextConfig = raw
            .get("text_config")
            .ok_or_else(|| QwenVitError::Config("config.json has no `text_config`".into()))
            .and_then(|v| {
                serde_json::from_value(v.clone())
                    .map_err(|e| QwenVitError::Config(format!("text_config: {e}")))
            })?;
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
        let tensors = sanitize(text, cfg.tie_word_embeddings)?;
        let mut w = Weights::from_tensors(tensors);
        let d = cfg.hidden_size;
        let hd = cfg.head_dim.unwrap_or(d / cfg.num_attention_heads);
        let eps = cfg.rms_norm_eps;
        let p = "language_model.model";
        let embed = Embedding::load(&mut w, &format!("{p}.embed_tokens"), [cfg.vocab_size, d])?;
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
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let l = format!("{p}.layers.{i}");
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
                        (cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd);
                    Mixer::Attention(Box::new(Attention {
                        q_proj: lin(&mut w, "q_proj", [2 * q_dims, d])?,
                        k_proj: lin(&mut w, "k_proj", [kv_dims, d])?,
                        v_proj: lin(&mut w, "v_proj", [kv_dims, d])?,
                        o_proj: lin(&mut w, "o_proj", [d, q_dims])?,
                        q_norm: RmsNorm::load(&mut w, &format!("{a}.q_norm"), hd, eps)?,
                        k_norm: RmsNorm::load(&mut w, &format!("{a}.k_norm"), hd, eps)?,
                    }))
                }
            };
            layers.push(Layer {
                mixer,
                input_norm: RmsNorm::load(&mut w, &format!("{l}.input_layernorm"), d, eps)?,
                post_norm: RmsNorm::load(&mut w, &format!("{l}.post_attention_layernorm"), d, eps)?,
                mlp: Mlp::load(
                    &mut w,
                    &format!("{l}.mlp"),
                    false,
                    d,
                    cfg.intermediate_size,
                    Glu::Swiglu,
                )?,
            });
        }
        if !layers
            .iter()
            .any(|l| matches!(l.mixer, Mixer::Attention(_)))
        {
            return Err(QwenVitError::Config(format!(
                "{} layers with full_attention_interval {interval} leave no attention layer \
                 (mlx-vlm reads the rope offset from layer {}): check text_config",
                cfg.num_hidden_layers,
                interval - 1
            )));
        }
        let norm = RmsNorm::load(&mut w, &format!("{p}.norm"), d, eps)?;
        let lm_head = match cfg.tie_word_embeddings {
            true => None,
            false => Some(Linear::load(
                &mut w,
                "language_model.lm_head",
                false,
                [cfg.vocab_size, d],
            )?),
        };
        w.ensure_consumed("qwen3_5 language model", |_| false)?;
        // compute_inv_freq(rotated dims, θ): θ and the width are Python scalars (weak).
        let rot = (hd as f64 * share) as i32;
        let f32_like = Array::from_f32(0.0);
        let exps = Array::arange::<_, i32>(0, rot, 2)?
            .as_dtype(Dtype::Float32)?
            .divide(weak(rot as f64, &f32_like)?)?;
        let inv_freq = Array::from_f32(1.0).divide(weak(theta, &f32_like)?.power(&exps)?)?;
        let freq_dim = rot / 2;
        let mut sel = vec![0i32; freq_dim as usize];
        for (dim, offset) in [(1usize, 1usize), (2, 2)] {
            let stop =
                ((section.get(dim).copied().unwrap_or(0) * 3) as usize).min(freq_dim as usize);
            for j in (offset..stop).step_by(3) {
                sel[j] = dim as i32;
            }
        }
        Ok(Qwen35ImageModel {
            vit,
            ids: VisionIds::from_config(&raw),
            embed,
            layers,
            norm,
            lm_head,
            heads: cfg.num_attention_heads,
            kv_heads: cfg.num_key_value_heads,
            head_dim: hd,
            scale: (hd as f64).powf(-0.5) as f32,
            inv_freq,
            selector: Array::from_slice(&sel, &[freq_dim]),
        })
    }

    /// One cache per layer (mlx-vlm's `make_cache`: `ArraysCache(2)` for a delta net,
    /// `KVCache` for attention).
    pub fn make_caches(&self) -> Vec<LayerCache> {
        self.layers
            .iter()
            .map(|l| match l.mixer {
                Mixer::Delta(_) => LayerCache::Delta(ArraysCache::new(2)),
                Mixer::Attention(_) => LayerCache::Attention(KvCache::new()),
            })
            .collect()
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

    /// A prompt with its images (`patches` and `grids` as the processor gives them, the
    /// images in prompt order) through fresh `caches` in one forward (`Model.__call__`):
    /// every position's logits and the rope delta for the decode steps ([`Self::decode`]).
    pub fn prefill(
        &self,
        ids: &[u32],
        patches: &Array,
        grids: &[[i32; 3]],
        caches: &mut [LayerCache],
    ) -> Result<Prefill, QwenVitError> {
        self.prefill_in_chunks(ids, patches, grids, caches, &[ids.len()])
    }

    /// As [`Self::prefill`], the language model run on the prompt in chunks ending at `ends`
    /// (increasing, the last the prompt's length), each with the prompt's M-RoPE positions,
    /// as mlx-vlm's `generate_step` prefills ([`super::qwen3vl_lm::generate_chunks`]); the
    /// logits of every chunk, concatenated.
    pub fn prefill_in_chunks(
        &self,
        ids: &[u32],
        patches: &Array,
        grids: &[[i32; 3]],
        caches: &mut [LayerCache],
        ends: &[usize],
    ) -> Result<Prefill, QwenVitError> {
        let increasing = ends.windows(2).all(|w| w[0] < w[1]) && ends.first() != Some(&0);
        if !increasing || ends.last() != Some(&ids.len()) {
            return Err(QwenVitError::Input(format!(
                "chunk ends {ends:?} for a prompt of {}: need increasing ends, the last the \
                 prompt's length",
                ids.len()
            )));
        }
        if ids.contains(&self.ids.video) {
            return Err(QwenVitError::Input(format!(
                "the prompt holds the video token (id {}): video input is not supported yet; \
                 send images",
                self.ids.video
            )));
        }
        let fresh = caches.iter().all(|c| match c {
            LayerCache::Attention(kv) => kv.offset() == 0,
            LayerCache::Delta(a) => a.get(0).is_none() && a.get(1).is_none(),
        });
        if !fresh || caches.len() != self.layers.len() {
            return Err(QwenVitError::Input(
                "a prompt with images starts from empty caches (make_caches)".into(),
            ));
        }
        let vid = self.ids;
        let (rows, rope_delta) = rope_index(ids, grids, vid, self.vit.config.spatial_merge_size)?;
        let out = self.vit.forward(patches, grids)?;
        let image_at: Vec<usize> = (0..ids.len()).filter(|&i| ids[i] == vid.image).collect();
        let n_features = out.merged.shape()[0] as usize;
        if image_at.len() != n_features {
            return Err(QwenVitError::Input(format!(
                "Image features and image tokens do not match: tokens: {}, features {n_features}",
                image_at.len()
            )));
        }
        let l = ids.len() as i32;
        let ids_arr =
            Array::from_slice(&ids.iter().map(|&t| t as i32).collect::<Vec<_>>(), &[1, l]);
        let embeds = self.embed.forward(&ids_arr)?;
        // masked_scatter: the k-th image token's row is feature k (copies).
        let mut map = vec![0i32; ids.len()];
        for (k, &i) in image_at.iter().enumerate() {
            map[i] = k as i32;
        }
        let map = Array::from_slice(&map, &[l]);
        let is_image = Array::from_slice(
            &ids.iter().map(|&t| t == vid.image).collect::<Vec<_>>(),
            &[1, l, 1],
        );
        let features = out.merged.as_dtype(embeds.dtype())?.take_axis(&map, 0)?;
        let h = ops::select(&is_image, &features.expand_dims(0)?, &embeds)?;
        let flat: Vec<i32> = rows.concat();
        let positions = Array::from_slice(&flat, &[3, 1, l]);
        // _selected_mrope_freqs, then cos / sin of [freqs, freqs] in h's dtype.
        let picked = positions
            .take_axis(&self.selector, 0)?
            .transpose_axes(&[1, 2, 0])?;
        let freqs = picked.as_dtype(Dtype::Float32)?.multiply(&self.inv_freq)?;
        let (cos, sin) = cos_sin(&freqs, h.dtype())?;
        let mut logits = Vec::with_capacity(ends.len());
        let mut start = 0;
        for &end in ends {
            let (a, b) = (start as i32, end as i32);
            use mlx_rs::ops::indexing::IndexOp;
            let cut = |t: &Array| t.index((.., a..b));
            let hc = self.layers_forward(cut(&h), &cut(&cos), &cut(&sin), caches)?;
            logits.push(self.head(&hc)?);
            start = end;
        }
        Ok(Prefill {
            logits: ops::concatenate(&logits, 1)?,
            rope_delta,
        })
    }

    /// Tokens after the prompt (`[1, n]` ids) through the caches: their logits. Positions are
    /// `offset + rope_delta` on, as mlx-vlm's decode steps take them.
    pub fn decode(&self, ids: &[u32], rope_delta: i32, caches: &mut [LayerCache]) -> R<Array> {
        let l = ids.len() as i32;
        let ids_arr =
            Array::from_slice(&ids.iter().map(|&t| t as i32).collect::<Vec<_>>(), &[1, l]);
        let h = self.embed.forward(&ids_arr)?;
        let delta = match plant::is(Defect::Qwen35DeltaDropped) {
            true => 0,
            false => rope_delta,
        };
        let start = Self::offset(caches) + delta;
        let positions = Array::arange::<_, i32>(0, l, 1)?
            .reshape(&[1, l])?
            .add(Array::from_int(start))?;
        // compute_mrope_frequencies' 2-D path: one position for all three rows.
        let freqs = positions
            .as_dtype(Dtype::Float32)?
            .expand_dims(-1)?
            .multiply(&self.inv_freq)?;
        let (cos, sin) = cos_sin(&freqs, h.dtype())?;
        let h = self.layers_forward(h, &cos, &sin, caches)?;
        self.head(&h)
    }

    fn head(&self, h: &Array) -> R<Array> {
        let h = self.norm.forward(h)?;
        match &self.lm_head {
            Some(head) => head.forward(&h),
            None => self.embed.as_linear(&h),
        }
    }

    fn layers_forward(
        &self,
        mut h: Array,
        cos: &Array,
        sin: &Array,
        caches: &mut [LayerCache],
    ) -> R<Array> {
        let mask = match h.shape()[1] > 1 {
            true => Mask::Causal,
            false => Mask::None,
        };
        for (layer, cache) in self.layers.iter().zip(caches.iter_mut()) {
            let x = layer.input_norm.forward(&h)?;
            let r = match (&layer.mixer, cache) {
                (Mixer::Delta(net), LayerCache::Delta(c)) => delta_forward(net, &x, c)?,
                (Mixer::Attention(attn), LayerCache::Attention(c)) => {
                    self.attention(attn, &x, cos, sin, &mask, c)?
                }
                _ => {
                    return Err(Exception::custom(
                        "a layer's cache is not of its kind: make the caches with make_caches",
                    ))
                }
            };
            let hh = h.add(&r)?;
            h = hh.add(&layer.mlp.forward(&layer.post_norm.forward(&hh)?)?)?;
        }
        Ok(h)
    }

    fn attention(
        &self,
        attn: &Attention,
        x: &Array,
        cos: &Array,
        sin: &Array,
        mask: &Mask,
        cache: &mut KvCache,
    ) -> R<Array> {
        let (b, l) = (x.shape()[0], x.shape()[1]);
        let heads = [0, 2, 1, 3];
        let qg = attn
            .q_proj
            .forward(x)?
            .reshape(&[b, l, self.heads, -1])?
            .split_equal(2, -1)?;
        let gate = qg[1].reshape(&[b, l, -1])?;
        let q = attn.q_norm.forward(&qg[0])?.transpose_axes(&heads)?;
        let k = attn
            .k_norm
            .forward(
                &attn
                    .k_proj
                    .forward(x)?
                    .reshape(&[b, l, self.kv_heads, self.head_dim])?,
            )?
            .transpose_axes(&heads)?;
        let v = attn
            .v_proj
            .forward(x)?
            .reshape(&[b, l, self.kv_heads, self.head_dim])?
            .transpose_axes(&heads)?;
        let (q, k) = apply_interleaved(q, k, cos, sin)?;
        let kv = cache.update_and_fetch(k, v)?;
        let out = crate::model::sdpa::attend(&q, &kv, self.scale, mask)?;
        let out = out.transpose_axes(&heads)?.reshape(&[b, l, -1])?;
        attn.o_proj.forward(&out.multiply(sigmoid(&gate)?)?)
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
