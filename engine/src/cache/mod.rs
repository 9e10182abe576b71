//! KV caches. Each attention layer owns one; the model reads `offset` for RoPE and the mask.

pub mod fixed;
pub mod kv;
pub mod rotating;

pub use kv::KvCache;
pub use rotating::RotatingKvCache;

use mlx_rs::error::Exception;
use mlx_rs::Array;

/// What attention needs from a cache, whatever its layout.
pub trait Cache {
    /// Tokens stored so far (the position of the next token).
    fn offset(&self) -> i32;
    /// Appends this step's keys/values ([B, kv_heads, L, head_dim]) and returns all live ones.
    fn update_and_fetch(&mut self, keys: Array, values: Array)
        -> Result<(Array, Array), Exception>;
    /// Whether `trim` can drop tokens from the end.
    fn is_trimmable(&self) -> bool;
    /// Drops up to `n` tokens from the end; returns how many were dropped.
    fn trim(&mut self, n: i32) -> i32;
    /// The arrays that hold the cache's state (for eval).
    fn state(&self) -> Vec<&Array>;
    /// The attention mask for `n` new tokens, as mlx-lm's cache of this kind makes it;
    /// `window` is the attention window of the layer kind asking (None = full attention).
    fn make_mask(&self, n: i32, window: Option<i32>) -> Result<Mask, Exception>;
    /// The RoPE position of the next token (an array inside compiled steps).
    fn rope_offset(&self) -> RopeOffset {
        RopeOffset::Int(self.offset())
    }
    /// For callers that need the concrete cache (e.g. the compiled decode step).
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any;
}

/// A RoPE position: a plain integer, or an MLX array (so a compiled graph can be reused
/// at every position).
#[derive(Clone)]
pub enum RopeOffset {
    Int(i32),
    Array(Array),
}

/// An attention mask as mlx-lm passes it to SDPA.
#[derive(Clone)]
pub enum Mask {
    None,
    /// SDPA's built-in causal mode (bottom-right aligned).
    Causal,
    /// An explicit boolean mask (true = attend).
    Array(Array),
}

impl Mask {
    pub fn as_sdpa(&self) -> Option<mlx_rs::fast::ScaledDotProductAttentionMask<'_>> {
        use mlx_rs::fast::ScaledDotProductAttentionMask as M;
        match self {
            Mask::None => None,
            Mask::Causal => Some(M::Causal),
            Mask::Array(a) => Some(M::Array(a)),
        }
    }
}

/// mlx-lm's `create_causal_mask(N, offset, window_size)`: query i (at offset + i) sees key
/// j iff j ≤ offset + i and, with a window, offset + i < j + window.
pub fn causal_mask(n: i32, offset: i32, window: Option<i32>) -> Result<Array, Exception> {
    use mlx_rs::ops::arange;
    use mlx_rs::ops::indexing::{IndexOp, NewAxis};
    let rinds = arange::<_, i32>(0, offset + n, 1)?;
    let linds = if offset != 0 {
        arange::<_, i32>(offset, offset + n, 1)?
    } else {
        rinds.clone()
    };
    let linds = linds.index((.., NewAxis));
    let rinds = rinds.index((NewAxis, ..));
    let mut mask = linds.ge(&rinds)?;
    if let Some(w) = window {
        mask = mask.logical_and(linds.lt(rinds.add(Array::from_int(w))?)?)?;
    }
    Ok(mask)
}

/// Zeros with `like`'s batch, heads, head dim and dtype, and `positions` positions.
pub(crate) fn zeros_positions(like: &Array, positions: i32) -> Result<Array, Exception> {
    let shape = like.shape();
    mlx_rs::ops::zeros_dtype(&[shape[0], shape[1], positions, shape[3]], like.dtype())
}

/// The first `offset` positions of a cache buffer (the whole buffer once it is full).
pub(crate) fn live_positions(buf: &Array, offset: i32) -> Array {
    use mlx_rs::ops::indexing::{Ellipsis, IndexOp};
    if offset < buf.shape()[2] {
        buf.index((Ellipsis, ..offset, ..))
    } else {
        buf.clone()
    }
}
