//! The training loop behind `engine train`: batches (sorted by length, shuffled with a
//! seeded permutation each pass), LoRA gradients by MLX autodiff, gradient accumulation,
//! global-norm clipping, AdamW on a warm-up + cosine schedule, validation every N steps,
//! `metrics.jsonl` (a meta line, then one line per step and per eval), adapters saved every
//! N steps and at the end.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use mlx_rs::error::Exception;
use mlx_rs::ops::minimum;
use mlx_rs::Array;
use serde_json::{json, Value};

use super::data::{Example, Pair};
use super::lora::Adapters;
use super::optim::AdamW;
use super::orpo::OrpoTerms;
use super::{value_and_grad, TrainError};
use crate::model::LanguageModel;

pub use super::setup::{
    batches, permutation, sft_batch, Dataset, LossFromLogits, Method, TrainConfig,
};

/// One batch as model inputs (ids without their last position) and its loss function.
pub fn batch_loss(data: &Dataset, batch: &[usize], cfg: &TrainConfig) -> (Array, LossFromLogits) {
    use mlx_rs::ops::indexing::IndexOp;
    match data {
        Dataset::Sft(v) => {
            let ex: Vec<&Example> = batch.iter().map(|&i| &v[i]).collect();
            let (ids, lengths) = sft_batch(&ex, cfg.max_seq_length);
            let t = ids.shape()[1];
            let inputs = ids.index((.., ..t - 1));
            let loss = move |logits: &Array| {
                let (l, n) = super::loss::sft_loss(logits, &ids, &lengths)?;
                Ok(vec![l, n])
            };
            (inputs, Box::new(loss))
        }
        Dataset::Orpo(v) => {
            let pairs: Vec<&Pair> = batch.iter().map(|&i| &v[i]).collect();
            let (ids, pm, rm) = super::orpo::pair_batch(&pairs);
            let t = ids.shape()[1];
            let inputs = ids.index((.., ..t - 1));
            let (lambda, scope) = (cfg.orpo_lambda, cfg.sft_scope);
            let loss = move |logits: &Array| {
                Ok(
                    super::orpo::orpo_from_logits(logits, &ids, &pm, &rm, lambda, scope)?
                        .into_vec(),
                )
            };
            (inputs, Box::new(loss))
        }
        Dataset::Pairs(set) => super::preference_data::batch_loss(set, batch, &cfg.method),
    }
}

/// The loss outputs of one batch (no gradients).
fn batch_outputs(
    model: &dyn LanguageModel,
    data: &Dataset,
    batch: &[usize],
    cfg: &TrainConfig,
) -> Result<Vec<Array>, Exception> {
    if let Some(chunk) = cfg.loss_chunk {
        return super::chunked::batch_outputs(model, data, batch, cfg, chunk);
    }
    if let Some(out) = prefix_shared_outputs(model, data, batch, cfg) {
        return out;
    }
    let (inputs, mut loss) = batch_loss(data, batch, cfg);
    loss(&forward_uncached(model, &inputs)?)
}

/// Whether `data`'s batches run the prefix-shared ORPO forward.
fn takes_prefix_shared(data: &Dataset, cfg: &TrainConfig) -> bool {
    matches!(data, Dataset::Orpo(_) | Dataset::Pairs(_))
        && cfg.orpo_forward == super::orpo_prefix::OrpoForward::PrefixShared
        && cfg.segment_size.is_none()
        && cfg.loss_chunk.is_none()
}

