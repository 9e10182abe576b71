//! Gemma 4's vision encoder, as mlx-vlm 0.7.10's `mlx_vlm/models/gemma4/vision.py`
//! (`VisionModel.__call__` with no position ids: pixels [B, 3, H, W], every patch real)
//! computes it, op for op.
//!
//! Patches (`VisionPatchEmbedder._patchify`), p = patch_size, P = (H/p)·(W/p):
//!
//! ```text
//! x [B, 3, H, W] f32 → [B, 3, H/p, p, W/p, p] → [B, H/p, W/p, p, p, 3] → [B, P, 3p²]
//!   → 2 · (x − 0.5) (f32) → bf16 → · W_inᵀ (no bias)
//!   + Σ_axis one_hot(pos[axis], S) · table[axis]
//! ```
//!
//! with pos = (column, row) and S = position_embedding_size (the one-hot matmul, then the
//! sum over the 2 axes).
//!
//! Each block (`VisionTransformerBlock`), norms `fast.rms_norm(·, w)` (the weight itself):
//!
//! ```text
//! h   = x + post_attn_norm(attn(input_norm(x)))
//! out = h + post_ffw_norm(down(gelu_approx(gate(n)) · up(n))),  n = pre_ffw_norm(h)
//! ```
//!
//! Attention: q, k, v projections → [B, P, heads, d]; q and k through `VisionRMSNorm` (in f32:
//! x · rsqrt(mean(x²) + eps) · w, cast back), v the same without w; 2-D RoPE on q and k
//! (`apply_multidimensional_rope`: the head split in 2 halves of c = 2·⌊d/4⌋ channels, the
//! first rotated by the column, the second by the row, angles pos / base^(2i/c) in f32,
//! cos and sin cast to bf16, rotate_half within each half); sdpa with scale 1 and an additive
//! mask of zeros (bf16 [B, 1, P, P]: mlx-vlm's padding mask, with no padding), q/k/v
//! zero-padded on the head axis to the next fused size (64, 80, 128: `ensure_fused_sdpa`) and
//! cut back.
//!
//! Every projection is a `ClippableLinear`: with `use_clipped_linears`, clip(x, in_min,
//! in_max) before and clip(·, out_min, out_max) after (the bounds are checkpoint scalars).
//!
//! Pooler (`VisionPooler`, k = pooling_kernel_size, n = P / k²): when n < P, patch (x, y)
//! goes to window ⌊x/k⌋ + (W/p / k)·⌊y/k⌋; out = einsum("bLl,bLd->bld", one_hot / k² (f32),
//! x), cast back; then · √hidden (a weak scalar); the images' rows in turn [1, B·n, D]; with
//! `standardize`, (x − std_bias) · std_scale.

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::ops::{concatenate, einsum, maximum, minimum, pad, rsqrt, zeros_dtype};
use mlx_rs::{fast, Array, Dtype};
use serde::Deserialize;
use serde_json::Value;

use crate::load::weights::Weights;
use crate::load::LoadError;
use crate::model::layers::{gelu_approx, Linear, RmsNorm};
use crate::plant::{self, Defect};
use crate::scalar::weak;

type R<T> = Result<T, Exception>;

/// mlx-vlm's gemma4 `VisionConfig`, defaults included.
#[derive(Debug, Clone, Deserialize)]
pub struct Gemma4VisionConfig {
    #[serde(default = "d_model_type")]
    pub model_type: String,
    #[serde(default = "d_768")]
    pub hidden_size: i32,
    #[serde(default = "d_3072")]
    pub intermediate_size: i32,
    #[serde(default = "d_16")]
    pub num_hidden_layers: i32,
    #[serde(default = "d_12")]
    pub num_attention_heads: i32,
    #[serde(default = "d_12")]
    pub num_key_value_heads: i32,
    #[serde(default = "d_64")]
    pub head_dim: i32,
    #[serde(default = "d_eps")]
    pub rms_norm_eps: f32,
    #[serde(default = "d_16")]
    pub patch_size: i32,
    #[serde(default = "d_10240")]
    pub position_embedding_size: i32,
    #[serde(default = "d_3")]
    pub pooling_kernel_size: i32,
    #[serde(default = "d_280")]
    pub default_output_length: i32,
    #[serde(default)]
    pub use_clipped_linears: bool,
    #[serde(default)]
    pub standardize: bool,
    #[serde(default)]
    pub rope_parameters: Option<Value>,
}

