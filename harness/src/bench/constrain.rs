//! `harness bench --suite constrain`: what the structured-outputs mask costs per token.
//! Per model, two engine legs on the same prompt ids, greedy, the same --max-tokens: plain
//! decoding (stack `engine`; EOS does not stop it) and decoding constrained to `schema()`
//! (stack `engine-json-schema`: llguidance's mask on every step; it stops where the grammar
//! is complete and the model's EOS is the only id left). Each leg is a fresh process (one
//! discarded warm-up, then one measured generation), legs alternate ABBA over --rounds, and
//! every number is the median over the rounds. Decode tok/s is over the tokens each leg
//! actually generated (a constrained answer may end early); both counts are recorded.
//!
//! The constrained leg also reports, outside the timed run: building llguidance's view of
//! the tokenizer (the token trie, once per tokenizer and process), compiling the schema, and
//! the mask on its own — the same ids replayed through a fresh constraint, `apply` (mask
//! computed, bias built, added to the logits) and its evaluation timed per token.
//!
//! The models: `tiny-llama-trained` (committed; a trained 1 024-id byte-level BPE) and the
//! bench model `qwen3-vocab-tiny` (random weights, the real 151 936-id Qwen3 vocabulary and
//! tokenizer). The `tiny` bench model cannot take part: its word-level vocabulary (`t0` …
//! `t4095`, no decoder) has no llguidance view at all ("can't determine decoder type"; tested).

use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Context, Result};
use engine::load::tokenizer::Tokenizer;
use serde::{Deserialize, Serialize};

use super::median;
use crate::db::{Db, RowContext};

/// The suite's models, in the order they run and are shown.
pub const MODELS: [&str; 2] = ["tiny-llama-trained", "qwen3-vocab-tiny"];
pub const PLAIN: &str = "engine";
pub const SCHEMA: &str = "engine-json-schema";
/// What the rows' params call `schema()`.
pub const SCHEMA_NAME: &str = "user-record";

/// The prompt (its ids under each model's tokenizer); random weights do not read it.
pub const PROMPT: &str = "Return the user record of the new account as JSON: the full name, \
the age, the role, the email address, at least four tags, the postal address and a paragraph \
of notes about the account.";

/// A realistic response schema: strings with length bounds, an integer range, an enum, an
/// array with minItems, a nested object and a long free-text field, so that a constrained
/// answer runs about as long as the plain one (≥ 64 tokens) before it can close.
pub fn schema() -> serde_json::Value {
    let text = |min: u32, max: u32| serde_json::json!({"type": "string", "minLength": min, "maxLength": max});
    serde_json::json!({
        "type": "object",
        "properties": {
            "name": text(12, 40),
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"type": "string", "enum": ["admin", "editor", "viewer", "guest"]},
            "email": text(8, 60),
            "tags": {"type": "array", "items": text(4, 16), "minItems": 4, "maxItems": 8},
            "address": {
                "type": "object",
                "properties": {
                    "street": text(8, 40),
                    "city": text(4, 24),
                    "zip": {"type": "integer", "minimum": 10000, "maximum": 99999},
                },
                "required": ["street", "city", "zip"],
                "additionalProperties": false,
            },
            "notes": text(64, 400),
        },
        "required": ["name", "age", "role", "email", "tags", "address", "notes"],
        "additionalProperties": false,
    })
}

/// What one leg prints (`harness leg-constrain`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ConstrainLeg {
    pub stack: String,
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    pub ttft_s: f64,
    pub decode_tps: f64,
    /// Constrained legs: the answer closed (grammar complete, EOS) before --max-tokens.
    #[serde(default)]
    pub complete: bool,
    #[serde(default)]
    pub env_build_ms: Option<f64>,
    #[serde(default)]
    pub compile_ms: Option<f64>,
    #[serde(default)]
    pub mask_us_per_token: Option<f64>,
    /// Of the mask, the bias array's part (built, added, evaluated; no llguidance).
    #[serde(default)]
    pub bias_us_per_token: Option<f64>,
}

mod leg;
mod promote;

