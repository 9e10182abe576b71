//! Snapshots through the kv-store and `restore`: any kind generically, and the K/V
//! kinds' header entries exactly as before the protocol.

use super::*;
use crate::cache::arrays::ArraysCache;
use crate::cache::kvstore::{self, Identity};
use crate::cache::list::CacheList;
use crate::cache::{restore, QuantSdpa, RotatingKvCache, Snapshot};

fn id() -> Identity {
    Identity {
        model_id: "m".into(),
        config_fingerprint: "c".into(),
        ns: String::new(),
        tokenizer_hash: "t".into(),
    }
}

/// Writes `caches`' snapshots and reads them back: (the header's JSON, the snapshots).
fn through_store(caches: &[&dyn Cache]) -> (String, Vec<Snapshot>) {
    let snaps: Vec<Snapshot> = caches.iter().map(|c| c.snapshot().unwrap()).collect();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("e.mlxkv");
    kvstore::write(&path, &id(), &[1, 2, 3], &snaps, "2026-12-04T00:00:00Z").unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let len = u32::from_le_bytes(bytes[12..16].try_into().unwrap()) as usize;
    let json = String::from_utf8(bytes[56..56 + len].to_vec()).unwrap();
    (json, kvstore::read(&path, true).unwrap().1)
}

fn same_arrays(a: &dyn Cache, b: &dyn Cache) {
    let (x, y) = (a.snapshot().unwrap(), b.snapshot().unwrap());
    assert_eq!((&x.kind, x.offset, &x.meta), (&y.kind, y.offset, &y.meta));
    assert_eq!(x.tensors.len(), y.tensors.len());
    for (p, q) in x.tensors.iter().zip(&y.tensors) {
        assert_eq!((p.shape(), floats(p)), (q.shape(), floats(q)));
    }
}

#[test]
fn arrays_and_list_round_trip_through_the_store() {
    let mut state = ArraysCache::with_left_padding(3, vec![1, 0]);
    state.set(0, mat(2, 3, &[1., 2., 3., 4., 5., 6.]));
    state.set(2, mat(2, 1, &[7., 8.]));
    let mut inner = ArraysCache::new(1);
    inner.set(0, mat(1, 2, &[9., 10.]));
    let mut ring = RotatingKvCache::new(4);
    let k = Array::from_slice(&[0f32; 12], &[1, 1, 6, 2]);
    ring.update_and_fetch(k.clone(), k).unwrap();
    let list = CacheList::new(vec![Box::new(kv_with(3)), Box::new(inner), Box::new(ring)]);
    let (_, back) = through_store(&[&state, &list]);
    let mut back = back.into_iter();
    let state_back = restore(back.next().unwrap(), QuantSdpa::MlxLm).unwrap();
    same_arrays(&state, state_back.as_ref());
    let list_back = restore(back.next().unwrap(), QuantSdpa::MlxLm).unwrap();
    same_arrays(&list, list_back.as_ref());
    let parts = list_back.sub_caches().unwrap();
    assert_eq!(
        parts.iter().map(|p| p.kind().unwrap()).collect::<Vec<_>>(),
        ["kv", "arrays", "rotating"]
    );
    assert_eq!((parts[0].offset(), parts[2].offset()), (3, 6));
}

/// The kv-store v3 entries of a standard and a rotating cache, as the format wrote them
/// before snapshots became generic (kind, offset, the ring's idx/maxSize/keep, tensors).
#[test]
fn kv_and_ring_entries_are_written_as_before() {
    let mut ring = RotatingKvCache::new(4);
    let k = Array::from_slice(&[0f32; 10], &[1, 1, 5, 2]);
    ring.update_and_fetch(k.clone(), k).unwrap();
    let (json, _) = through_store(&[&kv_with(3), &ring]);
    assert!(
        json.contains(r#"{"kind":"kv","offset":3,"tensors":[{"off":0,"#),
        "{json}"
    );
    assert!(
        json.contains(r#"{"kind":"rotating","offset":5,"idx":5,"maxSize":4,"keep":0,"tensors":[{"#),
        "{json}"
    );
}

#[test]
fn an_unknown_kind_is_refused_at_read() {
    let mut s = ArraysCache::new(1).snapshot().unwrap();
    s.kind = "mamba".into();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("e.mlxkv");
    kvstore::write(&path, &id(), &[1], &[s], "2026-12-04T00:00:00Z").unwrap();
    let e = kvstore::read(&path, false).err().unwrap().to_string();
    assert!(e.contains("unknown cache kind `mamba`"), "{e}");
}
