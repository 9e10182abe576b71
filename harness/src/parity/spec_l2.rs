//! The L2 speculative gate: our assistant-drafter path (`engine::generate::assistant`)
//! against mlx-optiq 0.7.7's `assistant_generate_step` goldens (oracles/gen_spec_l2.py,
//! target tiny-gemma4, drafter tiny-gemma4-assistant): per case the same ids and
//! accept/reject trace, every verify pass's input and accepted count, every draft call's
//! position, input, id and logits (bit-exact), and every emitted log-probability row
//! (bit-exact).
//!
//! The head rows (`gates::SPEC_L2_HEADS`, goldens `spec-l2/<drafter>`) run the same cases
//! with the drafter's head variants: the centroid head, and the pair whose config flags
//! contradict their tensors (the head is the one the tensors carry).

use engine::generate::assistant::{assistant_generate_in, AssistantTrace};
use engine::generate::sampler::{Sampler, SamplingParams};
use engine::generate::{Flow, Session, SessionOptions};
use engine::model::AssistantDrafter;
use serde_json::Value;

use super::spec::SpecReport;
use super::ParityError;
use crate::compare::compare;
use crate::goldens::{TensorEntry, TensorGolden};

fn field<T: serde::de::DeserializeOwned>(v: &Value, key: &str) -> Result<T, ParityError> {
    serde_json::from_value(v[key].clone()).map_err(|e| ParityError::Index(format!("{key}: {e}")))
}

/// Runs every case (or only `only`) of `golden`, the assistant-drafting golden of `target`.
/// `vectors`/`exact` count log-prob rows and drafter logits together.
pub fn run(
    target: &str,
    golden: &TensorGolden,
    only: Option<&str>,
) -> Result<SpecReport, ParityError> {
    let drafter = model_field(golden, "drafter")?;
    run_pair(target, &drafter, golden, only)
}

/// Runs the golden of `drafter` (a head variant; its target is the golden's `model`).
pub fn run_drafter(
    drafter: &str,
    golden: &TensorGolden,
    only: Option<&str>,
) -> Result<SpecReport, ParityError> {
    if model_field(golden, "drafter")? != drafter {
        return Err(ParityError::Index(format!("drafter: not models/{drafter}")));
    }
    run_pair(&model_field(golden, "model")?, drafter, golden, only)
}

/// The model a golden's index names (`models/NAME` → NAME) under `key`.
fn model_field(golden: &TensorGolden, key: &str) -> Result<String, ParityError> {
    golden.index[key]
        .as_str()
        .and_then(|s| s.strip_prefix("models/"))
        .map(str::to_owned)
        .ok_or_else(|| ParityError::Index(key.into()))
}

fn run_pair(
    target: &str,
    drafter_name: &str,
    golden: &TensorGolden,
    only: Option<&str>,
) -> Result<SpecReport, ParityError> {
    let m = engine::model::load(&crate::goldens::model_dir(target)?)?;
    let hooks = m
        .as_assistant_target()
        .ok_or_else(|| ParityError::Index(format!("{target} cannot host an assistant")))?;
    let drafter = AssistantDrafter::load(&crate::goldens::model_dir(drafter_name)?)?;
    let prefill_step: usize = field(&golden.index["settings"], "prefill_step_size")?;
    let cases: Vec<Value> = field(&golden.index, "cases")?;
    let mut report = SpecReport {
        label: format!(
            "L2 spec (assistant drafter {drafter_name}, {} head) {target}",
            drafter.head_kind()
        ),
        ..Default::default()
    };
    for case in cases.iter().filter(|c| only.is_none_or(|o| c["name"] == o)) {
        let mut session = Session::with_options(m.as_ref(), &SessionOptions::default());
        session.prefill_step = prefill_step;
        let ours = Ours::generate(&mut session, hooks, &drafter, case)?;
        ours.check(golden, case, &mut report)?;
    }
    if report.cases == 0 {
        return Err(ParityError::UnknownCase(
            only.unwrap_or("(none)").to_owned(),
        ));
    }
    Ok(report)
}

/// What our assistant-drafting run of one case gave.
struct Ours {
    ids: Vec<u32>,
    flags: Vec<bool>,
    rows: Vec<mlx_rs::Array>,
    trace: AssistantTrace,
    drafted: usize,
    accepted: usize,
}

