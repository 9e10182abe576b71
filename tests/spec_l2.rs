//! The L2 speculative gate (harness::parity::spec_l2): our Gemma 4 assistant-drafter path
//! against mlx-optiq 0.7.7's `assistant_generate_step` goldens (oracles/gen_spec_l2.py):
//! ids, accept/reject trace, verify passes, draft calls and every log-prob row and drafter
//! logit vector bit-exact.

use harness::parity::spec_l2::run;

const TARGET: &str = "tiny-gemma4";

#[test]
fn assistant_drafting_matches_optiq() {
    let r = run(TARGET, None).unwrap();
    harness::announce(&format!("spec L2 {TARGET}: {}", r.summary()));
    assert!(r.passed(), "{}", r.summary());
    assert!(
        r.accepted > 0 && r.accepted < r.drafted,
        "acceptance is meaningful"
    );
}

#[test]
fn planted_assistant_defects_fail_the_gate() {
    use engine::plant::{self, Defect};
    for defect in [
        Defect::AssistantRingTrimLikeMlxLm,
        Defect::AssistantFirstSlidingDonor,
    ] {
        let r = {
            let _on = plant::on(defect).unwrap();
            run(TARGET, None).unwrap()
        };
        println!("planted {defect:?} caught: {}", r.summary());
        assert!(!r.passed(), "{defect:?} went unnoticed");
    }
}