/// An ORPO batch's loss outputs by the prefix-shared forward, where `cfg` asks for it and
/// the run is not segmented (None: the batch goes through `batch_loss`).
fn prefix_shared_outputs(
    model: &dyn LanguageModel,
    data: &Dataset,
    batch: &[usize],
    cfg: &TrainConfig,
) -> Option<Result<Vec<Array>, Exception>> {
    use super::orpo_prefix::{orpo_loss_by, OrpoForward};
    if !takes_prefix_shared(data, cfg) {
        return None;
    }
    if let Dataset::Pairs(set) = data {
        let out = super::preference_data::prefix_shared_outputs(model, set, batch, &cfg.method);
        return Some(out);
    }
    let Dataset::Orpo(v) = data else {
        return None;
    };
    let pairs: Vec<&Pair> = batch.iter().map(|&i| &v[i]).collect();
    let terms = orpo_loss_by(
        model,
        &pairs,
        cfg.orpo_lambda,
        cfg.sft_scope,
        OrpoForward::PrefixShared,
    );
    Some(terms.map(OrpoTerms::into_vec))
}

/// The forward training runs: every layer attends over the inputs alone, no cache.
fn forward_uncached(model: &dyn LanguageModel, inputs: &Array) -> Result<Array, Exception> {
    model.forward(
        inputs,
        &mut crate::cache::none::none_for(&model.make_caches()),
    )
}

/// The loss outputs and the adapters' gradients of one batch: one value-and-grad over the
/// whole model, or segment by segment with `cfg.segment_size`.
pub fn batch_grads(
    model: &dyn LanguageModel,
    adapters: &Adapters,
    data: &Dataset,
    batch: &[usize],
    cfg: &TrainConfig,
    phases: &mut dyn super::segmented::Phases,
) -> Result<(Vec<Array>, Vec<Array>), Exception> {
    if let Some(chunk) = cfg.loss_chunk {
        return super::chunked::batch_grads(model, adapters, data, batch, cfg, chunk, phases);
    }
    if takes_prefix_shared(data, cfg) {
        let (out, grads) = value_and_grad(adapters, || {
            prefix_shared_outputs(model, data, batch, cfg).expect("a pair batch")
        })?;
        mlx_rs::transforms::eval(out.iter().chain(grads.iter()))?;
        phases.phase("forward+backward");
        return Ok((out, grads));
    }
    let (inputs, mut loss) = batch_loss(data, batch, cfg);
    match (cfg.segment_size, super::segmented::layered(model)) {
        (Some(size), Some(layered)) => super::segmented::segmented_value_and_grad(
            layered, adapters, &inputs, size, &mut loss, phases,
        ),
        (Some(_), None) => Err(Exception::custom(super::segmented::refusal(
            model.model_type(),
        ))),
        (None, _) => {
            let (out, grads) =
                value_and_grad(adapters, || loss(&forward_uncached(model, &inputs)?))?;
            mlx_rs::transforms::eval(out.iter().chain(grads.iter()))?;
            phases.phase("forward+backward");
            Ok((out, grads))
        }
    }
}

/// mlx.optimizers' `clip_grad_norm`: the global norm, and the gradients scaled to at most
/// `max_norm` (unchanged without one).
pub fn clip_grad_norm(
    grads: Vec<Array>,
    max_norm: Option<f32>,
) -> Result<(Vec<Array>, Array), Exception> {
    let mut sq = Array::from_f32(0.0);
    for g in &grads {
        sq = sq.add(g.square()?.sum(None)?)?;
    }
    let norm = sq.sqrt()?;
    let Some(max) = max_norm else {
        return Ok((grads, norm));
    };
    let scale = minimum(
        Array::from_f32(max).divide(norm.add(Array::from_f32(1e-6))?)?,
        Array::from_f32(1.0),
    )?;
    let clipped = grads
        .iter()
        .map(|g| g.multiply(&scale))
        .collect::<Result<_, _>>()?;
    Ok((clipped, norm))
}

fn scalar(a: &Array) -> Result<f64, Exception> {
    let a = a.as_dtype(mlx_rs::Dtype::Float32)?;
    a.eval()?;
    Ok(a.as_slice::<f32>()[0] as f64)
}

/// Appends JSON lines to `metrics.jsonl`, flushed each time.
pub struct Metrics {
    file: std::fs::File,
    path: PathBuf,
}

