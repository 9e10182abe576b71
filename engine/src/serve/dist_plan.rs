//! `engine serve` as ranks of a distributed group (mlx.launch): rank 0 serves HTTP and runs
//! the worker; every other rank runs a follower (`follower.rs`) with the same model shard,
//! sampler and prompt store, and no HTTP. Every rank must run the same forwards, in the
//! same order, with the same shapes (each one holds collectives). The worker decides on
//! facts only rank 0 sees (arrivals, backlogged clients, stop strings, deadlines,
//! disconnects), so rank 0 shares them, in mlx_lm.server's framing (`dist::share_bytes`):
//!
//! * before each model step, a **round plan** (JSON): the requests that ended since the last
//!   plan (with the tokens their caches were kept under, so prompt-store contents cannot
//!   diverge), then the step: an admission (prompt ids, sampling, seed, limit, and how many
//!   prompt tokens the prompt store gave), a decode step of one request, or shutdown;
//! * while idle, an empty plan at most every [`HEARTBEAT`] (which also notices a lost peer);
//! * at each emitted token, the emitter's decision (go on, stop, failed) — stop strings
//!   and cut clients are known on rank 0 only, and a step that goes on may run a forward;
//! * under `--batch N`, the batch lane's changes to its caches instead (`Op::Lane`,
//!   `batch_lane::mirror`): followers mirror the lane's forwards with rank 0's ids.
//!
//! Any failed collective is fatal: the ring cannot recover.

use std::cell::{Cell, RefCell};
use std::time::{Duration, Instant};

use mlx_rs::error::Exception;
use serde::{Deserialize, Serialize};

use super::error::ApiError;
use crate::generate::sampler::SamplingParams;
use crate::generate::Flow;

/// The most rank 0 stays silent while idle.
pub const HEARTBEAT: Duration = Duration::from_millis(100);

/// A request's sampling settings as shared (`SamplingParams`, every field).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Sampling {
    temp: f64,
    top_p: f64,
    min_p: f64,
    min_tokens_to_keep: i32,
    top_k: i32,
    seed: u64,
    logit_bias: Vec<(u32, f32)>,
    repetition_penalty: Option<f64>,
    repetition_context_size: usize,
    presence_penalty: Option<f64>,
    presence_context_size: usize,
    frequency_penalty: Option<f64>,
    frequency_context_size: usize,
}

impl From<&SamplingParams> for Sampling {
    fn from(p: &SamplingParams) -> Self {
        Sampling {
            temp: p.temp,
            top_p: p.top_p,
            min_p: p.min_p,
            min_tokens_to_keep: p.min_tokens_to_keep,
            top_k: p.top_k,
            seed: p.seed,
            logit_bias: p.logit_bias.clone(),
            repetition_penalty: p.repetition_penalty,
            repetition_context_size: p.repetition_context_size,
            presence_penalty: p.presence_penalty,
            presence_context_size: p.presence_context_size,
            frequency_penalty: p.frequency_penalty,
            frequency_context_size: p.frequency_context_size,
        }
    }
}

impl From<Sampling> for SamplingParams {
    fn from(s: Sampling) -> Self {
        SamplingParams {
            temp: s.temp,
            top_p: s.top_p,
            min_p: s.min_p,
            min_tokens_to_keep: s.min_tokens_to_keep,
            top_k: s.top_k,
            seed: s.seed,
            logit_bias: s.logit_bias,
            repetition_penalty: s.repetition_penalty,
            repetition_context_size: s.repetition_context_size,
            presence_penalty: s.presence_penalty,
            presence_context_size: s.presence_context_size,
            frequency_penalty: s.frequency_penalty,
            frequency_context_size: s.frequency_context_size,
        }
    }
}

/// A request rank 0 admits: everything a follower needs to run its prefill and steps.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Admit {
    pub id: u64,
    pub prompt: Vec<u32>,
    /// The limit after clamping to the context.
    pub max_tokens: usize,
    pub sampling: Sampling,
    /// Prompt tokens the prompt store gave rank 0 (the rest is prefilled).
    pub cached: usize,
    /// The request's grammar: every rank masks with it (else their ids diverge).
    #[serde(default)]
    pub constraint: Option<crate::constrain::Grammar>,
}

/// One entry of a round plan, applied in order.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Op {
    /// A request left the turns; `keep`: the tokens after its prompt that its caches were
    /// kept under (None: not kept).
    End {
        id: u64,
        keep: Option<Vec<u32>>,
    },
    Admit(Box<Admit>),
    /// One decode step of a request.
    Step {
        id: u64,
    },
    /// Rank 0 stops serving: followers exit 0.
    Shutdown,
    /// A change to the batch lane's caches (`batch_lane::mirror`).
    Lane(LaneOp),
}