pub use leg::{check_answer, leg, LegArgs};
pub use promote::promote_table;

/// A model of the suite: the directory and its vocabulary (the model's width).
fn model_dir(name: &str) -> Result<(PathBuf, i32)> {
    if let Some(m) = super::models::by_name(name) {
        if m.real_tokenizer().is_none() {
            bail!("bench model `{name}` has a word-level vocabulary that cannot spell JSON");
        }
        return Ok((m.ensure()?, m.vocab));
    }
    let dir = crate::goldens::model_dir(name)?;
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json"))?)?;
    let vocab = config["vocab_size"]
        .as_i64()
        .context("config.json: vocab_size")? as i32;
    Ok((dir, vocab))
}

/// One model's median legs.
pub struct ConstrainResult {
    pub model: String,
    pub vocab: i32,
    pub prompt_tokens: usize,
    pub plain: ConstrainLeg,
    pub schema: ConstrainLeg,
    /// Every leg's `decode_tps` and `ttft_ms`, in the order they ran.
    pub kept: super::kept::Kept,
}

/// The median leg of `legs` (all one stack); counts and completeness from the first (greedy
/// decoding gives the same ids every round).
fn median_leg(legs: &[&ConstrainLeg]) -> ConstrainLeg {
    let m = |f: fn(&ConstrainLeg) -> f64| median(legs.iter().map(|l| f(l)).collect());
    let opt = |f: fn(&ConstrainLeg) -> Option<f64>| {
        let v: Vec<f64> = legs.iter().filter_map(|l| f(l)).collect();
        (!v.is_empty()).then(|| median(v))
    };
    ConstrainLeg {
        stack: legs[0].stack.clone(),
        prompt_tokens: legs[0].prompt_tokens,
        generated_tokens: legs[0].generated_tokens,
        ttft_s: m(|l| l.ttft_s),
        decode_tps: m(|l| l.decode_tps),
        complete: legs[0].complete,
        env_build_ms: opt(|l| l.env_build_ms),
        compile_ms: opt(|l| l.compile_ms),
        mask_us_per_token: opt(|l| l.mask_us_per_token),
        bias_us_per_token: opt(|l| l.bias_us_per_token),
    }
}

/// Runs the suite: every model, plain and constrained legs ABBA over `rounds`.
pub fn run(rounds: usize, max_tokens: usize) -> Result<Vec<ConstrainResult>> {
    let stacks = [PLAIN, SCHEMA];
    let order = super::leg_order(rounds, &stacks);
    let bar = super::Progress::new("constrain", MODELS.len() * order.len());
    let tmp = tempfile::tempdir()?;
    let mut results = Vec::new();
    for name in MODELS {
        bar.start(format!("preparing {name}"));
        let (dir, vocab) = model_dir(name)?;
        let ids = Tokenizer::load(&dir)?.encode(PROMPT, true)?;
        let file = tmp.path().join(format!("{name}.json"));
        std::fs::write(&file, serde_json::to_string(&ids)?)?;
        let mut all = Vec::new();
        let mut kept = super::kept::Kept::default();
        for stack in &order {
            bar.start(format!("{name} · {stack}"));
            let mut cmd = Command::new(std::env::current_exe()?);
            cmd.arg("leg-constrain")
                .arg("--model")
                .arg(&dir)
                .arg("--prompt-ids")
                .arg(&file)
                .arg("--max-tokens")
                .arg(max_tokens.to_string());
            if *stack == SCHEMA {
                cmd.arg("--constrained");
            }
            let leg = super::run_json_leg::<ConstrainLeg>(&mut cmd, &format!("{name} {stack}"))?;
            kept.push(
                stack,
                [
                    ("decode_tps".to_owned(), leg.decode_tps),
                    ("ttft_ms".to_owned(), leg.ttft_s * 1e3),
                ],
            );
            all.push(leg);
            bar.done();
        }
        let of = |s: &str| median_leg(&all.iter().filter(|l| l.stack == s).collect::<Vec<_>>());
        results.push(ConstrainResult {
            model: name.into(),
            vocab,
            prompt_tokens: ids.len(),
            plain: of(PLAIN),
            schema: of(SCHEMA),
            kept,
        });
    }
    bar.finish();
    Ok(results)
}

