//! The batched sliding-window cache of the batch lane, laid out like mlx-lm 0.32.2's
//! `BatchRotatingKVCache`: one ring [B, heads, ≤ max_size, head dim] with one write index
//! for every row, each row's real positions right-aligned (left padding, per row), and the
//! ring's `rotated` state. Rows join by mlx-lm's `merge` (each single-sequence ring put in
//! temporal order, its newest min(offset, max_size) positions kept) and `extend` (both
//! sides put in temporal order when their rings differ, then right-aligned to the longer
//! write index), and leave by `filter` (rows taken, nothing trimmed). One-token steps write
//! in place and rotate; the mask (`make_mask`) is causal, windowed, hides each row's
//! padding and is rolled with the ring once it has wrapped. Dense K/V only (mlx-lm's
//! `to_quantized` is not implemented for it either).

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::{Ellipsis, IndexOp, NewAxis, TryIndexMutOp};
use mlx_rs::ops::{arange, concatenate, zeros_dtype};
use mlx_rs::Array;

use super::{RotatingKvCache, KIND as ROTATING_KIND};
use crate::cache::parts::{cat_rows, empty_rows, pad, take_rows};
use crate::cache::{ints, meta_i32, meta_i32s, snapshot_of};
use crate::cache::{AttentionCache, Cache, Kv, Mask, Meta, RopeOffset, Snapshot};

/// The kind tag of its snapshots.
pub const KIND: &str = "batch-rotating";

pub struct BatchRotatingKvCache {
    keys: Option<Array>,
    values: Option<Array>,
    /// Per row: pad positions at the front of its window (may go negative once trimmed).
    left_padding: Vec<i32>,
    /// Per row: tokens seen (its RoPE position).
    offset: Vec<i32>,
    max_size: i32,
    /// The ring's write index.
    idx: i32,
    /// mlx-lm's `_offset`: positions written into this batch's buffer.
    written: i32,
    rotated: bool,
}

const STEP: i32 = 256;

/// The last `n` positions (axis 2) of `x` (Python's `x[..., -n:, :]`; n > 0).
fn last(x: &Array, n: i32) -> Array {
    let len = x.shape()[2];
    x.index((Ellipsis, (len - n).., ..))
}

/// `mx.roll(x, shift, axis=2)` (positions move to higher indices).
fn roll_positions(x: &Array, shift: i32) -> Result<Array, Exception> {
    let len = x.shape()[2];
    let s = shift.rem_euclid(len.max(1));
    if s == 0 {
        return Ok(x.clone());
    }
    concatenate(
        &[
            x.index((Ellipsis, (len - s).., ..)),
            x.index((Ellipsis, ..(len - s), ..)),
        ],
        2,
    )
}

/// `mx.roll(mask, shift, axis=-1)`.
fn roll_last(x: &Array, shift: i32) -> Result<Array, Exception> {
    let len = x.shape()[x.ndim() - 1];
    let s = shift.rem_euclid(len.max(1));
    if s == 0 {
        return Ok(x.clone());
    }
    concatenate(
        &[
            x.index((Ellipsis, (len - s)..)),
            x.index((Ellipsis, ..(len - s))),
        ],
        -1,
    )
}

/// A single-sequence ring as mlx-lm's merge reads it: (its newest positions in temporal
/// order, keys and values; its offset), or None when it holds nothing.
type Ring = (Option<(Array, Array)>, i32);

