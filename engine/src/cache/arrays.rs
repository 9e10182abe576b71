//! mlx-lm 0.32.2's `ArraysCache`: a fixed number of optional arrays (a recurrent layer's
//! state, e.g. a gated delta net's conv and SSM state), batch axis first, with an optional
//! left padding and per-row lengths for a batched prefill. Not trimmable. Its offset is the
//! tokens it has consumed (`advance`: mlx-lm's `size()` is 0, but the engine's bookkeeping
//! — which prefix a prompt-cache entry holds — counts by it; no mixer reads it), kept per
//! row so that a row taken out of a batch (`extract`) says how many tokens its state holds
//! (the longest row's count is the offset); its mask is per row over the `n` new tokens only:
//! `pos >= left_padding[:, None]` and `pos < lengths[:, None]` where set (`make_mask`).
//! Batch ops as mlx-lm: `merge` stacks rows (a missing array zero), `filter` takes rows,
//! `extend` concatenates (a side missing an array gets zeros of its batch), `extract`
//! slices one row, `prepare`/`finalize` set and clear the lengths (and the padding).
//! The hybrids' recurrent mixers (short conv, gated delta net, Mamba-2) keep their state in
//! it; its snapshot is the present arrays with which slots hold one (and the offset), so
//! the kv-store round-trips it through `restore`.

use mlx_rs::error::Exception;
use mlx_rs::ops::{concatenate, zeros_dtype};
use mlx_rs::Array;

use super::{ints, meta_i32s, snapshot_of};
use super::{Cache, Mask, Meta, Snapshot};

/// The kind tag of its snapshots.
pub const KIND: &str = "arrays";

#[derive(Clone, Default)]
pub struct ArraysCache {
    slots: Vec<Option<Array>>,
    left_padding: Option<Vec<i32>>,
    lengths: Option<Vec<i32>>,
    /// Tokens each row has consumed (the padding and lengths not counted); empty is
    /// one row with none.
    seen: Vec<i32>,
}

/// `v` as an int32 column [B, 1].
fn column(v: &[i32]) -> Result<Array, Exception> {
    Array::from_slice(v, &[v.len() as i32]).reshape(&[-1, 1])
}

impl ArraysCache {
    /// `size` empty slots.
    pub fn new(size: usize) -> Self {
        ArraysCache {
            slots: vec![None; size],
            ..Default::default()
        }
    }

    /// `size` empty slots for rows padded on the left by `left_padding`.
    pub fn with_left_padding(size: usize, left_padding: Vec<i32>) -> Self {
        ArraysCache {
            left_padding: Some(left_padding),
            ..Self::new(size)
        }
    }

    pub fn get(&self, i: usize) -> Option<&Array> {
        self.slots[i].as_ref()
    }

    pub fn set(&mut self, i: usize, a: Array) {
        self.slots[i] = Some(a);
    }

    pub fn left_padding(&self) -> Option<&[i32]> {
        self.left_padding.as_deref()
    }

    pub fn lengths(&self) -> Option<&[i32]> {
        self.lengths.as_deref()
    }

    /// mlx-lm's `empty()`: the first slot holds nothing.
    pub fn is_empty(&self) -> bool {
        self.slots.first().is_none_or(|s| s.is_none())
    }

    /// mlx-lm's `batch_size`: a held array's first axis, else the padding's or the
    /// lengths' count, else 1.
    pub fn batch_size(&self) -> usize {
        if let Some(a) = self.slots.iter().flatten().next() {
            return a.shape()[0] as usize;
        }
        self.left_padding
            .as_ref()
            .or(self.lengths.as_ref())
            .map_or(1, |v| v.len())
    }

    /// mlx-lm's `advance(N)`: `n` tokens consumed from the lengths and the padding (and
    /// counted: each row its real ones, those past its padding and within its length).
    pub fn advance(&mut self, n: i32) {
        let mut seen = self.row_seen();
        for (i, s) in seen.iter_mut().enumerate() {
            let within = |v: &Option<Vec<i32>>, or: i32| {
                v.as_ref()
                    .and_then(|v| v.get(i))
                    .map_or(or, |&x| x.clamp(0, n))
            };
            let (from, to) = (within(&self.left_padding, 0), within(&self.lengths, n));
            *s += (to - from).max(0);
        }
        self.seen = seen;
        for v in [&mut self.lengths, &mut self.left_padding]
            .into_iter()
            .flatten()
        {
            v.iter_mut().for_each(|x| *x -= n);
        }
    }

    /// The tokens each of the `batch_size` rows has consumed.
    fn row_seen(&self) -> Vec<i32> {
        let rows = self.batch_size();
        match self.seen.len() {
            n if n == rows => self.seen.clone(),
            0 => vec![0; rows],
            _ => vec![self.seen.iter().copied().max().unwrap_or(0); rows],
        }
    }

