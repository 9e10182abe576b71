//! Probe and keep for the compiled training step (`compiled`), as the decode side does
//! (`generate::probe`): `--compile-step auto` runs the first batch on each path, outside the
//! timed loop — one untimed call each (the compiled one traces), then `PROBE_STEPS` timed
//! ones — and keeps the compiled step where its outputs and gradients equal the eager ones
//! bit for bit and its saving per step over the run outweighs tracing
//! each of the run's graphs (distinct keys and shapes over its batches; a trace costs the
//! first compiled call less a compiled step). Bit for bit, not within the bounds `on` is
//! gated to: a run's result must not depend on which path a timing picked (an f32 model,
//! or a bf16 one whose compiled graph rounds differently, stays eager under `auto`).
//! The choice and its numbers go to
//! metrics.jsonl as a `compile` line. `on` compiles every batch it can take (refusing runs
//! it cannot, with the cause), `off` never compiles.

use std::time::Instant;

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype};
use serde_json::json;

use super::compiled::{pair_key, CompileStep, CompiledStep, GraphKey, LossAndGrads};
use super::data::Pair;
use super::lora::Adapters;
use super::trainer::{batch_grads, Dataset, Metrics, StepGrads, TrainConfig};
use super::TrainError;
use crate::model::LanguageModel;

/// Timed calls per path in the probe (after one untimed call each).
pub const PROBE_STEPS: usize = 2;

/// The largest gap `--compile-step on` is gated to between the compiled and the eager
/// step's loss outputs,
/// relative to the largest |output|. Measured on cpu-amd-epyc, tiny-llama-trained: 0 in
/// bf16, 1.5e-7 in f32 (docs/training.md).
pub const OUTPUT_BOUND: f32 = 1e-6;

/// The largest gradient gap allowed between the compiled and the eager step, relative to
/// the largest |gradient|. Measured: 0 in bf16; in f32 8.8e-6 (SFT) to 7.0e-5 (ORPO),
/// where mlx-lm's own step compiled differs from it eager by 5.4e-6 (SFT, same model).
pub const GRAD_BOUND: f32 = 2e-4;

/// A batch's graph: its key and its (rows, width), as `graph_batch` would build it.
fn signature(
    data: &Dataset,
    batch: &[usize],
    cfg: &TrainConfig,
) -> Option<(GraphKey, usize, usize)> {
    if let Dataset::Sft(v) = data {
        let longest = batch.iter().map(|&i| v[i].tokens.len()).max().unwrap_or(1);
        let width = (1 + 32 * longest.div_ceil(32)).min(cfg.max_seq_length);
        return Some((GraphKey::Sft, batch.len(), width));
    }
    let Dataset::Orpo(v) = data else {
        return None;
    };
    let pairs: Vec<&Pair> = batch.iter().map(|&i| &v[i]).collect();
    let width = pairs
        .iter()
        .map(|p| p.chosen.len().max(p.rejected.len()))
        .max()?;
    let key = pair_key(
        &pairs,
        width,
        cfg.orpo_lambda,
        cfg.sft_scope,
        cfg.orpo_forward,
    );
    Some((key, 2 * batch.len(), width))
}

/// How many graphs the run's batches trace (one per distinct key and shape).
fn graphs_needed(data: &Dataset, cfg: &TrainConfig) -> usize {
    let mut seen = Vec::new();
    for b in super::trainer::batches(data, cfg.batch_size) {
        let sig = signature(data, &b, cfg);
        if !seen.contains(&sig) {
            seen.push(sig);
        }
    }
    seen.len()
}

/// `--compile-step on` for a run that cannot take the compiled step: refused, naming the
/// cause (the CLI asks before it writes anything).
pub fn refuse(
    mode: CompileStep,
    adapters: &Adapters,
    data: &Dataset,
    cfg: &TrainConfig,
) -> Result<(), TrainError> {
    match (mode, ineligible(adapters, data, cfg)) {
        (CompileStep::On, Some(why)) => Err(TrainError::Config(format!(
            "--compile-step on: {why}; pass --compile-step auto (or off)"
        ))),
        _ => Ok(()),
    }
}

