//! The constrain suite's leg: one plain or constrained generation in a fresh process.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use engine::constrain::{env_for, Constraint, Grammar};
use engine::generate::sampler::{Sampler, SamplingParams};
use engine::generate::{Flow, Session};
use engine::load::tokenizer::Tokenizer;

use super::{schema, ConstrainLeg, PLAIN, SCHEMA};

/// `harness leg-constrain`: one leg in this fresh process.
#[derive(clap::Args)]
pub struct LegArgs {
    #[arg(long)]
    model: PathBuf,
    #[arg(long)]
    prompt_ids: PathBuf,
    #[arg(long)]
    max_tokens: usize,
    /// Constrain the answer to `schema()`.
    #[arg(long)]
    constrained: bool,
}

pub fn leg(args: LegArgs) -> Result<()> {
    let ids: Vec<u32> = serde_json::from_str(&std::fs::read_to_string(&args.prompt_ids)?)?;
    anyhow::ensure!(
        !ids.is_empty() && args.max_tokens > 0,
        "empty prompt or --max-tokens 0"
    );
    let leg = measure(&args.model, &ids, args.max_tokens, args.constrained)?;
    println!("{}", serde_json::to_string(&leg)?);
    Ok(())
}

/// One generation: the ids and the instant each arrived, and whether it ended at EOS.
struct Run {
    out: Vec<u32>,
    times: Vec<Instant>,
    start: Instant,
    eos: bool,
    dtype: mlx_rs::Dtype,
}

fn generate(
    model: &dyn engine::model::LanguageModel,
    ids: &[u32],
    max_tokens: usize,
    eos: &[u32],
    mut sampler: Sampler,
) -> Result<Run> {
    let mut run = Run {
        out: Vec::new(),
        times: Vec::new(),
        start: Instant::now(),
        eos: false,
        dtype: mlx_rs::Dtype::Float32,
    };
    let (_, finish) = engine::generate::generate_in(
        &mut Session::new(model),
        ids,
        0,
        max_tokens,
        eos,
        &mut sampler,
        |id, logprobs| {
            run.times.push(Instant::now());
            run.out.push(id);
            run.dtype = logprobs.dtype();
            Ok(Flow::Continue)
        },
    )?;
    run.eos = finish == engine::generate::Finish::Eos;
    Ok(run)
}

fn measure(dir: &Path, ids: &[u32], max_tokens: usize, constrained: bool) -> Result<ConstrainLeg> {
    let model = engine::model::load(dir)?;
    let tokenizer = Arc::new(Tokenizer::load(dir)?);
    let greedy = || Sampler::new(SamplingParams::default());
    let grammar = Grammar::JsonSchema(schema());
    let (mut env_ms, mut compile_ms, mut mask_us, mut bias_us) = (None, None, None, None);
    let run = if constrained {
        let t = Instant::now();
        let env = env_for(&tokenizer).map_err(anyhow::Error::msg)?;
        env_ms = Some(t.elapsed().as_secs_f64() * 1e3);
        let make = || Constraint::new(&env, &grammar).map_err(anyhow::Error::msg);
        let t = Instant::now();
        let first = make()?;
        compile_ms = Some(t.elapsed().as_secs_f64() * 1e3);
        let eos = &tokenizer.eos_token_ids;
        generate(
            model.as_ref(),
            ids,
            max_tokens,
            eos,
            greedy()?.constrained(first),
        )?; // warm-up
        let run = generate(
            model.as_ref(),
            ids,
            max_tokens,
            eos,
            greedy()?.constrained(make()?),
        )?;
        check_answer(&tokenizer.decode(&run.out)?, run.eos).map_err(anyhow::Error::msg)?;
        let vocab = engine::model::LanguageModel::vocab_size(model.as_ref());
        mask_us = Some(replay_mask(make()?, ids, &run, vocab)?);
        bias_us = Some(replay_bias(run.out.len(), vocab, run.dtype)?);
        run
    } else {
        generate(model.as_ref(), ids, max_tokens, &[], greedy()?)?; // warm-up
        generate(model.as_ref(), ids, max_tokens, &[], greedy()?)?
    };
    let (ttft, after_first, span) = engine::generate::bench::token_timing(run.start, &run.times);
    Ok(ConstrainLeg {
        stack: if constrained { SCHEMA } else { PLAIN }.into(),
        prompt_tokens: ids.len(),
        generated_tokens: run.out.len(),
        ttft_s: ttft,
        decode_tps: engine::generate::bench::decode_rate(after_first, span),
        complete: run.eos,
        env_build_ms: env_ms,
        compile_ms,
        mask_us_per_token: mask_us,
        bias_us_per_token: bias_us,
    })
}

