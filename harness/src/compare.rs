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

/// The element types goldens hold: how to read them as f64 and as little-endian bytes.
trait Element: mlx_rs::ArrayElement + Copy {
    const WIDTH: usize;
    fn to_f64(self) -> f64;
    fn le_bytes(self) -> Vec<u8>;
    fn from_le(bytes: &[u8]) -> Self;
}

macro_rules! element {
    ($t:ty, $width:expr, $to_f64:expr) => {
        impl Element for $t {
            const WIDTH: usize = $width;
            fn to_f64(self) -> f64 {
                $to_f64(self)
            }
            fn le_bytes(self) -> Vec<u8> {
                self.to_le_bytes().to_vec()
            }
            fn from_le(bytes: &[u8]) -> Self {
                <$t>::from_le_bytes(bytes.try_into().expect("chunk of the element width"))
            }
        }
    };
}

element!(f32, 4, |x: f32| x as f64);
element!(f16, 2, |x: f16| x.to_f64());
element!(bf16, 2, |x: bf16| x.to_f64());
element!(u32, 4, |x: u32| x as f64);
element!(i32, 4, |x: i32| x as f64);

fn values_and_bytes_of<T: Element>(array: &Array) -> (Vec<f64>, Vec<u8>) {
    let v = array.as_slice::<T>();
    (
        v.iter().map(|&x| x.to_f64()).collect(),
        v.iter().flat_map(|&x| x.le_bytes()).collect(),
    )
}

fn decode_as<T: Element>(bytes: &[u8]) -> Vec<f64> {
    bytes
        .chunks_exact(T::WIDTH)
        .map(|c| T::from_le(c).to_f64())
        .collect()
}

/// The array's values as f64 plus their raw little-endian bytes.
pub fn values_and_bytes(array: &Array) -> Result<(Vec<f64>, Vec<u8>), mlx_rs::error::Exception> {
    // Row-major first: a gradient can come out as a transposed view (x·Wᵀ's, of W).
    let array = &array.contiguous()?;
    array.eval()?;
    Ok(match array.dtype() {
        Dtype::Float32 => values_and_bytes_of::<f32>(array),
        Dtype::Float16 => values_and_bytes_of::<f16>(array),
        Dtype::Bfloat16 => values_and_bytes_of::<bf16>(array),
        Dtype::Uint32 => values_and_bytes_of::<u32>(array),
        Dtype::Int32 => values_and_bytes_of::<i32>(array),
        other => {
            return Err(mlx_rs::error::Exception::custom(format!(
                "compare: dtype {other:?} not supported"
            )))
        }
    })
}

/// Golden bytes of dtype `dtype` (the name the oracle scripts write) as f64 values.
fn decode(dtype: &str, bytes: &[u8]) -> Vec<f64> {
    match dtype {
        "float32" => decode_as::<f32>(bytes),
        "float16" => decode_as::<f16>(bytes),
        "bfloat16" => decode_as::<bf16>(bytes),
        "uint32" => decode_as::<u32>(bytes),
        "int32" => decode_as::<i32>(bytes),
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
