//! The B=N gate (`gates::BATCH`, harness::parity::batch): the batch lane's batched decoding
//! against mlx-lm's `BatchGenerator` goldens (oracles/gen_batch.py) — B=2 and B=4 with
//! different prompt lengths, a row joining a running batch while another leaves, and the
//! `ring` scenario (a row joining a wrapped sliding-window batch from an unwrapped group) —
//! every row's logits bit-exact, ids identical, on a dense model, on the three
//! mixture-of-experts families (whose rows route to different experts in the same forward),
//! on phi3 (fused projections, longrope: per-row positions through RoPE with its own
//! frequencies), on gemma3 (sliding window 8 < every row's length: `BatchRotatingKvCache`
//! beside `BatchKvCache`) and on the hybrids (recurrent states in `ArraysCache`, one row per
//! sequence, alone in mamba2, beside attention layers, or beside K/V in one layer's
//! `CacheList` in falcon_h1), and on issue 38's kinds: multi-head latent attention (tiny-deepseek-v3),
//! GLM-4.5's grouped router (tiny-glm4-moe), OLMo 2's post-norm layers (tiny-olmo2) and
//! Ministral 3's position-scaled queries beside sliding windows (tiny-ministral3). Gemma 2
//! is not on it: mlx-lm 0.32.2's `BatchGenerator` fails on it (its softcapped attention's
//! mask does not broadcast against the grouped scores), so the lane refuses it by name, as it
//! refuses deepseek_v32 (a row joining a running batch differs from BatchGenerator by 7e-7).
//! The other issue-38 families with standard caches are gated too: gemma3n, glm4_moe_lite,
//! kimi_k25, minicpm3, mistral3, qwen3_vl (the manifest's `batch` rows).
//! `gates::BATCH_KV4`: the same
//! scenarios over 4-bit quantized KV against each row's single-sequence
//! `generate_step(kv_bits=4)` run. Planted defects: a mask that forgets the left padding
//! fails every model with attention layers; a router that keeps the wrong experts fails every
//! MoE family, one that weighs the experts by their biased scores fails the grouped routers
//! (Nemotron 3's `E` blocks, GLM-4.5's, DeepSeek-V3's); a sliding-window mask not rolled with the ring fails gemma3; recurrent states
//! that keep their first rows when a row leaves fail every hybrid; zeroed biases of new
//! quantized positions fail the quantized gate. Models with other caches (dynamic RoPE, …),
//! and quantized KV on a hybrid, are refused by the batch lane by name.

use engine::generate::batch::Batch;
use engine::generate::{Session, SessionOptions};
use harness::parity::gates::{Gate, Plant, Target, BATCH, BATCH_KV4};
use harness::parity::Report;

/// The mixture-of-experts models of the gate (each router kind: qwen3_moe's softmax then
/// top-k, mixtral's top-k then softmax, qwen2_moe's unnormalized top-k and shared expert).
const MOE: [&str; 3] = ["tiny-qwen3-moe", "tiny-mixtral", "tiny-qwen2-moe"];

/// The sliding-window models of the gate (window 8, below every row's length): gemma3
/// (1 global layer in 2), gemma4 (KV shared across layers, per-layer-kind masks), its MoE,
/// gpt-oss (attention sinks beside the window), and ministral3 (Llama 4's position-scaled
/// queries: each row's own positions).
const SLIDING: [&str; 5] = [
    "tiny-ministral3",
    "tiny-gemma3",
    "tiny-gemma4",
    "tiny-gemma4-moe",
    "tiny-gpt-oss",
];

