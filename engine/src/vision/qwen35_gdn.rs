//! Qwen3.5's gated delta net as mlx-vlm 0.7.10 runs it off Metal
//! (mlx_vlm/models/qwen3_5/language.py `Qwen3_5GatedDeltaNet.__call__`, gated_delta.py
//! `gated_delta_update`, `gated_delta_chunked`, `_invert_unit_lower`), on the text model's
//! weights ([`crate::model::gated_delta::GatedDeltaNet`]).
//!
//! The layer is the text model's (projections, causal depthwise conv with its cached window,
//! SiLU, `g = exp(−exp(A_log)·softplus(a + dt_bias))`, `β = σ(b)`, gated RMSNorm, `out_proj`)
//! but for q / k's l2 normalization written as mlx-vlm writes it, `rms_norm` with eps
//! `1e-6 / Dk` (then q · inv_scale², k · inv_scale; the same f32 eps as mlx-lm's
//! `1e-6 · inv_scale²` for widths 16 to 256), and for the recurrence of a chunk of more than one token, which mlx-vlm computes as a
//! chunked scan (a single token runs the text model's step, `gated_delta_ops`):
//!
//!   pad T to a multiple of C = 64 (q, k, v, β zeros; g ones), per chunk (f32, heads first):
//!   Λ = cumsum(log clip(g, 1e-6, 1)),  Γ = exp Λ,  D_ij = exp(Λ_i − Λ_j) on j ≤ i (else exp(−1e30))
//!   A = β_i · D ∘ (K Kᵀ) strictly below the diagonal,  T⁻¹ = (I + A)⁻¹ by forward substitution
//!   U₀ = T⁻¹ (β v),  K̃ = T⁻¹ ((β Γ) k),  M = D ∘ (Q Kᵀ) on j ≤ i,  Q̃ = Γ q − M K̃
//!   chunk by chunk, S (f32 [Hv, Dv, Dk]):  y = M U₀ + Q̃ Sᵀ;
//!     S = Γ_last S + ((exp(Λ_last − Λ) ∘ (U₀ − K̃ Sᵀ))ᵀ k
//!
//! Op by op as mlx-vlm's (same products, matmul shapes and casts), so the sums round alike.

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::{Ellipsis, IndexOp, NewAxis};
use mlx_rs::ops::{
    broadcast_to, clip, concatenate, conv1d, exp, log, ones_dtype, repeat_axis, select, sigmoid,
    stack, tril, zeros_dtype, zeros_like,
};
use mlx_rs::{fast, Array, Dtype};

use crate::cache::ArraysCache;
use crate::model::gated_delta::{compute_g, gated_delta_ops, precise_swiglu, GatedDeltaNet};
use crate::model::layers::weak;
use crate::plant::{self, Defect};

type R<T> = Result<T, Exception>;

/// `gated_delta_chunked`'s chunk length.
const CHUNK: i32 = 64;