fn ring_of(c: &dyn Cache, max_size: i32) -> Result<Ring, Exception> {
    if c.kind() != Some(ROTATING_KIND) {
        return Err(Exception::custom("a rotating cache's snapshot expected"));
    }
    let Some(s) = c.snapshot() else {
        return Ok((None, 0));
    };
    let (m, keep, idx) = (
        meta_i32(&s.meta, "maxSize")?,
        meta_i32(&s.meta, "keep")?,
        meta_i32(&s.meta, "idx")?,
    );
    if s.quant.is_some() {
        return Err(Exception::custom(
            "a quantized sliding-window cache cannot join a batch (mlx-lm's \
             BatchRotatingKVCache has no quantization)",
        ));
    }
    if m != max_size || keep != 0 {
        return Err(Exception::custom(
            "sliding-window caches join a batch only with the same window and no kept prefix",
        ));
    }
    let offset = s.offset;
    let order = |v: &Array| -> Result<Array, Exception> {
        // RotatingKVCache._temporal_order (keep 0).
        let len = v.shape()[2];
        if idx == len {
            Ok(v.clone())
        } else if idx < offset {
            concatenate(
                &[
                    v.index((Ellipsis, idx.., ..)),
                    v.index((Ellipsis, ..idx, ..)),
                ],
                2,
            )
        } else {
            Ok(v.index((Ellipsis, ..idx, ..)))
        }
    };
    let l = offset.min(max_size);
    let (k, v) = (&s.tensors[0], &s.tensors[1]);
    Ok((Some((last(&order(k)?, l), last(&order(v)?, l))), offset))
}

impl BatchRotatingKvCache {
    /// mlx-lm's `BatchRotatingKVCache.merge` of single-sequence rings (one per row).
    /// `max_size` is the window of the ring it is reached through.
    pub fn merge(max_size: i32, rows: &[&dyn Cache]) -> Result<Self, Exception> {
        if rows.is_empty() {
            return Err(Exception::custom("no rows to merge"));
        }
        let rings: Vec<Ring> = rows
            .iter()
            .map(|c| ring_of(*c, max_size))
            .collect::<Result<_, _>>()?;
        let lengths: Vec<i32> = rings
            .iter()
            .map(|(kv, _)| kv.as_ref().map_or(0, |(k, _)| k.shape()[2]))
            .collect();
        let longest = *lengths.iter().max().unwrap_or(&0);
        let mut cache = BatchRotatingKvCache {
            keys: None,
            values: None,
            left_padding: lengths.iter().map(|l| longest - l).collect(),
            offset: rings.iter().map(|r| r.1).collect(),
            max_size,
            idx: longest,
            written: longest,
            rotated: false,
        };
        let Some((lk, lv)) = rings.iter().find_map(|r| r.0.clone()) else {
            cache.left_padding = vec![0; rows.len()];
            return Ok(cache);
        };
        let (mut ks, mut vs) = (Vec::new(), Vec::new());
        for ((kv, _), len) in rings.iter().zip(&lengths) {
            let (k, v) = match kv {
                Some((k, v)) => (vec![k.clone()], vec![v.clone()]),
                None => (
                    empty_rows(&vec![lk.clone()], 1)?,
                    empty_rows(&vec![lv.clone()], 1)?,
                ),
            };
            ks.push(pad(&k, longest - len, false)?);
            vs.push(pad(&v, longest - len, false)?);
        }
        cache.keys = Some(cat_rows(&ks)?.remove(0));
        cache.values = Some(cat_rows(&vs)?.remove(0));
        Ok(cache)
    }

    /// mlx-lm's `from_state` (what `extend` reads the other batch through).
    pub fn from_state(s: Snapshot) -> Result<Self, Exception> {
        if s.kind != KIND {
            return Err(Exception::custom("a batch ring's snapshot expected"));
        }
        let mut tensors = s.tensors.into_iter();
        let (keys, values) = (tensors.next(), tensors.next());
        Ok(BatchRotatingKvCache {
            keys,
            values,
            left_padding: meta_i32s(&s.meta, "leftPadding")?,
            offset: meta_i32s(&s.meta, "offsets")?,
            max_size: meta_i32(&s.meta, "maxSize")?,
            idx: meta_i32(&s.meta, "idx")?,
            written: s.offset,
            rotated: s.meta.get("rotated").and_then(|v| v.as_bool()) == Some(true),
        })
    }

    pub fn rows(&self) -> usize {
        self.offset.len()
    }

    /// `_temporal_order`: the ring rolled back so its oldest slot comes first.
    fn temporal_order(&mut self) -> Result<(), Exception> {
        if self.rotated {
            if let (Some(k), Some(v)) = (&self.keys, &self.values) {
                let (k, v) = (roll_positions(k, -self.idx)?, roll_positions(v, -self.idx)?);
                self.idx = k.shape()[2];
                self.keys = Some(k);
                self.values = Some(v);
            }
            self.rotated = false;
        }
        Ok(())
    }

