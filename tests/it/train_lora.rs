//! The LoRA training gate (`gates::TRAIN`, harness::parity::train): adapters, SFT loss,
//! gradients and AdamW against mlx-lm (oracles/gen_train.py) bit for bit, and mlx-lm's saved
//! adapters loaded by us, on tiny-llama-trained, tiny-gemma3, tiny-gemma4, tiny-phi3, the
//! gemma3 / gemma4 wrappers and the MoE families (qwen3_moe, its 4-bit fixture, mixtral,
//! qwen2_moe) and the hybrids (qwen3_5, qwen3_5_moe, qwen3_next, lfm2, lfm2_moe, mamba2,
//! nemotron_h, granitemoehybrid: adapters on their recurrent mixers' projections too).
//! Planted: a weight decay off by 10 % fails from the second step on, on each; the stacked
//! experts' LoRA update scaled twice fails the MoE rows; the recurrent mixers' input
//! projections left without adapters fail the hybrid rows.

use harness::parity::gates::{Plant, Tweak, TRAIN};

const MODEL: &str = "tiny-llama-trained";

fn assert_passes(model: &str) {
    let r = TRAIN.run(model, None).unwrap();
    harness::announce(&r.summary());
    assert!(r.passed(), "{}", r.summary());
}

#[test]
fn lora_sft_steps_match_mlx_lm() {
    assert_passes(MODEL);
}

/// Gemma 3: gelu-tanh MLP, (1 + w) norms, sliding layers whose window (8) is shorter than
/// the batch (33 tokens), so the cache-less forward uses mlx-lm's windowed array mask there.
#[test]
fn lora_sft_steps_match_mlx_lm_on_gemma3() {
    assert_passes("tiny-gemma3");
}

/// Gemma 4 (small): KV-shared layers (their K/V borrowed from earlier layers, so adapters on
/// an earlier layer's k/v projections get gradients through later layers), the per-layer
/// input branch's linears, tied head.
#[test]
fn lora_sft_steps_match_mlx_lm_on_gemma4() {
    assert_passes("tiny-gemma4");
}

/// Phi-3: fused qkv_proj and gate_up_proj, mlx-lm's default keys (every linear of a
/// block), longrope RoPE over a 33-token batch.
#[test]
fn lora_sft_steps_match_mlx_lm_on_phi3() {
    assert_passes("tiny-phi3");
}

/// The gemma3 wrapper: adapters at `language_model.model.layers.…`, as mlx-lm's module tree
/// names them (mlx-lm's saved adapters load into ours; ours save under the same names).
#[test]
fn lora_sft_steps_match_mlx_lm_on_the_gemma3_wrapper() {
    assert_passes("tiny-gemma3-mm");
}

#[test]
fn lora_sft_steps_match_mlx_lm_on_the_gemma4_wrapper() {
    assert_passes("tiny-gemma4-mm");
}

/// The MoE families with mlx-lm's default keys: LoRA on the router gate (`LoRALinear`) and
/// on the stacked experts (`LoRASwitchLinear`, one A/B pair per expert, gathered per routing
/// entry; the 65-token batch takes the sorted path); qwen3_moe's dense layer, qwen2_moe's
/// shared expert and its gate.
const MOE: [&str; 4] = [
    "tiny-qwen3-moe",
    "tiny-mixtral",
    "tiny-qwen2-moe",
    "tiny-qwen3-moe-q4",
];

#[test]
fn lora_sft_steps_match_mlx_lm_on_qwen3_moe() {
    assert_passes(MOE[0]);
}

#[test]
fn lora_sft_steps_match_mlx_lm_on_mixtral() {
    assert_passes(MOE[1]);
}

#[test]
fn lora_sft_steps_match_mlx_lm_on_qwen2_moe() {
    assert_passes(MOE[2]);
}

/// Affine 4-bit experts (`QuantizedSwitchLinear` under `LoRASwitchLinear`: gather_qmm, its
/// gradient with respect to the input) and quantized attention.
#[test]
fn lora_sft_steps_match_mlx_lm_on_quantized_qwen3_moe() {
    assert_passes(MOE[3]);
}

