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
    (0..pieces[0].len())
        .map(|i| {
            let column: Vec<&Array> = pieces.iter().map(|p| &p[i]).collect();
            concatenate(&column, 2)
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
/// quantized on the way in. A cache already quantized stays as it is.
pub(crate) fn quantize_kv(
    keys: &mut Option<Parts>,
    values: &mut Option<Parts>,
    current: &mut Option<KvQuant>,
    q: KvQuant,
) -> Result<(), Exception> {
    if current.is_some() {
        return Ok(());
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
    Ok(())
}

/// Bytes held by the parts.
pub(crate) fn nbytes(p: &Option<Parts>) -> usize {
    p.iter().flatten().map(|a| a.nbytes()).sum()
}