    /// mlx-lm's `extract`: row `row` as a single-sequence ring in temporal order; `len`
    /// below its offset trims the difference where the ring can give it back.
    pub fn row_cache(&self, row: usize, len: i32) -> Result<RotatingKvCache, Exception> {
        let offset = self.offset[row];
        let (Some(k), Some(v)) = (&self.keys, &self.values) else {
            return Ok(RotatingKvCache::new(self.max_size));
        };
        let r = row as i32;
        let (mut k, mut v) = (
            k.index((r..r + 1, .., .., ..)),
            v.index((r..r + 1, .., .., ..)),
        );
        let mut idx = self.idx;
        if self.rotated {
            k = roll_positions(&k, -idx)?;
            v = roll_positions(&v, -idx)?;
            idx = self.max_size;
        }
        let pad = self.left_padding[row].max(0);
        let (k, v) = (
            k.index((Ellipsis, pad..idx, ..)),
            v.index((Ellipsis, pad..idx, ..)),
        );
        let n = k.shape()[2];
        let mut ring =
            RotatingKvCache::from_parts(vec![k], vec![v], offset, self.max_size, 0, n, None);
        if len < offset {
            if !ring.is_trimmable() {
                return Err(Exception::custom(
                    "a sliding-window row that has wrapped cannot give tokens back",
                ));
            }
            ring.trim(offset - len);
        }
        Ok(ring)
    }

    /// Keeps only rows `keep` (in that order).
    pub fn keep_rows(&mut self, keep: &[usize]) -> Result<(), Exception> {
        if let (Some(k), Some(v)) = (&self.keys, &self.values) {
            self.keys = Some(take_rows(&vec![k.clone()], keep)?.remove(0));
            self.values = Some(take_rows(&vec![v.clone()], keep)?.remove(0));
        }
        self.offset = keep.iter().map(|&i| self.offset[i]).collect();
        self.left_padding = keep.iter().map(|&i| self.left_padding[i]).collect();
        Ok(())
    }

    /// mlx-lm's `extend`: appends the rows of `other` after this batch's rows.
    pub fn extend_rows(&mut self, other: &mut BatchRotatingKvCache) -> Result<(), Exception> {
        if self.keys.is_none() && other.keys.is_none() {
            self.left_padding.extend(other.left_padding.iter().copied());
            self.offset.extend(other.offset.iter().copied());
            return Ok(());
        }
        if self.rotated != other.rotated || self.idx != other.idx {
            self.temporal_order()?;
            other.temporal_order()?;
        }
        let max_idx = self.idx.max(other.idx);
        let len = |c: &BatchRotatingKvCache| c.keys.as_ref().map_or(0, |k| k.shape()[2]);
        let widest = len(self).max(len(other));
        let like_k = self.keys.clone().or_else(|| other.keys.clone()).unwrap();
        let like_v = self
            .values
            .clone()
            .or_else(|| other.values.clone())
            .unwrap();
        let pad = |c: &BatchRotatingKvCache, x: &Option<Array>, like: &Array| {
            let left = max_idx - c.idx;
            let mut x = match x {
                Some(x) => x.clone(),
                None => empty_rows(&vec![like.clone()], c.rows() as i32)?.remove(0),
            };
            let mut right = widest - x.shape()[2] - left;
            if right < 0 {
                x = x.index((Ellipsis, ..(x.shape()[2] + right), ..));
                right = 0;
            }
            let x = pad(&vec![x], left, false)?;
            Ok::<_, Exception>(pad(&x, right, true)?.remove(0))
        };
        let k = cat_rows(&[
            vec![pad(self, &self.keys, &like_k)?],
            vec![pad(other, &other.keys, &like_k)?],
        ])?;
        let v = cat_rows(&[
            vec![pad(self, &self.values, &like_v)?],
            vec![pad(other, &other.values, &like_v)?],
        ])?;
        let (mine, theirs) = (max_idx - self.idx, max_idx - other.idx);
        self.left_padding.iter_mut().for_each(|p| *p += mine);
        self.left_padding
            .extend(other.left_padding.iter().map(|p| p + theirs));
        self.offset.extend(other.offset.iter().copied());
        self.keys = k.into_iter().next();
        self.values = v.into_iter().next();
        self.idx = max_idx;
        self.written = self.written.max(other.written);
        Ok(())
    }

