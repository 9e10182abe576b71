//! ORPO's prefix-shared forward against the joint 2B-row forward (both ours: they differ
//! by design in the shapes of the matmuls and reductions that make the same per-row values,
//! and in where chosen and rejected meet: the joint forward backpropagates each row on its
//! own and sums the two rows' parameter gradients, the prefix-shared one sums their
//! cotangents at the shared prefix and backpropagates that once). B = 4 pairs with prompts
//! of 4 different lengths and responses of unequal lengths (so the shared prefix is the
//! shortest prompt, and the rest of the longer prompts runs in the continuation rows), LoRA
//! on every linear with nonzero B, both NLL scopes, on the families whose attention differs
//! (Llama, Qwen3's q/k norms, Gemma 3's sliding layers, Gemma 4's KV-shared layers, MoE).
//!
//! Two gates, because the committed dense models are bf16:
//! - **f32** (each model converted to float32): the loss terms equal, the gradients within
//!   f32 reassociation of each other (`F32_GRAD_REL` of the largest gradient).
//! - **bf16** (the committed weights): the loss terms equal; each forward's gradients are
//!   compared with the exact ones (the joint forward on the f32 copy, same weights and
//!   adapters, so the gap is rounding alone), and the prefix-shared forward's error may be
//!   at most `BF16_ERROR_RATIO` times the joint forward's. A bf16 backward rounds each
//!   summed cotangent to 8 mantissa bits, so the two bf16 forwards differ from each other by
//!   as much as each differs from the exact gradients (~1 % of the largest), which an
//!   absolute bound between them could not tell from a bug.
//!
//! Planted: the prefix K/V's gradient dropped fails the f32 gradient gate (the losses do
//! not see it); the rejected rows reading no prefix values fails the loss gate.

use crate::common;

use std::path::Path;

use engine::model::LanguageModel;
use engine::plant::{self, Defect};
use engine::train::data::Pair;
use engine::train::lora::Adapters;
use engine::train::orpo::SftScope;
use engine::train::orpo_prefix::{orpo_loss_by, shared_prefix_len, OrpoForward};
use mlx_rs::{Array, Dtype};

/// The models of the gate (all bf16 but the f32 MoE).
const GATED: [&str; 5] = [
    "tiny-llama-trained",
    "tiny-qwen3-tools",
    "tiny-gemma3",
    "tiny-gemma4",
    "tiny-qwen3-moe",
];

/// Largest |Δ| of the loss terms between the forwards (measured: 0, every model, both
/// dtypes and scopes).
const LOSS_BOUND: f32 = 1e-5;

/// f32: largest gradient |Δ| between the forwards over the largest |gradient| (measured on
/// cpu-intel-xeon-processor: ≤ 8.3e-7 over the five models and both scopes).
const F32_GRAD_REL: f32 = 1e-5;

/// bf16: the prefix-shared forward's largest gradient error over the joint forward's, both
/// against the exact gradients (measured on cpu-intel-xeon-processor: 0.95–1.07 over the
/// four bf16 models and both scopes; the joint forward's own error is 1.2–51 % of the
/// largest gradient, tiny-llama-trained's the largest).
const BF16_ERROR_RATIO: f32 = 1.5;

fn attach(m: &dyn LanguageModel) -> Adapters<'_> {
    crate::common::train::attach_nonzero(m, 100)
}

/// Four pairs: prompts of 4 lengths, chosen and rejected of unequal lengths.
fn pairs(dir: &Path) -> Vec<Pair> {
    let tok = engine::load::tokenizer::Tokenizer::load(dir).unwrap();
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

/// The largest gap between two lists of arrays.
fn list_gap(a: &[Array], b: &[Array]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(a, b)| max_gap(a, b))
        .fold(0.0f32, f32::max)
}

/// The largest |x| of a list of arrays.
fn list_max(a: &[Array]) -> f32 {
    a.iter()
        .map(|g| max_gap(g, &mlx_rs::ops::zeros_like(g).unwrap()))
        .fold(0.0f32, f32::max)
}

/// One ORPO step's loss terms and adapter gradients for the model in `dir` by `forward`.
struct Step {
    losses: Vec<Array>,
    grads: Vec<Array>,
    /// The shared prefix's length.
    p: usize,
}

fn step(dir: &Path, scope: SftScope, forward: OrpoForward) -> Step {
    let m = engine::model::load(dir).unwrap();
    let adapters = attach(m.as_ref());
    let pairs = pairs(dir);
    let refs: Vec<&Pair> = pairs.iter().collect();
    let width = pairs
        .iter()
        .map(|p| p.chosen.len().max(p.rejected.len()))
        .max();
    let p = shared_prefix_len(&refs, width.unwrap());
    let shortest = pairs.iter().map(|p| p.prompt_len).min().unwrap();
    assert!(p >= shortest && p > 1, "shared prefix {p}");
    let (losses, grads) = engine::train::value_and_grad(&adapters, || {
        Ok(orpo_loss_by(m.as_ref(), &refs, 0.1, scope, forward)?.into_vec())
    })
    .unwrap();
    mlx_rs::transforms::eval(losses.iter().chain(&grads)).unwrap();
    adapters.detach();
    Step { losses, grads, p }
}