fn d_model_type() -> String {
    "gemma4_vision".into()
}
fn d_768() -> i32 {
    768
}
fn d_3072() -> i32 {
    3072
}
fn d_16() -> i32 {
    16
}
fn d_12() -> i32 {
    12
}
fn d_64() -> i32 {
    64
}
fn d_3() -> i32 {
    3
}
fn d_280() -> i32 {
    280
}
fn d_10240() -> i32 {
    10240
}
fn d_eps() -> f32 {
    1e-6
}

impl Gemma4VisionConfig {
    /// `rope_parameters["rope_theta"]` (100 when absent, as `__post_init__` sets it).
    pub fn rope_theta(&self) -> f64 {
        self.rope_parameters
            .as_ref()
            .and_then(|r| r.get("rope_theta"))
            .and_then(Value::as_f64)
            .unwrap_or(100.0)
    }
}

/// `ClippableLinear`: a bias-free linear, clamped before and after when the config asks.
struct ClippableLinear {
    linear: Linear,
    /// (input_min, input_max, output_min, output_max).
    clip: Option<[Array; 4]>,
}

impl ClippableLinear {
    fn load(w: &mut Weights, p: &str, shape: [i32; 2], clip: bool) -> Result<Self, LoadError> {
        let linear = Linear::load(w, &format!("{p}.linear"), false, shape)?;
        let clip = match clip {
            true => {
                let mut t = |n: &str| w.take(&format!("{p}.{n}"));
                Some([
                    t("input_min")?,
                    t("input_max")?,
                    t("output_min")?,
                    t("output_max")?,
                ])
            }
            false => None,
        };
        Ok(ClippableLinear { linear, clip })
    }

    /// `mx.clip(x, lo, hi)`: maximum with lo, then minimum with hi.
    fn forward(&self, x: &Array) -> R<Array> {
        let Some([i_lo, i_hi, o_lo, o_hi]) = &self.clip else {
            return self.linear.forward(x);
        };
        let x = minimum(maximum(x, i_lo)?, i_hi)?;
        let y = self.linear.forward(&x)?;
        minimum(maximum(&y, o_lo)?, o_hi)
    }
}

/// `VisionRMSNorm` / `VisionRMSNormNoScale`: in f32, `x · rsqrt(mean(x**2) + eps) (· w)`,
/// cast back to x's dtype.
fn vision_rms_norm(x: &Array, weight: Option<&Array>, eps: f32) -> R<Array> {
    let xf = x.as_dtype(Dtype::Float32)?;
    let var = xf
        .power(Array::from_f32(2.0))?
        .mean_axes(&[-1], Some(true))?;
    let normed = xf.multiply(rsqrt(var.add(Array::from_f32(eps))?)?)?;
    let out = match weight {
        Some(w) => normed.multiply(w.as_dtype(Dtype::Float32)?)?,
        None => normed,
    };
    out.as_dtype(x.dtype())
}

/// `rotate_half`: [x1, x2] → [−x2, x1] over the last axis.
fn rotate_half(x: &Array) -> R<Array> {
    let d = x.shape()[3];
    let x1 = x.index((.., .., .., ..d / 2));
    let x2 = x.index((.., .., .., d / 2..));
    concatenate(&[x2.negative()?, x1], -1)
}

