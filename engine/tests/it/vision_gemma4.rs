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
use engine::model::LanguageModel;
use engine::plant::{self, Defect};
use engine::vision::gemma4::Gemma4Processor;
use engine::vision::gemma4_tower::{Gemma4ImageError, Gemma4Vision};
use engine::vision::{decode, Limits};
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{Array, Dtype};
use serde_json::Value;

use crate::common::{bytes, goldens};

fn model_dir() -> PathBuf {
    goldens().join("models").join("tiny-gemma4-vl")
}

struct Golden {
    json: Value,
    bin: Vec<u8>,
}

impl Golden {
    fn read() -> Self {
        let dir = goldens().join("vision").join("gemma4-l1");
        let json: Value =
            serde_json::from_slice(&std::fs::read(dir.join("gemma4-l1.json")).unwrap()).unwrap();
        let bin = std::fs::read(dir.join(json["tensors_bin"].as_str().unwrap())).unwrap();
        Golden { json, bin }
    }

    /// max |Δ| of `got` against the stored tensor `entry` (shape and dtype must match; NaN
    /// counts as ∞; a nonzero difference is at least the smallest positive f32).
    fn max_delta(&self, entry: &Value, got: &Array) -> f32 {
        let off = entry["offset"].as_u64().unwrap() as usize;
        let raw = &self.bin[off..off + entry["bytes"].as_u64().unwrap() as usize];
        let shape: Vec<i32> = entry["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_i64().unwrap() as i32)
            .collect();
        assert_eq!(got.shape(), shape.as_slice(), "shape");
        let dtype = entry["dtype"].as_str().unwrap();
        let want = match dtype {
            "float32" => Dtype::Float32,
            "bfloat16" => Dtype::Bfloat16,
            d => panic!("dtype {d}"),
        };
        assert_eq!(got.dtype(), want, "dtype");
        let ours = bytes(got);
        if ours == raw {
            return 0.0;
        }
        let vals = |b: &[u8]| -> Vec<f32> {
            match want {
                Dtype::Float32 => b
                    .chunks(4)
                    .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                    .collect(),
                _ => b
                    .chunks(2)
                    .map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16))
                    .collect(),
            }
        };
        vals(&ours)
            .iter()
            .zip(&vals(raw))
            .map(|(x, y)| match (x - y).abs() {
                d if d.is_nan() => f32::INFINITY,
                d => d.max(f32::MIN_POSITIVE),
            })
            .fold(0.0, f32::max)
    }
}

fn u32s(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
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

/// Per prompt: (embeddings, logits) max |Δ| and the greedy ids (`generate::greedy`: the
/// argmax of the bf16 logprobs, first index on a tie, as generate_step takes it).
fn prompt_runs(m: &Gemma4Vision, g: &Golden, px: &[(Array, usize)]) -> Vec<(f32, f32, Vec<u32>)> {
    let greedy = |a: &Array| engine::generate::greedy(a).unwrap();
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
            let dl = g.max_delta(&p["logits"], &logits);
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
fn gemma4_encoder_embedder_and_image_prompts_are_bit_exact_with_mlx_vlm() {
    let g = Golden::read();
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
        assert_eq!(ids, u32s(&p["greedy"]), "{name}: greedy ids");
    }

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
    for (i, (dt, df)) in tower_deltas(&mlx_layout, &g, &px).into_iter().enumerate() {
        assert_eq!((dt, df), (0.0, 0.0), "image {i} (mlx-community layout)");
    }

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
    {
        let _on = plant::on(Defect::Gemma4VisionRopeAxesSwapped).unwrap();
        let d = tower_deltas(&m, &g, &px);
        assert!(
            d.iter().all(|&(dt, df)| dt > 0.0 && df > 0.0),
            "Gemma4VisionRopeAxesSwapped went unnoticed: {d:?}"
        );
    }
    // Planted: no image-block overlay (causal image tokens) — the logits differ wherever
    // an image block has more than one token (every prompt here).
    {
        let _on = plant::on(Defect::Gemma4ImageBlocksCausal).unwrap();
        let runs = prompt_runs(&m, &g, &px);
        assert!(
            runs.iter().all(|(de, dl, _)| *de == 0.0 && *dl > 0.0),
            "Gemma4ImageBlocksCausal went unnoticed: {:?}",
            runs.iter().map(|r| (r.0, r.1)).collect::<Vec<_>>()
        );
    }
    // Planted: the image rows in reverse order — the embeddings and logits differ.
    {
        let _on = plant::on(Defect::Gemma4ImageTokensReversed).unwrap();
        let runs = prompt_runs(&m, &g, &px);
        assert!(
            runs.iter().all(|(de, dl, _)| *de > 0.0 && *dl > 0.0),
            "Gemma4ImageTokensReversed went unnoticed: {:?}",
            runs.iter().map(|r| (r.0, r.1)).collect::<Vec<_>>()
        );
    }
}
