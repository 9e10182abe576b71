//! L1 sampling: the engine's sampler chain (temperature, top-p, top-k, min-p, repetition /
//! presence / frequency penalties, logit bias, seeded key sequence) against mlx-lm's on the
//! same seed and settings; sampled ids must be identical. Planted defects must fail.

use harness::parity::sampling::{check_named, MODELS};

#[test]
fn sampled_ids_equal_mlx_lm() {
    for name in MODELS {
        let report = check_named(name, |_| {}).unwrap();
        harness::announce(&report.summary());
        assert!(report.passed(), "{}", report.details().join("\n"));
    }
}

#[test]
fn planted_wrong_seed_fails() {
    let report = check_named("tiny-llama-trained", |p| {
        if p.temp > 0.0 {
            p.seed += 1
        }
    })
    .unwrap();
    assert!(!report.passed());
    println!("{}", report.details().join("\n"));
}

#[test]
fn planted_top_p_and_penalty_defects_fail() {
    let report = check_named("tiny-llama-trained", |p| {
        if p.top_p > 0.0 {
            p.top_p = 0.5;
        }
        if let Some(r) = p.repetition_penalty.as_mut() {
            *r += 0.2;
        }
    })
    .unwrap();
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
