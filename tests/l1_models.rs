//! L1: the engine vs mlx-lm 0.32.2 on the tiny models (goldens/l1/<model>): Llama, Qwen3,
//! their quantized variants, Gemma 3 and Gemma 4 (sliding window 8, so rotating caches wrap):
//! tokenizer ids and chat-template strings equal transformers', every logit vector
//! bit-identical, greedy ids identical. Planted defects prove the gate can fail.
//! Run single-threaded (MLX is not thread-safe): `bash scripts/test.sh`.

use harness::parity::gates::{Plant, KV_BITS, L1};
use harness::parity::l1::ModelReport;
use harness::parity::Report;

/// The L1 gate of `name`, with `plant` (`KEY=VALUE` in its config.json) if given.
fn l1(name: &str, plant: Option<&str>) -> ModelReport {
    let plant = plant.map(|p| Plant::parse(p).unwrap());
    L1.run(name, plant.as_ref()).unwrap().downcast().unwrap()
}

fn assert_bit_exact(name: &str) {
    let report = l1(name, None);
    harness::announce(&report.summary());
    for line in report.details() {
        println!("{line}");
    }
    assert!(
        report.passed(),
        "L1 {name} failed:\n{}",
        report.details().join("\n")
    );
}

#[test]
fn l1_tiny_llama() {
    assert_bit_exact("tiny-llama");
}

#[test]
fn l1_tiny_qwen3() {
    assert_bit_exact("tiny-qwen3");
}

#[test]
fn l1_tiny_llama_trained() {
    assert_bit_exact("tiny-llama-trained");
}

/// Planted defect: rms_norm eps 1e-5 → 1e-6 must break the gate and name where.
#[test]
fn planted_rms_norm_eps_fails_l1() {
    let report = l1("tiny-llama-trained", Some("rms_norm_eps=1e-6"));
    assert!(!report.passed());
    let first = &report.cases[0];
    assert_eq!(
        first.first_inexact_logits(),
        Some(0),
        "the prefill logits already differ"
    );
    println!(
        "planted eps defect caught: {}",
        report.details().join(" | ")
    );
}

/// Planted defect: a different RoPE base must break the gate, and the report must name the
/// first divergent greedy step somewhere.
#[test]
fn planted_rope_base_fails_l1() {
    let report = l1("tiny-qwen3", Some("rope_theta=10000.0"));
    assert!(!report.passed());
    assert!(report
        .cases
        .iter()
        .all(|c| c.first_inexact_logits() == Some(0)));
    println!(
        "planted rope defect caught: {}",
        report.details().join(" | ")
    );
}

#[test]
fn l1_tiny_llama_trained_q4_mixed() {
    assert_bit_exact("tiny-llama-trained-q4");
}

#[test]
fn l1_tiny_qwen3_q8() {
    assert_bit_exact("tiny-qwen3-q8");
}

/// Planted defect on the quantized path: the gate must fail there too.
#[test]
fn planted_defect_fails_l1_on_a_quantized_model() {
    let report = l1("tiny-llama-trained-q4", Some("rms_norm_eps=1e-6"));
    assert!(!report.passed());
    assert_eq!(report.cases[0].first_inexact_logits(), Some(0));
}

/// Chunked prefill (mlx-lm's prefill_step_size) stays bit-exact for any chunk size, down to
/// one token per step. (On this CPU backend mlx-lm's own logits do not depend on the chunk
/// size either, so these runs are checked against the standard goldens.)
#[test]
fn chunked_prefill_is_bit_exact() {
    use engine::load::template::ChatTemplate;
    use engine::load::tokenizer::Tokenizer;
    use harness::goldens::{model_dir, TensorGolden};
    use harness::parity::l1::check_model_with;
    // tiny-gemma3 chunked: multi-token updates of a rotating cache that already holds keys
    // (temporal reorder + trim) and windowed prefill masks.
    // tiny-gemma4: the same, with layers that borrow another layer's K/V mid-chunk.
    for name in [
        "tiny-llama-trained",
        "tiny-llama-trained-q4",
        "tiny-gemma3",
        "tiny-gemma4",
    ] {
        let dir = model_dir(name).unwrap();
        let model = engine::model::load(&dir).unwrap();
        let tokenizer = Tokenizer::load(&dir).unwrap();
        let template = ChatTemplate::from_tokenizer(&tokenizer).unwrap();
        let golden = TensorGolden::open(&format!("l1/{name}")).unwrap();
        for step in [1, 5, 16] {
            let report =
                check_model_with(&golden, model.as_ref(), &tokenizer, template.as_ref(), step)
                    .unwrap();
            harness::announce(&format!("prefill chunks of {step}: {}", report.summary()));
            assert!(report.passed(), "{}", report.details().join("\n"));
        }
    }
}

