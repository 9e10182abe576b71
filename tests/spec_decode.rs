//! The speculative-decoding gate (harness::parity::spec): our executor against mlx-lm's
//! `speculative_generate_step` goldens (oracles/gen_spec.py, target tiny-llama-trained,
//! drafter tiny-llama-draft): ids, accept/reject trace and every log-probability vector
//! identical, for γ = 1..4, chunked prefill and seeded sampling. Planted defects: a drafter
//! that is not rolled back (same ids, different trace) and a target rolled back one token
//! short fail.

use engine::plant::{self, Defect};
use harness::parity::spec::run;

const TARGET: &str = "tiny-llama-trained";

#[test]
fn speculative_decoding_matches_mlx_lm_trace_and_logprobs() {
    let r = run(TARGET, None).unwrap();
    harness::announce(&format!("spec {TARGET}: {}", r.summary()));
    assert!(r.passed(), "{}", r.summary());
    assert!(
        r.accepted > 0 && r.accepted < r.drafted,
        "acceptance is meaningful"
    );
}

#[test]
fn planted_spec_defects_fail_the_gate() {
    for (defect, case) in [
        (Defect::SpecKeepDraftTail, "raw1-g3"),
        (Defect::SpecTargetTrimShort, "raw1-g3"),
    ] {
        let r = {
            let _on = plant::on(defect).unwrap();
            run(TARGET, Some(case)).unwrap()
        };
        println!("planted {defect:?} caught: {}", r.summary());
        assert!(!r.passed(), "{defect:?} went unnoticed");
    }
}
