//! The standard KV cache, laid out like mlx-lm's `KVCache`: buffers grow in steps of 256
//! positions, new keys are written with a slice update, and reads slice to the offset.

use mlx_rs::error::Exception;
use mlx_rs::ops::concatenate;
use mlx_rs::ops::indexing::{Ellipsis, IndexOp, TryIndexMutOp};
use mlx_rs::Array;

use super::{causal_mask, live_positions, zeros_positions, Cache, Mask};

#[derive(Default)]
pub struct KvCache {
    keys: Option<Array>,
    values: Option<Array>,
    offset: i32,
}

impl KvCache {
    pub const STEP: i32 = 256;

    pub fn new() -> Self {
        Self::default()
    }

    /// The whole buffers, if the next `n` tokens fit without growing them.
    pub fn buffers_with_room(&self, n: i32) -> Option<(&Array, &Array)> {
        let (k, v) = (self.keys.as_ref()?, self.values.as_ref()?);
        (self.offset + n <= k.shape()[2]).then_some((k, v))
    }

    /// Takes the buffers a compiled step produced after writing `n` tokens in place.
    pub fn advance_with(&mut self, keys: Array, values: Array, n: i32) {
        self.keys = Some(keys);
        self.values = Some(values);
        self.offset += n;
    }
}

impl Cache for KvCache {
    fn offset(&self) -> i32 {
        self.offset
    }

    fn update_and_fetch(
        &mut self,
        keys: Array,
        values: Array,
    ) -> Result<(Array, Array), Exception> {
        let prev = self.offset;
        let len = keys.shape()[2];
        let capacity = self.keys.as_ref().map_or(0, |k| k.shape()[2]);
        if self.keys.is_none() || prev + len > capacity {
            let n_steps = (Self::STEP + len - 1) / Self::STEP;
            let new_k = zeros_positions(&keys, n_steps * Self::STEP)?;
            let new_v = zeros_positions(&values, n_steps * Self::STEP)?;
            match (self.keys.take(), self.values.take()) {
                (Some(mut old_k), Some(mut old_v)) => {
                    if prev % Self::STEP != 0 {
                        old_k = old_k.index((Ellipsis, ..prev, ..));
                        old_v = old_v.index((Ellipsis, ..prev, ..));
                    }
                    self.keys = Some(concatenate(&[old_k, new_k], 2)?);
                    self.values = Some(concatenate(&[old_v, new_v], 2)?);
                }
                _ => {
                    self.keys = Some(new_k);
                    self.values = Some(new_v);
                }
            }
        }
        self.offset += len;
        let (k_buf, v_buf) = (self.keys.as_mut().unwrap(), self.values.as_mut().unwrap());
        k_buf.try_index_mut((Ellipsis, prev..self.offset, ..), &keys)?;
        v_buf.try_index_mut((Ellipsis, prev..self.offset, ..), &values)?;
        Ok((
            live_positions(k_buf, self.offset),
            live_positions(v_buf, self.offset),
        ))
    }

    fn is_trimmable(&self) -> bool {
        true
    }

    fn trim(&mut self, n: i32) -> i32 {
        let n = n.min(self.offset);
        self.offset -= n;
        n
    }

    fn state(&self) -> Vec<&Array> {
        self.keys.iter().chain(self.values.iter()).collect()
    }

    /// mlx-lm's `create_attention_mask(N, offset, return_array=False, window_size)`.
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }

    fn make_mask(&self, n: i32, window: Option<i32>) -> Result<Mask, Exception> {
        Ok(match window {
            Some(w) => Mask::Array(causal_mask(n, self.offset, Some(w))?),
            None if n == 1 => Mask::None,
            None => Mask::Causal,
        })
    }
}
