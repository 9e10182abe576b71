//! The B=N gate (the batch lane's batched decoding vs mlx-lm; see harness::parity::batch):
//! B=2 and B=4 with different prompt lengths, and rows joining and leaving a running batch
//! ({A, B} → add C → remove A) — every row's logits bit-exact with its mlx-lm golden, greedy
//! ids identical. Planted defect: a mask that forgets the left padding must fail.

use harness::parity::batch::{run, Event};

const MODEL: &str = "tiny-llama-trained";

fn gate(schedule: &[(usize, Event)], steps: usize) -> harness::parity::batch::BatchReport {
    let report = run(MODEL, schedule, steps).unwrap();
    harness::announce(&format!("B=N {MODEL}: {}", report.summary()));
    report
}

#[test]
fn b2_rows_of_different_lengths() {
    let r = gate(&[(0, Event::Join(vec!["raw1", "chat1"]))], 20);
    assert!(r.passed(), "{}", r.summary());
    assert_eq!(r.vectors, 2 * 17);
}

#[test]
fn b4_rows_of_different_lengths() {
    let r = gate(
        &[(0, Event::Join(vec!["raw0", "raw1", "raw2", "chat0"]))],
        20,
    );
    assert!(r.passed(), "{}", r.summary());
    assert_eq!(r.vectors, 4 * 17);
}

#[test]
fn rows_join_and_leave_a_running_batch() {
    let r = gate(
        &[
            (0, Event::Join(vec!["raw0", "raw2"])),
            (4, Event::Join(vec!["chat1"])),
            (8, Event::Leave(vec!["raw0"])),
        ],
        24,
    );
    assert!(r.passed(), "{}", r.summary());
    // raw0 checked for its prefill + 8 steps, raw2 and chat1 for all 17 vectors.
    assert_eq!(r.vectors, 9 + 17 + 17);
}

#[test]
fn planted_unmasked_padding_fails_the_gate() {
    engine::cache::batch::plant_unmasked_padding(true);
    let r = run(MODEL, &[(0, Event::Join(vec!["raw0", "chat1"]))], 8);
    engine::cache::batch::plant_unmasked_padding(false);
    let r = r.unwrap();
    println!("planted B=N defect caught: {}", r.summary());
    assert!(!r.passed());
}
