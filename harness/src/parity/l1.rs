//! The L1 gate: the engine against mlx-lm's greedy generation on the same model
//! (`goldens/l1/<model>`, from `oracles/gen_l1.py`). Per case: tokenizer ids and the chat
//! template string must equal transformers', every stored logit vector must be bit-exact,
//! and the greedy ids must be identical.

use engine::generate::{greedy, Session, SessionOptions};
use engine::load::config::ModelConfig;
use engine::load::template::{ChatTemplate, Message};
use engine::load::tokenizer::Tokenizer;
use engine::load::weights::Weights;
use engine::model::LanguageModel;
use serde::Deserialize;

use super::{Count, ParityError, Report};
use crate::compare::{compare, Comparison};
use crate::goldens::{TensorEntry, TensorGolden};

#[derive(Debug, Deserialize)]
struct Case {
    name: String,
    #[serde(flatten)]
    prompt: Prompt,
    greedy_ids: Vec<u32>,
    logits: Vec<TensorEntry>,
}

/// A golden case's prompt as the oracle made it (the L1 and real-vocabulary goldens share
/// it): `raw` text encoded with special tokens, `chat` messages rendered with the template
/// (and the string it rendered), or `ids` given as they are; and the oracle's ids.
#[derive(Debug, Deserialize)]
pub(super) struct Prompt {
    kind: String,
    prompt: Option<String>,
    messages: Option<Vec<MessageJson>>,
    rendered: Option<String>,
    pub prompt_ids: Vec<u32>,
}

#[derive(Debug, Deserialize)]
struct MessageJson {
    role: String,
    content: String,
}

impl Prompt {
    /// The prompt's ids the way mlx_lm.generate makes them, and (for a chat case) whether
    /// our template renders the oracle's string.
    pub(super) fn ids(
        &self,
        case: &str,
        tokenizer: &Tokenizer,
        template: Option<&ChatTemplate>,
    ) -> Result<(Vec<u32>, Option<bool>), ParityError> {
        Ok(match self.kind.as_str() {
            "chat" => {
                let template = template.ok_or_else(|| {
                    ParityError::Index(format!("{case}: a chat case but no chat template"))
                })?;
                let messages: Vec<Message> = self
                    .messages
                    .iter()
                    .flatten()
                    .map(|m| Message::new(&m.role, &m.content))
                    .collect();
                let rendered = template.render(&messages, true)?;
                let matches = self.rendered.as_deref() == Some(rendered.as_str());
                (tokenizer.encode(&rendered, false)?, Some(matches))
            }
            // Given as ids (e.g. a long prompt cut to length): nothing to tokenize.
            "ids" => (self.prompt_ids.clone(), None),
            _ => (
                tokenizer.encode(self.prompt.as_deref().unwrap_or_default(), true)?,
                None,
            ),
        })
    }
}

/// One prompt's verdict.
#[derive(Debug, Clone)]
pub struct CaseReport {
    pub name: String,
    pub ids_match: bool,
    /// None for raw prompts (no template involved).
    pub template_match: Option<bool>,
    pub logits: Vec<Comparison>,
    pub greedy_matching: usize,
    pub greedy_total: usize,
    /// The first decode step whose greedy id differs from the oracle's.
    pub first_divergent_step: Option<usize>,
    /// A divergence at a knife-edge: the oracle's own top-2 logit gap at that step was at
    /// most `TIE_EPS`, so either id is a correct argmax. Reported, never hidden; steps after
    /// it are not compared (the trajectories legitimately differ from there on).
    pub tie_at: Option<usize>,
    /// Where a run told to stop at the first difference ([`Stop::AtFirstDifference`]) left
    /// this case: the step whose logits or greedy id already failed it. None: every step ran.
    pub stopped_at: Option<usize>,
}

/// How far a case runs. A gate run to show that a planted defect fails it needs only the
/// first difference of each case (the step it names, and the verdict): the steps after it
/// cannot make the case pass again, so they are not run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// Every step of every case (the gate's verdict and its counts).
    AtEnd,
    /// A case stops at its first inexact logit vector, or at its first greedy id past the
    /// compared logits that differs from the oracle's.
    AtFirstDifference,
    /// A case runs the steps that have a stored logit vector (the prefill and the first
    /// decode steps), then stops. For a run that changes only how the prompt is prefilled
    /// (its chunk size), these steps read everything the prefill left in the caches, each
    /// to the bit; the greedy steps past them are the standard gate's, which runs them all.
    AtLastComparedLogits,
}

