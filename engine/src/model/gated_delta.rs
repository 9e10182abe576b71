//! The gated delta net (Qwen 3.5's and Qwen3-Next's linear attention), as mlx-lm 0.32.2
//! computes it off Metal (`gated_delta.py`: `gated_delta_ops`, the path its CPU and CUDA
//! runs take; the Metal kernel is Apple-only):
//!
//!   qkv = conv_silu([conv_state; in_proj_qkv(x)])           depthwise, kernel K, no padding
//!   q, k = l2-normalized (q also · Dk^-½), v;   β = σ(b),   g = exp(−exp(A_log) · softplus(a + dt_bias))
//!   per token t (state S [B, Hv, Dv, Dk], float32, zeros at first):
//!     S = S · g_t;   δ = (v_t − S·k_t) · β_t;   S = S + δ ⊗ k_t;   y_t = S·q_t
//!   out = out_proj(rms_norm(y) · silu(z))                   (z = in_proj_z(x), in float32)
//!
//! The layer's `ArraysCache` holds [conv_state, S]: the last K − 1 conv inputs and the
//! recurrent state. q and k heads repeat to the value heads' count when there are fewer.

use std::cell::RefCell;

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::{Ellipsis, IndexOp, NewAxis};
use mlx_rs::ops::{
    arange, clip, concatenate, conv1d, repeat_axis, select, sigmoid, stack, zeros_dtype,
};
use mlx_rs::{fast, Array, Dtype};

use super::decoder::Mixer;
use super::layers::{compiled_shapeless, CompiledFn, Linear};
use super::shard::{slice, slice_segments, Part, Split};
use crate::cache::{ArraysCache, Cache, Mask};
use crate::load::weights::Weights;
use crate::load::LoadError;
use crate::scalar::weak;

type R<T> = Result<T, Exception>;

/// The head counts and widths of one gated delta net layer.
#[derive(Debug, Clone, Copy)]
pub struct GdnShape {
    pub hidden: i32,
    pub k_heads: i32,
    pub v_heads: i32,
    pub k_dim: i32,
    pub v_dim: i32,
    /// K, the conv kernel's length.
    pub conv_kernel: i32,
    pub eps: f32,
}

impl GdnShape {
    pub(crate) fn key_dim(&self) -> i32 {
        self.k_heads * self.k_dim
    }

    pub(crate) fn value_dim(&self) -> i32 {
        self.v_heads * self.v_dim
    }

    pub(crate) fn conv_dim(&self) -> i32 {
        2 * self.key_dim() + self.value_dim()
    }
}

/// How a layer projects its input into q, k, v, z, b and a.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GdnLayout {
    /// Qwen 3.5's: `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`.
    Split,
    /// Qwen3-Next's: `in_proj_qkvz` and `in_proj_ba`, grouped per key head
    /// (`fix_query_key_value_ordering`).
    Fused,
}

/// Boxed: a layer's linears are large values, and one box per layer costs nothing.
enum Projections {
    Split(Box<SplitProjections>),
    Fused(Box<(Linear, Linear)>),
}

struct SplitProjections {
    qkv: Linear,
    z: Linear,
    b: Linear,
    a: Linear,
}

pub struct GatedDeltaNet {
    proj: Projections,
    /// [conv_dim, K, 1] (MLX's depthwise layout).
    pub(crate) conv: Array,
    pub(crate) dt_bias: Array,
    pub(crate) a_log: Array,
    pub(crate) norm: Array,
    pub(crate) out_proj: Linear,
    pub(crate) shape: GdnShape,
}