/// `apply_multidimensional_rope` with 2-D positions: x [B, L, N, d], positions [B, L, 2].
fn rope_2d(x: &Array, positions: &Array, base: f64) -> R<Array> {
    let d = x.shape()[3];
    let c = 2 * (d / 4);
    let half = c / 2;
    let mut parts = Vec::with_capacity(2);
    for axis in 0..2 {
        // Planted: the axes swapped (the rows rotate the first half).
        let pos_axis = match plant::is(Defect::Gemma4VisionRopeAxesSwapped) {
            true => 1 - axis,
            false => axis,
        };
        let part = x.index((.., .., .., axis * c..(axis + 1) * c));
        let exps = Array::arange::<_, i32>(0, half, 1)?
            .as_dtype(Dtype::Float32)?
            .multiply(Array::from_f32((2.0 / c as f64) as f32))?;
        let timescale = Array::from_f32(base as f32).power(&exps)?;
        let angles = positions
            .index((.., .., pos_axis..pos_axis + 1))
            .as_dtype(Dtype::Float32)?
            .divide(&timescale)?;
        let (cos, sin) = (angles.cos()?, angles.sin()?);
        let cos = concatenate(&[&cos, &cos], -1)?
            .as_dtype(x.dtype())?
            .expand_dims(2)?;
        let sin = concatenate(&[&sin, &sin], -1)?
            .as_dtype(x.dtype())?
            .expand_dims(2)?;
        parts.push(
            part.multiply(&cos)?
                .add(rotate_half(&part)?.multiply(&sin)?)?,
        );
    }
    concatenate(&parts, -1)
}

/// `ensure_fused_sdpa`: q, k, v zero-padded on the head axis to 64, 80 or 128 (the first
/// that holds d; none past 128), sdpa with scale 1, cut back to d.
fn fused_sdpa(q: &Array, k: &Array, v: &Array, mask: &Array) -> R<Array> {
    let d = q.shape()[3];
    let target = [64, 80, 128].into_iter().find(|&t| d <= t).unwrap_or(d);
    let widen = |t: &Array| match target == d {
        true => Ok(t.clone()),
        false => pad(t, &[(0, 0), (0, 0), (0, 0), (0, target - d)], None, None),
    };
    let o = fast::scaled_dot_product_attention(widen(q)?, widen(k)?, widen(v)?, 1.0, mask, None)?;
    Ok(o.index((.., .., .., ..d)))
}

struct Block {
    input_norm: RmsNorm,
    post_attn_norm: RmsNorm,
    pre_ffw_norm: RmsNorm,
    post_ffw_norm: RmsNorm,
    q: ClippableLinear,
    k: ClippableLinear,
    v: ClippableLinear,
    o: ClippableLinear,
    q_norm: Array,
    k_norm: Array,
    gate: ClippableLinear,
    up: ClippableLinear,
    down: ClippableLinear,
    heads: i32,
    kv_heads: i32,
    head_dim: i32,
    eps: f32,
    theta: f64,
}

impl Block {
    fn load(w: &mut Weights, p: &str, c: &Gemma4VisionConfig) -> Result<Self, LoadError> {
        let (d, f, hd) = (c.hidden_size, c.intermediate_size, c.head_dim);
        let (nq, nkv) = (c.num_attention_heads * hd, c.num_key_value_heads * hd);
        let clip = c.use_clipped_linears;
        let lin =
            |w: &mut Weights, n: &str, s| ClippableLinear::load(w, &format!("{p}.{n}"), s, clip);
        let norm =
            |w: &mut Weights, n: &str| RmsNorm::load(w, &format!("{p}.{n}"), d, c.rms_norm_eps);
        Ok(Block {
            input_norm: norm(w, "input_layernorm")?,
            post_attn_norm: norm(w, "post_attention_layernorm")?,
            pre_ffw_norm: norm(w, "pre_feedforward_layernorm")?,
            post_ffw_norm: norm(w, "post_feedforward_layernorm")?,
            q: lin(w, "self_attn.q_proj", [nq, d])?,
            k: lin(w, "self_attn.k_proj", [nkv, d])?,
            v: lin(w, "self_attn.v_proj", [nkv, d])?,
            o: lin(w, "self_attn.o_proj", [d, nq])?,
            q_norm: w.take_shaped(&format!("{p}.self_attn.q_norm.weight"), &[hd])?,
            k_norm: w.take_shaped(&format!("{p}.self_attn.k_norm.weight"), &[hd])?,
            gate: lin(w, "mlp.gate_proj", [f, d])?,
            up: lin(w, "mlp.up_proj", [f, d])?,
            down: lin(w, "mlp.down_proj", [d, f])?,
            heads: c.num_attention_heads,
            kv_heads: c.num_key_value_heads,
            head_dim: hd,
            // VisionRMSNorm's own default: q_norm / k_norm are built without the config's eps.
            eps: 1e-6,
            theta: c.rope_theta(),
        })
    }