/// The hybrids, with mlx-lm's default keys (every Linear and SwitchLinear of the last 3
/// blocks; all 5 of tiny-nemotron-h's): LoRA on the recurrent mixers' projections — the
/// gated delta net's `linear_attn.in_proj_{qkv,z,b,a}` / `out_proj` (Qwen3-Next's fused
/// `in_proj_qkvz` / `in_proj_ba`), Mamba-2's `mixer.in_proj` / `out_proj` (Granite's
/// `mamba.`), the short convolution's `conv.in_proj` / `out_proj`; never their conv1d (not a
/// Linear). Gradients flow through the recurrences (the delta rule, the SSM scan, the
/// causal convolution) over the 33-token batch, from a zero state.
const HYBRIDS: [&str; 8] = [
    "tiny-qwen3-5",
    "tiny-qwen3-5-moe",
    "tiny-qwen3-next",
    "tiny-lfm2",
    "tiny-lfm2-moe",
    "tiny-mamba2",
    "tiny-nemotron-h",
    "tiny-granite-h",
];

/// Gated delta nets and gated attention; adapters under `language_model.` as mlx-lm's
/// qwen3_5 `Model` holds its text model.
#[test]
fn lora_sft_steps_match_mlx_lm_on_qwen3_5() {
    assert_passes(HYBRIDS[0]);
}

/// With the sparse block: the router gate, the stacked experts, the shared expert and its
/// gate.
#[test]
fn lora_sft_steps_match_mlx_lm_on_qwen3_5_moe() {
    assert_passes(HYBRIDS[1]);
}

#[test]
fn lora_sft_steps_match_mlx_lm_on_qwen3_next() {
    assert_passes(HYBRIDS[2]);
}

#[test]
fn lora_sft_steps_match_mlx_lm_on_lfm2() {
    assert_passes(HYBRIDS[3]);
}

#[test]
fn lora_sft_steps_match_mlx_lm_on_lfm2_moe() {
    assert_passes(HYBRIDS[4]);
}

/// Mamba-2 alone (`backbone.layers.{i}.mixer.…`).
#[test]
fn lora_sft_steps_match_mlx_lm_on_mamba2() {
    assert_passes(HYBRIDS[5]);
}

/// Mamba-2, attention and MLP blocks, each its `mixer`.
#[test]
fn lora_sft_steps_match_mlx_lm_on_nemotron_h() {
    assert_passes(HYBRIDS[6]);
}

/// Mamba-2 / attention, the experts with their router's `layer` and the shared MLP.
#[test]
fn lora_sft_steps_match_mlx_lm_on_granitemoehybrid() {
    assert_passes(HYBRIDS[7]);
}

/// Planted: the recurrent mixers' input projections get no adapter. Their B starts at
/// zero, so step 0 still matches; from step 1 mlx-lm's updated in_proj adapters change the
/// loss.
#[test]
fn planted_recurrent_in_proj_lora_dropped_fails_the_hybrid_rows() {
    let plant = Plant::Engine(engine::plant::Defect::RecurrentInProjLoraDropped);
    for model in HYBRIDS {
        let r = TRAIN.run(model, Some(&plant)).unwrap();
        println!(
            "{model}: planted in_proj LoRA dropped caught: {}",
            r.summary()
        );
        assert!(!r.passed(), "{model}");
    }
}

/// Planted: the experts' LoRA update scaled twice. B starts at zero, so step 0's loss
/// still matches; its gradients (of B, through scale²) already do not.
#[test]
fn planted_switch_lora_scale_twice_fails_the_moe_rows() {
    let _on = engine::plant::on(engine::plant::Defect::SwitchLoraScaleTwice).unwrap();
    for model in MOE {
        let r = TRAIN.run(model, None).unwrap();
        println!("{model}: planted switch-LoRA scale caught: {}", r.summary());
        assert!(!r.passed(), "{model}");
        assert!(
            r.summary().contains("first failure: step 0 grad"),
            "{}",
            r.summary()
        );
    }
}

#[test]
fn planted_weight_decay_fails_the_gate() {
    for model in TRAIN.models() {
        let r = TRAIN
            .run(model, Some(&Plant::Harness(Tweak::WeightDecay)))
            .unwrap();
        println!("{model}: planted weight decay caught: {}", r.summary());
        assert!(!r.passed(), "{model}");
    }
}
