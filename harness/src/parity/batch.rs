//! The B=N gate: batched decoding (the batch lane's `Batch`) against mlx-lm. On this backend
//! mlx-lm's `BatchGenerator` gives every row bit-identical logits to running that prompt
//! alone through `generate_step` (measured: docs/design/batch-lane.md), so each row is
//! checked against its prompt's L1 golden: every logit vector bit-exact, greedy ids equal —
//! for static batches of rows with different prompt lengths (left padding) and for rows
//! joining and leaving a running batch.

use engine::generate::batch::Batch;
use engine::generate::{greedy, Session, SessionOptions};
use mlx_rs::ops::indexing::IndexOp;
use serde_json::Value;

use super::ParityError;
use crate::compare::compare;
use crate::goldens::{TensorEntry, TensorGolden};

/// What happens before batch step `at`.
#[derive(Debug, Clone)]
pub enum Event {
    Join(Vec<&'static str>),
    Leave(Vec<&'static str>),
}

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
    case: Value,
    /// Index of the next logit vector / greedy id to check (0 = prefill).
    step: usize,
    token: u32,
}

fn entry(v: &Value) -> Result<TensorEntry, ParityError> {
    serde_json::from_value(v.clone()).map_err(|e| ParityError::Index(e.to_string()))
}

/// Runs `schedule` (events before the given batch steps) for `steps` batch steps on the L1
/// golden of `model`.
pub fn run(
    model: &str,
    schedule: &[(usize, Event)],
    steps: usize,
) -> Result<BatchReport, ParityError> {
    let golden = TensorGolden::open(&format!("l1/{model}"))?;
    let m = engine::model::load(&crate::goldens::model_dir(model)?)?;
    let cases = golden.index["cases"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let find = |name: &str| {
        cases
            .iter()
            .find(|c| c["name"] == name)
            .cloned()
            .ok_or_else(|| ParityError::UnknownCase(name.to_owned()))
    };
    let mut report = BatchReport::default();
    let check = |row: &mut Row,
                 logits: &mlx_rs::Array,
                 report: &mut BatchReport|
     -> Result<u32, ParityError> {
        let name = row.case["name"].as_str().unwrap_or("?").to_owned();
        if let Some(e) = row.case["logits"].get(row.step) {
            let (e, bytes) = golden.tensor_at(&entry(e)?)?;
            let flat = logits.as_dtype(mlx_rs::Dtype::Float32)?.reshape(&[-1])?;
            let cmp = compare(&flat, &e, bytes)?;
            report.vectors += 1;
            report.max_abs_diff = report.max_abs_diff.max(cmp.max_abs_diff);
            if cmp.bit_exact {
                report.exact += 1;
            } else if report.first_failure.is_none() {
                report.first_failure = Some(format!("{name} logits step {}", row.step));
            }
        }
        let id = greedy(logits)?;
        if let Some(want) = row.case["greedy_ids"].get(row.step).and_then(Value::as_u64) {
            report.ids += 1;
            if want as u32 == id {
                report.ids_matching += 1;
            } else if report.first_failure.is_none() {
                report.first_failure = Some(format!("{name} greedy step {}", row.step));
            }
        }
        row.step += 1;
        row.token = id;
        Ok(id)
    };
    let mut batch = Batch::new(m.as_ref());
    let mut rows: Vec<Row> = Vec::new();
    for t in 0..steps {
        for (_, event) in schedule.iter().filter(|(at, _)| *at == t) {
            match event {
                Event::Join(names) => {
                    let mut sessions = Vec::new();
                    for name in names {
                        let case = find(name)?;
                        let ids: Vec<u32> = serde_json::from_value(case["prompt_ids"].clone())
                            .map_err(|e| ParityError::Index(e.to_string()))?;
                        let mut session =
                            Session::with_options(m.as_ref(), &SessionOptions::default());
                        let logits = session.prefill(&ids)?;
                        let mut row = Row {
                            case,
                            step: 0,
                            token: 0,
                        };
                        check(&mut row, &logits, &mut report)?;
                        sessions.push(session);
                        rows.push(row);
                    }
                    batch.join(sessions)?;
                }
                Event::Leave(names) => {
                    let keep: Vec<usize> = (0..rows.len())
                        .filter(|&i| !names.iter().any(|n| rows[i].case["name"] == *n))
                        .collect();
                    batch.keep(&keep)?;
                    rows = rows
                        .into_iter()
                        .enumerate()
                        .filter(|(i, _)| keep.contains(i))
                        .map(|(_, r)| r)
                        .collect();
                }
            }
        }
        if rows.is_empty() {
            continue;
        }
        let ids: Vec<u32> = rows.iter().map(|r| r.token).collect();
        let logits = batch.step(&ids)?;
        for (i, row) in rows.iter_mut().enumerate() {
            check(row, &logits.index(i as i32), &mut report)?;
        }
    }
    Ok(report)
}
