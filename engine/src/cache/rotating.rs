//! The rotating (sliding-window) KV cache, laid out like mlx-lm's `RotatingKVCache`: a ring
//! of `max_size` positions (the first `keep` never rotate out). Multi-token updates first put
//! the ring back in temporal order and keep the last `max_size − 1` positions before
//! appending (so every new token still sees a full window); single-token updates write in
//! place at the ring index. It can be trimmed only while it has not wrapped.

use mlx_rs::error::Exception;
use mlx_rs::ops::concatenate;
use mlx_rs::ops::indexing::{Ellipsis, IndexOp};
use mlx_rs::Array;

pub mod batch;

use self::batch::BatchRotatingKvCache;
use super::fixed::{Compiled, Form};
use super::meta_i32;
use super::parts::{self, Parts};
use super::{causal_mask, refused, AttentionCache, Cache, Kv, KvQuant, Mask, Meta, Snapshot};

/// The kind tag of its snapshots (the kv-store's `rotating`, `rotating-qkv` quantized).
pub const KIND: &str = "rotating";

pub struct RotatingKvCache {
    keys: Option<Parts>,
    values: Option<Parts>,
    offset: i32,
    max_size: i32,
    keep: i32,
    idx: i32,
    /// Set once quantized (optiq's `RotatingQuantizedKVCache`: the same ring, every
    /// operation applied to the packed words, scales and biases alike).
    quant: Option<KvQuant>,
}

impl RotatingKvCache {
    pub const STEP: i32 = 256;

    pub fn new(max_size: i32) -> Self {
        Self::with_keep(max_size, 0)
    }

    pub fn with_keep(max_size: i32, keep: i32) -> Self {
        RotatingKvCache {
            keys: None,
            values: None,
            offset: 0,
            max_size,
            keep,
            idx: 0,
            quant: None,
        }
    }

    /// A ring restored from the kv-store: buffers stored whole, with offset and index.
    pub fn from_parts(
        keys: Parts,
        values: Parts,
        offset: i32,
        max_size: i32,
        keep: i32,
        idx: i32,
        quant: Option<KvQuant>,
    ) -> Self {
        RotatingKvCache {
            keys: Some(keys),
            values: Some(values),
            offset,
            max_size,
            keep,
            idx,
            quant,
        }
    }

    /// mlx-lm's `from_state`: the whole ring with its `idx`, `maxSize` and `keep`.
    pub fn from_state(s: Snapshot) -> Result<Self, Exception> {
        if s.kind != KIND {
            return Err(Exception::custom("a rotating cache's snapshot expected"));
        }
        let (max_size, keep, idx) = (
            meta_i32(&s.meta, "maxSize")?,
            meta_i32(&s.meta, "keep").unwrap_or(0),
            meta_i32(&s.meta, "idx")?,
        );
        let (keys, values) = parts::split_kv(s.tensors, s.quant)?;
        Ok(Self::from_parts(
            keys, values, s.offset, max_size, keep, idx, s.quant,
        ))
    }

    pub fn max_size(&self) -> i32 {
        self.max_size
    }

    /// optiq's donor view for its assistant drafter: the ring in temporal order, its newest
    /// min(offset, max_size − 1) positions (dense caches only).
    pub fn newest_window(&self) -> Result<(Array, Array), Exception> {
        let (Some(k), Some(v), None) = (&self.keys, &self.values, self.quant) else {
            return Err(Exception::custom(
                "the assistant drafter reads dense, non-empty caches only",
            ));
        };
        let (k, v) = (
            self.temporal_order(k)?.remove(0),
            self.temporal_order(v)?.remove(0),
        );
        let len = k.shape()[2];
        // Python's `x[..., -0:, :]` is the whole buffer.
        let valid = self.offset.min(self.max_size - 1).min(len);
        let from = if valid == 0 { 0 } else { len - valid };
        Ok((
            k.index((Ellipsis, from.., ..)),
            v.index((Ellipsis, from.., ..)),
        ))
    }

