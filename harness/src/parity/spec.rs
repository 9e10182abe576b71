//! The speculative-decoding gate: our executor (`engine::generate::speculative`) against
//! mlx-lm's `speculative_generate_step` goldens (oracles/gen_spec.py): per case the same ids,
//! the same accept/reject trace, and every log-probability vector bit-exact — γ = 1..4,
//! chunked prefill, and seeded sampling.

use engine::generate::sampler::{Sampler, SamplingParams};
use engine::generate::speculative::{speculative_generate_in, SpecStats};
use engine::generate::{Flow, Session, SessionOptions};
use engine::model::LanguageModel;
use serde::Deserialize;

use super::{ParityError, Report};
use crate::compare::compare;
use crate::goldens::{TensorEntry, TensorGolden};

#[derive(Debug, Clone, Default)]
pub struct SpecReport {
    /// The gate and target, as the summary names them (`L1 spec tiny-llama-trained`).
    pub label: String,
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

impl Report for SpecReport {
    fn passed(&self) -> bool {
        self.cases > 0 && self.cases_matching == self.cases && self.exact == self.vectors
    }

    fn summary(&self) -> String {
        format!(
            "{}: {}/{} cases with identical ids and trace, {}/{} log-prob vectors bit-exact (max \
             |Δ| {:e}), acceptance {}/{}{}",
            self.label,
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

/// One case of the golden.
#[derive(Debug, Deserialize)]
struct Case {
    name: String,
    prompt_ids: Vec<u32>,
    ids: Vec<u32>,
    from_draft: Vec<bool>,
    logprobs: Vec<TensorEntry>,
    temp: f64,
    seed: u64,
    prefill_step: usize,
    num_draft: usize,
}

/// Runs every case (or only `only`) of `golden`, the speculative golden of `target`.
pub fn run(
    target: &str,
    golden: &TensorGolden,
    only: Option<&str>,
) -> Result<SpecReport, ParityError> {
    let draft_name = golden.index["draft_model"]
        .as_str()
        .and_then(|s| s.strip_prefix("models/"))
        .ok_or_else(|| ParityError::Index("draft_model".into()))?
        .to_owned();
    let m = engine::model::load(&crate::goldens::model_dir(target)?)?;
    let d = engine::model::load(&crate::goldens::model_dir(&draft_name)?)?;
    let cases: Vec<Case> = serde_json::from_value(golden.index["cases"].clone())
        .map_err(|e| ParityError::Index(format!("cases: {e}")))?;
    let mut report = SpecReport {
        label: format!("L1 spec {target}"),
        ..Default::default()
    };
    for case in cases.iter().filter(|c| only.is_none_or(|o| c.name == o)) {
        run_case(golden, m.as_ref(), d.as_ref(), case, &mut report)?;
    }
    if report.cases == 0 {
        return Err(ParityError::UnknownCase(
            only.unwrap_or("(none)").to_owned(),
        ));
    }
    Ok(report)
}

fn run_case(
    golden: &TensorGolden,
    m: &dyn LanguageModel,
    d: &dyn LanguageModel,
    case: &Case,
    report: &mut SpecReport,
) -> Result<(), ParityError> {
    let mut sampler = Sampler::new(SamplingParams {
        temp: case.temp,
        seed: case.seed,
        ..Default::default()
    })?;
    let opts = SessionOptions::default();
    let mut target = Session::with_options(m, &opts);
    let mut draft = Session::with_options(d, &opts);
    target.prefill_step = case.prefill_step;
    draft.prefill_step = case.prefill_step;
    let (mut ids, mut trace) = (Vec::new(), Vec::new());
    let mut failure: Option<ParityError> = None;
    let (_, spec, _) = speculative_generate_in(
        &mut target,
        &mut draft,
        &case.prompt_ids,
        0,
        case.num_draft,
        case.ids.len(),
        &[],
        &mut sampler,
        |id, logprobs, from_draft| {
            let k = ids.len();
            ids.push(id);
            trace.push(from_draft);
            if let Some(e) = case.logprobs.get(k) {
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
                            report.first_failure = Some(format!("{} log-probs {k}", case.name));
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
    if ids == case.ids && trace == case.from_draft {
        report.cases_matching += 1;
    } else if report.first_failure.is_none() {
        let at = ids
            .iter()
            .zip(&trace)
            .zip(case.ids.iter().zip(&case.from_draft))
            .position(|(a, b)| a.0 != b.0 || a.1 != b.1)
            .unwrap_or(ids.len().min(case.ids.len()));
        report.first_failure = Some(format!("{}: ids or trace differ at token {at}", case.name));
    }
    Ok(())
}