/// Top-2 logit gap (f32 logits) under which a greedy step counts as a tie.
pub const TIE_EPS: f32 = 1e-5;

impl CaseReport {
    pub fn logits_exact(&self) -> usize {
        self.logits.iter().filter(|c| c.bit_exact).count()
    }

    /// The first logit vector (0 = prefill) that is not bit-exact.
    pub fn first_inexact_logits(&self) -> Option<usize> {
        self.logits.iter().position(|c| !c.bit_exact)
    }

    pub fn passed(&self) -> bool {
        let greedy_ok = self.greedy_matching == self.greedy_total
            || (self.tie_at.is_some() && self.tie_at == self.first_divergent_step);
        self.ids_match
            && self.template_match != Some(false)
            && self.logits_exact() == self.logits.len()
            && greedy_ok
    }
}

/// All prompts of one model.
#[derive(Debug, Clone)]
pub struct ModelReport {
    /// "L1", "L2", …: the tier whose oracle made the goldens.
    pub tier: &'static str,
    pub model: String,
    pub cases: Vec<CaseReport>,
}

impl Report for ModelReport {
    fn passed(&self) -> bool {
        self.cases.iter().all(CaseReport::passed)
    }

    fn summary(&self) -> String {
        let counts = self.counts();
        let (exact, total) = (counts[0].value, counts[0].total);
        let (ids, steps) = (counts[1].value, counts[1].total);
        let tok = self.cases.iter().filter(|c| c.ids_match).count();
        let tpl: Vec<bool> = self.cases.iter().filter_map(|c| c.template_match).collect();
        let ties = self.cases.iter().filter(|c| c.tie_at.is_some()).count();
        let worst = self
            .cases
            .iter()
            .flat_map(|c| {
                c.logits
                    .iter()
                    .enumerate()
                    .map(move |(step, cmp)| (cmp.max_abs_diff, &c.name, step))
            })
            .max_by(|a, b| a.0.total_cmp(&b.0));
        let max_delta = match worst {
            Some((d, case, step)) if d > 0.0 => format!("max |Δ| {d:e} ({case} step {step})"),
            _ => "max |Δ| 0".to_owned(),
        };
        let stopped = self.cases.iter().filter(|c| c.stopped_at.is_some()).count();
        let stopped = match stopped {
            0 => String::new(),
            k => format!(" ({k} cases stopped at their first difference)"),
        };
        format!(
            "{} {}: {exact}/{total} logit vectors bit-exact ({max_delta}), {ids}/{steps} greedy ids, \
             tokenizer {tok}/{n}, template {}/{}, ties {ties}{stopped}",
            self.tier,
            self.model,
            tpl.iter().filter(|&&m| m).count(),
            tpl.len(),
            n = self.cases.len(),
        )
    }

    /// Per-case lines, with the first divergence named where there is one.
    fn details(&self) -> Vec<String> {
        self.cases
            .iter()
            .map(|c| {
                let mut line = format!(
                    "  {}: logits {}/{}, greedy {}/{}",
                    c.name,
                    c.logits_exact(),
                    c.logits.len(),
                    c.greedy_matching,
                    c.greedy_total
                );
                if !c.ids_match {
                    line.push_str(", TOKENIZER IDS DIFFER");
                }
                if c.template_match == Some(false) {
                    line.push_str(", TEMPLATE STRING DIFFERS");
                }
                if let Some(step) = c.first_inexact_logits() {
                    line.push_str(&format!(
                        ", first inexact logits at step {step} ({})",
                        c.logits[step]
                    ));
                }
                if let Some(step) = c.first_divergent_step {
                    line.push_str(&format!(", greedy diverges at step {step}"));
                }
                if let Some(step) = c.tie_at {
                    line.push_str(&format!(
                        " (a tie: oracle top-2 gap ≤ {TIE_EPS:e} at step {step})"
                    ));
                }
                if let Some(step) = c.stopped_at {
                    line.push_str(&format!(", stopped there (step {step})"));
                }
                line
            })
            .collect()
    }

    /// Logit vectors bit-exact and greedy ids identical, over all cases.
    fn counts(&self) -> Vec<Count> {
        let sum = |metric, f: fn(&CaseReport) -> (usize, usize)| {
            let (value, total) = self
                .cases
                .iter()
                .map(f)
                .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
            Count {
                metric,
                value,
                total,
            }
        };
        vec![
            sum("logit_vectors_bit_exact", |c| {
                (c.logits_exact(), c.logits.len())
            }),
            sum("greedy_ids_identical", |c| {
                (c.greedy_matching, c.greedy_total)
            }),
        ]
    }
}

