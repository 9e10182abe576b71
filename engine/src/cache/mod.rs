//! KV caches. Each attention layer owns one; the model reads `offset` for RoPE and the mask.

pub mod batch;
pub mod batch_rotating;
pub mod fingerprint;
pub mod fixed;
pub mod kv;
pub mod kv_quant;
pub mod kvstore;
pub mod none;
pub(crate) mod parts;
pub mod prompt;
pub mod rotating;
pub mod ssd;

pub use kv::KvCache;
pub use rotating::RotatingKvCache;

use mlx_rs::error::Exception;
use mlx_rs::Array;

/// What attention needs from a cache, whatever its layout.
pub trait Cache {
    /// Tokens stored so far (the position of the next token).
    fn offset(&self) -> i32;
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
    /// The cache's state for the kv-store (None for kinds that are not stored, e.g. the
    /// compiled step's or the batch lane's).
    fn snapshot(&self) -> Option<Snapshot> {
        None
    }
    /// Bytes the stored K/V buffers hold.
    fn nbytes(&self) -> usize {
        self.state().iter().map(|a| a.nbytes()).sum()
    }
    /// Whether `trim` can drop tokens from the end.
    fn is_trimmable(&self) -> bool;
    /// Drops up to `n` tokens from the end; returns how many were dropped.
    fn trim(&mut self, n: i32) -> i32;
    /// The arrays that hold the cache's state (for eval).
    fn state(&self) -> Vec<&Array>;
    /// The attention mask for `n` new tokens, as mlx-lm's cache of this kind makes it;
    /// `window` is the attention window of the layer kind asking (None = full attention).
    fn make_mask(&self, n: i32, window: Option<i32>) -> Result<Mask, Exception>;
    /// The RoPE position of the next token (an array inside compiled steps).
    fn rope_offset(&self) -> RopeOffset {
        RopeOffset::Int(self.offset())
    }
    /// For callers that need the concrete cache (e.g. the compiled decode step).
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any;
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

/// A cache's state as the kv-store writes it: its kind, positions and arrays (keys' parts,
/// then values' parts: one each when dense, packed/scales/biases each when quantized).
#[derive(Clone)]
pub struct Snapshot {
    pub kind: SnapshotKind,
    pub offset: i32,
    pub quant: Option<KvQuant>,
    pub tensors: Vec<Array>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SnapshotKind {
    /// A standard cache, sliced to its live positions.
    Kv,
    /// A ring stored whole with its index.
    Rotating { max_size: i32, keep: i32, idx: i32 },
}

/// Rebuilds a cache from its snapshot; a quantized one is read through `sdpa` (the
/// attention is the session's choice, not part of the stored state).
pub fn restore(mut s: Snapshot, sdpa: QuantSdpa) -> Result<Box<dyn Cache>, Exception> {
    if let Some(q) = s.quant.as_mut() {
        q.sdpa = sdpa;
    }
    let per_side = if s.quant.is_some() { 3 } else { 1 };
    if s.tensors.len() != 2 * per_side {
        return Err(Exception::custom(
            "a cache snapshot holds keys' and values' parts",
        ));
    }
    let mut tensors = s.tensors;
    let values = tensors.split_off(per_side);
    Ok(match s.kind {
        SnapshotKind::Kv => Box::new(KvCache::from_parts(tensors, values, s.offset, s.quant)),
        SnapshotKind::Rotating {
            max_size,
            keep,
            idx,
        } => Box::new(RotatingKvCache::from_parts(
            tensors, values, s.offset, max_size, keep, idx, s.quant,
        )),
    })
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
    let sdpa = c.kv_quant().map_or(QuantSdpa::MlxLm, |q| q.sdpa);
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
