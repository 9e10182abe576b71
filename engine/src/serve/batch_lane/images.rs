//! Requests with images in the batch lane: each is a row of the lane (it takes a slot, its
//! client is cut, stalled or timed out like any row's), prefilled and stepped by the vision
//! model (`worker::image`: the same calls as on the serial lane, so the same answer) one
//! token per tick beside the batched step of the text rows. Not batched with them: the
//! vision model holds its own language model (and, for the Qwen families, each prompt's
//! M-RoPE delta moves its positions), so its rows step in forwards of their own.

use super::{Lane, Outcome};
use crate::generate::Finish;
use crate::serve::error::ApiError;
use crate::serve::worker::{Job, Worker, ADAPTER_WITH_IMAGES};

impl Worker {
    /// Starts a request with images: its row, its prompt prefilled with its images.
    pub(super) fn start_image_row<'w>(&'w self, lane: &mut Lane<'w>, job: Job) {
        let Some((mut row, request, prompt)) = self.open_row(job) else {
            return;
        };
        if row.adapter.is_some() {
            let e = ApiError::invalid(ADAPTER_WITH_IMAGES);
            return self.close(row, Outcome::Failed(e));
        }
        match self.start_image(&request, &prompt, &mut row.dec) {
            Ok(steps) => {
                row.cached = steps.cached;
                lane.images.push((row, steps));
            }
            Err(e) => self.close(row, Outcome::Failed(e)),
        }
    }

    /// One token of each image row whose client keeps up; rows that end leave (their
    /// caches to the prompt cache).
    pub(super) fn image_tick<'w>(&'w self, lane: &mut Lane<'w>) {
        for (mut row, mut steps) in std::mem::take(&mut lane.images) {
            if row.emit.backlogged() {
                match row.emit.check() {
                    true => self.close(row, Outcome::Done(Finish::Stop)),
                    false => lane.images.push((row, steps)),
                }
                continue;
            }
            let emit = &mut row.emit;
            let outcome = match steps.advance(&mut row.dec, &mut |id, lp| emit.token(id, lp)) {
                Ok(None) if !row.emit.gone => {
                    lane.images.push((row, steps));
                    continue;
                }
                Ok(None) => Outcome::Done(Finish::Stop),
                Ok(Some(finish)) => Outcome::Done(finish),
                Err(e) => Outcome::Failed(e),
            };
            let keep = matches!(outcome, Outcome::Done(_)) && !row.emit.gone;
            let produced = row.dec.history()[row.prompt_tokens..].to_vec();
            self.close(row, outcome);
            if keep {
                self.keep_image(steps, &produced);
            }
        }
    }
}

/// Rows of the lane, image rows included.
pub(super) fn busy(lane: &Lane<'_>) -> usize {
    lane.rows.len() + lane.admissions.len() + lane.images.len()
}
