//! L1 sampling (`gates::SAMPLING`): the engine's sampler chain (temperature, top-p, top-k,
//! min-p, repetition / presence / frequency penalties, logit bias, seeded key sequence)
//! against mlx-lm's on the same seed and settings; sampled ids must be identical. Planted
//! defects must fail.

use harness::parity::gates::{Plant, Tweak, SAMPLING};
use harness::parity::sampling::SamplingReport;
use harness::parity::Report;

fn planted(tweak: Tweak) -> SamplingReport {
    let plant = Plant::Harness(tweak);
    let report = SAMPLING.run("tiny-llama-trained", Some(&plant)).unwrap();
    report.downcast().unwrap()
}

#[test]
fn sampled_ids_equal_mlx_lm() {
    for name in SAMPLING.models() {
        let report = SAMPLING.run(name, None).unwrap();
        harness::announce(&report.summary());
        assert!(report.passed(), "{}", report.details().join("\n"));
    }
}

/// The seed + 1 wherever the temperature is above 0.
#[test]
fn planted_wrong_seed_fails() {
    let report = planted(Tweak::Seed);
    assert!(!report.passed());
    println!("{}", report.details().join("\n"));
}

/// top_p 0.5 where it is set, the repetition penalty + 0.2 where it is set.
#[test]
fn planted_top_p_and_penalty_defects_fail() {
    let report = planted(Tweak::TopPAndPenalty);
    let failed: Vec<&str> = report
        .cases
        .iter()
        .filter(|c| c.first_divergent_step.is_some())
        .map(|c| c.name.as_str())
        .collect();
    assert!(
        failed.iter().any(|n| n.starts_with("temp0.8-top_p0.9")),
        "{failed:?}"
    );
    assert!(
        failed.iter().any(|n| n.starts_with("greedy-repetition1.5")),
        "{failed:?}"
    );
}