impl GatedDeltaNet {
    /// `prefix` is the mixer's (`model.layers.{i}.linear_attn`); the checkpoint has been
    /// sanitized (the conv kernel in MLX's layout).
    pub fn load(
        w: &mut Weights,
        prefix: &str,
        shape: GdnShape,
        layout: GdnLayout,
    ) -> Result<Self, LoadError> {
        if shape.k_heads <= 0 || shape.v_heads % shape.k_heads != 0 {
            return Err(LoadError::Unsupported(format!(
                "gated delta net: linear_num_value_heads ({}) must be a multiple of \
                 linear_num_key_heads ({})",
                shape.v_heads, shape.k_heads
            )));
        }
        let lin = |w: &mut Weights, n: &str, out_in: [i32; 2]| {
            Linear::load(w, &format!("{prefix}.{n}"), false, out_in)
        };
        let (hidden, nv) = (shape.hidden, shape.v_heads);
        let proj = match layout {
            GdnLayout::Split => Projections::Split(Box::new(SplitProjections {
                qkv: lin(w, "in_proj_qkv", [shape.conv_dim(), hidden])?,
                z: lin(w, "in_proj_z", [shape.value_dim(), hidden])?,
                b: lin(w, "in_proj_b", [nv, hidden])?,
                a: lin(w, "in_proj_a", [nv, hidden])?,
            })),
            GdnLayout::Fused => Projections::Fused(Box::new((
                lin(
                    w,
                    "in_proj_qkvz",
                    [shape.conv_dim() + shape.value_dim(), hidden],
                )?,
                lin(w, "in_proj_ba", [2 * nv, hidden])?,
            ))),
        };
        let mut take = |n: &str, shape: &[i32]| w.take_shaped(&format!("{prefix}.{n}"), shape);
        let conv = take("conv1d.weight", &[shape.conv_dim(), shape.conv_kernel, 1])?;
        let dt_bias = take("dt_bias", &[nv])?;
        let a_log = take("A_log", &[nv])?;
        let norm = take("norm.weight", &[shape.v_dim])?;
        Ok(GatedDeltaNet {
            proj,
            conv,
            dt_bias,
            a_log,
            norm,
            out_proj: lin(w, "out_proj", [hidden, shape.value_dim()])?,
            shape,
        })
    }

    /// The input as (qkv [B, S, conv_dim], z [B, S, Hv, Dv], b and a [B, S, Hv]).
    pub(crate) fn project(&self, x: &Array) -> R<(Array, Array, Array, Array)> {
        let sh = self.shape;
        let (b, s) = (x.shape()[0], x.shape()[1]);
        match &self.proj {
            Projections::Split(p) => Ok((
                p.qkv.forward(x)?,
                p.z.forward(x)?.reshape(&[b, s, sh.v_heads, sh.v_dim])?,
                p.b.forward(x)?,
                p.a.forward(x)?,
            )),
            Projections::Fused(p) => {
                let (qkvz, ba) = (&p.0, &p.1);
                let (nk, dn, nv, dv) = (sh.k_heads, sh.k_dim, sh.v_heads, sh.v_dim);
                let per = nv / nk;
                let flat_order = crate::plant::is(crate::plant::Defect::GdnFusedOrderFlat);
                let heads = if flat_order { 1 } else { nk };
                let (dn, per) = if flat_order { (nk * dn, nv) } else { (dn, per) };
                let mixed = qkvz.forward(x)?.reshape(&[b, s, heads, -1])?;
                let mixed_ba = ba.forward(x)?.reshape(&[b, s, heads, -1])?;
                let p = mixed.split_at_indices(&[dn, 2 * dn, 2 * dn + per * dv], -1)?;
                let pb = mixed_ba.split_at_indices(&[per], -1)?;
                let v = p[2].reshape(&[b, s, -1, dv])?;
                let z = p[3].reshape(&[b, s, -1, dv])?;
                let flat = |t: &Array| t.reshape(&[b, s, -1]);
                let qkv = concatenate(&[flat(&p[0])?, flat(&p[1])?, flat(&v)?], -1)?;
                Ok((
                    qkv,
                    z,
                    pb[0].reshape(&[b, s, nv])?,
                    pb[1].reshape(&[b, s, nv])?,
                ))
            }
        }
    }

