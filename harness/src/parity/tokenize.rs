//! Tokenization against transformers (oracles/gen_tokenize.py) on the real tokenizers
//! (`crate::fixtures`, fetched by scripts/fetch_fixtures.sh): for each text, our
//! `Tokenizer::encode` with and without special tokens against transformers'
//! `tokenizer(text, add_special_tokens=…)` ids, and our `decode_with_special` of both against
//! transformers' `decode(ids)`. Identical ids and strings, or the first mismatch with its text;
//! and the tokenizer class we build (`Tokenizer::class`) is the one transformers built.

use engine::load::tokenizer::Tokenizer;
use serde::Deserialize;

use super::{ParityError, Report};
use crate::goldens::TensorGolden;

#[derive(Debug, Clone, Default)]
pub struct TokenizeReport {
    pub fixture: String,
    pub cases: usize,
    /// Texts whose ids (with special tokens, and without) both matched.
    pub ids_exact: usize,
    /// Texts whose decoded strings (of both id lists) both matched.
    pub text_exact: usize,
    /// The class we build the tokenizer as, and the one transformers built it as.
    pub class: (String, String),
    pub first_failure: Option<String>,
}

impl Report for TokenizeReport {
    fn passed(&self) -> bool {
        self.cases > 0
            && self.ids_exact == self.cases
            && self.text_exact == self.cases
            && self.class.0 == self.class.1
    }

    fn summary(&self) -> String {
        format!(
            "L1 tokenize {} ({}{}): {}/{} id lists and {}/{} decoded texts identical to transformers'{}",
            self.fixture,
            self.class.0,
            if self.class.0 == self.class.1 {
                String::new()
            } else {
                format!(", transformers: {}", self.class.1)
            },
            self.ids_exact,
            self.cases,
            self.text_exact,
            self.cases,
            self.first_failure
                .as_ref()
                .map_or(String::new(), |f| format!(", first failure: {f}"))
        )
    }
}

/// One text of the golden and what transformers made of it.
#[derive(Debug, Deserialize)]
struct Case {
    text: String,
    /// `tokenizer(text, add_special_tokens=True)`.
    ids: Vec<u32>,
    /// `tokenizer(text, add_special_tokens=False)`.
    ids_plain: Vec<u32>,
    /// `decode(ids)` and `decode(ids_plain)`.
    decoded: String,
    decoded_plain: String,
}

/// Ours against one case: None when identical, else what differs first.
fn compare(
    tokenizer: &Tokenizer,
    case: &Case,
) -> Result<(bool, bool, Option<String>), ParityError> {
    let ids = tokenizer.encode(&case.text, true)?;
    let plain = tokenizer.encode(&case.text, false)?;
    let decoded = tokenizer.decode_with_special(&case.ids)?;
    let decoded_plain = tokenizer.decode_with_special(&case.ids_plain)?;
    let ids_ok = ids == case.ids && plain == case.ids_plain;
    let text_ok = decoded == case.decoded && decoded_plain == case.decoded_plain;
    let text = &case.text;
    let why = if ids != case.ids {
        Some(format!(
            "{text:?}: ids ours {ids:?}, transformers {:?}",
            case.ids
        ))
    } else if plain != case.ids_plain {
        let want = &case.ids_plain;
        Some(format!(
            "{text:?} (no special tokens): ids ours {plain:?}, transformers {want:?}"
        ))
    } else if decoded != case.decoded {
        Some(format!(
            "{text:?}: decoded ours {decoded:?}, transformers {:?}",
            case.decoded
        ))
    } else if decoded_plain != case.decoded_plain {
        let want = &case.decoded_plain;
        Some(format!(
            "{text:?} (no special tokens): decoded ours {decoded_plain:?}, transformers {want:?}"
        ))
    } else {
        None
    };
    Ok((ids_ok, text_ok, why))
}

/// Runs the gate on `golden`, the tokenization golden of tokenizer fixture `fixture`.
pub fn run(fixture: &str, golden: &TensorGolden) -> Result<TokenizeReport, ParityError> {
    let dir = super::fixture::dir(fixture)?;
    let settings = &golden.index["settings"];
    super::fixture::check_sha(&dir, "tokenizer.json", settings, "tokenizer_json_sha256")?;
    let tokenizer = super::fixture::tokenizer(&dir)?;
    let cases: Vec<Case> = serde_json::from_value(golden.index["cases"].clone())
        .map_err(|e| ParityError::Index(format!("cases: {e}")))?;
    let theirs = settings["tokenizer_class"].as_str().unwrap_or_default();
    let mut report = TokenizeReport {
        fixture: fixture.to_owned(),
        class: (tokenizer.class().name().to_owned(), theirs.to_owned()),
        ..Default::default()
    };
    for case in &cases {
        let (ids_ok, text_ok, why) = compare(&tokenizer, case)?;
        report.cases += 1;
        report.ids_exact += usize::from(ids_ok);
        report.text_exact += usize::from(text_ok);
        if report.first_failure.is_none() {
            report.first_failure = why;
        }
    }
    Ok(report)
}