/// The hybrids of the gate: their recurrent layers' states (`ArraysCache`) are batched
/// beside attention layers — gated delta nets (qwen3_5, its MoE, qwen3_next), short
/// convolutions (lfm2, its MoE), Mamba-2 mixers (nemotron_h, granitemoehybrid; Nemotron 3's
/// mixture-of-experts `E` blocks in tiny-nemotron-h-moe-q4, which keep no cache and route
/// each row's tokens on their own, through 4-bit experts), a Mamba-2 mixer beside attention
/// in every layer (falcon_h1: one `CacheList` per layer, batched part by part) — or alone
/// (mamba2, which has no attention layer and so no padding to mask).
const HYBRID: [&str; 10] = [
    "tiny-qwen3-5",
    "tiny-qwen3-5-moe",
    "tiny-qwen3-next",
    "tiny-lfm2",
    "tiny-lfm2-moe",
    "tiny-nemotron-h",
    "tiny-nemotron-h-moe-q4",
    "tiny-granite-h",
    "tiny-falcon-h1",
    "tiny-mamba2",
];

/// The gate's models without an attention layer (no K/V, so no left padding to mask).
const ATTENTION_FREE: [&str; 1] = ["tiny-mamba2"];

fn run_gate(gate: &Gate, model: &str, scenario: &str, plant: Option<&Plant>) -> Box<dyn Report> {
    let target = Target {
        case: Some(scenario),
        ..Target::new(model)
    };
    gate.run_target(&target, plant).unwrap()
}

fn run(model: &str, scenario: &str, plant: Option<&Plant>) -> Box<dyn Report> {
    run_gate(&BATCH, model, scenario, plant)
}

fn gate(scenario: &str) {
    for g in [&BATCH, &BATCH_KV4] {
        for model in g.models() {
            let r = run_gate(g, model, scenario, None);
            harness::announce(&format!("{}: {}", g.name, r.summary()));
            assert!(r.passed(), "{} {model}: {}", g.name, r.summary());
        }
    }
}

#[test]
fn b2_rows_of_different_lengths() {
    gate("b2");
}

#[test]
fn b4_rows_of_different_lengths() {
    gate("b4");
}

#[test]
fn a_row_joins_a_running_batch_while_another_leaves() {
    gate("joinleave");
}

#[test]
fn a_row_joins_a_wrapped_sliding_window_batch() {
    gate("ring");
}

/// Every family the batch lane serves (the registry's `batch`) has a tiny model in the batch
/// gate: by its model_type, or the one mlx-lm remaps it to or from. Not llama4: the lane
/// refuses its chunked attention by name (`l1_models::moe2::the_batch_lane_refuses_llama4_s_chunked_caches`).
#[test]
fn the_gate_covers_every_family_of_the_batch_lane() {
    let gated: Vec<&str> = harness::manifest::tiny_models()
        .iter()
        .filter(|m| BATCH.models().contains(&m.name.as_str()))
        .map(|m| m.model_type.as_str())
        .collect();
    let same_module = engine::model::registry::same_module;
    let covered = |t: &str| gated.iter().any(|g| same_module(t, g));
    let missing: Vec<&str> = engine::model::registry::FAMILIES
        .iter()
        .filter(|f| f.batch && f.model_type != "llama4")
        .map(|f| f.model_type)
        .filter(|t| !covered(t))
        .collect();
    assert!(
        missing.is_empty(),
        "families the batch lane serves without a batch gate: {missing:?}"
    );
    assert!(!covered("no_such_family"), "the check must be able to fail");
    // Quantized KV on a hybrid is refused by the lane (`refusal`), so not gated either.
    for model in HYBRID {
        assert!(!BATCH_KV4.models().contains(&model), "{model} in batch-kv4");
    }
}

#[test]
fn planted_unmasked_padding_fails_the_gate() {
    for model in BATCH
        .models()
        .iter()
        .filter(|m| !ATTENTION_FREE.contains(m))
    {
        let r = run(
            model,
            "b4",
            Some(&Plant::parse("unmasked-padding").unwrap()),
        );
        println!("planted B=N defect caught on {model}: {}", r.summary());
        assert!(!r.passed(), "{model}");
    }
}

