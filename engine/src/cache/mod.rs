//! KV caches. Each attention layer owns one; the model reads `offset` for RoPE and the mask.

pub mod kv;

pub use kv::KvCache;

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
}
