//! One benchmark leg, measured the way `oracles/bench_leg.py` measures mlx-lm: a discarded
//! warm-up generation, then one measured generation of the same prompt ids (no EOS stop).
//! TTFT runs from the start of the prompt to the first token id on the host; decode tok/s is
//! (n − 1) / (last − first token time); peak memory is reset before the measured run.

use std::time::Instant;

use mlx_rs::error::Exception;
use serde::Serialize;

use super::sampler::{Sampler, SamplingParams};
use super::SessionOptions;
use crate::model::LanguageModel;

#[derive(Debug, Clone, Serialize)]
pub struct LegResult {
    pub stack: &'static str,
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    pub ttft_s: f64,
    pub prefill_tps: f64,
    pub decode_tps: f64,
    pub peak_memory_bytes: usize,
    /// Bytes the KV caches hold after the prompt and the generated tokens.
    pub kv_bytes: usize,
}

/// From the start of a request and the instant each token arrived: the time to the first
/// token, the tokens after it, and the time they took (their decode rate is the ratio).
pub fn token_timing(start: Instant, times: &[Instant]) -> (f64, usize, f64) {
    match times {
        [] => (0.0, 0, 0.0),
        [first, .., last] => (
            first.duration_since(start).as_secs_f64(),
            times.len() - 1,
            last.duration_since(*first).as_secs_f64(),
        ),
        [first] => (first.duration_since(start).as_secs_f64(), 0, 0.0),
    }
}

/// Decode tok/s from `token_timing` (0 with fewer than two tokens).
pub fn decode_rate(after_first: usize, span_s: f64) -> f64 {
    if after_first == 0 {
        0.0
    } else {
        after_first as f64 / span_s
    }
}

/// Greedy decoding of `ids` in `session` (which holds `ids[..cached]`), up to `max_tokens`
/// and never stopping at an EOS: the instant each token arrived.
pub fn token_times(
    session: &mut super::Session,
    ids: &[u32],
    cached: usize,
    max_tokens: usize,
) -> Result<Vec<Instant>, Exception> {
    token_times_until(session, ids, cached, max_tokens, &[])
}

/// As `token_times`, stopping at any of `eos` (a server's answer ends there).
fn token_times_until(
    session: &mut super::Session,
    ids: &[u32],
    cached: usize,
    max_tokens: usize,
    eos: &[u32],
) -> Result<Vec<Instant>, Exception> {
    let mut times = Vec::with_capacity(max_tokens);
    let mut sampler = Sampler::new(SamplingParams::default())?;
    super::generate_in(
        session,
        ids,
        cached,
        max_tokens,
        eos,
        &mut sampler,
        |_, _| {
            times.push(Instant::now());
            Ok(super::Flow::Continue)
        },
    )?;
    Ok(times)
}

fn run_once(
    model: &dyn LanguageModel,
    ids: &[u32],
    max_tokens: usize,
    eos: &[u32],
    opts: &SessionOptions,
) -> Result<(f64, f64, usize), Exception> {
    let start = Instant::now();
    let times = token_times_until(
        &mut super::Session::with_options(model, opts),
        ids,
        0,
        max_tokens,
        eos,
    )?;
    let (ttft, after_first, span) = token_timing(start, &times);
    Ok((ttft, decode_rate(after_first, span), times.len()))
}

/// KV bytes after greedy-feeding the prompt and `steps` more tokens (untimed).
fn kv_bytes(
    model: &dyn LanguageModel,
    ids: &[u32],
    steps: usize,
    opts: &SessionOptions,
) -> Result<usize, Exception> {
    let mut session = super::Session::with_options(model, opts);
    let mut token = super::greedy(&session.prefill(ids)?)?;
    for _ in 1..steps {
        token = super::greedy(&session.step(&[token])?)?;
    }
    let state: Vec<&mlx_rs::Array> = session.caches.iter().flat_map(|c| c.state()).collect();
    mlx_rs::transforms::eval(state)?;
    Ok(session.caches.iter().map(|c| c.nbytes()).sum())
}

/// One leg of `stack` (e.g. "engine", "engine-eager", "engine-l2") run with `opts`: all of
/// `max_tokens`, never stopping at an EOS.
pub fn run_leg(
    model: &dyn LanguageModel,
    ids: &[u32],
    max_tokens: usize,
    stack: &'static str,
    opts: &SessionOptions,
) -> Result<LegResult, Exception> {
    run_leg_until(model, ids, max_tokens, &[], stack, opts)
}

/// As `run_leg`, stopping at any of `eos` as a server's answer does (the serve suite's
/// direct leg: the tokens the served answers decode).
pub fn run_leg_until(
    model: &dyn LanguageModel,
    ids: &[u32],
    max_tokens: usize,
    eos: &[u32],
    stack: &'static str,
    opts: &SessionOptions,
) -> Result<LegResult, Exception> {
    assert!(max_tokens > 0 && !ids.is_empty());
    run_once(model, ids, max_tokens, eos, opts)?; // warm-up, discarded
    mlx_rs::memory::clear_cache()?;
    mlx_rs::memory::reset_peak_memory()?;
    let (ttft, decode, n) = run_once(model, ids, max_tokens, eos, opts)?;
    let peak = mlx_rs::memory::peak_memory()?;
    Ok(LegResult {
        stack,
        prompt_tokens: ids.len(),
        generated_tokens: n,
        ttft_s: ttft,
        prefill_tps: ids.len() as f64 / ttft,
        decode_tps: decode,
        peak_memory_bytes: peak,
        kv_bytes: kv_bytes(model, ids, n, opts)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn token_timing_counts_after_the_first_token() {
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let (ttft, n, span) = token_timing(t0, &[at(100), at(150), at(200)]);
        assert!((ttft - 0.1).abs() < 1e-9 && n == 2 && (span - 0.1).abs() < 1e-9);
        assert!((decode_rate(n, span) - 20.0).abs() < 1e-6);
        assert_eq!(token_timing(t0, &[at(5)]).1, 0);
        assert_eq!(decode_rate(0, 0.0), 0.0);
    }
}