    fn attention(&self, x: &Array, positions: &Array, mask: &Array) -> R<Array> {
        let (b, l) = (x.shape()[0], x.shape()[1]);
        let q = self
            .q
            .forward(x)?
            .reshape(&[b, l, self.heads, self.head_dim])?;
        let k = self
            .k
            .forward(x)?
            .reshape(&[b, l, self.kv_heads, self.head_dim])?;
        let v = self
            .v
            .forward(x)?
            .reshape(&[b, l, self.kv_heads, self.head_dim])?;
        let q = vision_rms_norm(&q, Some(&self.q_norm), self.eps)?;
        let k = vision_rms_norm(&k, Some(&self.k_norm), self.eps)?;
        let v = vision_rms_norm(&v, None, self.eps)?;
        let q = rope_2d(&q, positions, self.theta)?;
        let k = rope_2d(&k, positions, self.theta)?;
        let t = |a: &Array| a.transpose_axes(&[0, 2, 1, 3]);
        let o = fused_sdpa(&t(&q)?, &t(&k)?, &t(&v)?, mask)?;
        let o = o.transpose_axes(&[0, 2, 1, 3])?.reshape(&[b, l, -1])?;
        self.o.forward(&o)
    }

    fn forward(&self, x: &Array, positions: &Array, mask: &Array) -> R<Array> {
        let a = self.attention(&self.input_norm.forward(x)?, positions, mask)?;
        let h = x.add(self.post_attn_norm.forward(&a)?)?;
        let n = self.pre_ffw_norm.forward(&h)?;
        let m = self
            .down
            .forward(&gelu_approx(&self.gate.forward(&n)?)?.multiply(self.up.forward(&n)?)?)?;
        h.add(self.post_ffw_norm.forward(&m)?)
    }
}

/// The encoder: patch embedder, blocks, pooler, standardization.
pub struct Gemma4Vit {
    pub config: Gemma4VisionConfig,
    input_proj: Linear,
    /// [2, S, D].
    positions_table: Array,
    blocks: Vec<Block>,
    /// (std_bias, std_scale) with `standardize`.
    standardize: Option<(Array, Array)>,
}

impl Gemma4Vit {
    /// From the tower's tensors without their `vision_tower.` prefix (`patch_embedder.…`,
    /// `encoder.layers.{i}.…`, `std_bias`, `std_scale`).
    pub fn load(config: Gemma4VisionConfig, w: &mut Weights) -> Result<Self, LoadError> {
        let c = &config;
        if c.model_type != "gemma4_vision" {
            return Err(LoadError::Unsupported(format!(
                "vision_config.model_type `{}`: gemma4's tower is `gemma4_vision`",
                c.model_type
            )));
        }
        if c.head_dim % 4 != 0 || c.num_attention_heads % c.num_key_value_heads != 0 {
            return Err(LoadError::Unsupported(format!(
                "vision_config: head_dim {} must be a multiple of 4 (2-D RoPE splits it in two \
                 rotated halves) and num_attention_heads {} a multiple of num_key_value_heads {}",
                c.head_dim, c.num_attention_heads, c.num_key_value_heads
            )));
        }
        let (d, p) = (c.hidden_size, c.patch_size);
        let input_proj = Linear::load(w, "patch_embedder.input_proj", false, [d, 3 * p * p])?;
        let positions_table = w.take_shaped(
            "patch_embedder.position_embedding_table",
            &[2, c.position_embedding_size, d],
        )?;
        let blocks = (0..c.num_hidden_layers)
            .map(|i| Block::load(w, &format!("encoder.layers.{i}"), c))
            .collect::<Result<Vec<_>, _>>()?;
        let standardize = match c.standardize {
            true => Some((
                w.take_shaped("std_bias", &[d])?,
                w.take_shaped("std_scale", &[d])?,
            )),
            false => None,
        };
        Ok(Gemma4Vit {
            input_proj,
            positions_table,
            blocks,
            standardize,
            config,
        })
    }

