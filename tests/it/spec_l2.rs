//! The L2 speculative gate (`gates::SPEC_L2`, harness::parity::spec_l2): our Gemma 4
//! assistant-drafter path against mlx-optiq 0.7.7's `assistant_generate_step` goldens
//! (oracles/gen_spec_l2.py): ids, accept/reject trace, verify passes, draft calls and every
//! log-prob row and drafter logit vector bit-exact. The head rows (`gates::SPEC_L2_HEADS`):
//! the same cases with the centroid-head drafter and the pair whose config flags contradict
//! their tensors (the head is the one the tensors carry).

use engine::plant::Defect;
use harness::parity::gates::{Plant, SPEC_L2, SPEC_L2_HEADS};
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

const CENTROID: &str = "tiny-gemma4-assistant-centroid";
/// The flags lie: `lm-head` says tied, `no-lm-head` says untied.
const LYING: [&str; 2] = [
    "tiny-gemma4-assistant-lm-head",
    "tiny-gemma4-assistant-no-lm-head",
];

#[test]
fn every_drafter_head_matches_optiq() {
    for drafter in SPEC_L2_HEADS.models() {
        let r: SpecReport = SPEC_L2_HEADS
            .run(drafter, None)
            .unwrap()
            .downcast()
            .unwrap();
        harness::announce(&r.summary());
        assert!(r.passed(), "{}", r.summary());
        assert!(r.accepted > 0, "{drafter}: some drafts are accepted");
    }
}

/// A planted head defect fails `drafter`'s row: its run differs, or its load is refused.
fn caught(defect: Defect, drafter: &str) -> String {
    match SPEC_L2_HEADS.run(drafter, Some(&Plant::Engine(defect))) {
        Ok(r) => {
            assert!(!r.passed(), "{defect:?} went unnoticed on {drafter}");
            r.summary()
        }
        Err(e) => format!("refused: {e}"),
    }
}

#[test]
fn planted_head_defects_fail_the_head_rows() {
    for drafter in LYING {
        let how = caught(Defect::AssistantHeadFromFlags, drafter);
        println!("planted head-from-flags caught on {drafter}: {how}");
    }
    let how = caught(Defect::AssistantCentroidTopKShort, CENTROID);
    println!("planted centroid-top-k-short caught: {how}");
}

/// Speculation never changes the output: every drafter's ids (which the rows above prove
/// ours equal) are the target's plain greedy ids (mlx-lm's, goldens/l1/tiny-gemma4), on the
/// length both have.
#[test]
fn assisted_ids_are_the_targets_greedy_ids() {
    use harness::goldens::TensorGolden;
    let l1 = TensorGolden::open(&format!("l1/{TARGET}")).unwrap();
    let greedy = |prompt: &str| -> Vec<u64> {
        let cases = l1.index["cases"].as_array().unwrap();
        let case = cases.iter().find(|c| c["name"] == prompt).unwrap();
        serde_json::from_value(case["greedy_ids"].clone()).unwrap()
    };
    let goldens = std::iter::once(SPEC_L2.golden(TARGET)).chain(
        SPEC_L2_HEADS
            .models()
            .iter()
            .map(|m| SPEC_L2_HEADS.golden(m)),
    );
    for golden in goldens {
        let g = TensorGolden::open(&golden).unwrap();
        for case in g.index["cases"].as_array().unwrap() {
            let ids: Vec<u64> = serde_json::from_value(case["ids"].clone()).unwrap();
            let want = greedy(case["prompt"].as_str().unwrap());
            let n = ids.len().min(want.len());
            assert!(n >= 3, "{golden} {}: too short to compare", case["name"]);
            assert_eq!(ids[..n], want[..n], "{golden} {}", case["name"]);
        }
    }
}
