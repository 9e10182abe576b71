//! The batched KV cache of the batch lane's full-attention layers, laid out like mlx-lm's
//! `BatchKVCache`: rows share one buffer [B, heads, positions, head dim] and one write
//! position; shorter rows are padded on the left, and the mask hides each row's padding.
//! Rows join (`extend`: the shorter side is left-padded so both end at the same position)
//! and leave (`filter`: the padding every remaining row shares is trimmed). RoPE gets each
//! row's own position. A batched prefill of prompts of different lengths (mlx-lm's prompt
//! batch, `Batch::admit_prompts`) writes them right-padded (`prepare`: each row's length)
//! and then rolls each row's padding to its front (`finalize`, mlx-lm's `dynamic_roll`).
//!
//! Quantized KV (mlx-lm's `QuantizedKVCache`, which `BatchGenerator` 0.32.2 cannot batch)
//! is the same layout applied to the packed words, scales and biases alike: quantization
//! is per position and per group along the head dim, so a row's parts are the ones its
//! single-sequence cache holds, and attention over them with the padding masked gives
//! that row's single-sequence numbers (B=N gate `batch-kv4`).

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::{Ellipsis, IndexOp};
use mlx_rs::Array;

use super::{KvCache, KIND as KV_KIND};
use crate::cache::parts::{self, cat_rows, empty_rows, pad, take_rows, Parts};
use crate::cache::{ints, meta_i32s, snapshot_of};
use crate::cache::{AttentionCache, Cache, Kv, KvQuant, Mask, Meta, RopeOffset, Snapshot};

/// The kind tag of its snapshots.
pub const KIND: &str = "batch-kv";

pub struct BatchKvCache {
    /// None while every row is empty (one-token prompts before their first step).
    keys: Option<Parts>,
    values: Option<Parts>,
    quant: Option<KvQuant>,
    /// Per row: pad positions at the front, and real tokens held.
    left_padding: Vec<i32>,
    lengths: Vec<i32>,
    /// The shared write position (every row occupies [0, idx)).
    idx: i32,
    /// Per row: pad positions at the back during a batched prefill (`prepare` to
    /// `finalize`); None otherwise.
    right_padding: Option<Vec<i32>>,
}

const STEP: i32 = 256;

/// A standard cache's live keys' and values' parts, its quantization and its length
/// (None parts when it holds nothing).
type Row = (Option<(Parts, Parts)>, Option<KvQuant>, i32);

fn row_of(c: &dyn Cache) -> Result<Row, Exception> {
    if c.kind() != Some(KV_KIND) {
        return Err(Exception::custom("a standard cache's snapshot expected"));
    }
    let Some(s) = c.snapshot() else {
        return Ok((None, None, 0));
    };
    let mut keys = s.tensors;
    let values = keys.split_off(keys.len() / 2);
    Ok((Some((keys, values)), s.quant, s.offset))
}

/// The one quantization every row agrees on, or the refusal.
fn common_quant(rows: &[Row]) -> Result<Option<KvQuant>, Exception> {
    let held: Vec<Option<KvQuant>> = rows.iter().filter(|r| r.0.is_some()).map(|r| r.1).collect();
    let quant = held.first().copied().flatten();
    if held.iter().any(|q| *q != quant) {
        return Err(Exception::custom(
            "rows whose caches are quantized differently cannot share a batch",
        ));
    }
    if quant.is_some_and(|q| q.sdpa != crate::cache::QuantSdpa::MlxLm) {
        return Err(Exception::custom(
            "the batch lane reads quantized KV through mlx-lm's attention only \
             (--kv-quant 4|8 --fused-sdpa off --perf-decode off); optiq's fused attention \
             (--l2, --l3) is served by the serial lane",
        ));
    }
    Ok(quant)
}

