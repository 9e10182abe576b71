//! A draft model over a batch (issue 43, item 4, its draft-model part): the drafter's own
//! batch of rows, one per row of the target's batch that drafts, kept one id behind what
//! the target holds so that every round starts alike for every row.
//!
//! Row r's text is its prompt and the ids it emitted, L ids long; the target holds its
//! first L − 1 (the last is fed next), the drafter its first L − 2. A round feeds the
//! drafter `[text[L-2], text[L-1]]` for every row in one [B, 2] forward, so a row whose last
//! round accepted every draft (mlx-lm's drafter is fed two ids then) and one that accepted
//! none start the same way; each next draft is the argmax of the drafter's last logits, fed
//! back for γ − 1 more one-id steps. After the target's verify, a row that emitted e ids
//! (its accepted drafts and the target's own id) gives back γ + 1 − e positions, which
//! leaves the drafter L' − 2 of its new L' = L + e ids again: every id it keeps is a draft
//! the target accepted.
//!
//! The drafts only decide how many ids a round emits, never which ones: the target's picks
//! over the verify are what each row emits (`batch_lookup`, the lane's round), so drafting
//! by argmax serves greedy and sampled rows alike. Rows join (prefilled from the cache
//! entry's drafter caches, or from nothing) and leave at each round's `sync`, keyed by the
//! lane's row keys; a row whose text moved without the drafter (a plain step between
//! rounds) is caught up there. Standard K/V drafters only (`batch::trims_rows`).

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::{argmax_axis, IndexOp};

use super::batch::Batch;
use super::{Session, SessionOptions};
use crate::cache::Cache;
use crate::model::LanguageModel;
use crate::plant::{self, Defect};

/// A row to draft for: the lane's key for it and its text (prompt and emitted ids; at
/// least two ids).
pub struct DraftRow<'t> {
    pub key: u64,
    pub text: &'t [u32],
}

pub struct DraftBatch<'m> {
    model: &'m dyn LanguageModel,
    opts: SessionOptions,
    prefill_step: usize,
    batch: Batch<'m>,
    /// Each batch row's key and the ids of its text it holds, in batch order.
    keys: Vec<u64>,
    held: Vec<usize>,
    /// The γ of the last `draft` (what `settle` gives back against).
    gamma: usize,
}

impl<'m> DraftBatch<'m> {
    pub fn new(model: &'m dyn LanguageModel, opts: &SessionOptions, prefill_step: usize) -> Self {
        DraftBatch {
            model,
            opts: opts.clone(),
            prefill_step,
            batch: Batch::new(model),
            keys: Vec::new(),
            held: Vec::new(),
            gamma: 0,
        }
    }

    /// Drops every row (after a failure: the next `sync` prefills them again).
    pub fn clear(&mut self) {
        self.batch = Batch::new(self.model);
        self.keys.clear();
        self.held.clear();
    }

    /// Brings the batch to `rows`, in that order: rows no longer drafting leave, rows that
    /// are new (or whose drafter caches are not where their text says) are prefilled from
    /// `seed(key)` (a cache entry's drafter caches) or from nothing up to `text[..L-2]`.
    pub fn sync(
        &mut self,
        rows: &[DraftRow],
        mut seed: impl FnMut(u64) -> Option<Vec<Box<dyn Cache>>>,
    ) -> Result<(), Exception> {
        if rows.iter().any(|r| r.text.len() < 2) {
            return Err(Exception::custom(
                "a drafted row's text holds two ids at least",
            ));
        }
        let wanted = |key: u64| rows.iter().find(|r| r.key == key);
        let kept: Vec<usize> = (0..self.keys.len())
            .filter(|&i| wanted(self.keys[i]).is_some_and(|r| r.text.len() - 2 == self.held[i]))
            .collect();
        self.keep(&kept)?;
        let mut joining = Vec::new();
        let new: Vec<&DraftRow> = rows
            .iter()
            .filter(|r| !self.keys.contains(&r.key))
            .collect();
        for row in new {
            let caches = seed(row.key).unwrap_or_else(|| self.model.make_caches());
            joining.push(self.caught_up(caches, &row.text[..row.text.len() - 2])?);
            self.keys.push(row.key);
            self.held.push(row.text.len() - 2);
        }
        self.batch.join(joining)?;
        let order: Vec<usize> = rows
            .iter()
            .map(|r| self.keys.iter().position(|&k| k == r.key).expect("synced"))
            .collect();
        self.keep(&order)
    }

