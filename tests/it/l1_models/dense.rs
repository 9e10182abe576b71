//! L1 plants on the dense families of batch one (gemma2, olmo2, olmo3, …); part of the `l1_models`
//! binary. Each model's clean L1 run is `every_l1_model_is_bit_exact`'s (its manifest row).

use super::*;

/// Planted through the config: gemma2's attention logit cap (4 → 5) and its final logit
/// cap (6 → 7) — each breaks every case of tiny-gemma2 at its prefill.
#[test]
fn planted_softcap_defects_fail_l1_on_gemma2() {
    for plant in ["attn_logit_softcapping=5.0", "final_logit_softcapping=7.0"] {
        let report = l1("tiny-gemma2", Some(plant));
        assert_fails_at_prefill(&report, &format!("tiny-gemma2 with {plant}"));
    }
}

/// Planted: OLMo's q/k norms, meant over the whole projection, taken per head
/// (`QkNormPerHead`) — every case of tiny-olmo2 and tiny-olmo3 fails at its prefill; each
/// passes again once the guard is gone.
#[test]
fn planted_per_head_qk_norm_fails_l1_on_olmo() {
    for name in ["tiny-olmo2", "tiny-olmo3"] {
        {
            let _on = engine::plant::on(engine::plant::Defect::QkNormPerHead).unwrap();
            assert_fails_at_prefill(&l1(name, None), &format!("per-head q/k norm on {name}"));
        }
        let clean = l1(name, None);
        assert!(clean.passed(), "{name}: {}", clean.details().join("\n"));
    }
}

/// Planted through the config: OLMo 3's window narrowed (8 → 2) — every case of tiny-olmo3
/// fails at its prefill.
#[test]
fn planted_window_fails_l1_on_olmo3() {
    let report = l1("tiny-olmo3", Some("sliding_window=2"));
    assert_fails_at_prefill(&report, "tiny-olmo3 with sliding_window=2");
}
