//! The gemma3 vision gate (issue 41, vision L1): `engine::vision::gemma3_tower` against
//! mlx-vlm 0.7.10 on tiny-gemma3-vl (goldens/models, made with mlx-vlm's own gemma3 classes
//! by oracles/gen_vision_gemma3.py, which also wrote goldens/vision/gemma3-l1).
//!
//! From the image files up: decode → gemma3 preprocess (the model's preprocessor_config.json)
//! → the pixel tensors equal mlx-vlm's; the SigLIP tower's output and the projected features
//! bit-exact (max |Δ| = 0) for 3 images; for a 1-image and a 2-image prompt (the latter with
//! a pad id) the merged input embeddings and the logits of every position over the full
//! vocabulary bit-exact, and 6 greedy ids (the argmax of the bf16 logprobs, as generate_step
//! takes it) identical. The same model in mlx-community's layout (channels-last patch conv)
//! gives the same tower output. Planted defects (the post-layernorm's eps, the features one
//! position late) must fail it, and a prompt with the wrong number of image tokens is refused.

use std::path::PathBuf;

use engine::cache::Cache;
use engine::load::weights::Weights;
use engine::plant::Defect;
use engine::vision::gemma3::Gemma3Processor;
use engine::vision::gemma3_tower::{Gemma3Vision, ImageInputError};
use engine::vision::{decode, Limits};
use mlx_rs::Array;

use crate::common::goldens;
use crate::common::vision::{
    assert_plant_caught, assert_prompts_bit_exact, assert_towers_bit_exact,
    logits_delta_and_greedy, u32s, Golden,
};

fn model_dir() -> PathBuf {
    goldens().join("models").join("tiny-gemma3-vl")
}

/// The golden images' pixel tensors, through this engine's decode and gemma3 processor.
fn pixels(g: &Golden) -> Vec<Array> {
    let cfg = std::fs::read_to_string(model_dir().join("preprocessor_config.json")).unwrap();
    let proc = Gemma3Processor::from_json(&cfg).unwrap();
    let images = g.json["images"].as_array().unwrap();
    images
        .iter()
        .map(|img| {
            let file = goldens().join("vision").join(img["file"].as_str().unwrap());
            let rgb = decode(&std::fs::read(file).unwrap(), &Limits::default()).unwrap();
            let t = proc.preprocess(&rgb);
            let shape: Vec<i32> = t.shape.iter().map(|&s| s as i32).collect();
            Array::from_slice(&t.data, &shape)
        })
        .collect()
}

/// Per image: (tower, features) max |Δ|.
fn tower_deltas(m: &Gemma3Vision, g: &Golden, px: &[Array]) -> Vec<(f32, f32)> {
    let images = g.json["images"].as_array().unwrap();
    images
        .iter()
        .zip(px)
        .map(|(img, p)| {
            let tower = m.tower_output(p).unwrap();
            let feats = m.project(&tower).unwrap();
            (
                g.max_delta(&img["tower"], &tower),
                g.max_delta(&img["features"], &feats),
            )
        })
        .collect()
}

/// Per prompt: (embeddings, logits) max |Δ| and the greedy ids.
fn prompt_runs(m: &Gemma3Vision, g: &Golden, px: &[Array]) -> Vec<(f32, f32, Vec<u32>)> {
    let prompts = g.json["prompts"].as_array().unwrap();
    prompts
        .iter()
        .map(|p| {
            let ids = u32s(&p["ids"]);
            let imgs: Vec<Array> = u32s(&p["images"])
                .iter()
                .map(|&i| px[i as usize].clone())
                .collect();
            let emb = m.embed_with_images(&ids, &imgs).unwrap();
            let de = g.max_delta(&p["embeddings"], &emb);
            let mut caches: Vec<Box<dyn Cache>> = m.make_caches();
            let logits = m.forward_embeddings(emb, &mut caches).unwrap();
            let (dl, out) = logits_delta_and_greedy(g, p, &m.text, &logits, &mut caches);
            (de, dl, out)
        })
        .collect()
}

#[test]
fn gemma3_tower_projector_and_image_prompts_are_bit_exact_with_mlx_vlm() {
    let g = Golden::read("gemma3-l1", "gemma3-l1.json");
    let m = Gemma3Vision::load(&model_dir()).unwrap();
    let px = pixels(&g);

    // The pixel tensors are mlx-vlm's (the preprocessing gate's path, at this model's size).
    for (img, p) in g.json["images"].as_array().unwrap().iter().zip(&px) {
        assert_eq!(
            g.max_delta(&img["pixels"], p),
            0.0,
            "{}: pixels",
            img["file"]
        );
    }
    assert_towers_bit_exact(&tower_deltas(&m, &g, &px), "HF layout");
    assert_prompts_bit_exact(&g, prompt_runs(&m, &g, &px));

    // mlx-community's layout (the patch conv channels-last) loads to the same tower.
    let mut tensors = Weights::load(&model_dir()).unwrap().into_tensors();
    let conv = "vision_tower.vision_model.embeddings.patch_embedding.weight";
    let t = tensors[conv].transpose_axes(&[0, 2, 3, 1]).unwrap();
    tensors.insert(conv.to_owned(), t);
    let config = engine::load::config::ModelConfig::read(&model_dir()).unwrap();
    let mlx_layout = Gemma3Vision::from_parts(&config, Weights::from_tensors(tensors)).unwrap();
    assert_towers_bit_exact(&tower_deltas(&mlx_layout, &g, &px), "mlx-community layout");

    // A prompt whose image tokens do not fit the images is refused, naming the counts.
    let ids: Vec<u32> = vec![5, m.image_token, 6];
    let err = m.embed_with_images(&ids, &px[..1]).unwrap_err();
    assert!(
        matches!(
            err,
            ImageInputError::TokenCount {
                tokens: 1,
                images: 1,
                per_image: 4,
                ..
            }
        ),
        "{err}"
    );

    // Planted: the post-layernorm with the layers' eps (1e-6 for 1e-5): a small change
    // that bf16 rounding hides on some images, so the gate must see it on at least one.
    assert_plant_caught(
        Defect::VisionTowerNormOff,
        "VisionTowerNormOff",
        || tower_deltas(&m, &g, &px),
        |d| d.iter().any(|&(dt, _)| dt > 0.0),
    );
    // Planted: the image features one position late — the embeddings and logits differ.
    assert_plant_caught(
        Defect::ImageFeaturesOffByOne,
        "ImageFeaturesOffByOne",
        || prompt_runs(&m, &g, &px),
        |runs| runs.iter().all(|(de, dl, _)| *de > 0.0 && *dl > 0.0),
    );
}
