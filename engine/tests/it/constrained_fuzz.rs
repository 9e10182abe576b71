//! Constrained decoding under a fuzz (issue 45): no grammar a client sends makes the server
//! answer 5xx. 2,000 generated JSON schemas (nesting, `$ref` cycles, `anyOf`/`oneOf`/
//! `allOf`, enums and consts, patterns, numeric and length bounds, formats, every
//! `additionalProperties` form) and 200 regexes and 100 Lark grammars, on tiny-llama-trained's
//! tokenizer:
//!
//! - **The sampler both lanes call** (`Sampler::pick`: the serial lane's decode core and
//!   each batch row), fed random logits (a seeded "model" that likes to stop where the
//!   grammar lets it) instead of a forward, so 2,300 grammars take seconds: each grammar is
//!   refused before generation (a 400, as `Grammar::check` and the sampler's compile over the
//!   tokenizer say), or ends in a grammar-limit 400 (`ApiError::generation`), or is
//!   answered; never a server error (5xx). Every answer that ended by the grammar (EOS)
//!   validates: a schema's with the `jsonschema` crate, a regex's or Lark grammar's by a
//!   full match of the equivalent `regex`.
//! - **Through the server, both lanes**: the recursive-`$ref` schema of the issue and its
//!   streamed twin (4xx, or an error event in the stream), and 24 fuzz schemas each sent
//!   with a plain request beside it: 200 or 400, never 5xx; the plain request answered.
//! - **Planted**: the mask off by one (`ConstrainMaskOffByOne`: ids the grammar refuses get
//!   through, which the matcher then reports as the server's fault) and no mask at all
//!   (`ConstrainMaskNotApplied`: answers that violate their schemas) are each caught.

use std::sync::Arc;
use std::time::{Duration, Instant};

use engine::constrain::Grammar;
use engine::generate::sampler::{constrain, Sampler, SamplingParams};
use engine::load::tokenizer::Tokenizer;
use engine::plant::{self, Defect};
use engine::serve::error::ApiError;
use mlx_rs::Array;
use serde_json::{json, Map, Value};

use crate::common;
use crate::common::server::{http, post, serve_model};

const MODEL: &str = "tiny-llama-trained";
const SCHEMAS: u64 = 2_000;
const REGEXES: u64 = 200;
const LARKS: u64 = 100;
/// Ids per answer at most (an answer still open then is cut, and not judged).
const MAX_IDS: usize = 96;

/// A small deterministic generator (the same cases in every run).
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03)
    }

    fn next(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % n.max(1)
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.next(items.len() as u64) as usize]
    }
}

// ---- The schema generator -------------------------------------------------------------

const PATTERNS: [&str; 6] = [
    "^[a-z]{1,4}$",
    "^[0-9]{2}-[0-9]{2}$",
    "^(yes|no)$",
    "^x+$",
    "^[A-Z][a-z]*$",
    "a|b",
];
const FORMATS: [&str; 6] = ["date", "time", "date-time", "email", "uuid", "ipv4"];

fn leaf(r: &mut Rng) -> Value {
    match r.next(11) {
        0 => {
            let lo = r.next(40) as i64 - 20;
            json!({"type": "integer", "minimum": lo, "maximum": lo + r.next(100) as i64})
        }
        // Bounded: the judge reads numbers as f64, exact only up to 2^53.
        1 => json!({"type": "integer", "exclusiveMinimum": 0, "maximum": 1_000_000,
                    "multipleOf": 1 + r.next(5)}),
        2 => json!({"type": "number", "minimum": -1.5, "maximum": 2.5 + r.next(10) as f64}),
        3 => {
            let all = [
                json!("red"),
                json!(7),
                Value::Null,
                json!(true),
                json!([1]),
                json!({"k": 1}),
            ];
            json!({"enum": all[..1 + r.next(6) as usize]})
        }
        4 => json!({"const": *r.pick(&[json!("fixed"), json!(3), json!(false)])}),
        5 => json!({"type": "boolean"}),
        6 => json!({"type": "null"}),
        7 => {
            let min = r.next(3);
            json!({"type": "string", "minLength": min, "maxLength": min + r.next(6)})
        }
        8 => json!({"type": "string", "pattern": r.pick(&PATTERNS)}),
        9 => json!({"type": "string", "format": r.pick(&FORMATS)}),
        _ => json!({"type": ["string", "null"], "maxLength": 3}),
    }
}

