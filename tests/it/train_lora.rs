//! The LoRA training gate (`gates::TRAIN`, harness::parity::train): adapters, SFT loss,
//! gradients and AdamW against mlx-lm (oracles/gen_train.py) bit for bit, and mlx-lm's saved
//! adapters loaded by us, on tiny-llama-trained, tiny-smollm3, tiny-gemma3, tiny-gemma4, tiny-phi3, the
//! gemma3 / gemma4 wrappers and the MoE families (qwen3_moe, its 4-bit fixture, mixtral,
//! qwen2_moe, glm4_moe, ernie4_5_moe, minimax, phimoe), llama4_text and the hybrids (qwen3_5, qwen3_5_moe, qwen3_next, lfm2, lfm2_moe, mamba2,
//! nemotron_h with and without Nemotron 3's `E` blocks, granitemoehybrid, falcon_h1:
//! adapters on their recurrent mixers' projections too), batch one's dense families
//! (gemma2, olmo2, olmo3, seed_oss, exaone4, hunyuan_v1_dense, minicpm, cohere2) and
//! deepseek_v3 (multi-head latent attention), the other MLA families (glm4_moe_lite,
//! deepseek_v32 with its indexer, kimi_k25's wrapper, minicpm3), llama4's wrapper (chunked
//! attention, top-1 experts), ministral3, the mistral3 / qwen3_vl wrappers, gemma3n (its AltUp
//! coefficients left out, as mlx-lm cannot adapt them) and gpt_oss (its mxfp4 fixture too).
//! Planted: a weight decay off by 10 % fails from the second step on, on each; the stacked
//! experts' LoRA update scaled twice fails every model with experts; the recurrent mixers'
//! input projections left without adapters fail every model with a recurrent state; MLA's
//! latent projection left without an adapter fails every MLA family; the causal mask on
//! llama4's chunked layers fails llama4; Gemma 3n's cache-less forward sharing K/V as its
//! cached one does fails tiny-gemma3n at step 0.
//!
//! The gate's models are its rows in goldens/models/manifest.json (`TRAIN.models()`); the
//! plants' model sets are read from the same rows, by what each model is (its caches, its
//! expert stacks), not kept here.

use engine::cache::Cache;
use engine::model::LanguageModel;
use harness::parity::gates::{Plant, Tweak, TRAIN};

const MODEL: &str = "tiny-llama-trained";

fn assert_passes(model: &str) {
    assert!(
        TRAIN.models().contains(&model),
        "{model}: not a model of the train gate (its manifest row lacks \"train\")"
    );
    let r = TRAIN.run(model, None).unwrap();
    harness::announce(&r.summary());
    assert!(r.passed(), "{}", r.summary());
}

/// The gate's models (its manifest rows) of which `is` holds, each loaded to ask.
fn trained_models_that(is: impl Fn(&dyn LanguageModel) -> bool) -> Vec<&'static str> {
    let models: Vec<&'static str> = TRAIN
        .models()
        .iter()
        .copied()
        .filter(|m| {
            let dir = harness::goldens::model_dir(m).unwrap();
            is(engine::model::load(&dir).unwrap().as_ref())
        })
        .collect();
    assert!(!models.is_empty(), "no model of the train gate qualifies");
    models
}

/// A recurrent state among its caches (an `ArraysCache`, alone or in a layer's list).
fn keeps_a_recurrent_state(m: &dyn LanguageModel) -> bool {
    fn recurrent(c: &mut dyn Cache) -> bool {
        c.as_arrays().is_some()
            || c.sub_caches_mut()
                .is_some_and(|parts| parts.iter_mut().any(|p| recurrent(p.as_mut())))
    }
    m.make_caches().iter_mut().any(|c| recurrent(c.as_mut()))
}

