//! No cache at all: what mlx-lm's training forward runs with (`model(inputs)`, cache None).
//! Keys and values pass straight through; the mask is the one a fresh cache would make
//! (SDPA's causal mode for several tokens, a windowed causal array for sliding layers).

use mlx_rs::error::Exception;
use mlx_rs::Array;

use super::{causal_mask, Cache, Kv, Mask};

#[derive(Default)]
pub struct PassThrough;

impl Cache for PassThrough {
    fn offset(&self) -> i32 {
        0
    }

    fn update_and_fetch(&mut self, keys: Array, values: Array) -> Result<Kv, Exception> {
        Ok(Kv::Dense(keys, values))
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
        Ok(match window {
            Some(w) => Mask::Array(causal_mask(n, 0, Some(w))?),
            None if n == 1 => Mask::None,
            None => Mask::Causal,
        })
    }

    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

/// One pass-through per cache `model` would make: a cache-less forward.
pub fn none_for(model: &dyn crate::model::LanguageModel) -> Vec<Box<dyn Cache>> {
    model
        .make_caches()
        .iter()
        .map(|_| Box::new(PassThrough) as Box<dyn Cache>)
        .collect()
}
