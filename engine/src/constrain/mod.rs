//! Constrained decoding (structured outputs): a grammar — a JSON schema, any JSON object,
//! a regex or a Lark grammar — compiled by llguidance over the model's tokenizer into a
//! per-step token mask. The mask is a logits processor: disallowed ids get −∞ before
//! log-probabilities and sampling, so temperature, the filters, the penalties and both
//! server lanes work unchanged on the ids the grammar allows; an EOS id is allowed only
//! where the grammar accepts (llguidance's own rule).
//!
//! The mask costs little per token: llguidance's allowed set stays a bitmask (its u32
//! words, vocab/32 of them) that MLX expands to a boolean row on the device (`select`, so
//! allowed logits are untouched bit for bit), and each step's forward is started
//! (`async_eval`) before the grammar engine computes the mask on this thread, so the two
//! overlap. Under speculation the drafts are checked against the mask: cut before the
//! first id the grammar refuses, each verify row masked with the mask at its position
//! (`Constraint::draft_masks`: the matcher advanced over the drafts, then rolled back).
//!
//! The grammar engine is llguidance's (MIT; the one llama.cpp and vLLM use), not ours.
//! Its tokenizer view (`Env`) is built once per tokenizer: every id's bytes from
//! `tokenizer.json` (llguidance's own reader) in a token trie, and our tokenizer for
//! re-tokenizing text.

mod env;
mod limits;
pub mod openai;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::SimpleVob;
use llguidance::Matcher;
use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;

use crate::plant::{self, Defect};
pub use env::{env_for, Env};
pub use limits::{set_work, Work, LIMITS, MAX_GRAMMAR_BYTES};

/// What begins every error the grammar engine raises for a request on the model thread:
/// its grammar compiled over the model's tokenizer, or a step over the limits while the
/// answer is generated. Those are the request's fault (`grammar_fault`), never the server's.
pub const RUNTIME_ERROR: &str = "constrained decoding: ";

/// The grammar engine's reason, when `message` (an error raised while a request was
/// generated) is one of its (`RUNTIME_ERROR`).
pub fn grammar_fault(message: &str) -> Option<&str> {
    let why = message.strip_prefix(RUNTIME_ERROR)?;
    // llguidance ends some errors with a marker of its non-verbose mode.
    Some(why.trim_end().trim_end_matches("<non-verbose/>").trim_end())
}

/// `schema` answered as compact JSON (no whitespace between tokens: a small model would
/// otherwise fill its answer with newlines), unless it says otherwise in `x-guidance`.
fn compact(schema: &serde_json::Value) -> serde_json::Value {
    let mut schema = schema.clone();
    if let Some(o) = schema.as_object_mut() {
        o.entry("x-guidance")
            .or_insert_with(|| serde_json::json!({"whitespace_flexible": false}));
    }
    schema
}

/// What a request's answer must match.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum Grammar {
    /// `response_format: {"type": "json_schema", ...}`, `--json-schema FILE`.
    JsonSchema(serde_json::Value),
    /// `response_format: {"type": "json_object"}`: any JSON object.
    JsonObject,
    /// The `regex` extension, `--regex`.
    Regex(String),
    /// The `grammar` extension: a Lark grammar (llguidance's dialect).
    Lark(String),
}

impl Grammar {
    fn top_level(&self) -> TopLevelGrammar {
        match self {
            Grammar::JsonSchema(s) => TopLevelGrammar::from_json_schema(compact(s)),
            Grammar::JsonObject => {
                TopLevelGrammar::from_json_schema(compact(&serde_json::json!({"type": "object"})))
            }
            Grammar::Regex(r) => TopLevelGrammar::from_regex(r),
            Grammar::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
        }
    }

    /// Compiles the grammar without a model's tokenizer (over single bytes), so that a
    /// request can be refused with the grammar engine's reason before it is queued.
    pub fn check(&self) -> Result<(), String> {
        Constraint::new(env::byte_env(), self).map(|_| ())
    }

