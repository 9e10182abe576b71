//! The speculative-decoding gate: our executor (`engine::generate::speculative`) against
//! mlx-lm's `speculative_generate_step` goldens (oracles/gen_spec.py): per case the same ids,
//! the same accept/reject trace, and every log-probability vector bit-exact — γ = 1..4,
//! chunked prefill, and seeded sampling.

use engine::generate::sampler::{Sampler, SamplingParams};
use engine::generate::speculative::{speculative_generate_in, SpecStats};
use engine::generate::{Flow, Session, SessionOptions};
use serde_json::Value;

use super::ParityError;
use crate::compare::compare;
use crate::goldens::{TensorEntry, TensorGolden};

#[derive(Debug, Clone, Default)]
pub struct SpecReport {
    pub cases: usize,
    /// Cases whose ids and accept/reject trace both equal the oracle's.
    pub cases_matching: usize,
    pub vectors: usize,
    pub exact: usize,
    pub max_abs_diff: f64,
    pub drafted: usize,
    pub accepted: usize,
    pub first_failure: Option<String>,
}

impl SpecReport {
    pub fn passed(&self) -> bool {
        self.cases > 0 && self.cases_matching == self.cases && self.exact == self.vectors
    }

    pub fn summary(&self) -> String {
        format!(
            "{}/{} cases with identical ids and trace, {}/{} log-prob vectors bit-exact (max |Δ| \
             {:e}), acceptance {}/{}{}",
            self.cases_matching,
            self.cases,
            self.exact,
            self.vectors,
            self.max_abs_diff,
            self.accepted,
            self.drafted,
            self.first_failure
                .as_ref()
                .map_or(String::new(), |f| format!(", first failure: {f}"))
        )
    }
}

fn field<T: serde::de::DeserializeOwned>(case: &Value, key: &str) -> Result<T, ParityError> {
    serde_json::from_value(case[key].clone()).map_err(|e| ParityError::Index(format!("{key}: {e}")))
}

/// Runs every case of `goldens/spec/<target>` (or only `only`).
pub fn run(target: &str, only: Option<&str>) -> Result<SpecReport, ParityError> {
    let golden = TensorGolden::open(&format!("spec/{target}"))?;
    let draft_name = golden.index["draft_model"]
        .as_str()
        .and_then(|s| s.strip_prefix("models/"))
        .ok_or_else(|| ParityError::Index("draft_model".into()))?
        .to_owned();
    let m = engine::model::load(&crate::goldens::model_dir(target)?)?;
    let d = engine::model::load(&crate::goldens::model_dir(&draft_name)?)?;
    let cases: Vec<Value> = golden.index["cases"]
        .as_array()
        .cloned()
        .ok_or_else(|| ParityError::Index("cases".into()))?;
    let mut report = SpecReport::default();
    for case in cases.iter().filter(|c| only.is_none_or(|o| c["name"] == o)) {
        let name: String = field(case, "name")?;
        let prompt: Vec<u32> = field(case, "prompt_ids")?;
        let want_ids: Vec<u32> = field(case, "ids")?;
        let want_trace: Vec<bool> = field(case, "from_draft")?;
        let entries: Vec<TensorEntry> = field(case, "logprobs")?;
        let mut sampler = Sampler::new(SamplingParams {
            temp: field(case, "temp")?,
            seed: field(case, "seed")?,
            ..Default::default()
        })?;
        let opts = SessionOptions::default();
        let prefill_step: usize = field(case, "prefill_step")?;
        let mut target = Session::with_options(m.as_ref(), &opts);
        let mut draft = Session::with_options(d.as_ref(), &opts);
        target.prefill_step = prefill_step;
        draft.prefill_step = prefill_step;
        let (mut ids, mut trace) = (Vec::new(), Vec::new());
        let mut failure: Option<ParityError> = None;
        let (_, spec, _) = speculative_generate_in(
            &mut target,
            &mut draft,
            &prompt,
            0,
            field(case, "num_draft")?,
            want_ids.len(),
            &[],
            &mut sampler,
            |id, logprobs, from_draft| {
                let k = ids.len();
                ids.push(id);
                trace.push(from_draft);
                if let Some(e) = entries.get(k) {
                    let checked = golden
                        .tensor_at(e)
                        .map_err(ParityError::from)
                        .and_then(|(e, bytes)| Ok(compare(&logprobs.reshape(&[-1])?, &e, bytes)?));
                    match checked {
                        Ok(cmp) => {
                            report.vectors += 1;
                            report.max_abs_diff = report.max_abs_diff.max(cmp.max_abs_diff);
                            if cmp.bit_exact {
                                report.exact += 1;
                            } else if report.first_failure.is_none() {
                                report.first_failure = Some(format!("{name} log-probs {k}"));
                            }
                        }
                        Err(e) => {
                            failure = Some(e);
                            return Ok(Flow::Stop);
                        }
                    }
                }
                Ok(Flow::Continue)
            },
        )?;
        if let Some(e) = failure {
            return Err(e);
        }
        let SpecStats {
            drafted, accepted, ..
        } = spec;
        report.drafted += drafted;
        report.accepted += accepted;
        report.cases += 1;
        if ids == want_ids && trace == want_trace {
            report.cases_matching += 1;
        } else if report.first_failure.is_none() {
            let at = ids
                .iter()
                .zip(&trace)
                .zip(want_ids.iter().zip(&want_trace))
                .position(|(a, b)| a.0 != b.0 || a.1 != b.1)
                .unwrap_or(ids.len().min(want_ids.len()));
            report.first_failure = Some(format!("{name}: ids or trace differ at token {at}"));
        }
    }
    if report.cases == 0 {
        return Err(ParityError::UnknownCase(
            only.unwrap_or("(none)").to_owned(),
        ));
    }
    Ok(report)
}
