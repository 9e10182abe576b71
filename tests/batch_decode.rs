//! The B=N gate (`gates::BATCH`, harness::parity::batch): the batch lane's batched decoding
//! against mlx-lm's `BatchGenerator` goldens (oracles/gen_batch.py) — B=2 and B=4 with
//! different prompt lengths, and a row joining a running batch while another leaves — every
//! row's logits bit-exact, ids identical, on a dense model, on the three mixture-of-experts
//! families (whose rows route to different experts in the same forward) and on phi3
//! (fused projections, longrope: per-row positions through RoPE with its own frequencies).
//! Planted defects: a mask that forgets the left padding fails every model; a router that
//! keeps the wrong experts fails every MoE family. Models whose caches are not all
//! standard full-attention ones (rotating windows, dynamic RoPE) are refused by the batch
//! lane by name.

use engine::generate::batch::Batch;
use engine::generate::{Session, SessionOptions};
use harness::parity::gates::{Plant, Target, BATCH};
use harness::parity::Report;

/// The mixture-of-experts models of the gate (each router kind: qwen3_moe's softmax then
/// top-k, mixtral's top-k then softmax, qwen2_moe's unnormalized top-k and shared expert).
const MOE: [&str; 3] = ["tiny-qwen3-moe", "tiny-mixtral", "tiny-qwen2-moe"];

fn run(model: &str, scenario: &str, plant: Option<&Plant>) -> Box<dyn Report> {
    let target = Target {
        case: Some(scenario),
        ..Target::new(model)
    };
    BATCH.run_target(&target, plant).unwrap()
}

fn gate(scenario: &str) {
    for model in BATCH.models {
        let r = run(model, scenario, None);
        harness::announce(&r.summary());
        assert!(r.passed(), "{model}: {}", r.summary());
    }
}

#[test]
fn b2_rows_of_different_lengths() {
    gate("b2");
}

#[test]
fn b4_rows_of_different_lengths() {
    gate("b4");
}

#[test]
fn a_row_joins_a_running_batch_while_another_leaves() {
    gate("joinleave");
}

#[test]
fn the_gate_covers_every_family_of_the_batch_lane() {
    for model in MOE.iter().chain(&["tiny-llama-trained", "tiny-phi3"]) {
        assert!(BATCH.models.contains(model), "{model} is not gated");
    }
}

#[test]
fn planted_unmasked_padding_fails_the_gate() {
    for model in BATCH.models {
        let r = run(
            model,
            "b4",
            Some(&Plant::parse("unmasked-padding").unwrap()),
        );
        println!("planted B=N defect caught on {model}: {}", r.summary());
        assert!(!r.passed(), "{model}");
    }
}

#[test]
fn planted_moe_top_k_off_by_one_fails_the_batched_gate() {
    let plant = Plant::parse("moe-top-k-off-by-one").unwrap();
    for model in MOE {
        let r = run(model, "b4", Some(&plant));
        println!(
            "planted MoE router defect caught on {model}: {}",
            r.summary()
        );
        assert!(!r.passed(), "{model}");
    }
}

/// The batch lane's refusal, as `Batch::join` gives it (`engine serve --batch N` sends
/// such models to the serial lane instead: /stats shows `lanes.batch_slots` 0).
fn join_refusal(model: &str) -> String {
    let m = engine::model::load(&harness::goldens::model_dir(model).unwrap()).unwrap();
    let mut session = Session::with_options(m.as_ref(), &SessionOptions::default());
    session.prefill(&[1, 2, 3, 4]).unwrap();
    let mut batch = Batch::new(m.as_ref());
    match batch.join(vec![session]) {
        Ok(()) => panic!("{model}: the batch lane took caches it cannot batch"),
        Err(e) => e.what().to_owned(),
    }
}

#[test]
fn models_with_rotating_or_dynamic_rope_caches_are_refused_by_name() {
    for model in [
        "tiny-gemma3",
        "tiny-gemma3-mm",
        "tiny-gemma4",
        "tiny-gemma4-mm",
        "tiny-llama-dynamic",
        "tiny-gpt-oss",
        "tiny-gemma4-moe",
    ] {
        let why = join_refusal(model);
        println!("{model}: {why}");
        assert!(
            why.contains("the batch lane takes standard (dense, full-attention) caches only"),
            "{model}: {why}"
        );
    }
}
