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

/// mlx-lm's prompt batch on the standard kind: fresh rows merged, prompts of 2 and 5
/// positions written right-padded (`prepare` with their lengths), and `finalize` rolls each
/// row's padding to its front, so every row comes back as its own cache would hold it.
#[test]
fn a_right_padded_prefill_rolls_each_rows_padding_to_its_front() {
    let fresh = KvCache::new();
    let mut batch = fresh.merge(&[&fresh, &fresh]).unwrap();
    batch.prepare(&[2, 5]).unwrap();
    let (a, b) = (kv_with(2), kv_with(5));
    // Row 0's two positions, then three of padding (its prompt padded with id 0).
    let pad: Vec<f32> = vec![-1.; 6];
    let row0 = [floats(&a.snapshot().unwrap().tensors[0]), pad].concat();
    let row1 = floats(&b.snapshot().unwrap().tensors[0]);
    let k = Array::from_slice(&[row0, row1].concat(), &[2, 1, 5, 2]);
    batch
        .as_kv()
        .unwrap()
        .update_and_fetch(k.clone(), k)
        .unwrap();
    batch.finalize().unwrap();
    rows_come_back(batch.as_ref(), &[&a, &b]);
    // Row 0 now has three positions of left padding: the mask hides them.
    assert_eq!(
        bools(&batch.make_mask(1, None).unwrap()).unwrap().1,
        [false, false, false, true, true, true, true, true, true, true, true, true]
    );
}
