//! MLX's quantized kernels with their `mode` argument, reached through mlx-c: mlx-rs's
//! `quantized_matmul`, `gather_qmm` and `dequantize` fix the mode to affine. Every mode,
//! affine included, goes through these, so there is one path.

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype, Stream};

use crate::load::config::QuantParams;

type R<T> = Result<T, Exception>;

fn int(v: i32) -> mlx_sys::mlx_optional_int {
    mlx_sys::mlx_optional_int {
        value: v,
        has_value: true,
    }
}

/// Runs one mlx-c op that writes `res`: the new array on success; on failure `res` is freed
/// and the error names the op and the parameters.
///
/// SAFETY (for the callers' closures): every handle handed to the op must be live for the
/// call; `null` is an empty handle the op reads as "none" and is freed here.
fn call(
    op: &str,
    p: QuantParams,
    f: impl FnOnce(*mut mlx_sys::mlx_array, mlx_sys::mlx_array, mlx_sys::mlx_stream) -> i32,
) -> R<Array> {
    let stream = Stream::thread_local_or_default();
    // SAFETY: `res` and `null` are fresh handles owned here; on success `res` is taken
    // over by `Array::from_ptr`, on failure freed; `null` is freed after the call.
    unsafe {
        let mut res = mlx_sys::mlx_array_new();
        let null = mlx_sys::mlx_array_new();
        let status = f(&mut res, null, stream.as_ptr());
        mlx_sys::mlx_array_free(null);
        if status != 0 {
            mlx_sys::mlx_array_free(res);
            return Err(Exception::custom(format!(
                "{op} failed (mode {}, group size {}, bits {})",
                p.mode.name(),
                p.group_size,
                p.bits
            )));
        }
        Ok(Array::from_ptr(res))
    }
}

fn or_null(a: Option<&Array>, null: mlx_sys::mlx_array) -> mlx_sys::mlx_array {
    a.map_or(null, Array::as_ptr)
}

/// `mx.quantized_matmul(x, w, scales, biases, transpose, group_size, bits, mode)`.
pub fn quantized_matmul(
    x: &Array,
    w: &Array,
    scales: &Array,
    biases: Option<&Array>,
    transpose: bool,
    p: QuantParams,
) -> R<Array> {
    call("quantized_matmul", p, |res, null, s| unsafe {
        mlx_sys::mlx_quantized_matmul(
            res,
            x.as_ptr(),
            w.as_ptr(),
            scales.as_ptr(),
            or_null(biases, null),
            transpose,
            int(p.group_size),
            int(p.bits),
            p.mode.c_name().as_ptr(),
            s,
        )
    })
}

/// `mx.gather_qmm(x, w, scales, biases, rhs_indices=indices, transpose, group_size, bits,
/// mode, sorted_indices)` (no lhs indices, no global scale).
#[allow(clippy::too_many_arguments)]
pub fn gather_qmm(
    x: &Array,
    w: &Array,
    scales: &Array,
    biases: Option<&Array>,
    indices: &Array,
    transpose: bool,
    p: QuantParams,
    sorted: bool,
) -> R<Array> {
    call("gather_qmm", p, |res, null, s| unsafe {
        mlx_sys::mlx_gather_qmm(
            res,
            x.as_ptr(),
            w.as_ptr(),
            scales.as_ptr(),
            or_null(biases, null),
            null,
            indices.as_ptr(),
            transpose,
            int(p.group_size),
            int(p.bits),
            p.mode.c_name().as_ptr(),
            sorted,
            s,
        )
    })
}

/// `mx.dequantize(w, scales, biases, group_size, bits, mode, dtype=dtype)` (no global
/// scale). With `dtype` None MLX picks: the scales' dtype for affine, bfloat16 otherwise.
pub fn dequantize(
    w: &Array,
    scales: &Array,
    biases: Option<&Array>,
    p: QuantParams,
    dtype: Option<Dtype>,
) -> R<Array> {
    let dtype = mlx_sys::mlx_optional_dtype {
        value: dtype.map_or(0, |d| d as mlx_sys::mlx_dtype),
        has_value: dtype.is_some(),
    };
    call("dequantize", p, |res, null, s| unsafe {
        mlx_sys::mlx_dequantize(
            res,
            w.as_ptr(),
            scales.as_ptr(),
            or_null(biases, null),
            int(p.group_size),
            int(p.bits),
            p.mode.c_name().as_ptr(),
            null,
            dtype,
            s,
        )
    })
}
