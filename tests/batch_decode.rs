//! The B=N gate (`gates::BATCH`, harness::parity::batch): the batch lane's batched decoding
//! against mlx-lm's `BatchGenerator` goldens (oracles/gen_batch.py) — B=2 and B=4 with
//! different prompt lengths, and a row joining a running batch while another leaves — every
//! row's logits bit-exact, ids identical, on a dense model and a mixture-of-experts one
//! (whose rows route to different experts in the same forward). Planted defects: a mask
//! that forgets the left padding fails; a router that keeps the wrong experts fails.

use harness::parity::gates::{Plant, Target, BATCH};
use harness::parity::Report;

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
fn planted_unmasked_padding_fails_the_gate() {
    for model in BATCH.models {
        let r = run(
            model,
            "b4",
            Some(&Plant::parse("unmasked-padding").unwrap()),
        );
        println!("planted B=N defect caught on {model}: {}", r.summary());
        assert!(!r.passed());
    }
}

#[test]
fn planted_moe_top_k_off_by_one_fails_the_batched_gate() {
    let plant = Plant::parse("moe-top-k-off-by-one").unwrap();
    let r = run("tiny-qwen3-moe", "b4", Some(&plant));
    println!("planted MoE router defect caught: {}", r.summary());
    assert!(!r.passed());
}