impl Metrics {
    pub fn create(path: &Path, meta: Value) -> Result<Self, TrainError> {
        let file =
            std::fs::File::create(path).map_err(|e| TrainError::Io(path.to_path_buf(), e))?;
        let mut m = Metrics {
            file,
            path: path.to_path_buf(),
        };
        m.write(json!({"type": "meta", "meta": meta}))?;
        Ok(m)
    }

    pub fn write(&mut self, line: Value) -> Result<(), TrainError> {
        writeln!(self.file, "{line}")
            .and_then(|_| self.file.flush())
            .map_err(|e| TrainError::Io(self.path.clone(), e))
    }
}

/// What an eval measured: SFT `val_loss`; ORPO every `OrpoTerms` name, averaged.
pub fn evaluate(
    model: &dyn LanguageModel,
    data: &Dataset,
    cfg: &TrainConfig,
) -> Result<Vec<(&'static str, f64)>, Exception> {
    let all = batches(data, cfg.batch_size.min(data.len()).max(1));
    let take = if cfg.val_batches == 0 {
        all.len()
    } else {
        cfg.val_batches.min(all.len())
    };
    let names = super::preference_data::names(&cfg.method).unwrap_or_default();
    let mut sums = [0.0f64; 8];
    let mut weight = 0.0;
    let mut lw_rows: Vec<f64> = Vec::new();
    for b in &all[..take] {
        let out = batch_outputs(model, data, b, cfg)?;
        let rows_at = match data {
            Dataset::Pairs(_) => names.len(),
            _ => OrpoTerms::NAMES.len(),
        };
        if let (Dataset::Orpo(_) | Dataset::Pairs(_), Some(rows)) = (data, out.get(rows_at)) {
            let rows = rows.as_dtype(mlx_rs::Dtype::Float32)?;
            rows.eval()?;
            lw_rows.extend(rows.as_slice::<f32>().iter().map(|&x| x as f64));
        }
        match data {
            Dataset::Sft(_) => {
                let n = scalar(&out[1])?;
                sums[0] += scalar(&out[0])? * n;
                weight += n;
            }
            Dataset::Orpo(_) | Dataset::Pairs(_) => {
                for (s, o) in sums.iter_mut().zip(&out[..rows_at]) {
                    *s += scalar(o)? * b.len() as f64;
                }
                weight += b.len() as f64;
            }
        }
    }
    Ok(match data {
        Dataset::Sft(_) => vec![("val_loss", sums[0] / weight)],
        Dataset::Orpo(_) => OrpoTerms::NAMES
            .iter()
            .zip(sums)
            .map(|(&n, s)| (n, s / weight))
            .chain([("lw_se", super::lambda::standard_error(&lw_rows))])
            .collect(),
        Dataset::Pairs(_) => {
            let mut m: EvalMetrics = names
                .iter()
                .zip(sums)
                .map(|(&n, s)| (n, s / weight))
                .collect();
            // The controller's signals under ORPO's names: the chosen and rejected scores
            // (SimPO's means, DPO's and CPO's sums) and the noise of the chosen one.
            let get = |k: &str| {
                m.iter()
                    .find(|(n, _)| *n == k)
                    .map_or(f64::NAN, |(_, v)| *v)
            };
            let (lw, lr) = (get("logps/chosen"), get("logps/rejected"));
            m.extend([
                ("lw", lw),
                ("lr", lr),
                ("lw_se", super::lambda::standard_error(&lw_rows)),
            ]);
            m
        }
    })
}

/// One step's report.
pub struct StepReport {
    pub step: usize,
    pub loss: f64,
    pub grad_norm: f64,
    pub lr: f64,
    pub tokens_per_s: f64,
    /// At an eval: the dynamic-λ controller's change, as its console line.
    pub note: Option<String>,
}

