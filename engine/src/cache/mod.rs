//! Caches: the protocol every kind implements (`Cache`, mlx-lm 0.32.2's `_BaseCache`), its
//! K/V side for attention (`AttentionCache`), and the kinds. Each layer owns one; the model
//! reads `offset` for RoPE and the mask.

/// The `Cache::as_kv`/`as_kv_ref` pair of a kind that is its own `AttentionCache` (inside
/// its `impl Cache`).
macro_rules! attention_views {
    () => {
        fn as_kv(&mut self) -> Option<&mut dyn $crate::cache::AttentionCache> {
            Some(self)
        }

        fn as_kv_ref(&self) -> Option<&dyn $crate::cache::AttentionCache> {
            Some(self)
        }
    };
}
pub(crate) use attention_views;

pub mod arrays;
pub mod chunked;
pub mod fingerprint;
pub mod fixed;
pub mod kv;
pub mod kv_quant;
pub mod kvstore;
pub mod list;
pub mod none;
pub(crate) mod parts;
pub mod prompt;
pub mod rotating;
pub mod ssd;
#[cfg(test)]
mod tests;

pub use arrays::ArraysCache;
pub use kv::batch::BatchKvCache;
pub use kv::KvCache;
pub use list::CacheList;
pub use rotating::batch::BatchRotatingKvCache;
pub use rotating::RotatingKvCache;

use mlx_rs::error::Exception;
use mlx_rs::Array;

