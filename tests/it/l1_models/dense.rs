//! L1 plants on the dense families of batch one (gemma2, olmo2, olmo3, seed_oss, exaone4,
//! hunyuan_v1_dense, minicpm, cohere2); part of the `l1_models` binary. Each model's clean
//! L1 run is `every_l1_model_is_bit_exact`'s (its manifest row).

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

/// Planted through the config, each breaking every case at its prefill: seed_oss's RoPE
/// base (1e6 → 1e4); exaone4's pattern (LLG → LGG: layer 1 global and without positions)
/// and window (8 → 2); hunyuan_v1_dense's NTK alpha (1000 → 10); minicpm's logit divisor
/// (`dim_model_base` 16 → 32), depth scale (1.4 → 1) and embedding scale (12 → 1).
#[test]
fn planted_config_defects_fail_l1_on_seed_oss_exaone4_hunyuan_minicpm() {
    for (name, plant) in [
        ("tiny-seed-oss", "rope_theta=10000.0"),
        ("tiny-exaone4", "sliding_window_pattern=LGG"),
        ("tiny-exaone4", "sliding_window=2"),
        ("tiny-hunyuan", "rope_scaling.alpha=10.0"),
        ("tiny-minicpm", "dim_model_base=32"),
        ("tiny-minicpm", "scale_depth=1.0"),
        ("tiny-minicpm", "scale_emb=1.0"),
    ] {
        let report = l1(name, Some(plant));
        assert_fails_at_prefill(&report, &format!("{name} with {plant}"));
    }
}

/// Planted through the config: cohere2's logit scale (0.25 → 0.5) and its layer pattern
/// (every 2nd layer global → every 4th: layer 1 slides and rotates) — each breaks every
/// case of tiny-cohere2 at its prefill.
#[test]
fn planted_config_defects_fail_l1_on_cohere2() {
    for plant in ["logit_scale=0.5", "sliding_window_pattern=4"] {
        let report = l1("tiny-cohere2", Some(plant));
        assert_fails_at_prefill(&report, &format!("tiny-cohere2 with {plant}"));
    }
}
