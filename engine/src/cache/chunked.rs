//! mlx-lm 0.32.2's `ChunkedKVCache` (Llama 4's chunked-attention layers): a standard cache
//! whose front is dropped so that at most `chunk` positions stay live. Its buffers hold
//! positions `start..offset`; at the start of each forward (`maybe_trim_front`, which mlx-lm
//! runs before the model's layers and this cache runs on its first write of the step) the
//! oldest are cut once more than `chunk` are live. The mask (`chunked_mask`) lets a query
//! see the keys of its own chunk only (positions // chunk equal), causally.
//!
//! What it does not do, and says so: it is never stored (no snapshot: the prompt cache keeps
//! it only as the live object, the kv-store and the SSD tier skip it), never batched (the
//! batch lane refuses the model), never quantized (`--kv-bits` leaves it dense, as mlx-lm's
//! `maybe_quantize_kv_cache` does: it has no `to_quantized`), and gives positions back
//! (`trim`) only while nothing has been cut from its front — past that, a trimmed cache
//! would lack keys its chunk needs, so speculative decoding and prompt-cache branching
//! refuse it.

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::{Ellipsis, IndexOp, NewAxis};
use mlx_rs::ops::{abs, arange};
use mlx_rs::Array;

use super::parts::{self, Parts};
use super::{AttentionCache, Cache, Kv, Mask};

/// `ChunkedKVCache(chunk_size)`.
pub struct ChunkedKvCache {
    keys: Option<Parts>,
    values: Option<Parts>,
    offset: i32,
    /// The position of the first key held (`start_position`).
    start: i32,
    chunk: i32,
}

impl ChunkedKvCache {
    pub const STEP: i32 = 256;

    pub fn new(chunk: i32) -> Self {
        ChunkedKvCache {
            keys: None,
            values: None,
            offset: 0,
            start: 0,
            chunk,
        }
    }

    /// `start_position` after this step's `maybe_trim_front`.
    fn trimmed_start(&self) -> i32 {
        match self.keys {
            Some(_) if self.offset - self.start > self.chunk => self.offset - self.chunk,
            _ => self.start,
        }
    }

    /// `maybe_trim_front`: keep the newest `chunk` live positions.
    fn trim_front(&mut self) {
        let start = self.trimmed_start();
        let (trim, valid) = (start - self.start, self.offset - self.start);
        if trim == 0 {
            return;
        }
        let cut = |p: &Parts| parts::slice(p, |x| x.index((Ellipsis, trim..valid, ..)));
        self.keys = self.keys.as_ref().map(cut);
        self.values = self.values.as_ref().map(cut);
        self.start = start;
    }
}

/// Llama 4's chunk mask for `n` queries from `offset` over keys `start..offset + n`:
/// `(|k // chunk − q // chunk| == 0) & (k ≤ q)`, as `LlamaModel.__call__` builds it.
pub fn chunked_mask(start: i32, offset: i32, n: i32, chunk: i32) -> Result<Array, Exception> {
    let end = offset + n;
    let c = Array::from_int(chunk);
    let linds = arange::<_, i32>(start, end, 1)?;
    let rinds = arange::<_, i32>(offset, end, 1)?.index((.., NewAxis));
    let block = abs(linds.floor_divide(&c)?.subtract(rinds.floor_divide(&c)?)?)?;
    let same = block.eq(Array::from_int(0))?;
    same.logical_and(linds.le(&rinds)?)
}

impl Cache for ChunkedKvCache {
    fn offset(&self) -> i32 {
        self.offset
    }

    /// Exact only while nothing was cut from the front (see the module header).
    fn is_trimmable(&self) -> bool {
        self.start == 0
    }

    fn trim(&mut self, n: i32) -> i32 {
        if self.start != 0 {
            return 0;
        }
        let n = n.min(self.offset);
        self.offset -= n;
        n
    }

    fn state(&self) -> Vec<&Array> {
        parts::kv_state(&self.keys, &self.values)
    }

    /// The chunk mask from this step's start (after its front trim), whatever `window`.
    fn make_mask(&self, n: i32, _window: Option<i32>) -> Result<Mask, Exception> {
        let mask = chunked_mask(self.trimmed_start(), self.offset, n, self.chunk)?;
        Ok(Mask::Array(mask))
    }

    super::attention_views!();
}

impl AttentionCache for ChunkedKvCache {
    fn update_and_fetch(&mut self, keys: Array, values: Array) -> Result<Kv, Exception> {
        self.trim_front();
        let prev = self.offset - self.start;
        let cut = prev % Self::STEP != 0;
        let like = (&keys, &values);
        parts::reserve_kv(
            &mut self.keys,
            &mut self.values,
            like,
            prev,
            Self::STEP,
            None,
            cut,
        )?;
        self.offset += keys.shape()[2];
        let (new_k, new_v) = (vec![keys], vec![values]);
        let end = self.offset - self.start;
        parts::write_kv(
            (&mut self.keys, &mut self.values),
            prev,
            (&new_k, &new_v),
            |p| parts::head(p, end),
            None,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(c: &mut ChunkedKvCache, n: i32) {
        let kv = Array::zeros::<f32>(&[1, 1, n, 2]).unwrap();
        c.update_and_fetch(kv.clone(), kv).unwrap();
    }

    /// Queries 9 and 10 over keys 6..11 with chunks of 4: only keys 8 ≤ k ≤ q attend.
    #[test]
    fn the_mask_keeps_the_query_s_own_chunk_causally() {
        let m = chunked_mask(6, 9, 2, 4).unwrap();
        let got: Vec<bool> = m.as_slice::<bool>().to_vec();
        let want = [
            false, false, true, true, false, //
            false, false, true, true, true,
        ];
        assert_eq!(got, want);
    }

    /// The front is cut to `chunk` live positions at the next write; from then on the cache
    /// refuses to give positions back (the keys its chunk would need are gone).
    #[test]
    fn the_front_is_cut_and_trimming_stops_after_it() {
        let mut c = ChunkedKvCache::new(4);
        step(&mut c, 3);
        assert!(c.is_trimmable());
        assert_eq!(c.trim(1), 1);
        step(&mut c, 4);
        assert_eq!((c.offset(), c.start), (6, 0));
        assert_eq!(c.trimmed_start(), 2);
        step(&mut c, 1);
        assert_eq!((c.offset(), c.start), (7, 2));
        assert!(!c.is_trimmable());
        assert_eq!(c.trim(1), 0);
        assert_eq!(c.offset(), 7);
    }
}