#[test]
fn planted_unrolled_ring_mask_fails_the_sliding_window_gate() {
    let plant = Plant::parse("ring-mask-unrolled").unwrap();
    for model in SLIDING {
        let r = run(model, "ring", Some(&plant));
        println!(
            "planted ring-mask defect caught on {model}: {}",
            r.summary()
        );
        assert!(!r.passed(), "{model}");
    }
}

/// A row that stays must decode on its own state when another leaves: the plant keeps the
/// batch's first state rows instead (in `joinleave` the first row leaves after 3 ids while
/// the second decodes on).
#[test]
fn planted_unfiltered_state_rows_fail_the_hybrid_gate() {
    let plant = Plant::parse("state-rows-unfiltered").unwrap();
    for model in HYBRID {
        let r = run(model, "joinleave", Some(&plant));
        println!(
            "planted state-rows defect caught on {model}: {}",
            r.summary()
        );
        assert!(!r.passed(), "{model}");
    }
}

#[test]
fn planted_defects_fail_the_quantized_gate() {
    for name in ["batch-kv-biases-dropped", "unmasked-padding"] {
        let plant = Plant::parse(name).unwrap();
        let r = run_gate(&BATCH_KV4, "tiny-llama-trained", "b4", Some(&plant));
        println!(
            "planted {name} caught on the quantized gate: {}",
            r.summary()
        );
        assert!(!r.passed(), "{name}");
    }
}

#[test]
fn planted_moe_top_k_off_by_one_fails_the_batched_gate() {
    let plant = Plant::parse("moe-top-k-off-by-one").unwrap();
    for model in MOE {
        let r = run(model, "b4", Some(&plant));
        println!(
            "planted MoE router defect caught on {model}: {}",
            r.summary()
        );
        assert!(!r.passed(), "{model}");
    }
}

/// Nemotron 3's router (sigmoid scores, a correction bias for the choice only, grouped
/// top-k) batched: the rows' tokens route on their own, and a router that weighs the experts
/// by the biased scores fails the batched gate too.
#[test]
fn planted_biased_expert_weights_fail_the_batched_gate() {
    let _on = engine::plant::on(engine::plant::Defect::MoeCorrectionBiasWeighted).unwrap();
    for model in GROUPED_ROUTERS {
        let r = run(model, "b4", None);
        println!(
            "planted correction-bias defect caught on {model}: {}",
            r.summary()
        );
        assert!(!r.passed(), "{model}");
    }
}

/// The models whose routers are `group_expert_select` (sigmoid scores, a correction bias for
/// the choice only, grouped top-k): Nemotron 3's `E` blocks, GLM-4.5's sparse block and
/// DeepSeek-V3's (beside its multi-head latent attention, whose cache holds the compressed
/// latent and the rope key: K and V of different widths, batched as any K/V).
const GROUPED_ROUTERS: [&str; 3] = [
    "tiny-nemotron-h-moe-q4",
    "tiny-glm4-moe",
    "tiny-deepseek-v3",
];

/// The batch lane's refusal, as `Batch::join` gives it (`engine serve --batch N` sends
/// such models to the serial lane instead: /stats shows `lanes.batch_slots` 0).
fn join_refusal(model: &str) -> Option<String> {
    let m = engine::model::load(&harness::goldens::model_dir(model).unwrap()).unwrap();
    let mut session = Session::with_options(m.as_ref(), &SessionOptions::default());
    session.prefill(&[1, 2, 3, 4]).unwrap();
    let mut batch = Batch::new(m.as_ref());
    batch.join(vec![session]).err().map(|e| e.what().to_owned())
}

#[test]
fn models_with_dynamic_rope_caches_are_refused_by_name() {
    let why = join_refusal("tiny-llama-dynamic").expect("the batch lane took a dynamic-RoPE cache");
    println!("tiny-llama-dynamic: {why}");
    assert!(
        why.contains(
            "the batch lane takes standard (dense, full-attention), sliding-window and \
             recurrent-state (ArraysCache) caches only"
        ),
        "{why}"
    );
}

