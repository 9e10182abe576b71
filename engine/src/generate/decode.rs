//! The decode core. Every way of producing tokens — the CLI, the server's serial lane, each
//! row of its batch lane, and both speculative policies — runs a request through one
//! `Decoder`: the request's sampler and history (the logits processors' view: prompt plus
//! every id emitted), its token limit and EOS ids, its timing, and the one place a token is
//! emitted and the finish decided (`Decoder::emit`: EOS, the caller's stop, the limit).
//!
//! What differs between the paths is only how the next ids are found, a *policy*: one
//! pipelined step (`Plain`, mlx-lm's `generate_step`), a draft model's round
//! (`speculative::SpecRound`, `speculative_generate_step`) or an assistant's pass
//! (`assistant::AssistPass`, optiq's `assistant_generate_step`). `drafter::Decode` owns a
//! request's sessions and dispatches to the policy; the batch lane steps its rows itself
//! (one forward for all) and gives each row's logits to that row's `Decoder`.

use std::borrow::BorrowMut;
use std::time::Instant;

use mlx_rs::error::Exception;
use mlx_rs::Array;

use super::profile::{Phase, Profile};
use super::sampler::Sampler;
use super::{Finish, Flow, Session, Stats};

/// One request being decoded: sampler, history, limit, EOS ids, timing. `S` is the sampler,
/// owned (`Sampler`, the server) or borrowed (`&mut Sampler`, the library entry points).
pub struct Decoder<'e, S: BorrowMut<Sampler> = Sampler> {
    sampler: S,
    history: Vec<u32>,
    eos_ids: &'e [u32],
    max_tokens: usize,
    produced: usize,
    pub stats: Stats,
    start: Instant,
    decode_start: Instant,
}

impl<'e, S: BorrowMut<Sampler>> Decoder<'e, S> {
    /// A request for up to `max_tokens` after `prompt`, stopping at any of `eos_ids`.
    pub fn new(prompt: &[u32], max_tokens: usize, eos_ids: &'e [u32], sampler: S) -> Self {
        let now = Instant::now();
        Decoder {
            sampler,
            history: prompt.to_vec(),
            eos_ids,
            max_tokens,
            produced: 0,
            stats: Stats {
                prompt_tokens: prompt.len(),
                ..Stats::default()
            },
            start: now,
            decode_start: now,
        }
    }

    pub fn sampler(&mut self) -> &mut Sampler {
        self.sampler.borrow_mut()
    }

    /// Prompt plus every id emitted so far.
    pub fn history(&self) -> &[u32] {
        &self.history
    }

    /// Ids emitted so far.
    pub fn produced(&self) -> usize {
        self.produced
    }

    /// Ids still wanted.
    pub fn remaining(&self) -> usize {
        self.max_tokens.saturating_sub(self.produced)
    }

    /// One position's choice from its logits [1, vocab] (processors over the history, then
    /// log-probabilities and the sample, all lazy): (id [1], log-probabilities).
    pub fn pick(&mut self, logits: &Array) -> Result<(Array, Array), Exception> {
        self.sampler.borrow_mut().pick(logits, &self.history)
    }

    /// Whether this request samples plain greedy: temperature 0 and no logits processor
    /// (its rows of a batch step may then be picked together: `greedy_rows`).
    pub fn plain_greedy(&mut self) -> bool {
        let sampler = self.sampler.borrow_mut();
        sampler.params.temp == 0.0 && !sampler.has_processors()
    }

    /// Every row's choice from logits [n, vocab] at once (a verify pass; no processors):
    /// (ids [n], log-probabilities [n, vocab]).
    pub fn pick_rows(&mut self, logits: &Array) -> Result<(Array, Array), Exception> {
        let logprobs = logits.subtract(logits.logsumexp_axis(-1, true)?)?;
        Ok((self.sampler.borrow_mut().sample(&logprobs)?, logprobs))
    }

    /// The prompt is processed: what follows is decode time.
    pub fn prompt_done(&mut self) {
        self.stats.prompt_time = self.start.elapsed();
        self.decode_start = Instant::now();
    }

