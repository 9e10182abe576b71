//! The batch kinds through the protocol: `extend` reads the other batch through its
//! snapshot (`from_state`), so a group merged from rows of different lengths, appended to
//! a running batch, must give every row back as it went in.

use super::*;
use crate::cache::RotatingKvCache;

/// Each row extracted from the batch has the tensors and offset of the cache it came from.
fn rows_come_back(batch: &dyn Cache, rows: &[&dyn Cache]) {
    for (i, row) in rows.iter().enumerate() {
        let back = batch.extract(i, row.offset()).unwrap();
        let (a, b) = (row.snapshot().unwrap(), back.snapshot().unwrap());
        assert_eq!(
            (a.offset, a.tensors.len()),
            (b.offset, b.tensors.len()),
            "row {i}"
        );
        for (x, y) in a.tensors.iter().zip(&b.tensors) {
            assert_eq!((x.shape(), floats(x)), (y.shape(), floats(y)), "row {i}");
        }
    }
}

fn ring_with(n: i32, window: i32) -> RotatingKvCache {
    let k = Array::from_slice(
        &(0..2 * n).map(|i| 100. + i as f32).collect::<Vec<_>>(),
        &[1, 1, n, 2],
    );
    let mut c = RotatingKvCache::new(window);
    c.update_and_fetch(k.clone(), k).unwrap();
    c
}

#[test]
fn standard_rows_survive_merge_and_extend() {
    let (a, b, c) = (kv_with(2), kv_with(3), kv_with(5));
    let mut running = a.merge(&[&a]).unwrap();
    let group = b.merge(&[&b, &c]).unwrap();
    running.extend(group.as_ref()).unwrap();
    assert_eq!(running.rows(), Some(3));
    rows_come_back(running.as_ref(), &[&a, &b, &c]);
    running.filter(&[2, 0]).unwrap();
    rows_come_back(running.as_ref(), &[&c, &a]);
}

#[test]
fn ring_rows_survive_merge_and_extend() {
    let (a, b, c) = (ring_with(2, 8), ring_with(3, 8), ring_with(5, 8));
    let mut running = a.merge(&[&a]).unwrap();
    let group = b.merge(&[&b, &c]).unwrap();
    running.extend(group.as_ref()).unwrap();
    assert_eq!(running.rows(), Some(3));
    rows_come_back(running.as_ref(), &[&a, &b, &c]);
}

#[test]
fn kinds_do_not_mix() {
    let (a, r) = (kv_with(2), ring_with(2, 8));
    assert!(a.merge(&[&a, &r]).is_err());
    let mut running = a.merge(&[&a]).unwrap();
    assert!(running.extend(r.merge(&[&r]).unwrap().as_ref()).is_err());
    // Single-sequence caches are not batches.
    assert!(kv_with(1).filter(&[0]).is_err());
}
