//! Parity gates. `gates` is the table of them all (name, tier, golden group, oracle
//! generator, models, run); `harness parity`, `harness goldens` and the tests in tests/ read
//! it. One module per gate: `runtime` (the model-free MLX golden), `l1` (the engine vs
//! mlx-lm; also mlx-lm's kv_bits goldens), `sampling`, `batch`, `spec`, `detok`, `train`
//! (all vs mlx-lm), `l2` and `spec_l2` (vs mlx-optiq), `l3` (the envelope vs our own frozen
//! L2 trajectories). `plant` names the defects a gate can be given to show it fails.

pub mod batch;
pub mod detok;
pub mod fixture;
pub mod gates;
pub mod l1;
pub mod l2;
pub mod l3;
pub mod plant;
pub mod quality;
pub mod runtime;
pub mod sampling;
pub mod spec;
pub mod spec_l2;
pub mod templates;
pub mod tokenize;
pub mod train;
pub mod vocab;

use std::any::Any;

/// Why a parity gate could not run (a failing gate is a report, not an error).
#[derive(Debug, thiserror::Error)]
pub enum ParityError {
    #[error(transparent)]
    Golden(#[from] crate::goldens::GoldenError),
    #[error("golden index: {0}")]
    Index(String),
    #[error("engine: {0}")]
    Load(#[from] engine::load::LoadError),
    #[error("MLX: {0}")]
    Mlx(#[from] mlx_rs::error::Exception),
    #[error("unknown case `{0}`")]
    UnknownCase(String),
    /// A tier, plant or gate that does not exist or does not fit.
    #[error("{0}")]
    Usage(String),
    #[error("oracle: {0}")]
    Oracle(String),
    #[error(transparent)]
    NotCompiledIn(#[from] engine::plant::NotCompiledIn),
    #[error("eval: {0}")]
    Eval(#[from] crate::eval::EvalError),
}

/// One count for the results DB: `value` of `total` (e.g. logit vectors bit-exact).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Count {
    pub metric: &'static str,
    pub value: usize,
    pub total: usize,
}

/// What every gate's run gives back.
pub trait Report: IntoAny {
    /// The verdict line, naming the gate and what it ran (`L1 tiny-llama: 85/85 …`).
    fn summary(&self) -> String;
    /// Lines under the summary: per case, or where it failed.
    fn details(&self) -> Vec<String> {
        Vec::new()
    }
    fn passed(&self) -> bool;
    /// The counts `harness parity` records in the results DB (none for most gates).
    fn counts(&self) -> Vec<Count> {
        Vec::new()
    }
}

/// `Box<dyn Report>` back to the gate's own report type (see [`Report::downcast`]).
pub trait IntoAny: Any {
    fn into_any(self: Box<Self>) -> Box<dyn Any>;
}

impl<T: Any> IntoAny for T {
    fn into_any(self: Box<Self>) -> Box<dyn Any> {
        self
    }
}

impl dyn Report {
    /// The report as the gate's own type (e.g. `SpecReport`, for its acceptance counts).
    pub fn downcast<R: Report>(self: Box<Self>) -> Option<R> {
        self.into_any().downcast().ok().map(|r| *r)
    }
}
