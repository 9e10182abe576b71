//! Batched decoding (the batch lane's core): rows are prefilled one at a time as single
//! sequences (mlx-lm's batched prefill gives each row the same numbers on this backend, so
//! only scheduling differs), then decode together — one forward of [B, 1] ids per step over
//! one batch cache per layer: `BatchKvCache` for full attention (dense or quantized KV),
//! `BatchRotatingKvCache` for sliding windows, `ArraysCache` with one row per sequence for
//! the hybrids' recurrent layers (short conv, gated delta net, Mamba-2: mlx-lm's
//! `ArraysCache.merge` stacks the rows' states, `filter`/`extend` take and append rows).
//! Rows join and leave between steps. In the lane's batch (`for_lane`) a lone row steps as
//! a single-sequence session instead (the compiled step where it pays).
//!
//! `join` merges the rows' caches as they stand into the running batch. `admit` is
//! mlx-lm's `BatchGenerator` path for new prompts: rows whose caches hold all their prompt
//! tokens but the last are merged into a batch of their own, which feeds their last tokens
//! in one step (their first logits), and is then appended to the running batch. For
//! full-attention layers both give the same numbers; a sliding-window ring that wraps in
//! that first step is laid out as BatchGenerator lays it out only by `admit`.
//!
//! `admit_prompts` is BatchGenerator's prompt batch op for op (`PromptProcessingBatch`):
//! fresh caches merged (an `ArraysCache` of empty rows gets a zero left padding), the
//! prompts but their last tokens right-padded into one forward per prefill step with each
//! row's length given to the caches (`prepare`: the recurrent mixers' mask and their
//! states taken at each row's own end; the K/V rows' padding rolled to the front by
//! `finalize`), then the last tokens stepped. The lane uses it for uncached prompts that
//! arrive together (each row bitwise its prefill alone: the `prompt_batch_rows` gate); the
//! BatchGenerator gate checks the mixers' batched prefill against mlx-lm with it. Sliding-window and quantized caches have no batched prefill.
//!
//! `verify` feeds every row a run of ids of one length in one forward (a speculative
//! verify over the batch, `batch_lookup`), and `trim_rows` gives back each row's own
//! number of rejected positions.

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;

use super::{KvQuantPlan, Session, SessionOptions};
use crate::cache::{arrays, kv, list, rotating, Cache, QuantSdpa};
use crate::model::LanguageModel;

pub struct Batch<'m> {
    model: &'m dyn LanguageModel,
    /// One batch cache per layer; empty while no row is in the batch.
    caches: Vec<Box<dyn Cache>>,
    /// The rows' KV quantization plan (theirs, taken when they join): applied after every
    /// step as each row's session applies it (the batch lane takes plans that start at 0,
    /// so every cache converts at once).
    kv_quant: Option<KvQuantPlan>,
    /// Whether a lone row runs as a single-sequence session (`lone`).
    lone: bool,
    /// The lone row, while it is the batch's only row (`caches` is then empty).
    solo: Option<Session<'m>>,
}

/// The kinds the lane does not batch: dynamic RoPE's integer-offset cache and Llama 4's
/// chunked one (mlx-lm's `ChunkedKVCache` has no `merge`).
const OTHER_CACHES: &str =
    "this model's caches (dynamic RoPE's; Llama 4's chunked attention, ChunkedKvCache)";

const REFUSAL: &str = "the batch lane takes standard (dense, full-attention), sliding-window \
     and recurrent-state (ArraysCache) caches only";

const UNREFERENCED: &str = "this family: the batch lane is not gated against mlx-lm 0.32.2's \
     BatchGenerator for it (gemma2: BatchGenerator raises on its softcapped attention; \
     deepseek_v32: a row joining a running batch differs from it in the last bits), so it is \
     served one request at a time";

