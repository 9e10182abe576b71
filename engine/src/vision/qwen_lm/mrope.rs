//! Qwen's multimodal rotary positions (M-RoPE) on a prompt with images, as mlx-vlm 0.7.10
//! computes them (qwen3_vl / qwen3_5 `get_rope_index`, `MRoPERotaryEmbedding`, rope_utils.py's
//! interleaved M-RoPE):
//!
//! - [`rope_index`]: three position rows (t, h, w). Text runs count on from the last
//!   position + 1 in all three; an image of grid (t, gh, gw) after `n` text tokens starting at
//!   `s` takes `s + n + (ti, hi, wi)` over its `t × gh/m × gw/m` tokens (row-major). The rope
//!   delta is `max position + 1 − prompt length`;
//! - `MRope`: `inv_freq = 1 / θ^(arange(0, r, 2) / r)` over the rotated width `r`; for
//!   frequency `j` the position row `sel[j]` (interleaved: 1 at j = 1, 4, 7 … below
//!   `3·section[1]`, 2 at j = 2, 5, 8 … below `3·section[2]`, else 0),
//!   `freqs = f32(pos[sel[j]]) · inv_freq[j]`; cos / sin of `[freqs, freqs]` (`cos_sin`);
//!   a decode step's one position for all three rows;
//! - `apply_interleaved`: q and k rotated, `x·cos + rotate_half(x)·sin` on the rotated dims
//!   (mlx-vlm's compiled `_apply_interleaved_rotary_pos_emb_axis1`).

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::{Ellipsis, IndexOp};
use mlx_rs::ops::{self};
use mlx_rs::transforms::compile::compile;
use mlx_rs::{Array, Dtype};
use serde_json::Value;

use crate::model::layers::{weak, CompiledFn};
use crate::vision::qwen_vit::ops_fused::rotate_half;
use crate::vision::qwen_vit::QwenVitError;

type R<T> = Result<T, Exception>;

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

/// mlx-vlm's `MRoPERotaryEmbedding` (interleaved): the inverse frequencies over the rotated
/// width and each frequency's position row.
pub(crate) struct MRope {
    inv_freq: Array,
    selector: Array,
}

impl MRope {
    /// `compute_inv_freq(rotated, θ)` and the interleaved selector for `section`.
    pub fn new(rotated: i32, theta: f64, section: &[i32]) -> R<Self> {
        // θ and the width are Python scalars (weak).
        let f32_like = Array::from_f32(0.0);
        let exps = Array::arange::<_, i32>(0, rotated, 2)?
            .as_dtype(Dtype::Float32)?
            .divide(weak(rotated as f64, &f32_like)?)?;
        let inv_freq = Array::from_f32(1.0).divide(weak(theta, &f32_like)?.power(&exps)?)?;
        let freq_dim = rotated / 2;
        let mut sel = vec![0i32; freq_dim as usize];
        for (dim, offset) in [(1usize, 1usize), (2, 2)] {
            let stop =
                ((section.get(dim).copied().unwrap_or(0) * 3) as usize).min(freq_dim as usize);
            for j in (offset..stop).step_by(3) {
                sel[j] = dim as i32;
            }
        }
        Ok(MRope {
            inv_freq,
            selector: Array::from_slice(&sel, &[freq_dim]),
        })
    }

    /// The prompt's cos / sin from its (t, h, w) rows: `_selected_mrope_freqs` (compiled in
    /// mlx-vlm; one exact product per element either way), then [`cos_sin`].
    pub fn prompt(&self, rows: &[Vec<i32>; 3], dtype: Dtype) -> R<(Array, Array)> {
        let flat: Vec<i32> = rows.concat();
        let positions = Array::from_slice(&flat, &[3, 1, rows[0].len() as i32]);
        let picked = positions
            .take_axis(&self.selector, 0)?
            .transpose_axes(&[1, 2, 0])?;
        let freqs = picked.as_dtype(Dtype::Float32)?.multiply(&self.inv_freq)?;
        cos_sin(&freqs, dtype)
    }

    /// `l` decode positions from `start` on: `compute_mrope_frequencies`' 2-D path, one
    /// position for all three rows.
    pub fn decode(&self, start: i32, l: i32, dtype: Dtype) -> R<(Array, Array)> {
        let positions = Array::arange::<_, i32>(0, l, 1)?
            .reshape(&[1, l])?
            .add(Array::from_int(start))?;
        let freqs = positions
            .as_dtype(Dtype::Float32)?
            .expand_dims(-1)?
            .multiply(&self.inv_freq)?;
        cos_sin(&freqs, dtype)
    }
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

/// q and k rotated by [`interleaved_graph`] (compiled, as mlx-vlm's).
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
}
