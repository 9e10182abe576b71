//! The template gate (issue 20): every conversation of goldens/templates/<fixture>/index.json
//! (oracles/gen_templates.py: transformers' `apply_chat_template(..., tokenize=False)`) is
//! rendered by `ChatTemplate::render_json` with the fixture's real template and compared to
//! transformers' string exactly; where transformers raised, ours must fail too (with the
//! template's own message where it was a `raise_exception`). The clock is pinned to the
//! golden's, as the oracle pinned transformers'. Planted defects (tojson HTML-escapes; the
//! kwargs dropped) must fail the gate.
//!
//! Templated fixtures: qwen3, gemma3, llama3.1, llama3.2, and pyisms (our own template of the
//! features real ones use, committed beside its golden, with gemma3's special tokens).
//! mistral-v1 and mistral-v3 ship no template and are not in the gate.

#[path = "../../harness/src/fixtures.rs"]
mod fixtures;

use std::path::{Path, PathBuf};

use engine::load::template::{ChatTemplate, RenderArgs};
use engine::load::tokenizer::Tokenizer;
use engine::plant::{self, Defect};
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

const FIXTURES: [&str; 5] = ["qwen3", "gemma3", "llama3.1", "llama3.2", "pyisms"];
/// The floor: conversations rendered (not errors) per template.
const MIN_RENDERED: usize = 12;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn golden(fixture: &str) -> Value {
    let path = repo().join(format!("goldens/templates/{fixture}/index.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; make it with `oracles/.venv/bin/python oracles/gen_templates.py {fixture}`",
            path.display()
        )
    });
    serde_json::from_str(&text).expect("golden is JSON")
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The fixture's template with the golden's clock; checks the files are the golden's.
fn template_of(fixture: &str, golden: &Value) -> ChatTemplate {
    let tokenizer_fixture = golden["fixture"]
        .as_str()
        .expect("golden names its fixture");
    let dir = fixtures::tokenizer(tokenizer_fixture);
    let config = std::fs::read(dir.join("tokenizer_config.json")).expect("tokenizer_config.json");
    assert_eq!(
        sha256_hex(&config),
        golden["settings"]["tokenizer_config_sha256"],
        "{fixture}: the fixture's tokenizer_config.json is not the one the golden was made from"
    );
    let tokenizer = Tokenizer::load(&dir).expect("fixture loads");
    let source = match fixture {
        "pyisms" => std::fs::read_to_string(repo().join("goldens/templates/pyisms/template.jinja"))
            .expect("pyisms template"),
        _ => tokenizer
            .chat_template()
            .expect("a templated fixture")
            .to_owned(),
    };
    assert_eq!(
        sha256_hex(source.as_bytes()),
        golden["template"]["sha256"],
        "{fixture}: not the template the golden rendered"
    );
    let now = chrono::NaiveDateTime::parse_from_str(
        golden["settings"]["now"]
            .as_str()
            .expect("golden pins the clock"),
        "%Y-%m-%dT%H:%M:%S",
    )
    .expect("an ISO time");
    ChatTemplate::new(&source, &tokenizer)
        .expect("template compiles")
        .with_now(now)
}

/// The render arguments of a case: its named options, every other key a template kwarg.
fn args_of(case: &Map<String, Value>) -> RenderArgs {
    let mut args = RenderArgs::default();
    for (key, value) in case {
        match key.as_str() {
            "name" | "messages" | "rendered" | "error" => {}
            "tools" => args.tools = Some(value.clone()),
            "documents" => args.documents = Some(value.clone()),
            "add_generation_prompt" => args.add_generation_prompt = value.as_bool().unwrap(),
            "continue_final_message" => args.continue_final_message = value.as_bool().unwrap(),
            _ => {
                args.kwargs.insert(key.clone(), value.clone());
            }
        }
    }
    args
}

