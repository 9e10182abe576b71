//! `ArraysCache` as mlx-lm's: merge, filter, extend, extract, the mask, prepare/finalize,
//! advance, no trimming, checkpoints.

use super::*;
use crate::cache::arrays::ArraysCache;

fn held(c: &dyn Cache) -> ArraysCache {
    ArraysCache::from_state(c.snapshot().unwrap()).unwrap()
}

/// Three rows: [A0, None], empty, [A2, B2].
fn three_rows() -> (ArraysCache, ArraysCache, ArraysCache) {
    let mut r0 = ArraysCache::new(2);
    r0.set(0, mat(1, 2, &[1., 2.]));
    let r1 = ArraysCache::new(2);
    let mut r2 = ArraysCache::new(2);
    r2.set(0, mat(1, 2, &[5., 6.]));
    r2.set(1, mat(1, 3, &[7., 8., 9.]));
    (r0, r1, r2)
}

#[test]
fn merge_stacks_rows_with_zeros_where_a_row_has_none() {
    let (r0, r1, r2) = three_rows();
    let rows: Vec<&dyn Cache> = vec![&r0, &r1, &r2];
    let m = held(r0.merge(&rows).unwrap().as_ref());
    assert_eq!(floats(m.get(0).unwrap()), [1., 2., 0., 0., 5., 6.]);
    assert_eq!(m.get(1).unwrap().shape(), [3, 3]);
    assert_eq!(
        floats(m.get(1).unwrap()),
        [0., 0., 0., 0., 0., 0., 7., 8., 9.]
    );
    assert_eq!(m.left_padding(), None);
    assert_eq!(m.batch_size(), 3);
}

#[test]
fn merge_of_empty_rows_is_a_zero_padding_per_row() {
    let (a, b) = (ArraysCache::new(2), ArraysCache::new(2));
    let m = held(a.merge(&[&a, &b]).unwrap().as_ref());
    assert!(m.is_empty());
    assert_eq!(m.left_padding(), Some(&[0, 0][..]));
    assert_eq!(m.batch_size(), 2);
}

#[test]
fn filter_takes_rows_in_order_with_their_padding() {
    let (r0, r1, r2) = three_rows();
    let mut m = r0.merge(&[&r0, &r1, &r2]).unwrap();
    m.extend(&ArraysCache::with_left_padding(2, vec![4]))
        .unwrap();
    m.filter(&[2, 0]).unwrap();
    let m = held(m.as_ref());
    assert_eq!(floats(m.get(0).unwrap()), [5., 6., 1., 2.]);
    assert_eq!(m.left_padding(), Some(&[0, 0][..]));
}

#[test]
fn extend_concatenates_and_zero_fills_a_missing_side() {
    let (r0, r1, r2) = three_rows();
    let mut m = r0.merge(&[&r0, &r1, &r2]).unwrap();
    let mut other = ArraysCache::with_left_padding(2, vec![1]);
    other.set(0, mat(1, 2, &[3., 4.]));
    m.extend(&other).unwrap();
    let m = held(m.as_ref());
    assert_eq!(floats(m.get(0).unwrap()), [1., 2., 0., 0., 5., 6., 3., 4.]);
    // The other side has no slot 1: zeros of its batch (1 row).
    assert_eq!(m.get(1).unwrap().shape(), [4, 3]);
    assert_eq!(floats(m.get(1).unwrap())[9..], [0., 0., 0.]);
    // Only the other side had a padding: this side's rows get zeros.
    assert_eq!(m.left_padding(), Some(&[0, 0, 0, 1][..]));
    assert_eq!(m.lengths(), None);
}

#[test]
fn extract_is_one_row_without_padding() {
    let (r0, r1, r2) = three_rows();
    let mut m = r0.merge(&[&r0, &r1, &r2]).unwrap();
    m.prepare(&[1, 2, 3]).unwrap();
    let row = held(m.extract(2, 0).unwrap().as_ref());
    assert_eq!(floats(row.get(0).unwrap()), [5., 6.]);
    assert_eq!(floats(row.get(1).unwrap()), [7., 8., 9.]);
    assert_eq!((row.left_padding(), row.lengths()), (None, None));
}

#[test]
fn mask_is_padding_and_lengths_per_row() {
    let mut c = ArraysCache::with_left_padding(1, vec![1, 0]);
    // pos >= left_padding[:, None]
    assert_eq!(
        bools(&c.make_mask(4, None).unwrap()),
        Some((
            vec![2, 4],
            vec![false, true, true, true, true, true, true, true]
        ))
    );
    c.prepare(&[3, 2]).unwrap();
    // … & pos < lengths[:, None]
    assert_eq!(
        bools(&c.make_mask(4, None).unwrap()),
        Some((
            vec![2, 4],
            vec![false, true, true, false, true, true, false, false]
        ))
    );
    // advance(N) moves both back by N.
    c.advance(1);
    assert_eq!(c.left_padding(), Some(&[0, -1][..]));
    assert_eq!(c.lengths(), Some(&[2, 1][..]));
    c.finalize().unwrap();
    assert!(matches!(c.make_mask(4, None).unwrap(), Mask::None));
}

#[test]
fn a_state_is_not_trimmed_but_checkpointed() {
    let mut c = ArraysCache::new(1);
    c.set(0, mat(1, 2, &[1., 2.]));
    assert!(!c.is_trimmable());
    assert_eq!(c.trim(3), 0);
    assert!(c.rollback(1).is_err());
    assert!(c.can_checkpoint());
    let point = c.checkpoint().unwrap();
    c.set(0, mat(1, 2, &[9., 9.]));
    c.restore_checkpoint(point).unwrap();
    assert_eq!(floats(c.get(0).unwrap()), [1., 2.]);
    assert_eq!(c.offset(), 0);
}

#[test]
fn each_row_keeps_its_own_token_count_through_the_batch_ops() {
    let (mut r0, _, mut r2) = three_rows();
    r0.advance(3);
    r2.advance(5);
    let mut m = r0.merge(&[&r0, &r2]).unwrap();
    assert_eq!(m.offset(), 5);
    // One decode step: every row takes a token.
    m.as_arrays().unwrap().advance(1);
    let mut joining = ArraysCache::new(2);
    joining.set(0, mat(1, 2, &[3., 4.]));
    joining.advance(2);
    m.extend(&joining).unwrap();
    m.filter(&[2, 0]).unwrap();
    // Through a snapshot (the kv-store's and the batch ops' own path) as well.
    let m = held(m.as_ref());
    assert_eq!(m.offset(), 4);
    assert_eq!(m.extract(0, 10).unwrap().offset(), 2);
    assert_eq!(m.extract(1, 4).unwrap().offset(), 4);
    // A state cannot be cut back to fewer tokens than it has consumed.
    let e = m.extract(1, 3).err().unwrap();
    assert!(e.what().contains("cannot be cut back"), "{}", e.what());
}

#[test]
fn a_batched_prefill_counts_each_row_its_real_tokens() {
    // Row 0: one pad on the left, then 2 tokens; row 1: 3 tokens then one pad on the right.
    let mut c = ArraysCache::with_left_padding(1, vec![1, 0]);
    c.prepare(&[3, 3]).unwrap();
    c.set(0, mat(2, 1, &[0., 0.]));
    c.advance(4);
    c.finalize().unwrap();
    assert_eq!(c.extract(0, 2).unwrap().offset(), 2);
    assert_eq!(c.extract(1, 3).unwrap().offset(), 3);
}
