//! The compiled training step (`--compile-step auto|on|off`): one MLX-compiled graph for
//! "adapter parameters + batch arrays → loss outputs + gradients", as mlx-lm's trainer
//! wraps its step in `mx.compile` (mlx_lm/tuner/trainer.py `train`, `step`).
//!
//! The graph computes what the eager step computes (`trainer::batch_grads`): the same
//! forward and loss, op for op, under `value_and_grad` over the adapters' parameters. The
//! parameters enter as arguments (placed into the layers as the trace's inputs), the batch
//! as arrays (SFT: ids, lengths; ORPO: ids, prompt mask, response mask); the model's frozen
//! weights are constants the graph captures. MLX keys a compiled function's traces by its
//! inputs' shapes and dtypes and retraces for a new shape, so one graph serves every batch
//! of one `GraphKey` — what the trace depends on beyond the shapes: the method, λ and the
//! NLL scope (constants of the trace) and, for the prefix-shared ORPO forward, the shared
//! prefix's length P (a slicing bound: two batches of one shape can differ in it).
//!
//! Probe and keep (as the decode side, `generate::probe`): `auto` runs the first batch
//! `PROBE_STEPS` times on each path (after one untimed call each: the compiled one traces),
//! outside the timed loop, and keeps the compiled step where it was faster and its outputs
//! matched the eager ones within `OUTPUT_BOUND` and `GRAD_BOUND`; the choice and its numbers go to
//! metrics.jsonl as a `compile` line. `on` compiles every batch it can take (refusing runs
//! it cannot), `off` never compiles. Runs with LoRA dropout (its masks would be constants of
//! the first trace) or segmented backward stay eager.

use std::cell::Cell;
use std::marker::PhantomData;
use std::rc::Rc;
use std::time::Instant;

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::transforms::compile::compile;
use mlx_rs::{Array, Dtype};
use serde_json::json;

use super::data::{Example, Pair};
use super::lora::Adapters;
use super::orpo::{orpo_from_logits, orpo_terms, pair_batch, SftScope};
use super::orpo_prefix::{prefix_shared_logps, shared_prefix_len, OrpoForward};
use super::trainer::{batch_grads, sft_batch, Dataset, Metrics, StepGrads, TrainConfig};
use super::TrainError;
use crate::model::LanguageModel;
use crate::plant::{self, Defect};

/// Whether the training step runs compiled.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    serde::Serialize,
    serde::Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum CompileStep {
    /// Probe both paths on the first batch and keep the faster one whose outputs match.
    #[default]
    Auto,
    /// Every batch that can take it runs compiled.
    On,
    /// Always eager.
    Off,
}

/// Timed calls per path in the probe (after one untimed call each).
pub const PROBE_STEPS: usize = 2;

/// The largest gap allowed between the compiled and the eager step's loss outputs,
/// relative to the largest |output|. Measured on cpu-amd-epyc, tiny-llama-trained: 0 in
/// bf16, 1.5e-7 in f32 (docs/training.md).
pub const OUTPUT_BOUND: f32 = 1e-6;

/// The largest gradient gap allowed between the compiled and the eager step, relative to
/// the largest |gradient|. Measured: 0 in bf16; in f32 8.8e-6 (SFT) to 7.0e-5 (ORPO),
/// where mlx-lm's own step compiled differs from it eager by 5.4e-6 (SFT, same model).
pub const GRAD_BOUND: f32 = 2e-4;

/// How many keyed graphs are kept (the oldest dropped, its MLX traces with it).
pub const MAX_GRAPHS: usize = 8;

/// What a trace depends on beyond its inputs' shapes and dtypes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GraphKey {
    Sft,
    /// λ as its bits.
    Joint {
        lambda: u32,
        scope: SftScope,
    },
    PrefixShared {
        p: i32,
        lambda: u32,
        scope: SftScope,
    },
}

impl GraphKey {
    /// Whether a batch of key `other` may run `self`'s graph.
    fn same(&self, other: &GraphKey) -> bool {
        use GraphKey::*;
        match (*self, *other) {
            // Planted: P left out, so a batch reuses the trace of another P of its shape.
            (
                PrefixShared { lambda, scope, .. },
                PrefixShared {
                    lambda: l,
                    scope: s,
                    ..
                },
            ) if plant::is(Defect::CompiledStepKeyWithoutPrefix) => lambda == l && scope == s,
            // Planted: λ left out, so a batch keeps the λ of the first trace.
            (PrefixShared { p, scope, .. }, PrefixShared { p: q, scope: s, .. })
                if plant::is(Defect::CompiledStepKeyWithoutLambda) =>
            {
                p == q && scope == s
            }
            (Joint { scope, .. }, Joint { scope: s, .. })
                if plant::is(Defect::CompiledStepKeyWithoutLambda) =>
            {
                scope == s
            }
            _ => self == other,
        }
    }
}