/// `engine serve --batch N`'s eligibility (`generate::batch::refusal`, the lane's
/// `not_batchable`): quantized KV is batched only as the gate checks it — mlx-lm's
/// attention, quantized from the first chunk, full-attention caches, no recurrent layer.
#[test]
fn quantized_kv_takes_the_batch_lane_only_as_gated() {
    use engine::cache::kv_quant::{KvLayers, KvQuantPlan};
    use engine::cache::QuantSdpa;
    use engine::generate::batch::refusal;
    let plan = |start, sdpa| SessionOptions {
        kv_quant: Some(KvQuantPlan {
            layers: KvLayers::Uniform {
                bits: 4,
                group_size: 32,
            },
            start,
            sdpa,
        }),
        ..SessionOptions::default()
    };
    let load = |name| engine::model::load(&harness::goldens::model_dir(name).unwrap()).unwrap();
    let (llama, gemma) = (load("tiny-llama-trained"), load("tiny-gemma3-kv"));
    let hybrid = load("tiny-qwen3-5");
    // falcon_h1's recurrent states sit in each layer's `CacheList`, beside its K/V.
    let listed = load("tiny-falcon-h1");
    assert_eq!(refusal(llama.as_ref(), &plan(0, QuantSdpa::MlxLm)), None);
    assert_eq!(refusal(gemma.as_ref(), &SessionOptions::default()), None);
    assert_eq!(refusal(hybrid.as_ref(), &SessionOptions::default()), None);
    assert_eq!(refusal(listed.as_ref(), &SessionOptions::default()), None);
    for (model, opts, says) in [
        (
            &llama,
            plan(0, QuantSdpa::OptiqFused),
            "optiq's fused attention",
        ),
        (
            &llama,
            plan(0, QuantSdpa::DequantDecode),
            "optiq's fused attention",
        ),
        (&llama, plan(16, QuantSdpa::MlxLm), "--quantized-kv-start"),
        (
            &gemma,
            plan(0, QuantSdpa::MlxLm),
            "quantized sliding-window caches",
        ),
        (
            &hybrid,
            plan(0, QuantSdpa::MlxLm),
            "quantized KV on a hybrid model",
        ),
        (
            &listed,
            plan(0, QuantSdpa::MlxLm),
            "quantized KV on a hybrid model",
        ),
    ] {
        let why = refusal(model.as_ref(), &opts).expect("refused");
        assert!(why.contains(says), "{why}");
    }
    let dynamic = load("tiny-llama-dynamic");
    let why = refusal(dynamic.as_ref(), &SessionOptions::default()).unwrap();
    assert!(why.contains("dynamic RoPE"), "{why}");
}

/// BatchGenerator's prompt batch op for op (`Batch::admit_prompts`, harness
/// `run_prompt_batches`) on `model`'s batch golden.
fn prompt_batches(model: &str, scenario: &str) -> harness::parity::batch::BatchReport {
    let golden = harness::goldens::TensorGolden::open(&BATCH.golden(model)).unwrap();
    harness::parity::batch::run_prompt_batches(model, &golden, Some(scenario)).unwrap()
}

/// The models whose every cache takes a batched prefill (no sliding window): the hybrids,
/// dense attention and the MoE families.
fn prompt_batch_models() -> impl Iterator<Item = &'static str> {
    HYBRID
        .into_iter()
        .chain(["tiny-llama-trained", "tiny-phi3"])
        .chain(MOE)
}

/// The rows that join together admitted as BatchGenerator admits them, op for op: fresh
/// caches merged (the recurrent states' zero left padding), one right-padded forward with
/// each row's length (the mixers' mask and their states taken at each row's own end; the
/// K/V rows' padding rolled to the front), then the last tokens — the recurrent mixers'
/// batched prefill against the same goldens, every scenario bit-exact.
#[test]
fn batchgenerator_prompt_batches_are_bit_exact() {
    for model in prompt_batch_models() {
        for scenario in BATCH.cases {
            let r = prompt_batches(model, scenario);
            harness::announce(&format!("prompt batches: {}", r.summary()));
            assert!(r.passed(), "{model}: {}", r.summary());
        }
    }
}

