//! One benchmark leg, measured the way `oracles/bench_leg.py` measures mlx-lm: a discarded
//! warm-up generation, then one measured generation of the same prompt ids (no EOS stop).
//! TTFT runs from the start of the prompt to the first token id on the host; decode tok/s is
//! (n − 1) / (last − first token time); peak memory is reset before the measured run.

use std::time::Instant;

use mlx_rs::error::Exception;
use serde::Serialize;

use super::sampler::{Sampler, SamplingParams};
use super::{generate_with, CompileDecode};
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
}

fn run_once(
    model: &dyn LanguageModel,
    ids: &[u32],
    max_tokens: usize,
    compile: CompileDecode,
) -> Result<(f64, f64, usize), Exception> {
    let mut times = Vec::with_capacity(max_tokens);
    let start = Instant::now();
    let mut sampler = Sampler::new(SamplingParams::default())?;
    generate_with(model, ids, max_tokens, &[], &mut sampler, compile, |_| {
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

/// `compile` Off measures the eager engine (stack "engine-eager").
pub fn run_leg(
    model: &dyn LanguageModel,
    ids: &[u32],
    max_tokens: usize,
    compile: CompileDecode,
) -> Result<LegResult, Exception> {
    assert!(max_tokens > 0 && !ids.is_empty());
    run_once(model, ids, max_tokens, compile)?; // warm-up, discarded
    mlx_rs::memory::clear_cache()?;
    mlx_rs::memory::reset_peak_memory()?;
    let (ttft, decode, n) = run_once(model, ids, max_tokens, compile)?;
    Ok(LegResult {
        stack: if compile == CompileDecode::Off {
            "engine-eager"
        } else {
            "engine"
        },
        prompt_tokens: ids.len(),
        generated_tokens: n,
        ttft_s: ttft,
        prefill_tps: ids.len() as f64 / ttft,
        decode_tps: decode,
        peak_memory_bytes: mlx_rs::memory::peak_memory()?,
    })
}