/// `Qwen3_5GatedDeltaNet.__call__(x, mask=None, cache)`: the layer's output; the cache gets
/// the conv window and the recurrent state.
pub(crate) fn delta_forward(net: &GatedDeltaNet, x: &Array, cache: &mut ArraysCache) -> R<Array> {
    let sh = net.shape;
    let (b, s) = (x.shape()[0], x.shape()[1]);
    let (qkv, z, beta_in, a) = net.project(x)?;
    let input = net.conv_input(qkv, Some(&mut *cache))?;
    // mlx-vlm's own decode conv in half precision (on the tiny model's bf16 gate it gives
    // the same bits as conv1d: followed for the shapes where it may not).
    let half = matches!(net.conv.dtype(), Dtype::Bfloat16 | Dtype::Float16);
    let conv = match s == 1 && input.shape()[1] == sh.conv_kernel && half {
        true => decode_depthwise_conv(&input, &net.conv)?,
        false => conv1d(&input, &net.conv, 1, 0, 1, sh.conv_dim())?,
    };
    let conv = mlx_rs::nn::silu(&conv)?;
    let parts = conv.split_at_indices(&[sh.key_dim(), 2 * sh.key_dim()], -1)?;
    let q = parts[0].reshape(&[b, s, sh.k_heads, sh.k_dim])?;
    let k = parts[1].reshape(&[b, s, sh.k_heads, sh.k_dim])?;
    let v = parts[2].reshape(&[b, s, sh.v_heads, sh.v_dim])?;
    // _normalize_qk: eps 1e-6 / Dk, q scaled by inv_scale² (Python floats).
    let inv_scale = (sh.k_dim as f64).powf(-0.5);
    let eps = (1e-6 / sh.k_dim as f64) as f32;
    let qn = fast::rms_norm(&q, None, eps)?;
    let kn = fast::rms_norm(&k, None, eps)?;
    let q = weak(inv_scale * inv_scale, &qn)?.multiply(&qn)?;
    let k = weak(inv_scale, &kn)?.multiply(&kn)?;
    // _compute_g_beta (compiled: g as the text model's compiled compute_g, β = σ(b)).
    let g = compute_g(&net.a_log, &a, &net.dt_bias)?;
    let beta = sigmoid(&beta_in)?;
    let state = match cache.get(1) {
        Some(st) => st.clone(),
        None => zeros_dtype(&[b, sh.v_heads, sh.v_dim, sh.k_dim], Dtype::Float32)?,
    };
    let chunked = s > 1 && !plant::is(Defect::Qwen35PrefillSequential);
    let (out, state) = match chunked {
        true => gated_delta_chunked(&q, &k, &v, &g, &beta, state)?,
        false => gated_delta_ops(&q, &k, &v, &g, &beta, Some(state), None)?,
    };
    cache.set(1, state);
    cache.advance(s);
    let normed = fast::rms_norm(&out, Some(&net.norm), sh.eps)?;
    let out = precise_swiglu(&out, &z, &normed)?;
    net.out_proj.forward(&out.reshape(&[b, s, -1])?)
}

/// `_qwen3_5_decode_depthwise_conv` (a half-precision decode step's conv): the window
/// `[B, K, C]` times the kernel as `[K, C]`, both in f32, summed over K, cast back.
fn decode_depthwise_conv(input: &Array, kernel: &Array) -> R<Array> {
    let w = kernel
        .index((.., .., 0))
        .transpose()?
        .as_dtype(Dtype::Float32)?;
    let out = input
        .as_dtype(Dtype::Float32)?
        .multiply(w.index(NewAxis))?
        .sum_axis(1, false)?
        .as_dtype(input.dtype())?
        .index((.., NewAxis, ..));
    Ok(out)
}

/// `_invert_unit_lower(T, C)`: the inverse of unit lower-triangular `[…, C, C]` matrices,
/// row by row.
fn invert_unit_lower(t: &Array, c: i32) -> R<Array> {
    let eye = Array::eye::<f32>(c, None, None)?;
    let x = broadcast_to(&eye, t.shape())?.add(zeros_like(t)?)?;
    let mut rows = vec![x.index((Ellipsis, 0..1, ..))];
    for i in 1..c {
        let tij = t.index((Ellipsis, i..i + 1, ..i));
        let xj = concatenate(&rows, -2)?;
        rows.push(
            x.index((Ellipsis, i..i + 1, ..))
                .subtract(tij.matmul(&xj)?)?,
        );
    }
    concatenate(&rows, -2)
}