fn node(r: &mut Rng, depth: u64) -> Value {
    if depth == 0 {
        return leaf(r);
    }
    match r.next(9) {
        0 | 1 => leaf(r),
        2 => {
            let mut a = json!({"type": "array", "items": node(r, depth - 1)});
            match r.next(4) {
                0 => a["maxItems"] = json!(r.next(4)),
                1 => a["minItems"] = json!(1),
                2 => {
                    a["prefixItems"] = json!([leaf(r)]);
                    a["maxItems"] = json!(2);
                }
                _ => a["uniqueItems"] = json!(true),
            }
            a
        }
        3 => object(r, depth - 1),
        4 => {
            let key = *r.pick(&["anyOf", "oneOf", "allOf"]);
            let n = 2 + r.next(2);
            let parts: Vec<Value> = match key {
                // allOf over one object and bounds that can all hold.
                "allOf" => vec![
                    json!({"type": "integer"}),
                    json!({"minimum": 0}),
                    json!({"maximum": 9}),
                ],
                _ => (0..n).map(|_| node(r, depth - 1)).collect(),
            };
            json!({ key: parts })
        }
        5 | 6 => json!({"$ref": format!("#/$defs/d{}", r.next(3))}),
        _ => object(r, depth - 1),
    }
}

fn object(r: &mut Rng, depth: u64) -> Value {
    let n = r.next(4);
    let props: Map<String, Value> = (0..n).map(|i| (format!("k{i}"), node(r, depth))).collect();
    let required: Vec<&String> = props.keys().filter(|_| r.next(3) > 0).collect();
    let mut o = json!({"type": "object", "properties": props, "required": required});
    match r.next(4) {
        0 => {}
        1 => o["additionalProperties"] = json!(true),
        2 => o["additionalProperties"] = json!({"type": "integer", "maximum": 5}),
        _ => o["additionalProperties"] = json!(false),
    }
    if r.next(4) == 0 {
        o["maxProperties"] = json!(n + 1);
    }
    o
}

/// Schema `i`: an object over the generator's nodes, with `$defs` d0..d2 that refer to
/// each other and to themselves (a cycle through optional parts: an answer can end).
fn schema(i: u64) -> Value {
    let mut r = Rng::new(i);
    let mut s = object(&mut r, 1 + i % 3);
    let d0 = object(&mut r, 1);
    let d1 = json!({"type": "array", "items": {"$ref": "#/$defs/d0"}, "maxItems": 2});
    let d2 = json!({"type": "object", "properties": {"next": {"$ref": "#/$defs/d2"},
                    "v": leaf(&mut r)}, "additionalProperties": false});
    s["$defs"] = json!({"d0": d0, "d1": d1, "d2": d2});
    s
}

// ---- Regexes and Lark grammars ---------------------------------------------------------

/// A regex over small pieces: literals, classes, alternations and groups, quantified.
fn regex(r: &mut Rng, depth: u64) -> String {
    let n = 1 + r.next(3);
    (0..n)
        .map(|_| {
            let piece = match (depth, r.next(6)) {
                (0, _) | (_, 0) => r.pick(&["a", "b", "xy", "0", "-", "\\."]).to_string(),
                (_, 1) => r
                    .pick(&["[a-c]", "[0-9]", "[A-Z]", "[^a-z\\n]"])
                    .to_string(),
                (_, 2) => format!("({}|{})", regex(r, depth - 1), regex(r, depth - 1)),
                (_, 3) => format!("({})", regex(r, depth - 1)),
                _ => r.pick(&["\\d", "[xyz]"]).to_string(),
            };
            let q = match r.next(6) {
                0 => "?".to_string(),
                1 => format!("{{{},{}}}", r.next(2), 2 + r.next(3)),
                2 => "+".to_string(),
                _ => String::new(),
            };
            // A quantifier on a bare escape or class is fine; on a group too.
            format!("{piece}{q}")
        })
        .collect()
}