    /// The conv's input with the state (or zeros) before it; with a cache, its state
    /// becomes the inputs the next step needs.
    pub(crate) fn conv_input(&self, qkv: Array, state: Option<&mut ArraysCache>) -> R<Array> {
        let keep = self.shape.conv_kernel - 1;
        let s = qkv.shape()[1];
        let before = match state.as_ref().and_then(|c| c.get(0)) {
            Some(c) => c.clone(),
            None => zeros_dtype(&[qkv.shape()[0], keep, self.shape.conv_dim()], qkv.dtype())?,
        };
        let input = concatenate(&[&before, &qkv], 1)?;
        if let Some(cache) = state {
            let kept = match cache.lengths() {
                Some(lengths) => {
                    let lengths = Array::from_slice(lengths, &[lengths.len() as i32]);
                    let ends = clip(&lengths, (&Array::from_int(0), &Array::from_int(s)))?;
                    let positions = ends
                        .index((.., NewAxis))
                        .add(arange::<_, i32>(0, keep, 1)?)?
                        .index((Ellipsis, NewAxis));
                    input.take_along_axis(&positions, 1)?
                }
                None => input.index((.., (-keep).., ..)).contiguous()?,
            };
            cache.set(0, kept);
        }
        Ok(input)
    }
}

impl Mixer for GatedDeltaNet {
    fn forward(&self, x: &Array, mask: &Mask, cache: &mut dyn Cache) -> R<Array> {
        let sh = self.shape;
        let (b, s) = (x.shape()[0], x.shape()[1]);
        let (mut qkv, z, beta_in, a) = self.project(x)?;
        let mask = match mask {
            Mask::Array(m) => Some(m),
            _ => None,
        };
        if let Some(m) = mask {
            let zero = Array::from_int(0).as_dtype(qkv.dtype())?;
            qkv = select(m.index((Ellipsis, NewAxis)), &qkv, &zero)?;
        }
        let mut state = cache.as_arrays();
        let input = self.conv_input(qkv, state.as_deref_mut())?;
        let conv = conv1d(&input, &self.conv, 1, 0, 1, sh.conv_dim())?;
        let conv = mlx_rs::nn::silu(&conv)?;
        let parts = conv.split_at_indices(&[sh.key_dim(), 2 * sh.key_dim()], -1)?;
        let q = parts[0].reshape(&[b, s, sh.k_heads, sh.k_dim])?;
        let k = parts[1].reshape(&[b, s, sh.k_heads, sh.k_dim])?;
        let v = parts[2].reshape(&[b, s, sh.v_heads, sh.v_dim])?;
        let (q, k) = normalize_qk(&q, &k, (sh.k_dim as f64).powf(-0.5), 1e-6)?;
        let recurrent = state.as_ref().and_then(|c| c.get(1)).cloned();
        let beta = sigmoid(&beta_in)?;
        let g = compute_g(&self.a_log, &a, &self.dt_bias)?;
        let (out, recurrent) = gated_delta_ops(&q, &k, &v, &g, &beta, recurrent, mask)?;
        if let Some(c) = state {
            c.set(1, recurrent);
            c.advance(s);
        }
        let normed = fast::rms_norm(&out, Some(&self.norm), sh.eps)?;
        let out = precise_swiglu(&out, &z, &normed)?;
        self.out_proj.forward(&out.reshape(&[b, s, -1])?)
    }

    /// [conv state, recurrent state].
    fn make_cache(&self) -> Box<dyn Cache> {
        Box::new(ArraysCache::new(2))
    }

    fn recurrent(&self) -> bool {
        true
    }

    fn linears(&self) -> Vec<(&'static str, &Linear)> {
        let mut named = match &self.proj {
            Projections::Split(p) => vec![
                ("linear_attn.in_proj_qkv", &p.qkv),
                ("linear_attn.in_proj_z", &p.z),
                ("linear_attn.in_proj_b", &p.b),
                ("linear_attn.in_proj_a", &p.a),
            ],
            Projections::Fused(p) => vec![
                ("linear_attn.in_proj_qkvz", &p.0),
                ("linear_attn.in_proj_ba", &p.1),
            ],
        };
        named.push(("linear_attn.out_proj", &self.out_proj));
        named
    }

