//! The streaming detokenizer against mlx-lm's (oracles/gen_detok.py): for each case's ids,
//! the text piece our `StreamingDetokenizer` emits after every token and at the end, against
//! the `last_segment` mlx-lm's detokenizer gives after every `add_token` and `finalize` —
//! what `mlx_lm.generate` prints and `mlx_lm.server` streams, chunk by chunk.

use serde_json::Value;

use super::ParityError;
use crate::goldens::TensorGolden;

/// Models with detokenizer goldens (the tiny models share one tokenizer).
pub const MODELS: [&str; 1] = ["tiny-llama-trained"];

#[derive(Debug, Clone, Default)]
pub struct DetokReport {
    pub cases: usize,
    /// Cases whose whole text matched.
    pub text_exact: usize,
    /// Cases where every piece matched too.
    pub pieces_exact: usize,
    pub first_failure: Option<String>,
}

impl DetokReport {
    pub fn passed(&self) -> bool {
        self.cases > 0 && self.text_exact == self.cases && self.pieces_exact == self.cases
    }

    pub fn summary(&self) -> String {
        format!(
            "{}/{} texts and {}/{} piece streams identical to mlx-lm's{}",
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

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .into_iter()
        .flatten()
        .map(|s| s.as_str().unwrap_or_default().to_owned())
        .collect()
}

/// Runs the gate on `goldens/detok/<model>`; `perturb` may change our pieces of each case
/// before the comparison (the planted-defect check).
pub fn run(model: &str, perturb: impl Fn(&mut Vec<String>)) -> Result<DetokReport, ParityError> {
    let golden = TensorGolden::open_index_only(&format!("detok/{model}"))?;
    let tokenizer = engine::load::tokenizer::Tokenizer::load(&crate::goldens::model_dir(model)?)?;
    let cases = golden.index["cases"]
        .as_array()
        .ok_or_else(|| ParityError::Index("cases".into()))?;
    let mut report = DetokReport::default();
    for case in cases {
        let name = case["name"].as_str().unwrap_or("?");
        let ids: Vec<u32> = serde_json::from_value(case["ids"].clone())
            .map_err(|e| ParityError::Index(format!("{name}: ids: {e}")))?;
        let mut detok = tokenizer.detokenizer();
        let mut pieces = Vec::new();
        for &id in &ids {
            pieces.push(detok.push(id)?);
        }
        let last = detok.finish()?;
        perturb(&mut pieces);
        let want_pieces = strings(&case["segments"]);
        let want_last = case["finalize"].as_str().unwrap_or_default();
        let want_text = case["text"].as_str().unwrap_or_default();
        let text = pieces.concat() + &last;
        report.cases += 1;
        let text_ok = text == want_text;
        let pieces_ok = pieces == want_pieces && last == want_last;
        report.text_exact += usize::from(text_ok);
        report.pieces_exact += usize::from(pieces_ok);
        if !(text_ok && pieces_ok) && report.first_failure.is_none() {
            let at = pieces
                .iter()
                .zip(&want_pieces)
                .position(|(a, b)| a != b)
                .map_or(String::new(), |i| {
                    format!(
                        " (piece {i}: ours {:?}, mlx-lm {:?})",
                        pieces[i], want_pieces[i]
                    )
                });
            report.first_failure = Some(format!("{name}: ours {text:?}, mlx-lm {want_text:?}{at}"));
        }
    }
    Ok(report)
}
