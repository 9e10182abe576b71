//! The batch lane's admission path (serve/batch_lane/admit.rs) against mlx-lm's
//! `BatchGenerator` goldens (goldens/batch, oracles/gen_batch.py): rows that arrive in the
//! same tick have all their prompt tokens but the last prefilled (each alone, in the
//! lane's chunks), join the batch together, and their last prompt tokens are fed by the
//! batched step that runs every row — which gives their first logits, as BatchGenerator's
//! generation batch does. Every row's logit vectors bit-exact, greedy ids identical, on
//! every model of the B=N gate; the planted unmasked padding fails it.

mod common;

use engine::generate::batch::Batch;
use engine::generate::{greedy, Session, SessionOptions};
use mlx_rs::ops::indexing::IndexOp;
use serde_json::Value;

const MODELS: [&str; 5] = [
    "tiny-llama-trained",
    "tiny-qwen3-moe",
    "tiny-mixtral",
    "tiny-qwen2-moe",
    "tiny-phi3",
];

#[derive(Default, Debug)]
struct Tally {
    vectors: usize,
    exact: usize,
    ids: usize,
    ids_matching: usize,
}

impl Tally {
    fn passed(&self) -> bool {
        self.vectors > 0 && self.exact == self.vectors && self.ids_matching == self.ids
    }
}

/// One golden row in the running batch: its golden entry and next step.
struct Row<'g> {
    golden: &'g Value,
    step: usize,
}

/// The golden's f32 logits at `entry` ({offset, bytes}).
fn expected(data: &[u8], entry: &Value) -> Vec<u8> {
    let at = entry["offset"].as_u64().unwrap() as usize;
    let n = entry["bytes"].as_u64().unwrap() as usize;
    data[at..at + n].to_vec()
}

fn ids_of(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// Runs every scenario of `model`'s batch golden through the admission path, with prompt
/// chunks of `prefill_step` tokens.
fn run(model: &str, prefill_step: usize) -> Tally {
    let m = common::model(model);
    let dir = common::goldens().join("batch").join(model);
    let index: Value =
        serde_json::from_slice(&std::fs::read(dir.join("index.json")).unwrap()).unwrap();
    let data = std::fs::read(dir.join("logits.bin")).unwrap();
    let mut tally = Tally::default();
    for scenario in index["scenarios"].as_array().unwrap() {
        let golden_rows = scenario["rows"].as_array().unwrap();
        let mut batch = Batch::new(m.as_ref());
        let (mut rows, mut next): (Vec<Row>, Vec<u32>) = (Vec::new(), Vec::new());
        let last_join = golden_rows
            .iter()
            .map(|r| r["join_at"].as_u64().unwrap())
            .max()
            .unwrap();
        let mut t = 0;
        while t <= last_join || !rows.is_empty() {
            // This tick's arrivals: prompts but the last token prefilled, joined together.
            let mut sessions = Vec::new();
            for g in golden_rows
                .iter()
                .filter(|g| g["join_at"].as_u64() == Some(t))
            {
                let prompt = ids_of(&g["prompt_ids"]);
                let mut session = Session::with_options(m.as_ref(), &SessionOptions::default());
                let body = &prompt[..prompt.len() - 1];
                for chunk in body.chunks(prefill_step) {
                    session.prefill_chunk(chunk).unwrap();
                }
                sessions.push(session);
                rows.push(Row { golden: g, step: 0 });
                next.push(*prompt.last().unwrap());
            }
            batch.join(sessions).unwrap();
            t += 1;
            if rows.is_empty() {
                continue;
            }
            let logits = batch.step(&next).unwrap();
            for (i, row) in rows.iter_mut().enumerate() {
                let l = logits.index(i as i32);
                let flat = l.as_dtype(mlx_rs::Dtype::Float32).unwrap();
                let entry = &row.golden["logits"][row.step];
                tally.vectors += 1;
                if common::bytes(&flat) == expected(&data, entry) {
                    tally.exact += 1;
                }
                let id = greedy(&l.reshape(&[1, -1]).unwrap()).unwrap();
                tally.ids += 1;
                if ids_of(&row.golden["ids"])[row.step] == id {
                    tally.ids_matching += 1;
                }
                next[i] = id;
                row.step += 1;
            }
            let keep: Vec<usize> = (0..rows.len())
                .filter(|&i| rows[i].step < rows[i].golden["max_tokens"].as_u64().unwrap() as usize)
                .collect();
            if keep.len() < rows.len() {
                batch.keep(&keep).unwrap();
                let old = std::mem::take(&mut rows);
                let old_next = std::mem::take(&mut next);
                for (i, (row, id)) in old.into_iter().zip(old_next).enumerate() {
                    if keep.contains(&i) {
                        rows.push(row);
                        next.push(id);
                    }
                }
            }
        }
    }
    tally
}

#[test]
fn rows_admitted_together_match_batch_generator() {
    for model in MODELS {
        let tally = run(model, 2048);
        println!("admission path {model}: {tally:?}");
        assert!(tally.passed(), "{model}: {tally:?}");
    }
}

/// `--prefill-step-size 4`: the prompts go in over several chunks, as a budgeted tick
/// feeds them; the numbers do not change.
#[test]
fn small_prefill_chunks_give_the_same_numbers() {
    for model in ["tiny-llama-trained", "tiny-qwen3-moe"] {
        let tally = run(model, 4);
        println!("admission path {model}, chunks of 4: {tally:?}");
        assert!(tally.passed(), "{model}: {tally:?}");
    }
}

#[test]
fn planted_unmasked_padding_fails_the_admission_path() {
    let _on = engine::plant::on(engine::plant::Defect::BatchUnmaskedPadding).unwrap();
    let tally = run("tiny-llama-trained", 2048);
    println!("planted unmasked padding: {tally:?}");
    assert!(!tally.passed(), "{tally:?}");
}
