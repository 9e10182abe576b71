//! The Qwen3.5 vision gate: `engine::vision::qwen35_lm` (the hybrid language model's image
//! path: gated delta nets and gated M-RoPE attention, fed the tower's features) and the tower
//! (`engine::vision::qwen_vit`, Qwen3-VL's class without deepstack) against mlx-vlm 0.7.10 on
//! the tiny model goldens/models/tiny-qwen3-5-vl (mlx-vlm's own qwen3_5 classes, random
//! weights), with the goldens of goldens/vision/qwen35-l1 (oracles/gen_vision_qwen35.py).
//!
//! Three test images go through the engine's decode and Qwen3-VL processor (their patches'
//! SHA-256 must be the reference's), then through the tower in one call: the merged features
//! must equal mlx-vlm's bit for bit (max |Δ| = 0). Then a 1-image prompt (23 tokens, one
//! delta-net chunk) and a 2-image prompt (72 tokens, two 64-token chunks): the M-RoPE positions
//! and rope delta, the logits at every position (full vocab), 4 greedy decode steps' logits and
//! the greedy ids, and mlx-vlm's `generate_step` (its chunked prefill, each step's
//! log-probabilities and ids) must all be mlx-vlm's, in f32 and in bf16. Planted defects (the
//! chunked scan's inter-chunk decay dropped, the prompt's recurrence run token by token as
//! the text path runs it, the rope delta dropped in decoding) must fail it.

use std::path::PathBuf;

use engine::plant::Defect;
use engine::vision::qwen35_lm::Qwen35ImageModel;
use mlx_rs::Dtype;

use crate::common::goldens;
use crate::common::vision::{
    all_prompt_mismatches, assert_prompt_plants_caught, bf16_mismatches, qwen_golden,
    rewritten_checkpoint, tower_mismatches,
};

fn model_dir() -> PathBuf {
    goldens().join("models").join("tiny-qwen3-5-vl")
}

/// The tower's merged features on three images, the logits of a 1-image and a 2-image prompt
/// (full vocab, every position; the second prompt spans two of the delta net's prefill chunks)
/// and of 4 greedy decode steps after each equal mlx-vlm's bit for bit, the greedy ids match,
/// and so do mlx-vlm's `generate_step` log-probabilities and ids; dropping the chunked scan's
/// inter-chunk decay, running the prompt's recurrence token by token (the text path's), or
/// dropping the rope delta in decoding, is caught.
#[test]
fn qwen3_5_tower_and_image_prompt_logits_and_greedy_ids_are_bit_exact_with_mlx_vlm() {
    let (g, imgs) = qwen_golden("qwen35-l1", &model_dir());
    let model = Qwen35ImageModel::load(&model_dir()).unwrap();
    // No deepstack entries in the golden: qwen3_5's tower has none.
    let mut bad = tower_mismatches(
        &model.vit,
        &g,
        &imgs,
        &g.json["tower"],
        Dtype::Float32,
        "tower",
    );
    bad.extend(all_prompt_mismatches(&model, &g, &imgs));
    let prompts = g.json["prompts"].as_array().unwrap();
    assert!(bad.is_empty(), "{bad:#?}");

    assert_prompt_plants_caught(
        &model,
        &g,
        &imgs,
        prompts,
        &[
            // The state out of the last chunk is what the decode steps read.
            (
                Defect::Qwen35ChunkDecayDropped,
                "the dropped inter-chunk decay",
                1,
                "2-image prompt decode step 0",
            ),
            (
                Defect::Qwen35PrefillSequential,
                "the sequential prefill recurrence",
                0,
                "prompt logits",
            ),
            (
                Defect::Qwen35DeltaDropped,
                "the dropped rope delta",
                0,
                "decode step 0",
            ),
        ],
    );
}

/// The tiny checkpoint with every tensor cast to bf16 (a bf16 checkpoint of the same weights,
/// as the generator writes one for mlx-vlm to load).
fn bf16_copy() -> tempfile::TempDir {
    rewritten_checkpoint(&model_dir(), "pt", |n, a| {
        (n, a.as_dtype(Dtype::Bfloat16).unwrap())
    })
}

/// The weights in bf16 (as the released checkpoints are): the tower's output and the 2-image
/// prompt's logits (two delta-net chunks), decode steps (mlx-vlm's bf16 depthwise decode
/// conv) and greedy ids equal mlx-vlm's in bf16 bit for bit; the dropped inter-chunk decay is
/// caught here too.
#[test]
fn qwen3_5_in_bf16_is_bit_exact_with_mlx_vlm() {
    let (g, imgs) = qwen_golden("qwen35-l1", &model_dir());
    let dir = bf16_copy();
    let model = Qwen35ImageModel::load(dir.path()).unwrap();
    let (bad, p) = bf16_mismatches(&model, &g, &imgs);
    assert!(bad.is_empty(), "{bad:#?}");

    assert_prompt_plants_caught(
        &model,
        &g,
        &imgs,
        std::slice::from_ref(&p),
        &[(
            Defect::Qwen35ChunkDecayDropped,
            "the dropped inter-chunk decay",
            0,
            "decode step 0",
        )],
    );
}
