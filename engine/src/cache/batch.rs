//! The batched KV cache of the batch lane, laid out like mlx-lm's `BatchKVCache`: rows
//! share one buffer [B, heads, positions, head dim] and one write position; shorter rows are
//! padded on the left, and the mask hides each row's padding. Rows join (`extend`: the
//! shorter side is left-padded so both end at the same position) and leave (`filter`: the
//! padding every remaining row shares is trimmed). RoPE gets each row's own position.

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::{Ellipsis, IndexOp, TryIndexMutOp};
use mlx_rs::ops::{concatenate, zeros_dtype};
use mlx_rs::Array;

use super::{Cache, Kv, KvCache, Mask, RopeOffset};

pub struct BatchKvCache {
    keys: Array,
    values: Array,
    /// Per row: pad positions at the front, and real tokens held.
    left_padding: Vec<i32>,
    lengths: Vec<i32>,
    /// The shared write position (every row occupies [0, idx)).
    idx: i32,
}

const STEP: i32 = 256;

fn left_pad(x: &Array, pad: i32) -> Result<Array, Exception> {
    if pad == 0 {
        return Ok(x.clone());
    }
    let s = x.shape();
    let zeros = zeros_dtype(&[s[0], s[1], pad, s[3]], x.dtype())?;
    concatenate(&[&zeros, x], 2)
}

impl BatchKvCache {
    /// Merges single-sequence caches (one per row, each holding its prompt) into a batch.
    pub fn merge(rows: &mut [&mut KvCache]) -> Result<Self, Exception> {
        let lengths: Vec<i32> = rows.iter().map(|c| c.offset()).collect();
        let idx = *lengths.iter().max().unwrap_or(&0);
        let (mut ks, mut vs) = (Vec::new(), Vec::new());
        for c in rows.iter() {
            let (k, v) = c
                .live()
                .ok_or_else(|| Exception::custom("an empty cache cannot join a batch"))?;
            let pad = idx - c.offset();
            ks.push(left_pad(&k, pad)?);
            vs.push(left_pad(&v, pad)?);
        }
        Ok(BatchKvCache {
            keys: concatenate(&ks, 0)?,
            values: concatenate(&vs, 0)?,
            left_padding: lengths.iter().map(|l| idx - l).collect(),
            lengths,
            idx,
        })
    }

    pub fn rows(&self) -> usize {
        self.lengths.len()
    }

    /// Row `row`'s first `len` real positions as a standard cache of its own (a copy: the
    /// batch buffers are not kept alive by it), for the prompt cache when the row leaves.
    pub fn row_cache(&self, row: usize, len: i32) -> Result<KvCache, Exception> {
        let len = len.min(self.lengths[row]);
        let (r, start) = (row as i32, self.left_padding[row]);
        let slice = |x: &Array| x.index((r..r + 1, .., start..start + len, ..));
        let mut cache = KvCache::new();
        cache.update_and_fetch(slice(&self.keys), slice(&self.values))?;
        Ok(cache)
    }

    /// Keeps only rows `keep` (in that order), trimming the padding they all share.
    pub fn filter(&mut self, keep: &[usize]) -> Result<(), Exception> {
        let index = Array::from_slice(
            &keep.iter().map(|&i| i as i32).collect::<Vec<_>>(),
            &[keep.len() as i32],
        );
        self.keys = self.keys.take_axis(&index, 0)?;
        self.values = self.values.take_axis(&index, 0)?;
        self.left_padding = keep.iter().map(|&i| self.left_padding[i]).collect();
        self.lengths = keep.iter().map(|&i| self.lengths[i]).collect();
        let shared = self.left_padding.iter().copied().min().unwrap_or(0);
        if shared > 0 {
            self.keys = self.keys.index((Ellipsis, shared.., ..));
            self.values = self.values.index((Ellipsis, shared.., ..));
            self.idx -= shared;
            self.left_padding.iter_mut().for_each(|p| *p -= shared);
        }
        Ok(())
    }