/// A step's loss outputs and the adapters' gradients.
pub type LossAndGrads = (Vec<Array>, Vec<Array>);

type StepFn = Box<dyn FnMut(&[Array]) -> Result<Vec<Array>, Exception>>;

/// A batch as the graph takes it: its key and arrays (None: this batch stays eager).
fn graph_batch(
    data: &Dataset,
    batch: &[usize],
    cfg: &TrainConfig,
) -> Option<(GraphKey, Vec<Array>)> {
    if let Dataset::Sft(v) = data {
        let ex: Vec<&Example> = batch.iter().map(|&i| &v[i]).collect();
        let (ids, lengths) = sft_batch(&ex, cfg.max_seq_length);
        return Some((GraphKey::Sft, vec![ids, lengths]));
    }
    let Dataset::Orpo(v) = data else {
        return None;
    };
    let pairs: Vec<&Pair> = batch.iter().map(|&i| &v[i]).collect();
    Some(pair_inputs(
        &pairs,
        cfg.orpo_lambda,
        cfg.sft_scope,
        cfg.orpo_forward,
    ))
}

/// An ORPO batch as the graph takes it (`orpo_prefix::orpo_loss_by`'s choice of forward).
fn pair_inputs(
    pairs: &[&Pair],
    lambda: f32,
    scope: SftScope,
    forward: OrpoForward,
) -> (GraphKey, Vec<Array>) {
    let (ids, pm, rm) = pair_batch(pairs);
    let key = pair_key(pairs, ids.shape()[1] as usize, lambda, scope, forward);
    (key, vec![ids, pm, rm])
}

/// The key of a batch of pairs `width` tokens wide.
fn pair_key(
    pairs: &[&Pair],
    width: usize,
    lambda: f32,
    scope: SftScope,
    forward: OrpoForward,
) -> GraphKey {
    let lambda = lambda.to_bits();
    let p = shared_prefix_len(pairs, width) as i32;
    if forward == OrpoForward::PrefixShared && p > 0 {
        GraphKey::PrefixShared { p, lambda, scope }
    } else {
        GraphKey::Joint { lambda, scope }
    }
}

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

/// The forward training runs (as `trainer`'s): no cache.
fn forward_uncached(model: &dyn LanguageModel, inputs: &Array) -> Result<Array, Exception> {
    model.forward(
        inputs,
        &mut crate::cache::none::none_for(&model.make_caches()),
    )
}

/// The loss outputs of `key`'s batch `arrays`, as the eager step computes them
/// (`trainer::batch_loss`, `orpo_prefix::orpo_loss_by`).
fn graph_loss(
    model: &dyn LanguageModel,
    key: GraphKey,
    arrays: &[Array],
) -> Result<Vec<Array>, Exception> {
    let ids = &arrays[0];
    let t = ids.shape()[1];
    match key {
        GraphKey::Sft => {
            let logits = forward_uncached(model, &ids.index((.., ..t - 1)))?;
            let (loss, ntoks) = super::loss::sft_loss(&logits, ids, &arrays[1])?;
            Ok(vec![loss, ntoks])
        }
        GraphKey::Joint { lambda, scope } => {
            let logits = forward_uncached(model, &ids.index((.., ..t - 1)))?;
            let lambda = f32::from_bits(lambda);
            Ok(orpo_from_logits(&logits, ids, &arrays[1], &arrays[2], lambda, scope)?.into_vec())
        }
        GraphKey::PrefixShared { p, lambda, scope } => {
            let logps = prefix_shared_logps(model, ids, p)?;
            let lambda = f32::from_bits(lambda);
            Ok(orpo_terms(&logps, &arrays[1], &arrays[2], lambda, scope)?.into_vec())
        }
    }
}

/// The compiled graphs of one model and its adapters, keyed by `GraphKey`.
pub struct CompiledStep<'a> {
    model: &'static dyn LanguageModel,
    adapters: &'static Adapters<'static>,
    graphs: Vec<(GraphKey, StepFn)>,
    /// How many times a graph was traced (a new key or a new shape of one).
    traces: Rc<Cell<usize>>,
    /// Steps that ran compiled.
    pub steps: usize,
    _borrow: PhantomData<&'a Adapters<'a>>,
}

