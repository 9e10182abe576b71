//! Giving back the rejected part of a speculative pass, for every cache kind: the target's
//! verify pass (a draft model's round and prompt lookup alike, `speculative::verify`) and
//! the draft model's own drafting (`speculative::SpecRound`).
//!
//! A pass feeds `fed` = [y…, d1 … dγ] and keeps its first `keep` positions (y and the
//! accepted drafts). A K/V cache (and a sliding-window ring that has not wrapped) gives the
//! rest back by `trim`. A recurrent state — a short convolution's last K − 1 inputs, a gated
//! delta net's or Mamba-2's state — folds every token into one array, s_t = f(s_{t−1}, x_t),
//! and cannot drop one, so it is checkpointed (`Cache::checkpoint`) before the pass. To roll
//! back it returns to its checkpoint s_c, and the kept positions are fed again through the
//! whole model, so it ends at f(…f(s_c, fed[0])…, fed[keep − 1]): the state after exactly the
//! kept tokens, as plain decoding has it. The re-feed also writes the kept positions' K/V,
//! so before it the trimmable caches give back all of `fed` (not only the rejected part):
//! every cache is then back at the checkpoint's position and takes the kept positions once.
//! A composite cache (`CacheList`: Falcon-H1's state beside its K/V) is handled part by
//! part, so its K/V is trimmed rather than copied into a checkpoint. After a full accept
//! nothing is rolled back; a session of trimmable caches only is trimmed as before (no
//! re-feed). mlx-lm 0.32.2 has no such path: its speculative decoding needs every cache
//! to trim.
//!
//! A cache that can neither trim nor return to a checkpoint (a sliding-window ring that has
//! wrapped over the positions it would need) stops generation with an error naming its layer.

use mlx_rs::error::Exception;

use super::Session;
use crate::cache::{Cache, Snapshot};
use crate::plant::{self, Defect};

/// The caches' leaves (a composite cache's parts in its place), each with its layer.
fn leaves(caches: &mut [Box<dyn Cache>]) -> Vec<(usize, &mut Box<dyn Cache>)> {
    fn push<'a>(
        layer: usize,
        c: &'a mut Box<dyn Cache>,
        out: &mut Vec<(usize, &'a mut Box<dyn Cache>)>,
    ) {
        if c.sub_caches().is_some() {
            for part in c.sub_caches_mut().into_iter().flatten() {
                push(layer, part, out);
            }
        } else {
            out.push((layer, c));
        }
    }
    let mut out = Vec::new();
    for (layer, c) in caches.iter_mut().enumerate() {
        push(layer, c, &mut out);
    }
    out
}

/// How many drafts a pass over [y, drafts…] can feed and still give back (prompt lookup
/// drafts no more): no bound from a K/V cache or a recurrent state (it returns to a
/// checkpoint), a ring's room until it would wrap, and none where a cache can do neither
/// (past its window a ring's model then decodes with plain steps instead of failing).
pub fn room(caches: &mut [Box<dyn Cache>]) -> usize {
    let mut room = usize::MAX;
    for (_, c) in leaves(caches) {
        if !c.is_trimmable() {
            if !c.can_checkpoint() {
                return 0;
            }
            continue;
        }
        if let Some(r) = c.rollback_room() {
            // y and the drafts must fit: the ring can take r more positions.
            room = room.min((r - 1).max(0) as usize);
        }
    }
    room
}

/// The recurrent states of a session before a speculative pass (one entry per cache leaf:
/// None for a trimmable one, which gives positions back by trimming).
pub struct Checkpoint {
    states: Vec<Option<Snapshot>>,
}

impl Checkpoint {
    /// Checkpoints every cache of `session` that cannot trim (array references only: MLX
    /// arrays are immutable, so nothing is copied).
    pub fn take(session: &mut Session) -> Self {
        let states = leaves(&mut session.caches)
            .into_iter()
            .map(|(_, c)| match c.is_trimmable() {
                true => None,
                false => c.checkpoint(),
            })
            .collect();
        Checkpoint { states }
    }

    /// After the pass fed `fed`, leaves `session` holding only its first `keep` positions
    /// (see the module header). Nothing to do when every position is kept.
    pub fn roll_back(
        self,
        session: &mut Session,
        fed: &[u32],
        keep: usize,
    ) -> Result<(), Exception> {
        if keep >= fed.len() {
            return Ok(());
        }
        if self.states.iter().all(Option::is_none) {
            return session.trim(fed.len() - keep);
        }
        let mut leaves = leaves(&mut session.caches);
        if leaves.len() != self.states.len() {
            return Err(Exception::custom(
                "speculative decoding: the caches changed shape during a pass; the checkpoint \
                 does not fit them",
            ));
        }
        for ((layer, c), state) in leaves.iter().zip(&self.states) {
            if state.is_none() && !c.is_trimmable() {
                return Err(Exception::custom(format!(
                    "speculative decoding cannot roll back layer {layer}'s cache at position \
                     {}: it can neither give tokens back nor return to a checkpoint (e.g. a \
                     sliding-window cache that has wrapped: keep prompt + output under its \
                     window); decode without drafting",
                    c.offset()
                )));
            }
        }
        let restore = !plant::is(Defect::SpecStateNotRestored);
        for ((_, c), state) in leaves.iter_mut().zip(self.states) {
            match state {
                Some(s) if restore => c.restore_checkpoint(s)?,
                Some(_) => {}
                None => {
                    c.trim(fed.len() as i32);
                }
            }
        }
        if keep > 0 {
            let late = usize::from(plant::is(Defect::SpecRefeedOneLate));
            session.feed(&fed[late..keep + late])?;
        }
        Ok(())
    }
}

impl Session<'_> {
    /// Feeds `ids` for their caches alone (no logits are computed): a rollback's re-feed.
    fn feed(&mut self, ids: &[u32]) -> Result<(), Exception> {
        self.model
            .forward(&super::ids_array(ids), &mut self.caches)?;
        self.quantize_due()?;
        self.eval_caches()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::none::PassThrough;
    use crate::cache::{ArraysCache, CacheList, KvCache, RotatingKvCache};

    fn boxed(c: impl Cache + 'static) -> Box<dyn Cache> {
        Box::new(c)
    }

    #[test]
    fn room_is_unbounded_over_kv_and_states_bounded_by_a_ring_and_none_past_both() {
        let list = || CacheList::new(vec![boxed(ArraysCache::new(2)), boxed(KvCache::new())]);
        let mut caches = vec![
            boxed(KvCache::new()),
            boxed(ArraysCache::new(2)),
            boxed(list()),
        ];
        assert_eq!(room(&mut caches), usize::MAX);
        // An empty ring of 8 can take 7 positions and still trim: y and 6 drafts.
        caches.push(boxed(RotatingKvCache::new(8)));
        assert_eq!(room(&mut caches), 6);
        // A cache that can neither trim nor return to a checkpoint: no drafts at all.
        caches.push(boxed(PassThrough));
        assert_eq!(room(&mut caches), 0);
    }
}
