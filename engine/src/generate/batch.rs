//! Batched decoding (the batch lane's core): rows are prefilled one at a time as single
//! sequences (mlx-lm's batched prefill gives each row the same numbers on this backend, so
//! only scheduling differs), then decode together — one forward of [B, 1] ids per step over
//! one batch cache per layer: `BatchKvCache` for full attention (dense or quantized KV),
//! `BatchRotatingKvCache` for sliding windows. Rows join and leave between steps.
//!
//! `join` merges the rows' caches as they stand into the running batch. `admit` is
//! mlx-lm's `BatchGenerator` path for new prompts: rows whose caches hold all their prompt
//! tokens but the last are merged into a batch of their own, which feeds their last tokens
//! in one step (their first logits), and is then appended to the running batch. For
//! full-attention layers both give the same numbers; a sliding-window ring that wraps in
//! that first step is laid out as BatchGenerator lays it out only by `admit`.

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;

use super::Session;
use crate::cache::batch::BatchKvCache;
use crate::cache::batch_rotating::BatchRotatingKvCache;
use crate::cache::{Cache, KvCache, RotatingKvCache};
use crate::model::LanguageModel;

pub struct Batch<'m> {
    model: &'m dyn LanguageModel,
    /// One batch cache per layer; empty while no row is in the batch.
    caches: Vec<Box<dyn Cache>>,
}

/// A layer's batch cache, whichever kind it is.
enum Layer<'a> {
    Full(&'a mut BatchKvCache),
    Ring(&'a mut BatchRotatingKvCache),
}

fn layer(c: &mut Box<dyn Cache>) -> Layer<'_> {
    let any = c.as_any_mut();
    if any.is::<BatchKvCache>() {
        Layer::Full(any.downcast_mut::<BatchKvCache>().unwrap())
    } else {
        Layer::Ring(
            any.downcast_mut::<BatchRotatingKvCache>()
                .expect("a batch holds batch caches only"),
        )
    }
}

const REFUSAL: &str =
    "the batch lane takes standard (dense, full-attention) and sliding-window caches only";

/// Merges layer `l` of every session into one batch cache.
fn merge_layer(sessions: &mut [Session], l: usize) -> Result<Box<dyn Cache>, Exception> {
    let mut full: Vec<&KvCache> = Vec::new();
    let mut rings: Vec<&RotatingKvCache> = Vec::new();
    for s in sessions.iter_mut() {
        let any = s.caches[l].as_any_mut();
        if any.is::<KvCache>() {
            full.push(any.downcast_ref::<KvCache>().unwrap());
        } else if let Some(r) = any.downcast_ref::<RotatingKvCache>() {
            rings.push(r);
        } else {
            return Err(Exception::custom(REFUSAL));
        }
    }
    match (full.is_empty(), rings.is_empty()) {
        (false, true) => Ok(Box::new(BatchKvCache::merge(&full)?)),
        (true, false) => Ok(Box::new(BatchRotatingKvCache::merge(&rings)?)),
        _ => Err(Exception::custom(REFUSAL)),
    }
}

fn merge_sessions(sessions: &mut [Session]) -> Result<Vec<Box<dyn Cache>>, Exception> {
    let layers = sessions.first().map_or(0, |s| s.caches.len());
    (0..layers).map(|l| merge_layer(sessions, l)).collect()
}

impl<'m> Batch<'m> {
    pub fn new(model: &'m dyn LanguageModel) -> Self {
        Batch {
            model,
            caches: Vec::new(),
        }
    }

    pub fn rows(&mut self) -> usize {
        self.caches.first_mut().map_or(0, |c| match layer(c) {
            Layer::Full(c) => c.rows(),
            Layer::Ring(c) => c.rows(),
        })
    }

    /// Appends the rows of `other` after this batch's rows (mlx-lm's `extend`).
    fn extend(&mut self, mut other: Batch) -> Result<(), Exception> {
        if self.caches.is_empty() {
            self.caches = other.caches;
            return Ok(());
        }
        for (mine, theirs) in self.caches.iter_mut().zip(other.caches.iter_mut()) {
            match (layer(mine), layer(theirs)) {
                (Layer::Full(a), Layer::Full(b)) => a.extend(b)?,
                (Layer::Ring(a), Layer::Ring(b)) => a.extend(b)?,
                _ => return Err(Exception::custom("batch layers of different kinds")),
            }
        }
        Ok(())
    }

    /// Adds sessions as new rows (after the existing ones), their caches as they stand.
    pub fn join(&mut self, mut sessions: Vec<Session>) -> Result<(), Exception> {
        if sessions.is_empty() {
            return Ok(());
        }
        let caches = merge_sessions(&mut sessions)?;
        self.extend(Batch {
            model: self.model,
            caches,
        })
    }

    /// BatchGenerator's admission of new prompts: `sessions` hold every prompt token but
    /// the last (`last`, one per session); they are merged into a batch of their own, which
    /// feeds `last` in one step, and then appended after the existing rows. Returns that
    /// step's logits [new rows, vocab] (each row's first).
    pub fn admit(&mut self, mut sessions: Vec<Session>, last: &[u32]) -> Result<Array, Exception> {
        if sessions.len() != last.len() || sessions.is_empty() {
            return Err(Exception::custom("one last prompt token per admitted row"));
        }
        let mut group = Batch {
            model: self.model,
            caches: merge_sessions(&mut sessions)?,
        };
        let logits = group.step(last)?;
        self.extend(group)?;
        Ok(logits)
    }

    /// Row `row`'s caches holding its first `len` tokens, one single-sequence cache per layer.
    pub fn row_caches(&mut self, row: usize, len: i32) -> Result<Vec<Box<dyn Cache>>, Exception> {
        let caches: Vec<Box<dyn Cache>> = self
            .caches
            .iter_mut()
            .map(|c| {
                Ok(match layer(c) {
                    Layer::Full(c) => Box::new(c.row_cache(row, len)?) as Box<dyn Cache>,
                    Layer::Ring(c) => Box::new(c.row_cache(row, len)?) as Box<dyn Cache>,
                })
            })
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
            match layer(c) {
                Layer::Full(c) => c.filter(keep)?,
                Layer::Ring(c) => c.filter(keep)?,
            }
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