/// `gated_delta_chunked(q, k, v, g, beta, state)` (no mask): q, k [B, T, Hk, Dk], v
/// [B, T, Hv, Dv], g and β [B, T, Hv], state [B, Hv, Dv, Dk] → y [B, T, Hv, Dv] in v's dtype
/// and the f32 state.
pub(crate) fn gated_delta_chunked(
    q: &Array,
    k: &Array,
    v: &Array,
    g: &Array,
    beta: &Array,
    state: Array,
) -> R<(Array, Array)> {
    let (b, t, hk, dk) = (q.shape()[0], q.shape()[1], q.shape()[2], q.shape()[3]);
    let (hv, dv) = (v.shape()[2], v.shape()[3]);
    let c = CHUNK;
    let in_dtype = v.dtype();
    let (mut q, mut k) = match hv / hk {
        f if f > 1 => (
            repeat_axis::<f32>(q.clone(), f, -2)?,
            repeat_axis::<f32>(k.clone(), f, -2)?,
        ),
        _ => (q.clone(), k.clone()),
    };
    let (mut v, mut g, mut beta) = (v.clone(), g.clone(), beta.clone());
    let pad = (c - t % c) % c;
    if pad > 0 {
        let z = |d: i32, dt: Dtype| zeros_dtype(&[b, pad, hv, d], dt);
        q = concatenate(&[&q, &z(dk, q.dtype())?], 1)?;
        k = concatenate(&[&k, &z(dk, k.dtype())?], 1)?;
        v = concatenate(&[&v, &z(dv, v.dtype())?], 1)?;
        g = concatenate(&[&g, &ones_dtype(&[b, pad, hv], g.dtype())?], 1)?;
        beta = concatenate(&[&beta, &zeros_dtype(&[b, pad, hv], beta.dtype())?], 1)?;
    }
    let tp = t + pad;
    let nc = tp / c;
    let rc = |x: &Array, d: i32| -> R<Array> {
        x.reshape(&[b, nc, c, hv, d])?
            .transpose_axes(&[0, 3, 1, 2, 4])?
            .as_dtype(Dtype::Float32)
    };
    let (q, k, v) = (rc(&q, dk)?, rc(&k, dk)?, rc(&v, dv)?);
    let g = g.reshape(&[b, nc, c, hv])?.transpose_axes(&[0, 3, 1, 2])?;
    let beta = beta
        .reshape(&[b, nc, c, hv])?
        .transpose_axes(&[0, 3, 1, 2])?;

    let clipped = clip(&g, (&weak(1e-6, &g)?, &weak(1.0, &g)?))?;
    let lcg = log(&clipped)?.cumsum(-1, None, None)?;
    let cumg = exp(&lcg)?;
    let ones = ones_dtype(&[c, c], Dtype::Float32)?;
    let lower_incl = tril(&ones, 0)?;
    let strict_lower = tril(&ones, -1)?;
    let below = lower_incl.gt(weak(0.0, &lower_incl)?)?;
    let spread = lcg
        .index((Ellipsis, .., NewAxis))
        .subtract(lcg.index((Ellipsis, NewAxis, ..)))?;
    let diff = select(&below, &spread, &weak(-1e30, &spread)?)?;
    let dr = exp(&diff)?;

    let kt = k.swap_axes(-1, -2)?;
    let kk = k.matmul(&kt)?;
    let a = beta
        .index((Ellipsis, .., NewAxis))
        .multiply(&dr)?
        .multiply(&kk)?
        .multiply(&strict_lower)?;
    let eye = Array::eye::<f32>(c, None, None)?;
    let tinv = invert_unit_lower(&eye.add(&a)?, c)?;

    let kbeta = beta
        .multiply(&cumg)?
        .index((Ellipsis, .., NewAxis))
        .multiply(&k)?;
    let u0 = tinv.matmul(beta.index((Ellipsis, .., NewAxis)).multiply(&v)?)?;
    let k_t = tinv.matmul(&kbeta)?;
    let m = dr.multiply(q.matmul(&kt)?)?.multiply(&lower_incl)?;
    let qeff = cumg
        .index((Ellipsis, .., NewAxis))
        .multiply(&q)?
        .subtract(m.matmul(&k_t)?)?;
    let mu0 = m.matmul(&u0)?;
    let cumg_last = cumg.index((Ellipsis, -1));
    let ratio_last = exp(lcg.index((Ellipsis, -1, NewAxis)).subtract(&lcg)?)?;

    let mut s = state.as_dtype(Dtype::Float32)?;
    let mut ys = Vec::with_capacity(nc as usize);
    for ci in 0..nc {
        let at = |x: &Array| x.index((.., .., ci));
        let st = s.swap_axes(-1, -2)?;
        ys.push(at(&mu0).add(at(&qeff).matmul(&st)?)?);
        let uc = at(&u0).subtract(at(&k_t).matmul(&st)?)?;
        let uscaled = at(&ratio_last).index((Ellipsis, NewAxis)).multiply(&uc)?;
        let carried = match plant::is(Defect::Qwen35ChunkDecayDropped) {
            true => s.clone(),
            false => at(&cumg_last)
                .index((Ellipsis, NewAxis, NewAxis))
                .multiply(&s)?,
        };
        s = carried.add(uscaled.swap_axes(-1, -2)?.matmul(at(&k))?)?;
    }
    let y = stack(&ys, 2)?
        .transpose_axes(&[0, 2, 3, 1, 4])?
        .reshape(&[b, tp, hv, dv])?
        .index((.., ..t))
        .as_dtype(in_dtype)?;
    Ok((y, s))
}
