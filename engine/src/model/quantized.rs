//! Quantized weights as MLX stores them, in any of its modes (`nn.QuantizedLinear`,
//! `nn.QuantizedEmbedding`, `QuantizedSwitchLinear`): the packed weight, its scales, and
//! for affine its biases; the mode, group size and bits from the checkpoint's config or
//! inferred from the stored shapes (`Weights::quant_params`).

pub mod ops;

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype};

use crate::load::config::{QuantMode, QuantParams};
use crate::load::weights::Weights;
use crate::load::LoadError;
use crate::plant::{self, Defect};

type R<T> = Result<T, Exception>;

/// Which tensor of a quantized weight.
#[derive(Clone, Copy)]
enum PackedPart {
    /// The packed values: `in · bits / 32` uint32 columns.
    Weight,
    /// The scales, and affine's biases: one column per group of `group_size` inputs.
    Scales,
}

/// The stored shape of one part of a quantized weight whose dense shape is `shape`
/// ([..., out, in]), and how it follows from it (for the refusal's message).
fn packed(shape: &[i32], params: QuantParams, part: PackedPart) -> (Vec<i32>, String) {
    let mut stored = shape.to_vec();
    let in_dims = *shape.last().unwrap_or(&0);
    let (bits, group) = (params.bits, params.group_size);
    let last = match part {
        PackedPart::Weight => in_dims * bits / 32,
        PackedPart::Scales => in_dims / group.max(1),
    };
    if let Some(l) = stored.last_mut() {
        *l = last;
    }
    let how = format!(
        " (dense {shape:?}, quantized {} with {bits} bits, group size {group})",
        params.mode.name()
    );
    (stored, how)
}

/// Packed quantized weights (the scales, affine's biases, and how they were packed).
pub struct Quantized {
    pub scales: Array,
    pub biases: Option<Array>,
    pub params: QuantParams,
}

impl Quantized {
    /// `<prefix>.scales` (and `<prefix>.biases`, which only affine has), each
    /// [..., out, in / group_size] for a weight whose dense shape is `shape` ([..., out, in]).
    pub(crate) fn load(
        w: &mut Weights,
        prefix: &str,
        params: QuantParams,
        shape: &[i32],
    ) -> Result<Self, LoadError> {
        let (stored, how) = packed(shape, params, PackedPart::Scales);
        let biases = format!("{prefix}.biases");
        let biases = match (w.contains(&biases), params.mode) {
            (true, QuantMode::Affine) => Some(w.take_stored(&biases, &stored, &how)?),
            (false, QuantMode::Affine) => None,
            (true, mode) => {
                return Err(LoadError::Weights(format!(
                    "`{biases}`: {} quantization has no biases, but the checkpoint stores them",
                    mode.name()
                )))
            }
            (false, _) => None,
        };
        Ok(Quantized {
            scales: w.take_stored(&format!("{prefix}.scales"), &stored, &how)?,
            biases,
            params,
        })
    }

    /// `<prefix>.weight`, whose dense shape config.json makes `shape` ([..., out, in]), and
    /// its quantization when the checkpoint stores it quantized: then the packed weight is
    /// [..., out, in · bits / 32] and its scales (and affine's biases) [..., out, in /
    /// group_size]. A tensor of another shape is refused at load, naming it.
    pub(crate) fn load_weight(
        w: &mut Weights,
        prefix: &str,
        shape: &[i32],
    ) -> Result<(Array, Option<Self>), LoadError> {
        let name = format!("{prefix}.weight");
        let in_dims = *shape.last().unwrap_or(&0);
        let Some(params) = w.quant_params(prefix, in_dims)? else {
            return Ok((w.take_shaped(&name, shape)?, None));
        };
        let quantized = Quantized::load(w, prefix, params, shape)?;
        let (stored, how) = packed(shape, params, PackedPart::Weight);
        Ok((w.take_stored(&name, &stored, &how)?, Some(quantized)))
    }
    /// `x @ dequantize(W).T` through the fused quantized matmul.
    pub fn matmul_t(&self, x: &Array, weight: &Array) -> R<Array> {
        ops::quantized_matmul(
            x,
            weight,
            &self.scales,
            self.biases.as_ref(),
            true,
            self.params,
        )
    }

    /// Rows `ids` of the table, dequantized (`QuantizedEmbedding.__call__`).
    pub fn rows(&self, weight: &Array, ids: &Array) -> R<Array> {
        let biases = self
            .biases
            .as_ref()
            .map(|b| b.take_axis(ids, 0))
            .transpose()?;
        ops::dequantize(
            &weight.take_axis(ids, 0)?,
            &self.scales.take_axis(ids, 0)?,
            biases.as_ref(),
            self.params,
            self.planted_rows_dtype(),
        )
    }

    /// The dtype `rows` come out in: MLX's dequantize gives the scales' dtype for affine
    /// and bfloat16 for the floating-point modes (whose scales are uint8).
    pub fn rows_dtype(&self) -> Dtype {
        match (self.params.mode, self.planted_rows_dtype()) {
            (_, Some(d)) => d,
            (QuantMode::Affine, None) => self.scales.dtype(),
            (_, None) => Dtype::Bfloat16,
        }
    }

    /// Planted: the floating-point modes' rows come out in float32, as if they took the
    /// model's float dtype, not MLX's bfloat16.
    fn planted_rows_dtype(&self) -> Option<Dtype> {
        (self.params.mode != QuantMode::Affine && plant::is(Defect::QuantFpRowsFloat32))
            .then_some(Dtype::Float32)
    }

    /// The unpacked input width of a packed weight `cols` uint32 columns wide.
    pub fn unpacked_width(&self, cols: i32) -> i32 {
        cols * 32 / self.params.bits
    }
}