    /// The one emit/finish path. `id` was sampled from `logprobs` [1, vocab] (`drafted`: a
    /// draft the target accepted). An EOS id ends the request unemitted; otherwise
    /// `on_token` gets it and the request ends if it says Stop or the limit is reached.
    pub fn emit<E>(
        &mut self,
        id: u32,
        logprobs: &Array,
        drafted: bool,
        on_token: &mut impl FnMut(u32, &Array, bool) -> Result<Flow, E>,
    ) -> Result<Option<Finish>, E> {
        if self.eos_ids.contains(&id) {
            return Ok(Some(Finish::Eos));
        }
        let flow = on_token(id, logprobs, drafted)?;
        self.produced += 1;
        self.history.push(id);
        if flow == Flow::Stop {
            return Ok(Some(Finish::Stop));
        }
        Ok((self.produced >= self.max_tokens).then_some(Finish::Length))
    }

    /// The request ended: the final numbers.
    pub fn finish(&mut self) -> Stats {
        self.stats.generated_tokens = self.produced;
        self.stats.generation_time = self.decode_start.elapsed();
        self.stats.clone()
    }
}

/// The greedy choice of every row of a batch step at once, for rows that sample plain
/// greedy (`Decoder::plain_greedy`): (ids [B], log-probabilities [B, vocab]) from one
/// log-softmax and one argmax over the logits [B, vocab]. Row i's are bitwise what
/// `Sampler::pick` gives for row i's logits alone (the gate below); B rows cost the ops of
/// one instead of B.
pub fn greedy_rows(logits: &Array) -> Result<(Array, Array), Exception> {
    let logprobs = if crate::plant::is(crate::plant::Defect::GreedyRowsUnnormalized) {
        logits.clone()
    } else {
        logits.subtract(logits.logsumexp_axis(-1, true)?)?
    };
    Ok((
        mlx_rs::ops::indexing::argmax_axis(&logprobs, -1, None)?,
        logprobs,
    ))
}

fn read(y: &Array) -> Result<u32, Exception> {
    y.eval()?;
    Ok(y.as_slice::<u32>()[0])
}

/// The plain policy, mlx-lm's `generate_step`: one token per step. Without logits
/// processors the next step needs no host-side token, so step n+1 is built and queued with
/// async_eval before step n's id is read back, and step n+1's id is read only after step n+2
/// is queued: the host builds each graph while the previous one still runs (as
/// `generate_step` does). With processors each step waits for the last.
pub struct Plain {
    pipelined: bool,
    /// The current id (lazy: possibly still computing) and the log-probabilities it is
    /// drawn from.
    y: Array,
    y_logprobs: Array,
    /// A queued step the loop may leave unread (EOS, a stop); waited for in `end`, so no MLX
    /// work is in flight once the caller moves on (a process exiting under a running CPU
    /// task corrupted the heap, about 1 run in 40).
    in_flight: Option<Array>,
    /// ENGINE_DECODE_PROFILE's totals (None when it is off).
    profile: Option<Profile>,
}

impl Plain {
    /// Prefills `rest` (the prompt past what `session` holds) and samples the first id
    /// (read back here, so the time to the first token ends with the prompt).
    pub fn start<S: BorrowMut<Sampler>>(
        session: &mut Session,
        dec: &mut Decoder<'_, S>,
        rest: &[u32],
    ) -> Result<Self, Exception> {
        let logits = session.prefill(rest)?;
        let (y, y_logprobs) = dec.pick(&logits)?;
        mlx_rs::transforms::async_eval([&y])?;
        read(&y)?;
        dec.prompt_done();
        Ok(Plain {
            pipelined: !dec.sampler().has_processors(),
            y,
            y_logprobs,
            in_flight: None,
            profile: Profile::start(),
        })
    }

    /// Builds and queues the step after the current id (fed as a lazy array).
    fn queue(
        &mut self,
        session: &mut Session,
        dec: &mut Decoder<'_, impl BorrowMut<Sampler>>,
    ) -> Result<(Array, Array), Exception> {
        let t = Instant::now();
        let logits = session.step_array(&self.y)?;
        let next = dec.pick(&logits)?;
        if let Some(p) = self.profile.as_mut() {
            p.add(Phase::Build, t);
            p.step(&[&next.0, &next.1]);
            if !p.has_choice() {
                if let (Some(path), Some((eager, compiled))) =
                    (session.compile_choice(), session.compile_probe_medians())
                {
                    p.choice(path, eager, compiled);
                }
            }
        }
        let t = Instant::now();
        mlx_rs::transforms::async_eval([&next.0])?;
        if let Some(p) = self.profile.as_mut() {
            p.add(Phase::AsyncEval, t);
        }
        self.in_flight = Some(next.0.clone());
        Ok(next)
    }