impl BatchKvCache {
    /// Merges single-sequence caches (one per row, as they stand) into a batch, as mlx-lm's
    /// `BatchKVCache.merge`: rows right-aligned at the longest, padding on the left.
    pub fn merge(rows: &[&dyn Cache]) -> Result<Self, Exception> {
        let rows: Vec<Row> = rows.iter().map(|c| row_of(*c)).collect::<Result<_, _>>()?;
        let quant = common_quant(&rows)?;
        let lengths: Vec<i32> = rows.iter().map(|r| r.2).collect();
        let idx = *lengths.iter().max().unwrap_or(&0);
        let like = rows.iter().find_map(|r| r.0.clone());
        let (mut ks, mut vs) = (Vec::new(), Vec::new());
        if let Some((lk, lv)) = &like {
            for (held, _, len) in &rows {
                let (k, v) = match held {
                    Some((k, v)) => (k.clone(), v.clone()),
                    None => (empty_rows(lk, 1)?, empty_rows(lv, 1)?),
                };
                ks.push(pad(&k, idx - len, false)?);
                vs.push(pad(&v, idx - len, false)?);
            }
        }
        Ok(BatchKvCache {
            keys: like.is_some().then(|| cat_rows(&ks)).transpose()?,
            values: like.is_some().then(|| cat_rows(&vs)).transpose()?,
            quant,
            left_padding: lengths.iter().map(|l| idx - l).collect(),
            lengths,
            idx,
            right_padding: None,
        })
    }