/// Lark grammar `i` and the regex it is equal to: a sequence of terminals and a repeated
/// rule, regular by construction.
fn lark(i: u64) -> (String, String) {
    let mut r = Rng::new(10_000 + i);
    let (a, b) = (regex(&mut r, 1), regex(&mut r, 1));
    let sep = *r.pick(&[",", ";", " "]);
    let grammar = format!("start: item (\"{sep}\" item){{0,3}}\nitem: A | B\nA: /{a}/\nB: /{b}/\n");
    let sep_re = regex::escape(sep);
    let equal = format!("(?:(?:{a})|(?:{b}))(?:{sep_re}(?:(?:{a})|(?:{b}))){{0,3}}");
    (grammar, equal)
}

// ---- The driver ------------------------------------------------------------------------

/// How one grammar's request ended.
#[derive(Debug)]
enum Verdict {
    /// Refused before any id (a 400).
    Refused(String),
    /// A grammar limit reached while generating (a 400 `grammar_error`).
    Limit(String),
    /// The grammar ended the answer (EOS): its text.
    Answered(String),
    /// Still open after `MAX_IDS`.
    Cut,
    /// The server's fault (a 5xx): the defect this fuzz hunts.
    ServerError(String),
}

fn classify(e: ApiError, before_any: bool) -> Verdict {
    match (e.status.is_client_error(), before_any) {
        (true, true) => Verdict::Refused(e.message),
        (true, false) => Verdict::Limit(e.message),
        (false, _) => Verdict::ServerError(e.message),
    }
}

/// One request of `grammar`: checked as the HTTP side checks it, then sampled as both
/// lanes sample (`Sampler::pick`) from random logits, EOS favoured where allowed.
fn drive(tok: &Arc<Tokenizer>, grammar: &Grammar, seed: u64) -> (Verdict, usize) {
    if let Err(e) = grammar.check() {
        return (Verdict::Refused(e), 0);
    }
    let sampler = Sampler::new(SamplingParams::default()).unwrap();
    let mut sampler = match constrain(sampler, tok, Some(grammar)) {
        Ok(s) => s,
        Err(e) => return (classify(ApiError::generation(e), true), 0),
    };
    let vocab = tok.vocab_size();
    let mut r = Rng::new(seed);
    let mut history = vec![1u32];
    let eos = &tok.eos_token_ids;
    for step in 0..MAX_IDS {
        let mut row: Vec<f32> = (0..vocab).map(|_| r.next(1000) as f32 / 250.0).collect();
        for &id in eos {
            if let Some(l) = row.get_mut(id as usize) {
                *l += 3.0;
            }
        }
        let logits = Array::from_slice(&row, &[1, vocab as i32]);
        let id = match sampler.pick(&logits, &history) {
            Ok((y, _)) => match y.eval() {
                Ok(()) => y.as_slice::<u32>()[0],
                Err(e) => return (classify(ApiError::from(e), step == 0), step),
            },
            Err(e) => return (classify(ApiError::from(e), step == 0), step),
        };
        if eos.contains(&id) {
            let text = tok.decode(&history[1..]).unwrap_or_default();
            return (Verdict::Answered(text), step);
        }
        history.push(id);
    }
    (Verdict::Cut, MAX_IDS)
}