fn fail(report: &mut SpecReport, what: String) {
    if report.first_failure.is_none() {
        report.first_failure = Some(what);
    }
}

impl Ours {
    fn generate(
        session: &mut Session,
        hooks: &dyn engine::model::AssistantTarget,
        drafter: &AssistantDrafter,
        case: &Value,
    ) -> Result<Ours, ParityError> {
        let prompt: Vec<u32> = field(case, "prompt_ids")?;
        let mut sampler = Sampler::new(SamplingParams::default())?;
        let mut trace = AssistantTrace::default();
        let (mut ids, mut flags, mut rows) = (Vec::new(), Vec::new(), Vec::new());
        let (_, stats, _) = assistant_generate_in(
            session,
            hooks,
            drafter,
            &prompt,
            0,
            field(case, "gamma")?,
            field(case, "max_tokens")?,
            &[],
            &mut sampler,
            Some(&mut trace),
            |id, lp, from_draft| {
                ids.push(id);
                flags.push(from_draft);
                rows.push(lp.reshape(&[-1])?);
                Ok(Flow::Continue)
            },
        )?;
        Ok(Ours {
            ids,
            flags,
            rows,
            trace,
            drafted: stats.drafted,
            accepted: stats.accepted,
        })
    }

    /// Compares this run with the golden's `case`, adding to `report`.
    fn check(
        &self,
        golden: &TensorGolden,
        case: &Value,
        report: &mut SpecReport,
    ) -> Result<(), ParityError> {
        let name: String = field(case, "name")?;
        let check = |report: &mut SpecReport,
                     ours: &mlx_rs::Array,
                     e: &TensorEntry,
                     what: String|
         -> Result<(), ParityError> {
            let (e, bytes) = golden.tensor_at(e)?;
            let cmp = compare(ours, &e, bytes)?;
            report.vectors += 1;
            report.max_abs_diff = report.max_abs_diff.max(cmp.max_abs_diff);
            if cmp.bit_exact {
                report.exact += 1;
            } else {
                fail(report, what);
            }
            Ok(())
        };
        let lp_entries: Vec<TensorEntry> = field(case, "logprobs")?;
        for (k, (row, e)) in self.rows.iter().zip(&lp_entries).enumerate() {
            check(report, row, e, format!("{name} log-probs {k}"))?;
        }
        let want_drafts: Vec<Value> = field(case, "drafts")?;
        let mut drafts_match = want_drafts.len() == self.trace.drafts.len();
        for (k, ((pos, tok_in, id, logits), want)) in
            self.trace.drafts.iter().zip(&want_drafts).enumerate()
        {
            let same = *pos as i64 == want["position"].as_i64().unwrap_or(-1)
                && u64::from(*tok_in) == want["token_in"].as_u64().unwrap_or(u64::MAX)
                && u64::from(*id) == want["id"].as_u64().unwrap_or(u64::MAX);
            drafts_match &= same;
            let e: TensorEntry = field(want, "logits")?;
            check(report, logits, &e, format!("{name} draft {k} logits"))?;
        }
        let want_passes: Vec<Value> = field(case, "passes")?;
        let passes_match = want_passes.len() == self.trace.passes.len()
            && self
                .trace
                .passes
                .iter()
                .zip(&want_passes)
                .all(|((input, n), want)| {
                    serde_json::to_value(input).ok().as_ref() == Some(&want["input"])
                        && *n as u64 == want["accepted"].as_u64().unwrap_or(u64::MAX)
                });
        let ids_match = self.ids == field::<Vec<u32>>(case, "ids")?;
        let flags_match = self.flags == field::<Vec<bool>>(case, "from_draft")?;
        report.drafted += self.drafted;
        report.accepted += self.accepted;
        report.cases += 1;
        if ids_match && flags_match && drafts_match && passes_match {
            report.cases_matching += 1;
        } else {
            fail(
                report,
                format!(
                    "{name}: ids {ids_match} trace {flags_match} drafts {drafts_match} passes \
                     {passes_match}"
                ),
            );
        }
        Ok(())
    }
}