#[test]
fn l1_tiny_gemma3_with_wrapping_rings() {
    assert_bit_exact("tiny-gemma3");
}

/// Planted defect: a wider sliding window changes what the sliding layers see once the
/// ring wraps; the gate must fail.
#[test]
fn planted_sliding_window_fails_l1() {
    let report = l1("tiny-gemma3", Some("sliding_window=16"));
    assert!(!report.passed());
    println!(
        "planted window defect caught: {}",
        report.details().join(" | ")
    );
}

#[test]
fn l1_tiny_gemma3_q4() {
    assert_bit_exact("tiny-gemma3-q4");
}

#[test]
fn l1_tiny_qwen2_f16_with_qkv_biases() {
    assert_bit_exact("tiny-qwen2");
}

/// Planted defect: a qwen2 checkpoint read as llama (no q/k/v biases) must not load
/// silently; it is refused because the bias tensors are left over.
#[test]
fn qwen2_biases_are_not_ignored() {
    let dir = harness::goldens::model_dir("tiny-qwen2").unwrap();
    let mut config = engine::load::config::ModelConfig::read(&dir).unwrap();
    config.model_type = "llama".into();
    let err = engine::model::build(&config, engine::load::weights::Weights::load(&dir).unwrap())
        .err()
        .expect("extra bias tensors must be an error");
    assert!(err.to_string().contains("does not use"), "{err}");
}

/// Gemma 4 as the small checkpoints build it: per-layer input embeddings, KV sharing,
/// double-wide MLPs, proportional partial RoPE on a wider full-attention head, softcap.
#[test]
fn l1_tiny_gemma4_shared_kv_per_layer_inputs() {
    assert_bit_exact("tiny-gemma4");
}

/// Gemma 4 as the large checkpoints build it: K = V on full-attention layers.
#[test]
fn l1_tiny_gemma4_k_eq_v() {
    assert_bit_exact("tiny-gemma4-keqv");
}

#[test]
fn l1_tiny_gemma4_q4() {
    assert_bit_exact("tiny-gemma4-q4");
}

/// Planted defects on Gemma 4: the softcap, the proportional RoPE's rotated share and the
/// sliding window each break the gate.
#[test]
fn planted_gemma4_defects_fail_l1() {
    let softcap = l1("tiny-gemma4", Some("final_logit_softcapping=30.0"));
    assert!(!softcap.passed());
    assert_eq!(softcap.cases[0].first_inexact_logits(), Some(0));
    let rope = l1(
        "tiny-gemma4",
        Some("rope_parameters.full_attention.partial_rotary_factor=0.5"),
    );
    assert!(!rope.passed());
    let window = l1("tiny-gemma4-keqv", Some("sliding_window=16"));
    assert!(!window.passed());
    for report in [softcap, rope, window] {
        println!("planted gemma4 defect caught: {}", report.summary());
    }
}

/// mlx-lm's own KV quantization (`generate_step(kv_bits=4, kv_group_size=32,
/// quantized_kv_start=0)`, prefill chunks of 16): QuantizedKVCache and mlx-lm's quantized
/// SDPA — the L1 gate of `engine generate --kv-quant 4`. Planted defect: reading the same
/// caches through optiq's fused kernel must break it.
#[test]
fn l1_mlx_lm_kv_bits_4() {
    let report = KV_BITS.run("tiny-llama-trained", None).unwrap();
    harness::announce(&report.summary());
    assert!(report.passed(), "{}", report.summary());

    let fused = Plant::parse("sdpa=optiq-fused").unwrap();
    let planted = KV_BITS.run("tiny-llama-trained", Some(&fused)).unwrap();
    assert!(
        !planted.passed(),
        "the fused kernel must not pass mlx-lm's golden"
    );
}

/// The multimodal wrappers loaded for text as mlx-lm loads them (gemma3.Model /
/// gemma4.Model): the language model from `text_config` with the wrapper's defaults (8 q /
/// 4 kv heads, its vocab_size), its tensors under the language model's prefix, the vision
/// and audio towers dropped. Gemma 3 as google/gemma-3-*-it and mlx-community name it.
#[test]
fn l1_tiny_gemma3_mm_wrapper() {
    assert_bit_exact("tiny-gemma3-mm");
}