impl<'a> CompiledStep<'a> {
    pub fn new(model: &'a dyn LanguageModel, adapters: &'a Adapters<'a>) -> Self {
        // SAFETY: the compiled closures must be 'static, so they hold these references
        // with their lifetimes erased; they live in `graphs`, which this value owns and
        // drops with itself, and `_borrow` keeps it from outliving `model` and `adapters`.
        let (model, adapters) = unsafe {
            (
                std::mem::transmute::<&dyn LanguageModel, &'static dyn LanguageModel>(model),
                std::mem::transmute::<&Adapters<'_>, &'static Adapters<'static>>(adapters),
            )
        };
        CompiledStep {
            model,
            adapters,
            graphs: Vec::new(),
            traces: Rc::new(Cell::new(0)),
            steps: 0,
            _borrow: PhantomData,
        }
    }

    /// How many traces the graphs took so far.
    pub fn traces(&self) -> usize {
        self.traces.get()
    }

    /// The loss outputs and the adapters' gradients of one batch through the compiled graph
    /// (evaluated), or None where the batch stays eager. The adapters keep their values.
    pub fn grads(
        &mut self,
        data: &Dataset,
        batch: &[usize],
        cfg: &TrainConfig,
    ) -> Result<Option<LossAndGrads>, Exception> {
        let Some((key, arrays)) = graph_batch(data, batch, cfg) else {
            return Ok(None);
        };
        self.run(key, arrays).map(Some)
    }

    /// `grads` for a batch of ORPO pairs (as `orpo_prefix::orpo_loss_by` takes them).
    pub fn pair_grads(
        &mut self,
        pairs: &[&Pair],
        lambda: f32,
        scope: SftScope,
        forward: OrpoForward,
    ) -> Result<LossAndGrads, Exception> {
        let (key, arrays) = pair_inputs(pairs, lambda, scope, forward);
        self.run(key, arrays)
    }

    /// `key`'s graph on the adapters' parameters and `arrays`: (loss outputs, gradients).
    fn run(&mut self, key: GraphKey, arrays: Vec<Array>) -> Result<LossAndGrads, Exception> {
        let params = self.adapters.params();
        let n = params.len();
        let mut args = params.clone();
        args.extend(arrays);
        let result = (self.graph(key, n))(&args);
        // The trace left its inputs in the layers; put the real parameters back either way.
        self.adapters.set(&params);
        let mut out = result?;
        mlx_rs::transforms::eval(out.iter())?;
        let grads = out.split_off(out.len() - n);
        self.steps += 1;
        Ok((out, grads))
    }

    /// The graph for `key`, made if it is new (the oldest dropped past [`MAX_GRAPHS`]).
    fn graph(&mut self, key: GraphKey, n: usize) -> &mut StepFn {
        match self.graphs.iter().position(|(k, _)| k.same(&key)) {
            Some(i) => {
                let g = self.graphs.remove(i);
                self.graphs.push(g);
            }
            None => {
                if self.graphs.len() >= MAX_GRAPHS {
                    // Dropping a compiled function erases its MLX compile-cache entries.
                    drop(self.graphs.remove(0));
                }
                let f = step_fn(self.model, self.adapters, key, n, self.traces.clone());
                self.graphs.push((key, f));
            }
        }
        &mut self.graphs.last_mut().expect("pushed above").1
    }
}

/// The compiled "first `n` args are the parameters, the rest the batch → loss outputs,
/// then the gradients" for `key`.
fn step_fn(
    model: &'static dyn LanguageModel,
    adapters: &'static Adapters<'static>,
    key: GraphKey,
    n: usize,
    traces: Rc<Cell<usize>>,
) -> StepFn {
    let step = move |args: &[Array]| -> Result<Vec<Array>, Exception> {
        traces.set(traces.get() + 1);
        let (params, arrays) = args.split_at(n);
        // The parameters must be the trace's inputs: differentiating arrays the graph
        // captured is refused by MLX ("uncaptured inputs"), and a graph reading captured
        // adapters would keep its first call's.
        adapters.set(params);
        let (mut out, grads) = super::value_and_grad(adapters, || graph_loss(model, key, arrays))?;
        out.extend(grads);
        Ok(out)
    };
    let mut compiled = compile(step, false);
    Box::new(move |args: &[Array]| compiled(args))
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
        let why_not = ineligible(adapters, data, cfg);
        if let (CompileStep::On, Some(why)) = (mode, &why_not) {
            return Err(TrainError::Config(format!(
                "--compile-step on: {why}; pass --compile-step auto (or off)"
            )));
        }
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
                let matched = r.outputs_rel <= OUTPUT_BOUND && r.grads_rel <= GRAD_BOUND;
                let c = median(&r.compiled_ms);
                let saved = (median(&r.eager_ms) - c) * cfg.iters as f64;
                let traces = (r.trace_ms - c).max(0.0) * graphs as f64;
                let reason = match (matched, saved > traces) {
                    (false, _) => "the compiled outputs differ from the eager ones".into(),
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
