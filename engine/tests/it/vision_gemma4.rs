//! The gemma4 vision gate (issue 41, vision L1): `engine::vision::gemma4_tower` against
//! mlx-vlm 0.7.10 on tiny-gemma4-vl (goldens/models, made with mlx-vlm's own gemma4 classes
//! by oracles/gen_vision_gemma4.py, which also wrote goldens/vision/gemma4-l1).
//!
//! From the image files up: decode → gemma4 preprocess (the model's processor_config.json)
//! → the pixel tensors and soft-token counts equal mlx-vlm's; the encoder's output (clipped
//! linears, 2-D RoPE, pooling, standardization) and the embedded features bit-exact (max |Δ|
//! = 0) for 3 images of 3 sizes; for a 1-image prompt, a 2-image prompt (two sizes: the
//! tower runs them one by one) and the same image twice (one batch) the merged embeddings
//! and the logits of every position over the full vocabulary bit-exact (the image blocks
//! attending within themselves: use_bidirectional_attention "vision"), and 6 greedy ids
//! (mlx-vlm's generate_step) identical. The same model in mlx-community's layout loads to
//! the same tower. Planted defects (the 2-D RoPE's axes swapped, the image rows reversed,
//! no image-block overlay) must fail it, and a prompt with the wrong number of image tokens
//! is refused.

use std::path::PathBuf;

use engine::load::weights::Weights;
use engine::plant::Defect;
use engine::vision::gemma4::Gemma4Processor;
use engine::vision::gemma4_tower::{Gemma4ImageError, Gemma4Vision};
use engine::vision::{decode, Limits};
use mlx_rs::Array;
use serde_json::Value;

use crate::common::goldens;
use crate::common::vision::{
    assert_plant_caught, assert_prompts_bit_exact, assert_towers_bit_exact,
    logits_delta_and_greedy, u32s, Golden,
};

fn model_dir() -> PathBuf {
    goldens().join("models").join("tiny-gemma4-vl")
}

/// The golden images' pixel tensors and soft-token counts, through this engine's decode and
/// gemma4 processor (the model's processor_config.json `image_processor`).
fn pixels(g: &Golden) -> Vec<(Array, usize)> {
    let cfg: Value =
        serde_json::from_slice(&std::fs::read(model_dir().join("processor_config.json")).unwrap())
            .unwrap();
    let proc = Gemma4Processor::from_json(&cfg["image_processor"].to_string()).unwrap();
    g.json["images"]
        .as_array()
        .unwrap()
        .iter()
        .map(|img| {
            let file = goldens().join("vision").join(img["file"].as_str().unwrap());
            let rgb = decode(&std::fs::read(file).unwrap(), &Limits::default()).unwrap();
            let t = proc.preprocess(&rgb).unwrap();
            let shape: Vec<i32> = t.pixels.shape.iter().map(|&s| s as i32).collect();
            (Array::from_slice(&t.pixels.data, &shape), t.tokens)
        })
        .collect()
}

/// Per image: (tower, features) max |Δ|.
fn tower_deltas(m: &Gemma4Vision, g: &Golden, px: &[(Array, usize)]) -> Vec<(f32, f32)> {
    let images = g.json["images"].as_array().unwrap();
    images
        .iter()
        .zip(px)
        .map(|(img, (p, _))| {
            let tower = m.tower_output(std::slice::from_ref(p)).unwrap();
            let feats = m.embed(&tower).unwrap();
            (
                g.max_delta(&img["tower"], &tower),
                g.max_delta(&img["features"], &feats),
            )
        })
        .collect()
}

