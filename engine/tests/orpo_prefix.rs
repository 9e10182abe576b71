//! ORPO's prefix-shared forward against the joint 2B-row forward (both ours: they differ
//! by design only in the shapes of the matmuls and reductions that make the same per-row
//! values). B = 4 pairs with prompts of 4 different lengths and responses of unequal
//! lengths (so the shared prefix is the shortest prompt, and the rest of the longer prompts
//! runs in the continuation rows), LoRA on every linear with nonzero B, both NLL scopes:
//! every ORPO term and every adapter gradient within the stated bound, on f32
//! (tiny-llama-trained) and bf16 (tiny-qwen3-tools) models and the families whose
//! attention differs (gemma3's sliding layers, gemma4's KV-shared layers, MoE blocks).
//! Planted: the prefix K/V's gradient dropped fails the gradient gate; the rejected rows
//! reading no prefix values fails the loss gate.

mod common;

use common::{goldens, model};
use engine::model::LanguageModel;
use engine::plant::{self, Defect};
use engine::train::data::Pair;
use engine::train::lora::{AdapterConfig, Adapters, LoraParams};
use engine::train::orpo::SftScope;
use engine::train::orpo_prefix::{orpo_loss_by, shared_prefix_len, OrpoForward};
use mlx_rs::{Array, Dtype};

/// The models of the gate, and the bounds (absolute max |Δ| of the loss terms, of the
/// gradients) between the two forwards. Measured (cpu, see docs/training.md) well inside.
const GATED: [(&str, f32, f32); 5] = [
    ("tiny-llama-trained", 1e-5, 1e-5),
    ("tiny-qwen3-tools", 1e-5, 1e-5),
    ("tiny-gemma3", 1e-5, 1e-5),
    ("tiny-gemma4", 1e-5, 1e-5),
    ("tiny-qwen3-moe", 1e-5, 1e-5),
];

fn attach(m: &dyn LanguageModel) -> Adapters<'_> {
    let config = AdapterConfig {
        fine_tune_type: "lora".into(),
        num_layers: usize::MAX,
        lora_parameters: LoraParams {
            rank: 4,
            scale: 20.0,
            dropout: 0.0,
            keys: None,
        },
        extra: Default::default(),
    };
    let adapters = Adapters::attach(m, config, 3).unwrap();
    // Nonzero B, so every adapter parameter gets a gradient.
    let params: Vec<Array> = adapters
        .params()
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let key = mlx_rs::random::key(100 + i as u64).unwrap();
            mlx_rs::random::normal::<f32>(p.shape(), None, None, &key)
                .unwrap()
                .multiply(Array::from_f32(0.01))
                .unwrap()
                .as_dtype(p.dtype())
                .unwrap()
        })
        .collect();
    adapters.set(&params);
    adapters
}

/// Four pairs: prompts of 4 lengths, chosen and rejected of unequal lengths.
fn pairs(name: &str) -> Vec<Pair> {
    let tok =
        engine::load::tokenizer::Tokenizer::load(&goldens().join("models").join(name)).unwrap();
    let texts = [
        (
            "Question: What color is the sky?",
            " The sky is blue.",
            " Green, mostly, with a few purple clouds.",
        ),
        ("Say hi.", " Hi there, friend!", " No."),
        (
            "Name a fruit that is yellow and long.",
            " A banana.",
            " A cucumber is a fruit.",
        ),
        (
            "Count to three",
            " One, two, three.",
            " Three, two, one, zero, lift off.",
        ),
    ];
    texts
        .iter()
        .map(|&(p, c, r)| {
            let prompt = tok.encode(p, true).unwrap();
            let mut chosen = prompt.clone();
            chosen.extend(tok.encode(c, false).unwrap());
            let mut rejected = prompt.clone();
            rejected.extend(tok.encode(r, false).unwrap());
            Pair {
                prompt_len: prompt.len(),
                chosen,
                rejected,
            }
        })
        .collect()
}

fn max_gap(a: &Array, b: &Array) -> f32 {
    let d = a
        .as_dtype(Dtype::Float32)
        .unwrap()
        .subtract(b.as_dtype(Dtype::Float32).unwrap())
        .unwrap()
        .abs()
        .unwrap()
        .max(None)
        .unwrap();
    d.eval().unwrap();
    d.as_slice::<f32>()[0]
}

