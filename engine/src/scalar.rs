//! Python scalars in MLX expressions, as mlx-lm writes them.

use mlx_rs::error::Exception;
use mlx_rs::Array;

/// A Python float in an MLX expression: a scalar of the other operand's dtype (MLX's weak
/// scalars promote to the array's type instead of widening it).
pub fn weak(v: f64, like: &Array) -> Result<Array, Exception> {
    Array::from_f32(v as f32).as_dtype(like.dtype())
}
