//! No cache at all: what mlx-lm's training forward runs with (`model(inputs)`, cache None).
//! Keys and values pass straight through; the mask is the one a fresh cache would make
//! (SDPA's causal mode for several tokens; a windowed causal array for sliding layers whose
//! window is shorter than the sequence).

use mlx_rs::error::Exception;
use mlx_rs::Array;

use super::{causal_mask, AttentionCache, Cache, Kv, Mask};

#[derive(Default)]
pub struct PassThrough;

impl Cache for PassThrough {
    fn offset(&self) -> i32 {
        0
    }

    fn is_pass_through(&self) -> bool {
        true
    }

    fn is_trimmable(&self) -> bool {
        false
    }

    fn trim(&mut self, _n: i32) -> i32 {
        0
    }

    fn state(&self) -> Vec<&Array> {
        Vec::new()
    }

    fn make_mask(&self, n: i32, window: Option<i32>) -> Result<Mask, Exception> {
        // mlx-lm's create_attention_mask with no cache: an array only where the window
        // cuts into the sequence, SDPA's causal mode otherwise.
        Ok(match window {
            Some(w) if n > w => Mask::Array(causal_mask(n, 0, Some(w))?),
            _ if n == 1 => Mask::None,
            _ => Mask::Causal,
        })
    }

    attention_views!();
}

impl AttentionCache for PassThrough {
    fn update_and_fetch(&mut self, keys: Array, values: Array) -> Result<Kv, Exception> {
        Ok(Kv::Dense(keys, values))
    }
}

/// One pass-through per cache of `caches` (a model's `make_caches()`): a cache-less forward.
pub fn none_for(caches: &[Box<dyn Cache>]) -> Vec<Box<dyn Cache>> {
    caches
        .iter()
        .map(|_| Box::new(PassThrough) as Box<dyn Cache>)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::{KvCache, RotatingKvCache};

    fn same(a: &Mask, b: &Mask) -> bool {
        match (a, b) {
            (Mask::None, Mask::None) | (Mask::Causal, Mask::Causal) => true,
            (Mask::Array(x), Mask::Array(y)) => {
                let (x, y) = (
                    x.as_dtype(mlx_rs::Dtype::Int32),
                    y.as_dtype(mlx_rs::Dtype::Int32),
                );
                let (x, y) = (x.unwrap(), y.unwrap());
                x.shape() == y.shape() && x.as_slice::<i32>() == y.as_slice::<i32>()
            }
            _ => false,
        }
    }

    /// The cache-less masks are the ones a fresh cache makes (mlx-lm: `create_attention_mask`
    /// with cache None follows the same rules as a fresh rotating cache for sliding layers
    /// and a fresh KVCache for full ones), on either side of the window.
    #[test]
    fn masks_are_what_a_fresh_cache_makes() {
        let window = 8;
        for n in 1..=12 {
            let sliding = RotatingKvCache::new(window)
                .make_mask(n, Some(window))
                .unwrap();
            let full = KvCache::new().make_mask(n, None).unwrap();
            assert!(
                same(&PassThrough.make_mask(n, Some(window)).unwrap(), &sliding),
                "n={n} sliding"
            );
            assert!(
                same(&PassThrough.make_mask(n, None).unwrap(), &full),
                "n={n} full"
            );
        }
    }
}
