//! L1: the engine vs mlx-lm 0.32.2 on the tiny models (goldens/l1/<model>): Llama, Qwen3,
//! their quantized variants, Gemma 3 and Gemma 4 (sliding window 8, so rotating caches wrap):
//! tokenizer ids and chat-template strings equal transformers', every logit vector
//! bit-identical, greedy ids identical. Planted defects prove the gate can fail.
//! Run single-threaded (MLX is not thread-safe): `bash scripts/test.sh`.

use harness::parity::gates::{Plant, KV_BITS, L1, L1_LONG};
use harness::parity::l1::{check_model_with, ModelReport, Stop};
use harness::parity::Report;

/// The L1 gate of `name`, with `plant` (`KEY=VALUE` in its config.json) if given.
fn l1(name: &str, plant: Option<&str>) -> ModelReport {
    let plant = plant.map(|p| Plant::parse(p).unwrap());
    L1.run(name, plant.as_ref()).unwrap().downcast().unwrap()
}

/// A planted defect's report: the gate fails, and every case already differs at its
/// prefill (step 0) — the defect sits in the forward, not in some later step.
fn assert_fails_at_prefill(report: &ModelReport, what: &str) {
    assert!(
        !report.passed(),
        "{what}: the gate passed with the defect planted"
    );
    assert!(
        report
            .cases
            .iter()
            .all(|c| c.first_inexact_logits() == Some(0)),
        "{what}: {}",
        report.details().join(" | ")
    );
    println!("planted {what} caught: {}", report.summary());
}