/// Gemma 4 in Hugging Face's layout (`model.language_model.…`, the KV-shared layers' K/V
/// projections stored and dropped).
#[test]
fn l1_tiny_gemma4_mm_wrapper_hf_layout() {
    assert_bit_exact("tiny-gemma4-mm");
}

/// Gemma 4 in mlx-community's layout (`language_model.model.…`, untied lm_head, K = V).
#[test]
fn l1_tiny_gemma4_mm_wrapper_mlx_layout() {
    assert_bit_exact("tiny-gemma4-mm-mlx");
}

/// The gemma3 wrapper quantized as mlx_lm.convert writes it: 4-bit g32, the per-module
/// `false` entry named `language_model.model.layers.0.mlp.down_proj` (the wrapper's module
/// path) keeps that projection dense.
#[test]
fn l1_tiny_gemma3_mm_q4_wrapper() {
    assert_bit_exact("tiny-gemma3-mm-q4");
}

/// Planted defects on the wrappers: a setting changed in `text_config` breaks the gate while
/// the same key at the top level (which mlx-lm does not read) leaves it bit-exact, and the
/// language model's prefix kept in the tensor names fails the load.
#[test]
fn planted_wrapper_defects_fail_l1() {
    let inner = l1("tiny-gemma3-mm", Some("text_config.sliding_window=16"));
    assert!(!inner.passed());
    println!("planted text_config defect caught: {}", inner.summary());
    let top = l1("tiny-gemma3-mm", Some("sliding_window=16"));
    assert!(top.passed(), "{}", top.details().join("\n"));
    for name in ["tiny-gemma3-mm", "tiny-gemma4-mm", "tiny-gemma4-mm-mlx"] {
        let _on = engine::plant::on(engine::plant::Defect::WrapperPrefixKept).unwrap();
        let err = L1.run(name, None).err().expect("the prefix kept must fail");
        assert!(err.to_string().contains("missing tensor"), "{err}");
        println!("planted prefix defect caught on {name}: {err}");
    }
}

/// A wrapper config without `text_config`, or weights without the language model's prefix,
/// is an error naming the problem and the file.
#[test]
fn wrapper_layout_errors_name_the_problem() {
    use engine::load::config::ModelConfig;
    use engine::load::weights::Weights;
    let dir = harness::goldens::model_dir("tiny-gemma3-mm").unwrap();
    let mut config = ModelConfig::read(&dir).unwrap();
    config.raw.as_object_mut().unwrap().remove("text_config");
    let err = engine::model::build(&config, Weights::load(&dir).unwrap())
        .err()
        .expect("no text_config must be an error");
    let text = err.to_string();
    assert!(
        text.contains("config.json") && text.contains("`text_config`"),
        "{text}"
    );
    // transformers' `model.language_model.…` names under a gemma3 config.
    let config = ModelConfig::read(&dir).unwrap();
    let hf = harness::goldens::model_dir("tiny-gemma4-mm").unwrap();
    let err = engine::model::build(&config, Weights::load(&hf).unwrap())
        .err()
        .expect("no language_model. prefix must be an error");
    let text = err.to_string();
    assert!(
        text.contains("model*.safetensors") && text.contains("model.language_model."),
        "{text}"
    );
    println!("{text}");
}

/// RoPE kinds (rope.rs, mlx-lm's initialize_rope): dynamic NTK (max_position_embeddings 32,
/// so the base grows once prompt + continuation pass 32 positions) and yarn (ramped
/// frequencies, mscale on the input).
#[test]
fn l1_tiny_llama_dynamic_and_yarn_rope() {
    assert_bit_exact("tiny-llama-dynamic");
    assert_bit_exact("tiny-llama-yarn");
}

/// phi3: fused qkv / gate_up, SuScaled (longrope) RoPE on 12 of 16 head dims.
#[test]
fn l1_tiny_phi3_longrope() {
    assert_bit_exact("tiny-phi3");
}

/// transformers 5 configs with RoPE settings only in rope_parameters (flat for llama, per
/// layer type for gemma3_text): read as transformers reads them; the golden is mlx-lm on the
/// same config flattened to the top level (mlx-lm 0.32.2 itself ignores rope_parameters).
#[test]
fn l1_rope_parameters_only_configs() {
    assert_bit_exact("tiny-llama-rope-params");
    assert_bit_exact("tiny-gemma3-rope-params");
}

