//! Bit-exact comparison of an MLX array with golden bytes. "Bit-exact" means the bytes are
//! identical; the report also gives max |Δ| and where, to make a failure readable.

use half::{bf16, f16};
use mlx_rs::{Array, Dtype};

use crate::goldens::TensorEntry;

#[derive(Debug, Clone, PartialEq)]
pub struct Comparison {
    pub bit_exact: bool,
    pub shape_matches: bool,
    /// Largest absolute difference (as f64) and its flat index.
    pub max_abs_diff: f64,
    pub max_at: Option<usize>,
    /// First flat index whose bits differ.
    pub first_mismatch: Option<usize>,
    pub len: usize,
}

impl std::fmt::Display for Comparison {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if !self.shape_matches {
            return write!(f, "shape differs");
        }
        if self.bit_exact {
            return write!(f, "bit-exact ({} values)", self.len);
        }
        write!(
            f,
            "NOT bit-exact: max |Δ| = {:e} at {}, first differing value at {}",
            self.max_abs_diff,
            self.max_at.unwrap_or(0),
            self.first_mismatch.unwrap_or(0)
        )
    }
}

/// The array's values as f64 plus their raw little-endian bytes.
pub fn values_and_bytes(array: &Array) -> Result<(Vec<f64>, Vec<u8>), mlx_rs::error::Exception> {
    array.eval()?;
    Ok(match array.dtype() {
        Dtype::Float32 => {
            let v = array.as_slice::<f32>();
            (
                v.iter().map(|&x| x as f64).collect(),
                v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            )
        }
        Dtype::Float16 => {
            let v = array.as_slice::<f16>();
            (
                v.iter().map(|x| x.to_f64()).collect(),
                v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            )
        }
        Dtype::Bfloat16 => {
            let v = array.as_slice::<bf16>();
            (
                v.iter().map(|x| x.to_f64()).collect(),
                v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            )
        }
        Dtype::Uint32 => {
            let v = array.as_slice::<u32>();
            (
                v.iter().map(|&x| x as f64).collect(),
                v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            )
        }
        Dtype::Int32 => {
            let v = array.as_slice::<i32>();
            (
                v.iter().map(|&x| x as f64).collect(),
                v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            )
        }
        other => {
            return Err(mlx_rs::error::Exception::custom(format!(
                "compare: dtype {other:?} not supported"
            )))
        }
    })
}

fn decode(dtype: &str, bytes: &[u8]) -> Vec<f64> {
    match dtype {
        "float32" => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
            .collect(),
        "float16" => bytes
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes(c.try_into().unwrap()).to_f64())
            .collect(),
        "bfloat16" => bytes
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes(c.try_into().unwrap()).to_f64())
            .collect(),
        "uint32" => bytes
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()) as f64)
            .collect(),
        "int32" => bytes
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap()) as f64)
            .collect(),
        _ => Vec::new(),
    }
}

/// Compares `ours` with a golden tensor, bit for bit.
pub fn compare(
    ours: &Array,
    entry: &TensorEntry,
    golden: &[u8],
) -> Result<Comparison, mlx_rs::error::Exception> {
    let (values, bytes) = values_and_bytes(ours)?;
    let expected = decode(&entry.dtype, golden);
    let shape_matches = ours.shape() == entry.shape.as_slice() && expected.len() == values.len();
    let width = bytes.len().checked_div(values.len()).unwrap_or(1).max(1);
    let mut cmp = Comparison {
        bit_exact: shape_matches && bytes == golden,
        shape_matches,
        max_abs_diff: 0.0,
        max_at: None,
        first_mismatch: None,
        len: values.len(),
    };
    if shape_matches {
        for (i, (a, b)) in values.iter().zip(&expected).enumerate() {
            if cmp.first_mismatch.is_none()
                && bytes[i * width..(i + 1) * width] != golden[i * width..(i + 1) * width]
            {
                cmp.first_mismatch = Some(i);
            }
            let d = (a - b).abs();
            let d = if d.is_nan() { f64::INFINITY } else { d };
            if d > cmp.max_abs_diff {
                cmp.max_abs_diff = d;
                cmp.max_at = Some(i);
            }
        }
    }
    Ok(cmp)
}

/// Builds an MLX array from a golden tensor's bytes (for feeding stored inputs back in).
pub fn to_array(entry: &TensorEntry, bytes: &[u8]) -> Array {
    let shape = &entry.shape;
    match entry.dtype.as_str() {
        "float32" => Array::from_slice(
            &bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect::<Vec<_>>(),
            shape,
        ),
        "uint32" => Array::from_slice(
            &bytes
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
                .collect::<Vec<_>>(),
            shape,
        ),
        "int32" => Array::from_slice(
            &bytes
                .chunks_exact(4)
                .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
                .collect::<Vec<_>>(),
            shape,
        ),
        "float16" => Array::from_slice(
            &bytes
                .chunks_exact(2)
                .map(|c| f16::from_le_bytes(c.try_into().unwrap()))
                .collect::<Vec<_>>(),
            shape,
        ),
        "bfloat16" => Array::from_slice(
            &bytes
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes(c.try_into().unwrap()))
                .collect::<Vec<_>>(),
            shape,
        ),
        other => panic!("to_array: unsupported golden dtype {other}"),
    }
}