impl ConstrainResult {
    /// Constrained tok/s over plain tok/s.
    pub fn ratio(&self) -> f64 {
        self.schema.decode_tps / self.plain.decode_tps
    }

    /// The time the mask adds per token, from the two decode rates (µs).
    pub fn added_us(&self) -> f64 {
        (1.0 / self.schema.decode_tps - 1.0 / self.plain.decode_tps) * 1e6
    }

    /// (stack, metric, value, unit) rows.
    pub fn rows(&self) -> Vec<(&'static str, &'static str, f64, &'static str)> {
        let (p, s) = (&self.plain, &self.schema);
        let mut rows = vec![
            (PLAIN, "decode_tps", p.decode_tps, "tok/s"),
            (
                PLAIN,
                "generated_tokens",
                p.generated_tokens as f64,
                "tokens",
            ),
            (SCHEMA, "decode_tps", s.decode_tps, "tok/s"),
            (
                SCHEMA,
                "generated_tokens",
                s.generated_tokens as f64,
                "tokens",
            ),
            (SCHEMA, "decode_ratio_vs_plain", self.ratio(), "x"),
            (SCHEMA, "decode_cost_pct", (1.0 - self.ratio()) * 100.0, "%"),
            (SCHEMA, "added_us_per_token", self.added_us(), "µs"),
            (
                SCHEMA,
                "answer_complete",
                f64::from(u8::from(s.complete)),
                "bool",
            ),
        ];
        for (metric, v, unit) in [
            ("mask_us_per_token", s.mask_us_per_token, "µs"),
            ("bias_us_per_token", s.bias_us_per_token, "µs"),
            ("tokenizer_env_ms", s.env_build_ms, "ms"),
            ("schema_compile_ms", s.compile_ms, "ms"),
        ] {
            if let Some(v) = v {
                rows.push((SCHEMA, metric, v, unit));
            }
        }
        rows
    }

    pub fn table(&self) -> String {
        let words = self
            .kept
            .lines(&[("decode_tps", "tok/s", true)], SCHEMA, Some(PLAIN));
        self.medians_table() + &words
    }

    fn medians_table(&self) -> String {
        let (p, s) = (&self.plain, &self.schema);
        let opt = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.1}"));
        format!(
            "constrain {} (vocab {}, prompt {} tokens, greedy; schema {SCHEMA_NAME})\n  \
             plain        {:8.1} tok/s over {} tokens\n  \
             json-schema  {:8.1} tok/s over {} tokens{}\n  \
             ratio {:.3}× (cost {:.1} %), {:.0} µs added per token; mask alone {} µs/token (its bias array {} µs); \
             tokenizer view {} ms, schema compile {} ms\n",
            self.model,
            self.vocab,
            self.prompt_tokens,
            p.decode_tps,
            p.generated_tokens,
            s.decode_tps,
            s.generated_tokens,
            if s.complete {
                " (answer complete)"
            } else {
                " (max tokens)"
            },
            self.ratio(),
            (1.0 - self.ratio()) * 100.0,
            self.added_us(),
            opt(s.mask_us_per_token),
            opt(s.bias_us_per_token),
            opt(s.env_build_ms),
            opt(s.compile_ms),
        )
    }
}