/// Why `model` run with `opts` cannot take the batch lane (what it needs that the lane
/// lacks), or None when it can.
pub fn refusal(model: &dyn LanguageModel, opts: &SessionOptions) -> Option<&'static str> {
    if !crate::model::registry::has(model.model_type(), |f| f.batch) {
        return Some(UNREFERENCED);
    }
    let (mut rings, mut states) = (false, false);
    for c in model.make_caches() {
        // A `CacheList` (falcon_h1's [ArraysCache, KvCache]) batches part by part.
        let parts: Vec<&dyn Cache> = match (c.kind(), c.sub_caches()) {
            (Some(list::KIND), Some(parts)) => parts.iter().map(|p| p.as_ref()).collect(),
            _ => vec![c.as_ref()],
        };
        for p in parts {
            match p.kind() {
                Some(kv::KIND) => {}
                Some(rotating::KIND) => rings = true,
                Some(arrays::KIND) => states = true,
                _ => return Some(OTHER_CACHES),
            }
        }
    }
    let plan = opts.kv_quant.as_ref()?;
    if states {
        return Some(
            "quantized KV on a hybrid model (layers with a recurrent state, ArraysCache): the \
             batch-kv4 gate checks quantized batches on full-attention models only",
        );
    }
    if plan.sdpa != QuantSdpa::MlxLm {
        return Some(
            "quantized KV read through optiq's fused attention (--l2, --l3); the batch lane \
             reads quantized KV with mlx-lm's attention (--fused-sdpa off --perf-decode off)",
        );
    }
    if plan.start > 0 {
        return Some("quantized KV from a later position (--quantized-kv-start > 0)");
    }
    rings.then_some("quantized sliding-window caches (mlx-lm cannot batch them)")
}

/// Whether `model`'s prompts can be prefilled together (`Batch::admit_prompts`): its caches
/// are standard K/V or recurrent states (or lists of them); sliding-window rings have no
/// batched prefill here (nor in mlx-lm for a wrapped ring).
pub fn takes_prompt_batches(model: &dyn LanguageModel) -> bool {
    let kinds = [kv::KIND, arrays::KIND];
    model
        .make_caches()
        .iter()
        .all(|c| of_kinds(c.as_ref(), &kinds))
}

/// Whether `model`'s batch caches give positions back row by row (`Batch::trim_rows`, a
/// speculative verify over the batch): standard K/V only (a ring may have overwritten what
/// a row gives back; a recurrent state cannot be rewound).
pub fn trims_rows(model: &dyn LanguageModel) -> bool {
    model
        .make_caches()
        .iter()
        .all(|c| c.kind() == Some(kv::KIND))
}

/// Whether `c` is a cache the lane batches: standard, sliding-window or recurrent-state,
/// or a `CacheList` of such parts.
fn batchable(c: &dyn Cache) -> bool {
    of_kinds(c, &[kv::KIND, rotating::KIND, arrays::KIND])
}

/// Whether `c` is of one of `kinds`, a `CacheList` counting as its parts (mlx-lm's
/// `CacheList.merge` merges part by part).
fn of_kinds(c: &dyn Cache, kinds: &[&str]) -> bool {
    match (c.kind(), c.sub_caches()) {
        (Some(list::KIND), Some(parts)) => parts.iter().all(|p| of_kinds(p.as_ref(), kinds)),
        (kind, _) => kind.is_some_and(|k| kinds.contains(&k)),
    }
}

/// Merges layer `l` of every row's caches into one batch cache (the kind's `merge`, reached
/// through the first row; the rows must all be of one batchable kind).
fn merge_layer(caches: &[&[Box<dyn Cache>]], l: usize) -> Result<Box<dyn Cache>, Exception> {
    let rows: Vec<&dyn Cache> = caches.iter().map(|c| c[l].as_ref()).collect();
    let kind = rows[0].kind();
    if !batchable(rows[0]) || rows.iter().any(|r| r.kind() != kind) {
        return Err(Exception::custom(REFUSAL));
    }
    rows[0].merge(&rows)
}

fn merge_rows(caches: &[&[Box<dyn Cache>]]) -> Result<Vec<Box<dyn Cache>>, Exception> {
    let layers = caches.first().map_or(0, |c| c.len());
    (0..layers).map(|l| merge_layer(caches, l)).collect()
}

fn merge_sessions(sessions: &[Session]) -> Result<Vec<Box<dyn Cache>>, Exception> {
    let caches: Vec<&[Box<dyn Cache>]> = sessions.iter().map(|s| &s.caches[..]).collect();
    merge_rows(&caches)
}

impl<'m> Batch<'m> {
    pub fn new(model: &'m dyn LanguageModel) -> Self {
        Batch {
            model,
            caches: Vec::new(),
            kv_quant: None,
            lone: false,
            solo: None,
        }
    }

