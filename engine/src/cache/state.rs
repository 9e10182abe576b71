//! mlx-lm's `from_state`: one table from a snapshot's kind tag to the kind that rebuilds
//! it, so the kv-store, the SSD tier and the batch protocol handle any kind generically
//! (`Cache::snapshot` is mlx-lm's `state` + `meta_state`). Plus the meta readers the kinds
//! share.

use mlx_rs::error::Exception;
use mlx_rs::Array;

use super::arrays::ArraysCache;
use super::batch::BatchKvCache;
use super::batch_rotating::BatchRotatingKvCache;
use super::list::CacheList;
use super::parts::Parts;
use super::{Cache, KvCache, KvQuant, Meta, QuantSdpa, RotatingKvCache, Snapshot};

/// Every kind tag the registry rebuilds.
pub const KINDS: [&str; 6] = [
    super::kv::KIND,
    super::rotating::KIND,
    super::batch::KIND,
    super::batch_rotating::KIND,
    super::arrays::KIND,
    super::list::KIND,
];

/// Rebuilds a cache from its snapshot; a quantized one is read through `sdpa` (the
/// attention is the session's choice, not part of the stored state).
pub fn restore(mut s: Snapshot, sdpa: QuantSdpa) -> Result<Box<dyn Cache>, Exception> {
    if let Some(q) = s.quant.as_mut() {
        q.sdpa = sdpa;
    }
    Ok(match s.kind.as_str() {
        super::kv::KIND => Box::new(KvCache::from_state(s)?),
        super::rotating::KIND => Box::new(RotatingKvCache::from_state(s)?),
        super::batch::KIND => Box::new(BatchKvCache::from_state(s)?),
        super::batch_rotating::KIND => Box::new(BatchRotatingKvCache::from_state(s)?),
        super::arrays::KIND => Box::new(ArraysCache::from_state(s)?),
        super::list::KIND => Box::new(CacheList::from_state(s, sdpa)?),
        other => return Err(Exception::custom(format!("unknown cache kind `{other}`"))),
    })
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

/// A K/V snapshot's tensors split into keys' and values' parts (three each when quantized,
/// one each when dense).
pub(crate) fn kv_parts(
    tensors: Vec<Array>,
    quant: Option<KvQuant>,
) -> Result<(Parts, Parts), Exception> {
    let per_side = if quant.is_some() { 3 } else { 1 };
    if tensors.len() != 2 * per_side {
        return Err(Exception::custom(
            "a cache snapshot holds keys' and values' parts",
        ));
    }
    let mut keys = tensors;
    let values = keys.split_off(per_side);
    Ok((keys, values))
}