/// Why a run cannot take the compiled step (None: it can).
pub fn ineligible(adapters: &Adapters, data: &Dataset, cfg: &TrainConfig) -> Option<String> {
    if adapters.config.lora_parameters.dropout > 0.0 {
        return Some(
            "LoRA dropout draws new masks each step (a trace would keep its first)".into(),
        );
    }
    if cfg.segment_size.is_some() {
        return Some("segmented backward runs segment by segment".into());
    }
    if !matches!(data, Dataset::Sft(_) | Dataset::Orpo(_)) {
        return Some("this method's step has no compiled form".into());
    }
    None
}

/// The largest |a − b| over the largest |a|, across two lists of arrays.
fn relative_gap(a: &[Array], b: &[Array]) -> Result<(f32, f32), Exception> {
    let (mut gap, mut scale) = (0.0f32, 0.0f32);
    for (x, y) in a.iter().zip(b) {
        let x = x.as_dtype(Dtype::Float32)?;
        let d = x.subtract(y.as_dtype(Dtype::Float32)?)?.abs()?.max(None)?;
        let m = x.abs()?.max(None)?;
        mlx_rs::transforms::eval([&d, &m])?;
        gap = gap.max(d.as_slice::<f32>()[0]);
        scale = scale.max(m.as_slice::<f32>()[0]);
    }
    Ok((gap, scale))
}

/// What the probe measured.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ProbeResult {
    pub eager_ms: Vec<f64>,
    pub compiled_ms: Vec<f64>,
    /// The compiled path's first call: trace, compile and run.
    pub trace_ms: f64,
    /// Largest |Δ| of the loss outputs (the loss first) and of the gradients, compiled vs
    /// eager, each over the largest |value| of its list.
    pub outputs_rel: f32,
    pub grads_rel: f32,
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[s.len() / 2]
}

/// The training loop's step: compiled or eager, as decided.
pub struct Steps<'a> {
    mode: CompileStep,
    compiled: Option<CompiledStep<'a>>,
    /// Whether the probe has still to run (auto, on the first batch).
    probe_pending: bool,
    /// How many graphs the run's batches trace (auto weighs their cost).
    graphs: usize,
}

impl<'a> Steps<'a> {
    /// The step for this run; `on` refuses a run that cannot take it, naming the cause.
    pub fn new(
        model: &'a dyn LanguageModel,
        adapters: &'a Adapters<'a>,
        data: &Dataset,
        cfg: &TrainConfig,
        mode: CompileStep,
        metrics: &mut Metrics,
    ) -> Result<Self, TrainError> {
        refuse(mode, adapters, data, cfg)?;
        let why_not = ineligible(adapters, data, cfg);
        let eligible = why_not.is_none();
        if mode == CompileStep::Off || !eligible {
            let reason = why_not.unwrap_or_else(|| "--compile-step off".into());
            metrics.write(
                json!({"type": "compile", "mode": mode, "choice": "eager", "reason": reason}),
            )?;
        } else if mode == CompileStep::On {
            metrics.write(json!({"type": "compile", "mode": mode, "choice": "compiled", "reason": "--compile-step on"}))?;
        }
        let compiled =
            (mode != CompileStep::Off && eligible).then(|| CompiledStep::new(model, adapters));
        let probe_pending = mode == CompileStep::Auto && compiled.is_some();
        Ok(Steps {
            mode,
            graphs: if probe_pending {
                graphs_needed(data, cfg)
            } else {
                0
            },
            probe_pending,
            compiled,
        })
    }

