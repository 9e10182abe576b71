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

use engine::plant::{self, Defect};
use engine::vision::qwen35_lm::Qwen35ImageModel;
use engine::vision::qwen3vl_lm::{self, generate_chunks, rope_index};
use engine::vision::qwen_vl::{QwenVlPixels, QwenVlProcessor};
use engine::vision::{decode, Limits};
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::common::goldens;

fn model_dir() -> PathBuf {
    goldens().join("models").join("tiny-qwen3-5-vl")
}

struct Golden {
    json: Value,
    bin: Vec<u8>,
}

fn golden() -> Golden {
    let dir = goldens().join("vision").join("qwen35-l1");
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

/// The golden's images through the engine's decode and processor: each one's patches and
/// grid.
fn images(g: &Golden) -> Vec<QwenVlPixels> {
    let cfg = std::fs::read_to_string(model_dir().join("preprocessor_config.json")).unwrap();
    let proc = QwenVlProcessor::from_json(&cfg).unwrap();
    let mut out = Vec::new();
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
        assert_eq!(
            serde_json::to_value(p.grid_thw).unwrap(),
            img["grid_thw"],
            "{file}"
        );
        out.push(p);
    }
    out
}

/// The patches of images `chosen` (indices into the golden's images) in one tensor, and their
/// grids (the engine's `qwen3vl_lm::patches_of`).
fn patches_of(all: &[QwenVlPixels], chosen: &[usize]) -> (Array, Vec<[i32; 3]>) {
    let picked: Vec<QwenVlPixels> = chosen.iter().map(|&i| all[i].clone()).collect();
    qwen3vl_lm::patches_of(&picked).unwrap()
}

/// The first index of the largest value (`mx.argmax`).
fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in row.iter().enumerate() {
        if *v > row[best] {
            best = i;
        }
    }
    best as u32
}

/// One golden prompt through the image path: every mismatch (M-RoPE positions, rope delta,
/// the prompt's logits at every position, each greedy step's logits and id).
fn prompt_mismatches(
    model: &Qwen35ImageModel,
    g: &Golden,
    imgs: &[QwenVlPixels],
    p: &Value,
) -> Vec<String> {
    let chosen: Vec<usize> = serde_json::from_value(p["images"].clone()).unwrap();
    let ids: Vec<u32> = serde_json::from_value(p["ids"].clone()).unwrap();
    let what = format!("{}-image prompt", chosen.len());
    let (x, grids) = patches_of(imgs, &chosen);
    let mut bad = Vec::new();
    let (rows, delta) = rope_index(&ids, &grids, model.ids, 2).unwrap();
    if serde_json::to_value(&rows).unwrap() != p["position_ids"]
        || Some(delta as i64) != p["rope_delta"].as_i64()
    {
        bad.push(format!(
            "{what}: M-RoPE positions / delta {delta} differ from get_rope_index's"
        ));
    }
    let mut caches = model.make_caches();
    let out = model.prefill(&ids, &x, &grids, &mut caches).unwrap();
    assert_eq!(out.rope_delta, delta);
    let logits = out.logits.index(0);
    bad.extend(g.differs(&format!("{what} logits"), &logits, &p["logits"]));
    let (_, want_steps) = g.tensor(&p["step_logits"]);
    let vocab = logits.shape()[1] as usize;
    let last = logits.index(-1).as_dtype(mlx_rs::Dtype::Float32).unwrap();
    let mut y = argmax(last.as_slice::<f32>());
    let mut greedy = vec![y];
    for (s, want) in want_steps.chunks_exact(vocab).enumerate() {
        let step = model.decode(&[y], out.rope_delta, &mut caches).unwrap();
        let row = step
            .index((0, -1))
            .as_dtype(mlx_rs::Dtype::Float32)
            .unwrap();
        let got = row.as_slice::<f32>();
        if got
            .iter()
            .zip(want)
            .any(|(a, b)| a.to_bits() != b.to_bits())
        {
            let max = got
                .iter()
                .zip(want)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            bad.push(format!(
                "{what} decode step {s}: logits differ, max |Δ| {max}"
            ));
        }
        y = argmax(got);
        greedy.push(y);
    }
    let want_greedy: Vec<u32> = serde_json::from_value(p["greedy"].clone()).unwrap();
    if greedy != want_greedy {
        bad.push(format!(
            "{what}: greedy ids {greedy:?}, mlx-vlm's {want_greedy:?}"
        ));
    }
    bad
}