/// A cache of any kind, in the shape of mlx-lm 0.32.2's `_BaseCache`: its position, its
/// state for the kv-store (`snapshot` = `state` + meta + kind tag, rebuilt by
/// [`restore`], mlx-lm's `from_state`), trimming, the mask, and the batch protocol
/// (`merge`/`filter`/`extend`/`extract`/`prepare`/`finalize`) whose defaults refuse. K/V
/// attention reaches its own side through [`Cache::as_kv`]; no caller needs the concrete type.
pub trait Cache {
    /// Tokens stored so far (the position of the next token).
    fn offset(&self) -> i32;
    /// The registry tag of this kind (`restore` rebuilds by it); None for kinds
    /// that are neither stored nor batched (wrappers, the compiled step's, training's).
    fn kind(&self) -> Option<&'static str> {
        None
    }
    /// Whether this stands for no cache at all (training's pass-through: mlx-lm's cache
    /// None), where a forward may differ from any cached one (Gemma 3n shares K/V only
    /// through a cache).
    fn is_pass_through(&self) -> bool {
        false
    }
    /// The cache's state for the kv-store and the batch protocol: arrays, meta and kind
    /// (None while empty or for kinds that are not stored).
    fn snapshot(&self) -> Option<Snapshot> {
        None
    }
    /// Bytes the stored buffers hold.
    fn nbytes(&self) -> usize {
        self.state().iter().map(|a| a.nbytes()).sum()
    }
    /// Whether `trim` can drop tokens from the end.
    fn is_trimmable(&self) -> bool {
        false
    }
    /// Drops up to `n` tokens from the end; returns how many were dropped.
    fn trim(&mut self, _n: i32) -> i32 {
        0
    }
    /// The arrays that hold the cache's state (for eval).
    fn state(&self) -> Vec<&Array>;
    /// The attention mask for `n` new tokens, as mlx-lm's cache of this kind makes it;
    /// `window` is the attention window of the layer kind asking (None = full attention).
    fn make_mask(&self, n: i32, window: Option<i32>) -> Result<Mask, Exception>;
    /// The RoPE position of the next token (an array inside compiled steps).
    fn rope_offset(&self) -> RopeOffset {
        RopeOffset::Int(self.offset())
    }
    /// The K/V side, for attention (None: not a K/V cache, e.g. a recurrent state).
    fn as_kv(&mut self) -> Option<&mut dyn AttentionCache> {
        None
    }
    /// As `as_kv`, read-only.
    fn as_kv_ref(&self) -> Option<&dyn AttentionCache> {
        None
    }
    /// The recurrent side, for a state mixer (short conv, SSM, gated delta net): mlx-lm's
    /// `ArraysCache` (None: not a state cache, e.g. a pass-through in a cache-less run).
    fn as_arrays(&mut self) -> Option<&mut ArraysCache> {
        None
    }
    /// A composite cache's sub-caches (mlx-lm's `CacheList.__getitem__`); None otherwise.
    fn sub_caches(&self) -> Option<&[Box<dyn Cache>]> {
        None
    }
    /// As `sub_caches`, to update them (a parallel mixer hands each branch its part).
    fn sub_caches_mut(&mut self) -> Option<&mut [Box<dyn Cache>]> {
        None
    }
    /// Makes `dep` part of this cache's state, evaluated with it (a pipeline stage's send);
    /// false where this kind cannot carry one.
    fn carry(&mut self, _dep: &Array) -> bool {
        false
    }

    // Speculative decoding.

    /// Gives back the newest `n` positions after rejected drafts: trimmable caches trim
    /// (a ring overrides this with optiq's tail slice, so it rolls back past its window).
    fn rollback(&mut self, n: i32) -> Result<(), Exception> {
        if n > 0 && !self.is_trimmable() {
            return Err(Exception::custom(
                "speculative decoding needs caches that can give positions back",
            ));
        }
        self.trim(n);
        Ok(())
    }
    /// How many more positions this cache can take and still give back by `trim` (None:
    /// no bound but trimmability).
    fn rollback_room(&self) -> Option<i32> {
        None
    }
    /// Whether `checkpoint` gives a state to come back to (asked on every speculative pass,
    /// so it builds nothing).
    fn can_checkpoint(&self) -> bool {
        false
    }
    /// The state to come back to after a speculative pass (a recurrent state cannot be
    /// trimmed); None where this kind has no checkpoint.
    fn checkpoint(&self) -> Option<Snapshot> {
        None
    }
    /// Returns to a `checkpoint` of this same cache.
    fn restore_checkpoint(&mut self, _c: Snapshot) -> Result<(), Exception> {
        Err(refused("restore_checkpoint", "has no checkpoint"))
    }

    // The batch protocol (mlx-lm's `merge`/`filter`/`extend`/`extract`/`prepare`/`finalize`).

    /// Rows held, for a batch cache (None: a single-sequence cache).
    fn rows(&self) -> Option<usize> {
        None
    }
    /// mlx-lm's `merge` classmethod of this kind, reached through one of `rows`: the
    /// single-sequence caches `rows` (this kind, this cache among them or not) as one batch.
    fn merge(&self, _rows: &[&dyn Cache]) -> Result<Box<dyn Cache>, Exception> {
        Err(refused("merge", "cannot be merged into a batch"))
    }
    /// Keeps rows `keep` (in that order).
    fn filter(&mut self, _keep: &[usize]) -> Result<(), Exception> {
        Err(refused("filter", "is not a batch"))
    }
    /// Appends the rows of `other` (a batch of this kind) after this one's.
    fn extend(&mut self, _other: &dyn Cache) -> Result<(), Exception> {
        Err(refused("extend", "is not a batch"))
    }
    /// Row `row`'s first `len` tokens as a single-sequence cache.
    fn extract(&self, _row: usize, _len: i32) -> Result<Box<dyn Cache>, Exception> {
        Err(refused("extract", "is not a batch"))
    }
    /// Before a batched prefill: each row's real length.
    fn prepare(&mut self, _lengths: &[i32]) -> Result<(), Exception> {
        Err(refused("prepare", "has no batched prefill"))
    }
    /// After a batched prefill.
    fn finalize(&mut self) -> Result<(), Exception> {
        Err(refused("finalize", "has no batched prefill"))
    }
    /// Drops the last `n[r]` tokens of each row `r` (a batched speculative verify's
    /// rejected drafts, a count per row).
    fn trim_rows(&mut self, _n: &[i32]) -> Result<(), Exception> {
        Err(refused("trim_rows", "cannot give tokens back row by row"))
    }
}

/// What attention needs on top of [`Cache`]: K/V storage (mlx-lm's `update_and_fetch`),
/// its quantization, and the views the assistant drafter and the compiled step take.
pub trait AttentionCache: Cache {
    /// Appends this step's keys/values ([B, kv_heads, L, head_dim]) and returns all live
    /// ones, in the cache's layout (dense, or quantized once converted).
    fn update_and_fetch(&mut self, keys: Array, values: Array) -> Result<Kv, Exception>;
    /// Converts the stored K/V to affine-quantized form (mlx-lm's `to_quantized`, optiq's
    /// `quantize_cache_layer`); later updates are quantized on write. Returns false where
    /// this kind of cache cannot be quantized.
    fn quantize(&mut self, _quant: KvQuant) -> Result<bool, Exception> {
        Ok(false)
    }
    /// The quantization in force, if any.
    fn kv_quant(&self) -> Option<KvQuant> {
        None
    }
    /// The dense K/V in temporal order as optiq's `_read_cache_temporal` reads a donor
    /// cache (a ring: its newest min(offset, window − 1) positions).
    fn temporal_kv(&self) -> Result<(Array, Array), Exception> {
        Err(refused(
            "temporal_kv",
            "is not a standard or rotating cache",
        ))
    }
    /// How this cache enters the compiled one-token step now (see `fixed::Compiled`);
    /// None where it cannot (no room, quantized, a ring still growing, another kind).
    fn compiled(&self, _rings: bool) -> Option<fixed::Compiled> {
        None
    }
    /// Whether this kind can ever take the compiled step.
    fn compiles(&self, _rings: bool) -> bool {
        false
    }
    /// Takes the buffers the compiled step wrote its token into (`form` as `compiled` gave).
    fn advance_compiled(
        &mut self,
        _form: fixed::Form,
        _keys: Array,
        _values: Array,
    ) -> Result<(), Exception> {
        Err(refused(
            "advance_compiled",
            "does not take the compiled step",
        ))
    }
}

