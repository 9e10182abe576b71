//! Per-row failure containment. A batched forward that fails (its ops refused while the
//! step is built: a shape, an id, an allocation) is one failure of several rows, and
//! nothing says which row caused it; so no row is failed for it on the spot:
//!
//! 1. each row's queued sample of the last step is evaluated and emitted on its own (a row
//!    whose sample cannot be evaluated fails alone);
//! 2. each row's caches are taken out of the broken batch at the tokens it had fed (the
//!    slice drops whatever the failed step wrote into some layers before it failed);
//! 3. each row steps its next id alone, in a batch of its own: a row whose lone step fails
//!    again is the cause and fails alone; the others go on together in a new batch.
//!
//! A forward that fails later, while MLX evaluates it, has already fed every row's K/V
//! from one shared computation; its rows fail together, as before (see docs/serve.md).

use std::sync::atomic::Ordering;

use mlx_rs::error::Exception;

use super::{Lane, Outcome, Row};
use crate::cache::Cache;
use crate::generate::batch::Batch;
use crate::generate::{Finish, Session};
use crate::serve::error::ApiError;
use crate::serve::worker::Worker;

pub(super) fn failed(e: impl std::fmt::Display) -> Outcome {
    Outcome::Failed(ApiError::server(format!("generation failed: {e}")))
}

impl Worker {
    /// After the batched forward failed with `cause`: every row retried alone (module
    /// header); the lane's batch is rebuilt from the rows that went on.
    pub(super) fn contain<'w>(&'w self, lane: &mut Lane<'w>, cause: &Exception) {
        // Under a group the ranks no longer agree: the lane ends at its next tick.
        if self.lose_group(cause) {
            return;
        }
        let rows = std::mem::take(&mut lane.rows);
        let pending = lane.inflight.take();
        let broken = std::mem::replace(&mut lane.batch, Batch::for_lane(self.model.as_ref()));
        if crate::plant::is(crate::plant::Defect::BatchFailureNotContained) {
            for row in rows {
                self.close(row, failed(cause));
            }
            return;
        }
        let mut taken: Vec<(Row<'w>, Vec<Box<dyn Cache>>)> = Vec::new();
        let mut broken = broken;
        for (i, mut row) in rows.into_iter().enumerate() {
            if let Some(queued) = pending.as_ref().filter(|p| i < p.len()) {
                let outcome = match queued.row(i).and_then(|(y, lp)| {
                    y.eval()?;
                    Ok((y.as_slice::<u32>()[0], lp))
                }) {
                    Ok((id, lp)) => Self::emit_next(&mut row, id, &lp),
                    Err(e) => failed(e),
                };
                match outcome {
                    Outcome::Continue if !row.emit.gone => {}
                    Outcome::Continue => {
                        self.close(row, Outcome::Done(Finish::Stop));
                        continue;
                    }
                    other => {
                        self.close(row, other);
                        continue;
                    }
                }
            }
            // Everything but `next` is fed.
            let fed = row.dec.history().len() as i32 - 1;
            match broken.row_caches(i, fed) {
                Ok(caches) => taken.push((row, caches)),
                Err(e) => self.close(row, failed(e)),
            }
        }
        drop(broken);
        for (row, caches) in taken {
            self.counters
                .batch_retried_alone
                .fetch_add(1, Ordering::Relaxed);
            self.retry_alone(lane, row, caches);
        }
    }

    /// Steps `row` (its caches `caches` hold all it was fed but `next`) alone; it joins the
    /// lane's batch if that step went well and the row goes on.
    fn retry_alone<'w>(
        &'w self,
        lane: &mut Lane<'w>,
        mut row: Row<'w>,
        caches: Vec<Box<dyn Cache>>,
    ) {
        let opts = self.opts_for(row.adapter.as_ref());
        let session = Session::with_caches(self.model.as_ref(), &opts, caches);
        let mut alone = Batch::for_lane(self.model.as_ref());
        let outcome = match alone
            .join(vec![session])
            .and_then(|()| alone.step(&[row.next]))
        {
            Ok(logits) => self.advance(&mut row, &logits),
            Err(e) => failed(e),
        };
        match outcome {
            Outcome::Continue if !row.emit.gone => match lane.batch.append(alone) {
                Ok(()) => lane.rows.push(row),
                Err(e) => self.close(row, failed(e)),
            },
            Outcome::Continue => self.close(row, Outcome::Done(Finish::Stop)),
            other => self.close(row, other),
        }
    }
}