/// Every model of the L1 gate — the manifest's rows that name `l1` — is bit-exact against
/// mlx-lm (every logit vector max |Δ| 0, greedy ids, tokenizer ids, chat templates): a new
/// tiny model is gated by its manifest row and goldens alone. Every model runs; the failures
/// are reported together.
#[test]
fn every_l1_model_is_bit_exact() {
    let mut failed = Vec::new();
    for name in L1.models() {
        let report = l1(name, None);
        harness::announce(&report.summary());
        if !report.passed() {
            failed.push(format!("{name}:\n{}", report.details().join("\n")));
        }
    }
    assert!(failed.is_empty(), "L1 failed:\n{}", failed.join("\n"));
    assert!(
        L1.models().len() >= 34,
        "the L1 gate lost models: {:?}",
        L1.models()
    );
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
    assert_fails_at_prefill(&report, "rope_theta=10000.0");
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
/// size either, so these runs are checked against the standard goldens.) Each case runs its
/// compared steps: the prefill's logits and 16 decode steps', every one to the bit, read
/// all the chunks left in the caches; the greedy steps past them do not depend on how the
/// prompt was chunked, and `every_l1_model_is_bit_exact` runs them.
#[test]
fn chunked_prefill_is_bit_exact() {
    // tiny-gemma3 chunked: multi-token updates of a rotating cache that already holds keys
    // (temporal reorder + trim) and windowed prefill masks.
    // tiny-gemma4: the same, with layers that borrow another layer's K/V mid-chunk.
    // The hybrids: recurrent states (conv, delta-net, SSM) carried from chunk to chunk.
    for name in [
        "tiny-llama-trained",
        "tiny-llama-trained-q4",
        "tiny-gemma3",
        "tiny-gemma4",
        "tiny-lfm2",
        "tiny-qwen3-5",
        "tiny-qwen3-next",
        "tiny-mamba2",
        "tiny-nemotron-h",
        "tiny-falcon-h1",
    ] {
        assert_chunked_runs_pass(name, "", &[1, 5, 16], Stop::AtLastComparedLogits);
    }
}

/// `name`'s golden `l1/<name><suffix>` run with the prefill in chunks of each of `steps`,
/// each case until `stop`: the reports, in the order of `steps`.
fn chunked_runs(name: &str, suffix: &str, steps: &[usize], stop: Stop) -> Vec<ModelReport> {
    use engine::load::template::ChatTemplate;
    use engine::load::tokenizer::Tokenizer;
    use harness::goldens::{model_dir, TensorGolden};
    let dir = model_dir(name).unwrap();
    let model = engine::model::load(&dir).unwrap();
    let tokenizer = Tokenizer::load(&dir).unwrap();
    let template = ChatTemplate::from_tokenizer(&tokenizer).unwrap();
    let golden = TensorGolden::open(&format!("l1/{name}{suffix}")).unwrap();
    let (model, template) = (model.as_ref(), template.as_ref());
    (steps.iter())
        .map(|&step| check_model_with(&golden, model, &tokenizer, template, step, stop).unwrap())
        .collect()
}

/// `chunked_runs`, each announced and asserted to pass.
fn assert_chunked_runs_pass(name: &str, suffix: &str, steps: &[usize], stop: Stop) {
    for (step, report) in steps.iter().zip(chunked_runs(name, suffix, steps, stop)) {
        let summary = report.summary();
        harness::announce(&format!(
            "{name}{suffix}, prefill chunks of {step}: {summary}"
        ));
        assert!(report.passed(), "{}", report.details().join("\n"));
    }
}

/// Planted: chunks that overlap by one id (the prompt sliced one short). The chunked gate,
/// over its compared steps only, fails at the prefill; prefilled in one chunk (the golden's
/// 2048) the same prompts pass, so the defect is the chunking's alone.
#[test]
fn planted_overlapping_chunks_fail_the_chunked_gate() {
    let _on = engine::plant::on(engine::plant::Defect::PrefillChunksOverlap).unwrap();
    let stop = Stop::AtLastComparedLogits;
    let [whole, chunked] =
        <[ModelReport; 2]>::try_from(chunked_runs("tiny-llama-trained", "", &[2048, 2], stop))
            .unwrap();
    assert!(whole.passed(), "one chunk never overlaps");
    assert_fails_at_prefill(&chunked, "chunks of 2 overlapping by one id");
}

/// Long sequences (the `l1-long` gate: a 4,096-token prompt on each mixer kind — the gated
/// delta net split and fused, the short conv, Mamba-2 alone and beside attention): logits
/// and greedy ids equal mlx-lm's, prefilled in its chunks of 2048 (the golden's; every
/// greedy step) and in chunks of 1000 (the compared steps) — recurrent states agree at a
/// prefill chunk boundary that is not the golden's, and across the Mamba-2 scan's own
/// chunks of 256.
#[test]
fn a_4096_token_prompt_is_bit_exact_on_every_mixer_kind() {
    use harness::goldens::TensorGolden;
    let models = L1_LONG.models();
    for kind in [
        "tiny-qwen3-5",
        "tiny-qwen3-next",
        "tiny-lfm2",
        "tiny-mamba2",
        "tiny-nemotron-h",
    ] {
        assert!(models.contains(&kind), "{kind} is not in the l1-long gate");
    }
    for name in models {
        let golden = TensorGolden::open(&format!("l1/{name}-long")).unwrap();
        let prompt = golden.index["cases"][0]["prompt_ids"].as_array().unwrap();
        assert_eq!(prompt.len(), 4096);
        // The golden's own chunks run every greedy step; the other chunking, the compared ones.
        assert_chunked_runs_pass(name, "-long", &[2048], Stop::AtEnd);
        assert_chunked_runs_pass(name, "-long", &[1000], Stop::AtLastComparedLogits);
    }
}

/// Planted: the Mamba-2 scan drops its state at each of its 256-token chunks. The short L1
/// prompts never reach a second chunk and pass; the 4,096-token gate fails on Nemotron-H,
/// whose attention layer reads the positions after each chunk boundary. (tiny-mamba2 alone
/// cannot show it: its drawn decays, e^(−exp(A_log)·dt) per token, reach float32's zero
/// well within 256 tokens, so the last position's state and logits never depend on an
/// earlier chunk's — with or without the defect.)
#[test]
fn planted_dropped_scan_chunk_state_fails_only_the_long_gate() {
    let _on = engine::plant::on(engine::plant::Defect::SsmChunkStateDropped).unwrap();
    let name = "tiny-nemotron-h";
    assert!(
        l1(name, None).passed(),
        "{name}: short prompts never cross a scan chunk"
    );
    let report: ModelReport = L1_LONG.run(name, None).unwrap().downcast().unwrap();
    assert!(
        !report.passed(),
        "{name}: the long gate passed with the state dropped: {}",
        report.summary()
    );
    println!(
        "planted dropped scan-chunk state caught on {name}: {}",
        report.summary()
    );
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

/// lfm2 (short convolutions with an ArraysCache state beside full attention): planted, the
/// conv state kept one position early. The prompt's last token already reads the state its
/// body left (the prefill runs the prompt less its last token first, as mlx-lm's
/// generate_step does), so every case fails at its first logits.
#[test]
fn planted_shifted_conv_state_fails_l1_on_lfm2() {
    let _on = engine::plant::on(engine::plant::Defect::ShortConvStateShifted).unwrap();
    // tiny-lfm2-conv-bias: attention first and last, a conv bias, kernel 4, no FF adjust;
    // tiny-lfm2-moe-mlx: lfm2_moe's conv layers with a drawn conv bias, kernel 4.
    for model in ["tiny-lfm2", "tiny-lfm2-conv-bias", "tiny-lfm2-moe-mlx"] {
        assert_fails_at_prefill(&l1(model, None), &format!("{model}'s conv state shifted"));
    }
}

/// granitemoehybrid (Granite 4.0-H: Mamba-2 and NoPE attention, the sparse block beside the
/// shared MLP, Granite's multipliers, HF's fused experts): planted, the residual multiplier
/// and the logits scaling each left at 1 — each breaks every case's first logits.
#[test]
fn planted_multiplier_defects_fail_l1_on_granite_h() {
    for plant in ["residual_multiplier=1.0", "logits_scaling=1.0"] {
        let report = l1("tiny-granite-h", Some(plant));
        assert_fails_at_prefill(&report, &format!("granitemoehybrid with {plant}"));
    }
}

/// granitemoehybrid without experts (Granite 4.0-H-Micro's layout: `shared_mlp` read as
/// the feed-forward) and with RoPE: planted, the attention without positions (`nope`), and
/// the residual multiplier left at 1 — each breaks every case's first logits.
#[test]
fn planted_rope_and_residual_defects_fail_l1_on_dense_granite_h() {
    for plant in ["position_embedding_type=nope", "residual_multiplier=1.0"] {
        let report = l1("tiny-granite-h-dense", Some(plant));
        assert_fails_at_prefill(&report, &format!("dense granitemoehybrid with {plant}"));
    }
}

/// falcon_h1 (attention beside a Mamba-2 mixer in every layer, µP multipliers folded into
/// the weights by the sanitize): planted, the SSM branch's or attention's output multiplier
/// left at 1 (so not folded into out_proj / o_proj) — each breaks every case's first logits.
#[test]
fn planted_multiplier_defects_fail_l1_on_falcon_h1() {
    for plant in ["ssm_out_multiplier=1.0", "attention_out_multiplier=1.0"] {
        let report = l1("tiny-falcon-h1", Some(plant));
        assert_fails_at_prefill(&report, &format!("falcon_h1 with {plant}"));
    }
}

/// falcon_h1 with the mixer's gated RMSNorm (`mamba_rms_norm`), after the gate on an untied
/// head and before it on a tied one: planted, the other order — and the untied head's
/// multiplier left at 1 (not folded into lm_head) — each breaks every case's first logits.
#[test]
fn planted_gated_norm_order_and_untied_head_fail_l1_on_falcon_h1() {
    for (model, plant) in [
        ("tiny-falcon-h1-norm-after", "mamba_norm_before_gate=true"),
        ("tiny-falcon-h1-norm-before", "mamba_norm_before_gate=false"),
        ("tiny-falcon-h1-norm-after", "lm_head_multiplier=1.0"),
    ] {
        let report = l1(model, Some(plant));
        assert_fails_at_prefill(&report, &format!("{model} with {plant}"));
    }
}

/// lfm2_moe (LFM2's layers with its sigmoid-routed sparse block): planted on tiny-lfm2-moe
/// (HF's layout, expert_bias, renormalized, scaling 1.5), the routed scaling left at 1 and
/// the top k left unnormalized; on tiny-lfm2-moe-mlx (MLX's layout, no expert_bias, two
/// dense layers, scaling and top k as mlx-lm's defaults leave them, theta in
/// `rope_parameters`), the top k renormalized, a scaling of 1.5 and the theta of the
/// top-level default — each breaks every case's first logits.
#[test]
fn planted_router_defects_fail_l1_on_lfm2_moe() {
    for (model, plant) in [
        ("tiny-lfm2-moe", "routed_scaling_factor=1.0"),
        ("tiny-lfm2-moe", "norm_topk_prob=false"),
        ("tiny-lfm2-moe-mlx", "norm_topk_prob=true"),
        ("tiny-lfm2-moe-mlx", "routed_scaling_factor=1.5"),
        ("tiny-lfm2-moe-mlx", "rope_parameters.rope_theta=1000000.0"),
    ] {
        let report = l1(model, Some(plant));
        assert_fails_at_prefill(&report, &format!("{model} with {plant}"));
    }
}

/// qwen3_5 (gated delta nets beside gated attention, Hugging Face's checkpoint layout):
/// planted, each token decayed by the previous token's gate — every case fails at its
/// first logits.
#[test]
fn planted_late_decay_fails_l1_on_qwen3_5() {
    let _on = engine::plant::on(engine::plant::Defect::GdnDecayOneStepLate).unwrap();
    assert_fails_at_prefill(&l1("tiny-qwen3-5", None), "qwen3_5's decay one step late");
}

/// qwen3_5_moe (Qwen3-Next's sparse block with a gated shared expert): planted on
/// tiny-qwen3-5-moe (HF's fused experts, flat config), one expert more per token and the top
/// k left unnormalized; on tiny-qwen3-5-moe-mlx (mlx-community's layout under
/// `text_config`, attention every second layer, the top k unnormalized, half the head
/// rotated), the same extra expert, the top k renormalized and a quarter of the head
/// rotated — each breaks every case's first logits.
#[test]
fn planted_expert_defects_fail_l1_on_qwen3_5_moe() {
    for (model, plant) in [
        ("tiny-qwen3-5-moe", "num_experts_per_tok=3"),
        ("tiny-qwen3-5-moe", "norm_topk_prob=false"),
        ("tiny-qwen3-5-moe-mlx", "text_config.num_experts_per_tok=3"),
        ("tiny-qwen3-5-moe-mlx", "text_config.norm_topk_prob=true"),
        (
            "tiny-qwen3-5-moe-mlx",
            "text_config.rope_parameters.partial_rotary_factor=0.25",
        ),
    ] {
        let report = l1(model, Some(plant));
        assert_fails_at_prefill(&report, &format!("{model} with {plant}"));
    }
}

/// Qwen 3.5 / Qwen3-Next checkpoints already in MLX's layout (mlx-community's: [C, K, 1]
/// conv kernels, stacked experts, the (1 + w) norms stored with their 1): planted, the
/// norms given their 1 again as if the checkpoint were Hugging Face's — every case fails at
/// its first logits.
#[test]
fn planted_norm_offset_on_mlx_layout_fails_l1() {
    let _on = engine::plant::on(engine::plant::Defect::HybridNormOffsetOnMlxLayout).unwrap();
    for model in ["tiny-qwen3-5-moe-mlx", "tiny-qwen3-next-mlx"] {
        let what = format!("{model}'s norms offset twice");
        assert_fails_at_prefill(&l1(model, None), &what);
    }
}

/// qwen3_next (fused delta-net projections grouped per key head, the sparse block beside a
/// dense layer, Hugging Face's per-expert layout): planted, the fused projections split flat
/// — every case fails at its first logits.
#[test]
fn planted_flat_projection_order_fails_l1_on_qwen3_next() {
    let _on = engine::plant::on(engine::plant::Defect::GdnFusedOrderFlat).unwrap();
    // tiny-qwen3-next-mlx: as many key heads as value heads (4), value heads of 8.
    for model in ["tiny-qwen3-next", "tiny-qwen3-next-mlx"] {
        let what = format!("{model}'s projections split flat");
        assert_fails_at_prefill(&l1(model, None), &what);
    }
}

/// qwen3_next's second config (tiny-qwen3-next-mlx: the sparse block on every second layer
/// by `decoder_sparse_step`, attention every second layer with biases, half the head
/// rotated, the top k unnormalized, tied): planted, the top k renormalized and a quarter of
/// the head rotated — each breaks every case's first logits.
#[test]
fn planted_router_and_rope_defects_fail_l1_on_qwen3_next() {
    for plant in ["norm_topk_prob=true", "partial_rotary_factor=0.25"] {
        let report = l1("tiny-qwen3-next-mlx", Some(plant));
        assert_fails_at_prefill(&report, &format!("tiny-qwen3-next-mlx with {plant}"));
    }
}

/// mamba2 (Mamba-2 mixers only, a config with Python's `Infinity`): planted, the previous
/// state carried into the scan without its decay. The prompt is scanned from no state, so
/// the defect shows once decoding reads the state: every case fails, within its first
/// steps.
#[test]
fn planted_undecayed_state_fails_l1_on_mamba2() {
    let _on = engine::plant::on(engine::plant::Defect::SsmStateUndecayed).unwrap();
    // tiny-mamba2-tied: one group, projection biases, no conv bias, dt clipped, tied.
    for model in ["tiny-mamba2", "tiny-mamba2-tied"] {
        let report = l1(model, None);
        assert!(!report.passed(), "{model}: the undecayed state passed L1");
        let firsts: Vec<Option<usize>> = report
            .cases
            .iter()
            .map(|c| c.first_inexact_logits())
            .collect();
        assert!(
            firsts.iter().all(|f| f.is_some_and(|s| s < 8)),
            "{model}: {firsts:?}"
        );
        println!(
            "{model}: planted undecayed state caught: {}",
            report.summary()
        );
    }
}

/// mamba2 with a finite `time_step_limit` ([0.001, 0.5]): planted, the limit lifted (dt
/// no longer clipped) fails L1.
#[test]
fn planted_unclipped_time_step_fails_l1_on_mamba2() {
    let report = l1("tiny-mamba2-tied", Some("time_step_limit=[0.0,1000000.0]"));
    assert!(!report.passed(), "the unclipped dt passed L1");
    println!("planted unclipped dt caught: {}", report.summary());
}

/// nemotron_h (Mamba-2 mixers, attention without positions and ReLU² MLPs by pattern):
/// planted, the gated norm over all channels instead of per group — every case fails at its
/// first logits.
#[test]
fn planted_ungrouped_norm_fails_l1_on_nemotron_h() {
    let _on = engine::plant::on(engine::plant::Defect::SsmNormUngrouped).unwrap();
    assert_fails_at_prefill(&l1("tiny-nemotron-h", None), "nemotron_h's norm ungrouped");
}

/// smollm3 (layer 3 of 4 without RoPE): planted, every layer rotates (`no_rope_layers` all
/// ones) — the gate fails at the prefill of every case.
#[test]
fn planted_rotating_nope_layer_fails_l1_on_smollm3() {
    let report = l1("tiny-smollm3", Some("no_rope_layers=[1,1,1,1]"));
    assert_fails_at_prefill(&report, "smollm3 rotating its NoPE layer");
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

/// The dense families of batch one (gemma2, …).
mod dense;
/// Mistral 3 / Ministral 3 and Qwen3-VL's text model.
mod dense2;
/// The multi-head latent attention families (deepseek_v3 and those built on it).
mod mla;
/// The MoE families of oracles/make_moe2.py (glm4_moe, …).
mod moe2;
/// The MoE families and the floating-point quantization modes.
mod moe_quant;
/// nemotron_h with Nemotron 3's mixture-of-experts blocks.
mod nemotron_moe;
