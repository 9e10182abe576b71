//! How a cache stores K or V: one dense array, or MLX affine quantization's three arrays
//! (packed uint32 words, scales, biases). Every buffer operation a cache does — grow, slice,
//! concatenate, write a slice — is done to each part alike, so one piece of cache logic
//! serves both layouts (as mlx-lm's `QuantizedKVCache` and optiq's
//! `RotatingQuantizedKVCache` mirror their dense counterparts with `tree_map`).

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::{Ellipsis, IndexOp};
use mlx_rs::ops::{concatenate, quantize, zeros_dtype};
use mlx_rs::{Array, Dtype, Stream};

use super::{Kv, KvQuant, QTensor};

pub(crate) type Parts = Vec<Array>;

/// New K or V ([B, heads, L, D]) in the cache's layout.
pub(crate) fn encode(x: Array, quant: Option<KvQuant>) -> Result<Parts, Exception> {
    match quant {
        None => Ok(vec![x]),
        Some(q) => {
            let (packed, scales, biases) = quantize(&x, q.group_size, q.bits)?;
            Ok(vec![packed, scales, biases])
        }
    }
}

/// `positions` zero positions shaped for new K or V `like` ([B, heads, L, D]).
pub(crate) fn zeros(
    like: &Array,
    positions: i32,
    quant: Option<KvQuant>,
) -> Result<Parts, Exception> {
    let s = like.shape();
    let shape = |last: i32| [s[0], s[1], positions, last];
    match quant {
        None => Ok(vec![zeros_dtype(&shape(s[3]), like.dtype())?]),
        Some(q) => Ok(vec![
            zeros_dtype(&shape(s[3] / (32 / q.bits)), Dtype::Uint32)?,
            zeros_dtype(&shape(s[3] / q.group_size), like.dtype())?,
            zeros_dtype(&shape(s[3] / q.group_size), like.dtype())?,
        ]),
    }
}

/// Positions stored (axis 2).
pub(crate) fn len(p: &Parts) -> i32 {
    p[0].shape()[2]
}

/// Each part sliced to positions `range` on axis 2.
pub(crate) fn slice(p: &Parts, range: impl Fn(&Array) -> Array) -> Parts {
    p.iter().map(range).collect()
}

/// Positions `..end`.
pub(crate) fn head(p: &Parts, end: i32) -> Parts {
    slice(p, |x| x.index((Ellipsis, ..end, ..)))
}

/// The live positions: the first `offset`, or the whole buffer once it is full.
pub(crate) fn live(p: &Parts, offset: i32) -> Parts {
    if offset < len(p) {
        head(p, offset)
    } else {
        p.clone()
    }
}

/// Part-wise concatenation along positions.
pub(crate) fn cat(pieces: &[Parts]) -> Result<Parts, Exception> {
    cat_on(pieces, 2)
}

fn cat_on(pieces: &[Parts], axis: i32) -> Result<Parts, Exception> {
    (0..pieces[0].len())
        .map(|i| {
            let column: Vec<&Array> = pieces.iter().map(|p| &p[i]).collect();
            concatenate(&column, axis)
        })
        .collect()
}

/// Writes `new` into `buf` at positions `at..at + len(new)`.
pub(crate) fn write(buf: &mut Parts, at: i32, new: &Parts) -> Result<(), Exception> {
    for (b, n) in buf.iter_mut().zip(new) {
        *b = write_positions(b, n, at)?;
    }
    Ok(())
}

/// `buf` ([B, heads, positions, D]) with `update` written at positions `at..`: one
/// `SliceUpdate`, as Python's `buf[..., at:end, :] = update` builds it (mlx-rs's indexed
/// assignment adds two `Reshape`s of the update around it; same values, more primitives).
fn write_positions(buf: &Array, update: &Array, at: i32) -> Result<Array, Exception> {
    let (s, u) = (buf.shape(), update.shape());
    if s.len() != 4 || u.len() != 4 {
        return Err(Exception::custom(
            "cache buffers and updates are [B, heads, L, D]",
        ));
    }
    let start = [0, 0, at, 0];
    let stop = [s[0], s[1], at + u[2], s[3]];
    let strides = [1; 4];
    let stream = Stream::thread_local_or_default();
    // SAFETY: every handle and slice passed is live for the call; on success `res` owns a
    // new array that `Array::from_ptr` takes over, on failure it is freed here.
    unsafe {
        let mut res = mlx_sys::mlx_array_new();
        let status = mlx_sys::mlx_slice_update(
            &mut res,
            buf.as_ptr(),
            update.as_ptr(),
            start.as_ptr(),
            start.len(),
            stop.as_ptr(),
            stop.len(),
            strides.as_ptr(),
            strides.len(),
            stream.as_ptr(),
        );
        if status != 0 {
            mlx_sys::mlx_array_free(res);
            return Err(Exception::custom("mlx_slice_update failed"));
        }
        Ok(Array::from_ptr(res))
    }
}

/// What attention reads: dense arrays or quantized triples.
pub(crate) fn fetch(keys: Parts, values: Parts, quant: Option<KvQuant>) -> Kv {
    match quant {
        None => {
            let (mut k, mut v) = (keys, values);
            Kv::Dense(k.remove(0), v.remove(0))
        }
        Some(q) => Kv::Quantized {
            keys: QTensor::from_parts(keys),
            values: QTensor::from_parts(values),
            quant: q,
        },
    }
}

