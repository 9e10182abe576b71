//! The template gate: chat templates rendered by `ChatTemplate::render_json` against
//! transformers' `apply_chat_template(..., tokenize=False)` (oracles/gen_templates.py,
//! goldens/templates/<fixture>/index.json). Each conversation's rendering must be
//! transformers' string exactly (else the first differing byte, with context); where
//! transformers raised, ours must fail too, with the template's own message where it was a
//! `raise_exception`. The special-token context must be transformers' `special_tokens_map`.
//! `strftime_now` reads the golden's pinned clock (`ChatTemplate::with_now`), as the oracle
//! pinned transformers'.
//!
//! Fixtures: the real tokenizers with a template (qwen3, gemma3, llama3.1, llama3.2; the
//! converted mistral-v1/v3 have none) and `pyisms`, our own template of the Jinja features
//! real templates use (goldens/templates/pyisms/template.jinja), with gemma3's tokenizer.

use std::path::Path;

use engine::load::template::{ChatTemplate, NaiveDateTime, RenderArgs};
use engine::load::tokenizer::TemplateFiles;
use serde_json::{Map, Value};

use super::fixture::sha256_hex;
use super::{ParityError, Report};
use crate::goldens::TensorGolden;

/// The floor: conversations rendered (not errors) per template.
pub const MIN_RENDERED: usize = 12;

#[derive(Debug, Clone, Default)]
pub struct TemplatesReport {
    pub fixture: String,
    pub cases: usize,
    /// Cases transformers rendered, and ours identically.
    pub rendered: usize,
    /// Cases where transformers raised, and ours failed as it should.
    pub raised: usize,
    pub failures: Vec<String>,
}

impl Report for TemplatesReport {
    fn passed(&self) -> bool {
        self.failures.is_empty()
            && self.rendered >= MIN_RENDERED
            && self.rendered + self.raised == self.cases
    }

    fn summary(&self) -> String {
        format!(
            "L1 templates {}: {}/{} renderings identical to transformers', {} errors where it raised{}",
            self.fixture,
            self.rendered,
            self.cases - self.raised,
            self.raised,
            self.failures
                .first()
                .map_or(String::new(), |f| format!(", first failure: {f}"))
        )
    }

    fn details(&self) -> Vec<String> {
        self.failures.clone()
    }
}

fn index_error(what: impl Into<String>) -> ParityError {
    ParityError::Index(what.into())
}

/// The golden's clock (`settings.now`, ISO seconds).
fn pinned_now(index: &Value) -> Result<NaiveDateTime, ParityError> {
    let now = index["settings"]["now"]
        .as_str()
        .ok_or_else(|| index_error("settings.now missing"))?;
    NaiveDateTime::parse_from_str(now, "%Y-%m-%dT%H:%M:%S")
        .map_err(|e| index_error(format!("settings.now {now:?}: {e}")))
}

/// The fixture's template with the golden's clock; the tokenizer config and the template
/// must be the bytes the golden was made from.
fn template_of(fixture: &str, index: &Value, goldens: &Path) -> Result<ChatTemplate, ParityError> {
    let tokenizer_fixture = index["fixture"]
        .as_str()
        .ok_or_else(|| index_error("fixture missing"))?;
    let dir = super::fixture::dir(tokenizer_fixture)?;
    let settings = &index["settings"];
    super::fixture::check_sha(
        &dir,
        "tokenizer_config.json",
        settings,
        "tokenizer_config_sha256",
    )?;
    // Only the template and the config's special tokens take part: the tokenizer itself
    // (tokenizer.json, seconds to build for a 262k vocabulary) is not loaded.
    let files = TemplateFiles::read(&dir)?;
    let source = match fixture {
        "pyisms" => {
            let path = goldens.join("templates/pyisms/template.jinja");
            std::fs::read_to_string(&path)
                .map_err(|e| index_error(format!("{}: {e}", path.display())))?
        }
        _ => files
            .templates
            .get("default")
            .ok_or_else(|| index_error(format!("{fixture} has no chat template")))?
            .clone(),
    };
    if sha256_hex(source.as_bytes()) != index["template"]["sha256"] {
        return Err(index_error(format!(
            "{fixture}: not the template the golden rendered (sha256 differs)"
        )));
    }
    Ok(ChatTemplate::from_source(&source, &files.config)?.with_now(pinned_now(index)?))
}