/// Stacked experts among its layers (`SwitchLinear`).
fn has_experts(m: &dyn LanguageModel) -> bool {
    !m.switch_linears().is_empty()
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

/// SmolLM 3: Llama's layers, the NoPE one (3 of 4) among the 3 adapted.
#[test]
fn lora_sft_steps_match_mlx_lm_on_smollm3() {
    assert_passes("tiny-smollm3");
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
#[test]
fn lora_sft_steps_match_mlx_lm_on_qwen3_moe() {
    assert_passes("tiny-qwen3-moe");
}

/// glm4_moe (mlx-lm's default keys over all 4 layers: the dense layer's MLP, then the
/// sparse layers' shared experts and `LoRASwitchLinear` on the stacked experts; the router is
/// mlx-lm's `MoEGate`, no Linear, so it gets none).
#[test]
fn lora_sft_steps_match_mlx_lm_on_glm4_moe() {
    assert_passes("tiny-glm4-moe");
}

/// ernie4_5_moe (its router `gate` an nn.Linear: adapted), minimax (`block_sparse_moe`),
/// phimoe (LayerNorms, biased projections, sparsemixer routing) and llama4_text (NoPE layer,
/// `feed_forward`), each with mlx-lm's default keys.
#[test]
fn lora_sft_steps_match_mlx_lm_on_the_moe2_families() {
    for model in [
        "tiny-ernie4-5-moe",
        "tiny-minimax",
        "tiny-phimoe",
        "tiny-llama4-text",
    ] {
        assert_passes(model);
    }
}

#[test]
fn lora_sft_steps_match_mlx_lm_on_mixtral() {
    assert_passes("tiny-mixtral");
}

#[test]
fn lora_sft_steps_match_mlx_lm_on_qwen2_moe() {
    assert_passes("tiny-qwen2-moe");
}

/// Affine 4-bit experts (`QuantizedSwitchLinear` under `LoRASwitchLinear`: gather_qmm, its
/// gradient with respect to the input) and quantized attention.
#[test]
fn lora_sft_steps_match_mlx_lm_on_quantized_qwen3_moe() {
    assert_passes("tiny-qwen3-moe-q4");
}

// The hybrids, with mlx-lm's default keys (every Linear and SwitchLinear of the last 3
// blocks; all 5 of the nemotron_h ones): LoRA on the recurrent mixers' projections — the
// gated delta net's `linear_attn.in_proj_{qkv,z,b,a}` / `out_proj` (Qwen3-Next's fused
// `in_proj_qkvz` / `in_proj_ba`), Mamba-2's `mixer.in_proj` / `out_proj` (Granite's and
// Falcon-H1's `mamba.`), the short convolution's `conv.in_proj` / `out_proj`; never their
// conv1d (not a Linear). Gradients flow through the recurrences (the delta rule, the SSM
// scan, the causal convolution) over the 33-token batch, from a zero state.

/// Gated delta nets and gated attention; adapters under `language_model.` as mlx-lm's
/// qwen3_5 `Model` holds its text model.
#[test]
fn lora_sft_steps_match_mlx_lm_on_qwen3_5() {
    assert_passes("tiny-qwen3-5");
}

/// With the sparse block: the router gate, the stacked experts, the shared expert and its
/// gate.
#[test]
fn lora_sft_steps_match_mlx_lm_on_qwen3_5_moe() {
    assert_passes("tiny-qwen3-5-moe");
}

#[test]
fn lora_sft_steps_match_mlx_lm_on_qwen3_next() {
    assert_passes("tiny-qwen3-next");
}

#[test]
fn lora_sft_steps_match_mlx_lm_on_lfm2() {
    assert_passes("tiny-lfm2");
}

#[test]
fn lora_sft_steps_match_mlx_lm_on_lfm2_moe() {
    assert_passes("tiny-lfm2-moe");
}

/// Mamba-2 alone (`backbone.layers.{i}.mixer.…`).
#[test]
fn lora_sft_steps_match_mlx_lm_on_mamba2() {
    assert_passes("tiny-mamba2");
}

/// Mamba-2, attention and MLP blocks, each its `mixer`.
#[test]
fn lora_sft_steps_match_mlx_lm_on_nemotron_h() {
    assert_passes("tiny-nemotron-h");
}

/// Mamba-2 / attention, the experts with their router's `layer` and the shared MLP.
#[test]
fn lora_sft_steps_match_mlx_lm_on_granitemoehybrid() {
    assert_passes("tiny-granite-h");
}

/// Nemotron 3's `E` blocks (pattern ME*E-, every block adapted): `LoRASwitchLinear` on the
/// expert stacks `switch_mlp.fc1` / `fc2` (ReLU², 8 experts top 2, two groups of which one
/// is kept: the routing's gradient flows through the σ scores of the chosen experts), LoRA on
/// the latent projections (`moe_latent_size` 32) and the shared expert; the router's `gate`
/// (mlx-lm's `MoEGate`, no Linear) gets none. float32: MLX's CPU gather_mm takes no bf16.
#[test]
fn lora_sft_steps_match_mlx_lm_on_nemotron_h_moe_blocks() {
    assert_passes("tiny-nemotron-h-moe-grouped");
}

/// QLoRA on the `E` blocks: affine 4-bit expert stacks (`QuantizedSwitchLinear` under
/// `LoRASwitchLinear`: gather_qmm), no latent projection, and the quantized Mamba-2,
/// attention and MLP blocks.
#[test]
fn lora_sft_steps_match_mlx_lm_on_quantized_nemotron_h_moe() {
    assert_passes("tiny-nemotron-h-moe-q4");
}

/// Falcon-H1: every layer's Mamba-2 (`mamba.in_proj` / `out_proj`) and attention
/// (`self_attn.*`) side by side on one normed input, then the SwiGLU `feed_forward`; the µP
/// multipliers folded into the frozen weights at load (bf16), the tied head's logit
/// multiplier after the adapters' outputs.
#[test]
fn lora_sft_steps_match_mlx_lm_on_falcon_h1() {
    assert_passes("tiny-falcon-h1");
}

/// Gemma 2 with mlx-lm's default keys: the gradients run back through its softcapped
/// attention (eager tanh cap, `where` mask, precise softmax) and the eager final softcap.
#[test]
fn lora_sft_steps_match_mlx_lm_on_gemma2() {
    assert_passes("tiny-gemma2");
}

/// OLMo 2 with mlx-lm's default keys: post-norm layers, q/k norms over the whole
/// projection, q/k/v/o biases.
#[test]
fn lora_sft_steps_match_mlx_lm_on_olmo2() {
    assert_passes("tiny-olmo2");
}

/// The rest of batch one with mlx-lm's default keys: olmo3 (sliding layers, window 8 under
/// the 33-token batch), seed_oss (q/k/v biases, no o bias), exaone4 (post-norms, NoPE
/// global layers), hunyuan_v1_dense (q/k norms after RoPE), minicpm (scaled branches, the
/// divided head), cohere2 (parallel block, LayerNorms, float16).
#[test]
fn lora_sft_steps_match_mlx_lm_on_the_rest_of_dense_batch_one() {
    for model in [
        "tiny-olmo3",
        "tiny-seed-oss",
        "tiny-exaone4",
        "tiny-hunyuan",
        "tiny-minicpm",
        "tiny-cohere2",
    ] {
        assert_passes(model);
    }
}

/// ministral3 with mlx-lm's default keys (every linear of a block): the gradients run back
/// through Llama 4's position-dependent query scale and the sliding layers (window under
/// the 33-token batch).
#[test]
fn lora_sft_steps_match_mlx_lm_on_ministral3() {
    assert_passes("tiny-ministral3");
}

/// The text paths of the mistral3 (ministral3 inside) and qwen3_vl (qwen3 inside) wrappers,
/// mlx-lm's default keys: adapters at `language_model.model.layers.…`, as mlx-lm's wrapper
/// `Model` holds its language model.
#[test]
fn lora_sft_steps_match_mlx_lm_on_the_mistral3_and_qwen3_vl_wrappers() {
    for model in ["tiny-mistral3", "tiny-qwen3-vl"] {
        assert_passes(model);
    }
}

/// Gemma 3n's text path over all 4 layers, every linear of a block but AltUp's
/// coefficients (mlx-lm's default keys fail on those): adapters at
/// `model.language_model.layers.…`; the gradients run back through AltUp's predict /
/// correct, Laurel, the per-layer inputs and the sparse gelu_topk, and the 2 KV-shared layers
/// project their own K/V (mlx-lm shares only through a cache).
#[test]
fn lora_sft_steps_match_mlx_lm_on_gemma3n() {
    assert_passes("tiny-gemma3n");
}

/// Planted: Gemma 3n's cache-less forward shares K/V as the cached one does. The loss
/// differs from step 0 on.
#[test]
fn planted_gemma3n_shared_kv_without_cache_fails_gemma3n() {
    let defect = engine::plant::Defect::Gemma3nSharedKvWithoutCache;
    assert_fails_at_step_0_loss("tiny-gemma3n", defect, "shared K/V without cache");
}

/// The gate on `model` with `defect` planted fails, first at step 0's loss.
fn assert_fails_at_step_0_loss(model: &str, defect: engine::plant::Defect, what: &str) {
    let _on = engine::plant::on(defect).unwrap();
    let r = TRAIN.run(model, None).unwrap();
    println!("{model}: planted {what} caught: {}", r.summary());
    assert!(!r.passed());
    assert!(
        r.summary().contains("first failure: step 0 loss"),
        "{}",
        r.summary()
    );
}

/// gpt-oss with mlx-lm's default keys: its sink attention's q/k/v/o (biased), the router
/// (`LoRALinear`) and the biased expert stacks (`LoRASwitchLinear` under the clamped
/// swiglu), sliding layers under the 33-token batch.
#[test]
fn lora_sft_steps_match_mlx_lm_on_gpt_oss() {
    assert_passes("tiny-gpt-oss");
}

/// QLoRA on gpt-oss's mxfp4 experts (`QuantizedSwitchLinear` in mode mxfp4 under
/// `LoRASwitchLinear`: gather_qmm and its gradient with respect to the input).
#[test]
fn lora_sft_steps_match_mlx_lm_on_mxfp4_gpt_oss() {
    assert_passes("tiny-gpt-oss-mxfp4");
}

/// DeepSeek-V3's multi-head latent attention with mlx-lm's default keys: LoRA on q_a_proj,
/// q_b_proj, kv_a_proj_with_mqa and o_proj (the absorbed `MultiLinear` embed_q /
/// unembed_out get none), the dense first layer's MLP, then the σ-routed grouped top-k
/// experts (`LoRASwitchLinear`) and the shared expert; the `MoEGate` router gets none.
#[test]
fn lora_sft_steps_match_mlx_lm_on_deepseek_v3() {
    assert_passes("tiny-deepseek-v3");
}

/// GLM-4.7-Flash (glm4_moe_lite, mlx-lm's deepseek_v3 classes under its own name): MLA with
/// mlx-lm's default keys over all 3 blocks, as on deepseek_v3.
#[test]
fn lora_sft_steps_match_mlx_lm_on_glm4_moe_lite() {
    assert_passes("tiny-glm4-moe-lite");
}

/// deepseek_v32: MLA plus its sparse-attention indexer, whose `wq_b`, `wk` and
/// `weights_proj` are nn.Linears that mlx-lm's default keys adapt too.
#[test]
fn lora_sft_steps_match_mlx_lm_on_deepseek_v32() {
    assert_passes("tiny-deepseek-v32");
}

/// Kimi K2.5's multimodal wrapper (text path): adapters under `language_model.` as mlx-lm's
/// `Model` holds its deepseek_v3 language model (no q_lora_rank: a plain `q_proj`).
#[test]
fn lora_sft_steps_match_mlx_lm_on_kimi_k25() {
    assert_passes("tiny-kimi-k25");
}

/// MiniCPM3: MLA's projections without absorption, so its `kv_b_proj` is an nn.Linear and
/// takes an adapter beside q_a / q_b / kv_a_proj_with_mqa / o_proj and the MLP.
#[test]
fn lora_sft_steps_match_mlx_lm_on_minicpm3() {
    assert_passes("tiny-minicpm3");
}

/// Llama 4 (the `llama4` wrapper's text path, adapters under `language_model.`): chunked
/// attention (chunk 8 under the 33-token batch), the NoPE layer, the top-1 MoE's router
/// (an nn.Linear: adapted), stacked experts and shared expert, over all 4 blocks.
#[test]
fn lora_sft_steps_match_mlx_lm_on_llama4() {
    assert_passes("tiny-llama4");
}

/// Planted: MLA's latent projection (`kv_a_proj_with_mqa`) gets no adapter. Its B starts at
/// zero, so step 0's loss matches; mlx-lm has a gradient for it that we lack.
#[test]
fn planted_mla_latent_proj_lora_dropped_fails_deepseek_v3() {
    let plant = Plant::Engine(engine::plant::Defect::MlaLatentProjLoraDropped);
    let r = TRAIN.run("tiny-deepseek-v3", Some(&plant)).unwrap();
    println!(
        "tiny-deepseek-v3: planted latent-proj LoRA dropped caught: {}",
        r.summary()
    );
    assert!(!r.passed());
}

/// Planted: the latent projection without adapter on the other MLA families — the
/// deepseek_v3 classes as glm4_moe_lite, deepseek_v32 (beside its indexer's adapters) and
/// kimi_k25's wrapper, and minicpm3's unabsorbed MLA: each fails (step 0's loss still
/// matches, B being zero; mlx-lm's gradient for it is missing here).
#[test]
fn planted_mla_latent_proj_lora_dropped_fails_the_other_mla_families() {
    let plant = Plant::Engine(engine::plant::Defect::MlaLatentProjLoraDropped);
    for model in [
        "tiny-glm4-moe-lite",
        "tiny-deepseek-v32",
        "tiny-kimi-k25",
        "tiny-minicpm3",
    ] {
        let r = TRAIN.run(model, Some(&plant)).unwrap();
        println!(
            "{model}: planted latent-proj LoRA dropped caught: {}",
            r.summary()
        );
        assert!(!r.passed(), "{model}");
    }
}

/// Planted: llama4's chunked layers read the plain causal mask in the cache-less training
/// forward (mlx-lm's `model(inputs)` masks chunks of 8 from position 0): step 0's loss
/// already differs.
#[test]
fn planted_chunked_mask_causal_without_cache_fails_llama4() {
    let defect = engine::plant::Defect::ChunkedMaskCausalWithoutCache;
    assert_fails_at_step_0_loss("tiny-llama4", defect, "causal mask on chunked layers");
}

/// Planted: the recurrent mixers' input projections get no adapter. Their B starts at
/// zero, so step 0 still matches; from step 1 mlx-lm's updated in_proj adapters change the
/// loss. Every model of the gate with a recurrent state fails.
#[test]
fn planted_recurrent_in_proj_lora_dropped_fails_the_hybrid_rows() {
    let plant = Plant::Engine(engine::plant::Defect::RecurrentInProjLoraDropped);
    for model in trained_models_that(keeps_a_recurrent_state) {
        let r = TRAIN.run(model, Some(&plant)).unwrap();
        println!(
            "{model}: planted in_proj LoRA dropped caught: {}",
            r.summary()
        );
        assert!(!r.passed(), "{model}");
    }
}

/// Planted: the experts' LoRA update scaled twice. B starts at zero, so step 0's loss
/// still matches; its gradients (of B, through scale²) already do not. Every model of the
/// gate with expert stacks fails (the hybrids' too: qwen3_5_moe, lfm2_moe, granitemoehybrid,
/// nemotron_h's `E` blocks).
#[test]
fn planted_switch_lora_scale_twice_fails_the_moe_rows() {
    let models = trained_models_that(has_experts);
    let _on = engine::plant::on(engine::plant::Defect::SwitchLoraScaleTwice).unwrap();
    for model in models {
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