/// An L1 report on a golden made with mlx-lm's kv_bits: its summary line only.
#[derive(Debug, Clone)]
pub struct KvBits(pub ModelReport);

impl Report for KvBits {
    fn summary(&self) -> String {
        format!("{} (mlx-lm kv_bits)", self.0.summary())
    }

    fn passed(&self) -> bool {
        self.0.passed()
    }

    fn counts(&self) -> Vec<Count> {
        self.0.counts()
    }
}

/// The golden's prefill chunk size (mlx-lm's 2048 unless its settings say otherwise).
pub(super) fn prefill_step(golden: &TensorGolden) -> usize {
    golden.index["settings"]["prefill_step_size"]
        .as_u64()
        .map_or(engine::generate::PREFILL_STEP, |s| s as usize)
}

/// The session options a golden was made with: mlx-lm's KV quantization when its settings
/// name `kv_bits` (uniform, mlx-lm's quantized SDPA), else the defaults.
pub fn options(golden: &TensorGolden) -> SessionOptions {
    use engine::generate::{KvLayers, KvQuantPlan};
    let settings = &golden.index["settings"];
    let int = |k: &str, default: i64| settings[k].as_i64().unwrap_or(default) as i32;
    SessionOptions {
        kv_quant: settings["kv_bits"].as_i64().map(|bits| KvQuantPlan {
            layers: KvLayers::Uniform {
                bits: bits as i32,
                group_size: int("kv_group_size", 64),
            },
            start: int("quantized_kv_start", 5000),
            sdpa: engine::cache::QuantSdpa::MlxLm,
        }),
        ..Default::default()
    }
}

/// The L1 gate of `model` on `golden` (`l1/<model>`, or one made with other settings, such as
/// `l1/tiny-llama-trained-kv4`): the model loaded with `tweak_config` applied to its
/// config.json, run with the golden's session options after `tweak_options` (planted
/// defects), prefilled in chunks of the golden's `prefill_step_size`. The report is named
/// after the golden.
pub fn run(
    model: &str,
    golden: &TensorGolden,
    tweak_config: impl FnOnce(&mut serde_json::Value),
    tweak_options: impl FnOnce(&mut SessionOptions),
    stop: Stop,
) -> Result<ModelReport, ParityError> {
    let dir = crate::goldens::model_dir(model)?;
    let mut config = ModelConfig::read(&dir)?;
    tweak_config(&mut config.raw);
    let built = engine::model::build(&config, Weights::load(&dir)?)?;
    let mut opts = options(golden);
    tweak_options(&mut opts);
    let mut report = check_in_dir(golden, &dir, built.as_ref(), &opts, stop)?;
    if let Some(name) = golden.dir.file_name() {
        report.model = name.to_string_lossy().into_owned();
    }
    Ok(report)
}

/// Runs every case of `golden` through `model` with `opts`, with the tokenizer and chat
/// template of the model's directory `dir`, prefilling in chunks of the golden's
/// `prefill_step_size`, each case until `stop`.
pub(super) fn check_in_dir(
    golden: &TensorGolden,
    dir: &std::path::Path,
    model: &dyn engine::model::LanguageModel,
    opts: &SessionOptions,
    stop: Stop,
) -> Result<ModelReport, ParityError> {
    let tokenizer = Tokenizer::load(dir)?;
    let template = ChatTemplate::from_tokenizer(&tokenizer)?;
    let step = prefill_step(golden);
    let cases = Cases {
        tokenizer: &tokenizer,
        template: template.as_ref(),
        prefill_step: step,
        opts,
        stop,
    };
    cases.check(golden, model)
}

/// Runs every case of `golden` through `model` with the default session options, prefilling
/// in chunks of `prefill_step`, each case until `stop`.
pub fn check_model_with(
    golden: &TensorGolden,
    model: &dyn LanguageModel,
    tokenizer: &Tokenizer,
    template: Option<&ChatTemplate>,
    prefill_step: usize,
    stop: Stop,
) -> Result<ModelReport, ParityError> {
    let cases = Cases {
        tokenizer,
        template,
        prefill_step,
        opts: &SessionOptions::default(),
        stop,
    };
    cases.check(golden, model)
}