impl StepReport {
    /// What `on_step` sees with an eval's results: the step, no training numbers.
    pub(super) fn at_eval(step: usize) -> Self {
        StepReport {
            step,
            loss: f64::NAN,
            grad_norm: f64::NAN,
            lr: f64::NAN,
            tokens_per_s: 0.0,
            note: None,
        }
    }
}

/// Trains `adapters` on `train` (validating on `valid`), writing `metrics` and saving the
/// adapters to `out` every `save_every` steps and at the end; `on_step` sees each step.
/// Every step eager (`train_with` takes another step, e.g. `compiled::Steps`).
#[allow(clippy::too_many_arguments)]
pub fn train(
    model: &dyn LanguageModel,
    adapters: &Adapters,
    opt: &mut AdamW,
    train: &Dataset,
    valid: Option<&Dataset>,
    cfg: &TrainConfig,
    metrics: &mut Metrics,
    out: &Path,
    on_step: impl FnMut(&StepReport, Option<&[(&'static str, f64)]>),
) -> Result<(), TrainError> {
    train_with(
        model, adapters, opt, train, valid, cfg, metrics, out, &mut Eager, on_step,
    )
}

/// Where each step's loss outputs and gradients come from: `batch_grads` (`Eager`), or a
/// compiled graph (`compiled::Steps`, `--compile-step`). `tic` times the step: a source
/// that does untimed work first (a probe) restarts it.
pub trait StepGrads {
    #[allow(clippy::too_many_arguments)]
    fn grads(
        &mut self,
        model: &dyn LanguageModel,
        adapters: &Adapters,
        data: &Dataset,
        batch: &[usize],
        cfg: &TrainConfig,
        metrics: &mut Metrics,
        tic: &mut Instant,
    ) -> Result<(Vec<Array>, Vec<Array>), TrainError>;
}

/// Every step by `batch_grads`.
pub struct Eager;

impl StepGrads for Eager {
    fn grads(
        &mut self,
        model: &dyn LanguageModel,
        adapters: &Adapters,
        data: &Dataset,
        batch: &[usize],
        cfg: &TrainConfig,
        _metrics: &mut Metrics,
        _tic: &mut Instant,
    ) -> Result<(Vec<Array>, Vec<Array>), TrainError> {
        Ok(batch_grads(model, adapters, data, batch, cfg, &mut ())?)
    }
}

/// `train` with each step's gradients from `steps`.
#[allow(clippy::too_many_arguments)]
pub fn train_with(
    model: &dyn LanguageModel,
    adapters: &Adapters,
    opt: &mut AdamW,
    train: &Dataset,
    valid: Option<&Dataset>,
    cfg: &TrainConfig,
    metrics: &mut Metrics,
    out: &Path,
    steps: &mut dyn StepGrads,
    mut on_step: impl FnMut(&StepReport, Option<&[(&'static str, f64)]>),
) -> Result<(), TrainError> {
    if train.len() < cfg.batch_size {
        return Err(TrainError::Config(format!(
            "the training set has {} examples, fewer than --batch-size {}",
            train.len(),
            cfg.batch_size
        )));
    }
    let mut controller = cfg
        .lambda_controller
        .clone()
        .filter(|_| cfg.weight().is_some())
        .map(super::lambda::Controller::new);
    if controller.is_some() && valid.is_none() {
        return Err(TrainError::Config(super::lambda::needs_validation(
            "the data directory",
        )));
    }
    // The configuration this run uses, its weight updated as the controller moves it.
    let mut run_cfg = cfg.clone();
    if let Some(c) = &controller {
        run_cfg.set_weight(c.lambda);
    }
    let cfg = &mut run_cfg;
    let all = batches(train, cfg.batch_size);
    let mut rng = cfg.seed ^ 0x9E37_79B9_7F4A_7C15;
    let mut order: Vec<usize> = Vec::new();
    let mut accum: Option<Vec<Array>> = None;
    let accum_steps = cfg.grad_accumulation.max(1);
    crate::runtime::reset_peak_memory().map_err(|e| TrainError::Config(e.to_string()))?;
    let mut tic = Instant::now();
    for step in 1..=cfg.iters {
        let eval_now = step == 1 || step % cfg.steps_per_eval.max(1) == 0 || step == cfg.iters;
        if let (Some(v), true) = (valid, eval_now) {
            let (m, note) = evaluate_and_steer(model, v, cfg, controller.as_mut(), metrics, step)?;
            let mut report = StepReport::at_eval(step);
            report.note = note;
            on_step(&report, Some(&m));
            tic = Instant::now();
        }
        if order.is_empty() {
            order = permutation(all.len(), &mut rng);
        }
        let batch = &all[order.pop().expect("non-empty")];
        adapters.seed_dropout(cfg.seed, step as u64)?;
        let (outputs, grads) =
            steps.grads(model, adapters, train, batch, cfg, metrics, &mut tic)?;
        let grads = add_grads(accum.take(), grads)?;
        let tokens: usize = batch.iter().map(|&i| train.item_len(i)).sum();
        if step % accum_steps != 0 {
            mlx_rs::transforms::eval(grads.iter())?;
            accum = Some(grads);
            continue;
        }
        let grads = mean_grads(grads, accum_steps)?;
        let (grads, norm) = clip_grad_norm(grads, cfg.max_grad_norm)?;
        let lr = opt.learning_rate()? as f64;
        super::apply_update(opt, adapters, &grads, &[&outputs[0], &norm])?;
        let elapsed = tic.elapsed().as_secs_f64();
        tic = Instant::now();
        let report = StepReport {
            step,
            loss: scalar(&outputs[0])?,
            grad_norm: scalar(&norm)?,
            lr,
            tokens_per_s: tokens as f64 / elapsed.max(1e-9),
            note: super::preference_data::step_note(&cfg.method, &outputs),
        };
        metrics.write(train_line(&report, cfg, &outputs)?)?;
        on_step(&report, None);
        if cfg.save_every > 0 && step % cfg.save_every == 0 {
            adapters.save(out)?;
        }
    }
    adapters.save(out)
}

/// An eval's named results.
type EvalMetrics = Vec<(&'static str, f64)>;

/// Evaluates on `valid` and writes the eval line (with the objective's weight); with a
/// controller, feeds it the eval's ℓw and ℓr (the first eval calibrates it from ℓw's noise)
/// and, where it moves the weight or its phase, writes the change, sets the weight in `cfg`
/// and returns the change's console line.
fn evaluate_and_steer(
    model: &dyn LanguageModel,
    valid: &Dataset,
    cfg: &mut TrainConfig,
    controller: Option<&mut super::lambda::Controller>,
    metrics: &mut Metrics,
    step: usize,
) -> Result<(EvalMetrics, Option<String>), TrainError> {
    let m = evaluate(model, valid, cfg)?;
    let mut line = json!({"type": "eval", "step": step});
    if let Some(w) = cfg.weight() {
        line[cfg.actuated.key()] = json!(w);
    }
    for (k, x) in &m {
        line[*k] = json!(x);
    }
    metrics.write(line)?;
    let get = |name: &str| m.iter().find(|(k, _)| *k == name).map(|(_, v)| *v);
    let (Some(c), Some(lw), Some(lr)) = (controller, get("lw"), get("lr")) else {
        return Ok((m, None));
    };
    let change = if c.eps_sft.is_nan() {
        let noise = get("lw_se").unwrap_or(f64::NAN);
        Some(c.calibrate(lw, lr, noise).map_err(TrainError::Config)?)
    } else {
        c.update(lw, lr, get("lw_se").unwrap_or(f64::NAN))
    };
    let Some(change) = change else {
        return Ok((m, None));
    };
    metrics.write(json!({
        "type": "lambda", "weight": cfg.actuated.key(), "step": step, "from": change.from,
        "to": change.to, "cause": change.cause, "phase": change.phase,
        "eps_sft": c.eps_sft, "eps_disp": c.eps_disp,
    }))?;
    cfg.set_weight(c.lambda);
    Ok((
        m,
        Some(format!("step {step}: {}", change.line_for(cfg.actuated))),
    ))
}

/// This batch's gradients added to those accumulated so far (if any).
fn add_grads(prev: Option<Vec<Array>>, grads: Vec<Array>) -> Result<Vec<Array>, Exception> {
    match prev {
        Some(prev) => prev.iter().zip(&grads).map(|(a, g)| a.add(g)).collect(),
        None => Ok(grads),
    }
}

/// The mean over `accum_steps` accumulated batches (the gradients as they are for one).
fn mean_grads(grads: Vec<Array>, accum_steps: usize) -> Result<Vec<Array>, Exception> {
    if accum_steps <= 1 {
        return Ok(grads);
    }
    let k = Array::from_f32(accum_steps as f32);
    grads.iter().map(|g| g.divide(&k)).collect()
}

/// A step's metrics line: the report, peak memory and, for ORPO, λ and the step's parts.
fn train_line(
    report: &StepReport,
    cfg: &TrainConfig,
    outputs: &[Array],
) -> Result<Value, Exception> {
    let peak = crate::runtime::memory().map_or(0, |m| m.peak);
    let mut line = json!({
        "type": "train", "step": report.step, "loss": report.loss, "grad_norm": report.grad_norm,
        "lr": report.lr, "tokens_per_s": report.tokens_per_s, "peak_memory_mb": peak as f64 / 1e6,
    });
    if cfg.method == Method::Orpo {
        line["lambda"] = json!(cfg.orpo_lambda);
        // The step's ORPO parts ("lr" stays the learning rate here; ℓw, ℓr are in evals).
        for (name, o) in OrpoTerms::NAMES.iter().zip(outputs).skip(1).take(4) {
            line[*name] = json!(scalar(o)?);
        }
    }
    if let (Method::Pairs(_), Some(w)) = (cfg.method, cfg.weight()) {
        line[cfg.actuated.key()] = json!(w);
    }
    // DPO, CPO, SimPO: every term TRL logs.
    for (name, o) in super::preference_data::names(&cfg.method)
        .unwrap_or_default()
        .iter()
        .zip(outputs)
        .skip(1)
    {
        line[*name] = json!(scalar(o)?);
    }
    Ok(line)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clipping_scales_to_the_max_norm_and_reports_the_norm() {
        let g = vec![
            Array::from_slice(&[3.0f32, 0.0], &[2]),
            Array::from_slice(&[4.0f32], &[1]),
        ];
        let (same, norm) = clip_grad_norm(g.clone(), None).unwrap();
        assert_eq!(scalar(&norm).unwrap(), 5.0);
        assert_eq!(same[0].as_slice::<f32>(), [3.0, 0.0]);
        let (clipped, _) = clip_grad_norm(g, Some(1.0)).unwrap();
        let total: f32 = clipped
            .iter()
            .map(|c| {
                c.eval().unwrap();
                c.as_slice::<f32>().iter().map(|x| x * x).sum::<f32>()
            })
            .sum();
        assert!((total.sqrt() - 1.0).abs() < 1e-5, "{total}");
    }

    #[test]
    fn batches_are_length_sorted_and_the_permutation_is_seeded() {
        let data = Dataset::Sft(
            [5usize, 1, 3, 2, 4, 6]
                .iter()
                .map(|&n| Example {
                    tokens: vec![1; n],
                    offset: 0,
                })
                .collect(),
        );
        assert_eq!(batches(&data, 2), vec![vec![1, 3], vec![2, 4], vec![0, 5]]);
        let (mut a, mut b) = (7u64, 7u64);
        assert_eq!(permutation(10, &mut a), permutation(10, &mut b));
        assert_ne!(permutation(10, &mut a), (0..10).collect::<Vec<_>>());
    }
}
