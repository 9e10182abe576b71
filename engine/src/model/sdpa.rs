//! Attention over what a cache returns. Dense K/V go to MLX's fused SDPA kernel (as
//! mlx-lm's `scaled_dot_product_attention`); quantized K/V go to mlx-lm's
//! `quantized_scaled_dot_product_attention` or, where optiq 0.7.7's server would, to
//! optiq's fused kernel that tiles the KV axis (FlashAttention-2 style online softmax over
//! 512-position tiles of `quantized_matmul`). Op order and dtypes follow each reference.

use std::sync::atomic::{AtomicUsize, Ordering};

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::{Ellipsis, IndexOp, NewAxis};
use mlx_rs::ops::{arange, exp, maximum, quantized_matmul, select, softmax_axis};
use mlx_rs::{fast, Array, Dtype};

use crate::cache::{Kv, KvQuant, Mask, QTensor, QuantSdpa};

type R<T> = Result<T, Exception>;

/// KV positions per tile of optiq's fused kernel.
pub const FUSED_TILE: i32 = 512;

/// One-token decode steps that ran through the L3 path (proof that it ran).
static PERF_DECODE_CALLS: AtomicUsize = AtomicUsize::new(0);

pub fn perf_decode_calls() -> usize {
    PERF_DECODE_CALLS.load(Ordering::Relaxed)
}

/// `softmax(q·kᵀ·scale + mask)·v` for whatever layout the cache returned.
pub fn attend(q: &Array, kv: &Kv, scale: f32, mask: &Mask) -> R<Array> {
    match kv {
        Kv::Dense(k, v) => fast::scaled_dot_product_attention(q, k, v, scale, mask.as_sdpa(), None),
        Kv::Quantized {
            keys,
            values,
            quant,
        } => {
            if !fused_applies(q, quant, mask) {
                quantized(q, keys, values, scale, mask, quant)
            } else if quant.sdpa == QuantSdpa::DequantDecode && q.shape()[2] == 1 {
                PERF_DECODE_CALLS.fetch_add(1, Ordering::Relaxed);
                if crate::plant::is(crate::plant::Defect::PerfDecodeDropsNewest) {
                    let n = keys.packed.shape()[keys.packed.ndim() - 2];
                    let older =
                        |t: &QTensor| t.map(|x| Ok(x.index((Ellipsis, ..(n - 1).max(1), ..))));
                    return dequant_decode(q, &older(keys)?, &older(values)?, scale, quant);
                }
                dequant_decode(q, keys, values, scale, quant)
            } else {
                fused_tiled(q, keys, values, scale, mask, quant)
            }
        }
    }
}

/// mlx-lm's `scaled_dot_product_attention(..., sinks=)` (gpt-oss): dense K/V through the
/// fused SDPA with one learned sink logit per head (`sinks` [heads]: a column that joins
/// each row's softmax and takes its share of the mass, with no value); None is [`attend`]'s
/// dense path. Quantized K/V are refused as mlx-lm refuses them.
pub fn attend_with_sinks(
    q: &Array,
    kv: &Kv,
    scale: f32,
    mask: &Mask,
    sinks: Option<&Array>,
) -> R<Array> {
    match kv {
        Kv::Dense(k, v) => {
            fast::scaled_dot_product_attention(q, k, v, scale, mask.as_sdpa(), sinks)
        }
        Kv::Quantized { .. } if sinks.is_some() => Err(Exception::custom(
            "Quantized SDPA does not support attention sinks.",
        )),
        Kv::Quantized { .. } => attend(q, kv, scale, mask),
    }
}

/// mlx-lm's gemma2 attention, which caps the logits and so cannot use the fused kernel: q
/// scaled (weak scalar), grouped per KV head, `s = q·kᵀ`, `s = tanh(s / cap) · cap`, the
/// mask (a boolean one as `where(mask, s, finfo.min)`; mlx-lm asks for an array, so the
/// causal mode is made explicit), a precise softmax, `s·v`, the heads ungrouped. Dense K/V
/// only: mlx-lm's gemma2 has no quantized path.
pub fn attend_softcapped(q: &Array, kv: &Kv, scale: f32, cap: f32, mask: &Mask) -> R<Array> {
    let Kv::Dense(keys, values) = kv else {
        return Err(Exception::custom(
            "attention with a logit softcap runs over dense K/V only (as mlx-lm's gemma2)",
        ));
    };
    let shape = q.shape().to_vec();
    let (b, hq, l, d) = (shape[0], shape[1], shape[2], shape[3]);
    let hkv = keys.shape()[1];
    let rep = hq / hkv;
    let mut q = q.multiply(crate::scalar::weak(scale as f64, q)?)?;
    let (mut k, mut v) = (keys.clone(), values.clone());
    if rep > 1 {
        q = q.reshape(&[b, hkv, rep, l, d])?;
        (k, v) = (k.expand_dims(2)?, v.expand_dims(2)?);
    }
    let scores = q.matmul(k.swap_axes(-1, -2)?)?;
    let cap = crate::scalar::weak(cap as f64, &scores)?;
    let mut scores = mlx_rs::ops::tanh(&scores.divide(&cap)?)?.multiply(&cap)?;
    let mask = match mask {
        Mask::None => None,
        Mask::Causal => Some(causal(l, k.shape()[k.ndim() - 2])?),
        Mask::Array(m) => Some(m.clone()),
    };
    if let Some(m) = mask {
        scores = match m.dtype() {
            Dtype::Bool => select(&m, &scores, lowest(&scores)?)?,
            _ => scores.add(&m)?,
        };
    }
    let out = softmax_axis(&scores, -1, true)?.matmul(&v)?;
    match rep > 1 {
        true => out.reshape(&[b, hq, l, d]),
        false => Ok(out),
    }
}