/// Planted defects on the RoPE kinds, each a config value the engine reads differently from
/// the golden's: dynamic NTK's threshold (the base never grows: only positions past 32
/// differ), yarn's mscale (0: no input scale), longrope's original context (the input scale
/// becomes 1), and the rope_theta / scaling factor found only in rope_parameters.
#[test]
fn planted_rope_kind_defects_fail_l1() {
    let dynamic = l1("tiny-llama-dynamic", Some("max_position_embeddings=4096"));
    assert!(!dynamic.passed());
    // Prompts past 32 tokens differ from the prefill on, shorter ones only later.
    let firsts: Vec<_> = dynamic
        .cases
        .iter()
        .map(|c| c.first_inexact_logits())
        .collect();
    assert!(firsts.contains(&Some(0)), "{firsts:?}");
    assert!(firsts.iter().any(|f| *f != Some(0)), "{firsts:?}");
    println!("planted dynamic threshold caught: first inexact logits {firsts:?}");
    for (name, plant) in [
        ("tiny-llama-yarn", "rope_scaling.mscale=0.0"),
        ("tiny-phi3", "original_max_position_embeddings=256"),
        (
            "tiny-llama-rope-params",
            "rope_parameters.rope_theta=10000.0",
        ),
        (
            "tiny-gemma3-rope-params",
            "rope_parameters.full_attention.factor=1.0",
        ),
    ] {
        let report = l1(name, Some(plant));
        assert!(!report.passed(), "{name} with {plant} passed");
        println!("planted {plant} on {name} caught: {}", report.summary());
    }
}

/// No silent default theta: a qwen3 config with rope_theta neither at the top level nor in
/// rope_parameters is refused as mlx-lm refuses it; a llama config carrying it only in
/// rope_parameters loads with that theta (tiny-llama-rope-params above).
#[test]
fn qwen3_without_rope_theta_is_refused() {
    let dir = harness::goldens::model_dir("tiny-qwen3").unwrap();
    let mut config = engine::load::config::ModelConfig::read(&dir).unwrap();
    config.raw.as_object_mut().unwrap().remove("rope_theta");
    let err = engine::model::build(&config, engine::load::weights::Weights::load(&dir).unwrap())
        .err()
        .expect("a missing rope_theta must be an error");
    assert!(
        err.to_string()
            .contains("rope_theta is missing from the model config"),
        "{err}"
    );
}

/// qwen3_moe (8 experts, top-2, a dense layer among sparse ones): every prompt's prefill
/// of 32 or more tokens routes through the sorted-indices path (mlx-lm's `_gather_sort`),
/// the shorter ones and every decode step through the unsorted gather_mm.
#[test]
fn l1_tiny_qwen3_moe() {
    assert_bit_exact("tiny-qwen3-moe");
}

/// qwen3_moe quantized as mlx-lm quantizes it (bf16, affine 4-bit g32; the routers 8-bit
/// g64 by per-module overrides): the experts run through gather_qmm, sorted and unsorted.
#[test]
fn l1_tiny_qwen3_moe_q4() {
    assert_bit_exact("tiny-qwen3-moe-q4");
}

/// mixtral (8 experts, top-2): the top-k gate logits, then a softmax over those k.
#[test]
fn l1_tiny_mixtral() {
    assert_bit_exact("tiny-mixtral");
}

/// qwen2_moe (8 experts, top-4 by `argpartition(-p, k-1)[..., :k]`, a sigmoid-gated shared
/// expert, q/k/v biases).
#[test]
fn l1_tiny_qwen2_moe() {
    assert_bit_exact("tiny-qwen2-moe");
}

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
        let report = l1(name, None);
        assert!(!report.passed());
        assert!(report
            .cases
            .iter()
            .all(|c| c.first_inexact_logits() == Some(0)));
        println!(
            "planted top-k defect caught on {name}: {}",
            report.details().join(" | ")
        );
    }
}

/// tiny-llama-trained quantized by mlx-lm in each floating-point mode (uint8 scales, no
/// biases): mxfp4 (4-bit g32), nvfp4 (4-bit g16), mxfp8 (8-bit g32), the embedding, every
/// linear and the head; the fp embedding's rows come out in bfloat16, so the model runs in
/// bfloat16, as in mlx-lm.
#[test]
fn l1_tiny_llama_fp_modes() {
    for name in ["tiny-llama-mxfp4", "tiny-llama-nvfp4", "tiny-llama-mxfp8"] {
        assert_bit_exact(name);
    }
}

