//! Qwen3-VL with images: the vision tower ([`super::qwen_vit`]) and the language model's
//! image path, as mlx-vlm 0.7.10 computes them (mlx_vlm/models/qwen3_vl/qwen3_vl.py
//! `Model.__call__` / `get_input_embeddings`, language.py `LanguageModel`, `Qwen3VLModel`,
//! `Attention`; rope_utils.py's interleaved M-RoPE).
//!
//! The prompt (ids with each image's `<|vision_start|>` and its run of image tokens):
//!
//! - embeddings: `embed(ids)`, the tower's merged features copied in at the image tokens in
//!   order (`masked_scatter`);
//! - positions (`get_rope_index`): three rows (t, h, w). Text runs count on from the last
//!   position + 1 in all three; an image of grid (t, gh, gw) after `n` text tokens starting at
//!   `s` takes `s + n + (ti, hi, wi)` over its `t × gh/m × gw/m` tokens (row-major). The rope
//!   delta is `max position + 1 − prompt length`;
//! - angles: `inv_freq = 1 / θ^(arange(0, d, 2) / d)`; for frequency `j` the position row
//!   `sel[j]` (interleaved: 1 at j = 1, 4, 7 … below 3·section[1], 2 at j = 2, 5, 8 … below
//!   3·section[2], else 0), `freqs = f32(pos[sel[j]]) · inv_freq[j]`; cos / sin of
//!   `[freqs, freqs]`;
//! - each layer as qwen3's (RMSNorm'd q/k per head) but rotated by
//!   `x·cos + rotate_half(x)·sin` (mlx-vlm's compiled `_apply_interleaved_rotary_pos_emb_axis1`),
//!   causal SDPA over the cache; after layer `i < len(deepstack)`, deepstack feature `i` added
//!   at the image tokens (`h.at[idx].add`);
//! - decoding after the prompt (mlx-vlm's decode loop: `language_model(y, cache)`): the
//!   position of the token at cache offset `o` is `o + delta` in all three rows; no deepstack.
//!
//! Weights: mlx-vlm's `Model.sanitize` (`model.language_model` → `language_model.model`,
//! `lm_head` → `language_model.lm_head`), so Hugging Face and mlx-community layouts load.
//! Qwen3.5 shares the tower but not this language model (its text model is the hybrid one).

use std::collections::HashMap;
use std::path::Path;

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::{Ellipsis, IndexOp};
use mlx_rs::ops::{self};
use mlx_rs::transforms::compile::compile;
use mlx_rs::{Array, Dtype};
use serde::Deserialize;
use serde_json::Value;

use super::qwen_vit::ops_fused::rotate_half;
use super::qwen_vit::{tower_name, QwenVit, QwenVitError};
use super::qwen_vl::QwenVlPixels;
use crate::cache::{AttentionCache, Cache, KvCache, Mask};
use crate::load::weights::Weights;
use crate::model::layers::{weak, CompiledFn, Embedding, Glu, Linear, Mlp, RmsNorm};
use crate::plant::{self, Defect};

type R<T> = Result<T, Exception>;

/// config.json's `text_config` fields the image path reads (mlx-vlm's `TextConfig`).
#[derive(Debug, Clone, Deserialize)]
struct TextConfig {
    num_hidden_layers: usize,
    hidden_size: i32,
    intermediate_size: i32,
    num_attention_heads: i32,
    num_key_value_heads: Option<i32>,
    head_dim: i32,
    rms_norm_eps: f32,
    vocab_size: i32,
    rope_theta: f64,
    #[serde(default)]
    rope_scaling: Option<Value>,
    #[serde(default)]
    tie_word_embeddings: bool,
}

/// The special ids `get_rope_index` and the merge read (mlx-vlm's `ModelConfig` defaults).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VisionIds {
    pub image: u32,
    pub video: u32,
    pub vision_start: u32,
}

