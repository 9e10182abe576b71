//! The speculative-decoding gate (`gates::SPEC`, harness::parity::spec): our executor
//! against mlx-lm's `speculative_generate_step` goldens (oracles/gen_spec.py, target
//! tiny-llama-trained, drafter tiny-llama-draft): ids, accept/reject trace and every
//! log-probability vector identical, for γ = 1..4, chunked prefill and seeded sampling.
//! Planted defects: a drafter that is not rolled back (same ids, different trace) and a
//! target rolled back one token short fail.

use engine::plant::Defect;
use harness::parity::gates::{Plant, Target, SPEC};
use harness::parity::spec::SpecReport;
use harness::parity::Report;

const TARGET: &str = "tiny-llama-trained";

#[test]
fn speculative_decoding_matches_mlx_lm_trace_and_logprobs() {
    let r: SpecReport = SPEC.run(TARGET, None).unwrap().downcast().unwrap();
    harness::announce(&r.summary());
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
        let target = Target {
            case: Some(case),
            ..Target::new(TARGET)
        };
        let r = SPEC
            .run_target(&target, Some(&Plant::Engine(defect)))
            .unwrap();
        println!("planted {defect:?} caught: {}", r.summary());
        assert!(!r.passed(), "{defect:?} went unnoticed");
    }
}