/// Where two strings first differ, with context around it.
fn first_difference(want: &str, got: &str) -> String {
    let at = want
        .char_indices()
        .zip(got.chars())
        .find(|((_, a), b)| a != b)
        .map(|((i, _), _)| i)
        .unwrap_or_else(|| want.len().min(got.len()));
    let around = |s: &str| {
        let mut start = at.saturating_sub(40).min(s.len());
        while !s.is_char_boundary(start) {
            start -= 1;
        }
        let mut end = (at + 40).min(s.len());
        while !s.is_char_boundary(end) {
            end += 1;
        }
        format!("{:?}", &s[start..end])
    };
    format!(
        "first difference at byte {at} (lengths {} vs {}):\n    transformers: {}\n    ours:         {}",
        want.len(),
        got.len(),
        around(want),
        around(got)
    )
}

/// One template's cases: (rendered-and-equal count, failures).
fn check(fixture: &str) -> (usize, Vec<String>) {
    let golden = golden(fixture);
    let template = template_of(fixture, &golden);
    let mut failures = Vec::new();
    let want_tokens: Vec<(String, String)> =
        serde_json::from_value(golden["special_tokens"].clone()).expect("special_tokens pairs");
    if template.special_tokens() != want_tokens.as_slice() {
        failures.push(format!(
            "{fixture}: special tokens {:?}, transformers passes {want_tokens:?}",
            template.special_tokens()
        ));
    }
    let mut rendered = 0;
    for case in golden["cases"].as_array().expect("cases") {
        let case = case.as_object().expect("a case is an object");
        let name = format!("{fixture}/{}", case["name"].as_str().unwrap());
        let messages = case["messages"].as_array().expect("messages").clone();
        let ours = template.render_json(&messages, &args_of(case));
        match (case.get("rendered"), case.get("error"), ours) {
            (Some(want), _, Ok(got)) if want.as_str() == Some(got.as_str()) => rendered += 1,
            (Some(want), _, Ok(got)) => failures.push(format!(
                "{name}: {}",
                first_difference(want.as_str().unwrap(), &got)
            )),
            (Some(_), _, Err(e)) => {
                failures.push(format!("{name}: transformers renders, ours fails: {e}"))
            }
            (None, Some(error), Ok(got)) => failures.push(format!(
                "{name}: transformers raised {error}, ours rendered {:?}",
                &got[..got.len().min(200)]
            )),
            (None, Some(error), Err(e)) => {
                let message = error["message"].as_str().unwrap_or("");
                if error["type"] == "TemplateError" && !e.to_string().contains(message) {
                    failures.push(format!(
                        "{name}: the template raised {message:?}; ours says {e}"
                    ));
                }
            }
            (None, None, _) => panic!("{name}: a case has neither rendered nor error"),
        }
    }
    (rendered, failures)
}

#[test]
fn every_template_renders_as_transformers_does() {
    let mut all = Vec::new();
    for fixture in FIXTURES {
        let (rendered, failures) = check(fixture);
        let total = golden(fixture)["cases"].as_array().unwrap().len();
        println!(
            "templates/{fixture}: {rendered} rendered identically, {total} cases, {} failures",
            failures.len()
        );
        if failures.is_empty() && rendered < MIN_RENDERED {
            all.push(format!(
                "{fixture}: only {rendered} conversations render (< {MIN_RENDERED})"
            ));
        }
        all.extend(failures);
    }
    assert!(
        all.is_empty(),
        "{} failures:\n{}",
        all.len(),
        all.join("\n")
    );
}

#[test]
fn the_gate_fails_with_planted_defects() {
    for defect in [
        Defect::TemplateTojsonEscapesHtml,
        Defect::TemplateKwargsDropped,
    ] {
        let _on = plant::on(defect).expect("test builds carry the planted defects");
        let failures: Vec<String> = FIXTURES.iter().flat_map(|f| check(f).1).collect();
        assert!(!failures.is_empty(), "{defect:?}: the gate passed");
        println!(
            "{defect:?}: {} failures, first: {}",
            failures.len(),
            failures[0]
        );
    }
}

#[test]
fn a_perturbed_golden_string_is_reported_with_its_position() {
    let d = first_difference("<a>hello world</a>", "<a>hello World</a>");
    assert!(d.contains("byte 9"), "{d}");
}