/// The refusal of protocol method `op` by a kind that lacks it.
pub(crate) fn refused(op: &str, why: &str) -> Exception {
    Exception::custom(format!("cache protocol: `{op}`: this cache {why}"))
}

/// `cache`'s K/V side, or the refusal an attention layer gives without one.
pub fn kv_of(cache: &mut dyn Cache) -> Result<&mut dyn AttentionCache, Exception> {
    cache
        .as_kv()
        .ok_or_else(|| Exception::custom("an attention layer was given a cache without K/V"))
}

/// The KV quantization in force on `cache` (None for caches without K/V).
pub fn kv_quant_of(cache: &dyn Cache) -> Option<KvQuant> {
    cache.as_kv_ref().and_then(|kv| kv.kv_quant())
}

/// Affine quantization of a KV cache (MLX `quantize`: groups along the head dim).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvQuant {
    pub bits: i32,
    pub group_size: i32,
    /// Which attention reads this cache.
    pub sdpa: QuantSdpa,
}

/// Attention over quantized K/V.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantSdpa {
    /// mlx-lm's `quantized_scaled_dot_product_attention` (L1 with `--kv-bits`).
    MlxLm,
    /// optiq 0.7.7's fused KV-tiled kernel where optiq's server uses it (L2).
    OptiqFused,
    /// As `OptiqFused`, but one-token decode dequantizes the cache and runs the dense SDPA
    /// kernel (L3: ours, faster on CPU, no oracle; gated by the envelope).
    DequantDecode,
}

/// One affine-quantized tensor, as `mx.quantize` returns it.
#[derive(Clone)]
pub struct QTensor {
    pub packed: Array,
    pub scales: Array,
    pub biases: Array,
}

impl QTensor {
    fn from_parts(parts: Vec<Array>) -> Self {
        let mut it = parts.into_iter();
        let mut next = || it.next().expect("quantized parts come in threes");
        QTensor {
            packed: next(),
            scales: next(),
            biases: next(),
        }
    }

    /// The same map applied to all three arrays.
    pub fn map(&self, f: impl Fn(&Array) -> Result<Array, Exception>) -> Result<Self, Exception> {
        Ok(QTensor {
            packed: f(&self.packed)?,
            scales: f(&self.scales)?,
            biases: f(&self.biases)?,
        })
    }
}

/// Keys and values as attention reads them.
#[derive(Clone)]
pub enum Kv {
    Dense(Array, Array),
    Quantized {
        keys: QTensor,
        values: QTensor,
        quant: KvQuant,
    },
}

/// A cache's state as the kv-store writes it and `restore` rebuilds it: mlx-lm's
/// `state` (`tensors`: for K/V kinds keys' parts, then values' parts, one each when dense,
/// packed/scales/biases each when quantized) and `meta_state` (`meta`: the kind's integers
/// and lists, camelCase, in the order the kv-store writes them), with its kind tag.
#[derive(Clone)]
pub struct Snapshot {
    pub kind: String,
    pub offset: i32,
    pub quant: Option<KvQuant>,
    pub meta: Meta,
    pub tensors: Vec<Array>,
}

/// A snapshot's meta state: JSON integers, booleans and lists by name.
pub type Meta = serde_json::Map<String, serde_json::Value>;

/// Every kind tag the registry rebuilds.
pub const KINDS: [&str; 6] = [
    kv::KIND,
    rotating::KIND,
    kv::batch::KIND,
    rotating::batch::KIND,
    arrays::KIND,
    list::KIND,
];

