//! L1 on the mixture-of-experts families (qwen3_moe, mixtral, qwen2_moe, gpt_oss, Gemma 4's
//! MoE block) and MLX's floating-point quantization modes; part of the `l1_models` binary.

use super::*;

/// Planted defect: the router keeps the experts ranked 2..=k+1 (its top-k slice off by
/// one); the prefill logits of every case already differ.
#[test]
fn planted_moe_top_k_off_by_one_fails_l1() {
    let _on = engine::plant::on(engine::plant::Defect::MoeTopKOffByOne).unwrap();
    for name in [
        "tiny-qwen3-moe",
        "tiny-qwen3-moe-q4",
        "tiny-mixtral",
        "tiny-qwen2-moe",
    ] {
        assert_fails_at_prefill(&l1(name, None), &format!("top-k off by one on {name}"));
    }
}

/// Planted defect: the fp modes' quantized embedding dequantizes to float32 (not MLX's
/// bfloat16), so the model runs in float32: the prefill logits of every case differ on the
/// fixtures whose embedding is fp-quantized. The affine embedding of the mixed fixture does
/// not carry it.
#[test]
fn planted_quant_fp_rows_float32_fails_l1() {
    let _on = engine::plant::on(engine::plant::Defect::QuantFpRowsFloat32).unwrap();
    for name in [
        "tiny-llama-mxfp4",
        "tiny-llama-nvfp4",
        "tiny-llama-mxfp8",
        "tiny-qwen3-moe-mxfp4",
    ] {
        assert_fails_at_prefill(&l1(name, None), &format!("fp rows float32 on {name}"));
    }
}

/// Planted defect: a per-module entry without a `mode` takes the global mode (mxfp4), not
/// affine: the mixed fixture's affine embedding then reads as mxfp4 and is refused for its
/// biases, and the MoE fixture's affine 8-bit g64 routers as mxfp4 with (64, 8), which MLX
/// does not allow.
#[test]
fn planted_quant_entry_takes_global_mode_fails_l1() {
    let _on = engine::plant::on(engine::plant::Defect::QuantEntryTakesGlobalMode).unwrap();
    for (name, expect) in [
        ("tiny-llama-mixed-modes", "mxfp4 quantization has no biases"),
        (
            "tiny-qwen3-moe-mxfp4",
            "mxfp4 quantization requires group size 32 and 4 bits",
        ),
    ] {
        let err = L1
            .run(name, None)
            .err()
            .unwrap_or_else(|| panic!("{name} must fail with the plant"))
            .to_string();
        assert!(err.contains(expect), "{name}: {err}");
        println!("planted entry-takes-global-mode caught on {name}: {err}");
    }
}

/// Planted defects on gpt_oss: the attention sinks dropped (every case's prefill logits
/// already differ), and the sliding window ignored (a window past every sequence: a case
/// differs once its sequence outgrows the real window of 8).
#[test]
fn planted_gpt_oss_defects_fail_l1() {
    {
        let _on = engine::plant::on(engine::plant::Defect::GptOssSinksDropped).unwrap();
        assert_fails_at_prefill(&l1("tiny-gpt-oss", None), "sinks dropped");
    }
    let report = l1("tiny-gpt-oss", Some("sliding_window=4096"));
    assert!(!report.passed());
    let firsts: Vec<_> = report
        .cases
        .iter()
        .map(|c| c.first_inexact_logits())
        .collect();
    assert!(firsts.iter().all(Option::is_some), "{firsts:?}");
    println!("planted sliding window ignored caught: first inexact logits {firsts:?}");
}