/// Per prompt: (embeddings, logits) max |Δ| and the greedy ids.
fn prompt_runs(m: &Gemma4Vision, g: &Golden, px: &[(Array, usize)]) -> Vec<(f32, f32, Vec<u32>)> {
    g.json["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            let ids = u32s(&p["ids"]);
            let imgs: Vec<Array> = u32s(&p["images"])
                .iter()
                .map(|&i| px[i as usize].0.clone())
                .collect();
            let merged = m.embed_with_images(&ids, &imgs).unwrap();
            let de = g.max_delta(&p["embeddings"], &merged.embeddings);
            let mut caches = m.make_caches();
            let logits = m.forward_embeddings(&merged, &mut caches).unwrap();
            let (dl, out) = logits_delta_and_greedy(g, p, &m.text, &logits, &mut caches);
            (de, dl, out)
        })
        .collect()
}

#[test]
fn gemma4_encoder_embedder_and_image_prompts_are_bit_exact_with_mlx_vlm() {
    let g = Golden::read("gemma4-l1", "gemma4-l1.json");
    let m = Gemma4Vision::load(&model_dir()).unwrap();
    let px = pixels(&g);

    // The pixel tensors and soft-token counts are mlx-vlm's.
    for (img, (p, tokens)) in g.json["images"].as_array().unwrap().iter().zip(&px) {
        assert_eq!(
            g.max_delta(&img["pixels"], p),
            0.0,
            "{}: pixels",
            img["file"]
        );
        assert_eq!(
            *tokens as u64,
            img["tokens"].as_u64().unwrap(),
            "{}",
            img["file"]
        );
    }
    assert_towers_bit_exact(&tower_deltas(&m, &g, &px), "HF layout");
    assert_prompts_bit_exact(&g, prompt_runs(&m, &g, &px));

    // mlx-community's layout (no `model.` prefix, `language_model.model.…`) loads to the
    // same tower and embedder.
    let tensors = Weights::load(&model_dir()).unwrap().into_tensors();
    let renamed = tensors.into_iter().map(|(n, a)| {
        let n = match n.strip_prefix("model.language_model.") {
            Some(rest) => format!("language_model.model.{rest}"),
            None => n.strip_prefix("model.").unwrap_or(&n).to_owned(),
        };
        (n, a)
    });
    let config = engine::load::config::ModelConfig::read(&model_dir()).unwrap();
    let mlx_layout = Gemma4Vision::from_parts(&config, Weights::from_tensors(renamed)).unwrap();
    assert_towers_bit_exact(&tower_deltas(&mlx_layout, &g, &px), "mlx-community layout");

    // A prompt whose image tokens do not fit the images is refused, naming the counts.
    let err = m
        .embed_with_images(&[5, m.image_token, 6], &[px[0].0.clone()])
        .err()
        .unwrap();
    assert!(
        matches!(
            err,
            Gemma4ImageError::TokenCount {
                tokens: 1,
                images: 1,
                want: 4,
                ..
            }
        ),
        "{err}"
    );

    // Planted: the 2-D RoPE's axes swapped — the tower's output differs on every image
    // (none of them is a square grid of one patch).
    assert_plant_caught(
        Defect::Gemma4VisionRopeAxesSwapped,
        "Gemma4VisionRopeAxesSwapped",
        || tower_deltas(&m, &g, &px),
        |d| d.iter().all(|&(dt, df)| dt > 0.0 && df > 0.0),
    );
    // Planted: no image-block overlay (causal image tokens) — the logits differ wherever
    // an image block has more than one token (every prompt here).
    assert_plant_caught(
        Defect::Gemma4ImageBlocksCausal,
        "Gemma4ImageBlocksCausal",
        || prompt_runs(&m, &g, &px),
        |runs| runs.iter().all(|(de, dl, _)| *de == 0.0 && *dl > 0.0),
    );
    // Planted: the image rows in reverse order — the embeddings and logits differ.
    assert_plant_caught(
        Defect::Gemma4ImageTokensReversed,
        "Gemma4ImageTokensReversed",
        || prompt_runs(&m, &g, &px),
        |runs| runs.iter().all(|(de, dl, _)| *de > 0.0 && *dl > 0.0),
    );
}
