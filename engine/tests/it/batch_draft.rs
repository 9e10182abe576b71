//! Draft-model rows in the batch lane (issue 43 item 4, its draft-model part): with
//! `--draft-model`, the lane's rows draft together in the drafter's own batch
//! (`generate::batch_draft`), every row's drafts are verified in one forward of the model,
//! and each row gives back its own rejected positions, in the model's batch and in the
//! drafter's. Served answers must be the serial lane's plain greedy answers.

use serde_json::{json, Value};

use crate::common::goldens;
use crate::common::lane::{four_then_one, plain_runs};

/// The requests: three rows drafting with their own γ (2, 3, 5) and a fourth beside them
/// that does not draft — `num_draft_tokens` 0, or a repetition penalty (which the
/// speculative policies do not run: it falls back to plain decoding with its processor) —
/// then a fifth drafting row (γ 4) that joins later. With the penalty, the second row
/// samples at temperature 1 from its top 1 (the sampled verify's path, `pick_verify`
/// drawing every position, whose draws are greedy's ids).
fn bodies(penalized: bool) -> Vec<Value> {
    let drafted = |p: &str, gamma: usize| json!({"prompt": p, "max_tokens": 40, "temperature": 0, "num_draft_tokens": gamma});
    let mut plain = json!({"prompt": "In the morning", "max_tokens": 40, "temperature": 0});
    match penalized {
        true => plain["repetition_penalty"] = 1.3.into(),
        false => plain["num_draft_tokens"] = 0.into(),
    }
    let mut sampled = drafted("Once upon a time", 3);
    if penalized {
        sampled["temperature"] = 1.0.into();
        sampled["top_k"] = 1.into();
    }
    vec![
        drafted("The little robot", 2),
        sampled,
        drafted("Question: Who brought the broken clock?", 5),
        plain,
        drafted("The cat sat", 4),
    ]
}

/// `bodies` on a `--batch 4` tiny-llama-trained server drafting with itself
/// (`common::lane::four_then_one`, planted `plants`).
fn run(bodies: &[Value], plants: &str) -> (Vec<String>, Value) {
    let model = goldens().join("models/tiny-llama-trained");
    let flags = ["--draft-model", model.to_str().unwrap()];
    four_then_one(&model, &flags, plants, bodies)
}

/// Drafts accepted over drafts made, from /stats.
fn acceptance(st: &Value) -> f64 {
    let s = &st["speculative"];
    s["accepted"].as_f64().unwrap() / s["drafted"].as_f64().unwrap().max(1.0)
}

/// Draft-model rows in the batch lane (issue 43 item 4): three rows drafting with γ 2, 3
/// and 5 and a row that does not draft start together on a `--batch 4` server; a fifth
/// drafting row (γ 4) joins when a slot frees. The drafter is the model itself, so plain
/// greedy decoding would accept every draft. Twice: the non-drafting row greedy
/// (`num_draft_tokens` 0: one argmax for every row of a round) and under a repetition
/// penalty (every row picks with its own sampler, one of the drafting rows sampling at
/// temperature 1 from its top 1).
///
/// Every answer is the serial lane's plain greedy answer and at least 95 % of the drafts
/// are accepted. Planted: `BatchRowTrimShort` (each row of the model's batch keeps one
/// rejected position) changes an answer; `BatchDraftTrimShort` (each drafter row keeps one
/// rejected position while counting it given back) leaves the answers alone — drafts never
/// choose an id — but its drafts read stale ids and the acceptance falls below 95 %.
#[test]
fn batch_lane_draft_rows_answer_as_plain_greedy_and_a_stale_drafter_is_caught() {
    let runs = plain_runs(bodies, &["num_draft_tokens"]);
    for (penalized, bodies, plain) in &runs {
        let (served, st) = run(bodies, "");
        println!(
            "batch-lane drafting (penalized row: {penalized}): {}",
            st["speculative"]
        );
        assert_eq!(&served, plain, "drafted rows vs the serial lane: {st}");
        assert!(
            acceptance(&st) >= 0.95,
            "the model drafting for itself: {st}"
        );
        assert_eq!(
            st["speculative"]["fallbacks"], 1,
            "the non-drafting row: {st}"
        );
        assert!(
            st["lanes"]["batch_peak_rows"].as_u64().unwrap() >= 4,
            "the rows never shared a round: {st}"
        );
        assert_eq!(st["lanes"]["serial_reason"], Value::Null, "{st}");
        assert_eq!(st["failed"], 0, "{st}");

        let (short, _) = run(bodies, "BatchRowTrimShort");
        assert_ne!(&short, plain, "a short row trim changed no answer");
        let (stale, st) = run(bodies, "BatchDraftTrimShort");
        println!(
            "stale drafter (penalized row: {penalized}): {}",
            st["speculative"]
        );
        assert_eq!(&stale, plain, "drafts chose an id: {st}");
        assert!(
            acceptance(&st) < 0.95,
            "a stale drafter row went unnoticed: {st}"
        );
    }
}