    /// mlx-lm's `from_state`.
    pub fn from_state(s: Snapshot) -> Result<Self, Exception> {
        if s.kind != KIND {
            return Err(Exception::custom("an arrays cache's snapshot expected"));
        }
        let held = meta_i32s(&s.meta, "slots")?;
        if held.iter().filter(|&&h| h != 0).count() != s.tensors.len() {
            return Err(Exception::custom(
                "an arrays cache's snapshot holds one array per held slot",
            ));
        }
        let mut tensors = s.tensors.into_iter();
        let optional = |key: &str| s.meta.contains_key(key).then(|| meta_i32s(&s.meta, key));
        let seen = optional("seen")
            .transpose()?
            .unwrap_or_else(|| vec![s.offset]);
        Ok(ArraysCache {
            slots: held
                .iter()
                .map(|&h| if h != 0 { tensors.next() } else { None })
                .collect(),
            left_padding: optional("leftPadding").transpose()?,
            lengths: optional("lengths").transpose()?,
            seen,
        })
    }

    /// The arrays cache behind `c` (through its snapshot), or the refusal.
    fn of(c: &dyn Cache) -> Result<Self, Exception> {
        Self::from_state(snapshot_of(c, KIND)?)
    }
}

/// mlx-lm's `extend`'s `cat`: `a` over `b` along the batch axis, a missing side zeros of
/// its batch; None when both are missing.
fn cat(
    a: Option<&Array>,
    b: Option<&Array>,
    a_rows: usize,
    b_rows: usize,
) -> Result<Option<Array>, Exception> {
    let Some(like) = b.or(a) else {
        return Ok(None);
    };
    let zeros = |rows: usize| {
        let mut shape = like.shape().to_vec();
        shape[0] = rows as i32;
        zeros_dtype(&shape, like.dtype())
    };
    let a = a.cloned().map_or_else(|| zeros(a_rows), Ok)?;
    let b = b.cloned().map_or_else(|| zeros(b_rows), Ok)?;
    Ok(Some(concatenate(&[a, b], 0)?))
}

/// The same for the padding and lengths vectors.
fn cat_ints(
    a: &Option<Vec<i32>>,
    b: &Option<Vec<i32>>,
    a_rows: usize,
    b_rows: usize,
) -> Option<Vec<i32>> {
    if a.is_none() && b.is_none() {
        return None;
    }
    let mut out = a.clone().unwrap_or_else(|| vec![0; a_rows]);
    out.extend(b.clone().unwrap_or_else(|| vec![0; b_rows]));
    Some(out)
}

impl Cache for ArraysCache {
    fn as_arrays(&mut self) -> Option<&mut ArraysCache> {
        Some(self)
    }

    /// The tokens consumed (see the module header).
    fn offset(&self) -> i32 {
        self.seen.iter().copied().max().unwrap_or(0)
    }

