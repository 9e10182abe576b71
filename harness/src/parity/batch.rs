//! The B=N gate: batched decoding (the batch lane's `Batch`) against mlx-lm's batched
//! generation (`BatchGenerator` goldens from oracles/gen_batch.py): per row, every logit
//! vector bit-exact and the greedy ids identical — for static batches of rows with different
//! prompt lengths (left padding) and for rows joining a running batch and leaving it when
//! they reach their token limit.

use engine::generate::batch::Batch;
use engine::generate::{greedy, Session, SessionOptions};
use mlx_rs::ops::indexing::IndexOp;
use serde_json::Value;

use super::ParityError;
use crate::compare::compare;
use crate::goldens::{TensorEntry, TensorGolden};

/// The scenarios of `goldens/batch/<model>`.
pub const SCENARIOS: [&str; 3] = ["b2", "b4", "joinleave"];

#[derive(Debug, Clone, Default)]
pub struct BatchReport {
    pub vectors: usize,
    pub exact: usize,
    pub max_abs_diff: f64,
    pub ids: usize,
    pub ids_matching: usize,
    pub first_failure: Option<String>,
}

impl BatchReport {
    pub fn passed(&self) -> bool {
        self.vectors > 0 && self.exact == self.vectors && self.ids_matching == self.ids
    }

    pub fn summary(&self) -> String {
        format!(
            "{}/{} logit vectors bit-exact (max |Δ| {:e}), {}/{} greedy ids{}",
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

struct Row {
    golden: Value,
    /// Index of the next logit vector / id to check (0 = after the prefill).
    step: usize,
    token: u32,
}

fn entry(v: &Value) -> Result<TensorEntry, ParityError> {
    serde_json::from_value(v.clone()).map_err(|e| ParityError::Index(e.to_string()))
}

/// Runs `scenario` of the batch golden of `model`: rows join the batch at their `join_at`
/// step (prefilled alone first) and leave when they have produced `max_tokens` ids.
pub fn run(model: &str, scenario: &str) -> Result<BatchReport, ParityError> {
    let golden = TensorGolden::open(&format!("batch/{model}"))?;
    let m = engine::model::load(&crate::goldens::model_dir(model)?)?;
    let rows_golden: Vec<Value> = golden.index["scenarios"]
        .as_array()
        .and_then(|s| s.iter().find(|s| s["name"] == scenario))
        .and_then(|s| s["rows"].as_array().cloned())
        .ok_or_else(|| ParityError::UnknownCase(scenario.to_owned()))?;
    let mut report = BatchReport::default();
    let check = |row: &mut Row,
                 logits: &mlx_rs::Array,
                 report: &mut BatchReport|
     -> Result<(), ParityError> {
        let name = row.golden["name"].as_str().unwrap_or("?").to_owned();
        if let Some(e) = row.golden["logits"].get(row.step) {
            let (e, bytes) = golden.tensor_at(&entry(e)?)?;
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
        if let Some(want) = row.golden["ids"].get(row.step).and_then(Value::as_u64) {
            report.ids += 1;
            if want as u32 == id {
                report.ids_matching += 1;
            } else if report.first_failure.is_none() {
                report.first_failure = Some(format!("{scenario}/{name} id step {}", row.step));
            }
        }
        row.step += 1;
        row.token = id;
        Ok(())
    };
    let limit = |r: &Row| r.golden["max_tokens"].as_u64().unwrap_or(0) as usize;
    let mut batch = Batch::new(m.as_ref());
    let mut rows: Vec<Row> = Vec::new();
    let last_join = rows_golden
        .iter()
        .filter_map(|r| r["join_at"].as_u64())
        .max()
        .unwrap_or(0) as usize;
    let mut t = 0;
    while t <= last_join || !rows.is_empty() {
        let mut sessions = Vec::new();
        for g in rows_golden
            .iter()
            .filter(|g| g["join_at"].as_u64() == Some(t as u64))
        {
            let ids: Vec<u32> = serde_json::from_value(g["prompt_ids"].clone())
                .map_err(|e| ParityError::Index(e.to_string()))?;
            let mut session = Session::with_options(m.as_ref(), &SessionOptions::default());
            let logits = session.prefill(&ids)?;
            let mut row = Row {
                golden: g.clone(),
                step: 0,
                token: 0,
            };
            check(&mut row, &logits, &mut report)?;
            if row.step < limit(&row) {
                sessions.push(session);
                rows.push(row);
            }
        }
        batch.join(sessions)?;
        t += 1;
        if rows.is_empty() {
            continue;
        }
        let ids: Vec<u32> = rows.iter().map(|r| r.token).collect();
        let logits = batch.step(&ids)?;
        for (i, row) in rows.iter_mut().enumerate() {
            check(row, &logits.index(i as i32), &mut report)?;
        }
        let keep: Vec<usize> = (0..rows.len())
            .filter(|&i| rows[i].step < limit(&rows[i]))
            .collect();
        if keep.len() < rows.len() {
            batch.keep(&keep)?;
            let mut i = 0;
            rows.retain(|_| {
                i += 1;
                keep.contains(&(i - 1))
            });
        }
    }
    Ok(report)
}
