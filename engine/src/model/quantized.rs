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

/// Packed quantized weights (the scales, affine's biases, and how they were packed).
pub struct Quantized {
    pub scales: Array,
    pub biases: Option<Array>,
    pub params: QuantParams,
}

impl Quantized {
    /// `<prefix>.scales` (and `<prefix>.biases`, which only affine has).
    pub(crate) fn load(
        w: &mut Weights,
        prefix: &str,
        params: QuantParams,
    ) -> Result<Self, LoadError> {
        let biases = format!("{prefix}.biases");
        let biases = match (w.contains(&biases), params.mode) {
            (true, QuantMode::Affine) => Some(w.take(&biases)?),
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
            scales: w.take(&format!("{prefix}.scales"))?,
            biases,
            params,
        })
    }

    /// `<prefix>.weight`, and its quantization when the checkpoint stores it quantized. A
    /// dense weight whose width (`what`: its input, its rows) disagrees with config.json
    /// would load, then fail every forward; say so at load instead, naming the tensor.
    pub(crate) fn load_weight(
        w: &mut Weights,
        prefix: &str,
        dims: i32,
        what: &str,
    ) -> Result<(Array, Option<Self>), LoadError> {
        let quantized = match w.quant_params(prefix, dims)? {
            Some(params) => Some(Quantized::load(w, prefix, params)?),
            None => None,
        };
        let weight = w.take(&format!("{prefix}.weight"))?;
        if quantized.is_none() && (weight.ndim() != 2 || weight.shape()[1] != dims) {
            return Err(LoadError::Weights(format!(
                "`{prefix}.weight` has shape {:?}, but config.json makes {what} {dims} wide: \
                 the weights do not belong to this config",
                weight.shape()
            )));
        }
        Ok((weight, quantized))
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
