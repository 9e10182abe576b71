//! The Qwen3-VL vision gate: `engine::vision::qwen_vit` (the tower) and
//! `engine::vision::qwen3vl_lm` (the image path of the language model) against mlx-vlm
//! 0.7.10 on the tiny model goldens/models/tiny-qwen3-vl-vision (mlx-vlm's own classes, random
//! weights), with the goldens of goldens/vision/qwen3vl-l1 (oracles/gen_vision_qwen3vl.py).
//!
//! Three test images (non-square, square, a large JPEG downscaled) go through the engine's
//! decode and Qwen3-VL processor (their patches' SHA-256 must be the reference's), then
//! through the tower in one call: the merged features and both deepstack features must equal
//! mlx-vlm's bit for bit (max |Δ| = 0), from the checkpoint's Hugging Face layout and from the
//! same tensors in mlx-community's layout. Then a 1-image and a 2-image prompt: the M-RoPE
//! positions and rope delta, the logits at every position (full vocab), 4 greedy decode steps'
//! logits and the greedy ids must all be mlx-vlm's. Planted defects (the ViT's 2-D rotary with
//! row and column swapped, deepstack skipped, the rope delta dropped in decoding) must fail it.

use std::path::PathBuf;

use engine::plant::Defect;
use engine::vision::qwen3vl_lm::Qwen3VlImageModel;
use engine::vision::qwen_vit::QwenVit;
use engine::vision::qwen_vl::QwenVlPixels;
use mlx_rs::Dtype;

use crate::common::goldens;
use crate::common::vision::{
    all_prompt_mismatches, assert_plant_caught, assert_prompt_plants_caught, bf16_mismatches,
    mentions, patches_of, prompt_mismatches, qwen_golden, rewritten_checkpoint, tower_mismatches,
    Golden,
};

fn model_dir() -> PathBuf {
    goldens().join("models").join("tiny-qwen3-vl-vision")
}

/// The tower's f32 outputs against the golden's: every mismatch, named by `what`.
fn f32_tower_mismatches(
    vit: &QwenVit,
    g: &Golden,
    imgs: &[QwenVlPixels],
    what: &str,
) -> Vec<String> {
    tower_mismatches(vit, g, imgs, &g.json["tower"], Dtype::Float32, what)
}

/// The tiny checkpoint rewritten in mlx-community's layout (`vision_tower.…` with the Conv3d
/// kernel in MLX's `[out, T, P, P, C]`, `language_model.model.…`, `language_model.lm_head`).
fn mlx_layout_copy() -> tempfile::TempDir {
    rewritten(true, None)
}

/// The tiny checkpoint rewritten: in mlx-community's layout (`mlx`), every tensor cast to
/// `dtype` (a bf16 checkpoint of the same weights).
fn rewritten(mlx: bool, dtype: Option<Dtype>) -> tempfile::TempDir {
    rewritten_checkpoint(&model_dir(), "mlx", |name, a| {
        let a = match dtype {
            Some(d) => a.as_dtype(d).unwrap(),
            None => a,
        };
        if !mlx {
            return (name, a);
        }
        if let Some(rest) = name.strip_prefix("model.visual.") {
            let a = match rest == "patch_embed.proj.weight" {
                true => a.transpose_axes(&[0, 2, 3, 4, 1]).unwrap(),
                false => a,
            };
            (format!("vision_tower.{rest}"), a)
        } else if let Some(rest) = name.strip_prefix("model.language_model.") {
            (format!("language_model.model.{rest}"), a)
        } else {
            assert_eq!(name, "lm_head.weight");
            ("language_model.lm_head.weight".into(), a)
        }
    })
}

/// The tower's merged and deepstack features equal mlx-vlm's bit for bit on three images in
/// one call, loaded from both layouts; the swapped 2-D rotary is caught.
#[test]
fn qwen3_vl_tower_output_is_bit_exact_with_mlx_vlm_from_both_layouts() {
    let (g, imgs) = qwen_golden("qwen3vl-l1", &model_dir());
    let vit = QwenVit::load(&model_dir()).unwrap();
    let bad = f32_tower_mismatches(&vit, &g, &imgs, "HF layout");
    assert!(bad.is_empty(), "{bad:#?}");

    let mlx = mlx_layout_copy();
    let vit_mlx = QwenVit::load(mlx.path()).unwrap();
    let bad = f32_tower_mismatches(&vit_mlx, &g, &imgs, "mlx layout");
    assert!(bad.is_empty(), "{bad:#?}");

    // Patches that do not fit the grids are refused, naming both.
    let (x, _) = patches_of(&imgs, &[0]);
    let err = vit.forward(&x, &[[1, 4, 4]]).err().unwrap().to_string();
    assert!(
        err.contains("[24, 1536]") && err.contains("[16, 1536]"),
        "{err}"
    );

    assert_plant_caught(
        Defect::VisionRopeAxesSwapped,
        "the swapped vision rotary",
        || f32_tower_mismatches(&vit, &g, &imgs, "planted"),
        |bad| mentions(bad, "merged"),
    );
}

/// The logits of a 1-image and a 2-image prompt (full vocab, every position) and of 4
/// greedy decode steps after each equal mlx-vlm's bit for bit, and the greedy ids match; so
/// do mlx-vlm's `generate_step` log-probabilities and ids (its chunked prefill); from
/// mlx-community's layout too; skipping deepstack, or the rope delta in decoding, is caught.
#[test]
fn qwen3_vl_image_prompt_logits_and_greedy_ids_are_bit_exact_with_mlx_vlm() {
    let (g, imgs) = qwen_golden("qwen3vl-l1", &model_dir());
    let prompts = g.json["prompts"].as_array().unwrap();
    let model = Qwen3VlImageModel::load(&model_dir()).unwrap();
    let bad = all_prompt_mismatches(&model, &g, &imgs);
    assert!(bad.is_empty(), "{bad:#?}");

    let mlx = mlx_layout_copy();
    let model_mlx = Qwen3VlImageModel::load(mlx.path()).unwrap();
    let bad = prompt_mismatches(&model_mlx, &g, &imgs, &prompts[0]);
    assert!(bad.is_empty(), "mlx layout: {bad:#?}");

    assert_prompt_plants_caught(
        &model,
        &g,
        &imgs,
        prompts,
        &[
            (
                Defect::DeepstackSkipped,
                "skipped deepstack",
                0,
                "prompt logits",
            ),
            (
                Defect::MropeDeltaDropped,
                "the dropped rope delta",
                1,
                "decode step 0",
            ),
        ],
    );
}

/// The weights in bf16 (as the released checkpoints are): the tower's outputs and the
/// 1-image prompt's logits, decode steps and greedy ids equal mlx-vlm's in bf16 bit for bit.
#[test]
fn qwen3_vl_in_bf16_is_bit_exact_with_mlx_vlm() {
    let (g, imgs) = qwen_golden("qwen3vl-l1", &model_dir());
    let dir = rewritten(false, Some(Dtype::Bfloat16));
    let model = Qwen3VlImageModel::load(dir.path()).unwrap();
    let (bad, _) = bf16_mismatches(&model, &g, &imgs);
    assert!(bad.is_empty(), "{bad:#?}");
}
