//! The B=N gate: batched decoding (the batch lane's `Batch`) against mlx-lm's batched
//! generation (`BatchGenerator` goldens from oracles/gen_batch.py): per row, every logit
//! vector bit-exact and the greedy ids identical — for static batches of rows with different
//! prompt lengths (left padding) and for rows joining a running batch and leaving it when
//! they reach their token limit. Rows are admitted as BatchGenerator admits them: every
//! prompt token but the last prefilled (alone), the last fed by one step of the rows that
//! join together (`Batch::admit`), which gives their first logits. `run_prompt_batches`
//! admits them as BatchGenerator's prompt batch instead, op for op (`Batch::admit_prompts`:
//! one right-padded forward with each row's length): the check of the recurrent mixers'
//! batched prefill (mask, lengths) against the same goldens.
//!
//! A golden with `settings.kv_bits` (gate `batch-kv4`) holds each row's single-sequence
//! `generate_step(kv_bits=…)` run instead (mlx-lm has no quantized batch cache): the rows'
//! sessions quantize their caches as that run does, and the batch decodes over quantized
//! K/V.

use engine::cache::kv_quant::{KvLayers, KvQuantPlan};
use engine::cache::QuantSdpa;
use engine::generate::batch::Batch;
use engine::generate::{greedy, Session, SessionOptions};
use mlx_rs::ops::indexing::IndexOp;
use serde::Deserialize;

use super::{ParityError, Report};
use crate::compare::compare;
use crate::goldens::{TensorEntry, TensorGolden};

#[derive(Debug, Clone, Default)]
pub struct BatchReport {
    pub model: String,
    /// The scenario run, or None for all of them.
    pub scenario: Option<String>,
    pub vectors: usize,
    pub exact: usize,
    pub max_abs_diff: f64,
    pub ids: usize,
    pub ids_matching: usize,
    pub first_failure: Option<String>,
}

impl Report for BatchReport {
    fn passed(&self) -> bool {
        self.vectors > 0 && self.exact == self.vectors && self.ids_matching == self.ids
    }

    fn summary(&self) -> String {
        let scenario = self
            .scenario
            .as_ref()
            .map_or(String::new(), |s| format!(" {s}"));
        format!(
            "L1 batch {}{scenario}: {}/{} logit vectors bit-exact (max |Δ| {:e}), {}/{} greedy ids{}",
            self.model,
            self.exact,
            self.vectors,
            self.max_abs_diff,
            self.ids_matching,
            self.ids,
            self.first_failure
                .as_ref()
                .map_or(String::new(), |f| format!(", first failure: {f}"))
        )
    }
}

/// One scenario of the golden: rows of one batch.
#[derive(Debug, Deserialize)]
struct Scenario {
    name: String,
    rows: Vec<GoldenRow>,
}

/// One row: it joins at step `join_at` and leaves after `max_tokens` ids.
#[derive(Debug, Deserialize)]
struct GoldenRow {
    name: String,
    join_at: usize,
    max_tokens: usize,
    prompt_ids: Vec<u32>,
    ids: Vec<u32>,
    logits: Vec<TensorEntry>,
}

/// A row in the running batch.
struct Row<'g> {
    golden: &'g GoldenRow,
    /// Index of the next logit vector / id to check (0 = after the prefill).
    step: usize,
    token: u32,
}

/// Runs `scenario` (default: every scenario) of `golden`, the batch golden of `model`: rows
/// join the batch at their `join_at` step (prefilled alone first) and leave when they have
/// produced `max_tokens` ids.
pub fn run(
    model: &str,
    golden: &TensorGolden,
    scenario: Option<&str>,
) -> Result<BatchReport, ParityError> {
    run_admitting(model, golden, scenario, Admission::Rows)
}

/// As `run`, each group of joining rows admitted as BatchGenerator's prompt batch
/// (`Batch::admit_prompts`) instead of prefilled row by row.
pub fn run_prompt_batches(
    model: &str,
    golden: &TensorGolden,
    scenario: Option<&str>,
) -> Result<BatchReport, ParityError> {
    run_admitting(model, golden, scenario, Admission::PromptBatch)
}

/// How joining rows are prefilled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Admission {
    /// Each alone, as the batch lane does (`Batch::admit`).
    Rows,
    /// Together in one right-padded forward (`Batch::admit_prompts`).
    PromptBatch,
}

fn run_admitting(
    model: &str,
    golden: &TensorGolden,
    scenario: Option<&str>,
    admission: Admission,
) -> Result<BatchReport, ParityError> {
    let m = engine::model::load(&crate::goldens::model_dir(model)?)?;
    let mut report = BatchReport {
        model: model.to_owned(),
        scenario: scenario.map(str::to_owned),
        ..Default::default()
    };
    let scenarios: Vec<Scenario> = serde_json::from_value(golden.index["scenarios"].clone())
        .map_err(|e| ParityError::Index(format!("scenarios: {e}")))?;
    let chosen: Vec<&Scenario> = scenarios
        .iter()
        .filter(|s| scenario.is_none_or(|want| s.name == want))
        .collect();
    if chosen.is_empty() {
        return Err(ParityError::UnknownCase(
            scenario.unwrap_or("(none)").to_owned(),
        ));
    }
    let opts = session_options(&golden.index["settings"]);
    for s in chosen {
        let run = Run {
            golden,
            model: m.as_ref(),
            opts: &opts,
            scenario: s,
            admission,
        };
        run_scenario(&run, &mut report)?;
    }
    Ok(report)
}

