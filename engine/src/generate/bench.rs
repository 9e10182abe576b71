//! One benchmark leg, measured the way `oracles/bench_leg.py` measures mlx-lm: a discarded
//! warm-up generation, then one measured generation of the same prompt ids (no EOS stop).
//! TTFT runs from the start of the prompt to the first token id on the host; decode tok/s is
//! (n − 1) / (last − first token time); peak memory is reset before the measured run.

use std::time::Instant;

use mlx_rs::error::Exception;
use serde::Serialize;

use super::sampler::{Sampler, SamplingParams};
use super::{generate_with, SessionOptions};
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

fn run_once(
    model: &dyn LanguageModel,
    ids: &[u32],
    max_tokens: usize,
    opts: &SessionOptions,
) -> Result<(f64, f64, usize), Exception> {
    let mut times = Vec::with_capacity(max_tokens);
    let start = Instant::now();
    let mut sampler = Sampler::new(SamplingParams::default())?;
    generate_with(model, ids, max_tokens, &[], &mut sampler, opts, |_, _| {
        times.push(Instant::now());
        Ok(super::Flow::Continue)
    })?;
    let ttft = times[0].duration_since(start).as_secs_f64();
    let decode = match times.len() {
        n if n > 1 => (n - 1) as f64 / times[n - 1].duration_since(times[0]).as_secs_f64(),
        _ => 0.0,
    };
    Ok((ttft, decode, times.len()))
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

/// One leg of `stack` (e.g. "engine", "engine-eager", "engine-l2") run with `opts`.
pub fn run_leg(
    model: &dyn LanguageModel,
    ids: &[u32],
    max_tokens: usize,
    stack: &'static str,
    opts: &SessionOptions,
) -> Result<LegResult, Exception> {
    assert!(max_tokens > 0 && !ids.is_empty());
    run_once(model, ids, max_tokens, opts)?; // warm-up, discarded
    mlx_rs::memory::clear_cache()?;
    mlx_rs::memory::reset_peak_memory()?;
    let (ttft, decode, n) = run_once(model, ids, max_tokens, opts)?;
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
