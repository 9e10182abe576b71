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
//! Runs with LoRA dropout (its masks would be constants of the first trace) or segmented
//! backward stay eager. Which path a run takes, and the probe that decides it under
//! `auto`, are in `compiled_probe`.

use std::cell::Cell;
use std::marker::PhantomData;
use std::rc::Rc;

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::transforms::compile::compile;
use mlx_rs::Array;

use super::data::{Example, Pair};
use super::lora::Adapters;
use super::orpo::{orpo_from_logits, orpo_terms, pair_batch, SftScope};
use super::orpo_prefix::{prefix_shared_logps, shared_prefix_len, OrpoForward};
use super::setup::{sft_batch, Dataset, TrainConfig};
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

/// How many keyed graphs are kept (the oldest dropped, its MLX traces with it).
pub const MAX_GRAPHS: usize = 8;

/// What a trace depends on beyond its inputs' shapes and dtypes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum GraphKey {
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
pub(super) fn pair_key(
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
            let logps = prefix_shared_logps(model, ids, p, 0)?;
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