/// Recurrent states that take no lengths: a shorter row's state runs on over its right
/// padding, which the prompt batches catch on every hybrid.
#[test]
fn planted_ignored_state_lengths_fail_the_prompt_batches() {
    let _on = engine::plant::on(engine::plant::Defect::BatchStateLengthsIgnored).unwrap();
    for model in HYBRID {
        let r = prompt_batches(model, "b4");
        println!(
            "planted state-lengths defect caught on {model}: {}",
            r.summary()
        );
        assert!(!r.passed(), "{model}");
    }
}

/// A row taken out of a hybrid batch (`row_caches`: its prompt-cache entry when it leaves,
/// a parked row's caches) holds the tokens it has consumed, in every layer alike: the
/// recurrent states count per row, as the K/V rows do; a state cannot be cut back.
#[test]
fn a_row_out_of_a_hybrid_batch_holds_its_own_tokens() {
    let m = engine::model::load(&harness::goldens::model_dir("tiny-qwen3-5").unwrap()).unwrap();
    let sessions = [4, 7]
        .map(|n| {
            let mut s = Session::with_options(m.as_ref(), &SessionOptions::default());
            s.prefill(&[1, 2, 3, 4, 5, 6, 7][..n]).unwrap();
            s
        })
        .into();
    let mut batch = Batch::new(m.as_ref());
    batch.join(sessions).unwrap();
    batch.step(&[8, 9]).unwrap();
    for (row, held) in [(0, 5), (1, 8)] {
        let caches = batch.row_caches(row, 100).unwrap();
        let offsets: Vec<i32> = caches.iter().map(|c| c.offset()).collect();
        assert!(offsets.iter().all(|&o| o == held), "row {row}: {offsets:?}");
    }
    let why = batch.row_caches(0, 4).err().expect("a state cut back");
    assert!(why.what().contains("cannot be cut back"), "{}", why.what());
}

#[test]
fn hybrid_models_join_the_batch() {
    // Gated above, or (the multimodal checkpoint) its text model is.
    for model in HYBRID.iter().chain(&["tiny-qwen3-5-mm"]) {
        assert_eq!(join_refusal(model), None, "{model}");
    }
}

#[test]
fn sliding_window_models_join_the_batch() {
    // Gated above (BATCH.models()) or their text model is (the multimodal and quantized-weight
    // variants share gemma3's caches).
    for model in SLIDING.iter().chain(&["tiny-gemma3-mm", "tiny-gemma3-q4"]) {
        assert_eq!(join_refusal(model), None, "{model}");
    }
}

/// Gemma 2 has no batch reference (mlx-lm 0.32.2's `BatchGenerator` raises on it) and
/// deepseek_v32's lane is not exact against it (a row joining a running batch differs in
/// the last bits), so `engine serve --batch` serves both one request at a time and says
/// why; a family the gate covers is not refused (the check can tell them apart).
#[test]
fn families_without_a_batch_reference_are_refused_by_the_batch_lane() {
    use engine::generate::batch::refusal;
    let load = |name| engine::model::load(&harness::goldens::model_dir(name).unwrap()).unwrap();
    let opts = SessionOptions::default();
    for name in ["tiny-gemma2", "tiny-deepseek-v32"] {
        let why = refusal(load(name).as_ref(), &opts).expect("took the batch lane");
        assert!(
            why.contains("not gated against mlx-lm 0.32.2's BatchGenerator"),
            "{name}: {why}"
        );
    }
    assert_eq!(refusal(load("tiny-olmo2").as_ref(), &opts), None);
}