/// A case's render arguments: its named options, every other key a template kwarg.
pub fn args_of(case: &Map<String, Value>) -> RenderArgs {
    let mut args = RenderArgs::default();
    for (key, value) in case {
        match key.as_str() {
            "name" | "messages" | "rendered" | "error" => {}
            "tools" => args.tools = Some(value.clone()),
            "documents" => args.documents = Some(value.clone()),
            "add_generation_prompt" => args.add_generation_prompt = value.as_bool() == Some(true),
            "continue_final_message" => args.continue_final_message = value.as_bool() == Some(true),
            _ => {
                args.kwargs.insert(key.clone(), value.clone());
            }
        }
    }
    args
}

/// `s[at - 40 .. at + 40]`, widened to char boundaries.
fn around(s: &str, at: usize) -> String {
    let mut start = at.saturating_sub(40).min(s.len());
    while !s.is_char_boundary(start) {
        start -= 1;
    }
    let mut end = (at + 40).min(s.len());
    while !s.is_char_boundary(end) {
        end += 1;
    }
    format!("{:?}", &s[start..end])
}

/// Where two strings first differ, with context around it.
pub fn first_difference(want: &str, got: &str) -> String {
    let at = want
        .char_indices()
        .zip(got.chars())
        .find(|((_, a), b)| a != b)
        .map(|((i, _), _)| i)
        .unwrap_or_else(|| want.len().min(got.len()));
    format!(
        "first difference at byte {at} (lengths {} vs {}): transformers {}, ours {}",
        want.len(),
        got.len(),
        around(want, at),
        around(got, at)
    )
}

/// One case: Ok(true) rendered identically, Ok(false) failed as transformers did, Err why not.
fn check_case(template: &ChatTemplate, case: &Map<String, Value>) -> Result<bool, String> {
    let messages = case["messages"].as_array().cloned().unwrap_or_default();
    let ours = template.render_json(&messages, &args_of(case));
    match (
        case.get("rendered").and_then(Value::as_str),
        case.get("error"),
        ours,
    ) {
        (Some(want), _, Ok(got)) if want == got => Ok(true),
        (Some(want), _, Ok(got)) => Err(first_difference(want, &got)),
        (Some(_), _, Err(e)) => Err(format!("transformers renders, ours fails: {e}")),
        (None, Some(error), Ok(got)) => Err(format!(
            "transformers raised {error}, ours rendered {}",
            around(&got, 0)
        )),
        (None, Some(error), Err(e)) => {
            let message = error["message"].as_str().unwrap_or("");
            match error["type"] == "TemplateError" && !e.to_string().contains(message) {
                true => Err(format!("the template raised {message:?}; ours says {e}")),
                false => Ok(false),
            }
        }
        (None, None, _) => Err("the case has neither `rendered` nor `error`".into()),
    }
}

/// Runs the gate on `golden`, the template golden of `fixture`.
pub fn run(fixture: &str, golden: &TensorGolden) -> Result<TemplatesReport, ParityError> {
    let index = &golden.index;
    let template = template_of(fixture, index, &crate::goldens::goldens_root())?;
    let mut report = TemplatesReport {
        fixture: fixture.to_owned(),
        ..Default::default()
    };
    let want_tokens: Vec<(String, String)> =
        serde_json::from_value(index["special_tokens"].clone())
            .map_err(|e| index_error(format!("special_tokens: {e}")))?;
    if template.special_tokens() != want_tokens.as_slice() {
        report.failures.push(format!(
            "special tokens {:?}, transformers passes {want_tokens:?}",
            template.special_tokens()
        ));
    }
    let cases = index["cases"]
        .as_array()
        .ok_or_else(|| index_error("cases missing"))?;
    for case in cases {
        let case = case
            .as_object()
            .ok_or_else(|| index_error("a case is not an object"))?;
        let name = case["name"].as_str().unwrap_or("?");
        report.cases += 1;
        match check_case(&template, case) {
            Ok(true) => report.rendered += 1,
            Ok(false) => report.raised += 1,
            Err(why) => report.failures.push(format!("{fixture}/{name}: {why}")),
        }
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_perturbed_string_is_reported_at_its_first_difference() {
        let d = first_difference("<a>hello world</a>", "<a>hello World</a>");
        assert!(d.contains("byte 9"), "{d}");
        let d = first_difference("abc", "ab");
        assert!(d.contains("byte 2 (lengths 3 vs 2)"), "{d}");
    }
}
