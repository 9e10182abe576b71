//! L1 plants on the dense families of Mistral 3 / Ministral 3 and Qwen3-VL's text model:
//! tiny-ministral3 (Llama 4's position-dependent query scale, yarn RoPE, sliding and full
//! layers), tiny-mistral3 (the mistral3 wrapper over a ministral3, Hugging Face's layout) and
//! tiny-qwen3-vl (the qwen3_vl wrapper over qwen3) and tiny-gemma3n (Gemma 3n's text model:
//! AltUp, Laurel, per-layer inputs, activation sparsity, KV sharing); part of the
//! `l1_models` binary.

use super::*;

/// Planted through the config: Llama 4's query scale switched off (β 0) — every case of
/// tiny-ministral3 fails at its prefill (its original max of 3 positions puts a scaled
/// position in even the shortest prompt).
#[test]
fn planted_query_scale_off_fails_l1_on_ministral3() {
    let plant = "rope_parameters.llama_4_scaling_beta=0.0";
    let report = l1("tiny-ministral3", Some(plant));
    assert_fails_at_prefill(&report, &format!("tiny-ministral3 with {plant}"));
}

/// Planted through the wrapper's `text_config`: the head tied (the wrapper's default is
/// untied, and mlx-lm's ministral3 then drops the stored `lm_head`), or the text model read
/// as llama (no query scale) — every case of tiny-mistral3 fails at its prefill.
#[test]
fn planted_text_config_defects_fail_l1_on_mistral3() {
    for plant in [
        "text_config.tie_word_embeddings=true",
        "text_config.model_type=mistral",
    ] {
        let report = l1("tiny-mistral3", Some(plant));
        assert_fails_at_prefill(&report, &format!("tiny-mistral3 with {plant}"));
    }
}

/// Planted through `text_config`: another RoPE theta (Qwen3-VL's text positions are plain
/// RoPE from it in mlx-lm, its mrope settings unused) — every case fails at its prefill.
#[test]
fn planted_rope_theta_fails_l1_on_qwen3_vl() {
    let plant = "text_config.rope_theta=1000000.0";
    let report = l1("tiny-qwen3-vl", Some(plant));
    assert_fails_at_prefill(&report, &format!("tiny-qwen3-vl with {plant}"));
}

/// Planted through Gemma 3n's `text_config`, one distinctive piece at a time: AltUp's
/// coefficient clip lifted, its output scale dropped, KV sharing off (the last layers
/// attend over their own K/V), activation sparsity off — each fails every case of
/// tiny-gemma3n at its prefill.
#[test]
fn planted_gemma3n_defects_fail_l1() {
    for plant in [
        "text_config.altup_coef_clip=100.0",
        "text_config.altup_correct_scale=false",
        "text_config.num_kv_shared_layers=0",
        "text_config.activation_sparsity_pattern=[0.0,0.0,0.0,0.0]",
    ] {
        let report = l1("tiny-gemma3n", Some(plant));
        assert_fails_at_prefill(&report, &format!("tiny-gemma3n with {plant}"));
    }
}
