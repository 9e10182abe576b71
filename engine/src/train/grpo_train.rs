//! `engine train --method grpo`: group sampling, rewards and GRPO updates, as trl 1.16.0's
//! `GRPOTrainer` runs them with its defaults (one process, `steps_per_generation` = 1).
//!
//! Each generation: a batch of prompts, `--grpo-group-size` completions of each sampled by
//! the engine's batched decoder (`generate::batch::Batch`: each prompt's group prefilled
//! as one prompt batch, then every row decoded together) with the adapters as they stand,
//! at `--grpo-temperature` (TRL: 1.0, no top-p/top-k), until EOS or
//! `--max-completion-length`. Completions are decoded without special tokens and scored by
//! the reward spec (`reward`); advantages come from `grpo::advantages`. Then
//! `--grpo-iterations` (TRL's μ, `num_iterations`) optimizer steps on that batch: each a
//! forward over prompt + completion, the completion tokens' log-probabilities of
//! logits / temperature (as TRL's `_get_per_token_logps_and_entropies` divides them), and
//! `grpo::grpo_terms` — against the log-probabilities at generation (μ > 1) and, with
//! β ≠ 0, the reference model's (the base model: the adapters taken off for that forward).
//! The completion mask runs through the first EOS, which is learned as TRL learns it.
//! The update runs `micro_batch` rows at a time (default: as many as there are prompts, as
//! mlx-lm-lora's `_grpo_value_and_grad`, so the group size does not multiply its peak),
//! each part cut to its longest row, its vocabulary log-softmax taken only from its
//! shortest prompt's end on (where its completions start), and evaluated before the next,
//! against the whole batch's denominators (`grpo::BatchTotals`); the gradients add up.
//! Validation: one greedy completion per validation prompt, its mean reward.

use std::path::Path;
use std::time::Instant;

use mlx_rs::error::Exception;
use mlx_rs::ops::concatenate;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{Array, Dtype};
use serde_json::{json, Value};

use super::grpo::{
    advantages, grpo_terms, nanmean, nanstd, BatchTotals, GrpoLossConfig, GrpoTerms, RewardScale,
};
use super::lora::Adapters;
use super::optim::AdamW;
use super::reward::{Rewards, Scored};
use super::trainer::{clip_grad_norm, permutation, Metrics, StepReport};
use super::{value_and_grad, TrainError};
use crate::generate::batch::Batch;
use crate::generate::sampler::{Sampler, SamplingParams};
use crate::load::tokenizer::Tokenizer;
use crate::model::LanguageModel;

/// One prompt of a GRPO run: its ids, its text (what reward functions see) and its line.
#[derive(Debug, Clone)]
pub struct GrpoExample {
    pub prompt: Vec<u32>,
    pub text: String,
    pub line: Value,
}

/// A GRPO run's settings (TRL's names and defaults where it has them).
#[derive(Debug, Clone, serde::Serialize)]
pub struct GrpoConfig {
    pub iters: usize,
    /// Prompts per generation.
    pub batch_size: usize,
    /// Completions per prompt (TRL's `num_generations`, 8).
    pub group_size: usize,
    pub max_completion_length: usize,
    pub temperature: f32,
    /// Optimizer steps per generation (TRL's `num_iterations`, μ: 1).
    pub iterations: usize,
    pub scale_rewards: RewardScale,
    pub loss: GrpoLossConfig,
    /// Completions per forward and backward of the update (0: all at once).
    pub micro_batch: usize,
    pub max_grad_norm: Option<f32>,
    pub steps_per_eval: usize,
    pub save_every: usize,
    pub seed: u64,
}

/// Sampled completions of a batch of prompts: `group` rows per prompt, in prompt order.
struct Rollout {
    prompts: Vec<usize>,
    completions: Vec<Vec<u32>>,
}