/// Rebuilds a cache from its snapshot (mlx-lm's `from_state`, one table from the kind tag to
/// the kind, so the kv-store, the SSD tier and the batch protocol handle any kind generically); a quantized one is read through `sdpa` (the
/// attention is the session's choice, not part of the stored state).
pub fn restore(mut s: Snapshot, sdpa: QuantSdpa) -> Result<Box<dyn Cache>, Exception> {
    if let Some(q) = s.quant.as_mut() {
        q.sdpa = sdpa;
    }
    Ok(match s.kind.as_str() {
        kv::KIND => Box::new(KvCache::from_state(s)?),
        rotating::KIND => Box::new(RotatingKvCache::from_state(s)?),
        kv::batch::KIND => Box::new(BatchKvCache::from_state(s)?),
        rotating::batch::KIND => Box::new(BatchRotatingKvCache::from_state(s)?),
        arrays::KIND => Box::new(ArraysCache::from_state(s)?),
        list::KIND => Box::new(CacheList::from_state(s, sdpa)?),
        other => return Err(Exception::custom(format!("unknown cache kind `{other}`"))),
    })
}

/// The snapshot of `c` when it is of kind `kind` (what a batch reads another batch by, as
/// `extend` does), or the refusal naming what was expected.
pub(crate) fn snapshot_of(c: &dyn Cache, kind: &str) -> Result<Snapshot, Exception> {
    c.snapshot()
        .filter(|_| c.kind() == Some(kind))
        .ok_or_else(|| Exception::custom(format!("a `{kind}` cache expected")))
}

/// A snapshot's integer `key`.
pub(crate) fn meta_i32(meta: &Meta, key: &str) -> Result<i32, Exception> {
    meta.get(key)
        .and_then(|v| v.as_i64())
        .and_then(|v| i32::try_from(v).ok())
        .ok_or_else(|| Exception::custom(format!("a cache snapshot without `{key}`")))
}

/// A snapshot's list of integers `key`.
pub(crate) fn meta_i32s(meta: &Meta, key: &str) -> Result<Vec<i32>, Exception> {
    meta.get(key)
        .and_then(|v| v.as_array())
        .and_then(|a| {
            a.iter()
                .map(|v| v.as_i64().and_then(|v| i32::try_from(v).ok()))
                .collect()
        })
        .ok_or_else(|| Exception::custom(format!("a cache snapshot without `{key}`")))
}

/// `key` → the integers `v` (a meta entry).
pub(crate) fn ints(v: &[i32]) -> serde_json::Value {
    serde_json::Value::from(v.to_vec())
}

/// How many tokens every cache of `caches` holds (0 for none), at most `cap`.
pub fn common_len(caches: &[Box<dyn Cache>], cap: usize) -> usize {
    caches
        .iter()
        .map(|c| c.offset().max(0) as usize)
        .min()
        .unwrap_or(0)
        .min(cap)
}

/// An independent copy of a cache (through its snapshot: the arrays are shared, and MLX
/// copies a shared buffer before writing into it, so neither copy sees the other's writes).
/// None for kinds without a snapshot.
pub fn duplicate(c: &dyn Cache) -> Option<Box<dyn Cache>> {
    let sdpa = kv_quant_of(c).map_or(QuantSdpa::MlxLm, |q| q.sdpa);
    restore(c.snapshot()?, sdpa).ok()
}

/// A RoPE position: a plain integer, or an MLX array (so a compiled graph can be reused
/// at every position).
#[derive(Clone)]
pub enum RopeOffset {
    Int(i32),
    Array(Array),
}

/// An attention mask as mlx-lm passes it to SDPA.
#[derive(Clone)]
pub enum Mask {
    None,
    /// SDPA's built-in causal mode (bottom-right aligned).
    Causal,
    /// An explicit boolean mask (true = attend).
    Array(Array),
}

impl Mask {
    pub fn as_sdpa(&self) -> Option<mlx_rs::fast::ScaledDotProductAttentionMask<'_>> {
        use mlx_rs::fast::ScaledDotProductAttentionMask as M;
        match self {
            Mask::None => None,
            Mask::Causal => Some(M::Causal),
            Mask::Array(a) => Some(M::Array(a)),
        }
    }
}

/// mlx-lm's `create_causal_mask(N, offset, window_size)`: query i (at offset + i) sees key
/// j iff j ≤ offset + i and, with a window, offset + i < j + window.
pub fn causal_mask(n: i32, offset: i32, window: Option<i32>) -> Result<Array, Exception> {
    use mlx_rs::ops::arange;
    use mlx_rs::ops::indexing::{IndexOp, NewAxis};
    let rinds = arange::<_, i32>(0, offset + n, 1)?;
    let linds = if offset != 0 {
        arange::<_, i32>(offset, offset + n, 1)?
    } else {
        rinds.clone()
    };
    let linds = linds.index((.., NewAxis));
    let rinds = rinds.index((NewAxis, ..));
    let mut mask = linds.ge(&rinds)?;
    if let Some(w) = window {
        mask = mask.logical_and(linds.lt(rinds.add(Array::from_int(w))?)?)?;
    }
    Ok(mask)
}