/// L3 (ours, no oracle): a one-token decode step over quantized K/V that dequantizes the
/// cache and runs MLX's dense SDPA kernel. On the CPU backend `quantized_matmul` with one
/// query row is slow: at 2048 cached positions (4-bit, head dim 64, 4 q / 2 kv heads) one
/// attention took 5.7 ms through optiq's tiled kernel and 2.3 ms this way (dense bf16 SDPA
/// without quantization: 1.6 ms). Memory stays quantized; the dequantized copy is a
/// temporary of one step. Its rounding differs from optiq's, hence no oracle.
fn dequant_decode(
    q: &Array,
    keys: &QTensor,
    values: &QTensor,
    scale: f32,
    quant: &KvQuant,
) -> R<Array> {
    let dense = |t: &QTensor| {
        mlx_rs::ops::dequantize(
            &t.packed,
            &t.scales,
            Some(&t.biases),
            quant.group_size,
            quant.bits,
        )
    };
    let values = match crate::plant::is(crate::plant::Defect::PerfDequantValueBiasesDropped) {
        // Planted (tests/it/l3_kl.rs): the values dequantized without their affine biases.
        true => mlx_rs::ops::dequantize(
            &values.packed,
            &values.scales,
            Some(&mlx_rs::ops::zeros_like(&values.biases)?),
            quant.group_size,
            quant.bits,
        )?,
        false => dense(values)?,
    };
    fast::scaled_dot_product_attention(q, dense(keys)?, values, scale, None, None)
}

/// softmax(q·kᵀ)·v over 512-position tiles with a running max and rescaled sums (optiq's
/// op order), for already scaled and grouped queries.
fn online_softmax(
    q: &Array,
    keys: &QTensor,
    values: &QTensor,
    mask: Option<&Array>,
    quant: &KvQuant,
) -> R<Array> {
    let n = keys.packed.shape()[keys.packed.ndim() - 2];
    let tile = |t: &QTensor, a: i32, b: i32| t.map(|x| Ok(x.index((Ellipsis, a..b, ..))));
    // (running max, running sum, output)
    let mut acc: Option<(Array, Array, Array)> = None;
    let mut start = 0;
    while start < n {
        let end = (start + FUSED_TILE).min(n);
        let (k, v) = (tile(keys, start, end)?, tile(values, start, end)?);
        let mut scores = qmm(q, &k, true, quant)?;
        if let Some(m) = mask {
            scores = select(m.index((.., start..end)), &scores, lowest(&scores)?)?;
        }
        let tile_max = scores.max_axis(-1, true)?;
        acc = Some(match acc {
            None => {
                let e = exp(scores.subtract(&tile_max)?)?;
                let sum = e.sum_axis(-1, true)?;
                let out = qmm(&e, &v, false, quant)?;
                (tile_max, sum, out)
            }
            Some((m, sum, out)) => {
                let m2 = maximum(&m, &tile_max)?;
                let factor = exp(m.subtract(&m2)?)?;
                let e = exp(scores.subtract(&m2)?)?;
                let sum2 = factor.multiply(&sum)?.add(e.sum_axis(-1, true)?)?;
                let delta = qmm(&e, &v, false, quant)?;
                let out = out.multiply(&factor)?.add(&delta)?;
                (m2, sum2, out)
            }
        });
        start = end;
    }
    let (_, sum, out) = acc.ok_or_else(|| Exception::custom("attention over an empty cache"))?;
    out.divide(&sum)
}