/// Per-module modes as mlx-lm writes them: mxfp4 by default, attention affine 8-bit g64,
/// lm_head mxfp8 from `null` group size and bits, the embedding affine (an entry with no
/// `mode`).
#[test]
fn l1_tiny_llama_mixed_modes() {
    assert_bit_exact("tiny-llama-mixed-modes");
}

/// qwen3_moe in mxfp4: the experts through gather_qmm in mxfp4, sorted and unsorted, the
/// routers affine 8-bit g64.
#[test]
fn l1_tiny_qwen3_moe_mxfp4() {
    assert_bit_exact("tiny-qwen3-moe-mxfp4");
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
        let report = l1(name, None);
        assert!(!report.passed());
        assert!(report
            .cases
            .iter()
            .all(|c| c.first_inexact_logits() == Some(0)));
        println!(
            "planted fp rows float32 caught on {name}: {}",
            report.summary()
        );
    }
}

/// Planted defect: a per-module entry without a `mode` takes the global mode (mxfp4), not
/// affine: the mixed fixture's affine embedding then reads as mxfp4 and is refused for its
/// biases, and the MoE fixture's affine 8-bit g64 routers as mxfp4 with (64, 8), which MLX
/// does not allow.
#[test]
fn planted_quant_entry_takes_global_mode_fails_l1() {
    use harness::parity::gates::L1;
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

/// gpt_oss: layers sliding / full from layer_types (window 8: the rotating caches wrap in
/// every prompt and in decode), per-head attention sinks in the fused SDPA, yarn RoPE,
/// the router's top-4 logits of 8 then a softmax, biased experts through the clamped SwiGLU
/// (the prompts of 16+ tokens take the sorted-indices path).
#[test]
fn l1_tiny_gpt_oss() {
    assert_bit_exact("tiny-gpt-oss");
}

/// gpt_oss quantized as mlx-community's MXFP4-Q8 checkpoints are (bf16): the experts mxfp4
/// through gather_qmm (sorted and unsorted), the other linears, the routers and the
/// embedding affine 8-bit g64 by per-module entries under a global mxfp4 block.
#[test]
fn l1_tiny_gpt_oss_mxfp4() {
    assert_bit_exact("tiny-gpt-oss-mxfp4");
}

/// Planted defects on gpt_oss: the attention sinks dropped (every case's prefill logits
/// already differ), and the sliding window ignored (a window past every sequence: a case
/// differs once its sequence outgrows the real window of 8).
#[test]
fn planted_gpt_oss_defects_fail_l1() {
    {
        let _on = engine::plant::on(engine::plant::Defect::GptOssSinksDropped).unwrap();
        let report = l1("tiny-gpt-oss", None);
        assert!(!report.passed());
        assert!(report
            .cases
            .iter()
            .all(|c| c.first_inexact_logits() == Some(0)));
        println!(
            "planted sinks dropped caught: {}",
            report.details().join(" | ")
        );
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

/// Gemma 4 with the mixture-of-experts block (the 26B-A4B's layers): beside each dense MLP a
/// router (norm, scale, top 3 of 8, softmax over those, per-expert scale) and SwitchGLU
/// experts with the GeGLU activation, each branch with its own norms; K = V on full layers,
/// sliding window 8. Hugging Face's fused `experts.gate_up_proj` split as mlx-lm's sanitize
/// splits it; the prompts of 22+ tokens take the sorted-indices path.
#[test]
fn l1_tiny_gemma4_moe() {
    assert_bit_exact("tiny-gemma4-moe");
}

/// The same model as the `gemma4` wrapper, bf16, affine 4-bit g32 experts through
/// gather_qmm and the routers' proj 8-bit g64 (gemma4's quant_predicate), as mlx_lm.convert
/// writes the 26B.
#[test]
fn l1_tiny_gemma4_moe_q4_wrapper() {
    assert_bit_exact("tiny-gemma4-moe-q4");
}

/// Planted defects on Gemma 4's experts: the router's per-expert scale dropped, and one
/// expert fewer per token (`top_k_experts=2`), each break the prefill of every case.
#[test]
fn planted_gemma4_moe_defects_fail_l1() {
    {
        let _on = engine::plant::on(engine::plant::Defect::Gemma4PerExpertScaleDropped).unwrap();
        for name in ["tiny-gemma4-moe", "tiny-gemma4-moe-q4"] {
            let report = l1(name, None);
            assert!(!report.passed());
            assert!(report
                .cases
                .iter()
                .all(|c| c.first_inexact_logits() == Some(0)));
            println!(
                "planted per-expert scale defect caught on {name}: {}",
                report.summary()
            );
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
