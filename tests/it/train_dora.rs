//! DoRA and QLoRA against mlx-lm's trainer (oracles/gen_train.py), through the same check
//! as the LoRA gate (harness::parity::train: from the golden's initial adapters, 3 steps of
//! every loss, token count and gradient, the tensors after the last update, our saved files
//! against mlx-lm's, and the logits with mlx-lm's saved adapters loaded by us — all bit for
//! bit), plus DoRA's initial magnitudes (the weights' row norms) against mlx-lm's.
//!
//! - `train-dora` (`gates::TRAIN_DORA`, goldens/train/<model>-dora): mlx-lm's `DoRALinear`
//!   on tiny-llama-trained (bf16), tiny-llama-trained-q4 (affine 4-bit g64, layer 0's
//!   down_proj dense) and tiny-qwen3-q8 (affine 8-bit g32): the norm of W + scale·BᵀAᵀ per
//!   output row, gradient-stopped, the quantized weights dequantized as mlx-lm does.
//! - QLoRA: the LoRA gate's rows tiny-llama-trained-q4 and tiny-qwen3-q8 (`LoRALinear` over
//!   `QuantizedLinear`: quantized_matmul, then the f32 adapter).
//!
//! - `train-full` (`gates::TRAIN_FULL`, goldens/train/<model>-full): `--fine-tune-type full`
//!   on tiny-llama-trained, the last block's 9 weights (bf16) trained, saved and loaded.
//!
//! Planted: DoRA's norm left differentiable fails every DoRA row at step 0's gradients; a
//! 4-bit base under LoRA run on its dequantized weight fails the 4-bit row; full
//! fine-tuning with one block too many trainable fails the full gate.

use engine::plant::Defect;
use harness::parity::gates::{Gate, Plant, Tweak, TRAIN, TRAIN_DORA, TRAIN_FULL};

const QUANTIZED: [&str; 2] = ["tiny-llama-trained-q4", "tiny-qwen3-q8"];

fn assert_passes(gate: &Gate, model: &str) {
    assert!(
        gate.models().contains(&model),
        "{model}: not a row of {}",
        gate.name
    );
    let r = gate.run(model, None).unwrap();
    harness::announce(&r.summary());
    assert!(r.passed(), "{}", r.summary());
}

fn assert_fails(gate: &Gate, model: &str, defect: Defect, first: &str) {
    let r = gate.run(model, Some(&Plant::Engine(defect))).unwrap();
    println!("{model}: planted {defect:?} caught: {}", r.summary());
    assert!(!r.passed(), "{model}");
    assert!(r.summary().contains(first), "{}", r.summary());
}

#[test]
fn dora_sft_steps_match_mlx_lm_on_dense_and_quantized_bases() {
    assert_eq!(TRAIN_DORA.models().len(), 3);
    for model in TRAIN_DORA.models() {
        assert_passes(&TRAIN_DORA, model);
    }
}

#[test]
fn qlora_sft_steps_match_mlx_lm_on_4_and_8_bit_bases() {
    for model in QUANTIZED {
        assert_passes(&TRAIN, model);
    }
}

/// DoRA's norm with its gradient: A and B learn through it too. B starts at zero, yet the
/// norm's gradient with respect to B is not zero, so step 0's gradients already differ.
#[test]
fn planted_dora_norm_with_gradient_fails_every_dora_row() {
    for model in TRAIN_DORA.models() {
        let defect = Defect::DoraNormWithGradient;
        assert_fails(&TRAIN_DORA, model, defect, "first failure: step 0 grad");
    }
}

/// The LoRA gate's own plant, a weight decay off by 10 %, fails every DoRA row (A, B and m
/// are f32).
#[test]
fn planted_weight_decay_fails_every_dora_row() {
    for model in TRAIN_DORA.models() {
        let r = TRAIN_DORA
            .run(model, Some(&Plant::Harness(Tweak::WeightDecay)))
            .unwrap();
        println!("{model}: planted weight decay caught: {}", r.summary());
        assert!(!r.passed(), "{model}");
    }
}

/// The 4-bit base under LoRA computed as x·dequantize(W)ᵀ: the same weights, another
/// matmul, so step 0's loss already differs. (On the 8-bit row this plant changes nothing on
/// the CPU — MLX 0.32.2's 8-bit quantized_matmul there gives x·dequantize(W)ᵀ bit for bit,
/// measured 121/121 — so it is not asked to fail there.)
#[test]
fn planted_dequantized_qlora_base_fails_the_4_bit_row() {
    let defect = Defect::QloraDequantizedBase;
    assert_fails(&TRAIN, QUANTIZED[0], defect, "first failure: step 0 loss");
}

#[test]
fn full_fine_tuning_steps_match_mlx_lm() {
    assert_passes(&TRAIN_FULL, "tiny-llama-trained");
}

/// One block too many made trainable: the trainable set is not mlx-lm's (the gate stops at
/// a gradient mlx-lm has no tensor for). (The LoRA gate's weight-decay plant cannot fail
/// here: in bf16 the decay factor 1 − lr·wd = 1 − 1e-5, ×1.1 or not, rounds to 1.)
#[test]
fn planted_one_block_too_many_fails_the_full_gate() {
    let model = "tiny-llama-trained";
    let plant = Plant::Engine(Defect::FullOneLayerTooMany);
    match TRAIN_FULL.run(model, Some(&plant)) {
        Err(e) => {
            println!("planted FullOneLayerTooMany caught: {e}");
            assert!(e.to_string().contains("model.layers.1."), "{e}");
        }
        Ok(r) => panic!(
            "planted FullOneLayerTooMany passed the check: {}",
            r.summary()
        ),
    }
}