/// optiq installs its kernel for 4/8 bits and f16/bf16 queries with no mask or the causal
/// one; everything else (e.g. a wrapped window's explicit mask) takes mlx-lm's path.
fn fused_applies(q: &Array, quant: &KvQuant, mask: &Mask) -> bool {
    quant.sdpa != QuantSdpa::MlxLm
        && matches!(quant.bits, 4 | 8)
        && matches!(quant.group_size, 32 | 64 | 128)
        && matches!(q.dtype(), Dtype::Float16 | Dtype::Bfloat16)
        && !matches!(mask, Mask::Array(_))
}

/// `mx.finfo(dtype).min` as a Python float meets an array of `dtype`.
pub(crate) fn lowest(like: &Array) -> R<Array> {
    let v = match like.dtype() {
        Dtype::Float16 => -65504.0,
        Dtype::Bfloat16 => f32::from_bits(0xFF7F_0000),
        _ => f32::MIN,
    };
    Array::from_f32(v).as_dtype(like.dtype())
}

/// The bottom-right-aligned causal mask [L, N] (query i sits at N − L + i).
fn causal(l: i32, n: i32) -> R<Array> {
    let q = arange::<_, i32>(n - l, n, 1)?.index((.., NewAxis));
    let k = arange::<_, i32>(0, n, 1)?.index(NewAxis);
    q.ge(&k)
}

/// Scaled queries, grouped per KV head when heads are shared ([B, Hkv, rep, L, D]), and
/// K/V expanded to match; returns the shape to restore.
fn grouped(
    q: &Array,
    keys: &QTensor,
    values: &QTensor,
    scale: f32,
) -> R<(Array, QTensor, QTensor, Option<Vec<i32>>)> {
    let shape = q.shape().to_vec();
    let (b, hq, l, d) = (shape[0], shape[1], shape[2], shape[3]);
    let hkv = keys.packed.shape()[keys.packed.ndim() - 3];
    let q = q.multiply(Array::from_f32(scale).as_dtype(q.dtype())?)?;
    let rep = hq / hkv;
    if rep == 1 {
        return Ok((q, keys.clone(), values.clone(), None));
    }
    let q = q.reshape(&[b, hkv, rep, l, d])?;
    let expand = |t: &QTensor| t.map(|x| x.expand_dims(-3));
    Ok((q, expand(keys)?, expand(values)?, Some(shape)))
}

/// Undoes `grouped`'s head grouping on the output.
fn ungrouped(out: Array, restore: Option<Vec<i32>>) -> R<Array> {
    match restore {
        Some(shape) => out.reshape(&shape),
        None => Ok(out),
    }
}

fn qmm(x: &Array, t: &QTensor, transpose: bool, quant: &KvQuant) -> R<Array> {
    quantized_matmul(
        x,
        &t.packed,
        &t.scales,
        &t.biases,
        transpose,
        quant.group_size,
        quant.bits,
    )
}

/// mlx-lm's `quantized_scaled_dot_product_attention`.
fn quantized(
    q: &Array,
    keys: &QTensor,
    values: &QTensor,
    scale: f32,
    mask: &Mask,
    quant: &KvQuant,
) -> R<Array> {
    let (q, keys, values, restore) = grouped(q, keys, values, scale)?;
    let mut scores = qmm(&q, &keys, true, quant)?;
    let mask = match mask {
        Mask::None => None,
        Mask::Causal => {
            let s = scores.shape();
            Some(causal(s[s.len() - 2], s[s.len() - 1])?)
        }
        Mask::Array(m) if restore.is_some() && m.ndim() > 3 => Some(m.expand_dims(-3)?),
        Mask::Array(m) => Some(m.clone()),
    };
    if let Some(m) = mask {
        scores = if m.dtype() == Dtype::Bool {
            select(&m, &scores, lowest(&scores)?)?
        } else {
            scores.add(&m)?
        };
    }
    let scores = softmax_axis(&scores, -1, true)?;
    let out = qmm(&scores, &values, false, quant)?;
    ungrouped(out, restore)
}

/// optiq 0.7.7's `_prefill_flashattn_n_tiled` (used for every query length, decode too):
/// running max, rescaled sums and outputs, all in the activation dtype.
fn fused_tiled(
    q: &Array,
    keys: &QTensor,
    values: &QTensor,
    scale: f32,
    mask: &Mask,
    quant: &KvQuant,
) -> R<Array> {
    let n = keys.packed.shape()[keys.packed.ndim() - 2];
    let l = q.shape()[2];
    let (q, keys, values, restore) = grouped(q, keys, values, scale)?;
    let mask = match mask {
        Mask::Causal => Some(causal(l, n)?),
        _ => None,
    };
    let out = online_softmax(&q, &keys, &values, mask.as_ref(), quant)?;
    ungrouped(out, restore)
}