/// As `check_model_with`, with explicit session options (KV quantization for L2/L3).
pub fn check_model_opts(
    golden: &TensorGolden,
    model: &dyn LanguageModel,
    tokenizer: &Tokenizer,
    template: Option<&ChatTemplate>,
    prefill_step: usize,
    opts: &SessionOptions,
) -> Result<ModelReport, ParityError> {
    let cases = Cases {
        tokenizer,
        template,
        prefill_step,
        opts,
        stop: Stop::AtEnd,
    };
    cases.check(golden, model)
}

/// How every case of a golden runs: the model's tokenizer and template, the prefill chunk,
/// the session options and how far each case goes.
struct Cases<'a> {
    tokenizer: &'a Tokenizer,
    template: Option<&'a ChatTemplate>,
    prefill_step: usize,
    opts: &'a SessionOptions,
    stop: Stop,
}

impl Cases<'_> {
    fn check(
        &self,
        golden: &TensorGolden,
        model: &dyn LanguageModel,
    ) -> Result<ModelReport, ParityError> {
        let cases: Vec<Case> = serde_json::from_value(golden.index["cases"].clone())
            .map_err(|e| ParityError::Index(e.to_string()))?;
        let name = golden.index["model"]
            .as_str()
            .unwrap_or("?")
            .trim_start_matches("models/")
            .to_owned();
        let mut reports = Vec::new();
        for case in &cases {
            reports.push(self.case(golden, case, model)?);
        }
        Ok(ModelReport {
            tier: "L1",
            model: name,
            cases: reports,
        })
    }

    fn case(
        &self,
        golden: &TensorGolden,
        case: &Case,
        model: &dyn LanguageModel,
    ) -> Result<CaseReport, ParityError> {
        let (ids, template_match) = case.prompt.ids(&case.name, self.tokenizer, self.template)?;
        let ids_match = ids == case.prompt.prompt_ids;

        // Generation always starts from the oracle's ids, so the model is judged on its own.
        let mut session = Session::with_options(model, self.opts);
        session.prefill_step = self.prefill_step;
        let mut logits = session.prefill(&case.prompt.prompt_ids)?;
        let mut comparisons = Vec::new();
        let mut greedy_ids = Vec::new();
        let mut stopped_at = None;
        let steps = match self.stop {
            Stop::AtLastComparedLogits => case.logits.len().min(case.greedy_ids.len()),
            Stop::AtEnd | Stop::AtFirstDifference => case.greedy_ids.len(),
        };
        for step in 0..steps {
            let mut differs = false;
            if let Some(entry) = case.logits.get(step) {
                let (entry, bytes) = golden.tensor_at(entry)?;
                let flat = logits.as_dtype(mlx_rs::Dtype::Float32)?.reshape(&[-1])?;
                let comparison = compare(&flat, &entry, bytes)?;
                differs = !comparison.bit_exact;
                comparisons.push(comparison);
            }
            let id = greedy(&logits)?;
            greedy_ids.push(id);
            // Past the compared logits a different id cannot be a tie: the case failed.
            differs |= step >= case.logits.len() && id != case.greedy_ids[step];
            if differs && self.stop == Stop::AtFirstDifference {
                stopped_at = Some(step);
                break;
            }
            if step + 1 < steps {
                logits = session.step(&[id])?;
            }
        }
        let first_divergent_step = greedy_ids
            .iter()
            .zip(&case.greedy_ids)
            .position(|(a, b)| a != b);
        let tie_at = match first_divergent_step {
            Some(step) if step < case.logits.len() => {
                let (_, bytes) = golden.tensor_at(&case.logits[step])?;
                (top2_gap(bytes) <= TIE_EPS).then_some(step)
            }
            _ => None,
        };
        if let Some(step) = tie_at {
            comparisons.truncate(step + 1);
        }
        let greedy_matching = greedy_ids
            .iter()
            .zip(&case.greedy_ids)
            .filter(|(a, b)| a == b)
            .count();
        Ok(CaseReport {
            name: case.name.clone(),
            ids_match,
            template_match,
            logits: comparisons,
            greedy_matching,
            greedy_total: steps,
            first_divergent_step,
            tie_at,
            stopped_at,
        })
    }
}

/// The gap between the largest and second-largest of little-endian f32 logits.
fn top2_gap(bytes: &[u8]) -> f32 {
    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for c in bytes.chunks_exact(4) {
        let v = f32::from_le_bytes(c.try_into().unwrap());
        if v > a {
            b = a;
            a = v;
        } else if v > b {
            b = v;
        }
    }
    a - b
}