/// `group` completions of each of `prompts` (indices into `data`), decoded together.
fn rollout(
    model: &dyn LanguageModel,
    data: &[GrpoExample],
    prompts: &[usize],
    group: usize,
    cfg: &GrpoConfig,
    eos: &[u32],
    sampling: SamplingParams,
) -> Result<Rollout, Exception> {
    let mut batch = Batch::new(model);
    let mut first = Vec::with_capacity(prompts.len());
    for &p in prompts {
        let rows: Vec<&[u32]> = vec![&data[p].prompt[..]; group];
        first.push(batch.admit_prompts(&rows, 512)?);
    }
    let mut logits = concatenate(&first[..], 0)?;
    let mut sampler = Sampler::new(sampling)?;
    let n = prompts.len() * group;
    let (mut out, mut done) = (vec![Vec::new(); n], vec![false; n]);
    for _ in 0..cfg.max_completion_length {
        let scores = logits.as_dtype(Dtype::Float32)?;
        let logprobs = scores.subtract(scores.logsumexp_axis(-1, true)?)?;
        let ids = sampler.sample(&logprobs)?.as_dtype(Dtype::Uint32)?;
        ids.eval()?;
        let ids: Vec<u32> = ids.as_slice::<u32>().to_vec();
        for (i, &id) in ids.iter().enumerate() {
            if !done[i] {
                out[i].push(id);
                done[i] = eos.contains(&id);
            }
        }
        if done.iter().all(|&d| d) {
            break;
        }
        logits = batch.step(&ids)?;
    }
    Ok(Rollout {
        prompts: prompts
            .iter()
            .flat_map(|&p| std::iter::repeat_n(p, group))
            .collect(),
        completions: out,
    })
}

/// The rollout as a training batch: ids [N, L] (prompt + completion, zero-padded), and the
/// completion targets' mask [N, L − 1] (f32).
fn sequences(data: &[GrpoExample], r: &Rollout) -> (Array, Array) {
    let rows: Vec<(usize, Vec<u32>)> = r
        .prompts
        .iter()
        .zip(&r.completions)
        .map(|(&p, c)| (data[p].prompt.len(), [&data[p].prompt[..], c].concat()))
        .collect();
    let t = rows.iter().map(|(_, s)| s.len()).max().unwrap_or(2).max(2);
    let (mut ids, mut mask) = (Vec::new(), Vec::new());
    for (p, seq) in &rows {
        ids.extend(seq.iter().map(|&x| x as i32));
        ids.extend(std::iter::repeat_n(0, t - seq.len()));
        // Target step s (1-based) is token s of the row.
        mask.extend((1..t).map(|s| f32::from(u8::from(s >= *p && s < seq.len()))));
    }
    let n = rows.len() as i32;
    (
        Array::from_slice(&ids, &[n, t as i32]),
        Array::from_slice(&mask, &[n, t as i32 - 1]),
    )
}

/// Per-token log-probabilities [N, L − 1 − from] (f32) of `ids`' next tokens under
/// `model`, of logits / temperature, for the target steps from `from` on. The first
/// Q = min(`shared`, `from`) tokens, which every row has in common (`shared`: the rows'
/// common prompt), run once (`orpo_prefix::continuation_logits`: the rows attend to that
/// prefix's K/V, its gradient flows back through them); the head and the log-softmax are
/// applied only where they are read (the logits of steps after Q and before `from` are
/// computed, as the causal context needs them, but not normalized).
fn token_logps(
    model: &dyn LanguageModel,
    ids: &Array,
    temperature: f32,
    from: i32,
    shared: i32,
) -> Result<Array, Exception> {
    let t = ids.shape()[1];
    let q = if ids.shape()[0] > 1 {
        shared.min(from).max(0)
    } else {
        0
    };
    let logits = match q {
        0 => model.forward(
            &ids.index((.., ..t - 1)),
            &mut crate::cache::none::none_for(&model.make_caches()),
        )?,
        _ => super::orpo_prefix::continuation_logits(
            model,
            &ids.index((..1, ..q)),
            &ids.index((.., q..t - 1)),
        )?,
    };
    let logits = if from > q {
        logits.index((.., from - q..))
    } else {
        logits
    };
    let logits = if temperature == 1.0 {
        logits
    } else {
        logits.divide(crate::scalar::weak(temperature as f64, &logits)?)?
    };
    super::loss::cross_entropy(&logits, &ids.index((.., 1 + from..)))?
        .as_dtype(Dtype::Float32)?
        .negative()
}

