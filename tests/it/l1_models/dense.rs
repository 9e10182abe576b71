//! L1 plants on the dense families of batch one (gemma2, …); part of the `l1_models`
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