#[derive(Default, Debug)]
struct Tally {
    refused: usize,
    limits: usize,
    answered: usize,
    valid: usize,
    cut: usize,
    server_errors: usize,
    ids: usize,
    first_bad: Option<String>,
    /// A refusal's and a limit's reason, as examples.
    a_refusal: Option<String>,
    a_limit: Option<String>,
}

impl Tally {
    fn add(&mut self, case: &str, verdict: Verdict, judge: impl Fn(&str) -> Result<(), String>) {
        match verdict {
            Verdict::Refused(why) => {
                self.refused += 1;
                self.a_refusal.get_or_insert(format!("{case}: {why}"));
            }
            Verdict::Limit(why) => {
                self.limits += 1;
                self.a_limit.get_or_insert(format!("{case}: {why}"));
            }
            Verdict::Cut => self.cut += 1,
            Verdict::ServerError(e) => {
                self.server_errors += 1;
                self.first_bad.get_or_insert(format!("{case}: 5xx: {e}"));
            }
            Verdict::Answered(text) => {
                self.answered += 1;
                match judge(&text) {
                    Ok(()) => self.valid += 1,
                    Err(e) => {
                        self.first_bad
                            .get_or_insert(format!("{case}: {e}: {text:?}"));
                    }
                }
            }
        }
    }

    fn clean(&self) -> bool {
        self.server_errors == 0 && self.valid == self.answered
    }
}

/// Whether `text` is a JSON document valid under `schema`. JSON allows any exponent, an
/// f64 does not: exponents of 3 digits or more are read as 300 (where the schema bounds a number, the
/// grammar keeps it within them, so only unbounded numbers have them).
fn judge_json(schema: &Value, text: &str) -> Result<(), String> {
    let huge = regex::Regex::new(r"([eE][+-]?)0*[0-9]{3,}").unwrap();
    let text = huge.replace_all(text, "${1}300");
    let doc: Value = serde_json::from_str(&text).map_err(|e| format!("not JSON: {e}"))?;
    let v = jsonschema::validator_for(schema).map_err(|e| format!("judge: {e}"))?;
    v.validate(&doc).map_err(|e| format!("invalid: {e}"))
}

fn judge_regex(re: &str, text: &str) -> Result<(), String> {
    let full = regex::Regex::new(&format!("^(?:{re})$")).map_err(|e| format!("judge: {e}"))?;
    match full.is_match(text) {
        true => Ok(()),
        false => Err(format!("no full match of /{re}/")),
    }
}

fn fuzz_schemas(tok: &Arc<Tokenizer>, n: u64) -> Tally {
    let mut t = Tally::default();
    for i in 0..n {
        let s = schema(i);
        let (verdict, ids) = drive(tok, &Grammar::JsonSchema(s.clone()), i);
        t.ids += ids;
        t.add(&format!("schema {i} {s}"), verdict, |text| {
            judge_json(&s, text)
        });
    }
    t
}

fn fuzz_regexes(tok: &Arc<Tokenizer>) -> Tally {
    let mut t = Tally::default();
    for i in 0..REGEXES {
        let re = regex(&mut Rng::new(20_000 + i), 3);
        let (verdict, ids) = drive(tok, &Grammar::Regex(re.clone()), i);
        t.ids += ids;
        t.add(&format!("regex {i} /{re}/"), verdict, |text| {
            judge_regex(&re, text)
        });
    }
    for i in 0..LARKS {
        let (g, equal) = lark(i);
        let (verdict, ids) = drive(tok, &Grammar::Lark(g.clone()), i);
        t.ids += ids;
        t.add(&format!("lark {i} {g:?}"), verdict, |text| {
            judge_regex(&equal, text)
        });
    }
    t
}

fn tokenizer() -> Arc<Tokenizer> {
    Arc::new(Tokenizer::load(&common::goldens().join("models").join(MODEL)).unwrap())
}