    /// `_update_concat` (several tokens per row; rows with no right padding).
    fn update_concat(&mut self, keys: Array, values: Array) -> Result<Kv, Exception> {
        let n = keys.shape()[2];
        match (self.keys.take(), self.values.take()) {
            (Some(k), Some(v)) => {
                self.keys = Some(k);
                self.values = Some(v);
                self.temporal_order()?;
                let (mut k, mut v) = (self.keys.take().unwrap(), self.values.take().unwrap());
                if k.shape()[2] > self.idx {
                    k = k.index((Ellipsis, ..self.idx, ..));
                    v = v.index((Ellipsis, ..self.idx, ..));
                }
                let trim = self.idx - self.max_size + 1;
                if trim > 0 {
                    self.left_padding.iter_mut().for_each(|p| *p -= trim);
                    k = k.index((Ellipsis, trim.., ..));
                    v = v.index((Ellipsis, trim.., ..));
                }
                self.keys = Some(concatenate(&[&k, &keys], 2)?);
                self.values = Some(concatenate(&[&v, &values], 2)?);
            }
            _ => {
                self.keys = Some(keys);
                self.values = Some(values);
            }
        }
        self.offset.iter_mut().for_each(|o| *o += n);
        self.written += n;
        self.idx = self.keys.as_ref().unwrap().shape()[2];
        Ok(Kv::Dense(
            self.keys.clone().unwrap(),
            self.values.clone().unwrap(),
        ))
    }

    /// `_update_in_place` (one token per row): grow while below the window, trim a longer
    /// buffer to it, wrap the write index, write.
    fn update_in_place(&mut self, keys: Array, values: Array) -> Result<Kv, Exception> {
        let s = keys.shape().to_vec();
        let prev = self.written;
        let capacity = self.keys.as_ref().map_or(0, |k| k.shape()[2]);
        if self.keys.is_none() || (prev >= capacity && capacity < self.max_size) {
            let new_size = STEP.min(self.max_size - prev);
            let zeros = |x: &Array| zeros_dtype(&[s[0], s[1], new_size, x.shape()[3]], x.dtype());
            let (zk, zv) = (zeros(&keys)?, zeros(&values)?);
            match (self.keys.take(), self.values.take()) {
                (Some(k), Some(v)) => {
                    self.keys = Some(concatenate(&[&k, &zk], 2)?);
                    self.values = Some(concatenate(&[&v, &zv], 2)?);
                }
                _ => {
                    self.keys = Some(zk);
                    self.values = Some(zv);
                }
            }
            self.idx = prev;
        }
        let (k, v) = (self.keys.as_mut().unwrap(), self.values.as_mut().unwrap());
        let trim = k.shape()[2] - self.max_size;
        if trim > 0 {
            *k = k.index((Ellipsis, trim.., ..));
            *v = v.index((Ellipsis, trim.., ..));
            self.idx = self.max_size;
            self.left_padding.iter_mut().for_each(|p| *p -= trim);
        }
        if self.idx == self.max_size {
            self.rotated = true;
            self.idx = 0;
        }
        let n = s[2];
        if self.rotated {
            self.left_padding.iter_mut().for_each(|p| *p -= n);
        }
        let (at, end) = (self.idx, self.idx + n);
        k.try_index_mut((Ellipsis, at..end, ..), &keys)?;
        v.try_index_mut((Ellipsis, at..end, ..), &values)?;
        self.written += n;
        self.offset.iter_mut().for_each(|o| *o += n);
        self.idx += n;
        Ok(self.keys_and_values())
    }

    fn keys_and_values(&self) -> Kv {
        let (k, v) = (self.keys.as_ref().unwrap(), self.values.as_ref().unwrap());
        if self.written < k.shape()[2] {
            let w = self.written;
            Kv::Dense(k.index((Ellipsis, ..w, ..)), v.index((Ellipsis, ..w, ..)))
        } else {
            Kv::Dense(k.clone(), v.clone())
        }
    }
}