    /// `qwen3_5.Model.shard` on a delta net: by heads. The conv kernel and `in_proj_qkv` are
    /// cut per segment ([q | k | v]: each rank keeps its q heads, its k heads and its v heads),
    /// z, b, a, `dt_bias` and `A_log` by value heads, `out_proj` by its inputs with one
    /// `all_sum` after it (mlx-lm's `shard_inplace` then an explicit `all_sum`: the same ops
    /// as a row-split linear without a bias). Qwen3-Next's fused projections are not split:
    /// mlx-lm 0.32.2 does not shard `qwen3_next` (the registry refuses it first).
    fn shard(&mut self, part: Part, layer: &str) -> Result<(), LoadError> {
        let p = format!("{layer}.linear_attn");
        let n = part.size as i32;
        let sh = self.shape;
        if sh.k_heads % n != 0 || sh.v_heads % n != 0 {
            return Err(LoadError::Unsupported(format!(
                "{p}: {} key and {} value heads do not split over {n} ranks (tensor parallel \
                 needs both to divide by the rank count; try --pipeline)",
                sh.k_heads, sh.v_heads
            )));
        }
        let Projections::Split(proj) = &mut self.proj else {
            return Err(LoadError::Unsupported(format!(
                "{p}: the fused projections (in_proj_qkvz, in_proj_ba) are not split across \
                 ranks (mlx-lm 0.32.2 does not shard them either)"
            )));
        };
        let kd = sh.key_dim();
        let qkv = [kd, 2 * kd];
        // Planted: the conv kernel cut as one block, not per segment, so its channels no
        // longer line up with in_proj_qkv's.
        let unsegmented = crate::plant::is(crate::plant::Defect::GdnConvShardUnsegmented);
        let conv_segments: &[i32] = if unsegmented { &[] } else { &qkv };
        self.conv = slice_segments(
            &self.conv,
            0,
            conv_segments,
            part,
            &format!("{p}.conv1d.weight"),
        )?;
        proj.qkv
            .shard_segments(Split::Columns, &qkv, part, &format!("{p}.in_proj_qkv"))?;
        proj.z
            .shard_inplace(Split::Columns, part, &format!("{p}.in_proj_z"))?;
        proj.b
            .shard_inplace(Split::Columns, part, &format!("{p}.in_proj_b"))?;
        proj.a
            .shard_inplace(Split::Columns, part, &format!("{p}.in_proj_a"))?;
        self.dt_bias = slice(&self.dt_bias, 0, part, &format!("{p}.dt_bias"))?;
        self.a_log = slice(&self.a_log, 0, part, &format!("{p}.A_log"))?;
        self.out_proj
            .shard(Split::Rows, part, &format!("{p}.out_proj"))?;
        self.shape.k_heads /= n;
        self.shape.v_heads /= n;
        Ok(())
    }
}

/// `normalize_qk`: q and k l2-normalized through `rms_norm` (its eps scaled to match), the
/// readout scale `inv_scale` folded into q once more.
fn normalize_qk(q: &Array, k: &Array, inv_scale: f64, eps: f64) -> R<(Array, Array)> {
    let rms_eps = (eps * inv_scale * inv_scale) as f32;
    let qn = fast::rms_norm(q, None, rms_eps)?;
    let kn = fast::rms_norm(k, None, rms_eps)?;
    let q = weak(inv_scale * inv_scale, &qn)?.multiply(&qn)?;
    let k = weak(inv_scale, &kn)?.multiply(&kn)?;
    Ok((q, k))
}

/// `_gated_delta_step_ops`: one token through the recurrence. q, k [B, H, Dk], v [B, H, Dv],
/// g and β [B, H], state [B, H, Dv, Dk].
fn step(
    (q, k, v): (&Array, &Array, &Array),
    g: &Array,
    beta: &Array,
    state: Array,
    mask: Option<&Array>,
) -> R<(Array, Array)> {
    let old = state.clone();
    let decay = g.index((Ellipsis, NewAxis, NewAxis));
    let state = state.multiply(&decay)?;
    let k_row = k.index((Ellipsis, NewAxis, ..));
    let kv_mem = state.multiply(&k_row)?.sum_axis(-1, false)?;
    let delta = v
        .subtract(&kv_mem)?
        .multiply(beta.index((Ellipsis, NewAxis)))?;
    let state = state.add(k_row.multiply(delta.index((Ellipsis, NewAxis)))?)?;
    let y = state
        .multiply(q.index((Ellipsis, NewAxis, ..)))?
        .sum_axis(-1, false)?;
    let state = match mask {
        Some(m) => select(&m.expand_dims_axes(&[1, 2, 3])?, &state, &old)?,
        None => state,
    };
    Ok((y.as_dtype(q.dtype())?, state))
}