#[test]
fn no_fuzzed_grammar_gets_a_server_error_and_every_answer_matches_its_grammar() {
    let tok = tokenizer();
    let started = Instant::now();
    let schemas = fuzz_schemas(&tok, SCHEMAS);
    let grammars = fuzz_regexes(&tok);
    println!(
        "fuzz: {SCHEMAS} schemas {schemas:?}\n      {REGEXES} regexes + {LARKS} lark {grammars:?}\n      \
         in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    for (what, t) in [("schemas", &schemas), ("regexes and lark", &grammars)] {
        assert!(t.clean(), "{what}: {:?}", t.first_bad);
        // The fuzz reaches every outcome but the server's fault: a gate over refusals
        // alone would prove nothing.
        assert!(
            t.answered * 4 >= t.refused + t.limits + t.cut,
            "{what}: {t:?}"
        );
    }
    assert!(schemas.refused > 0, "no schema was refused: {schemas:?}");

    // Planted: ids the grammar refuses get through the mask (the matcher then refuses
    // them: the server's fault), and no mask at all (answers that break their schemas).
    let _on = plant::on(Defect::ConstrainMaskOffByOne).unwrap();
    let planted = fuzz_schemas(&tok, 200);
    println!("planted ConstrainMaskOffByOne: {planted:?}");
    assert!(!planted.clean(), "ConstrainMaskOffByOne was not caught");
    drop(_on);
    let _on = plant::on(Defect::ConstrainMaskNotApplied).unwrap();
    let planted = fuzz_schemas(&tok, 200);
    println!("planted ConstrainMaskNotApplied: {planted:?}");
    assert!(
        planted.valid < planted.answered,
        "ConstrainMaskNotApplied was not caught"
    );
}

// ---- Through the server ----------------------------------------------------------------

/// The issue's schema: a required self-reference, which llguidance expands until its item
/// limit on the first step.
fn recursive() -> Value {
    json!({"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}},
           "required": ["c"]}}, "$ref": "#/$defs/n"})
}

fn completion(schema: &Value, stream: bool) -> Value {
    json!({"model": "m", "prompt": "The robot", "max_tokens": 48, "stream": stream,
           "response_format": {"type": "json_schema",
                               "json_schema": {"name": "t", "schema": schema, "strict": true}}})
}

/// A plain schema's answer on `port`: (status, body).
fn plain_schema(port: u16) -> (u16, Value) {
    let s = json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]});
    post(port, "/v1/completions", &completion(&s, false))
}

