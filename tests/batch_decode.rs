//! The B=N gate (`gates::BATCH`, harness::parity::batch): the batch lane's batched decoding
//! against mlx-lm's `BatchGenerator` goldens (oracles/gen_batch.py) — B=2 and B=4 with
//! different prompt lengths, and a row joining a running batch while another leaves — every
//! row's logits bit-exact, ids identical. Planted defect: a mask that forgets the left
//! padding fails.

use harness::parity::gates::{Plant, Target, BATCH};
use harness::parity::Report;

const MODEL: &str = "tiny-llama-trained";

fn run(scenario: &str, plant: Option<&Plant>) -> Box<dyn Report> {
    let target = Target {
        case: Some(scenario),
        ..Target::new(MODEL)
    };
    BATCH.run_target(&target, plant).unwrap()
}

fn gate(scenario: &str) {
    let r = run(scenario, None);
    harness::announce(&r.summary());
    assert!(r.passed(), "{}", r.summary());
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
    let r = run("b4", Some(&Plant::parse("unmasked-padding").unwrap()));
    println!("planted B=N defect caught: {}", r.summary());
    assert!(!r.passed());
}