    /// optiq's `_trim_rotating`: drops the newest `n` positions by slicing them off the
    /// buffer (after a multi-token verify the buffer is in time order with them last), so
    /// a ring past its window can be rolled back too. If that leaves a full ring shorter
    /// than its window, a placeholder slot is appended where the next token will be written.
    pub fn trim_tail(&mut self, n: i32) -> Result<(), Exception> {
        if n <= 0 {
            return Ok(());
        }
        let (Some(k), Some(v), None) = (&self.keys, &self.values, self.quant) else {
            return Err(Exception::custom(
                "only dense, non-empty rings trim this way",
            ));
        };
        let n = n.min(self.offset);
        self.offset -= n;
        self.idx -= n;
        let mut k = k[0].index((Ellipsis, ..self.idx, ..));
        let mut v = v[0].index((Ellipsis, ..self.idx, ..));
        let short = self.max_size - k.shape()[2];
        if self.offset >= self.max_size && short > 0 {
            let pad = |x: &Array| -> Result<Array, Exception> {
                let s = x.shape();
                let z = mlx_rs::ops::zeros_dtype(&[s[0], s[1], short, s[3]], x.dtype())?;
                mlx_rs::ops::concatenate(&[x, &z], 2)
            };
            k = pad(&k)?;
            v = pad(&v)?;
        }
        self.keys = Some(vec![k]);
        self.values = Some(vec![v]);
        Ok(())
    }

    /// Drops `trim` positions after the kept prefix, then appends `append`.
    fn trim_cat(&self, trim: i32, v: &Parts, append: Option<&Parts>) -> Result<Parts, Exception> {
        let mut pieces = if trim > 0 {
            vec![
                parts::slice(v, |x| x.index((Ellipsis, ..self.keep, ..))),
                parts::slice(v, |x| x.index((Ellipsis, (trim + self.keep).., ..))),
            ]
        } else {
            vec![v.clone()]
        };
        pieces.extend(append.cloned());
        if pieces.len() == 1 {
            return Ok(pieces.remove(0));
        }
        parts::cat(&pieces)
    }

    /// The ring rearranged into temporal order, unused tail sliced off.
    fn temporal_order(&self, v: &Parts) -> Result<Parts, Exception> {
        let len = parts::len(v);
        if self.idx == len {
            Ok(v.clone())
        } else if self.idx < self.offset {
            parts::cat(&[
                parts::slice(v, |x| x.index((Ellipsis, ..self.keep, ..))),
                parts::slice(v, |x| x.index((Ellipsis, self.idx.., ..))),
                parts::slice(v, |x| x.index((Ellipsis, self.keep..self.idx, ..))),
            ])
        } else {
            Ok(parts::head(v, self.idx))
        }
    }

    fn update_concat(&mut self, keys: Array, values: Array) -> Result<Kv, Exception> {
        let len = keys.shape()[2];
        let new_k = parts::encode(keys, self.quant)?;
        let new_v = parts::encode(values, self.quant)?;
        match (self.keys.take(), self.values.take()) {
            (Some(old_k), Some(old_v)) => {
                let k = self.temporal_order(&old_k)?;
                let v = self.temporal_order(&old_v)?;
                self.idx = parts::len(&k);
                let trim = self.idx - self.max_size + 1;
                self.keys = Some(self.trim_cat(trim, &k, Some(&new_k))?);
                self.values = Some(self.trim_cat(trim, &v, Some(&new_v))?);
            }
            _ => {
                self.keys = Some(new_k);
                self.values = Some(new_v);
            }
        }
        self.offset += len;
        self.idx = parts::len(self.keys.as_ref().unwrap());
        Ok(self.live())
    }

    fn update_in_place(&mut self, keys: Array, values: Array) -> Result<Kv, Exception> {
        let prev = self.offset;
        let capacity = self.keys.as_ref().map_or(0, parts::len);
        if self.keys.is_none() || (prev >= capacity && capacity < self.max_size) {
            let new_size = Self::STEP.min(self.max_size - prev);
            let new_k = parts::zeros(&keys, new_size, self.quant)?;
            let new_v = parts::zeros(&values, new_size, self.quant)?;
            match (self.keys.take(), self.values.take()) {
                (Some(k), Some(v)) => {
                    self.keys = Some(parts::cat(&[k, new_k])?);
                    self.values = Some(parts::cat(&[v, new_v])?);
                }
                _ => {
                    self.keys = Some(new_k);
                    self.values = Some(new_v);
                }
            }
            self.idx = prev;
        }
        let trim = parts::len(self.keys.as_ref().unwrap()) - self.max_size;
        if trim > 0 {
            let k = self.trim_cat(trim, self.keys.as_ref().unwrap(), None)?;
            let v = self.trim_cat(trim, self.values.as_ref().unwrap(), None)?;
            self.keys = Some(k);
            self.values = Some(v);
            self.idx = self.max_size;
        }
        if self.idx == self.max_size {
            self.idx = self.keep;
        }
        let s = keys.shape()[2];
        let new_k = parts::encode(keys, self.quant)?;
        let new_v = parts::encode(values, self.quant)?;
        parts::write(self.keys.as_mut().unwrap(), self.idx, &new_k)?;
        parts::write(self.values.as_mut().unwrap(), self.idx, &new_v)?;
        self.offset += s;
        self.idx += s;
        Ok(self.live())
    }