    /// A session whose `caches` (holding a prefix of `ids`, or more) hold exactly `ids`.
    fn caught_up(
        &self,
        mut caches: Vec<Box<dyn Cache>>,
        ids: &[u32],
    ) -> Result<Session<'m>, Exception> {
        let held = crate::cache::common_len(&caches, ids.len());
        if caches.iter().any(|c| c.offset() as usize != held) {
            // Layers that disagree, or hold past `ids`: start over.
            caches = self.model.make_caches();
        }
        let mut session = Session::with_caches(self.model, &self.opts, caches);
        let held = crate::cache::common_len(&session.caches, ids.len());
        for chunk in ids[held..].chunks(self.prefill_step.max(1)) {
            session.prefill_chunk(chunk)?;
        }
        Ok(session)
    }

    /// Keeps batch rows `keep`, in that order.
    fn keep(&mut self, keep: &[usize]) -> Result<(), Exception> {
        self.batch.keep(keep)?;
        self.keys = keep.iter().map(|&i| self.keys[i]).collect();
        self.held = keep.iter().map(|&i| self.held[i]).collect();
        Ok(())
    }

    /// `gamma` drafts for every row (after `sync` with these rows' texts), [rows][gamma].
    pub fn draft(&mut self, rows: &[DraftRow], gamma: usize) -> Result<Vec<Vec<u32>>, Exception> {
        if rows.len() != self.keys.len() || gamma == 0 {
            return Err(Exception::custom("draft after a sync of these rows, γ ≥ 1"));
        }
        let runs: Vec<Vec<u32>> = rows
            .iter()
            .map(|r| r.text[r.text.len() - 2..].to_vec())
            .collect();
        let logits = self.batch.feed_runs(&runs)?;
        let mut d = argmax_axis(logits.index((.., -1, ..)), -1, None)?;
        let mut drafts = Vec::with_capacity(gamma);
        for i in 0..gamma {
            mlx_rs::transforms::async_eval([&d])?;
            drafts.push(d.clone());
            if i + 1 < gamma {
                d = argmax_axis(self.batch.step_ids(&d)?, -1, None)?;
            }
        }
        self.held.iter_mut().for_each(|h| *h += gamma + 1);
        self.gamma = gamma;
        let all = mlx_rs::ops::stack(&drafts, 1)?.as_dtype(mlx_rs::Dtype::Uint32)?;
        all.eval()?;
        let ids = all.as_slice::<u32>();
        Ok(ids.chunks(gamma).map(<[u32]>::to_vec).collect())
    }

    /// After the verify: row r (in the last `draft`'s order) emitted `emitted[r]` ids; it
    /// keeps what its new text says the drafter holds.
    pub fn settle(&mut self, emitted: &[usize]) -> Result<(), Exception> {
        if emitted.len() != self.keys.len() {
            return Err(Exception::custom(
                "one count of emitted ids per drafted row",
            ));
        }
        let back: Vec<usize> = emitted
            .iter()
            .map(|&e| (self.gamma + 1).saturating_sub(e.max(1)))
            .collect();
        for (h, b) in self.held.iter_mut().zip(&back) {
            *h -= b;
        }
        // Planted: each row keeps one rejected position it counts as given back.
        let short = usize::from(plant::is(Defect::BatchDraftTrimShort));
        let trimmed: Vec<usize> = back.iter().map(|b| b.saturating_sub(short)).collect();
        self.batch.trim_rows(&trimmed)
    }

    /// The drafter caches of the row `key` (what it holds), for the row's cache entry.
    pub fn row_caches(&mut self, key: u64) -> Option<Vec<Box<dyn Cache>>> {
        let i = self.keys.iter().position(|&k| k == key)?;
        self.batch.row_caches(i, self.held[i] as i32).ok()
    }
}