/// Planted defects on Gemma 4's experts: the router's per-expert scale dropped, and one
/// expert fewer per token (`top_k_experts=2`), each break the prefill of every case.
#[test]
fn planted_gemma4_moe_defects_fail_l1() {
    {
        let _on = engine::plant::on(engine::plant::Defect::Gemma4PerExpertScaleDropped).unwrap();
        for name in ["tiny-gemma4-moe", "tiny-gemma4-moe-q4"] {
            let what = format!("per-expert scale dropped on {name}");
            assert_fails_at_prefill(&l1(name, None), &what);
        }
    }
    let top_k = l1("tiny-gemma4-moe", Some("top_k_experts=2"));
    assert!(!top_k.passed());
    assert_eq!(top_k.cases[0].first_inexact_logits(), Some(0));
    println!("planted top_k_experts=2 caught: {}", top_k.summary());
}

/// `enable_moe_block` without the expert counts is refused, naming them (mlx-lm has no
/// defaults for them).
#[test]
fn gemma4_moe_without_expert_counts_is_refused() {
    let dir = harness::goldens::model_dir("tiny-gemma4-moe").unwrap();
    let mut config = engine::load::config::ModelConfig::read(&dir).unwrap();
    config.raw.as_object_mut().unwrap().remove("top_k_experts");
    let err = engine::model::build(&config, engine::load::weights::Weights::load(&dir).unwrap())
        .err()
        .expect("a MoE config without top_k_experts must be an error");
    assert!(err.to_string().contains("`top_k_experts`"), "{err}");
    println!("{err}");
}

/// What gpt_oss refuses, and how: a Hugging Face checkpoint (fused, interleaved
/// `gate_up_proj` experts) names mlx_lm.convert; a `swiglu_limit` other than the 7.0 mlx-lm
/// hard-codes; quantized KV, which mlx-lm's quantized SDPA cannot read with sinks (the
/// same error as mlx-lm's, where attention meets quantized K/V).
#[test]
fn gpt_oss_refusals_name_the_fix() {
    use engine::cache::{Kv, KvQuant, Mask, QTensor, QuantSdpa};
    use engine::load::config::ModelConfig;
    use engine::load::weights::Weights;
    let dir = harness::goldens::model_dir("tiny-gpt-oss").unwrap();
    let config = ModelConfig::read(&dir).unwrap();
    let mut hf = Weights::load(&dir).unwrap();
    hf.rename(|n| Some(n.replace("experts.gate_proj.weight", "experts.gate_up_proj")));
    let err = engine::model::build(&config, hf).err().unwrap().to_string();
    println!("{err}");
    assert!(
        err.contains("Hugging Face's layout") && err.contains("mlx_lm.convert"),
        "{err}"
    );
    let mut limited = config.clone();
    limited.raw["swiglu_limit"] = serde_json::json!(6.0);
    let err = engine::model::build(&limited, Weights::load(&dir).unwrap())
        .err()
        .unwrap()
        .to_string();
    println!("{err}");
    assert!(err.contains("swiglu_limit 6"), "{err}");
    // Quantized K/V (here packed zeros; the tiny head_dim of 16 is below MLX's smallest
    // KV group of 32, so no session can quantize this fixture's caches).
    let zeros = |shape: &[i32]| mlx_rs::ops::zeros::<f32>(shape).unwrap();
    let t = || QTensor {
        packed: zeros(&[1, 2, 4, 4]),
        scales: zeros(&[1, 2, 4, 1]),
        biases: zeros(&[1, 2, 4, 1]),
    };
    let kv = Kv::Quantized {
        keys: t(),
        values: t(),
        quant: KvQuant {
            bits: 8,
            group_size: 32,
            sdpa: QuantSdpa::MlxLm,
        },
    };
    let sinks = zeros(&[4]);
    let err = engine::model::sdpa::attend_with_sinks(
        &zeros(&[1, 4, 1, 32]),
        &kv,
        1.0,
        &Mask::None,
        Some(&sinks),
    )
    .expect_err("quantized KV with sinks must fail")
    .what()
    .to_owned();
    println!("{err}");
    assert!(
        err.contains("Quantized SDPA does not support attention sinks."),
        "{err}"
    );
}
