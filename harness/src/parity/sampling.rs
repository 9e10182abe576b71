//! The sampling gate: the engine's sampler chain against mlx-lm's for the same seed and
//! settings (`goldens/sampling/<model>`, from `oracles/gen_sampling.py`): sampled ids must
//! be identical, step for step.

use engine::generate::generate;
use engine::generate::sampler::{Sampler, SamplingParams};
use engine::model::LanguageModel;
use serde::Deserialize;
use serde_json::Value;

use super::{ParityError, Report};
use crate::goldens::TensorGolden;

#[derive(Debug, Deserialize)]
struct Case {
    name: String,
    settings: Value,
    prompt_ids: Vec<u32>,
    sampled_ids: Vec<u32>,
}

/// mlx-lm's keyword arguments (as the golden stores them) → our parameters.
pub fn params_from_settings(s: &Value) -> SamplingParams {
    let f = |k: &str| s.get(k).and_then(Value::as_f64);
    let u = |k: &str, d: usize| s.get(k).and_then(Value::as_u64).map_or(d, |v| v as usize);
    let d = SamplingParams::default();
    SamplingParams {
        temp: f("temp").unwrap_or(0.0),
        top_p: f("top_p").unwrap_or(0.0),
        min_p: f("min_p").unwrap_or(0.0),
        min_tokens_to_keep: u("min_tokens_to_keep", 1) as i32,
        top_k: u("top_k", 0) as i32,
        seed: s.get("seed").and_then(Value::as_u64).unwrap_or(0),
        logit_bias: s
            .get("logit_bias")
            .and_then(Value::as_object)
            .map(|m| {
                m.iter()
                    .filter_map(|(k, v)| Some((k.parse().ok()?, v.as_f64()? as f32)))
                    .collect()
            })
            .unwrap_or_default(),
        repetition_penalty: f("repetition_penalty"),
        repetition_context_size: u("repetition_context_size", d.repetition_context_size),
        presence_penalty: f("presence_penalty"),
        presence_context_size: u("presence_context_size", d.presence_context_size),
        frequency_penalty: f("frequency_penalty"),
        frequency_context_size: u("frequency_context_size", d.frequency_context_size),
    }
}

#[derive(Debug, Clone)]
pub struct CaseReport {
    pub name: String,
    pub matching: usize,
    pub total: usize,
    pub first_divergent_step: Option<usize>,
}

#[derive(Debug, Clone)]
pub struct SamplingReport {
    pub model: String,
    pub cases: Vec<CaseReport>,
}

impl Report for SamplingReport {
    fn passed(&self) -> bool {
        self.cases.iter().all(|c| c.first_divergent_step.is_none())
    }

    fn summary(&self) -> String {
        let (m, t) = self
            .cases
            .iter()
            .fold((0, 0), |(m, t), c| (m + c.matching, t + c.total));
        let exact = self
            .cases
            .iter()
            .filter(|c| c.first_divergent_step.is_none())
            .count();
        format!(
            "L1 sampling {}: {exact}/{} settings×prompts identical, {m}/{t} sampled ids",
            self.model,
            self.cases.len()
        )
    }

    /// The cases that diverge.
    fn details(&self) -> Vec<String> {
        self.cases
            .iter()
            .filter_map(|c| {
                c.first_divergent_step.map(|s| {
                    format!(
                        "  {}: {}/{} ids, diverges at step {s}",
                        c.name, c.matching, c.total
                    )
                })
            })
            .collect()
    }
}

/// Runs every case of `golden`, the sampling golden of `model`; `tweak` may alter each
/// case's parameters (for planted-defect checks).
pub fn run(
    model: &str,
    golden: &TensorGolden,
    tweak: impl Fn(&mut SamplingParams),
) -> Result<SamplingReport, ParityError> {
    let loaded = engine::model::load(&crate::goldens::model_dir(model)?)?;
    check(&golden.index, loaded.as_ref(), model, tweak)
}

fn check(
    index: &Value,
    model: &dyn LanguageModel,
    name: &str,
    tweak: impl Fn(&mut SamplingParams),
) -> Result<SamplingReport, ParityError> {
    let cases: Vec<Case> = serde_json::from_value(index["cases"].clone())
        .map_err(|e| ParityError::Index(e.to_string()))?;
    let mut reports = Vec::new();
    for case in cases {
        let mut params = params_from_settings(&case.settings);
        tweak(&mut params);
        let mut sampler = Sampler::new(params)?;
        let mut ids = Vec::new();
        generate(
            model,
            &case.prompt_ids,
            case.sampled_ids.len(),
            &[],
            &mut sampler,
            |id, _| {
                ids.push(id);
                Ok(engine::generate::Flow::Continue)
            },
        )?;
        reports.push(CaseReport {
            name: case.name,
            matching: ids
                .iter()
                .zip(&case.sampled_ids)
                .filter(|(a, b)| a == b)
                .count(),
            total: case.sampled_ids.len(),
            first_divergent_step: ids
                .iter()
                .zip(&case.sampled_ids)
                .position(|(a, b)| a != b)
                .or((ids.len() != case.sampled_ids.len())
                    .then_some(ids.len().min(case.sampled_ids.len()))),
        });
    }
    Ok(SamplingReport {
        model: name.to_owned(),
        cases: reports,
    })
}