impl Cache for BatchRotatingKvCache {
    /// The positions written into the batch buffer (rows differ; see `rope_offset`).
    fn offset(&self) -> i32 {
        self.written
    }

    fn rope_offset(&self) -> RopeOffset {
        RopeOffset::Array(Array::from_slice(&self.offset, &[self.offset.len() as i32]))
    }

    fn state(&self) -> Vec<&Array> {
        self.keys.iter().chain(self.values.iter()).collect()
    }

    /// mlx-lm's `BatchRotatingKVCache.make_mask`: causal within the window, each row's
    /// padding hidden, rolled with the ring once it has wrapped; [B, 1, N, K].
    fn make_mask(&self, n: i32, window: Option<i32>) -> Result<Mask, Exception> {
        let window = window.unwrap_or(self.max_size);
        let offset = (self.max_size - 1).min(self.written);
        let rinds = arange::<_, i32>(0, offset + n, 1)?;
        let linds = arange::<_, i32>(offset, offset + n, 1)?.index((.., NewAxis));
        let rinds = rinds.index(NewAxis);
        let mask = linds
            .ge(&rinds)?
            .logical_and(&linds.lt(rinds.add(Array::from_int(window))?)?)?;
        let mut padding = self.left_padding.clone();
        let trim = self.idx - self.max_size + i32::from(n > 1);
        if trim > 0 {
            padding.iter_mut().for_each(|p| *p -= trim);
        }
        let rotated = n == 1 && (self.rotated || self.idx >= self.max_size);
        if rotated {
            padding.iter_mut().for_each(|p| *p -= 1);
        }
        if crate::plant::is(crate::plant::Defect::BatchUnmaskedPadding) {
            padding.iter_mut().for_each(|p| *p = 0);
        }
        let pad = Array::from_slice(&padding, &[padding.len() as i32]).reshape(&[-1, 1, 1, 1])?;
        let k = offset + n;
        let mut mask = mask
            .reshape(&[1, 1, n, k])?
            .logical_and(&rinds.reshape(&[1, 1, 1, k])?.ge(&pad)?)?;
        if rotated && !crate::plant::is(crate::plant::Defect::BatchRingMaskUnrolled) {
            let idx = if self.idx >= self.max_size {
                0
            } else {
                self.idx
            };
            mask = roll_last(&mask, idx + 1)?;
        }
        Ok(Mask::Array(mask))
    }

    attention_views!();

    fn kind(&self) -> Option<&'static str> {
        Some(KIND)
    }

    /// The whole ring buffers with every position the batch keeps.
    fn snapshot(&self) -> Option<Snapshot> {
        Some(Snapshot {
            kind: KIND.to_owned(),
            offset: self.written,
            quant: None,
            meta: Meta::from_iter([
                ("maxSize".to_owned(), self.max_size.into()),
                ("idx".to_owned(), self.idx.into()),
                ("rotated".to_owned(), self.rotated.into()),
                ("leftPadding".to_owned(), ints(&self.left_padding)),
                ("offsets".to_owned(), ints(&self.offset)),
            ]),
            tensors: self
                .keys
                .iter()
                .chain(self.values.iter())
                .cloned()
                .collect(),
        })
    }

    fn rows(&self) -> Option<usize> {
        Some(BatchRotatingKvCache::rows(self))
    }

    fn filter(&mut self, keep: &[usize]) -> Result<(), Exception> {
        self.keep_rows(keep)
    }

    fn extend(&mut self, other: &dyn Cache) -> Result<(), Exception> {
        let other = snapshot_of(other, KIND)?;
        self.extend_rows(&mut Self::from_state(other)?)
    }

    fn extract(&self, row: usize, len: i32) -> Result<Box<dyn Cache>, Exception> {
        Ok(Box::new(self.row_cache(row, len)?))
    }
}

impl AttentionCache for BatchRotatingKvCache {
    fn update_and_fetch(&mut self, keys: Array, values: Array) -> Result<Kv, Exception> {
        if keys.shape()[2] == 1 {
            self.update_in_place(keys, values)
        } else {
            self.update_concat(keys, values)
        }
    }
}
