//! The cache protocol's unit tests: `ArraysCache` and `CacheList` against mlx-lm 0.32.2's
//! `cache.py` semantics (expected values reasoned from its code), their snapshots through
//! the kv-store and `restore`, and the kv-store entries of the K/V kinds byte for
//! byte as the format wrote them before the protocol.

mod arrays;
mod batch;
mod list;
mod store;

use mlx_rs::Array;

use super::{AttentionCache, Cache, KvCache, Mask};

/// A [rows, cols] f32 array.
fn mat(rows: i32, cols: i32, v: &[f32]) -> Array {
    Array::from_slice(v, &[rows, cols])
}

fn floats(a: &Array) -> Vec<f32> {
    let a = a.as_dtype(mlx_rs::Dtype::Float32).unwrap();
    a.eval().unwrap();
    a.as_slice::<f32>().to_vec()
}

fn bools(m: &Mask) -> Option<(Vec<i32>, Vec<bool>)> {
    match m {
        Mask::Array(a) => {
            let x = a.as_dtype(mlx_rs::Dtype::Int32).unwrap();
            x.eval().unwrap();
            Some((
                a.shape().to_vec(),
                x.as_slice::<i32>().iter().map(|&v| v != 0).collect(),
            ))
        }
        _ => None,
    }
}

/// A standard cache holding `n` positions of one head of dim 2 (values 0, 1, 2, …).
fn kv_with(n: i32) -> KvCache {
    let k = Array::from_slice(
        &(0..2 * n).map(|i| i as f32).collect::<Vec<_>>(),
        &[1, 1, n, 2],
    );
    let mut c = KvCache::new();
    c.update_and_fetch(k.clone(), k).unwrap();
    c
}
