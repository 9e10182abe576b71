//! LoRA on stacked experts, as mlx-lm 0.32.2's `LoRASwitchLinear` computes it: each expert
//! e has its own low-rank pair, A[e] of shape [rank, in] and B[e] of shape [out, rank]
//! (stacked: A [experts, rank, in], B [experts, out, rank], both f32), gathered per routing
//! entry like the experts' weights:
//!
//!   y = switch(x, inds) + scale · gather_mm(gather_mm(x, A[inds]ᵀ), B[inds]ᵀ)
//!
//! the update cast to x's dtype, the same `sorted` flag as the experts' own gather.
//! The adapter is the `Lora` of `layers.rs` (same fields; only the shapes differ).

use mlx_rs::error::Exception;
use mlx_rs::ops::gather_mm;
use mlx_rs::Array;

use super::SwitchLinear;
use crate::model::layers::{dropped, weak, Lora};
use crate::plant::{self, Defect};

type R<T> = Result<T, Exception>;

impl SwitchLinear {
    /// The experts' input width (of the dense weight, or unpacked from a quantized one).
    pub fn input_dims(&self) -> i32 {
        let cols = self.weight.shape()[2];
        match &self.quantized {
            Some(q) => cols * 32 / q.params.bits,
            None => cols,
        }
    }

    pub fn output_dims(&self) -> i32 {
        self.weight.shape()[1]
    }

    pub fn num_experts(&self) -> i32 {
        self.weight.shape()[0]
    }
}

/// `y` (the experts' output for x through `indices`) plus the adapter's update.
pub fn add_update(lora: &Lora, y: &Array, x: &Array, indices: &Array, sorted: bool) -> R<Array> {
    let input = dropped(x, &lora.dropout)?;
    let z = gather_mm(&input, lora.a.swap_axes(-1, -2)?, None, indices, sorted)?;
    let z = gather_mm(&z, lora.b.swap_axes(-1, -2)?, None, indices, sorted)?;
    let mut z = z.multiply(weak(lora.scale as f64, &z)?)?;
    if plant::is(Defect::SwitchLoraScaleTwice) {
        z = z.multiply(weak(lora.scale as f64, &z)?)?;
    }
    y.add(z.as_dtype(x.dtype())?)
}