/// `gated_delta_ops`: the tokens one by one. q, k [B, T, Hk, Dk], v [B, T, Hv, Dv], g and β
/// [B, T, Hv], state [B, Hv, Dv, Dk] (zeros when None); → y [B, T, Hv, Dv] and the state.
pub(crate) fn gated_delta_ops(
    q: &Array,
    k: &Array,
    v: &Array,
    g: &Array,
    beta: &Array,
    state: Option<Array>,
    mask: Option<&Array>,
) -> R<(Array, Array)> {
    let (b, t, hk, dk) = (q.shape()[0], q.shape()[1], q.shape()[2], q.shape()[3]);
    let (hv, dv) = (v.shape()[2], v.shape()[3]);
    let mut state = match state {
        Some(s) => s,
        None => zeros_dtype(&[b, hv, dv, dk], Dtype::Float32)?,
    };
    let (q, k) = match hv / hk {
        f if f > 1 => (
            repeat_axis::<f32>(q.clone(), f, -2)?,
            repeat_axis::<f32>(k.clone(), f, -2)?,
        ),
        _ => (q.clone(), k.clone()),
    };
    let mut ys = Vec::with_capacity(t as usize);
    for i in 0..t {
        let at = |x: &Array| x.index((.., i));
        let m = mask.map(|m| m.index((.., i)));
        let late = crate::plant::is(crate::plant::Defect::GdnDecayOneStepLate) && i > 0;
        let g_t = g.index((.., if late { i - 1 } else { i }));
        let (y, next) = step(
            (&at(&q), &at(&k), &at(v)),
            &g_t,
            &at(beta),
            state,
            m.as_ref(),
        )?;
        ys.push(y);
        state = next;
    }
    Ok((stack(&ys, 1)?, state))
}

fn compute_g_graph(args: &[Array]) -> R<Vec<Array>> {
    let (a_log, a, dt_bias) = (&args[0], &args[1], &args[2]);
    let x = a.add(dt_bias)?;
    let softplus = mlx_rs::ops::logaddexp(&x, Array::from_int(0).as_dtype(x.dtype())?)?;
    let decay = mlx_rs::ops::exp(a_log.as_dtype(Dtype::Float32)?)?.negative()?;
    Ok(vec![mlx_rs::ops::exp(decay.multiply(&softplus)?)?])
}

fn precise_swiglu_graph(args: &[Array]) -> R<Vec<Array>> {
    let (h, gate, x) = (&args[0], &args[1], &args[2]);
    let gate = gate.as_dtype(Dtype::Float32)?;
    let gate = gate.multiply(sigmoid(&gate)?)?;
    let x = x.as_dtype(Dtype::Float32)?;
    Ok(vec![gate.multiply(&x)?.as_dtype(h.dtype())?])
}

thread_local! {
    static COMPUTE_G: RefCell<CompiledFn> = RefCell::new(compiled_shapeless(compute_g_graph));
    static PRECISE_SWIGLU: RefCell<CompiledFn> = RefCell::new(compiled_shapeless(precise_swiglu_graph));
}

/// mlx-lm's compiled `compute_g(A_log, a, dt_bias)`.
pub(crate) fn compute_g(a_log: &Array, a: &Array, dt_bias: &Array) -> R<Array> {
    let args = [a_log.clone(), a.clone(), dt_bias.clone()];
    COMPUTE_G.with_borrow_mut(|f| Ok(f(&args)?.remove(0)))
}

/// mlx-lm's compiled `precise_swiglu(h, gate, x)`: silu(gate) · x in float32, cast to h's
/// dtype (the gated RMSNorm's output).
pub(crate) fn precise_swiglu(h: &Array, gate: &Array, x: &Array) -> R<Array> {
    let args = [h.clone(), gate.clone(), x.clone()];
    PRECISE_SWIGLU.with_borrow_mut(|f| Ok(f(&args)?.remove(0)))
}
