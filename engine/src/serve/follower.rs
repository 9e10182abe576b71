//! A rank other than 0 under `engine serve`: no HTTP, no emitter. It applies rank 0's round
//! plans (`dist_plan`) in order with the same model shard, sampler and prompt store, so
//! that every forward — and every collective in it — matches rank 0's (the batch lane's
//! through a `batch_lane::Mirror`). Any failure is
//! fatal (`dist::fatal`, exit 4); rank 0's shutdown ends it with status 0.

use std::collections::HashMap;

use mlx_rs::error::Exception;

use super::batch_lane::Mirror;
use super::dist_plan::{self, Admit, Op};
use super::worker::Worker;
use crate::generate::decode::Decoder;
use crate::generate::drafter::Decode;
use crate::generate::sampler::{Sampler, SamplingParams};
use crate::generate::Session;

/// A request this rank decodes with rank 0.
struct Followed<'w> {
    decode: Decode<'w>,
    dec: Decoder<'w>,
    prompt: Vec<u32>,
}

impl Worker {
    /// Follows rank 0's plans until it shuts down.
    pub fn follow(self) {
        crate::dist::arm("the first round plan");
        let mut requests: HashMap<u64, Followed<'_>> = HashMap::new();
        // Rank 0's batch lane (`--batch N`), mirrored from its first op on.
        let mut lane: Option<Mirror<'_>> = None;
        loop {
            let ops = dist_plan::receive().unwrap_or_else(|e| crate::dist::fatal(&e));
            for op in ops {
                let applied = match op {
                    Op::End { id, keep } => self.follow_end(requests.remove(&id), keep),
                    Op::Admit(a) => {
                        let id = a.id;
                        self.follow_admit(*a)
                            .map(|r| {
                                requests.insert(id, r);
                            })
                            .or_else(failed_alone)
                    }
                    // A request that failed alone (as on rank 0) waits for rank 0's End.
                    Op::Step { id } => match requests.get_mut(&id) {
                        Some(r) => r
                            .decode
                            .advance(&mut r.dec, &mut |id, _, _| dist_plan::follow_flow(id))
                            .map(|_| ())
                            .or_else(failed_alone),
                        None => Err(Exception::custom(format!(
                            "the round plan steps request {id}, which this rank does not hold"
                        ))),
                    },
                    Op::Lane(op) => lane.get_or_insert_with(|| Mirror::new(&self)).apply(op),
                    Op::Shutdown => {
                        crate::dist::done();
                        return;
                    }
                };
                if let Err(e) = applied {
                    crate::dist::fatal(&e)
                }
            }
        }
    }

    /// An admission: the prompt store gives what it gave rank 0, then the prefill.
    fn follow_admit(&self, a: Admit) -> Result<Followed<'_>, Exception> {
        let sampler = follower_sampler(&a, &self.tokenizer)?;
        let (caches, cached) = match self.cache_take(&a.prompt) {
            Some(hit) if hit.reused == a.cached => (hit.caches, hit.reused),
            // Rank 0 found nothing (it had evicted what this rank kept): start afresh.
            _ if a.cached == 0 => (self.make_caches(), 0),
            hit => {
                return Err(Exception::custom(format!(
                    "the prompt stores diverged: rank 0 reused {} prompt tokens, this rank {}",
                    a.cached,
                    hit.map_or(0, |h| h.reused)
                )))
            }
        };
        let mut session = Session::with_caches(self.model.as_ref(), &self.opts, caches);
        session.prefill_step = self.prefill_step;
        let eos = &self.tokenizer.eos_token_ids;
        let mut dec = Decoder::new(&a.prompt, a.max_tokens, eos, sampler);
        let decode = Decode::start(session, None, &self.opts, &mut dec, &a.prompt, cached)?;
        Ok(Followed {
            decode,
            dec,
            prompt: a.prompt,
        })
    }

    /// A request rank 0 ended: its caches kept under the tokens rank 0 kept them under.
    fn follow_end(&self, r: Option<Followed<'_>>, keep: Option<Vec<u32>>) -> Result<(), Exception> {
        let Some(r) = r else {
            return Ok(());
        };
        let (mut session, _) = r.decode.end()?;
        if let Some(tail) = keep {
            let mut tokens = r.prompt;
            tokens.extend(tail);
            let caches = std::mem::take(&mut session.caches);
            drop(session);
            self.keep_fed(caches, tokens);
        }
        Ok(())
    }
}

/// A request's failure that rank 0 had too, at the same point (its grammar's: `lead`): the
/// request fails alone, the group goes on; any other is fatal.
fn failed_alone(e: Exception) -> Result<(), Exception> {
    match dist_plan::same_on_every_rank(e.what()) {
        true => Ok(()),
        false => Err(e),
    }
}

/// A follower's sampler for an admission: rank 0's settings and rank 0's grammar (the same
/// mask every step, else the ranks' ids — and so their forwards — diverge).
fn follower_sampler(
    a: &Admit,
    tokenizer: &std::sync::Arc<crate::load::tokenizer::Tokenizer>,
) -> Result<Sampler, Exception> {
    let sampler = Sampler::new(SamplingParams::from(a.sampling.clone()))
        .map_err(|e| Exception::custom(e.to_string()))?;
    let grammar = a
        .constraint
        .as_ref()
        .filter(|_| !crate::plant::is(crate::plant::Defect::FollowerUnconstrained));
    crate::generate::sampler::constrain(sampler, tokenizer, grammar).map_err(Exception::custom)
}

/// A follower rank: applies rank 0's plans until its shutdown (then exits 0); any failure
/// ends it with `dist::exit::PEER_LOST`.
pub fn follow(worker: Worker) -> anyhow::Result<()> {
    if let Some(g) = crate::dist::group() {
        eprintln!(
            "engine serve: rank {} of {} ({} parallel): following rank 0",
            g.rank,
            g.size,
            g.mode.name()
        );
    }
    worker.follow();
    Ok(())
}
