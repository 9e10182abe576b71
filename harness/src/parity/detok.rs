//! The streaming detokenizer against mlx-lm's (oracles/gen_detok.py): for each case's ids,
//! the text piece our `StreamingDetokenizer` emits after every token and at the end, against
//! the `last_segment` mlx-lm's detokenizer gives after every `add_token` and `finalize` —
//! what `mlx_lm.generate` prints and `mlx_lm.server` streams, chunk by chunk.

use serde::Deserialize;

use engine::load::tokenizer::detok::Kind;

use super::{ParityError, Report};
use crate::goldens::TensorGolden;

#[derive(Debug, Clone, Default)]
pub struct DetokReport {
    pub model: String,
    pub cases: usize,
    /// Cases whose whole text matched.
    pub text_exact: usize,
    /// Cases where every piece matched too.
    pub pieces_exact: usize,
    pub first_failure: Option<String>,
}

impl Report for DetokReport {
    fn passed(&self) -> bool {
        self.cases > 0 && self.text_exact == self.cases && self.pieces_exact == self.cases
    }

    fn summary(&self) -> String {
        format!(
            "L1 detok {}: {}/{} texts and {}/{} piece streams identical to mlx-lm's{}",
            self.model,
            self.text_exact,
            self.cases,
            self.pieces_exact,
            self.cases,
            self.first_failure
                .as_ref()
                .map_or(String::new(), |f| format!(", first failure: {f}"))
        )
    }
}

/// One case of the golden: ids and what mlx-lm's detokenizer made of them.
#[derive(Debug, Deserialize)]
struct Case {
    name: String,
    ids: Vec<u32>,
    /// `last_segment` after every `add_token`.
    segments: Vec<String>,
    /// `last_segment` after `finalize`.
    finalize: String,
    text: String,
}

/// Runs the gate on `golden`, the detokenizer golden of `model`; `perturb` may change our
/// pieces of each case before the comparison (the planted-defect check).
pub fn run(
    model: &str,
    golden: &TensorGolden,
    perturb: impl Fn(&mut Vec<String>),
) -> Result<DetokReport, ParityError> {
    run_dir(model, &crate::goldens::model_dir(model)?, golden, perturb)
}

/// The gate on a real tokenizer: `fixture` (`crate::fixtures`), whose tokenizer.json must be
/// the one the golden was made from.
pub fn run_fixture(
    fixture: &str,
    golden: &TensorGolden,
    perturb: impl Fn(&mut Vec<String>),
) -> Result<DetokReport, ParityError> {
    let dir = super::fixture::dir(fixture)?;
    let settings = &golden.index["settings"];
    super::fixture::check_sha(&dir, "tokenizer.json", settings, "tokenizer_json_sha256")?;
    run_dir(fixture, &dir, golden, perturb)
}

/// The gate on the tokenizer in `dir`, reported as `name`; mlx-lm's detokenizer class must
/// be the kind ours picks.
fn run_dir(
    name: &str,
    dir: &std::path::Path,
    golden: &TensorGolden,
    perturb: impl Fn(&mut Vec<String>),
) -> Result<DetokReport, ParityError> {
    let tokenizer = super::fixture::tokenizer(dir)?;
    let settings = &golden.index["settings"];
    if let Some(theirs) = settings["detokenizer"].as_str() {
        let ours = tokenizer.detokenizer_kind();
        let same = match ours {
            Kind::Bpe => theirs == "BPEStreamingDetokenizer",
            Kind::Spm { trim_space } => {
                theirs == "SPMStreamingDetokenizer"
                    && settings["trim_space"]
                        .as_bool()
                        .is_none_or(|t| t == trim_space)
            }
            Kind::Naive => theirs == "NaiveStreamingDetokenizer",
        };
        if !same {
            return Ok(DetokReport {
                model: name.to_owned(),
                cases: 1,
                first_failure: Some(format!("we pick {ours:?}, mlx-lm picks {theirs}")),
                ..Default::default()
            });
        }
    }
    let cases: Vec<Case> = serde_json::from_value(golden.index["cases"].clone())
        .map_err(|e| ParityError::Index(format!("cases: {e}")))?;
    let mut report = DetokReport {
        model: name.to_owned(),
        ..Default::default()
    };
    for case in &cases {
        let mut detok = tokenizer.detokenizer();
        let mut pieces = Vec::new();
        for &id in &case.ids {
            pieces.push(detok.push(id)?);
        }
        let last = detok.finish()?;
        perturb(&mut pieces);
        let text = pieces.concat() + &last;
        report.cases += 1;
        let text_ok = text == case.text;
        let pieces_ok = pieces == case.segments && last == case.finalize;
        report.text_exact += usize::from(text_ok);
        report.pieces_exact += usize::from(pieces_ok);
        if !(text_ok && pieces_ok) && report.first_failure.is_none() {
            let at = pieces
                .iter()
                .zip(&case.segments)
                .position(|(a, b)| a != b)
                .map_or(String::new(), |i| {
                    format!(
                        " (piece {i}: ours {:?}, mlx-lm {:?})",
                        pieces[i], case.segments[i]
                    )
                });
            let (name, want) = (&case.name, &case.text);
            report.first_failure = Some(format!("{name}: ours {text:?}, mlx-lm {want:?}{at}"));
        }
    }
    Ok(report)
}