    /// One step: the next one queued (when pipelined), the current id read and emitted.
    /// Some(finish) when the request is over.
    pub fn advance<S: BorrowMut<Sampler>, E: From<Exception>>(
        &mut self,
        session: &mut Session,
        dec: &mut Decoder<'_, S>,
        on_token: &mut impl FnMut(u32, &Array, bool) -> Result<Flow, E>,
    ) -> Result<Option<Finish>, E> {
        if dec.remaining() == 0 {
            return Ok(Some(Finish::Length));
        }
        let n = dec.produced();
        let queued = if self.pipelined && dec.remaining() > 1 {
            Some(self.queue(session, dec)?)
        } else {
            None
        };
        let t = Instant::now();
        let token = read(&self.y)?;
        if let Some(p) = self.profile.as_mut() {
            p.add(Phase::Wait, t);
        }
        if let Some(finish) = dec.emit(token, &self.y_logprobs, false, on_token)? {
            return Ok(Some(finish));
        }
        if n.is_multiple_of(256) {
            mlx_rs::memory::clear_cache()?;
        }
        (self.y, self.y_logprobs) = match queued {
            Some(next) => next,
            None => {
                let logits = session.step(&[token])?;
                dec.pick(&logits)?
            }
        };
        Ok(None)
    }

    /// Waits for a step the loop left unread.
    pub fn end(self) -> Result<(), Exception> {
        if let Some(p) = &self.profile {
            eprintln!("{}", p.report());
        }
        match self.in_flight {
            Some(pending) => pending.eval(),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use mlx_rs::ops::indexing::IndexOp;
    use mlx_rs::{random, Array, Dtype};

    use super::greedy_rows;
    use crate::generate::sampler::{Sampler, SamplingParams};

    /// For each row of `logits` [B, vocab]: whether `greedy_rows` gives exactly the id and
    /// log-probabilities (max |Δ| = 0) that `Sampler::pick` gives for that row alone.
    fn rows_match(logits: &Array) -> bool {
        let (ids, lp) = greedy_rows(logits).unwrap();
        let mut sampler = Sampler::new(SamplingParams::default()).unwrap();
        (0..logits.dim(0)).all(|i| {
            let alone = logits.index(i).reshape(&[1, -1]).unwrap();
            let (y, lp1) = sampler.pick(&alone, &[]).unwrap();
            let f32s = |a: &Array| {
                a.as_dtype(Dtype::Float32)
                    .unwrap()
                    .as_slice::<f32>()
                    .to_vec()
            };
            let row = lp.index(i..i + 1);
            y.as_slice::<u32>()[0] == ids.as_slice::<u32>()[i as usize]
                && f32s(&lp1)
                    .iter()
                    .zip(f32s(&row))
                    .all(|(a, b)| a.to_bits() == b.to_bits())
        })
    }

    fn logits(dtype: Dtype, seed: u64) -> Array {
        let key = random::key(seed).unwrap();
        random::normal::<f32>(&[7, 1031], None, Some(4.0), &key)
            .unwrap()
            .as_dtype(dtype)
            .unwrap()
    }

    #[test]
    fn all_rows_picked_at_once_are_each_rows_pick_alone() {
        for (dtype, seed) in [
            (Dtype::Float32, 1),
            (Dtype::Bfloat16, 2),
            (Dtype::Float16, 3),
        ] {
            assert!(rows_match(&logits(dtype, seed)), "{dtype:?}");
        }
    }

    #[test]
    fn planted_unnormalized_rows_are_caught() {
        let _on = crate::plant::on(crate::plant::Defect::GreedyRowsUnnormalized).unwrap();
        assert!(!rows_match(&logits(Dtype::Float32, 1)));
    }
}