    /// A full, dense ring as a compiled one-token step sees it: every slot live, the buffers
    /// and the slot the next token goes to. None while the ring still grows or trims, or
    /// once quantized (those steps run eagerly).
    pub fn full_ring_slot(&self) -> Option<(&Array, &Array, i32)> {
        if self.quant.is_some() {
            return None;
        }
        let (k, v) = (self.keys.as_ref()?, self.values.as_ref()?);
        if parts::len(k) != self.max_size || self.offset < self.max_size {
            return None;
        }
        let slot = if self.idx >= self.max_size {
            self.keep
        } else {
            self.idx
        };
        Some((&k[0], &v[0], slot))
    }

    /// After a compiled step wrote one token at `slot` (what `update_in_place` does to a
    /// full ring).
    pub fn advance_ring(&mut self, keys: Array, values: Array, slot: i32) {
        self.keys = Some(vec![keys]);
        self.values = Some(vec![values]);
        self.offset += 1;
        self.idx = slot + 1;
    }

    /// The live positions in ring order (attention is order-blind given the mask).
    fn live(&self) -> Kv {
        let (k, v) = (self.keys.as_ref().unwrap(), self.values.as_ref().unwrap());
        parts::fetch(
            parts::live(k, self.offset),
            parts::live(v, self.offset),
            self.quant,
        )
    }
}

impl Cache for RotatingKvCache {
    fn offset(&self) -> i32 {
        self.offset
    }

    fn kind(&self) -> Option<&'static str> {
        Some(KIND)
    }

    /// The whole ring with its index (its order is the ring's, not time's).
    fn snapshot(&self) -> Option<Snapshot> {
        let (k, v) = (self.keys.as_ref()?, self.values.as_ref()?);
        let mut tensors = k.clone();
        tensors.extend(v.iter().cloned());
        Some(Snapshot {
            kind: KIND.to_owned(),
            offset: self.offset,
            quant: self.quant,
            meta: Meta::from_iter([
                ("idx".to_owned(), self.idx.into()),
                ("maxSize".to_owned(), self.max_size.into()),
                ("keep".to_owned(), self.keep.into()),
            ]),
            tensors,
        })
    }

    fn is_trimmable(&self) -> bool {
        self.offset < self.max_size
    }

    fn trim(&mut self, n: i32) -> i32 {
        let n = n.min(self.offset);
        self.offset -= n;
        self.idx -= n;
        n
    }

    fn state(&self) -> Vec<&Array> {
        parts::kv_state(&self.keys, &self.values)
    }

    attention_views!();

    /// optiq's `_trim_rotating` (see `trim_tail`): a ring past its window rolls back too.
    fn rollback(&mut self, n: i32) -> Result<(), Exception> {
        self.trim_tail(n)
    }

    /// Until it wraps: a ring that wrapped over positions could not give them back.
    fn rollback_room(&self) -> Option<i32> {
        Some(self.max_size - self.offset - 1)
    }

    /// mlx-lm's `RotatingKVCache.merge`: the rows as one `BatchRotatingKVCache`.
    fn merge(&self, rows: &[&dyn Cache]) -> Result<Box<dyn Cache>, Exception> {
        Ok(Box::new(BatchRotatingKvCache::merge(self.max_size, rows)?))
    }

    /// mlx-lm's `RotatingKVCache.make_mask`.
    fn make_mask(&self, n: i32, window: Option<i32>) -> Result<Mask, Exception> {
        if n > 1 {
            let window = window.unwrap_or(self.max_size);
            let offset = (self.max_size - 1).min(self.offset);
            return Ok(if offset + n > window {
                Mask::Array(causal_mask(n, offset, Some(window))?)
            } else {
                Mask::Causal
            });
        }
        let Some(window) = window else {
            return Ok(Mask::None);
        };
        if self.offset >= window && self.max_size > window {
            // The window is narrower than the ring: mask the ring slots outside it.
            let idx = if self.idx >= self.max_size {
                0
            } else {
                self.idx
            };
            let size = if self.offset < self.max_size {
                self.offset + 1
            } else {
                self.max_size
            };
            let mask =
                mlx_rs::ops::arange::<_, i32>(0, size, 1)?.ge(Array::from_int(size - window))?;
            // mx.roll(mask, idx + 1) on a vector: the last `shift` entries move to the front.
            let shift = (idx + 1).rem_euclid(size);
            let rolled = concatenate(
                &[mask.index((size - shift)..), mask.index(..(size - shift))],
                0,
            )?;
            return Ok(Mask::Array(rolled));
        }
        Ok(Mask::None)
    }
}

