//! The sampling gate: the engine's sampler chain against mlx-lm's for the same seed and
//! settings (`goldens/sampling/<model>`, from `oracles/gen_sampling.py`): sampled ids must
//! be identical, step for step.

use engine::generate::generate;
use engine::generate::sampler::{Sampler, SamplingParams};
use engine::model::LanguageModel;
use serde::Deserialize;
use serde_json::Value;

use super::ParityError;
use crate::goldens::TensorGolden;

/// Models with committed sampling goldens.
pub const MODELS: [&str; 3] = ["tiny-llama-trained", "tiny-qwen3", "tiny-llama-trained-q4"];

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
pub struct Report {
    pub model: String,
    pub cases: Vec<CaseReport>,
}

impl Report {
    pub fn passed(&self) -> bool {
        self.cases.iter().all(|c| c.first_divergent_step.is_none())
    }

    pub fn summary(&self) -> String {
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

    pub fn details(&self) -> Vec<String> {
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

/// Runs every case of `goldens/sampling/<name>`; `tweak` may alter each case's parameters
/// (for planted-defect checks).
pub fn check_named(name: &str, tweak: impl Fn(&mut SamplingParams)) -> Result<Report, ParityError> {
    check_named_against(name, None, tweak)
}

/// As `check_named`, against `live_dir/<name>` (written by `gen_sampling.py --out`) if given.
pub fn check_named_against(
    name: &str,
    live_dir: Option<&std::path::Path>,
    tweak: impl Fn(&mut SamplingParams),
) -> Result<Report, ParityError> {
    let golden = match live_dir {
        Some(dir) => TensorGolden::open_index_dir(dir.join(name))?,
        None => TensorGolden::open_index_only(&format!("sampling/{name}"))?,
    };
    let dir = crate::goldens::model_dir(name)?;
    let model = engine::model::load(&dir)?;
    check(&golden.index, model.as_ref(), name, tweak)
}

fn check(
    index: &Value,
    model: &dyn LanguageModel,
    name: &str,
    tweak: impl Fn(&mut SamplingParams),
) -> Result<Report, ParityError> {
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
    Ok(Report {
        model: name.to_owned(),
        cases: reports,
    })
}