impl VisionIds {
    pub(crate) fn from_config(raw: &Value) -> Self {
        let id = |k: &str, d: u64| raw.get(k).and_then(Value::as_u64).unwrap_or(d) as u32;
        let image = raw
            .get("image_token_index")
            .and_then(Value::as_u64)
            .map(|v| v as u32)
            .unwrap_or_else(|| id("image_token_id", 151655));
        let video = raw
            .get("video_token_index")
            .and_then(Value::as_u64)
            .map(|v| v as u32)
            .unwrap_or_else(|| id("video_token_id", 151656));
        VisionIds {
            image,
            video,
            vision_start: id("vision_start_token_id", 151652),
        }
    }
}

/// `get_rope_index` for one prompt: the (t, h, w) position rows, and the rope delta. Images
/// are counted as mlx-vlm counts them (an image token right after a vision-start token).
pub fn rope_index(
    ids: &[u32],
    grids: &[[i32; 3]],
    vid: VisionIds,
    merge: i32,
) -> Result<([Vec<i32>; 3], i32), QwenVitError> {
    let n_images = ids
        .windows(2)
        .filter(|w| w[0] == vid.vision_start && w[1] == vid.image)
        .count();
    if n_images > grids.len() {
        return Err(QwenVitError::Input(format!(
            "the prompt has {n_images} images (vision-start then image token) for {} grids: \
             send one image per image placeholder",
            grids.len()
        )));
    }
    let mut rows: [Vec<i32>; 3] = Default::default();
    let mut st = 0usize;
    let mut next = 0i32; // the last chunk's max + 1
    for grid in grids.iter().take(n_images) {
        let ed = ids[st..]
            .iter()
            .position(|&t| t == vid.image)
            .map(|p| p + st)
            .ok_or_else(|| QwenVitError::Input("an image without its image tokens".into()))?;
        let (t, gh, gw) = (grid[0], grid[1] / merge, grid[2] / merge);
        let text = (ed - st) as i32;
        for r in rows.iter_mut() {
            r.extend((0..text).map(|i| i + next));
        }
        let base = text + next;
        let mut max = base;
        for ti in 0..t {
            for hi in 0..gh {
                for wi in 0..gw {
                    rows[0].push(ti + base);
                    rows[1].push(hi + base);
                    rows[2].push(wi + base);
                    max = max.max(ti.max(hi).max(wi) + base);
                }
            }
        }
        next = max + 1;
        st = ed + (t * gh * gw) as usize;
    }
    if st < ids.len() {
        let text = (ids.len() - st) as i32;
        for r in rows.iter_mut() {
            r.extend((0..text).map(|i| i + next));
        }
    }
    if rows[0].len() != ids.len() {
        return Err(QwenVitError::Input(format!(
            "the images' tokens do not fit the prompt ({} positions for {} tokens): each image \
             needs exactly t·h·w/merge² image tokens",
            rows[0].len(),
            ids.len()
        )));
    }
    let max = rows.iter().flatten().copied().max().unwrap_or(-1);
    Ok((rows, max + 1 - ids.len() as i32))
}

struct TextLayer {
    input_norm: RmsNorm,
    post_norm: RmsNorm,
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    mlp: Mlp,
}

/// A Qwen3-VL checkpoint with its image path: the tower and the language model as mlx-vlm
/// runs them.
pub struct Qwen3VlImageModel {
    pub vit: QwenVit,
    pub ids: VisionIds,
    embed: Embedding,
    layers: Vec<TextLayer>,
    norm: RmsNorm,
    lm_head: Option<Linear>,
    heads: i32,
    kv_heads: i32,
    head_dim: i32,
    scale: f32,
    inv_freq: Array,
    selector: Array,
}

