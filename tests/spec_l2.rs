//! The L2 speculative gate (`gates::SPEC_L2`, harness::parity::spec_l2): our Gemma 4
//! assistant-drafter path against mlx-optiq 0.7.7's `assistant_generate_step` goldens
//! (oracles/gen_spec_l2.py): ids, accept/reject trace, verify passes, draft calls and every
//! log-prob row and drafter logit vector bit-exact.

use engine::plant::Defect;
use harness::parity::gates::{Plant, SPEC_L2};
use harness::parity::spec::SpecReport;
use harness::parity::Report;

const TARGET: &str = "tiny-gemma4";

#[test]
fn assistant_drafting_matches_optiq() {
    let r: SpecReport = SPEC_L2.run(TARGET, None).unwrap().downcast().unwrap();
    harness::announce(&r.summary());
    assert!(r.passed(), "{}", r.summary());
    assert!(
        r.accepted > 0 && r.accepted < r.drafted,
        "acceptance is meaningful"
    );
}

#[test]
fn planted_assistant_defects_fail_the_gate() {
    for defect in [
        Defect::AssistantRingTrimLikeMlxLm,
        Defect::AssistantFirstSlidingDonor,
    ] {
        let r = SPEC_L2.run(TARGET, Some(&Plant::Engine(defect))).unwrap();
        println!("planted {defect:?} caught: {}", r.summary());
        assert!(!r.passed(), "{defect:?} went unnoticed");
    }
}
