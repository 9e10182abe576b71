//! The batch lane's time slices: with every slot busy and requests waiting, a row whose
//! client has not taken its events gives its slot up (parked with its caches), else the
//! row that has held its slot longest once it has held it for `SLICE`; parked rows whose
//! clients caught up rejoin when a slot is free.

use std::sync::atomic::Ordering;
use std::time::Instant;

use super::{mirror, Lane, Outcome, Row, SLICE};
use crate::cache::Cache;
use crate::generate::batch::Batch;
use crate::generate::Session;
use crate::serve::error::ApiError;
use crate::serve::worker::Worker;

impl Worker {
    /// The row to park under contention: one whose client is behind, else the one that
    /// has held its slot longest if that is at least SLICE.
    fn victim(rows: &mut [Row<'_>]) -> Option<usize> {
        if let Some(i) = rows.iter_mut().position(|r| r.emit.backlogged()) {
            return Some(i);
        }
        let (i, oldest) = rows.iter().enumerate().min_by_key(|(_, r)| r.since)?;
        let slice = match crate::plant::is(crate::plant::Defect::BatchSliceShort) {
            true => std::time::Duration::from_millis(20),
            false => SLICE,
        };
        (oldest.since.elapsed() >= slice).then_some(i)
    }

    /// Takes row `i` (whose emitted ids are all fed but its `next`) out of the batch with
    /// its caches. Returns false if the batch broke (every row failed, the lane empty).
    fn park<'w>(
        &self,
        i: usize,
        rows: &mut Vec<Row<'w>>,
        batch: &mut Batch<'_>,
        parked: &mut Vec<(Row<'w>, Vec<Box<dyn Cache>>)>,
    ) -> bool {
        let fed = rows[i].dec.history().len() as i32 - 1;
        let key = rows[i].key;
        let _ = self.mirror(|| mirror::LaneOp::Park { row: i, fed, key });
        let Ok(caches) = batch.row_caches(i, fed) else {
            return true;
        };
        let keep: Vec<usize> = (0..rows.len()).filter(|&k| k != i).collect();
        if let Err(e) = batch.keep(&keep) {
            for row in rows.drain(..) {
                self.close(row, Outcome::Failed(ApiError::server(e.to_string())));
            }
            return false;
        }
        parked.push((rows.remove(i), caches));
        self.counters.batch_parks.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// Every slot busy and a request waiting (new, or parked and ready): a row whose client
    /// has not taken its events gives its slot up (parked), else the row that has held its
    /// slot longest, once it has held it for SLICE. Waiting requests take free slots first;
    /// parked rows whose clients caught up take them back next.
    pub(super) fn share_slots<'w>(&'w self, lane: &mut Lane<'w>) {
        let slots = lane.slots;
        let ready = |parked: &mut Vec<(Row<'_>, Vec<Box<dyn Cache>>)>| {
            parked.iter_mut().position(|(r, _)| !r.emit.backlogged())
        };
        let park = lane.admissions.is_empty()
            && lane.rows.len() >= slots
            && lane.parked.len() < (crate::serve::worker::PAUSED_PER_SLOT - 1) * slots
            && (lane.admissible() || ready(&mut lane.parked).is_some())
            && Self::victim(&mut lane.rows).is_some();
        let rejoin = lane.admissions.is_empty()
            && !lane.admissible()
            && lane.rows.len() < slots
            && ready(&mut lane.parked).is_some();
        if park || rejoin {
            self.flush(lane);
        }
        if park && lane.rows.len() >= slots {
            if let Some(i) = Self::victim(&mut lane.rows) {
                if !self.park(i, &mut lane.rows, &mut lane.batch, &mut lane.parked) {
                    self.fresh_batch(lane);
                }
            }
        }
        if rejoin && lane.rows.len() < slots {
            if let Some(j) = ready(&mut lane.parked) {
                let (mut row, caches) = lane.parked.remove(j);
                row.since = Instant::now();
                let key = row.key;
                let _ = self.mirror(|| mirror::LaneOp::Rejoin { key });
                let session = Session::with_caches(self.model.as_ref(), &self.opts, caches);
                match lane.batch.join(vec![session]) {
                    Ok(()) => lane.rows.push(row),
                    Err(e) => self.close(row, Outcome::Failed(ApiError::server(e.to_string()))),
                }
            }
        }
    }
}