/// A prompt's result: every position's logits `[1, L, vocab]` and the rope delta its decode
/// steps continue from.
pub struct Prefill {
    pub logits: Array,
    pub rope_delta: i32,
}

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
        let raw = crate::load::read_json(&dir.join("config.json"))?;
        let all = Weights::load(dir)?.into_tensors();
        let (tower, text): (HashMap<_, _>, HashMap<_, _>) =
            all.into_iter().partition(|(n, _)| tower_name(n).is_some());
        let vit = QwenVit::from_checkpoint(&raw, tower)?;
        let cfg: TextConfig = raw
            .get("text_config")
            .ok_or_else(|| QwenVitError::Config("config.json has no `text_config`".into()))
            .and_then(|v| {
                serde_json::from_value(v.clone())
                    .map_err(|e| QwenVitError::Config(format!("text_config: {e}")))
            })?;
        let section: Vec<i32> = cfg
            .rope_scaling
            .as_ref()
            .and_then(|r| r.get("mrope_section"))
            .and_then(|s| serde_json::from_value(s.clone()).ok())
            .unwrap_or_else(|| vec![24, 20, 20]);
        let mut w = Weights::from_tensors(text.into_iter().map(|(n, a)| (text_name(&n), a)));
        let (d, hd) = (cfg.hidden_size, cfg.head_dim);
        let kv_heads = cfg.num_key_value_heads.unwrap_or(cfg.num_attention_heads);
        let eps = cfg.rms_norm_eps;
        let p = "language_model.model";
        let embed = Embedding::load(&mut w, &format!("{p}.embed_tokens"), [cfg.vocab_size, d])?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let l = format!("{p}.layers.{i}");
            let a = format!("{l}.self_attn");
            let lin = |w: &mut Weights, n: &str, s: [i32; 2]| {
                Linear::load(w, &format!("{a}.{n}"), false, s)
            };
            layers.push(TextLayer {
                input_norm: RmsNorm::load(&mut w, &format!("{l}.input_layernorm"), d, eps)?,
                post_norm: RmsNorm::load(&mut w, &format!("{l}.post_attention_layernorm"), d, eps)?,
                q_proj: lin(&mut w, "q_proj", [cfg.num_attention_heads * hd, d])?,
                k_proj: lin(&mut w, "k_proj", [kv_heads * hd, d])?,
                v_proj: lin(&mut w, "v_proj", [kv_heads * hd, d])?,
                o_proj: lin(&mut w, "o_proj", [d, cfg.num_attention_heads * hd])?,
                q_norm: RmsNorm::load(&mut w, &format!("{a}.q_norm"), hd, eps)?,
                k_norm: RmsNorm::load(&mut w, &format!("{a}.k_norm"), hd, eps)?,
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
        w.ensure_consumed("qwen3_vl language model", |_| false)?;
        // compute_inv_freq(head_dim, θ): θ and the width are Python scalars (weak).
        let f32_like = Array::from_f32(0.0);
        let exps = Array::arange::<_, i32>(0, hd, 2)?
            .as_dtype(Dtype::Float32)?
            .divide(weak(hd as f64, &f32_like)?)?;
        let inv_freq =
            Array::from_f32(1.0).divide(weak(cfg.rope_theta, &f32_like)?.power(&exps)?)?;
        let freq_dim = hd / 2;
        let mut sel = vec![0i32; freq_dim as usize];
        for (dim, offset) in [(1usize, 1usize), (2, 2)] {
            let stop =
                ((section.get(dim).copied().unwrap_or(0) * 3) as usize).min(freq_dim as usize);
            for j in (offset..stop).step_by(3) {
                sel[j] = dim as i32;
            }
        }
        Ok(Qwen3VlImageModel {
            vit,
            ids: VisionIds::from_config(&raw),
            embed,
            layers,
            norm,
            lm_head,
            heads: cfg.num_attention_heads,
            kv_heads,
            head_dim: hd,
            scale: (hd as f64).powf(-0.5) as f32,
            inv_freq,
            selector: Array::from_slice(&sel, &[freq_dim]),
        })
    }

    /// One cache per layer (mlx-vlm's `KVCache`, as mlx-lm's).
    pub fn make_caches(&self) -> Vec<KvCache> {
        self.layers.iter().map(|_| KvCache::new()).collect()
    }

    /// A prompt with its images (`patches` and `grids` as the processor gives them, the
    /// images in prompt order) through fresh `caches` in one forward (`Model.__call__`):
    /// every position's logits and the rope delta for the decode steps ([`Self::decode`]).
    pub fn prefill(
        &self,
        ids: &[u32],
        patches: &Array,
        grids: &[[i32; 3]],
        caches: &mut [KvCache],
    ) -> Result<Prefill, QwenVitError> {
        self.prefill_in_chunks(ids, patches, grids, caches, &[ids.len()])
    }

    /// As [`Self::prefill`], the language model run on the prompt in chunks ending at `ends`
    /// (increasing, the last the prompt's length), each with the prompt's M-RoPE positions
    /// and deepstack rows, as mlx-vlm's `generate_step` prefills ([`generate_chunks`]); the
    /// logits of every chunk, concatenated.
    pub fn prefill_in_chunks(
        &self,
        ids: &[u32],
        patches: &Array,
        grids: &[[i32; 3]],
        caches: &mut [KvCache],
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
            // mlx-vlm counts video tokens as visual positions for deepstack; without video
            // features that count no longer matches and its deepstack is skipped or misread.
            return Err(QwenVitError::Input(format!(
                "the prompt holds the video token (id {}): video input is not supported yet; \
                 send images",
                self.ids.video
            )));
        }
        if caches.iter().any(|c| c.offset() != 0) {
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
        let visual = Array::from_slice(
            &ids.iter()
                .map(|&t| t == vid.image || t == vid.video)
                .collect::<Vec<_>>(),
            &[1, l, 1],
        );
        let spread = |f: &Array| -> R<Array> { f.take_axis(&map, 0)?.expand_dims(0) };
        let h = ops::select(
            &is_image,
            &spread(&out.merged.as_dtype(embeds.dtype())?)?,
            &embeds,
        )?;
        let deep = out.deepstack.iter().map(spread).collect::<R<Vec<_>>>()?;
        let flat: Vec<i32> = rows.concat();
        let positions = Array::from_slice(&flat, &[3, 1, l]);
        let (cos, sin) = self.cos_sin_3d(&positions, h.dtype())?;
        let mut logits = Vec::with_capacity(ends.len());
        let mut start = 0;
        for &end in ends {
            let (a, b) = (start as i32, end as i32);
            let cut = |t: &Array| t.index((.., a..b));
            let deep = deep.iter().map(cut).collect::<Vec<_>>();
            let hc = self.layers_forward(
                cut(&h),
                &cut(&cos),
                &cut(&sin),
                caches,
                Some((&cut(&visual), &deep)),
            )?;
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
    pub fn decode(&self, ids: &[u32], rope_delta: i32, caches: &mut [KvCache]) -> R<Array> {
        let l = ids.len() as i32;
        let ids_arr =
            Array::from_slice(&ids.iter().map(|&t| t as i32).collect::<Vec<_>>(), &[1, l]);
        let h = self.embed.forward(&ids_arr)?;
        let delta = match plant::is(Defect::MropeDeltaDropped) {
            true => 0,
            false => rope_delta,
        };
        let start = caches.first().map_or(0, |c| c.offset()) + delta;
        let positions = Array::arange::<_, i32>(0, l, 1)?
            .reshape(&[1, l])?
            .add(Array::from_int(start))?;
        // compute_mrope_frequencies' 2-D path: one position for all three rows.
        let freqs = positions
            .as_dtype(Dtype::Float32)?
            .expand_dims(-1)?
            .multiply(&self.inv_freq)?;
        let (cos, sin) = cos_sin(&freqs, h.dtype())?;
        let h = self.layers_forward(h, &cos, &sin, caches, None)?;
        self.head(&h)
    }

    fn head(&self, h: &Array) -> R<Array> {
        let h = self.norm.forward(h)?;
        match &self.lm_head {
            Some(head) => head.forward(&h),
            None => self.embed.as_linear(&h),
        }
    }

    /// `_selected_mrope_freqs` (compiled in mlx-vlm; one exact product per element either
    /// way), then cos / sin.
    fn cos_sin_3d(&self, positions: &Array, dtype: Dtype) -> R<(Array, Array)> {
        let picked = positions
            .take_axis(&self.selector, 0)?
            .transpose_axes(&[1, 2, 0])?;
        let freqs = picked.as_dtype(Dtype::Float32)?.multiply(&self.inv_freq)?;
        cos_sin(&freqs, dtype)
    }

    fn layers_forward(
        &self,
        mut h: Array,
        cos: &Array,
        sin: &Array,
        caches: &mut [KvCache],
        deepstack: Option<(&Array, &[Array])>,
    ) -> R<Array> {
        let mask = match h.shape()[1] > 1 {
            true => Mask::Causal,
            false => Mask::None,
        };
        for (i, (layer, cache)) in self.layers.iter().zip(caches.iter_mut()).enumerate() {
            let r = self.attention(
                layer,
                &layer.input_norm.forward(&h)?,
                cos,
                sin,
                &mask,
                cache,
            )?;
            let hh = h.add(&r)?;
            h = hh.add(&layer.mlp.forward(&layer.post_norm.forward(&hh)?)?)?;
            if let Some((visual, feats)) = deepstack {
                if i < feats.len() && !plant::is(Defect::DeepstackSkipped) {
                    // h.at[image positions].add(features): the sum at those rows only.
                    h = ops::select(visual, &h.add(&feats[i])?, &h)?;
                }
            }
        }
        Ok(h)
    }

    fn attention(
        &self,
        layer: &TextLayer,
        x: &Array,
        cos: &Array,
        sin: &Array,
        mask: &Mask,
        cache: &mut KvCache,
    ) -> R<Array> {
        let (b, l) = (x.shape()[0], x.shape()[1]);
        let q = layer
            .q_norm
            .forward(
                &layer
                    .q_proj
                    .forward(x)?
                    .reshape(&[b, l, self.heads, self.head_dim])?,
            )?
            .transpose_axes(&[0, 2, 1, 3])?;
        let k = layer
            .k_norm
            .forward(
                &layer
                    .k_proj
                    .forward(x)?
                    .reshape(&[b, l, self.kv_heads, self.head_dim])?,
            )?
            .transpose_axes(&[0, 2, 1, 3])?;
        let v = layer
            .v_proj
            .forward(x)?
            .reshape(&[b, l, self.kv_heads, self.head_dim])?
            .transpose_axes(&[0, 2, 1, 3])?;
        let (q, k) = apply_interleaved(q, k, cos, sin)?;
        let kv = cache.update_and_fetch(k, v)?;
        let out = crate::model::sdpa::attend(&q, &kv, self.scale, mask)?;
        layer
            .o_proj
            .forward(&out.transpose_axes(&[0, 2, 1, 3])?.reshape(&[b, l, -1])?)
    }
}

/// The processor's images (in prompt order) as the tower takes them: their patches in one
/// `[n, C·T·P·P]` f32 tensor and their grids (`Qwen3VLProcessor`'s `pixel_values`,
/// `image_grid_thw`).
pub fn patches_of(images: &[QwenVlPixels]) -> Result<(Array, Vec<[i32; 3]>), QwenVitError> {
    let width = images.first().map_or(0, |i| i.pixels.shape[1]);
    if images.is_empty()
        || images
            .iter()
            .any(|i| i.pixels.shape.len() != 2 || i.pixels.shape[1] != width)
    {
        return Err(QwenVitError::Input(
            "no images, or images from processors of different patch sizes: preprocess every \
             image of a prompt with the checkpoint's one processor"
                .into(),
        ));
    }
    let data: Vec<f32> = images
        .iter()
        .flat_map(|i| i.pixels.data.iter().copied())
        .collect();
    let rows = (data.len() / width) as i32;
    let grids = images
        .iter()
        .map(|i| i.grid_thw.map(|v| v as i32))
        .collect();
    Ok((Array::from_slice(&data, &[rows, width as i32]), grids))
}

/// The chunk ends of mlx-vlm's `generate_step` prefill for a prompt of `len` tokens: all but
/// the last token in chunks of at most `step` (`prefill_step_size`, 2048 by default), then the
/// last token by itself.
pub fn generate_chunks(len: usize, step: usize) -> Vec<usize> {
    let mut ends = Vec::new();
    let mut at = 0;
    while len - at > 1 {
        at += step.max(1).min(len - at - 1);
        ends.push(at);
    }
    ends.push(len);
    ends
}

/// `MRoPERotaryEmbedding.__call__` from its frequencies: cos / sin of `[freqs, freqs]`,
/// times the attention scaling (1.0), cast to the hidden states' dtype.
pub(crate) fn cos_sin(freqs: &Array, dtype: Dtype) -> R<(Array, Array)> {
    let emb = ops::concatenate(&[freqs, freqs], -1)?;
    let one = weak(1.0, &emb)?;
    let cos = ops::cos(&emb)?.multiply(&one)?.as_dtype(dtype)?;
    let sin = ops::sin(&emb)?.multiply(&one)?.as_dtype(dtype)?;
    Ok((cos, sin))
}

/// `_apply_interleaved_rotary_pos_emb_axis1(q, k, cos, sin)`, an `mx.compile`d function in
/// mlx-vlm (compiled, its products and sums fuse: compiled here too).
fn interleaved_graph(args: &[Array]) -> R<Vec<Array>> {
    let (q, k) = (&args[0], &args[1]);
    let cos = args[2].expand_dims(1)?;
    let sin = args[3].expand_dims(1)?;
    let rd = *cos.shape().last().unwrap();
    let apply = |t: &Array| -> R<Array> {
        let rot = t.index((Ellipsis, ..rd));
        let pass = t.index((Ellipsis, rd..));
        let e = rot
            .multiply(&cos)?
            .add(&rotate_half(&rot)?.multiply(&sin)?)?
            .as_dtype(t.dtype())?;
        ops::concatenate(&[e, pass], -1)
    };
    Ok(vec![apply(q)?, apply(k)?])
}

/// q and k rotated by [`interleaved_graph`] (compiled, as mlx-vlm's); also Qwen3.5's.
pub(crate) fn apply_interleaved(q: Array, k: Array, cos: &Array, sin: &Array) -> R<(Array, Array)> {
    let mut rotated = INTERLEAVED.with_borrow_mut(|f| f(&[q, k, cos.clone(), sin.clone()]))?;
    let k = rotated.pop().unwrap();
    Ok((rotated.pop().unwrap(), k))
}

thread_local! {
    static INTERLEAVED: std::cell::RefCell<CompiledFn> = std::cell::RefCell::new({
        let mut f = compile(interleaved_graph, false);
        Box::new(move |args: &[Array]| f(args))
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    const IDS: VisionIds = VisionIds {
        image: 10,
        video: 13,
        vision_start: 11,
    };

    #[test]
    fn rope_index_counts_images_and_text_as_get_rope_index_does() {
        // text ×2, an image of grid (1, 4, 6) (2 × 3 tokens), text ×2.
        let ids = [5, 11, 10, 10, 10, 10, 10, 10, 12, 6];
        let (rows, delta) = rope_index(&ids, &[[1, 4, 6]], IDS, 2).unwrap();
        assert_eq!(rows[0], [0, 1, 2, 2, 2, 2, 2, 2, 5, 6]);
        assert_eq!(rows[1], [0, 1, 2, 2, 2, 3, 3, 3, 5, 6]);
        assert_eq!(rows[2], [0, 1, 2, 3, 4, 2, 3, 4, 5, 6]);
        assert_eq!(delta, 7 - 10);
    }

    #[test]
    fn generate_chunks_leave_the_last_token_alone() {
        assert_eq!(generate_chunks(18, 2048), [17, 18]);
        assert_eq!(generate_chunks(5, 2), [2, 4, 5]);
        assert_eq!(generate_chunks(1, 2048), [1]);
    }

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