    /// The batch lane's batch: while it holds one row, that row steps as a single-sequence
    /// session (`engine generate`'s step: no batch mask, an integer RoPE offset, the compiled
    /// graph where it pays) instead of a batch of one, which costs a lone request ~25 % of its
    /// speed on a small model. Full-attention `KvCache` models only: a row's K/V move between
    /// the two forms by slicing and merging, which the batch gate checks; a sliding-window
    /// ring or a recurrent state would need layouts the gate does not cover.
    pub fn for_lane(model: &'m dyn LanguageModel) -> Self {
        // Plain K/V layers only, not lists of them: the lone row's session is checked
        // against the serial lane on those.
        let lone = model
            .make_caches()
            .iter()
            .all(|c| c.kind() == Some(kv::KIND));
        Batch {
            lone,
            ..Batch::new(model)
        }
    }

    /// Whether the only row is stepping alone (a single-sequence session).
    pub fn is_solo(&self) -> bool {
        self.solo.is_some()
    }

    /// Takes the only row `session` alone, when this batch is the lane's and empty.
    fn solo_from(&mut self, sessions: &mut Vec<Session<'m>>) -> bool {
        if !self.lone || sessions.len() != 1 || !self.caches.is_empty() || self.solo.is_some() {
            return false;
        }
        self.solo = sessions.pop();
        true
    }

    /// The lone row back into batch form (before another row joins).
    fn unsolo(&mut self) -> Result<(), Exception> {
        if let Some(session) = self.solo.take() {
            let group = self.merged(vec![session])?;
            self.caches = group.caches;
            self.kv_quant = group.kv_quant;
        }
        Ok(())
    }

    /// When one row is left in batch form, it goes on alone (`for_lane`), as a session
    /// with `opts` (its request's: its adapter's compile policy, the lane's KV plan).
    pub fn go_solo(&mut self, opts: &SessionOptions) -> Result<(), Exception> {
        if !self.lone || self.solo.is_some() || self.caches.is_empty() || self.rows() != 1 {
            return Ok(());
        }
        let caches = self
            .caches
            .iter()
            .map(|c| c.extract(0, i32::MAX))
            .collect::<Result<Vec<_>, _>>()?;
        let mut caches = caches;
        if crate::plant::is(crate::plant::Defect::LoneRowLosesNewest) {
            caches.iter_mut().for_each(|c| {
                c.trim(1);
            });
        }
        self.caches.clear();
        self.kv_quant = None;
        self.solo = Some(Session::with_caches(self.model, opts, caches));
        Ok(())
    }

