//! `CacheList` as mlx-lm's: trimmable when all parts are, trim returns the last part's
//! count, batch ops part by part.

use super::*;
use crate::cache::arrays::ArraysCache;
use crate::cache::list::CacheList;

fn hybrid(n: i32, state: f32) -> CacheList {
    let mut s = ArraysCache::new(1);
    s.set(0, mat(1, 2, &[state, state]));
    CacheList::new(vec![Box::new(kv_with(n)), Box::new(s)])
}

fn kinds(c: &dyn Cache) -> Vec<&'static str> {
    c.sub_caches()
        .unwrap()
        .iter()
        .map(|p| p.kind().unwrap())
        .collect()
}

#[test]
fn trimmable_only_when_every_part_is_and_trim_returns_the_last_count() {
    assert!(!hybrid(3, 1.).is_trimmable());
    let mut two = CacheList::new(vec![Box::new(kv_with(5)), Box::new(kv_with(3))]);
    assert!(two.is_trimmable());
    assert_eq!(two.offset(), 5);
    // The first part gives 4, the second only its 3: mlx-lm returns the last `m`.
    assert_eq!(two.trim(4), 3);
    assert_eq!((two.get(0).offset(), two.get(1).offset()), (1, 0));
}

#[test]
fn batch_ops_apply_part_by_part() {
    let (a, b) = (hybrid(3, 1.), hybrid(5, 2.));
    let mut m = a.merge(&[&a, &b]).unwrap();
    assert_eq!(kinds(m.as_ref()), ["batch-kv", "arrays"]);
    assert_eq!(m.rows(), Some(2));
    // The shorter row is left-padded to the longer.
    assert_eq!(m.offset(), 5);
    let row = m.extract(0, 3).unwrap();
    assert_eq!(kinds(row.as_ref()), ["kv", "arrays"]);
    assert_eq!(row.offset(), 3);
    let parts = row.sub_caches().unwrap();
    let state = ArraysCache::from_state(parts[1].snapshot().unwrap()).unwrap();
    assert_eq!(floats(state.get(0).unwrap()), [1., 1.]);
    let more = a.merge(&[&a]).unwrap();
    m.extend(more.as_ref()).unwrap();
    assert_eq!(m.rows(), Some(3));
    m.filter(&[1]).unwrap();
    assert_eq!(m.rows(), Some(1));
    // `prepare`/`finalize` reach every part (mlx-lm's BatchKVCache and ArraysCache both
    // take a batched prefill); one length per row.
    m.prepare(&[1]).unwrap();
    m.finalize().unwrap();
    assert!(m.prepare(&[1, 2]).is_err());
    // A list of another shape is refused.
    let one = CacheList::new(vec![Box::new(kv_with(2))]);
    assert!(a.merge(&[&a, &one]).is_err());
}