    /// mlx-lm's `from_state` (what `extend` reads the other batch through).
    pub fn from_state(s: Snapshot) -> Result<Self, Exception> {
        if s.kind != KIND {
            return Err(Exception::custom("a batch cache's snapshot expected"));
        }
        let (keys, values) = match s.tensors.is_empty() {
            true => (None, None),
            false => {
                let (k, v) = parts::split_kv(s.tensors, s.quant)?;
                (Some(k), Some(v))
            }
        };
        Ok(BatchKvCache {
            keys,
            values,
            quant: s.quant,
            left_padding: meta_i32s(&s.meta, "leftPadding")?,
            lengths: meta_i32s(&s.meta, "lengths")?,
            idx: s.offset,
            right_padding: None,
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
        let (Some(k), Some(v)) = (&self.keys, &self.values) else {
            return Ok(KvCache::new());
        };
        if len == 0 {
            return Ok(KvCache::new());
        }
        let slice =
            |p: &Parts| parts::slice(p, |x| x.index((r..r + 1, .., start..start + len, ..)));
        Ok(KvCache::from_parts(slice(k), slice(v), len, self.quant))
    }

    /// Keeps only rows `keep` (in that order), trimming the padding they all share.
    pub fn keep_rows(&mut self, keep: &[usize]) -> Result<(), Exception> {
        if let (Some(k), Some(v)) = (&self.keys, &self.values) {
            self.keys = Some(take_rows(k, keep)?);
            self.values = Some(take_rows(v, keep)?);
        }
        self.left_padding = keep.iter().map(|&i| self.left_padding[i]).collect();
        self.lengths = keep.iter().map(|&i| self.lengths[i]).collect();
        let shared = self.left_padding.iter().copied().min().unwrap_or(0);
        if shared > 0 {
            let drop = |p: &Parts| parts::slice(p, |x| x.index((Ellipsis, shared.., ..)));
            self.keys = self.keys.as_ref().map(drop);
            self.values = self.values.as_ref().map(drop);
            self.idx -= shared;
            self.left_padding.iter_mut().for_each(|p| *p -= shared);
        }
        Ok(())
    }

    /// Appends the rows of `other` after this batch's rows.
    pub fn extend_rows(&mut self, other: &BatchKvCache) -> Result<(), Exception> {
        let both_held = self.keys.is_some() && other.keys.is_some();
        if both_held && self.quant != other.quant {
            return Err(Exception::custom(
                "rows whose caches are quantized differently cannot share a batch",
            ));
        }
        let idx = self.idx.max(other.idx);
        let like = self.keys.clone().or_else(|| other.keys.clone());
        let like_v = self.values.clone().or_else(|| other.values.clone());
        if let (Some(lk), Some(lv)) = (like, like_v) {
            let fit =
                |c: &BatchKvCache, p: &Option<Parts>, like: &Parts| -> Result<Parts, Exception> {
                    let held = match p {
                        Some(p) => parts::head(p, c.idx),
                        None => empty_rows(like, c.rows() as i32)?,
                    };
                    pad(&held, idx - c.idx, false)
                };
            let k = cat_rows(&[fit(self, &self.keys, &lk)?, fit(other, &other.keys, &lk)?])?;
            let v = cat_rows(&[
                fit(self, &self.values, &lv)?,
                fit(other, &other.values, &lv)?,
            ])?;
            self.quant = if self.keys.is_some() {
                self.quant
            } else {
                other.quant
            };
            self.keys = Some(k);
            self.values = Some(v);
        }
        let (mine, theirs) = (idx - self.idx, idx - other.idx);
        self.left_padding.iter_mut().for_each(|p| *p += mine);
        self.left_padding
            .extend(other.left_padding.iter().map(|p| p + theirs));
        self.lengths.extend(other.lengths.iter().copied());
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

    fn state(&self) -> Vec<&Array> {
        parts::kv_state(&self.keys, &self.values)
    }

    /// mlx-lm's `create_causal_mask(N, offset=idx, left_padding)`: causal, and each row's
    /// padding hidden; always an explicit [B, 1, N, idx + N] mask.
    fn make_mask(&self, n: i32, window: Option<i32>) -> Result<Mask, Exception> {
        if window.is_some() {
            return Err(Exception::custom(
                "a full-attention batch cache was asked for a sliding-window mask",
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

    attention_views!();

    fn kind(&self) -> Option<&'static str> {
        Some(KIND)
    }

    /// The buffers up to the write position, with each row's padding and length.
    fn snapshot(&self) -> Option<Snapshot> {
        let mut tensors = Vec::new();
        if let (Some(k), Some(v)) = (&self.keys, &self.values) {
            tensors.extend(parts::head(k, self.idx));
            tensors.extend(parts::head(v, self.idx));
        }
        Some(Snapshot {
            kind: KIND.to_owned(),
            offset: self.idx,
            quant: self.quant,
            meta: Meta::from_iter([
                ("leftPadding".to_owned(), ints(&self.left_padding)),
                ("lengths".to_owned(), ints(&self.lengths)),
            ]),
            tensors,
        })
    }

    fn rows(&self) -> Option<usize> {
        Some(BatchKvCache::rows(self))
    }

    fn filter(&mut self, keep: &[usize]) -> Result<(), Exception> {
        self.keep_rows(keep)
    }

    fn extend(&mut self, other: &dyn Cache) -> Result<(), Exception> {
        let other = snapshot_of(other, KIND)?;
        self.extend_rows(&Self::from_state(other)?)
    }

    fn extract(&self, row: usize, len: i32) -> Result<Box<dyn Cache>, Exception> {
        Ok(Box::new(self.row_cache(row, len)?))
    }

    /// mlx-lm's `prepare(lengths=…, right_padding=…)` for right-padded prompts: each row's
    /// padding is the longest length less its own (kept only when some row has any).
    fn prepare(&mut self, lengths: &[i32]) -> Result<(), Exception> {
        if self.quant.is_some() {
            return Err(Exception::custom(
                "a quantized batch cache has no batched prefill (mlx-lm has none)",
            ));
        }
        if lengths.len() != self.rows() {
            return Err(Exception::custom("one prefill length per batch row"));
        }
        let longest = lengths.iter().copied().max().unwrap_or(0);
        let padding: Vec<i32> = lengths.iter().map(|l| longest - l).collect();
        self.right_padding = padding.iter().any(|&p| p > 0).then_some(padding);
        Ok(())
    }

    /// Each row gives back its last `n[r]` positions. What every row gives back moves the
    /// shared write position back (as `trim` would); the rest of a row's becomes padding at
    /// its front, rolled there as `finalize` rolls a prefill's right padding (the row then
    /// ends at the write position again), and masked from then on. So the buffer grows by
    /// the most any row kept, not by the verify's length.
    fn trim_rows(&mut self, n: &[i32]) -> Result<(), Exception> {
        if n.len() != self.rows() {
            return Err(Exception::custom(
                "one count of tokens to drop per batch row",
            ));
        }
        if n.iter()
            .zip(&self.lengths)
            .any(|(&k, &len)| k < 0 || k > len)
        {
            return Err(Exception::custom(
                "a row cannot give back more tokens than it holds",
            ));
        }
        let mut n = n.to_vec();
        if crate::plant::is(crate::plant::Defect::BatchRowTrimShort) {
            n.iter_mut().filter(|k| **k > 0).for_each(|k| *k -= 1);
        }
        let shared = n.iter().copied().min().unwrap_or(0);
        self.idx -= shared;
        self.lengths.iter_mut().for_each(|l| *l -= shared);
        n.iter_mut().for_each(|k| *k -= shared);
        self.right_padding = n.iter().any(|&k| k > 0).then_some(n);
        self.finalize()
    }

    /// mlx-lm's `finalize`: each row's right padding rolled to its front (`dynamic_roll`
    /// over the whole buffer, as mlx-lm rolls it), so the row ends at the write position
    /// like a merged row; its padding joins the left padding, its length loses it.
    fn finalize(&mut self) -> Result<(), Exception> {
        let Some(padding) = self.right_padding.take() else {
            return Ok(());
        };
        let roll = |p: &Parts| -> Result<Parts, Exception> {
            p.iter()
                .map(|x| {
                    let n = x.shape()[2];
                    let shifts = Array::from_slice(&padding, &[padding.len() as i32, 1]);
                    // (j − shift) mod n, kept non-negative (shift ≤ n).
                    let from = mlx_rs::ops::arange::<_, i32>(0, n, 1)?
                        .subtract(&shifts)?
                        .add(Array::from_int(n))?
                        .remainder(Array::from_int(n))?;
                    x.take_along_axis(&from.reshape(&[padding.len() as i32, 1, n, 1])?, 2)
                })
                .collect()
        };
        self.keys = self.keys.as_ref().map(roll).transpose()?;
        self.values = self.values.as_ref().map(roll).transpose()?;
        for (i, p) in padding.iter().enumerate() {
            self.lengths[i] -= p;
            self.left_padding[i] += p;
        }
        Ok(())
    }
}

impl AttentionCache for BatchKvCache {
    fn update_and_fetch(&mut self, keys: Array, values: Array) -> Result<Kv, Exception> {
        let n = keys.shape()[2];
        let like = (&keys, &values);
        parts::reserve_kv(
            &mut self.keys,
            &mut self.values,
            like,
            self.idx,
            STEP,
            self.quant,
            true,
        )?;
        let mut new_k = parts::encode(keys, self.quant)?;
        let new_v = parts::encode(values, self.quant)?;
        if self.quant.is_some() && crate::plant::is(crate::plant::Defect::BatchKvBiasesDropped) {
            new_k[2] = mlx_rs::ops::zeros_like(&new_k[2])?;
        }
        let (at, end) = (self.idx, self.idx + n);
        self.idx = end;
        self.lengths.iter_mut().for_each(|l| *l += n);
        parts::write_kv(
            (&mut self.keys, &mut self.values),
            at,
            (&new_k, &new_v),
            |p| parts::head(p, end),
            self.quant,
        )
    }

    /// mlx-lm's `to_quantized` on the whole batch buffers (padding included): quantization
    /// is per position, so each row's parts are its single-sequence cache's.
    fn quantize(&mut self, quant: KvQuant) -> Result<bool, Exception> {
        parts::quantize_kv(&mut self.keys, &mut self.values, &mut self.quant, quant)
    }

    fn kv_quant(&self) -> Option<KvQuant> {
        self.quant
    }
}
