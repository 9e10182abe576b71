//! The standard KV cache, laid out like mlx-lm's `KVCache`: buffers grow in steps of 256
//! positions, new keys are written with a slice update, and reads slice to the offset.
//! Once quantized it is mlx-lm's `QuantizedKVCache`: the same growth and slicing applied to
//! the packed words, scales and biases, new keys quantized on write.

use mlx_rs::error::Exception;
use mlx_rs::Array;

pub mod batch;

use self::batch::BatchKvCache;
use super::fixed::{Compiled, Form};
use super::parts::{self, Parts};
use super::{causal_mask, refused, AttentionCache, Cache, Kv, KvQuant, Mask, Meta, Snapshot};

/// The kind tag of its snapshots (the kv-store's `kv`, `qkv` once quantized).
pub const KIND: &str = "kv";

#[derive(Default)]
pub struct KvCache {
    keys: Option<Parts>,
    values: Option<Parts>,
    offset: i32,
    quant: Option<KvQuant>,
}

impl KvCache {
    pub const STEP: i32 = 256;

    pub fn new() -> Self {
        Self::default()
    }

    /// The whole dense buffers, if the next `n` tokens fit without growing them.
    pub fn buffers_with_room(&self, n: i32) -> Option<(&Array, &Array)> {
        if self.quant.is_some() {
            return None;
        }
        let (k, v) = (self.keys.as_ref()?, self.values.as_ref()?);
        (self.offset + n <= parts::len(k)).then_some((&k[0], &v[0]))
    }

    /// A cache holding `offset` positions given as parts sliced to them (kv-store restore).
    pub fn from_parts(keys: Parts, values: Parts, offset: i32, quant: Option<KvQuant>) -> Self {
        KvCache {
            keys: Some(keys),
            values: Some(values),
            offset,
            quant,
        }
    }

    /// The live dense keys and values ([1, heads, offset, head dim]), if any.
    pub fn live(&self) -> Option<(Array, Array)> {
        if self.quant.is_some() {
            return None;
        }
        let (k, v) = (self.keys.as_ref()?, self.values.as_ref()?);
        Some((
            parts::live(k, self.offset).remove(0),
            parts::live(v, self.offset).remove(0),
        ))
    }

    /// mlx-lm's `from_state`: the live parts with the offset (and quantization).
    pub fn from_state(s: Snapshot) -> Result<Self, Exception> {
        if s.kind != KIND {
            return Err(Exception::custom("a standard cache's snapshot expected"));
        }
        let (keys, values) = parts::split_kv(s.tensors, s.quant)?;
        Ok(Self::from_parts(keys, values, s.offset, s.quant))
    }

    /// Takes the buffers a compiled step produced after writing `n` tokens in place.
    pub fn advance_with(&mut self, keys: Array, values: Array, n: i32) {
        self.keys = Some(vec![keys]);
        self.values = Some(vec![values]);
        self.offset += n;
    }
}

impl Cache for KvCache {
    fn offset(&self) -> i32 {
        self.offset
    }

    fn kind(&self) -> Option<&'static str> {
        Some(KIND)
    }

    /// The live positions only (the buffer's unused tail is not stored).
    fn snapshot(&self) -> Option<Snapshot> {
        let (k, v) = (self.keys.as_ref()?, self.values.as_ref()?);
        let mut tensors = parts::live(k, self.offset);
        tensors.extend(parts::live(v, self.offset));
        Some(Snapshot {
            kind: KIND.to_owned(),
            offset: self.offset,
            quant: self.quant,
            meta: Meta::new(),
            tensors,
        })
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
        parts::kv_state(&self.keys, &self.values)
    }

    attention_views!();

    /// mlx-lm's `KVCache.merge`: the rows as one `BatchKVCache`.
    fn merge(&self, rows: &[&dyn Cache]) -> Result<Box<dyn Cache>, Exception> {
        Ok(Box::new(BatchKvCache::merge(rows)?))
    }

    /// mlx-lm's `create_attention_mask(N, offset, return_array=False, window_size)`.
    fn make_mask(&self, n: i32, window: Option<i32>) -> Result<Mask, Exception> {
        Ok(match window {
            Some(w) => Mask::Array(causal_mask(n, self.offset, Some(w))?),
            None if n == 1 => Mask::None,
            None => Mask::Causal,
        })
    }
}

impl AttentionCache for KvCache {
    fn update_and_fetch(&mut self, keys: Array, values: Array) -> Result<Kv, Exception> {
        let prev = self.offset;
        let cut = prev % Self::STEP != 0;
        let like = (&keys, &values);
        parts::reserve_kv(
            &mut self.keys,
            &mut self.values,
            like,
            prev,
            Self::STEP,
            self.quant,
            cut,
        )?;
        self.offset += keys.shape()[2];
        let new_k = parts::encode(keys, self.quant)?;
        let new_v = parts::encode(values, self.quant)?;
        let end = self.offset;
        parts::write_kv(
            (&mut self.keys, &mut self.values),
            prev,
            (&new_k, &new_v),
            |p| parts::live(p, end),
            self.quant,
        )
    }

    fn quantize(&mut self, quant: KvQuant) -> Result<bool, Exception> {
        parts::quantize_kv(&mut self.keys, &mut self.values, &mut self.quant, quant)
    }

    fn kv_quant(&self) -> Option<KvQuant> {
        self.quant
    }

    fn temporal_kv(&self) -> Result<(Array, Array), Exception> {
        self.live()
            .ok_or_else(|| Exception::custom("a donor cache is empty or quantized"))
    }

    /// The whole dense buffers, while the token fits without growing them.
    fn compiled(&self, _rings: bool) -> Option<Compiled> {
        let (keys, values) = self.buffers_with_room(1)?;
        Some(Compiled {
            keys: keys.clone(),
            values: values.clone(),
            form: Form::Linear,
        })
    }

    fn compiles(&self, _rings: bool) -> bool {
        true
    }

    fn advance_compiled(
        &mut self,
        form: Form,
        keys: Array,
        values: Array,
    ) -> Result<(), Exception> {
        match form {
            Form::Linear => {
                self.advance_with(keys, values, 1);
                Ok(())
            }
            Form::Ring { .. } => Err(refused("advance_compiled", "is not a ring")),
        }
    }
}