/// How many leading tokens `prompts` all share.
fn shared_len(prompts: &[Vec<u32>]) -> i32 {
    let Some(first) = prompts.first() else {
        return 0;
    };
    prompts
        .iter()
        .map(|p| p.iter().zip(first).take_while(|(a, b)| a == b).count())
        .min()
        .unwrap_or(0) as i32
}

/// Every completion's reward by every function, and the texts' token counts.
fn score(
    tokenizer: &Tokenizer,
    data: &[GrpoExample],
    r: &Rollout,
    rewards: &Rewards,
    eos: &[u32],
) -> Result<Vec<Vec<Option<f64>>>, TrainError> {
    let texts: Vec<String> = r
        .completions
        .iter()
        .map(|c| {
            let body: Vec<u32> = c.iter().copied().filter(|t| !eos.contains(t)).collect();
            tokenizer.decode(&body)
        })
        .collect::<Result<_, _>>()?;
    let items: Vec<Scored> = r
        .prompts
        .iter()
        .zip(&texts)
        .zip(&r.completions)
        .map(|((&p, text), ids)| Scored {
            prompt: &data[p].text,
            completion: text,
            completion_tokens: ids.len(),
            example: &data[p].line,
        })
        .collect();
    rewards.score(&items).map_err(TrainError::Config)
}

/// The mean reward of one greedy completion per validation prompt.
fn evaluate(
    model: &dyn LanguageModel,
    tokenizer: &Tokenizer,
    valid: &[GrpoExample],
    rewards: &Rewards,
    cfg: &GrpoConfig,
) -> Result<f64, TrainError> {
    let eos = &tokenizer.eos_token_ids;
    let all: Vec<usize> = (0..valid.len()).collect();
    let mut got = Vec::new();
    for chunk in all.chunks(cfg.batch_size.max(1) * cfg.group_size.max(1)) {
        let r = rollout(model, valid, chunk, 1, cfg, eos, SamplingParams::default())?;
        let per_func = score(tokenizer, valid, &r, rewards, eos)?;
        let (scored, _) = advantages(&per_func, &rewards.weights, 1, RewardScale::None);
        got.extend(scored.into_iter().flatten());
    }
    Ok(nanmean(&got))
}

fn scalar(a: &Array) -> Result<f64, Exception> {
    let a = a.as_dtype(Dtype::Float32)?;
    a.eval()?;
    Ok(a.as_slice::<f32>()[0] as f64)
}

/// What one generation gives the steps that use it.
pub struct Generation {
    ids: Array,
    mask: Array,
    advantages: Array,
    old: Option<Array>,
    reference: Option<Array>,
    line: Value,
    /// Each row's prompt + completion length.
    lens: Vec<usize>,
    /// Each row's prompt.
    prompts: Vec<Vec<u32>>,
    /// Completion tokens of all rows (Σ mask).
    completion_total: usize,
    /// Prompt and completion tokens (the padded batch's size).
    pub tokens: usize,
}

impl Generation {
    /// The completions' mean length in tokens.
    pub fn completion_tokens(&self) -> f64 {
        self.line["completion_length"].as_f64().unwrap_or(f64::NAN)
    }

    /// Each row's prompt + completion length.
    pub fn row_lengths(&self) -> &[usize] {
        &self.lens
    }
}