    /// Times both paths on `batch` and keeps the compiled one where it matched and its
    /// saving per step over the run's steps outweighs tracing each of the run's graphs
    /// (a trace costs the probe's first compiled call less a compiled step).
    fn probe_and_keep(
        &mut self,
        model: &dyn LanguageModel,
        adapters: &Adapters,
        data: &Dataset,
        batch: &[usize],
        cfg: &TrainConfig,
        metrics: &mut Metrics,
    ) -> Result<(), TrainError> {
        let compiled = self.compiled.as_mut().expect("auto with a compiled step");
        let graphs = self.graphs.clamp(1, cfg.iters.max(1));
        let (result, reason) = match probe(compiled, model, adapters, data, batch, cfg) {
            Ok(Some(r)) => {
                let matched = r.outputs_rel == 0.0 && r.grads_rel == 0.0;
                let c = median(&r.compiled_ms);
                let saved = (median(&r.eager_ms) - c) * cfg.iters as f64;
                let traces = (r.trace_ms - c).max(0.0) * graphs as f64;
                let reason = match (matched, saved > traces) {
                    (false, _) => format!(
                        "the compiled outputs differ from the eager ones (relative gaps \
                         {:.1e} outputs, {:.1e} gradients; auto keeps only a bit-identical step)",
                        r.outputs_rel, r.grads_rel
                    ),
                    (true, false) => format!(
                        "eager: compiled saves {saved:.0} ms over {} steps, tracing {graphs} \
                         graphs costs {traces:.0} ms",
                        cfg.iters
                    ),
                    (true, true) => format!(
                        "compiled: saves {saved:.0} ms over {} steps, tracing {graphs} graphs \
                         costs {traces:.0} ms",
                        cfg.iters
                    ),
                };
                (Some(r), reason)
            }
            Ok(None) => (None, "the first batch has no compiled form".into()),
            Err(e) => (None, format!("the compiled step failed: {e}")),
        };
        let keep = reason.starts_with("compiled:");
        if !keep {
            self.compiled = None;
        }
        metrics.write(json!({
            "type": "compile", "mode": self.mode,
            "choice": if keep { "compiled" } else { "eager" },
            "reason": reason, "graphs": graphs, "probe": result,
        }))?;
        Ok(())
    }
}

impl StepGrads for Steps<'_> {
    /// One batch's loss outputs and gradients, evaluated. The first call of `auto` probes
    /// both paths first (writing the `compile` line) and then restarts `tic`, so the probe
    /// stays out of the step's timing.
    fn grads(
        &mut self,
        model: &dyn LanguageModel,
        adapters: &Adapters,
        data: &Dataset,
        batch: &[usize],
        cfg: &TrainConfig,
        metrics: &mut Metrics,
        tic: &mut Instant,
    ) -> Result<LossAndGrads, TrainError> {
        if self.probe_pending {
            self.probe_pending = false;
            self.probe_and_keep(model, adapters, data, batch, cfg, metrics)?;
            *tic = Instant::now();
        }
        if let Some(c) = &mut self.compiled {
            if let Some(r) = c.grads(data, batch, cfg)? {
                return Ok(r);
            }
        }
        Ok(batch_grads(model, adapters, data, batch, cfg, &mut ())?)
    }
}

/// The probe: one untimed call and `PROBE_STEPS` timed ones on each path (eager first),
/// and the compiled outputs' gap to the eager ones. None: the batch has no compiled form.
pub fn probe(
    compiled: &mut CompiledStep,
    model: &dyn LanguageModel,
    adapters: &Adapters,
    data: &Dataset,
    batch: &[usize],
    cfg: &TrainConfig,
) -> Result<Option<ProbeResult>, Exception> {
    let ms = |t: Instant| t.elapsed().as_secs_f64() * 1e3;
    let mut eager = batch_grads(model, adapters, data, batch, cfg, &mut ())?;
    let mut eager_ms = Vec::new();
    for _ in 0..PROBE_STEPS {
        let t = Instant::now();
        eager = batch_grads(model, adapters, data, batch, cfg, &mut ())?;
        eager_ms.push(ms(t));
    }
    let t = Instant::now();
    let Some(mut got) = compiled.grads(data, batch, cfg)? else {
        return Ok(None);
    };
    let trace_ms = ms(t);
    let mut compiled_ms = Vec::new();
    for _ in 0..PROBE_STEPS {
        let t = Instant::now();
        got = compiled.grads(data, batch, cfg)?.expect("the same batch");
        compiled_ms.push(ms(t));
    }
    let (og, os) = relative_gap(&eager.0, &got.0)?;
    let (gg, gs) = relative_gap(&eager.1, &got.1)?;
    Ok(Some(ProbeResult {
        eager_ms,
        compiled_ms,
        trace_ms,
        outputs_rel: og / os.max(f32::MIN_POSITIVE),
        grads_rel: gg / gs.max(f32::MIN_POSITIVE),
    }))
}
