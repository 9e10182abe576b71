//! DoRA on a linear layer, as mlx-lm 0.32.2's `DoRALinear.__call__` (tuner/dora.py)
//! computes it, op for op:
//!
//!   W = the layer's weight, dequantized when it is quantized (`_dequantized_weight`)
//!   y = x·Wᵀ + cast_x(scale·((dropout(x)·A)·B))          (no bias yet, no quantized_matmul)
//!   n = stop_gradient(‖W + (scale·Bᵀ)·Aᵀ‖₂ per output row)  (`mx.linalg.norm(…, axis=1)`)
//!   out = cast_x(m / n) · y  (+ bias)
//!
//! with A [in, rank], B [rank, out] and the magnitude m [out] trainable, m starting at the
//! rows' norms of W in f32 (`set_linear`: `norm(W.astype(float32), axis=1)`). The norm's
//! gradient is stopped, as mlx-lm stops it, so A and B learn only through y.
//!
//! The layer math lives with the layers (`Linear::forward` calls it); training attaches
//! the adapter (`train::lora`). Also the QLoRA plant's dequantized base
//! (`plant::Defect::QloraDequantizedBase`).

use mlx_rs::error::Exception;
use mlx_rs::linalg::{norm_l2, NormOptions};
use mlx_rs::{Array, Dtype};

use super::{dropped, weak, Linear, Lora};
use crate::model::quantized::ops::dequantize;
use crate::plant::{self, Defect};

type R<T> = Result<T, Exception>;

/// The layer's weight as mlx-lm's `_dequantized_weight` gives it: dense as stored, or
/// `mx.dequantize(W, scales, biases, group_size, bits, mode)` (MLX picks the dtype).
pub fn dequantized_weight(linear: &Linear) -> R<Array> {
    match &linear.quantized {
        None => Ok(linear.weight.clone()),
        Some(q) => dequantize(&linear.weight, &q.scales, q.biases.as_ref(), q.params, None),
    }
}

/// DoRA's initial magnitude: each output row's L2 norm of the (dequantized) weight in f32.
pub fn magnitude(linear: &Linear) -> R<Array> {
    let w = dequantized_weight(linear)?.as_dtype(Dtype::Float32)?;
    row_norms(&w)
}

/// `mx.linalg.norm(w, axis=1)`: MLX's ord-less norm over the input axis.
pub fn row_norms(w: &Array) -> R<Array> {
    norm_l2(
        w,
        NormOptions {
            axes: 1.into(),
            keep_dims: false,
        },
    )
}

/// The layer's output when a DoRA adapter is attached (`Lora.m` set); None otherwise.
pub fn forward_if_any(linear: &Linear, x: &Array) -> R<Option<Array>> {
    let lora = linear.lora.borrow();
    match lora.as_ref() {
        Some(l) if l.m.is_some() => forward(linear, x, l).map(Some),
        _ => Ok(None),
    }
}

/// `DoRALinear.__call__`.
fn forward(linear: &Linear, x: &Array, l: &Lora) -> R<Array> {
    let m = l.m.as_ref().expect("a DoRA adapter has its magnitude");
    let w = dequantized_weight(linear)?;
    let y = x.matmul(w.t())?;
    let xd = dropped(x, &l.dropout)?;
    let z = xd.matmul(&l.a)?.matmul(&l.b)?;
    let z = z.multiply(weak(l.scale as f64, &z)?)?.as_dtype(x.dtype())?;
    let out = y.add(&z)?;
    let bt = l.b.t();
    let scaled_bt = bt.multiply(weak(l.scale as f64, &bt)?)?;
    let adapted = w.add(scaled_bt.matmul(l.a.t())?)?;
    let norm = row_norms(&adapted)?;
    let denom = match plant::is(Defect::DoraNormWithGradient) {
        true => norm,
        false => mlx_rs::stop_gradient(&norm)?,
    };
    let out = m.divide(&denom)?.as_dtype(x.dtype())?.multiply(&out)?;
    match &linear.bias {
        Some(b) => out.add(b),
        None => Ok(out),
    }
}

/// Planted (QLoRA): a quantized layer under a LoRA adapter computes its base output from
/// the dequantized weight.
pub fn planted_dequantized_base(linear: &Linear) -> bool {
    plant::is(Defect::QloraDequantizedBase) && linear.lora.borrow().is_some()
}

/// The plant's base output: `x @ dequantize(W).T` (+ bias).
pub fn dequantized_base(linear: &Linear, x: &Array) -> R<Array> {
    let y = x.matmul(dequantized_weight(linear)?.t())?;
    match &linear.bias {
        Some(b) => y.add(b),
        None => Ok(y),
    }
}