/// Stores every result's rows; returns how many.
pub fn record(
    db: &Db,
    ctx: &RowContext,
    results: &[ConstrainResult],
    rounds: usize,
    max_tokens: usize,
) -> Result<usize> {
    let mut n = 0;
    for r in results {
        let params = serde_json::json!({
            "prompt_tokens": r.prompt_tokens, "max_tokens": max_tokens, "rounds": rounds,
            "vocab": r.vocab, "schema": SCHEMA_NAME,
        });
        for (stack, metric, value, unit) in r.rows() {
            // Each leg, and the constrained/plain decode ratio's interval over paired rounds.
            let params = match metric {
                "decode_ratio_vs_plain" => {
                    r.kept
                        .row_params(params.clone(), SCHEMA, Some(PLAIN), "decode_tps")
                }
                _ => r.kept.row_params(params.clone(), stack, None, metric),
            };
            db.insert(&ctx.row(
                "constrain",
                &r.model,
                (metric, value, unit),
                stack,
                None,
                params,
            ))?;
            n += 1;
        }
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn leg(stack: &str, tps: f64, tokens: usize, mask: Option<f64>) -> ConstrainLeg {
        ConstrainLeg {
            stack: stack.into(),
            prompt_tokens: 40,
            generated_tokens: tokens,
            ttft_s: 0.01,
            decode_tps: tps,
            complete: false,
            env_build_ms: mask.map(|_| 900.0),
            compile_ms: mask.map(|_| 2.0),
            mask_us_per_token: mask,
            bias_us_per_token: mask.map(|m| m / 2.0),
        }
    }

    pub(super) fn result() -> ConstrainResult {
        let plain = [
            leg(PLAIN, 100.0, 128, None),
            leg(PLAIN, 120.0, 128, None),
            leg(PLAIN, 110.0, 128, None),
        ];
        let schema = [
            leg(SCHEMA, 80.0, 128, Some(300.0)),
            leg(SCHEMA, 99.0, 128, Some(200.0)),
            leg(SCHEMA, 90.0, 128, Some(250.0)),
        ];
        ConstrainResult {
            model: "qwen3-vocab-tiny".into(),
            vocab: 151_936,
            prompt_tokens: 40,
            plain: median_leg(&plain.iter().collect::<Vec<_>>()),
            schema: median_leg(&schema.iter().collect::<Vec<_>>()),
            kept: Default::default(),
        }
    }

    #[test]
    fn the_leg_line_parses_and_medians_are_per_field() {
        let line = r#"{"stack":"engine-json-schema","prompt_tokens":40,"generated_tokens":97,"ttft_s":0.02,"decode_tps":88.5,"complete":true,"env_build_ms":812.0,"compile_ms":1.5,"mask_us_per_token":240.0}"#;
        let l: ConstrainLeg = serde_json::from_str(line).unwrap();
        assert_eq!(
            (l.generated_tokens, l.complete, l.mask_us_per_token),
            (97, true, Some(240.0))
        );
        // A plain leg's line has no constrained-only fields.
        let p: ConstrainLeg = serde_json::from_str(
            r#"{"stack":"engine","prompt_tokens":40,"generated_tokens":128,"ttft_s":0.02,"decode_tps":120.0}"#,
        )
        .unwrap();
        assert_eq!((p.complete, p.mask_us_per_token), (false, None));
        let r = result();
        assert_eq!((r.plain.decode_tps, r.schema.decode_tps), (110.0, 90.0));
        assert_eq!(r.schema.mask_us_per_token, Some(250.0));
    }

    #[test]
    fn rows_state_the_ratio_cost_and_token_counts() {
        let r = result();
        let rows = r.rows();
        let get = |stack: &str, metric: &str| {
            rows.iter()
                .find(|x| x.0 == stack && x.1 == metric)
                .unwrap()
                .2
        };
        assert!((get(SCHEMA, "decode_ratio_vs_plain") - 90.0 / 110.0).abs() < 1e-12);
        assert!((get(SCHEMA, "decode_cost_pct") - (1.0 - 90.0 / 110.0) * 100.0).abs() < 1e-9);
        assert!((get(SCHEMA, "added_us_per_token") - (1e6 / 90.0 - 1e6 / 110.0)).abs() < 1e-6);
        assert_eq!(
            (
                get(PLAIN, "generated_tokens"),
                get(SCHEMA, "generated_tokens")
            ),
            (128.0, 128.0)
        );
        assert_eq!(get(SCHEMA, "mask_us_per_token"), 250.0);
        assert!(!rows
            .iter()
            .any(|x| x.0 == PLAIN && x.1 == "mask_us_per_token"));
        assert!(r.table().contains("cost 18.2 %"), "{}", r.table());
    }
}
