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
use engine::model::LanguageModel;
use engine::plant::{self, Defect};
use engine::vision::gemma3::Gemma3Processor;
use engine::vision::gemma3_tower::{Gemma3Vision, ImageInputError};
use engine::vision::{decode, Limits};
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{Array, Dtype};
use serde_json::Value;

use crate::common::{bytes, goldens};

fn model_dir() -> PathBuf {
    goldens().join("models").join("tiny-gemma3-vl")
}

struct Golden {
    json: Value,
    bin: Vec<u8>,
}

impl Golden {
    fn read() -> Self {
        let dir = goldens().join("vision").join("gemma3-l1");
        let json: Value =
            serde_json::from_slice(&std::fs::read(dir.join("gemma3-l1.json")).unwrap()).unwrap();
        let bin = std::fs::read(dir.join(json["tensors_bin"].as_str().unwrap())).unwrap();
        Golden { json, bin }
    }

    /// The stored tensor's shape, dtype and raw little-endian bytes.
    fn tensor(&self, entry: &Value) -> (Vec<i32>, String, &[u8]) {
        let off = entry["offset"].as_u64().unwrap() as usize;
        let len = entry["bytes"].as_u64().unwrap() as usize;
        let shape = entry["shape"].as_array().unwrap();
        let shape = shape.iter().map(|v| v.as_i64().unwrap() as i32).collect();
        (
            shape,
            entry["dtype"].as_str().unwrap().to_owned(),
            &self.bin[off..off + len],
        )
    }
}

/// Raw values as f32 (bf16 widened exactly).
fn values(dtype: &str, raw: &[u8]) -> Vec<f32> {
    match dtype {
        "float32" => raw
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        "bfloat16" => raw
            .chunks(2)
            .map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16))
            .collect(),
        other => panic!("dtype {other}"),
    }
}

/// max |Δ| of `got` against golden `entry` (shape and dtype must match; NaN counts as ∞).
fn max_delta(g: &Golden, entry: &Value, got: &Array) -> f32 {
    let (shape, dtype, raw) = g.tensor(entry);
    assert_eq!(got.shape(), shape.as_slice(), "shape");
    let want_dtype = match dtype.as_str() {
        "float32" => Dtype::Float32,
        "bfloat16" => Dtype::Bfloat16,
        d => panic!("dtype {d}"),
    };
    assert_eq!(got.dtype(), want_dtype, "dtype");
    let ours = bytes(got);
    if ours == raw {
        return 0.0;
    }
    let (a, b) = (values(&dtype, &ours), values(&dtype, raw));
    a.iter()
        .zip(&b)
        .map(|(x, y)| match (x - y).abs() {
            d if d.is_nan() => f32::INFINITY,
            d => d.max(f32::MIN_POSITIVE),
        })
        .fold(0.0, f32::max)
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

/// The engine's greedy pick (`generate::greedy`: the argmax of the logprobs, in the logits'
/// bf16, where near logits can tie and the first index wins, as in mlx-vlm's generate_step).
fn greedy(last: &Array) -> u32 {
    engine::generate::greedy(last).unwrap()
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
                max_delta(g, &img["tower"], &tower),
                max_delta(g, &img["features"], &feats),
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
            let ids: Vec<u32> = p["ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect();
            let which = p["images"].as_array().unwrap();
            let imgs: Vec<Array> = which
                .iter()
                .map(|i| px[i.as_u64().unwrap() as usize].clone())
                .collect();
            let emb = m.embed_with_images(&ids, &imgs).unwrap();
            let de = max_delta(g, &p["embeddings"], &emb);
            let mut caches: Vec<Box<dyn Cache>> = m.make_caches();
            let logits = m.forward_embeddings(emb, &mut caches).unwrap();
            let dl = max_delta(g, &p["logits"], &logits);
            let n = p["greedy"].as_array().unwrap().len();
            let l = ids.len() as i32;
            let mut out = vec![greedy(&logits.index((.., l - 1, ..)))];
            while out.len() < n {
                let step = Array::from_slice(&[*out.last().unwrap()], &[1, 1]);
                let lg = m.text.forward(&step, &mut caches).unwrap();
                out.push(greedy(&lg.index((.., 0, ..))));
            }
            (de, dl, out)
        })
        .collect()
}

#[test]
fn gemma3_tower_projector_and_image_prompts_are_bit_exact_with_mlx_vlm() {
    let g = Golden::read();
    let m = Gemma3Vision::load(&model_dir()).unwrap();
    let px = pixels(&g);

    // The pixel tensors are mlx-vlm's (the preprocessing gate's path, at this model's size).
    for (img, p) in g.json["images"].as_array().unwrap().iter().zip(&px) {
        assert_eq!(
            max_delta(&g, &img["pixels"], p),
            0.0,
            "{}: pixels",
            img["file"]
        );
    }
    for (i, (dt, df)) in tower_deltas(&m, &g, &px).into_iter().enumerate() {
        assert_eq!((dt, df), (0.0, 0.0), "image {i}: tower / features max |Δ|");
    }
    let prompts = g.json["prompts"].as_array().unwrap();
    for (p, (de, dl, ids)) in prompts.iter().zip(prompt_runs(&m, &g, &px)) {
        let name = p["name"].as_str().unwrap();
        assert_eq!(de, 0.0, "{name}: merged embeddings max |Δ|");
        assert_eq!(
            dl, 0.0,
            "{name}: logits max |Δ| (every position, full vocabulary)"
        );
        let want: Vec<u32> = p["greedy"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(ids, want, "{name}: greedy ids");
    }

    // mlx-community's layout (the patch conv channels-last) loads to the same tower.
    let mut tensors = Weights::load(&model_dir()).unwrap().into_tensors();
    let conv = "vision_tower.vision_model.embeddings.patch_embedding.weight";
    let t = tensors[conv].transpose_axes(&[0, 2, 3, 1]).unwrap();
    tensors.insert(conv.to_owned(), t);
    let config = engine::load::config::ModelConfig::read(&model_dir()).unwrap();
    let mlx_layout = Gemma3Vision::from_parts(&config, Weights::from_tensors(tensors)).unwrap();
    for (i, (dt, df)) in tower_deltas(&mlx_layout, &g, &px).into_iter().enumerate() {
        assert_eq!((dt, df), (0.0, 0.0), "image {i} (mlx-community layout)");
    }

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
    {
        let _on = plant::on(Defect::VisionTowerNormOff).unwrap();
        let d = tower_deltas(&m, &g, &px);
        assert!(
            d.iter().any(|&(dt, _)| dt > 0.0),
            "VisionTowerNormOff went unnoticed: {d:?}"
        );
    }
    // Planted: the image features one position late — the embeddings and logits differ.
    {
        let _on = plant::on(Defect::ImageFeaturesOffByOne).unwrap();
        let runs = prompt_runs(&m, &g, &px);
        assert!(
            runs.iter().all(|(de, dl, _)| *de > 0.0 && *dl > 0.0),
            "ImageFeaturesOffByOne went unnoticed: {:?}",
            runs.iter().map(|r| (r.0, r.1)).collect::<Vec<_>>()
        );
    }
}
