//! The batch lane's draft model (`--draft-model`, issue 43 item 4): its drafter batch
//! (`generate::batch_draft`), the drafts it gives a round's drafting rows, and what the rows
//! give back after the round (`lookup.rs` runs the rounds).

use std::sync::atomic::Ordering;

use super::{Lane, Outcome};
use crate::serve::worker::Worker;

impl Worker {
    /// The lane's drafter batch: with a draft model (`--draft-model`), else None.
    pub(super) fn drafter_batch(&self) -> Option<crate::generate::batch_draft::DraftBatch<'_>> {
        match &self.draft {
            Some((crate::generate::drafter::Drafter::Model(m), _)) => {
                Some(crate::generate::batch_draft::DraftBatch::new(
                    m.as_ref(),
                    &self.opts,
                    self.prefill_step,
                ))
            }
            _ => None,
        }
    }

    /// The draft model's drafts for the rows that draft with it (`batch_draft`), into
    /// `drafts` (each cut to its row's γ and what it may still emit); the indices of those
    /// rows. A failure of the drafter ends drafting for them (they decode on, counted as
    /// fallbacks).
    pub(super) fn model_drafts(&self, lane: &mut Lane<'_>, drafts: &mut [Vec<u32>]) -> Vec<usize> {
        use crate::generate::batch_draft::DraftRow;
        let Some(drafter) = lane.drafter.as_mut() else {
            return Vec::new();
        };
        let drafting: Vec<usize> = (0..lane.rows.len())
            .filter(|&i| lane.rows[i].draft.is_some())
            .collect();
        if drafting.is_empty() {
            drafter.clear();
            return drafting;
        }
        let mut seeds: Vec<(u64, Vec<Box<dyn crate::cache::Cache>>)> = drafting
            .iter()
            .filter_map(|&i| {
                let row = &mut lane.rows[i];
                Some((row.key, row.draft_seed.take()?))
            })
            .collect();
        let gamma = drafting
            .iter()
            .filter_map(|&i| lane.rows[i].draft)
            .max()
            .unwrap_or(1);
        let rows: Vec<DraftRow> = drafting
            .iter()
            .map(|&i| DraftRow {
                key: lane.rows[i].key,
                text: lane.rows[i].dec.history(),
            })
            .collect();
        let seed = |key: u64| {
            let at = seeds.iter().position(|(k, _)| *k == key)?;
            Some(seeds.swap_remove(at).1)
        };
        match drafter
            .sync(&rows, seed)
            .and_then(|()| drafter.draft(&rows, gamma))
        {
            Ok(proposed) => {
                for (&i, d) in drafting.iter().zip(proposed) {
                    let row = &lane.rows[i];
                    let limit = row
                        .draft
                        .unwrap_or(0)
                        .min(row.dec.remaining().saturating_sub(1));
                    drafts[i] = d[..limit.min(d.len())].to_vec();
                }
                drafting
            }
            Err(e) => {
                eprintln!("engine serve: the running rows decode on without drafting: {e}");
                drafter.clear();
                for &i in &drafting {
                    lane.rows[i].draft = None;
                }
                self.counters
                    .spec_fallbacks
                    .fetch_add(drafting.len() as u64, Ordering::Relaxed);
                Vec::new()
            }
        }
    }

    /// After a round's emission: the drafter rows give back what their rows did not keep
    /// (row i emitted `fed − given_back[i]` ids), and a row that ends takes its drafter
    /// caches to its cache entry. A drafter that fails here is cleared (its rows are
    /// prefilled again at the next round).
    pub(super) fn settle_drafter(
        &self,
        lane: &mut Lane<'_>,
        drafted: &[usize],
        given_back: &[usize],
        fed: usize,
        outcomes: &[Option<Outcome>],
    ) {
        let Some(drafter) = lane.drafter.as_mut() else {
            return;
        };
        if drafted.is_empty() {
            return;
        }
        let emitted: Vec<usize> = drafted.iter().map(|&i| fed - given_back[i]).collect();
        if let Err(e) = drafter.settle(&emitted) {
            eprintln!("engine serve: the drafter rows start over: {e}");
            drafter.clear();
            return;
        }
        for &i in drafted {
            if matches!(outcomes[i], Some(Outcome::Done(_))) {
                let row = &mut lane.rows[i];
                row.draft_seed = drafter.row_caches(row.key);
            }
        }
    }
}