/// Samples, scores and prepares one generation of `prompts` (indices into `data`).
#[allow(clippy::too_many_arguments)]
pub fn generation(
    model: &dyn LanguageModel,
    adapters: &Adapters,
    tokenizer: &Tokenizer,
    data: &[GrpoExample],
    prompts: &[usize],
    rewards: &Rewards,
    cfg: &GrpoConfig,
    step: usize,
) -> Result<Generation, TrainError> {
    let eos = &tokenizer.eos_token_ids;
    let sampling = SamplingParams {
        temp: cfg.temperature as f64,
        seed: cfg.seed.wrapping_mul(1_000_003).wrapping_add(step as u64),
        ..SamplingParams::default()
    };
    let r = rollout(model, data, prompts, cfg.group_size, cfg, eos, sampling)?;
    let per_func = score(tokenizer, data, &r, rewards, eos)?;
    let (scored, adv) = advantages(
        &per_func,
        &rewards.weights,
        cfg.group_size,
        cfg.scale_rewards,
    );
    let (ids, mask) = sequences(data, &r);
    let lens: Vec<usize> = (r.prompts.iter().zip(&r.completions))
        .map(|(&p, c)| data[p].prompt.len() + c.len())
        .collect();
    let old = if cfg.iterations > 1 {
        let lp = token_logps(model, &ids, cfg.temperature, 0, 0)?;
        lp.eval()?;
        Some(lp)
    } else {
        None
    };
    let reference = if cfg.loss.beta != 0.0 {
        let lp = adapters.without(|| token_logps(model, &ids, cfg.temperature, 0, 0))?;
        lp.eval()?;
        Some(lp)
    } else {
        None
    };
    let lengths: Vec<f64> = r.completions.iter().map(|c| c.len() as f64).collect();
    let got: Vec<f64> = scored.iter().flatten().copied().collect();
    let line = json!({
        "reward": nanmean(&got),
        "reward_std": nanstd(&got),
        "completion_length": nanmean(&lengths),
        "unscored": scored.iter().filter(|x| x.is_none()).count(),
    });
    Ok(Generation {
        tokens: ids.size(),
        ids,
        mask,
        advantages: Array::from_slice(&adv, &[adv.len() as i32]),
        old,
        reference,
        line,
        lens,
        prompts: r.prompts.iter().map(|&p| data[p].prompt.clone()).collect(),
        completion_total: r.completions.iter().map(Vec::len).sum(),
    })
}

/// The GRPO terms ([loss, kl, clip_ratio]) and the adapters' gradients on generation `g`,
/// `part` rows at a time (0 or ≥ the rows: all at once). Each part is cut to its longest
/// row (the padding after it is masked, and causal attention keeps it from the tokens
/// before), its log-softmax is taken from its shortest prompt's end on (no earlier step is
/// scored), and it is evaluated, with the sums so far, before the next part starts.
pub fn terms_and_grads(
    model: &dyn LanguageModel,
    adapters: &Adapters,
    g: &Generation,
    cfg: &GrpoConfig,
    part: usize,
) -> Result<(Vec<Array>, Vec<Array>), Exception> {
    let n = g.lens.len();
    let part = if part == 0 { n } else { part.min(n) };
    let totals = (part < n).then_some(BatchTotals {
        tokens: g.completion_total as f32,
        rows: n as f32,
    });
    let mut sums: Option<(Vec<Array>, Vec<Array>)> = None;
    for start in (0..n).step_by(part.max(1)) {
        let end = (start + part).min(n);
        let rows = start as i32..end as i32;
        let width = g.lens[start..end].iter().copied().max().unwrap_or(2).max(2) as i32;
        // Target step s predicts token s + 1; the first completion token is predicted at
        // step prompt_len − 1, so no step before the shortest prompt's end is scored.
        let prompts = &g.prompts[start..end];
        let from = prompts.iter().map(Vec::len).min().unwrap_or(1).max(1) as i32 - 1;
        let ids = g.ids.index((rows.clone(), ..width));
        let cut = |a: &Array| a.index((rows.clone(), from..width - 1));
        let mask = cut(&g.mask);
        let (old, reference) = (g.old.as_ref().map(cut), g.reference.as_ref().map(cut));
        let adv = g.advantages.index(rows.clone());
        let (outputs, grads) = value_and_grad(adapters, || {
            let lp = token_logps(model, &ids, cfg.temperature, from, shared_len(prompts))?;
            grpo_terms(
                &lp,
                old.as_ref(),
                reference.as_ref(),
                &mask,
                &adv,
                &cfg.loss,
                totals,
            )
            .map(GrpoTerms::into_vec)
        })?;
        let add = |a: Vec<Array>, b: Vec<Array>| -> Result<Vec<Array>, Exception> {
            a.iter().zip(&b).map(|(x, y)| x.add(y)).collect()
        };
        let next = match sums.take() {
            None => (outputs, grads),
            Some((o, gr)) => (add(o, outputs)?, add(gr, grads)?),
        };
        mlx_rs::transforms::eval(next.0.iter().chain(&next.1))?;
        sums = Some(next);
    }
    Ok(sums.expect("at least one row"))
}