impl AttentionCache for RotatingKvCache {
    fn update_and_fetch(&mut self, keys: Array, values: Array) -> Result<Kv, Exception> {
        if keys.shape()[2] == 1 {
            self.update_in_place(keys, values)
        } else {
            self.update_concat(keys, values)
        }
    }

    /// optiq's conversion: the ring buffer quantized as it stands, ring index kept.
    fn quantize(&mut self, quant: KvQuant) -> Result<bool, Exception> {
        parts::quantize_kv(&mut self.keys, &mut self.values, &mut self.quant, quant)
    }

    fn kv_quant(&self) -> Option<KvQuant> {
        self.quant
    }

    fn temporal_kv(&self) -> Result<(Array, Array), Exception> {
        self.newest_window()
    }

    /// With `rings`: a full, dense ring, written at its slot.
    fn compiled(&self, rings: bool) -> Option<Compiled> {
        let (keys, values, slot) = self.full_ring_slot().filter(|_| rings)?;
        Some(Compiled {
            keys: keys.clone(),
            values: values.clone(),
            form: Form::Ring { slot },
        })
    }

    fn compiles(&self, rings: bool) -> bool {
        rings
    }

    fn advance_compiled(
        &mut self,
        form: Form,
        keys: Array,
        values: Array,
    ) -> Result<(), Exception> {
        match form {
            Form::Ring { slot } => {
                self.advance_ring(keys, values, slot);
                Ok(())
            }
            Form::Linear => Err(refused("advance_compiled", "is a ring")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(cache: &mut RotatingKvCache, n: i32) -> (Array, Array) {
        let k = mlx_rs::ops::ones::<f32>(&[1, 1, n, 2]).unwrap();
        match cache.update_and_fetch(k.clone(), k).unwrap() {
            Kv::Dense(k, v) => (k, v),
            Kv::Quantized { .. } => unreachable!("never quantized here"),
        }
    }

    #[test]
    fn ring_keeps_the_window_and_is_trimmable_only_before_wrapping() {
        let mut cache = RotatingKvCache::new(4);
        let (k, _) = step(&mut cache, 3);
        assert_eq!(k.shape()[2], 3);
        assert!(cache.is_trimmable());
        assert_eq!(cache.trim(1), 1);
        assert_eq!(cache.offset(), 2);
        step(&mut cache, 1);
        step(&mut cache, 1);
        let (k, _) = step(&mut cache, 1); // offset 5 > max_size 4: wrapped
        assert_eq!(
            k.shape()[2],
            4,
            "the ring never exceeds max_size for single tokens"
        );
        assert_eq!(cache.offset(), 5);
        assert!(!cache.is_trimmable(), "a wrapped ring cannot be trimmed");
        // A multi-token update keeps max_size - 1 old positions plus the new ones.
        let (k, _) = step(&mut cache, 3);
        assert_eq!(k.shape()[2], 3 + 3);
    }

    #[test]
    fn prefill_masks_follow_mlx_lm() {
        let cache = RotatingKvCache::new(8);
        assert!(matches!(cache.make_mask(4, Some(8)).unwrap(), Mask::Causal));
        assert!(matches!(
            cache.make_mask(12, Some(8)).unwrap(),
            Mask::Array(_)
        ));
        assert!(matches!(cache.make_mask(1, Some(8)).unwrap(), Mask::None));
    }
}
