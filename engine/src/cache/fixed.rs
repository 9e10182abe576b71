//! The KV caches as a compiled decode step sees them: whole fixed-capacity buffers, with
//! the write position and the RoPE offset as MLX arrays, so one traced graph serves every
//! step of one layout. New keys land with a dynamic slice update into the whole buffer.
//!
//! A linear buffer (`KvCache`) is read over a static prefix of `bound` positions (the
//! offset + 1 rounded up, see `generate::compiled`) with a boolean mask of the live ones,
//! not over its whole capacity: on `small` the full 512-position buffer cost ~3 ms a step
//! over the 257–384 live positions. On the CPU backend that masked attention equals, bit
//! for bit, attention over the sliced keys (measured; the L1 gate and
//! `tests/compiled_decode.rs` re-check it through every compiled step). A full ring
//! (`RotatingKvCache`) is read whole, in ring order, with no mask, as mlx-lm's
//! `RotatingKVCache` returns it once full.

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::{Ellipsis, IndexOp};
use mlx_rs::{Array, Stream};

use super::{AttentionCache, Cache, Kv, Mask, RopeOffset};

/// How a cache enters the compiled step: its whole buffers and their form.
pub struct Compiled {
    pub keys: Array,
    pub values: Array,
    pub form: Form,
}

/// A linear buffer (the token written at the offset), or a full ring (written at `slot`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Form {
    Linear,
    Ring { slot: i32 },
}

/// What one compiled step's attention reads of a cache.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Attend {
    /// A linear buffer: its first `bound` positions (bound > offset), those past the
    /// offset masked out.
    Prefix { bound: i32 },
    /// A full ring: every slot, unmasked.
    Ring,
}

pub struct FixedKv {
    pub keys: Array,
    pub values: Array,
    /// int32 scalar: where the token's keys and values are written (the offset of a
    /// linear buffer, the slot of a ring).
    pub write_at: Array,
    /// int32 scalar: the RoPE position of the token being added.
    pub offset: Array,
    pub attend: Attend,
}

/// `src` with `update` written at `start` (an array) along `axis`.
pub fn slice_update_dynamic(
    src: &Array,
    update: &Array,
    start: &Array,
    axis: i32,
) -> Result<Array, Exception> {
    let stream = Stream::thread_local_or_default();
    let axes = [axis];
    // SAFETY: every handle passed is live for the call; on success `res` owns a new array
    // that `Array::from_ptr` takes over, on failure it is freed here.
    unsafe {
        let mut res = mlx_sys::mlx_array_new();
        let status = mlx_sys::mlx_slice_update_dynamic(
            &mut res,
            src.as_ptr(),
            update.as_ptr(),
            start.as_ptr(),
            axes.as_ptr(),
            axes.len(),
            stream.as_ptr(),
        );
        if status != 0 {
            mlx_sys::mlx_array_free(res);
            return Err(Exception::custom("mlx_slice_update_dynamic failed"));
        }
        Ok(Array::from_ptr(res))
    }
}

impl Cache for FixedKv {
    fn offset(&self) -> i32 {
        // Only meaningful as an array inside the compiled graph.
        -1
    }

    fn rope_offset(&self) -> RopeOffset {
        RopeOffset::Array(self.offset.clone())
    }

    fn is_trimmable(&self) -> bool {
        false
    }

    fn trim(&mut self, _n: i32) -> i32 {
        0
    }

    /// The whole buffers (what the cache keeps after the step).
    fn state(&self) -> Vec<&Array> {
        vec![&self.keys, &self.values]
    }

    /// A prefix: positions 0..=offset of it are live. A full ring no wider than the window
    /// needs no mask (`RotatingKVCache.make_mask` for one token); a ring wider than its
    /// window would need the rolled mask: not compiled.
    fn make_mask(&self, n: i32, window: Option<i32>) -> Result<Mask, Exception> {
        if n != 1 {
            return Err(Exception::custom(
                "the fixed-capacity cache serves one-token decode steps only",
            ));
        }
        match self.attend {
            Attend::Prefix { bound } => {
                let positions = mlx_rs::ops::arange::<_, i32>(0, bound, 1)?;
                Ok(Mask::Array(positions.le(&self.offset)?))
            }
            Attend::Ring if window.is_some_and(|w| self.keys.shape()[2] > w) => Err(
                Exception::custom("the compiled ring serves rings no wider than their window"),
            ),
            Attend::Ring => Ok(Mask::None),
        }
    }

    attention_views!();
}

impl AttentionCache for FixedKv {
    fn update_and_fetch(&mut self, keys: Array, values: Array) -> Result<Kv, Exception> {
        self.keys = slice_update_dynamic(&self.keys, &keys, &self.write_at, 2)?;
        self.values = slice_update_dynamic(&self.values, &values, &self.write_at, 2)?;
        Ok(match self.attend {
            Attend::Prefix { bound } => Kv::Dense(
                self.keys.index((Ellipsis, ..bound, ..)),
                self.values.index((Ellipsis, ..bound, ..)),
            ),
            Attend::Ring => Kv::Dense(self.keys.clone(), self.values.clone()),
        })
    }
}