/// One optimizer step on generation `g`, `micro_batch` rows at a time: the GRPO terms
/// ([loss, kl, clip_ratio]) and the gradient norm, evaluated with the update.
pub fn update(
    model: &dyn LanguageModel,
    adapters: &Adapters,
    opt: &mut AdamW,
    g: &Generation,
    cfg: &GrpoConfig,
) -> Result<(Vec<Array>, Array), Exception> {
    let (outputs, grads) = terms_and_grads(model, adapters, g, cfg, cfg.micro_batch)?;
    let (grads, norm) = clip_grad_norm(grads, cfg.max_grad_norm)?;
    super::apply_update(opt, adapters, &grads, &[&outputs[0], &norm])?;
    Ok((outputs, norm))
}

/// Trains `adapters` by GRPO on `train`'s prompts, validating on `valid`'s, writing
/// `metrics` and saving the adapters to `out` every `save_every` steps and at the end.
#[allow(clippy::too_many_arguments)]
pub fn train_grpo(
    model: &dyn LanguageModel,
    tokenizer: &Tokenizer,
    adapters: &Adapters,
    opt: &mut AdamW,
    train: &[GrpoExample],
    valid: Option<&[GrpoExample]>,
    rewards: &Rewards,
    cfg: &GrpoConfig,
    metrics: &mut Metrics,
    out: &Path,
    mut on_step: impl FnMut(&StepReport, Option<&[(&'static str, f64)]>),
) -> Result<(), TrainError> {
    if train.len() < cfg.batch_size {
        return Err(TrainError::Config(format!(
            "the training set has {} prompts, fewer than --batch-size {}",
            train.len(),
            cfg.batch_size
        )));
    }
    let mut rng = cfg.seed ^ 0x9E37_79B9_7F4A_7C15;
    let mut order: Vec<usize> = Vec::new();
    let mut current: Option<Generation> = None;
    crate::runtime::reset_peak_memory().map_err(|e| TrainError::Config(e.to_string()))?;
    for step in 1..=cfg.iters {
        let eval_now = step == 1 || step % cfg.steps_per_eval.max(1) == 0 || step == cfg.iters;
        if let (Some(v), true) = (valid, eval_now) {
            let reward = evaluate(model, tokenizer, v, rewards, cfg)?;
            metrics.write(json!({"type": "eval", "step": step, "val_reward": reward}))?;
            on_step(&StepReport::at_eval(step), Some(&[("val_reward", reward)]));
        }
        let tic = Instant::now();
        if (step - 1) % cfg.iterations.max(1) == 0 {
            let mut prompts = Vec::with_capacity(cfg.batch_size);
            while prompts.len() < cfg.batch_size {
                if order.is_empty() {
                    order = permutation(train.len(), &mut rng);
                }
                prompts.push(order.pop().expect("non-empty"));
            }
            current = Some(generation(
                model, adapters, tokenizer, train, &prompts, rewards, cfg, step,
            )?);
        }
        let g = current.as_ref().expect("generated");
        let lr = opt.learning_rate()? as f64;
        let (outputs, norm) = update(model, adapters, opt, g, cfg)?;
        let report = StepReport {
            step,
            loss: scalar(&outputs[0])?,
            grad_norm: scalar(&norm)?,
            lr,
            tokens_per_s: g.tokens as f64 / tic.elapsed().as_secs_f64().max(1e-9),
            note: None,
        };
        let peak = crate::runtime::memory().map_or(0, |m| m.peak);
        let mut line = json!({
            "type": "train", "step": step, "loss": report.loss, "grad_norm": report.grad_norm,
            "lr": lr, "tokens_per_s": report.tokens_per_s, "peak_memory_mb": peak as f64 / 1e6,
            "kl": scalar(&outputs[1])?, "clip_ratio": scalar(&outputs[2])?,
        });
        for (k, v) in g.line.as_object().expect("an object") {
            line[k.as_str()] = v.clone();
        }
        metrics.write(line)?;
        on_step(&report, None);
        if cfg.save_every > 0 && step % cfg.save_every == 0 {
            adapters.save(out)?;
        }
    }
    adapters.save(out)
}