/// The worst |Δ| between each row of a prompt batch (`Batch::admit_prompts`, prefill step
/// `step`, then 8 greedy steps of the batch) and that prompt run alone (a session's prefill
/// with the same step, then the same ids), over every step's logits, on `model`.
fn prompt_batch_vs_alone(model: &str, step: usize) -> f32 {
    use mlx_rs::ops::indexing::IndexOp;
    let m = engine::model::load(&harness::goldens::model_dir(model).unwrap()).unwrap();
    let prompts: Vec<Vec<u32>> = [(9, 5, 7), (23, 11, 3), (16, 17, 5)]
        .iter()
        .map(|&(n, a, b)| (0..n).map(|i| a + i * b).collect())
        .collect();
    let refs: Vec<&[u32]> = prompts.iter().map(|p| &p[..]).collect();
    // The larger of two gaps, a NaN winning (so it fails the gate).
    let worse = |m: f32, d: f32| if d.is_nan() || d > m { d } else { m };
    let diff = |a: &mlx_rs::Array, b: &mlx_rs::Array| -> f32 {
        let host = |x: &mlx_rs::Array| {
            let x = x.as_dtype(mlx_rs::Dtype::Float32).unwrap();
            x.as_slice::<f32>().to_vec()
        };
        let (a, b) = (host(a), host(b));
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(&b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, worse)
    };
    let mut batch = Batch::new(m.as_ref());
    let mut logits = batch.admit_prompts(&refs, step).unwrap();
    let mut alone: Vec<Session> = Vec::new();
    let mut worst = 0f32;
    let mut ids: Vec<u32> = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let mut s = Session::with_options(
            m.as_ref(),
            &SessionOptions::from(engine::generate::CompileDecode::Off),
        );
        s.prefill_step = step;
        let want = s.prefill(p).unwrap();
        worst = worse(
            worst,
            diff(&logits.index(i as i32).reshape(&[1, -1]).unwrap(), &want),
        );
        alone.push(s);
    }
    for _ in 0..8 {
        let next = mlx_rs::ops::indexing::argmax_axis(&logits, -1, None).unwrap();
        ids = next.as_slice::<u32>().to_vec();
        logits = batch.step(&ids).unwrap();
        for (i, s) in alone.iter_mut().enumerate() {
            let want = s.step(&[ids[i]]).unwrap();
            worst = worse(
                worst,
                diff(&logits.index(i as i32).reshape(&[1, -1]).unwrap(), &want),
            );
        }
    }
    assert_eq!(ids.len(), prompts.len());
    worst
}

/// The models of the batched-prefill gate: f32, bf16 and f16 dense, a mixture of experts, a
/// hybrid with recurrent states.
const PROMPT_BATCH_ROWS: [&str; 5] = [
    "tiny-qwen3",
    "tiny-llama-trained",
    "tiny-qwen2",
    "tiny-mixtral",
    "tiny-qwen3-5",
];

/// Issue 43 item 3: the batch lane prefills uncached prompts that arrive together in one
/// right-padded forward per prefill step (BatchGenerator's prompt batch), and every row —
/// its first logits and 8 decode steps after — is bit-exact (max |Δ| = 0) against that
/// prompt prefilled alone, in f32, bf16 and f16, whether the bodies fit one prefill step or
/// span several. So the lane's rows keep the serial lane's numbers and no envelope is needed.
#[test]
fn prompt_batch_rows_are_bit_exact_against_prefill_alone() {
    for model in PROMPT_BATCH_ROWS {
        for step in [512, 4] {
            let worst = prompt_batch_vs_alone(model, step);
            println!("{model} (prefill step {step}): max |Δ| = {worst:e}");
            assert_eq!(worst, 0.0, "{model}, prefill step {step}");
        }
    }
}

#[test]
fn planted_unmasked_padding_fails_the_prompt_batch_rows() {
    let _on = engine::plant::on(engine::plant::Defect::BatchUnmaskedPadding).unwrap();
    assert!(prompt_batch_vs_alone("tiny-llama-trained", 512) > 0.0);
}