/// One change to the batch lane's caches (the lane call it mirrors in brackets).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum LaneOp {
    /// A request starts its admission: the prompt store gives `cached` prompt tokens
    /// (`admit::start`).
    Open {
        key: u64,
        prompt: Vec<u32>,
        cached: usize,
    },
    /// An admission's next `n` prompt tokens are prefilled (`Session::prefill_chunk`).
    Chunk { key: u64, n: usize },
    /// A one-token prompt with nothing cached is stepped alone (`first_alone`).
    Alone { key: u64 },
    /// An admission or a parked row leaves without joining; `keep`: the ids generated
    /// after its prompt that its caches are kept under (a row over at its first id).
    Close { key: u64, keep: Option<Vec<u32>> },
    /// Admissions join the batch as they stand (`Batch::join`).
    Join { keys: Vec<u64> },
    /// Admissions join through one step of their last prompt ids (`Batch::admit`).
    Admit { keys: Vec<u64> },
    /// Uncached admissions prefilled as one prompt batch (`Batch::admit_prompts`).
    Together { keys: Vec<u64> },
    /// One decode step, one id per row (`Batch::step_ids`).
    Step { ids: Vec<u32> },
    /// Rows leave (`Worker::settle`): `ended` (row, its history) keep their caches, then
    /// only rows `keep` stay.
    Settle {
        keep: Vec<usize>,
        ended: Vec<(usize, Vec<u32>)>,
    },
    /// Row `row` is parked with its first `fed` tokens under `key` (`Worker::park`).
    Park { row: usize, fed: i32, key: u64 },
    /// A parked row joins again (`share_slots`).
    Rejoin { key: u64 },
    /// The last row steps alone (`Batch::go_solo`).
    GoSolo,
    /// The lane's batch starts afresh (after a failure).
    Reset,
}

impl LaneOp {
    /// Whether the op runs a forward (so it is shared before rank 0 runs it).
    pub fn runs_forward(&self) -> bool {
        matches!(
            self,
            LaneOp::Chunk { .. }
                | LaneOp::Alone { .. }
                | LaneOp::Admit { .. }
                | LaneOp::Together { .. }
                | LaneOp::Step { .. }
        )
    }
}

/// The emitter's decision at a token, shared so every rank's decoder does the same.
const GO_ON: u8 = 0;
const STOP: u8 = 1;
const FAILED: u8 = 2;

/// Rank 0's side: what has happened since the last plan.
#[derive(Default)]
pub struct Leader {
    pending: RefCell<Vec<Op>>,
    last_sent: Cell<Option<Instant>>,
    next_id: Cell<u64>,
    /// The tokens `keep_fed` kept the ending request's caches under.
    pub kept: RefCell<Option<Vec<u32>>>,
    /// Set when the emitter failed at a token (not a model error).
    pub emit_failed: Cell<bool>,
    /// Why a collective (or a model step, which holds collectives) failed: the server
    /// fails what is in flight and exits.
    lost: RefCell<Option<String>>,
}

impl Leader {
    /// Marks the group lost (the first cause is kept); the error for the request at hand.
    pub fn lose(&self, why: &dyn std::fmt::Display) -> ApiError {
        while crate::plant::is(crate::plant::Defect::LostCollectiveHangs) {
            std::thread::park(); // as if the collective never returned
        }
        let mut lost = self.lost.borrow_mut();
        let why = lost.get_or_insert_with(|| why.to_string()).clone();
        ApiError::server(lost_message(&why))
    }

    /// Why the group was lost, if it was.
    pub fn lost(&self) -> Option<String> {
        self.lost.borrow().clone()
    }

    /// A fresh request id.
    pub fn next_id(&self) -> u64 {
        let id = self.next_id.get();
        self.next_id.set(id + 1);
        id
    }

    /// Notes a request that ended (sent with the next plan): its caches' kept tokens past
    /// its prompt of `prompt_len` (taken from `kept`).
    pub fn ended(&self, id: u64, prompt_len: usize) {
        let keep = self
            .kept
            .borrow_mut()
            .take()
            .map(|mut t| t.split_off(prompt_len));
        self.pending.borrow_mut().push(Op::End { id, keep });
    }

    /// Notes `op` for the next plan (it runs no forward: it may wait).
    pub fn defer(&self, op: Op) {
        self.pending.borrow_mut().push(op);
    }

    /// Shares the pending ends and then `op` (None: only the ends, a heartbeat).
    pub fn send(&self, op: Option<Op>) -> Result<(), Exception> {
        let mut ops = std::mem::take(&mut *self.pending.borrow_mut());
        ops.extend(op);
        let bytes = serde_json::to_vec(&ops).map_err(|e| Exception::custom(e.to_string()))?;
        crate::dist::share_bytes(&bytes)?;
        self.last_sent.set(Some(Instant::now()));
        crate::dist::tick("the next round plan");
        Ok(())
    }

    /// An empty plan when nothing was shared for [`HEARTBEAT`].
    pub fn heartbeat(&self) -> Result<(), Exception> {
        if self
            .last_sent
            .get()
            .is_none_or(|t| t.elapsed() >= HEARTBEAT)
        {
            self.send(None)?;
        }
        Ok(())
    }

