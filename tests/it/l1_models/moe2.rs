//! L1 plants on the families of oracles/make_moe2.py (glm4_moe, ernie4_5_moe, minimax,
//! llama4_text, phimoe, llama4): each fixture's clean run is gated by
//! `every_l1_model_is_bit_exact` (its manifest row); these tests show the gate fails (at
//! every case's prefill, or for llama4's chunking by the first chunk boundary) when the
//! family's distinctive math is planted wrong. Part of the `l1_models` binary.

use super::*;

/// glm4_moe's group-limited routing off by one group (`topk_group` 3 of 4 kept where the
/// model keeps 2, or the grouping dropped), the routed weights left unscaled, and the
/// whole head rotated where half is: each breaks every case at its prefill.
#[test]
fn planted_routing_and_rotary_defects_fail_l1_on_glm4_moe() {
    for plant in [
        "topk_group=3",
        "n_group=1",
        "routed_scaling_factor=1.0",
        "partial_rotary_factor=1.0",
    ] {
        let report = l1("tiny-glm4-moe", Some(plant));
        assert_fails_at_prefill(&report, &format!("tiny-glm4-moe with {plant}"));
    }
}

/// ernie4_5_moe's router: sigmoid in place of its softmax (the same experts, other
/// weights after the renormalization), or a third expert per token: each breaks every case
/// at its prefill.
#[test]
fn planted_router_defects_fail_l1_on_ernie4_5_moe() {
    for plant in ["moe_gate_act=sigmoid", "moe_k=3"] {
        let report = l1("tiny-ernie4-5-moe", Some(plant));
        assert_fails_at_prefill(&report, &format!("tiny-ernie4-5-moe with {plant}"));
    }
}

/// minimax: the routing weights read from the scores with `e_score_correction_bias` added
/// (the bias meant for the choice only; the engine plant Nemotron 3 shares), and the whole
/// head rotated where `rotary_dim` is half of it — each breaks every case at its prefill.
/// The clean run passes after its guard (before it: the L1 gate).
#[test]
fn planted_bias_and_rotary_defects_fail_l1_on_minimax() {
    let name = "tiny-minimax";
    {
        let _on = engine::plant::on(engine::plant::Defect::MoeCorrectionBiasWeighted).unwrap();
        assert_fails_at_prefill(&l1(name, None), "minimax: bias in the weights");
    }
    assert!(
        l1(name, None).passed(),
        "{name}: the plant outlived its guard"
    );
    assert_fails_at_prefill(
        &l1(name, Some("rotary_dim=16")),
        "minimax with rotary_dim=16",
    );
}

/// llama4_text: every layer rotated where layer 3 is NoPE, or the weightless q/k norms
/// dropped — each breaks every case at its prefill.
#[test]
fn planted_nope_and_qk_norm_defects_fail_l1_on_llama4_text() {
    for plant in ["no_rope_layers=[1,1,1,1]", "use_qk_norm=false"] {
        let report = l1("tiny-llama4-text", Some(plant));
        assert_fails_at_prefill(&report, &format!("tiny-llama4-text with {plant}"));
    }
}

/// phimoe: sparsemixer's band widened (`router_jitter_noise`), SuScaledRoPE's input scale
/// reset (`long_mscale` 1), one expert per token — each breaks every case at its prefill.
#[test]
fn planted_sparsemixer_and_rope_defects_fail_l1_on_phimoe() {
    for plant in [
        "router_jitter_noise=0.5",
        "rope_scaling.long_mscale=1.0",
        "num_experts_per_tok=1",
    ] {
        let report = l1("tiny-phimoe", Some(plant));
        assert_fails_at_prefill(&report, &format!("tiny-phimoe with {plant}"));
    }
}

/// llama4 (the wrapper, for text): the weightless q/k norms of the chunked layers dropped
/// breaks every case at its prefill; the chunks made twice or half as long, or the global
/// layers' temperature tuning made a no-op (floor_scale 8192), break every case by the
/// step its positions cross a chunk boundary (the shortest prompt is under 8 tokens, so
/// its prefill may still be right).
#[test]
fn planted_chunk_and_temperature_defects_fail_l1_on_llama4() {
    let report = l1("tiny-llama4", Some("text_config.use_qk_norm=false"));
    assert_fails_at_prefill(&report, "tiny-llama4 with use_qk_norm=false");
    for plant in [
        "text_config.attention_chunk_size=16",
        "text_config.attention_chunk_size=4",
        "text_config.floor_scale=8192",
    ] {
        let report = l1("tiny-llama4", Some(plant));
        assert!(!report.passed(), "tiny-llama4 with {plant} passed");
        assert!(
            report
                .cases
                .iter()
                .all(|c| c.first_inexact_logits().is_some_and(|s| s <= 8)),
            "tiny-llama4 with {plant}: {}",
            report.details().join(" | ")
        );
    }
}

/// llama4's chunked layers keep a `ChunkedKvCache`, which the batch lane does not merge: the
/// lane refuses the model (naming chunked attention), so the server serves it serially.
#[test]
fn the_batch_lane_refuses_llama4_s_chunked_caches() {
    let dir = harness::goldens::model_dir("tiny-llama4").unwrap();
    let model = engine::model::load(&dir).unwrap();
    let opts = engine::generate::SessionOptions::default();
    let why = engine::generate::batch::refusal(model.as_ref(), &opts);
    assert!(
        why.is_some_and(|w| w.contains("chunked attention")),
        "{why:?}"
    );
}

/// llama4 prefilled in steps of 1, 5 and 16 tokens (mlx-lm's prefill_step_size): the chunked
/// caches cut their front between steps and take multi-token writes across chunk boundaries,
/// and the logits still equal the whole-prompt golden's (each case over its compared steps,
/// as `chunked_prefill_is_bit_exact`).
#[test]
fn chunked_prefill_is_bit_exact_on_llama4() {
    use harness::parity::l1::Stop;
    let steps = [1, 5, 16];
    super::assert_chunked_runs_pass("tiny-llama4", "", &steps, Stop::AtLastComparedLogits);
}