    /// Appends the rows of `other` after this batch's rows.
    pub fn extend(&mut self, other: BatchKvCache) -> Result<(), Exception> {
        let idx = self.idx.max(other.idx);
        let fit =
            |c: &BatchKvCache, x: &Array| left_pad(&x.index((Ellipsis, ..c.idx, ..)), idx - c.idx);
        self.keys = concatenate(&[fit(self, &self.keys)?, fit(&other, &other.keys)?], 0)?;
        self.values = concatenate(&[fit(self, &self.values)?, fit(&other, &other.values)?], 0)?;
        let (mine, theirs) = (idx - self.idx, idx - other.idx);
        self.left_padding.iter_mut().for_each(|p| *p += mine);
        self.left_padding
            .extend(other.left_padding.iter().map(|p| p + theirs));
        self.lengths.extend(other.lengths);
        self.idx = idx;
        Ok(())
    }
}

impl Cache for BatchKvCache {
    /// The shared write position (rows differ; see `rope_offset`).
    fn offset(&self) -> i32 {
        self.idx
    }

    fn rope_offset(&self) -> RopeOffset {
        RopeOffset::Array(Array::from_slice(
            &self.lengths,
            &[self.lengths.len() as i32],
        ))
    }

    fn update_and_fetch(&mut self, keys: Array, values: Array) -> Result<Kv, Exception> {
        let n = keys.shape()[2];
        if self.idx + n > self.keys.shape()[2] {
            let grow = (STEP + n - 1) / STEP * STEP;
            let s = self.keys.shape().to_vec();
            let more = |x: &Array, d: i32| -> Result<Array, Exception> {
                let z = zeros_dtype(&[s[0], s[1], grow, d], x.dtype())?;
                concatenate(&[&x.index((Ellipsis, ..self.idx, ..)), &z], 2)
            };
            self.keys = more(&self.keys, keys.shape()[3])?;
            self.values = more(&self.values, values.shape()[3])?;
        }
        let (at, end) = (self.idx, self.idx + n);
        self.keys.try_index_mut((Ellipsis, at..end, ..), &keys)?;
        self.values
            .try_index_mut((Ellipsis, at..end, ..), &values)?;
        self.idx = end;
        self.lengths.iter_mut().for_each(|l| *l += n);
        Ok(Kv::Dense(
            self.keys.index((Ellipsis, ..self.idx, ..)),
            self.values.index((Ellipsis, ..self.idx, ..)),
        ))
    }

    fn is_trimmable(&self) -> bool {
        false
    }

    fn trim(&mut self, _n: i32) -> i32 {
        0
    }

    fn state(&self) -> Vec<&Array> {
        vec![&self.keys, &self.values]
    }

    /// mlx-lm's `create_causal_mask(N, offset=idx, left_padding)`: causal, and each row's
    /// padding hidden; always an explicit [B, 1, N, idx + N] mask.
    fn make_mask(&self, n: i32, window: Option<i32>) -> Result<Mask, Exception> {
        if window.is_some() {
            return Err(Exception::custom(
                "the batch lane serves full-attention models only",
            ));
        }
        use mlx_rs::ops::arange;
        use mlx_rs::ops::indexing::NewAxis;
        let total = self.idx + n;
        let keys = arange::<_, i32>(0, total, 1)?;
        let queries = arange::<_, i32>(self.idx, total, 1)?.index((.., NewAxis));
        let causal = queries.ge(keys.index(NewAxis))?; // [N, total]
        let mut padding = self.left_padding.clone();
        if crate::plant::is(crate::plant::Defect::BatchUnmaskedPadding) {
            padding.iter_mut().for_each(|p| *p = 0);
        }
        let pad = Array::from_slice(&padding, &[padding.len() as i32]).reshape(&[-1, 1, 1, 1])?;
        let not_pad = keys.reshape(&[1, 1, 1, -1])?.ge(&pad)?; // [B, 1, 1, total]
        Ok(Mask::Array(
            causal.reshape(&[1, 1, n, total])?.logical_and(&not_pad)?,
        ))
    }

    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}