/// Both lanes: the recursive schema whole (on completions, chat, Responses and Messages)
/// and streamed (a 4xx, or an error event naming the grammar), then fuzz schemas each beside a plain request: 200 or 400 (never 5xx),
/// every finished answer valid; the plain request answered. The server answers after all.
/// And `--grammar-step-fuel 10` turns a plain schema's answer into a 400 `grammar_error`
/// (planted: `GrammarLimitsIgnored`, the flag not applied → a 200). Planted
/// `GrammarFaultIsTheServers`: the recursive schema is a 500.
#[test]
fn the_server_answers_fuzzed_grammars_on_both_lanes_without_a_server_error() {
    let starve = ["--grammar-step-fuel", "10"];
    let servers: Vec<_> = std::thread::scope(|sc| {
        let starts = [
            sc.spawn(|| serve_model(MODEL, &[])),
            sc.spawn(|| serve_model(MODEL, &["--batch", "4"])),
            sc.spawn(|| serve_model(MODEL, &starve)),
            sc.spawn(|| {
                let dir = common::goldens().join("models").join(MODEL);
                let env = [("ENGINE_PLANT", "GrammarLimitsIgnored")];
                common::server::serve_dir_with_env(&dir, &starve, &env)
            }),
            sc.spawn(|| {
                let dir = common::goldens().join("models").join(MODEL);
                let env = [("ENGINE_PLANT", "GrammarFaultIsTheServers")];
                common::server::serve_dir_with_env(&dir, &[], &env)
            }),
        ];
        starts.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let (status, r) = plain_schema(servers[0].port);
    assert_eq!(status, 200, "{r}");
    let (status, r) = plain_schema(servers[2].port);
    assert_eq!(
        (status, &r["error"]["code"]),
        (400, &json!("grammar_error")),
        "{r}"
    );
    let (status, r) = plain_schema(servers[3].port);
    assert_eq!(status, 200, "GrammarLimitsIgnored was not caught: {r}");
    // Planted: a grammar's fault taken for the server's.
    let (status, r) = post(
        servers[4].port,
        "/v1/completions",
        &completion(&recursive(), false),
    );
    assert_eq!(status, 500, "GrammarFaultIsTheServers was not caught: {r}");
    for (srv, extra) in servers.iter().zip([&[][..], &["--batch", "4"][..]]) {
        let port = srv.port;
        let (status, r) = post(port, "/v1/completions", &completion(&recursive(), false));
        assert!(status == 400, "{extra:?}: {status} {r}");
        assert_eq!(r["error"]["code"], "grammar_error", "{r}");
        // The same schema on chat, Responses and Messages: a 400 in each API's shape.
        let user = json!([{"role": "user", "content": "hi"}]);
        let format = json!({"type": "json_schema", "json_schema":
                            {"name": "t", "schema": recursive(), "strict": true}});
        let chat = json!({"messages": user, "max_tokens": 16, "response_format": format});
        let responses = json!({"input": "hi", "max_output_tokens": 16, "text": {"format":
            {"type": "json_schema", "name": "t", "schema": recursive(), "strict": true}}});
        let messages = json!({"model": "m", "messages": user, "max_tokens": 16,
            "output_config": {"format": {"type": "json_schema", "schema": recursive()}}});
        for (path, body) in [
            ("/v1/chat/completions", chat),
            ("/v1/responses", responses),
            ("/v1/messages", messages),
        ] {
            let (status, r) = post(port, path, &body);
            assert_eq!(status, 400, "{extra:?} {path}: {r}");
            let kind = r["error"]["type"].as_str().unwrap_or_default();
            assert_eq!(kind, "invalid_request_error", "{extra:?} {path}: {r}");
        }
        let body = completion(&recursive(), true).to_string();
        let (status, text) = http(port, "POST", "/v1/completions", body.as_bytes());
        match status {
            400 => assert!(text.contains("grammar_error"), "{text}"),
            200 => assert!(
                text.contains("\"grammar_error\"") && !text.contains("server_error"),
                "{extra:?}: the stream has no grammar error event: {text}"
            ),
            _ => panic!("{extra:?}: streamed: {status} {text}"),
        }
        let mut slowest = Duration::ZERO;
        for i in 0..24 {
            let s = schema(5_000 + i);
            let plain = json!({"model": "m", "prompt": "Good night", "max_tokens": 4});
            let ((status, r), waited) = std::thread::scope(|sc| {
                let fuzzed = sc.spawn(|| post(port, "/v1/completions", &completion(&s, false)));
                let t = Instant::now();
                let (plain_status, p) = post(port, "/v1/completions", &plain);
                assert_eq!(plain_status, 200, "{extra:?}: the plain request: {p}");
                (fuzzed.join().unwrap(), t.elapsed())
            });
            slowest = slowest.max(waited);
            assert!(
                status == 200 || status == 400,
                "{extra:?} {s}: {status} {r}"
            );
            if status == 200 && r["choices"][0]["finish_reason"] == "stop" {
                let text = r["choices"][0]["text"].as_str().unwrap();
                judge_json(&s, text).unwrap_or_else(|e| panic!("{extra:?} {s}: {e}"));
            }
        }
        println!("{extra:?}: the slowest plain request beside a fuzzed one: {slowest:?}");
        // A liveness bound, not a benchmark: no grammar holds the model thread.
        assert!(slowest < Duration::from_secs(5), "{extra:?}: {slowest:?}");
        let stats = common::server::stats(port);
        assert_eq!(stats["failed"], 0, "{extra:?}: {stats}");
    }
}