    /// Shares the emitter's decision at token `id`; returns it.
    pub fn flow<E>(&self, id: u32, decided: Result<Flow, E>) -> Result<Result<Flow, E>, Exception> {
        let code = match &decided {
            Ok(Flow::Continue) => GO_ON,
            Ok(Flow::Stop) => STOP,
            Err(_) => FAILED,
        };
        self.emit_failed.set(code == FAILED);
        let mut bytes = vec![code];
        bytes.extend(id.to_le_bytes());
        crate::dist::share_bytes(&bytes)?;
        Ok(decided)
    }
}

/// Whether a failed step failed the same way on every rank, so the request fails alone and
/// the group goes on: a grammar's fault (`constrain::grammar_fault`) is, since every rank
/// masks with the same grammar over the same ids after the same forward (the followers then
/// wait for rank 0's end of it; `follower`).
pub(super) fn same_on_every_rank(message: &str) -> bool {
    crate::constrain::grammar_fault(message).is_some() && !grammar_fault_loses_group()
}

/// `same_on_every_rank` for a step's error as the request's (`ApiError::generation`).
pub(super) fn fails_alone(e: &ApiError) -> bool {
    e.code == Some("grammar_error") && !grammar_fault_loses_group()
}

/// Planted: a grammar's fault is taken for a lost group (caught by
/// engine/tests/it/dist/serve.rs).
fn grammar_fault_loses_group() -> bool {
    crate::plant::is(crate::plant::Defect::GrammarFaultLosesGroup)
}

/// The error of every request in flight when the group is lost.
pub fn lost_message(why: &str) -> String {
    format!(
        "a distributed step failed ({why}): a peer rank was lost; this server exits \
         (restart every rank)"
    )
}

/// A token decision: its code and the id rank 0 emitted.
const DECISION_BYTES: usize = 5;

/// Ends a follower whose decoding no longer matches rank 0's (they sampled different ids,
/// or one stopped where the other did not), with `dist::exit::MISMATCH`.
fn diverged(what: &str) -> ! {
    crate::dist::exit_with(
        crate::dist::exit::MISMATCH,
        &format!(
            "the ranks' decoding diverged: {what} (the ranks computed different logits: are \
             they running the same engine build on the same model?)"
        ),
    )
}

/// A follower's next round plan (rank 0's ops, in order).
pub fn receive() -> Result<Vec<Op>, Exception> {
    let bytes = crate::dist::share_bytes(&[])?;
    crate::dist::tick("the next round plan");
    if bytes.len() == DECISION_BYTES && bytes[0] <= FAILED {
        diverged("rank 0 emitted a token where this rank's request had ended");
    }
    serde_json::from_slice(&bytes)
        .map_err(|e| Exception::custom(format!("a round plan that does not parse: {e}")))
}

/// A follower's view of rank 0's decision at this rank's token `id`: go on, or stop there
/// (rank 0 stopped, or its emitter failed, which ends the request without another forward
/// as well).
pub fn follow_flow(id: u32) -> Result<Flow, Exception> {
    let bytes = crate::dist::share_bytes(&[])?;
    if bytes.len() != DECISION_BYTES {
        diverged("rank 0 went on with a round plan where this rank emitted a token");
    }
    let theirs = u32::from_le_bytes([bytes[1], bytes[2], bytes[3], bytes[4]]);
    if theirs != id {
        diverged(&format!(
            "rank 0 emitted id {theirs} where this rank sampled {id}"
        ));
    }
    match bytes[0] {
        GO_ON => Ok(Flow::Continue),
        STOP | FAILED => Ok(Flow::Stop),
        _ => Err(Exception::custom("a token decision that does not parse")),
    }
}

/// Joins the group mlx.launch describes (None outside one) and refuses what ranks cannot
/// serve together.
pub fn join(args: &super::ServeArgs) -> anyhow::Result<Option<&'static crate::dist::Group>> {
    let Some(group) = crate::dist::init(&args.dist)? else {
        return Ok(None);
    };
    anyhow::ensure!(
        args.draft_model.is_none(),
        "--draft-model is not supported across ranks (as in mlx_lm.server); serve it on one \
         machine"
    );
    anyhow::ensure!(
        args.ssd_cache.is_none(),
        "--ssd-cache is not supported across ranks: each rank would restore and write its \
         own shard's files"
    );
    anyhow::ensure!(
        group.mode == crate::dist::Mode::Tensor || args.prompt_cache_bytes.is_none(),
        "--prompt-cache-bytes is not supported with --pipeline: the ranks' stages hold \
         different bytes, so their prompt caches would evict differently (use \
         --prompt-cache-size)"
    );
    if group.rank == 0 {
        eprintln!(
            "engine serve: rank 0 of {} ({} parallel): serving HTTP; the other ranks follow",
            group.size,
            group.mode.name()
        );
    }
    Ok(Some(group))
}