/// mlx-vlm's `generate_step` on one golden prompt, followed: the prompt prefilled in its
/// chunks (all but the last token, then the last), then decode steps; every mismatch of the
/// chunking, each step's log-probabilities (`logits − logsumexp`) and the ids.
fn generate_mismatches(
    model: &Qwen35ImageModel,
    g: &Golden,
    imgs: &[QwenVlPixels],
    p: &Value,
) -> Vec<String> {
    let chosen: Vec<usize> = serde_json::from_value(p["images"].clone()).unwrap();
    let ids: Vec<u32> = serde_json::from_value(p["ids"].clone()).unwrap();
    let what = format!("{}-image generate_step", chosen.len());
    let want = &p["generate"];
    let (x, grids) = patches_of(imgs, &chosen);
    let ends = generate_chunks(ids.len(), 2048);
    let mut lens = vec![ends[0]];
    lens.extend(ends.windows(2).map(|w| w[1] - w[0]));
    let calls: Vec<usize> = serde_json::from_value(want["calls"].clone()).unwrap();
    let mut bad = Vec::new();
    if calls[..lens.len()] != lens[..] {
        bad.push(format!(
            "{what}: prefill chunks {lens:?}, mlx-vlm's calls {calls:?}"
        ));
    }
    let mut caches = model.make_caches();
    let out = model
        .prefill_in_chunks(&ids, &x, &grids, &mut caches, &ends)
        .unwrap();
    let (_, want_lp) = g.tensor(&want["logprobs"]);
    let vocab = out.logits.shape()[2] as usize;
    let mut last = out.logits.index((.., -1, ..));
    let mut got_ids = Vec::new();
    for (s, want) in want_lp.chunks_exact(vocab).enumerate() {
        let lp = last
            .subtract(last.logsumexp_axis(-1, true).unwrap())
            .unwrap()
            .as_dtype(mlx_rs::Dtype::Float32)
            .unwrap();
        let got = lp.as_slice::<f32>();
        if got
            .iter()
            .zip(want)
            .any(|(a, b)| a.to_bits() != b.to_bits())
        {
            let max = got
                .iter()
                .zip(want)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            bad.push(format!(
                "{what} step {s}: log-probabilities differ, max |Δ| {max}"
            ));
        }
        let y = argmax(got);
        got_ids.push(y);
        if s + 1 < want_lp.len() / vocab {
            last = model
                .decode(&[y], out.rope_delta, &mut caches)
                .unwrap()
                .index((.., -1, ..));
        }
    }
    let want_ids: Vec<u32> = serde_json::from_value(want["ids"].clone()).unwrap();
    if got_ids != want_ids {
        bad.push(format!("{what}: ids {got_ids:?}, mlx-vlm's {want_ids:?}"));
    }
    bad
}