/// The mask alone, µs per token: `run`'s ids replayed through `constraint` over logits of
/// the model's width and dtype, each step's masked logits evaluated.
fn replay_mask(mut constraint: Constraint, ids: &[u32], run: &Run, vocab: usize) -> Result<f64> {
    let logits = mlx_rs::ops::zeros::<f32>(&[1, vocab as i32])?.as_dtype(run.dtype)?;
    logits.eval()?;
    let mut history = ids.to_vec();
    history.extend(&run.out);
    let t = Instant::now();
    for i in 0..run.out.len() {
        constraint
            .apply(&logits, &history[..ids.len() + i])?
            .eval()?;
    }
    Ok(t.elapsed().as_secs_f64() * 1e6 / run.out.len().max(1) as f64)
}

/// The array side of the mask alone, µs per token: a −∞/0 bias over the whole vocabulary
/// built on the host, made an array of the logits' dtype, added and evaluated — what
/// `Constraint::apply` does after llguidance's mask, so mask − bias is llguidance's share.
fn replay_bias(steps: usize, vocab: usize, dtype: mlx_rs::Dtype) -> Result<f64> {
    let logits = mlx_rs::ops::zeros::<f32>(&[1, vocab as i32])?.as_dtype(dtype)?;
    logits.eval()?;
    let t = Instant::now();
    for step in 0..steps {
        let mut bias = vec![f32::NEG_INFINITY; vocab];
        // Some allowed ids, as a mask has (which ones does not change the cost).
        for b in bias.iter_mut().skip(step % 7).step_by(7) {
            *b = 0.0;
        }
        let bias = mlx_rs::Array::from_slice(&bias, &[1, vocab as i32]).as_dtype(dtype)?;
        logits.add(&bias)?.eval()?;
    }
    Ok(t.elapsed().as_secs_f64() * 1e6 / steps.max(1) as f64)
}

/// A constrained answer must be JSON: an object's opening at least, and the whole object
/// when the grammar closed it (else the mask was not applied).
pub fn check_answer(text: &str, complete: bool) -> Result<(), String> {
    if !text.starts_with('{') {
        return Err(format!(
            "the constrained answer does not open a JSON object (was the mask applied?): {:?}",
            text.chars().take(60).collect::<String>()
        ));
    }
    if complete {
        match serde_json::from_str::<serde_json::Value>(text) {
            Ok(v) if v.is_object() => {}
            _ => {
                return Err(format!(
                    "the complete constrained answer is not a JSON object: {text:?}"
                ))
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_that_is_not_json_fails_the_leg() {
        assert!(check_answer(r#"{"name": "ab"#, false).is_ok());
        assert!(check_answer(r#"{"name": "abc"}"#, true).is_ok());
        // What decoding without the mask gives: not JSON at all, or an unclosed object.
        assert!(check_answer("the user is", false).is_err());
        assert!(check_answer(r#"{"name": "ab"#, true).is_err());
    }

    /// Why `tiny` is not one of the suite's models: llguidance cannot build a view of its
    /// word-level tokenizer at all (no decoder in tokenizer.json, so it cannot tell how ids
    /// map to bytes); and no id of it would spell `{` anyway.
    #[test]
    fn the_tiny_word_level_tokenizer_has_no_llguidance_view() {
        let bench = crate::bench::models::TINY;
        let dir = tempfile::tempdir().unwrap();
        bench.ensure_tokenizer(dir.path()).unwrap();
        let tokenizer = Arc::new(Tokenizer::load(dir.path()).unwrap());
        let err = env_for(&tokenizer).map(|_| ()).unwrap_err();
        assert!(err.contains("decoder"), "{err}");
        assert!(super::super::model_dir("tiny").is_err());
    }
}
