//! mlx-lm 0.32.2's `CacheList`: one layer's cache made of sub-caches (a hybrid layer's
//! attention K/V beside its recurrent state). Trimmable when every part is, `trim` trims
//! each (returning the last's count, as mlx-lm), `offset` is the largest part's (mlx-lm's
//! `size()`), and every batch op applies part by part (`merge` merges the i-th parts of all
//! rows with the i-th part's own kind). Its snapshot nests the parts' (each part's kind,
//! offset, meta, quantization and tensor count in `caches`, their tensors in order) and
//! `restore` rebuilds each part through the same table. The mask and RoPE position
//! are those of the first part with K/V (mlx-lm's models ask the part they attend with:
//! falcon_h1's `create_attention_mask(h, cache[1])`), or the first part's if none has K/V.
//! Falcon-H1's layers keep one: [ArraysCache, KvCache].

use mlx_rs::error::Exception;
use mlx_rs::Array;
use serde_json::Value;

use super::{kv_quant_of, Cache, KvQuant, Mask, Meta, QuantSdpa, RopeOffset, Snapshot};

/// The kind tag of its snapshots.
pub const KIND: &str = "list";

pub struct CacheList {
    caches: Vec<Box<dyn Cache>>,
}

impl CacheList {
    pub fn new(caches: Vec<Box<dyn Cache>>) -> Self {
        CacheList { caches }
    }

    pub fn get(&self, i: usize) -> &dyn Cache {
        self.caches[i].as_ref()
    }

    pub fn get_mut(&mut self, i: usize) -> &mut dyn Cache {
        self.caches[i].as_mut()
    }

    /// Rebuilds every part through `restore` (`sdpa` for quantized parts).
    pub fn from_state(s: Snapshot, sdpa: QuantSdpa) -> Result<Self, Exception> {
        if s.kind != KIND {
            return Err(Exception::custom("a cache list's snapshot expected"));
        }
        let bad = || Exception::custom("a cache list's snapshot without its parts");
        let parts = s
            .meta
            .get("caches")
            .and_then(Value::as_array)
            .ok_or_else(bad)?;
        let mut tensors = s.tensors.into_iter();
        let mut caches = Vec::with_capacity(parts.len());
        for p in parts {
            let mut meta = p.as_object().cloned().ok_or_else(bad)?;
            let mut take = |key: &str| meta.remove(key);
            let kind = take("kind").and_then(|v| v.as_str().map(str::to_owned));
            let offset = take("offset").and_then(|v| v.as_i64());
            let count = take("tensors").and_then(|v| v.as_u64());
            let (bits, group_size) = (take("bits"), take("groupSize"));
            let (Some(kind), Some(offset), Some(count)) = (kind, offset, count) else {
                return Err(bad());
            };
            let quant = match (
                bits.and_then(|v| v.as_i64()),
                group_size.and_then(|v| v.as_i64()),
            ) {
                (Some(bits), Some(group_size)) => Some(KvQuant {
                    bits: bits as i32,
                    group_size: group_size as i32,
                    sdpa,
                }),
                _ => None,
            };
            let part = Snapshot {
                kind,
                offset: offset as i32,
                quant,
                meta,
                tensors: tensors.by_ref().take(count as usize).collect(),
            };
            if part.tensors.len() != count as usize {
                return Err(bad());
            }
            caches.push(super::restore(part, sdpa)?);
        }
        if tensors.next().is_some() {
            return Err(bad());
        }
        Ok(CacheList { caches })
    }

    /// The part attention reads: the first with K/V, else the first.
    fn attended(&self) -> Option<&dyn Cache> {
        let kv = self.caches.iter().find(|c| c.as_kv_ref().is_some());
        kv.or(self.caches.first()).map(|c| c.as_ref())
    }

    /// The attention reading quantized parts (mlx-lm's, unless a part says otherwise).
    fn sdpa(&self) -> QuantSdpa {
        self.caches
            .iter()
            .find_map(|c| kv_quant_of(c.as_ref()))
            .map_or(QuantSdpa::MlxLm, |q| q.sdpa)
    }

    /// The sub-caches of `c` if it is a list of as many parts, or the refusal.
    fn parts_of(c: &dyn Cache, n: usize) -> Result<&[Box<dyn Cache>], Exception> {
        c.sub_caches()
            .filter(|p| c.kind() == Some(KIND) && p.len() == n)
            .ok_or_else(|| Exception::custom("a cache list of as many parts expected"))
    }
}

impl Cache for CacheList {
    fn offset(&self) -> i32 {
        self.caches.iter().map(|c| c.offset()).max().unwrap_or(0)
    }