/// The tower's merged features on three images, the logits of a 1-image and a 2-image prompt
/// (full vocab, every position; the second prompt spans two of the delta net's prefill chunks)
/// and of 4 greedy decode steps after each equal mlx-vlm's bit for bit, the greedy ids match,
/// and so do mlx-vlm's `generate_step` log-probabilities and ids; dropping the chunked scan's
/// inter-chunk decay, running the prompt's recurrence token by token (the text path's), or
/// dropping the rope delta in decoding, is caught.
#[test]
fn qwen3_5_tower_and_image_prompt_logits_and_greedy_ids_are_bit_exact_with_mlx_vlm() {
    let g = golden();
    let imgs = images(&g);
    let model = Qwen35ImageModel::load(&model_dir()).unwrap();
    let (x, grids) = patches_of(&imgs, &[0, 1, 2]);
    let out = model.vit.forward(&x, &grids).unwrap();
    assert!(out.deepstack.is_empty(), "qwen3_5's tower has no deepstack");
    let mut bad = Vec::new();
    bad.extend(g.differs("tower merged", &out.merged, &g.json["tower"]["merged"]));
    let prompts = g.json["prompts"].as_array().unwrap();
    for p in prompts {
        bad.extend(prompt_mismatches(&model, &g, &imgs, p));
        bad.extend(generate_mismatches(&model, &g, &imgs, p));
    }
    assert!(bad.is_empty(), "{bad:#?}");

    {
        let _on = plant::on(Defect::Qwen35ChunkDecayDropped).unwrap();
        // The state out of the last chunk is what the decode steps read.
        let bad = prompt_mismatches(&model, &g, &imgs, &prompts[1]);
        assert!(
            bad.iter()
                .any(|m| m.contains("2-image prompt decode step 0")),
            "the dropped inter-chunk decay went unnoticed: {bad:?}"
        );
    }
    {
        let _on = plant::on(Defect::Qwen35PrefillSequential).unwrap();
        let bad = prompt_mismatches(&model, &g, &imgs, &prompts[0]);
        assert!(
            bad.iter().any(|m| m.contains("prompt logits")),
            "the sequential prefill recurrence went unnoticed: {bad:?}"
        );
    }
    let _on = plant::on(Defect::Qwen35DeltaDropped).unwrap();
    let bad = prompt_mismatches(&model, &g, &imgs, &prompts[0]);
    assert!(
        bad.iter().any(|m| m.contains("decode step 0")),
        "the dropped rope delta went unnoticed: {bad:?}"
    );
}

/// The tiny checkpoint with every tensor cast to bf16 (a bf16 checkpoint of the same weights,
/// as the generator writes one for mlx-vlm to load).
fn bf16_copy() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for f in std::fs::read_dir(model_dir()).unwrap().flatten() {
        if f.file_name() != "model.safetensors" {
            std::fs::copy(f.path(), dir.path().join(f.file_name())).unwrap();
        }
    }
    let tensors = Array::load_safetensors(model_dir().join("model.safetensors")).unwrap();
    let cast: Vec<(String, Array)> = tensors
        .into_iter()
        .map(|(n, a)| (n, a.as_dtype(mlx_rs::Dtype::Bfloat16).unwrap()))
        .collect();
    let meta = std::collections::HashMap::from([("format".to_owned(), "pt".to_owned())]);
    Array::save_safetensors(cast, &meta, dir.path().join("model.safetensors")).unwrap();
    dir
}

/// The weights in bf16 (as the released checkpoints are): the tower's output and the 2-image
/// prompt's logits (two delta-net chunks), decode steps (mlx-vlm's bf16 depthwise decode
/// conv) and greedy ids equal mlx-vlm's in bf16 bit for bit; the dropped inter-chunk decay is
/// caught here too.
#[test]
fn qwen3_5_in_bf16_is_bit_exact_with_mlx_vlm() {
    let g = golden();
    let imgs = images(&g);
    let dir = bf16_copy();
    let model = Qwen35ImageModel::load(dir.path()).unwrap();
    let want = &g.json["bf16"];
    let (x, grids) = patches_of(&imgs, &[0, 1, 2]);
    let out = model.vit.forward(&x, &grids).unwrap();
    assert_eq!(out.merged.dtype(), mlx_rs::Dtype::Bfloat16);
    let mut bad = Vec::new();
    bad.extend(g.differs("bf16 merged", &out.merged, &want["tower"]["merged"]));
    let index = want["prompt"]["index"].as_u64().unwrap() as usize;
    let mut p = g.json["prompts"][index].clone();
    for k in ["logits", "step_logits", "greedy"] {
        p[k] = want["prompt"][k].clone();
    }
    bad.extend(prompt_mismatches(&model, &g, &imgs, &p));
    assert!(bad.is_empty(), "{bad:#?}");

    let _on = plant::on(Defect::Qwen35ChunkDecayDropped).unwrap();
    let bad = prompt_mismatches(&model, &g, &imgs, &p);
    assert!(
        bad.iter().any(|m| m.contains("decode step 0")),
        "the dropped inter-chunk decay went unnoticed in bf16: {bad:?}"
    );
}
