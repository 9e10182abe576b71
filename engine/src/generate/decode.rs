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