/// The rows' session options: mlx-lm's `kv_bits` quantization (quantized from the first
/// prefill chunk on, read through mlx-lm's quantized SDPA) where the golden has it.
fn session_options(settings: &serde_json::Value) -> SessionOptions {
    let int = |k: &str| settings[k].as_i64().map(|v| v as i32);
    SessionOptions {
        kv_quant: int("kv_bits").map(|bits| KvQuantPlan {
            layers: KvLayers::Uniform {
                bits,
                group_size: int("kv_group_size").unwrap_or(64),
            },
            start: int("quantized_kv_start").unwrap_or(0),
            sdpa: QuantSdpa::MlxLm,
        }),
        ..SessionOptions::default()
    }
}

/// Checks one row's logits and greedy id at its current step, then moves it on.
fn check_row(
    golden: &TensorGolden,
    scenario: &str,
    row: &mut Row,
    logits: &mlx_rs::Array,
    report: &mut BatchReport,
) -> Result<(), ParityError> {
    let name = &row.golden.name;
    if let Some(e) = row.golden.logits.get(row.step) {
        let (e, bytes) = golden.tensor_at(e)?;
        let flat = logits.as_dtype(mlx_rs::Dtype::Float32)?.reshape(&[-1])?;
        let cmp = compare(&flat, &e, bytes)?;
        report.vectors += 1;
        report.max_abs_diff = report.max_abs_diff.max(cmp.max_abs_diff);
        if cmp.bit_exact {
            report.exact += 1;
        } else if report.first_failure.is_none() {
            report.first_failure = Some(format!("{scenario}/{name} logits step {}", row.step));
        }
    }
    let id = greedy(logits)?;
    if let Some(&want) = row.golden.ids.get(row.step) {
        report.ids += 1;
        if want == id {
            report.ids_matching += 1;
        } else if report.first_failure.is_none() {
            report.first_failure = Some(format!("{scenario}/{name} id step {}", row.step));
        }
    }
    row.step += 1;
    row.token = id;
    Ok(())
}

/// Drops the rows that have reached their token limit (batch and bookkeeping alike).
fn leave(batch: &mut Batch, rows: &mut Vec<Row>) -> Result<(), ParityError> {
    let keep: Vec<usize> = (0..rows.len())
        .filter(|&i| rows[i].step < rows[i].golden.max_tokens)
        .collect();
    if keep.len() < rows.len() {
        batch.keep(&keep)?;
        let mut i = 0;
        rows.retain(|_| {
            i += 1;
            keep.contains(&(i - 1))
        });
    }
    Ok(())
}

/// What one scenario's run reads.
struct Run<'a, 'g> {
    golden: &'a TensorGolden,
    model: &'a dyn engine::model::LanguageModel,
    opts: &'a SessionOptions,
    scenario: &'g Scenario,
    admission: Admission,
}

/// Admits the rows that join at step `t`: prompts but the last token prefilled alone, then
/// one step of their own for the last tokens (checked: each row's first logits).
fn admit<'a, 'g>(
    run: &Run<'a, 'g>,
    t: usize,
    batch: &mut Batch<'a>,
    rows: &mut Vec<Row<'g>>,
    report: &mut BatchReport,
) -> Result<(), ParityError> {
    let (mut sessions, mut last, mut joining) = (Vec::new(), Vec::new(), Vec::new());
    for g in run.scenario.rows.iter().filter(|g| g.join_at == t) {
        joining.push(Row {
            golden: g,
            step: 0,
            token: 0,
        });
        if run.admission == Admission::PromptBatch {
            continue;
        }
        let mut session = Session::with_options(run.model, run.opts);
        let (body, tail) = g.prompt_ids.split_at(g.prompt_ids.len() - 1);
        for chunk in body.chunks(session.prefill_step) {
            session.prefill_chunk(chunk)?;
        }
        sessions.push(session);
        last.push(tail[0]);
    }
    if joining.is_empty() {
        return Ok(());
    }
    let logits = match run.admission {
        Admission::Rows => batch.admit(sessions, &last)?,
        Admission::PromptBatch => {
            let prompts: Vec<&[u32]> = joining.iter().map(|r| &r.golden.prompt_ids[..]).collect();
            batch.admit_prompts(&prompts, engine::generate::PREFILL_STEP)?
        }
    };
    for (i, row) in joining.iter_mut().enumerate() {
        check_row(
            run.golden,
            &run.scenario.name,
            row,
            &logits.index(i as i32),
            report,
        )?;
    }
    rows.extend(joining);
    leave(batch, rows)
}

fn run_scenario(run: &Run<'_, '_>, report: &mut BatchReport) -> Result<(), ParityError> {
    let (golden, scenario) = (run.golden, run.scenario);
    let mut batch = Batch::new(run.model);
    let mut rows: Vec<Row> = Vec::new();
    let last_join = scenario.rows.iter().map(|r| r.join_at).max().unwrap_or(0);
    let mut t = 0;
    while t <= last_join || !rows.is_empty() {
        admit(run, t, &mut batch, &mut rows, report)?;
        t += 1;
        if rows.is_empty() {
            continue;
        }
        let ids: Vec<u32> = rows.iter().map(|r| r.token).collect();
        let logits = batch.step(&ids)?;
        for (i, row) in rows.iter_mut().enumerate() {
            check_row(golden, &scenario.name, row, &logits.index(i as i32), report)?;
        }
        leave(&mut batch, &mut rows)?;
    }
    Ok(())
}
