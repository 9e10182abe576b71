//! The Qwen3-VL vision gate: `engine::vision::qwen_vit` (the tower) against mlx-vlm 0.7.10 on
//! the tiny model goldens/models/tiny-qwen3-vl-vision (mlx-vlm's own classes, random weights),
//! with the goldens of goldens/vision/qwen3vl-l1 (oracles/gen_vision_qwen3vl.py).
//!
//! Three test images (non-square, square, a large JPEG downscaled) go through the engine's
//! decode and Qwen3-VL processor (their patches' SHA-256 must be the reference's), then
//! through the tower in one call: the merged features and both deepstack features must equal
//! mlx-vlm's bit for bit (max |Δ| = 0), from the checkpoint's Hugging Face layout and from the
//! same tensors in mlx-community's layout. A planted defect (the ViT's 2-D rotary with the
//! row and column swapped) must fail it.

use std::path::PathBuf;

use engine::plant::{self, Defect};
use engine::vision::qwen_vit::QwenVit;
use engine::vision::qwen_vl::QwenVlProcessor;
use engine::vision::{decode, Limits};
use mlx_rs::Array;
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::common::goldens;

fn model_dir() -> PathBuf {
    goldens().join("models").join("tiny-qwen3-vl-vision")
}

struct Golden {
    json: Value,
    bin: Vec<u8>,
}

fn golden() -> Golden {
    let dir = goldens().join("vision").join("qwen3vl-l1");
    let json: Value =
        serde_json::from_slice(&std::fs::read(dir.join("golden.json")).unwrap()).unwrap();
    let bin = std::fs::read(dir.join(json["tensors_bin"].as_str().unwrap())).unwrap();
    Golden { json, bin }
}

impl Golden {
    /// A stored tensor: its shape and values.
    fn tensor(&self, entry: &Value) -> (Vec<i32>, Vec<f32>) {
        let shape = entry["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_i64().unwrap() as i32)
            .collect();
        let (at, len) = (
            entry["offset"].as_u64().unwrap() as usize,
            entry["len"].as_u64().unwrap() as usize,
        );
        let values = self.bin[at..at + len]
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        (shape, values)
    }

    /// How `got` differs from the stored tensor `entry`: None when bit-identical, else the
    /// shapes or the max |Δ| and where.
    fn differs(&self, what: &str, got: &Array, entry: &Value) -> Option<String> {
        let (shape, want) = self.tensor(entry);
        let got = got.as_dtype(mlx_rs::Dtype::Float32).unwrap();
        if got.shape() != shape.as_slice() {
            return Some(format!(
                "{what}: shape {:?}, reference {shape:?}",
                got.shape()
            ));
        }
        let got = got.as_slice::<f32>();
        let mut worst = (0f32, 0usize);
        let mut differing = 0;
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            if a.to_bits() != b.to_bits() {
                differing += 1;
                let d = (a - b).abs();
                if d > worst.0 || d.is_nan() {
                    worst = (d, i);
                }
            }
        }
        (differing > 0).then(|| {
            format!(
                "{what}: {differing} of {} values differ, max |Δ| {} at {}",
                want.len(),
                worst.0,
                worst.1
            )
        })
    }
}

/// The golden's images through the engine's decode and processor: the patches of all of
/// them in order, and their grids.
fn patches(g: &Golden) -> (Array, Vec<[i32; 3]>) {
    let cfg = std::fs::read_to_string(model_dir().join("preprocessor_config.json")).unwrap();
    let proc = QwenVlProcessor::from_json(&cfg).unwrap();
    let mut data = Vec::new();
    let mut grids = Vec::new();
    for img in g.json["images"].as_array().unwrap() {
        let file = img["file"].as_str().unwrap();
        let bytes = std::fs::read(goldens().join("vision").join(file)).unwrap();
        let p = proc
            .preprocess(&decode(&bytes, &Limits::default()).unwrap())
            .unwrap();
        assert_eq!(
            format!("{:x}", Sha256::digest(p.pixels.le_bytes())),
            img["patches_sha256"].as_str().unwrap(),
            "{file}: the patches differ from mlx-vlm's processor's"
        );
        let grid = p.grid_thw.map(|v| v as i32);
        assert_eq!(
            serde_json::to_value(grid).unwrap(),
            img["grid_thw"],
            "{file}"
        );
        data.extend_from_slice(&p.pixels.data);
        grids.push(grid);
    }
    let row = 3 * 2 * 16 * 16;
    let n = (data.len() / row) as i32;
    (Array::from_slice(&data, &[n, row as i32]), grids)
}

/// The tower's outputs against the golden's: every mismatch.
fn tower_mismatches(vit: &QwenVit, g: &Golden, what: &str) -> Vec<String> {
    let (x, grids) = patches(g);
    let out = vit.forward(&x, &grids).unwrap();
    let want = &g.json["tower"];
    let mut bad = Vec::new();
    bad.extend(g.differs(&format!("{what} merged"), &out.merged, &want["merged"]));
    let deep = want["deepstack"].as_array().unwrap();
    assert_eq!(out.deepstack.len(), deep.len(), "{what}: deepstack count");
    for (i, (got, entry)) in out.deepstack.iter().zip(deep).enumerate() {
        bad.extend(g.differs(&format!("{what} deepstack {i}"), got, entry));
    }
    bad
}

/// The tiny checkpoint rewritten in mlx-community's layout (`vision_tower.…` with the Conv3d
/// kernel in MLX's `[out, T, P, P, C]`, `language_model.model.…`, `language_model.lm_head`).
pub fn mlx_layout_copy() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for f in std::fs::read_dir(model_dir()).unwrap().flatten() {
        if f.file_name() != "model.safetensors" {
            std::fs::copy(f.path(), dir.path().join(f.file_name())).unwrap();
        }
    }
    let tensors = Array::load_safetensors(model_dir().join("model.safetensors")).unwrap();
    let renamed: Vec<(String, Array)> = tensors
        .into_iter()
        .map(|(name, a)| {
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
        .collect();
    let meta = std::collections::HashMap::from([("format".to_owned(), "mlx".to_owned())]);
    Array::save_safetensors(renamed, &meta, dir.path().join("model.safetensors")).unwrap();
    dir
}

/// The tower's merged and deepstack features equal mlx-vlm's bit for bit on three images in
/// one call, loaded from both layouts; the swapped 2-D rotary is caught.
#[test]
fn qwen3_vl_tower_output_is_bit_exact_with_mlx_vlm_from_both_layouts() {
    let g = golden();
    let vit = QwenVit::load(&model_dir()).unwrap();
    let bad = tower_mismatches(&vit, &g, "HF layout");
    assert!(bad.is_empty(), "{bad:#?}");

    let mlx = mlx_layout_copy();
    let vit_mlx = QwenVit::load(mlx.path()).unwrap();
    let bad = tower_mismatches(&vit_mlx, &g, "mlx layout");
    assert!(bad.is_empty(), "{bad:#?}");

    let _on = plant::on(Defect::VisionRopeAxesSwapped).unwrap();
    let bad = tower_mismatches(&vit, &g, "planted");
    assert!(
        bad.iter().any(|m| m.contains("merged")),
        "the swapped vision rotary went unnoticed"
    );
}
