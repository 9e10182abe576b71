//! Batched decoding (the batch lane's core): rows are prefilled one at a time as single
//! sequences (mlx-lm's batched prefill gives each row the same numbers on this backend, so
//! only scheduling differs), then decode together — one forward of [B, 1] ids per step over
//! a `BatchKvCache` per layer. Rows join and leave between steps.

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;

use super::Session;
use crate::cache::batch::BatchKvCache;
use crate::cache::{Cache, KvCache};
use crate::model::LanguageModel;

pub struct Batch<'m> {
    model: &'m dyn LanguageModel,
    /// One `BatchKvCache` per layer; empty while no row is in the batch.
    caches: Vec<Box<dyn Cache>>,
}

fn as_batch(c: &mut Box<dyn Cache>) -> &mut BatchKvCache {
    c.as_any_mut()
        .downcast_mut::<BatchKvCache>()
        .expect("a batch holds BatchKvCaches only")
}

fn merge_sessions(sessions: &mut [Session]) -> Result<Vec<BatchKvCache>, Exception> {
    let layers = sessions.first().map_or(0, |s| s.caches.len());
    (0..layers)
        .map(|l| {
            let mut row_caches: Vec<&mut KvCache> = sessions
                .iter_mut()
                .map(|s| {
                    s.caches[l]
                        .as_any_mut()
                        .downcast_mut::<KvCache>()
                        .ok_or_else(|| {
                            Exception::custom(
                                "the batch lane takes standard (dense, full-attention) caches only",
                            )
                        })
                })
                .collect::<Result<_, _>>()?;
            BatchKvCache::merge(&mut row_caches)
        })
        .collect()
}

impl<'m> Batch<'m> {
    pub fn new(model: &'m dyn LanguageModel) -> Self {
        Batch {
            model,
            caches: Vec::new(),
        }
    }

    pub fn rows(&mut self) -> usize {
        self.caches.first_mut().map_or(0, |c| as_batch(c).rows())
    }

    /// Adds prefilled sessions as new rows (after the existing ones).
    pub fn join(&mut self, mut sessions: Vec<Session>) -> Result<(), Exception> {
        if sessions.is_empty() {
            return Ok(());
        }
        let merged = merge_sessions(&mut sessions)?;
        if self.caches.is_empty() {
            self.caches = merged
                .into_iter()
                .map(|c| Box::new(c) as Box<dyn Cache>)
                .collect();
        } else {
            for (mine, theirs) in self.caches.iter_mut().zip(merged) {
                as_batch(mine).extend(theirs)?;
            }
        }
        Ok(())
    }

    /// Row `row`'s caches holding its first `len` tokens, one standard cache per layer.
    pub fn row_caches(&mut self, row: usize, len: i32) -> Result<Vec<Box<dyn Cache>>, Exception> {
        let caches: Vec<Box<dyn Cache>> = self
            .caches
            .iter_mut()
            .map(|c| Ok(Box::new(as_batch(c).row_cache(row, len)?) as Box<dyn Cache>))
            .collect::<Result<_, Exception>>()?;
        let state: Vec<&Array> = caches.iter().flat_map(|c| c.state()).collect();
        mlx_rs::transforms::eval(state)?;
        Ok(caches)
    }

    /// Keeps rows `keep` (in that order).
    pub fn keep(&mut self, keep: &[usize]) -> Result<(), Exception> {
        if keep.is_empty() {
            self.caches.clear();
            return Ok(());
        }
        for c in self.caches.iter_mut() {
            as_batch(c).filter(keep)?;
        }
        Ok(())
    }

    /// Feeds one token per row; returns the logits [B, vocab].
    pub fn step(&mut self, ids: &[u32]) -> Result<Array, Exception> {
        let ids: Vec<i32> = ids.iter().map(|&i| i as i32).collect();
        self.step_ids(&Array::from_slice(&ids, &[ids.len() as i32]))
    }

    /// As `step`, with the ids still an MLX array [B] (e.g. lazy samples).
    pub fn step_ids(&mut self, ids: &Array) -> Result<Array, Exception> {
        if ids.size() != self.rows() {
            return Err(Exception::custom("one token per batch row"));
        }
        let logits = self
            .model
            .forward(&ids.reshape(&[-1, 1])?, &mut self.caches)?;
        Ok(logits.index((.., -1, ..)))
    }
}