/// (largest loss-term gap, largest gradient gap, largest |gradient|) between the two
/// forwards on `name` in `scope`.
fn gaps(name: &str, scope: SftScope) -> (f32, f32, f32) {
    let m = model(name);
    let adapters = attach(m.as_ref());
    let pairs = pairs(name);
    let refs: Vec<&Pair> = pairs.iter().collect();
    let width = pairs
        .iter()
        .map(|p| p.chosen.len().max(p.rejected.len()))
        .max();
    let p = shared_prefix_len(&refs, width.unwrap());
    let shortest = pairs.iter().map(|p| p.prompt_len).min().unwrap();
    assert!(p >= shortest && p > 1, "shared prefix {p}");
    let run = |forward| {
        engine::train::value_and_grad(&adapters, || {
            Ok(orpo_loss_by(m.as_ref(), &refs, 0.1, scope, forward)?.into_vec())
        })
        .unwrap()
    };
    let (joint_out, joint_grads) = run(OrpoForward::Joint);
    let (shared_out, shared_grads) = run(OrpoForward::PrefixShared);
    let loss = joint_out
        .iter()
        .zip(&shared_out)
        .map(|(a, b)| max_gap(a, b))
        .fold(0.0f32, f32::max);
    let grad = joint_grads
        .iter()
        .zip(&shared_grads)
        .map(|(a, b)| max_gap(a, b))
        .fold(0.0f32, f32::max);
    let zero = |g: &Array| max_gap(g, &mlx_rs::ops::zeros_like(g).unwrap());
    let scale = joint_grads.iter().map(zero).fold(0.0f32, f32::max);
    println!(
        "{name} {scope:?}: P = {p} (prompts ≥ {shortest}), max |Δ| loss terms {loss:e}, \
         gradients {grad:e} (max |g| {scale:e}, {} arrays)",
        joint_grads.len()
    );
    (loss, grad, scale)
}

#[test]
#[ignore = "fails: losses bit-identical, LoRA gradients off by up to 0.5 (max |g| 0.83) on the \
            dense models; the prefix-shared forward stays off by default until this passes"]
fn prefix_shared_forward_matches_the_joint_one() {
    let mut failed = Vec::new();
    for (name, loss_bound, grad_bound) in GATED {
        for scope in [SftScope::Full, SftScope::Response] {
            let (loss, grad, scale) = gaps(name, scope);
            assert!(scale > 0.0, "{name}: all-zero gradients");
            if loss > loss_bound || grad > grad_bound {
                failed.push(format!("{name} {scope:?}: {loss:e} / {grad:e}"));
            }
        }
    }
    assert!(failed.is_empty(), "outside the bounds: {failed:?}");
}

/// The continuation reads the prefix K/V with their gradient stopped: the loss is the
/// same, the gradients are not.
#[test]
#[ignore = "meaningful only once the gradient gate passes"]
fn planted_prefix_kv_without_gradient_fails_the_gradient_gate() {
    let _on = plant::on(Defect::OrpoPrefixKvNoGrad).unwrap();
    let (name, loss_bound, grad_bound) = GATED[0];
    let (loss, grad, _) = gaps(name, SftScope::Full);
    assert!(loss <= loss_bound, "the loss should not see it: {loss:e}");
    assert!(grad > grad_bound, "planted: gradient gap {grad:e}");
}

/// The rejected rows read zeros for the prefix's values: the loss gate fails.
#[test]
fn planted_rejected_rows_without_the_prefix_fail_the_loss_gate() {
    let _on = plant::on(Defect::OrpoRejectedSkipsPrefix).unwrap();
    let (name, loss_bound, _) = GATED[0];
    let (loss, _, _) = gaps(name, SftScope::Full);
    assert!(loss > loss_bound, "planted: loss gap {loss:e}");
}

/// Without a shared prefix (here: the rows differ from their first token) the
/// prefix-shared forward is the joint one.
#[test]
fn pairs_without_a_shared_prefix_take_the_joint_forward() {
    let pair = Pair {
        prompt_len: 1,
        chosen: vec![5, 6, 7, 8],
        rejected: vec![9, 6, 7],
    };
    assert_eq!(shared_prefix_len(&[&pair], 4), 0);
    let m = model("tiny-llama-trained");
    let a = orpo_loss_by(
        m.as_ref(),
        &[&pair],
        0.1,
        SftScope::Full,
        OrpoForward::Joint,
    )
    .unwrap();
    let b = orpo_loss_by(
        m.as_ref(),
        &[&pair],
        0.1,
        SftScope::Full,
        OrpoForward::PrefixShared,
    )
    .unwrap();
    assert_eq!(common::bytes(&a.loss), common::bytes(&b.loss));
}