    /// Pixels [B, 3, H, W] f32 (one size for the batch) → the pooled, scaled (and
    /// standardized) soft tokens [1, B·n, D], n = (H/p)·(W/p) / k².
    pub fn forward(&self, pixels: &Array) -> R<Array> {
        let c = &self.config;
        let s = pixels.shape();
        let (b, ch, h, w) = (s[0], s[1], s[2], s[3]);
        let p = c.patch_size;
        let (ph, pw) = (h / p, w / p);
        let n = ph * pw;
        let k = c.pooling_kernel_size;
        let length = n / (k * k);
        if ch != 3 || h % p != 0 || w % p != 0 || ph.max(pw) > c.position_embedding_size {
            return Err(Exception::custom(format!(
                "pixels {s:?}: gemma4's tower takes [B, 3, H, W] with H and W multiples of \
                 patch_size {p} and at most {} patches a side; preprocess with vision::gemma4",
                c.position_embedding_size
            )));
        }
        // `_patchify`.
        let patches = pixels
            .reshape(&[b, ch, ph, p, pw, p])?
            .transpose_axes(&[0, 2, 4, 3, 5, 1])?
            .reshape(&[b, n, ch * p * p])?;
        let patches = patches.subtract(weak(0.5, &patches)?)?;
        let patches = weak(2.0, &patches)?.multiply(&patches)?;
        let dtype = self.input_proj.weight.dtype();
        let x = self.input_proj.forward(&patches.as_dtype(dtype)?)?;
        // The patch positions (column, row), row-major, as `_patch_positions_single`.
        let pos: Vec<i32> = (0..b)
            .flat_map(|_| (0..ph).flat_map(move |y| (0..pw).flat_map(move |x| [x, y])))
            .collect();
        let positions = Array::from_slice(&pos, &[b, n, 2]);
        // `_position_embeddings`: one_hot → [B, 2, P, S] → @ table → sum over the 2 axes.
        let size = c.position_embedding_size;
        let one_hot = positions
            .expand_dims(-1)?
            .eq(Array::arange::<_, i32>(0, size, 1)?)?
            .as_dtype(Dtype::Float32)?
            .transpose_axes(&[0, 2, 1, 3])?
            .as_dtype(self.positions_table.dtype())?;
        let pe = one_hot
            .matmul(&self.positions_table)?
            .sum_axes(&[1], None)?;
        let mut hidden = x.add(&pe)?;
        // The padding mask, with no padding: zeros in the embeddings' dtype.
        let mask = zeros_dtype(&[b, 1, n, n], hidden.dtype())?;
        for block in &self.blocks {
            hidden = block.forward(&hidden, &positions, &mask)?;
        }
        let pooled = match length == n {
            true => hidden,
            false => self.pool(&hidden, b, pw, n, length)?,
        };
        let pooled = pooled.multiply(weak((c.hidden_size as f64).sqrt(), &pooled)?)?;
        let out = pooled.reshape(&[1, b * length, c.hidden_size])?;
        match &self.standardize {
            Some((bias, scale)) => out.subtract(bias)?.multiply(scale),
            None => Ok(out),
        }
    }

    /// `_avg_pool_by_positions`: each patch's window (from its position, exact integers
    /// here), the one-hot weights / k² in f32, the einsum, cast back.
    fn pool(&self, x: &Array, b: i32, pw: i32, n: i32, length: i32) -> R<Array> {
        let k = ((n / length) as f64).sqrt() as i32;
        let weight = 1.0f32 / (k * k) as f32;
        let mut weights = vec![0f32; (b * n * length) as usize];
        for bi in 0..b {
            for i in 0..n {
                let (px, py) = (i % pw, i / pw);
                let window = px / k + (pw / k) * (py / k);
                weights[((bi * n + i) * length + window) as usize] = weight;
            }
        }
        let weights = Array::from_slice(&weights, &[b, n, length]);
        einsum("bLl,bLd->bld", [&weights, x])?.as_dtype(x.dtype())
    }
}