/// f32 gaps of `name` (its f32 copy in `dir`) in `scope`: (loss terms, gradients, largest
/// |gradient|).
fn f32_gaps(name: &str, dir: &Path, scope: SftScope) -> (f32, f32, f32) {
    let joint = step(dir, scope, OrpoForward::Joint);
    let shared = step(dir, scope, OrpoForward::PrefixShared);
    let (loss, grad) = (
        list_gap(&joint.losses, &shared.losses),
        list_gap(&joint.grads, &shared.grads),
    );
    let scale = list_max(&joint.grads);
    println!(
        "{name} f32 {scope:?}: P = {}, max |Δ| loss terms {loss:e}, gradients {grad:e} \
         (max |g| {scale:e}, relative {:e}, {} arrays)",
        joint.p,
        grad / scale,
        joint.grads.len()
    );
    (loss, grad, scale)
}

#[test]
fn prefix_shared_gradients_match_the_joint_ones_in_f32() {
    let tmp = tempfile::tempdir().unwrap();
    let mut failed = Vec::new();
    for name in GATED {
        let dir = common::f32_copy(name, tmp.path());
        for scope in [SftScope::Full, SftScope::Response] {
            let (loss, grad, scale) = f32_gaps(name, &dir, scope);
            assert!(scale > 0.0, "{name}: all-zero gradients");
            if loss > LOSS_BOUND || grad > F32_GRAD_REL * scale {
                failed.push(format!("{name} {scope:?}: {loss:e} / {:e}", grad / scale));
            }
        }
    }
    assert!(failed.is_empty(), "outside the bounds: {failed:?}");
}

/// bf16 errors of `name` (a bf16 model) in `scope` against its f32 copy's joint gradients
/// (`exact_dir`): (loss-term gap between the forwards, joint error, prefix-shared error).
fn bf16_errors(name: &str, exact_dir: &Path, scope: SftScope) -> (f32, f32, f32) {
    let dir = common::committed(name);
    let exact = step(exact_dir, scope, OrpoForward::Joint);
    let joint = step(&dir, scope, OrpoForward::Joint);
    let shared = step(&dir, scope, OrpoForward::PrefixShared);
    let loss = list_gap(&joint.losses, &shared.losses);
    let (e_joint, e_shared) = (
        list_gap(&joint.grads, &exact.grads),
        list_gap(&shared.grads, &exact.grads),
    );
    println!(
        "{name} bf16 {scope:?}: max |Δ| loss terms {loss:e}; gradient error joint \
         {e_joint:e}, prefix-shared {e_shared:e} (ratio {:.2}, max |g| {:e})",
        e_shared / e_joint,
        list_max(&exact.grads)
    );
    (loss, e_joint, e_shared)
}

#[test]
fn prefix_shared_gradients_are_as_accurate_as_the_joint_ones_in_bf16() {
    let tmp = tempfile::tempdir().unwrap();
    let mut failed = Vec::new();
    let mut gated = 0;
    for name in GATED {
        if common::model(name).activation_dtype() != Dtype::Bfloat16 {
            continue;
        }
        gated += 1;
        let exact_dir = common::f32_copy(name, tmp.path());
        for scope in [SftScope::Full, SftScope::Response] {
            let (loss, e_joint, e_shared) = bf16_errors(name, &exact_dir, scope);
            if loss > LOSS_BOUND || e_shared > BF16_ERROR_RATIO * e_joint {
                failed.push(format!(
                    "{name} {scope:?}: {loss:e} / {e_shared:e} vs {e_joint:e}"
                ));
            }
        }
    }
    assert_eq!(gated, 4, "the bf16 models of the gate");
    assert!(failed.is_empty(), "outside the bounds: {failed:?}");
}

/// The prefix K/V's gradient dropped, on the bf16 model whose own rounding is smallest:
/// the bf16 gate fails too.
#[test]
fn planted_prefix_kv_without_gradient_fails_the_bf16_gate() {
    let tmp = tempfile::tempdir().unwrap();
    let exact_dir = common::f32_copy("tiny-qwen3-tools", tmp.path());
    let _on = plant::on(Defect::OrpoPrefixKvNoGrad).unwrap();
    let (_, e_joint, e_shared) = bf16_errors("tiny-qwen3-tools", &exact_dir, SftScope::Full);
    assert!(
        e_shared > BF16_ERROR_RATIO * e_joint,
        "planted: {e_shared:e} vs {e_joint:e}"
    );
}

/// The continuation reads the prefix K/V with their gradient stopped: the loss is the
/// same, the gradients are not.
#[test]
fn planted_prefix_kv_without_gradient_fails_the_gradient_gate() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = common::f32_copy(GATED[0], tmp.path());
    let _on = plant::on(Defect::OrpoPrefixKvNoGrad).unwrap();
    let (loss, grad, scale) = f32_gaps(GATED[0], &dir, SftScope::Full);
    assert!(loss <= LOSS_BOUND, "the loss should not see it: {loss:e}");
    assert!(
        grad > F32_GRAD_REL * scale,
        "planted: gradient gap {grad:e}"
    );
}

/// The rejected rows read zeros for the prefix's values: the loss gate fails.
#[test]
fn planted_rejected_rows_without_the_prefix_fail_the_loss_gate() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = common::f32_copy(GATED[0], tmp.path());
    let _on = plant::on(Defect::OrpoRejectedSkipsPrefix).unwrap();
    let (loss, _, _) = f32_gaps(GATED[0], &dir, SftScope::Full);
    assert!(loss > LOSS_BOUND, "planted: loss gap {loss:e}");
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
    let m = common::model("tiny-llama-trained");
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