    /// A batch of `sessions` merged as they stand, with their quantization plan.
    fn merged(&self, sessions: Vec<Session>) -> Result<Batch<'m>, Exception> {
        let kv_quant = sessions[0].kv_quant.clone();
        if sessions.iter().any(|s| s.kv_quant != kv_quant) {
            return Err(Exception::custom(
                "rows with different KV quantization cannot share a batch",
            ));
        }
        Ok(Batch {
            caches: merge_sessions(&sessions)?,
            kv_quant,
            ..Batch::new(self.model)
        })
    }

    pub fn rows(&mut self) -> usize {
        if self.solo.is_some() {
            return 1;
        }
        self.caches.first().and_then(|c| c.rows()).unwrap_or(0)
    }

    /// Appends the rows of `other` after this batch's rows (mlx-lm's `extend`).
    fn extend(&mut self, other: Batch) -> Result<(), Exception> {
        if self.caches.is_empty() {
            self.caches = other.caches;
            self.kv_quant = other.kv_quant;
            return Ok(());
        }
        if self.kv_quant != other.kv_quant {
            return Err(Exception::custom(
                "rows with different KV quantization cannot share a batch",
            ));
        }
        for (mine, theirs) in self.caches.iter_mut().zip(&other.caches) {
            mine.extend(theirs.as_ref())?;
        }
        Ok(())
    }

    /// Adds sessions as new rows (after the existing ones), their caches as they stand.
    pub fn join(&mut self, mut sessions: Vec<Session<'m>>) -> Result<(), Exception> {
        if sessions.is_empty() || self.solo_from(&mut sessions) {
            return Ok(());
        }
        self.unsolo()?;
        let group = self.merged(sessions)?;
        self.extend(group)
    }

    /// BatchGenerator's admission of new prompts: `sessions` hold every prompt token but
    /// the last (`last`, one per session); they are merged into a batch of their own, which
    /// feeds `last` in one step, and then appended after the existing rows. Returns that
    /// step's logits [new rows, vocab] (each row's first).
    pub fn admit(
        &mut self,
        mut sessions: Vec<Session<'m>>,
        last: &[u32],
    ) -> Result<Array, Exception> {
        if sessions.len() != last.len() || sessions.is_empty() {
            return Err(Exception::custom("one last prompt token per admitted row"));
        }
        if self.solo_from(&mut sessions) {
            let solo = self.solo.as_mut().expect("just taken");
            return solo.step(last);
        }
        self.unsolo()?;
        let mut group = self.merged(sessions)?;
        let logits = group.step(last)?;
        self.extend(group)?;
        Ok(logits)
    }

    /// BatchGenerator's prompt batch for new `prompts` (see the module header): fresh caches
    /// merged, every prompt token but the last prefilled in one right-padded forward per
    /// `prefill_step` tokens (each row's length given to the caches when they differ), the
    /// last tokens in one step; the rows appended after the existing ones. Returns that
    /// step's logits [new rows, vocab].
    pub fn admit_prompts(
        &mut self,
        prompts: &[&[u32]],
        prefill_step: usize,
    ) -> Result<Array, Exception> {
        if prompts.is_empty() || prompts.iter().any(|p| p.is_empty()) {
            return Err(Exception::custom("a prompt batch of non-empty prompts"));
        }
        self.unsolo()?;
        let fresh: Vec<Vec<Box<dyn Cache>>> =
            prompts.iter().map(|_| self.model.make_caches()).collect();
        let rows: Vec<&[Box<dyn Cache>]> = fresh.iter().map(|c| &c[..]).collect();
        let mut group = Batch {
            caches: merge_rows(&rows)?,
            ..Batch::new(self.model)
        };
        if prompts.iter().any(|p| p.len() > 1) {
            let bodies: Vec<&[u32]> = prompts.iter().map(|p| &p[..p.len() - 1]).collect();
            group.prompt(&bodies, prefill_step.max(1))?;
        }
        let last: Vec<u32> = prompts.iter().map(|p| p[p.len() - 1]).collect();
        let logits = group.step(&last)?;
        self.extend(group)?;
        Ok(logits)
    }

    /// mlx-lm's `PromptProcessingBatch.prompt`: `bodies` right-padded with id 0 to the
    /// longest, the caches told each row's length when they differ (`prepare`), fed
    /// `step` columns at a time, then `finalize`d.
    fn prompt(&mut self, bodies: &[&[u32]], step: usize) -> Result<(), Exception> {
        let lengths: Vec<i32> = bodies.iter().map(|b| b.len() as i32).collect();
        let longest = bodies.iter().map(|b| b.len()).max().unwrap_or(0);
        let padded = lengths.iter().any(|&l| l as usize != longest);
        if padded {
            for c in self.caches.iter_mut() {
                c.prepare(&lengths)?;
            }
        }
        let ids: Vec<i32> = bodies
            .iter()
            .flat_map(|b| (0..longest).map(|j| b.get(j).map_or(0, |&t| t as i32)))
            .collect();
        let ids = Array::from_slice(&ids, &[bodies.len() as i32, longest as i32]);
        let eval = |caches: &[Box<dyn Cache>]| {
            let state: Vec<&Array> = caches.iter().flat_map(|c| c.state()).collect();
            mlx_rs::transforms::eval(state)?;
            mlx_rs::memory::clear_cache()
        };
        for at in (0..longest).step_by(step) {
            let end = (at + step).min(longest) as i32;
            let chunk = ids.index((.., at as i32..end));
            self.model.forward(&chunk, &mut self.caches)?;
            eval(&self.caches)?;
        }
        if padded {
            for c in self.caches.iter_mut() {
                c.finalize()?;
            }
            eval(&self.caches)?;
        }
        Ok(())
    }

    /// Appends `other`'s rows after this batch's (a batch of one taken as it is, lone or
    /// not, when this one is empty).
    pub fn append(&mut self, mut other: Batch<'m>) -> Result<(), Exception> {
        if self.rows() == 0 {
            *self = other;
            return Ok(());
        }
        self.unsolo()?;
        other.unsolo()?;
        self.extend(other)
    }

    /// Row `row`'s caches holding its first `len` tokens, one single-sequence cache per layer.
    pub fn row_caches(&mut self, row: usize, len: i32) -> Result<Vec<Box<dyn Cache>>, Exception> {
        let caches: Vec<Box<dyn Cache>> = match &self.solo {
            Some(_) if row != 0 => return Err(Exception::custom("the lone row is row 0")),
            // Copies that share the arrays (MLX copies a shared buffer before writing it).
            Some(solo) => solo
                .caches
                .iter()
                .map(|c| {
                    let mut copy = crate::cache::duplicate(c.as_ref()).ok_or_else(|| {
                        Exception::custom("a lone row's cache without a snapshot")
                    })?;
                    copy.trim((copy.offset() - len).max(0));
                    Ok(copy)
                })
                .collect::<Result<_, Exception>>()?,
            None => self
                .caches
                .iter()
                .map(|c| c.extract(row, len))
                .collect::<Result<_, Exception>>()?,
        };
        let state: Vec<&Array> = caches.iter().flat_map(|c| c.state()).collect();
        mlx_rs::transforms::eval(state)?;
        Ok(caches)
    }

    /// Keeps rows `keep` (in that order).
    pub fn keep(&mut self, keep: &[usize]) -> Result<(), Exception> {
        if keep.is_empty() {
            self.caches.clear();
            self.solo = None;
            return Ok(());
        }
        if self.solo.is_some() {
            return match keep {
                [0] => Ok(()),
                _ => Err(Exception::custom("the lone row is the batch's only row")),
            };
        }
        for c in self.caches.iter_mut() {
            c.filter(keep)?;
        }
        Ok(())
    }

    /// Feeds every row a run of ids of one common length (its next id and its drafts) in
    /// one forward; returns the logits of every position, [B, len, vocab]. A lone row goes
    /// back into batch form first.
    pub fn verify(&mut self, runs: &[Vec<u32>]) -> Result<Array, Exception> {
        if crate::plant::is(crate::plant::Defect::BatchVerifyFails) {
            return Err(Exception::custom("injected fault: a verify forward"));
        }
        self.feed_runs(runs)
    }

    /// Feeds every row its run of ids (one length for all) in one forward: the logits of
    /// every position, [B, len, vocab] (a drafter's first step, `batch_draft`).
    pub fn feed_runs(&mut self, runs: &[Vec<u32>]) -> Result<Array, Exception> {
        self.unsolo()?;
        let len = runs.first().map_or(0, Vec::len);
        if runs.len() != self.rows() || len == 0 || runs.iter().any(|r| r.len() != len) {
            return Err(Exception::custom(
                "one run of ids per batch row, every run of one length",
            ));
        }
        let ids: Vec<i32> = runs.iter().flatten().map(|&i| i as i32).collect();
        let ids = Array::from_slice(&ids, &[runs.len() as i32, len as i32]);
        let logits = self.model.forward(&ids, &mut self.caches)?;
        if let Some(plan) = &self.kv_quant {
            plan.apply(&mut self.caches)?;
        }
        Ok(logits)
    }

    /// Drops the last `n[r]` tokens of each row `r` from every layer's cache (a verify's
    /// rejected drafts; `Cache::trim_rows`).
    pub fn trim_rows(&mut self, n: &[usize]) -> Result<(), Exception> {
        let n: Vec<i32> = n.iter().map(|&k| k as i32).collect();
        for c in self.caches.iter_mut() {
            c.trim_rows(&n)?;
        }
        Ok(())
    }

    /// Feeds one token per row; returns the logits [B, vocab].
    pub fn step(&mut self, ids: &[u32]) -> Result<Array, Exception> {
        let ids: Vec<i32> = ids.iter().map(|&i| i as i32).collect();
        self.step_ids(&Array::from_slice(&ids, &[ids.len() as i32]))
    }

    /// As `step`, with the ids still an MLX array [B] (e.g. lazy samples).
    pub fn step_ids(&mut self, ids: &Array) -> Result<Array, Exception> {
        if ids.size() != self.rows() {
            return Err(Exception::custom("one token per batch row"));
        }
        if crate::plant::is(crate::plant::Defect::BatchFaultOnId1000) {
            let fed = ids.as_dtype(mlx_rs::Dtype::Uint32)?;
            fed.eval()?;
            if fed.as_slice::<u32>().contains(&1000) {
                return Err(Exception::custom("injected fault: a forward fed id 1000"));
            }
        }
        if let Some(solo) = self.solo.as_mut() {
            return solo.step_array(&ids.reshape(&[1])?);
        }
        let logits = self
            .model
            .forward(&ids.reshape(&[-1, 1])?, &mut self.caches)?;
        if let Some(plan) = &self.kv_quant {
            plan.apply(&mut self.caches)?;
        }
        Ok(logits.index((.., -1, ..)))
    }
}
