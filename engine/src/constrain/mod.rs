//! Constrained decoding (structured outputs): a grammar — a JSON schema, any JSON object,
//! a regex or a Lark grammar — compiled by llguidance over the model's tokenizer into a
//! per-step token mask. The mask is a logits processor: disallowed ids get −∞ before
//! log-probabilities and sampling, so temperature, the filters, the penalties and both
//! server lanes work unchanged on the ids the grammar allows; an EOS id is allowed only
//! where the grammar accepts (llguidance's own rule).
//!
//! The grammar engine is llguidance's (MIT; the one llama.cpp and vLLM use), not ours.
//! Its tokenizer view (`Env`) is built once per tokenizer: every id's bytes from
//! `tokenizer.json` (llguidance's own reader) in a token trie, and our tokenizer for
//! re-tokenizing text.

mod env;
pub mod openai;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::SimpleVob;
use llguidance::Matcher;
use mlx_rs::error::Exception;
use mlx_rs::Array;

use crate::plant::{self, Defect};
pub use env::{env_for, Env};

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
#[derive(Debug, Clone, PartialEq)]
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
}

/// One request's constraint: the matcher and where in the history its answer begins.
pub struct Constraint {
    matcher: Matcher,
    /// The history's length at the first step (the prompt); ids after it are the answer.
    base: Option<usize>,
    consumed: usize,
}

impl Constraint {
    pub fn new(env: &Env, grammar: &Grammar) -> Result<Self, String> {
        let parser = env
            .factory
            .create_parser(grammar.top_level())
            .map_err(|e| e.to_string())?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(e);
        }
        Ok(Constraint {
            matcher,
            base: None,
            consumed: 0,
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
        self.matcher
            .consume_tokens(new)
            .map_err(|e| Exception::custom(format!("constrained decoding: {e}")))
    }

    /// The allowed ids now (after `sync`).
    fn allowed(&mut self) -> Result<SimpleVob, Exception> {
        self.matcher
            .compute_mask_or_eos()
            .map_err(|e| Exception::custom(format!("constrained decoding: {e}")))
    }

    /// `logits` [1, vocab] with every id the grammar does not allow after `history` set
    /// to −∞ (allowed ids keep their logits bit for bit: + 0).
    pub fn apply(&mut self, logits: &Array, history: &[u32]) -> Result<Array, Exception> {
        self.sync(history)?;
        if plant::is(Defect::ConstrainMaskNotApplied) {
            return Ok(logits.clone());
        }
        let allowed = self.allowed()?;
        let vocab = logits.shape().last().copied().unwrap_or(0).max(0) as usize;
        let shift = usize::from(plant::is(Defect::ConstrainMaskOffByOne));
        let mut bias = vec![f32::NEG_INFINITY; vocab];
        let mut any = false;
        allowed.iter_set_entries(|i| {
            if let Some(b) = bias.get_mut(i + shift) {
                *b = 0.0;
                any = true;
            }
        });
        if !any {
            return Err(Exception::custom(
                "constrained decoding: the grammar allows no token of this model here \
                 (complete, and the model has no EOS id)",
            ));
        }
        let bias = Array::from_slice(&bias, &[1, vocab as i32]).as_dtype(logits.dtype())?;
        logits.add(&bias)
    }
}