    /// The grammar's text size in bytes (a schema as compact JSON).
    pub fn size(&self) -> usize {
        match self {
            Grammar::JsonSchema(s) => s.to_string().len(),
            Grammar::JsonObject => 0,
            Grammar::Regex(r) | Grammar::Lark(r) => r.len(),
        }
    }
}

/// One request's constraint: the matcher and where in the history its answer begins.
pub struct Constraint {
    matcher: Matcher,
    /// The tokenizer's EOS ids (a draft that is one ends the drafts checked).
    eos: SimpleVob,
    /// The history's length at the first step (the prompt); ids after it are the answer.
    base: Option<usize>,
    consumed: usize,
    /// The packed masks of the rows being masked (reused from step to step).
    words: Vec<u32>,
}

impl Constraint {
    /// The grammar compiled over `env` (a grammar over the limits refused: `limits`).
    pub fn new(env: &Env, grammar: &Grammar) -> Result<Self, String> {
        limits::check_size(grammar)?;
        let parser = env
            .factory
            .create_parser(grammar.top_level())
            .map_err(|e| limits::explain(&e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(limits::explain(&e));
        }
        Ok(Constraint {
            matcher,
            eos: env.factory.tok_env().tok_trie().eos_token_set(),
            base: None,
            consumed: 0,
            words: Vec::new(),
        })
    }

    /// Feeds the matcher the ids emitted since the last step (`history`: prompt plus
    /// answer so far).
    fn sync(&mut self, history: &[u32]) -> Result<(), Exception> {
        let base = *self.base.get_or_insert(history.len());
        let new = &history[(base + self.consumed).min(history.len())..];
        self.consumed += new.len();
        if plant::is(Defect::ConstrainMaskNotApplied) {
            return Ok(());
        }
        self.matcher.consume_tokens(new).map_err(|e| {
            // A limit reached while advancing is the grammar's; any other refusal of an id
            // is ours: the mask let through an id the grammar does not allow.
            let e = e.to_string();
            match limits::is_limit(&e) {
                true => Self::grammar_error(limits::explain(&e)),
                false => Exception::custom(format!(
                    "the token mask let through an id the grammar refuses: {e}"
                )),
            }
        })
    }

    /// The allowed ids now (after `sync`).
    fn allowed(&mut self) -> Result<SimpleVob, Exception> {
        self.matcher
            .compute_mask_or_eos()
            .map_err(|e| Self::grammar_error(limits::explain(&e.to_string())))
    }

    fn grammar_error(e: impl std::fmt::Display) -> Exception {
        Exception::custom(format!("{RUNTIME_ERROR}{e}"))
    }

    /// `logits` [1, vocab] with every id the grammar does not allow after `history` set
    /// to −∞ (allowed ids keep their logits bit for bit: a select). The logits' forward is
    /// started first, so MLX runs it while the mask is computed here.
    pub fn apply(&mut self, logits: &Array, history: &[u32]) -> Result<Array, Exception> {
        mlx_rs::transforms::async_eval([logits])?;
        self.sync(history)?;
        if plant::is(Defect::ConstrainMaskNotApplied) {
            return Ok(logits.clone());
        }
        let allowed = self.allowed()?;
        self.mask_rows(logits, &[allowed])
    }

    /// A verify pass's masks after `history`: `drafts` cut before the first id the grammar
    /// refuses (or an EOS id, which ends the answer anyway), and the mask at each kept
    /// draft's position plus the one after them — (kept, masks), `masks.len() == kept + 1`
    /// (row i of the verify pass is masked with `masks[i]`). The matcher is advanced over
    /// the kept drafts to find them and rolled back after: it ends where it began.
    pub fn draft_masks(
        &mut self,
        history: &[u32],
        drafts: &[u32],
    ) -> Result<(usize, Vec<SimpleVob>), Exception> {
        self.sync(history)?;
        if plant::is(Defect::ConstrainMaskNotApplied) {
            return Ok((drafts.len(), Vec::new()));
        }
        let mut masks = Vec::with_capacity(drafts.len() + 1);
        if plant::is(Defect::SpecDraftsUnmasked) {
            // Planted: the drafts are neither checked nor masked past the first row.
            masks.push(self.allowed()?);
            let all = SimpleVob::alloc_ones(masks[0].len());
            masks.extend(std::iter::repeat_n(all, drafts.len()));
            return Ok((drafts.len(), masks));
        }
        let mut kept = 0;
        for &d in drafts {
            let mask = self.allowed()?;
            let ok = mask.is_allowed(d) && !self.eos.is_allowed(d);
            masks.push(mask);
            if !ok {
                break;
            }
            self.matcher.consume_token(d).map_err(Self::grammar_error)?;
            kept += 1;
        }
        if kept == drafts.len() {
            masks.push(self.allowed()?);
        }
        self.matcher.rollback(kept).map_err(Self::grammar_error)?;
        Ok((kept, masks))
    }

    /// `logits` [rows, vocab] (or [vocab] for one row) with row i masked by `masks[i]`:
    /// the masks' u32 words go to MLX as they are ([rows, vocab/32]) and are expanded to
    /// booleans there; disallowed ids become −∞ through a select.
    pub fn mask_rows(&mut self, logits: &Array, masks: &[SimpleVob]) -> Result<Array, Exception> {
        let vocab = logits.shape().last().copied().unwrap_or(0).max(0) as usize;
        let nw = vocab.div_ceil(32).max(1);
        let rows = masks.len();
        self.words.clear();
        self.words.resize(rows * nw, 0);
        for (mask, out) in masks.iter().zip(self.words.chunks_mut(nw)) {
            let shifted;
            let mask = if plant::is(Defect::ConstrainMaskOffByOne) {
                shifted = shift_up(mask);
                &shifted
            } else {
                mask
            };
            if !pack(mask, vocab, out) {
                return Err(Self::grammar_error(
                    "the grammar allows no token of this model here (complete, and the \
                     model has no EOS id)",
                ));
            }
        }
        let words = Array::from_slice(&self.words, &[rows as i32, nw as i32, 1]);
        let pow2: Vec<u32> = (0..32).map(|k| 1u32 << k).collect();
        let pow2 = Array::from_slice(&pow2, &[1, 1, 32]);
        let two = Array::from_slice(&[2u32], &[1]);
        let allowed = words
            .floor_divide(&pow2)?
            .remainder(&two)?
            .as_dtype(mlx_rs::Dtype::Bool)?
            .reshape(&[rows as i32, (nw * 32) as i32])?
            .index((.., ..vocab as i32))
            .reshape(logits.shape())?;
        let neg_inf = Array::from_f32(f32::NEG_INFINITY).as_dtype(logits.dtype())?;
        mlx_rs::ops::select(&allowed, logits, &neg_inf)
    }
}

/// Copies `mask`'s words for ids below `vocab` into `out` (vocab/32 words, rounded up;
/// ids past the mask's own length stay refused). Whether any id is allowed.
fn pack(mask: &SimpleVob, vocab: usize, out: &mut [u32]) -> bool {
    let src = mask.as_slice();
    let n = out.len().min(src.len());
    out[..n].copy_from_slice(&src[..n]);
    if !vocab.is_multiple_of(32) {
        if let Some(last) = out.last_mut() {
            *last &= (1u32 << (vocab % 32)) - 1;
        }
    }
    out.iter().any(|&w| w != 0)
}

/// The planted off-by-one: id i's verdict moved to id i + 1.
fn shift_up(mask: &SimpleVob) -> SimpleVob {
    let mut out = SimpleVob::alloc(mask.len() + 1);
    mask.iter_set_entries(|i| out.allow_token(i as u32 + 1));
    out
}