/// Quantizes dense K and V buffers in place of themselves (whole buffers, padding included,
/// as mlx-lm's `to_quantized` and optiq's `quantize_cache_layer` do); later writes are
/// quantized on the way in. A cache already quantized stays as it is. Both ways the cache
/// is quantized after it (`AttentionCache::quantize`'s true).
pub(crate) fn quantize_kv(
    keys: &mut Option<Parts>,
    values: &mut Option<Parts>,
    current: &mut Option<KvQuant>,
    q: KvQuant,
) -> Result<bool, Exception> {
    if current.is_some() {
        return Ok(true);
    }
    for p in [keys, values] {
        if let Some(parts) = p.take() {
            let dense = parts
                .into_iter()
                .next()
                .expect("a dense buffer has one part");
            *p = Some(encode(dense, Some(q))?);
        }
    }
    *current = Some(q);
    Ok(true)
}

/// The arrays of a K/V pair of buffers, keys' first (a cache's `state`).
pub(crate) fn kv_state<'a>(keys: &'a Option<Parts>, values: &'a Option<Parts>) -> Vec<&'a Array> {
    keys.iter().chain(values.iter()).flatten().collect()
}

/// Makes room in K/V buffers for `n` more positions written at `at`, as mlx-lm's
/// `KVCache.update_and_fetch` grows them: by whole steps of `step` positions appended after
/// the old buffers, which are first cut to `at` when `cut` says so (the single-sequence
/// cache cuts only off a step boundary; the batch always). `like_k`/`like_v` are the new
/// keys and values, whose shapes the new positions take.
pub(crate) fn reserve_kv(
    keys: &mut Option<Parts>,
    values: &mut Option<Parts>,
    (like_k, like_v): (&Array, &Array),
    at: i32,
    step: i32,
    quant: Option<KvQuant>,
    cut: bool,
) -> Result<(), Exception> {
    let n = like_k.shape()[2];
    let capacity = keys.as_ref().map_or(0, len);
    if keys.is_some() && at + n <= capacity {
        return Ok(());
    }
    let grow = (step + n - 1) / step * step;
    let new_k = zeros(like_k, grow, quant)?;
    let new_v = zeros(like_v, grow, quant)?;
    match (keys.take(), values.take()) {
        (Some(mut old_k), Some(mut old_v)) => {
            if cut {
                old_k = head(&old_k, at);
                old_v = head(&old_v, at);
            }
            *keys = Some(cat(&[old_k, new_k])?);
            *values = Some(cat(&[old_v, new_v])?);
        }
        _ => {
            *keys = Some(new_k);
            *values = Some(new_v);
        }
    }
    Ok(())
}

/// Writes encoded new keys and values into K/V buffers (already `reserve_kv`d) at `at`,
/// then what attention reads: each buffer through `read` (its live positions).
pub(crate) fn write_kv(
    (keys, values): (&mut Option<Parts>, &mut Option<Parts>),
    at: i32,
    (new_k, new_v): (&Parts, &Parts),
    read: impl Fn(&Parts) -> Parts,
    quant: Option<KvQuant>,
) -> Result<Kv, Exception> {
    let (Some(k_buf), Some(v_buf)) = (keys.as_mut(), values.as_mut()) else {
        return Err(Exception::custom("K/V buffers are reserved before a write"));
    };
    write(k_buf, at, new_k)?;
    write(v_buf, at, new_v)?;
    Ok(fetch(read(k_buf), read(v_buf), quant))
}

/// A K/V snapshot's tensors split into keys' and values' parts (three each when quantized,
/// one each when dense).
pub(crate) fn split_kv(
    tensors: Vec<Array>,
    quant: Option<KvQuant>,
) -> Result<(Parts, Parts), Exception> {
    let per_side = if quant.is_some() { 3 } else { 1 };
    if tensors.len() != 2 * per_side {
        return Err(Exception::custom(
            "a cache snapshot holds keys' and values' parts",
        ));
    }
    let mut keys = tensors;
    let values = keys.split_off(per_side);
    Ok((keys, values))
}

/// `pad` zero positions before (or, with `after`, after) every part of `p`.
pub(crate) fn pad(p: &Parts, pad: i32, after: bool) -> Result<Parts, Exception> {
    if pad == 0 {
        return Ok(p.clone());
    }
    p.iter()
        .map(|x| {
            let s = x.shape();
            let zeros = zeros_dtype(&[s[0], s[1], pad, s[3]], x.dtype())?;
            match after {
                false => concatenate(&[&zeros, x], 2),
                true => concatenate(&[x, &zeros], 2),
            }
        })
        .collect()
}

/// `rows` zero rows of no positions shaped like `like` (an empty side of a merge).
pub(crate) fn empty_rows(like: &Parts, rows: i32) -> Result<Parts, Exception> {
    like.iter()
        .map(|x| {
            let s = x.shape();
            zeros_dtype(&[rows, s[1], 0, s[3]], x.dtype())
        })
        .collect()
}

/// Concatenates parts along the batch axis.
pub(crate) fn cat_rows(pieces: &[Parts]) -> Result<Parts, Exception> {
    cat_on(pieces, 0)
}

/// Each part's rows `keep`, in that order.
pub(crate) fn take_rows(p: &Parts, keep: &[usize]) -> Result<Parts, Exception> {
    let index = Array::from_slice(
        &keep.iter().map(|&i| i as i32).collect::<Vec<_>>(),
        &[keep.len() as i32],
    );
    p.iter().map(|x| x.take_axis(&index, 0)).collect()
}