    fn kind(&self) -> Option<&'static str> {
        Some(KIND)
    }

    fn snapshot(&self) -> Option<Snapshot> {
        let held: Vec<i32> = self.slots.iter().map(|s| i32::from(s.is_some())).collect();
        let mut meta = Meta::from_iter([("slots".to_owned(), ints(&held))]);
        if let Some(p) = &self.left_padding {
            meta.insert("leftPadding".to_owned(), ints(p));
        }
        if let Some(l) = &self.lengths {
            meta.insert("lengths".to_owned(), ints(l));
        }
        if self.seen.len() > 1 {
            meta.insert("seen".to_owned(), ints(&self.seen));
        }
        Some(Snapshot {
            kind: KIND.to_owned(),
            offset: self.offset(),
            quant: None,
            meta,
            tensors: self.slots.iter().flatten().cloned().collect(),
        })
    }

    fn state(&self) -> Vec<&Array> {
        self.slots.iter().flatten().collect()
    }

    /// mlx-lm's `ArraysCache.make_mask(N)`: [B, n] from the padding and lengths, or none.
    fn make_mask(&self, n: i32, _window: Option<i32>) -> Result<Mask, Exception> {
        let pos = mlx_rs::ops::arange::<_, i32>(0, n, 1)?;
        let mut mask: Option<Array> = None;
        if let Some(p) = &self.left_padding {
            mask = Some(pos.ge(&column(p)?)?);
        }
        if let Some(l) = &self.lengths {
            let within = pos.lt(&column(l)?)?;
            mask = Some(match mask {
                Some(m) => m.logical_and(&within)?,
                None => within,
            });
        }
        Ok(mask.map_or(Mask::None, Mask::Array))
    }

    fn can_checkpoint(&self) -> bool {
        true
    }

    /// A recurrent state is rolled back by returning to a checkpoint, not by trimming.
    fn checkpoint(&self) -> Option<Snapshot> {
        self.snapshot()
    }

    fn restore_checkpoint(&mut self, c: Snapshot) -> Result<(), Exception> {
        *self = Self::from_state(c)?;
        Ok(())
    }

    fn rows(&self) -> Option<usize> {
        Some(self.batch_size())
    }

    /// mlx-lm's `ArraysCache.merge`: row i's arrays at row i, zeros where a row has none;
    /// all rows empty: no arrays, a zero padding per row.
    fn merge(&self, rows: &[&dyn Cache]) -> Result<Box<dyn Cache>, Exception> {
        let rows: Vec<ArraysCache> = rows
            .iter()
            .map(|c| Self::of(*c))
            .collect::<Result<_, _>>()?;
        let size = rows.first().map_or(0, |r| r.slots.len());
        let mut out = ArraysCache::new(size);
        out.seen = rows.iter().map(|r| r.offset()).collect();
        if rows.iter().all(|r| r.is_empty()) {
            out.left_padding = Some(vec![0; rows.len()]);
            return Ok(Box::new(out));
        }
        for e in 0..size {
            let Some(like) = rows.iter().find_map(|r| r.slots.get(e).cloned().flatten()) else {
                continue;
            };
            let mut shape = like.shape().to_vec();
            shape[0] = 1;
            let column = rows
                .iter()
                .map(|r| match r.slots.get(e).cloned().flatten() {
                    Some(a) => a.as_dtype(like.dtype()),
                    None => zeros_dtype(&shape, like.dtype()),
                })
                .collect::<Result<Vec<_>, _>>()?;
            out.slots[e] = Some(concatenate(&column, 0)?);
        }
        Ok(Box::new(out))
    }

    fn filter(&mut self, keep: &[usize]) -> Result<(), Exception> {
        let seen = self.row_seen();
        self.seen = keep.iter().map(|&i| seen[i]).collect();
        let rows: Vec<i32> = match crate::plant::is(crate::plant::Defect::BatchStateRowsUnfiltered)
        {
            true => (0..keep.len() as i32).collect(),
            false => keep.iter().map(|&i| i as i32).collect(),
        };
        let index = Array::from_slice(&rows, &[rows.len() as i32]);
        for s in self.slots.iter_mut().flatten() {
            *s = s.take_axis(&index, 0)?;
        }
        for v in [&mut self.left_padding, &mut self.lengths]
            .into_iter()
            .flatten()
        {
            *v = keep.iter().map(|&i| v[i]).collect();
        }
        Ok(())
    }

    fn extend(&mut self, other: &dyn Cache) -> Result<(), Exception> {
        let other = Self::of(other)?;
        let (a_rows, b_rows) = (self.batch_size(), other.batch_size());
        self.seen = [self.row_seen(), other.row_seen()].concat();
        for (mine, theirs) in self.slots.iter_mut().zip(&other.slots) {
            *mine = cat(mine.as_ref(), theirs.as_ref(), a_rows, b_rows)?;
        }
        self.left_padding = cat_ints(&self.left_padding, &other.left_padding, a_rows, b_rows);
        self.lengths = cat_ints(&self.lengths, &other.lengths, a_rows, b_rows);
        Ok(())
    }

    /// Row `row`'s arrays, which hold every token the row has consumed: asked for fewer
    /// (`len`), it refuses (a state cannot be cut back); more, it holds what it has (as a
    /// K/V row gives at most its own length).
    fn extract(&self, row: usize, len: i32) -> Result<Box<dyn Cache>, Exception> {
        use mlx_rs::ops::indexing::IndexOp;
        let have = self.row_seen().get(row).copied().unwrap_or(0);
        if len < have {
            return Err(Exception::custom(format!(
                "row {row}'s recurrent state holds {have} tokens; it cannot be cut back to {len}"
            )));
        }
        let r = row as i32;
        Ok(Box::new(ArraysCache {
            slots: self
                .slots
                .iter()
                .map(|s| s.as_ref().map(|a| a.index(r..r + 1)))
                .collect(),
            seen: vec![have],
            ..Default::default()
        }))
    }

    fn prepare(&mut self, lengths: &[i32]) -> Result<(), Exception> {
        if crate::plant::is(crate::plant::Defect::BatchStateLengthsIgnored) {
            return Ok(());
        }
        self.lengths = Some(lengths.to_vec());
        Ok(())
    }

    fn finalize(&mut self) -> Result<(), Exception> {
        self.lengths = None;
        self.left_padding = None;
        Ok(())
    }
}