    fn kind(&self) -> Option<&'static str> {
        Some(KIND)
    }

    /// The parts' snapshots nested (None if any part has none).
    fn snapshot(&self) -> Option<Snapshot> {
        let mut parts = Vec::new();
        let mut tensors = Vec::new();
        for c in &self.caches {
            let s = c.snapshot()?;
            let mut entry = Meta::new();
            entry.insert("kind".to_owned(), s.kind.into());
            entry.insert("offset".to_owned(), s.offset.into());
            entry.extend(s.meta);
            if let Some(q) = s.quant {
                entry.insert("groupSize".to_owned(), q.group_size.into());
                entry.insert("bits".to_owned(), q.bits.into());
            }
            entry.insert("tensors".to_owned(), s.tensors.len().into());
            parts.push(Value::Object(entry));
            tensors.extend(s.tensors);
        }
        Some(Snapshot {
            kind: KIND.to_owned(),
            offset: self.offset(),
            quant: None,
            meta: Meta::from_iter([("caches".to_owned(), Value::Array(parts))]),
            tensors,
        })
    }

    fn nbytes(&self) -> usize {
        self.caches.iter().map(|c| c.nbytes()).sum()
    }

    fn is_trimmable(&self) -> bool {
        self.caches.iter().all(|c| c.is_trimmable())
    }

    /// Trims every part; the last part's count (mlx-lm returns its loop's last `m`).
    fn trim(&mut self, n: i32) -> i32 {
        self.caches.iter_mut().fold(0, |_, c| c.trim(n))
    }

    fn state(&self) -> Vec<&Array> {
        self.caches.iter().flat_map(|c| c.state()).collect()
    }

    fn make_mask(&self, n: i32, window: Option<i32>) -> Result<Mask, Exception> {
        match self.attended() {
            Some(c) => c.make_mask(n, window),
            None => Ok(Mask::None),
        }
    }

    fn rope_offset(&self) -> RopeOffset {
        self.attended()
            .map_or(RopeOffset::Int(0), |c| c.rope_offset())
    }

    fn sub_caches(&self) -> Option<&[Box<dyn Cache>]> {
        Some(&self.caches)
    }

    fn sub_caches_mut(&mut self) -> Option<&mut [Box<dyn Cache>]> {
        Some(&mut self.caches)
    }

    fn can_checkpoint(&self) -> bool {
        true
    }

    fn checkpoint(&self) -> Option<Snapshot> {
        self.snapshot()
    }

    fn restore_checkpoint(&mut self, c: Snapshot) -> Result<(), Exception> {
        *self = Self::from_state(c, self.sdpa())?;
        Ok(())
    }

    fn rows(&self) -> Option<usize> {
        self.caches.first().and_then(|c| c.rows())
    }

    /// mlx-lm's `CacheList.merge`: the i-th parts of all rows merged by the i-th part's kind.
    fn merge(&self, rows: &[&dyn Cache]) -> Result<Box<dyn Cache>, Exception> {
        let n = self.caches.len();
        let lists = rows
            .iter()
            .map(|r| Self::parts_of(*r, n))
            .collect::<Result<Vec<_>, _>>()?;
        let caches = (0..n)
            .map(|i| {
                let column: Vec<&dyn Cache> = lists.iter().map(|l| l[i].as_ref()).collect();
                column[0].merge(&column)
            })
            .collect::<Result<_, _>>()?;
        Ok(Box::new(CacheList { caches }))
    }

    fn filter(&mut self, keep: &[usize]) -> Result<(), Exception> {
        self.caches.iter_mut().try_for_each(|c| c.filter(keep))
    }

    fn extend(&mut self, other: &dyn Cache) -> Result<(), Exception> {
        let theirs = Self::parts_of(other, self.caches.len())?;
        for (c, o) in self.caches.iter_mut().zip(theirs) {
            c.extend(o.as_ref())?;
        }
        Ok(())
    }

    fn extract(&self, row: usize, len: i32) -> Result<Box<dyn Cache>, Exception> {
        let caches = self
            .caches
            .iter()
            .map(|c| c.extract(row, len))
            .collect::<Result<_, _>>()?;
        Ok(Box::new(CacheList { caches }))
    }

    fn prepare(&mut self, lengths: &[i32]) -> Result<(), Exception> {
        self.caches.iter_mut().try_for_each(|c| c.prepare(lengths))
    }

    fn finalize(&mut self) -> Result<(), Exception> {
        self.caches.iter_mut().try_for_each(|c| c.finalize())
    }
}
