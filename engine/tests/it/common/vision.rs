//! What the vision gates (vision_gemma3, vision_gemma4, vision_qwen3vl, vision_qwen35) share:
//! reading a golden (its JSON and the tensors file it names) and comparing the engine's
//! tensors with the stored ones bit for bit; gemma's prompt check (the logits' max |Δ| and the
//! greedy ids after them) and its assertions; a planted defect's must-be-caught check; and
//! the Qwen-VL image path's checks (the golden images through the processor, the tower's
//! outputs, one prompt's M-RoPE positions, logits and greedy steps, mlx-vlm's
//! `generate_step` followed), written once over the engine's `QwenImageModel` so Qwen3-VL and
//! Qwen3.5 run the same comparison.

use std::path::Path;

use engine::cache::Cache;
use engine::model::LanguageModel;
use engine::plant::{self, Defect};
use engine::vision::qwen_lm::{self, generate_chunks, rope_index, QwenImageModel, QwenMixer};
use engine::vision::qwen_vit::QwenVit;
use engine::vision::qwen_vl::{QwenVlPixels, QwenVlProcessor};
use engine::vision::{decode, Limits};
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{Array, Dtype};
use serde_json::Value;
use sha2::{Digest, Sha256};

use super::{bytes, goldens};

/// A vision golden: its JSON and the bytes of the tensors file it names (`tensors_bin`).
pub struct Golden {
    pub json: Value,
    pub bin: Vec<u8>,
}

impl Golden {
    /// goldens/vision/`dir`/`file` and its tensors.
    pub fn read(dir: &str, file: &str) -> Self {
        let dir = goldens().join("vision").join(dir);
        let json: Value = serde_json::from_slice(&std::fs::read(dir.join(file)).unwrap()).unwrap();
        let bin = std::fs::read(dir.join(json["tensors_bin"].as_str().unwrap())).unwrap();
        Golden { json, bin }
    }

    /// A stored little-endian f32 tensor (`offset`, `len` and `shape` in the entry, as the
    /// Qwen generators write them): its shape and values.
    pub fn f32_tensor(&self, entry: &Value) -> (Vec<i32>, Vec<f32>) {
        let (at, len) = (
            entry["offset"].as_u64().unwrap() as usize,
            entry["len"].as_u64().unwrap() as usize,
        );
        let values = self.bin[at..at + len]
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        (shape_of(entry), values)
    }

    /// How `got` differs from the stored f32 tensor `entry`: None when bit-identical, else the
    /// shapes or the max |Δ| and where.
    pub fn differs(&self, what: &str, got: &Array, entry: &Value) -> Option<String> {
        let (shape, want) = self.f32_tensor(entry);
        let got = got.as_dtype(Dtype::Float32).unwrap();
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

    /// max |Δ| of `got` against the stored tensor `entry` in its own dtype (`offset`, `bytes`,
    /// `shape` and `dtype` in the entry, as the gemma generators write them; shape and dtype
    /// must match; NaN counts as ∞; a nonzero difference is at least the smallest positive
    /// f32, so that any differing bit reads as nonzero).
    pub fn max_delta(&self, entry: &Value, got: &Array) -> f32 {
        let off = entry["offset"].as_u64().unwrap() as usize;
        let raw = &self.bin[off..off + entry["bytes"].as_u64().unwrap() as usize];
        assert_eq!(got.shape(), shape_of(entry).as_slice(), "shape");
        let dtype = match entry["dtype"].as_str().unwrap() {
            "float32" => Dtype::Float32,
            "bfloat16" => Dtype::Bfloat16,
            d => panic!("dtype {d}"),
        };
        assert_eq!(got.dtype(), dtype, "dtype");
        let ours = bytes(got);
        if ours == raw {
            return 0.0;
        }
        let (a, b) = (widened(dtype, &ours), widened(dtype, raw));
        a.iter()
            .zip(&b)
            .map(|(x, y)| match (x - y).abs() {
                d if d.is_nan() => f32::INFINITY,
                d => d.max(f32::MIN_POSITIVE),
            })
            .fold(0.0, f32::max)
    }
}

/// A stored tensor's shape.
fn shape_of(entry: &Value) -> Vec<i32> {
    entry["shape"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_i64().unwrap() as i32)
        .collect()
}

/// Raw little-endian values of `dtype` (f32 or bf16) as f32 (bf16 widened exactly).
fn widened(dtype: Dtype, raw: &[u8]) -> Vec<f32> {
    match dtype {
        Dtype::Float32 => raw
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        _ => raw
            .chunks(2)
            .map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16))
            .collect(),
    }
}

/// A JSON array of ids.
pub fn u32s(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// A gemma prompt's logits (every position) against the golden prompt `p`'s, and the greedy
/// ids after them, as many as `p` holds, decoding through `text` with the prompt's `caches`
/// (`generate::greedy`: the argmax of the logprobs in the logits' dtype, the first index on a
/// tie, as mlx-vlm's generate_step takes it): the logits' max |Δ| and the ids.
pub fn logits_delta_and_greedy(
    g: &Golden,
    p: &Value,
    text: &impl LanguageModel,
    logits: &Array,
    caches: &mut [Box<dyn Cache>],
) -> (f32, Vec<u32>) {
    let dl = g.max_delta(&p["logits"], logits);
    let n = p["greedy"].as_array().unwrap().len();
    let greedy = |a: &Array| engine::generate::greedy(a).unwrap();
    let mut out = vec![greedy(&logits.index((.., -1, ..)))];
    while out.len() < n {
        let step = Array::from_slice(&[*out.last().unwrap()], &[1, 1]);
        let lg = text.forward(&step, caches).unwrap();
        out.push(greedy(&lg.index((.., 0, ..))));
    }
    (dl, out)
}

/// Every image's (tower, features) max |Δ| is 0 (`what`: which model, for the message).
pub fn assert_towers_bit_exact(deltas: &[(f32, f32)], what: &str) {
    for (i, &(dt, df)) in deltas.iter().enumerate() {
        assert_eq!(
            (dt, df),
            (0.0, 0.0),
            "image {i} ({what}): tower / features max |Δ|"
        );
    }
}

/// Each golden prompt's merged embeddings and logits (every position, full vocabulary) are
/// bit-exact and its greedy ids the golden's: `runs` holds per prompt the (embeddings,
/// logits) max |Δ| and the ids.
pub fn assert_prompts_bit_exact(g: &Golden, runs: Vec<(f32, f32, Vec<u32>)>) {
    let prompts = g.json["prompts"].as_array().unwrap();
    assert_eq!(runs.len(), prompts.len());
    for (p, (de, dl, ids)) in prompts.iter().zip(runs) {
        let name = p["name"].as_str().unwrap();
        assert_eq!(de, 0.0, "{name}: merged embeddings max |Δ|");
        assert_eq!(
            dl, 0.0,
            "{name}: logits max |Δ| (every position, full vocabulary)"
        );
        assert_eq!(ids, u32s(&p["greedy"]), "{name}: greedy ids");
    }
}

/// Every golden prompt through the image path, in one forward and as mlx-vlm's
/// `generate_step` runs it: every mismatch ([`prompt_mismatches`], [`generate_mismatches`]).
pub fn all_prompt_mismatches<M: QwenMixer>(
    model: &QwenImageModel<M>,
    g: &Golden,
    imgs: &[QwenVlPixels],
) -> Vec<String> {
    let mut bad = Vec::new();
    for p in g.json["prompts"].as_array().unwrap() {
        bad.extend(prompt_mismatches(model, g, imgs, p));
        bad.extend(generate_mismatches(model, g, imgs, p));
    }
    bad
}

/// With `defect` planted, `run`'s outcome must show it (`caught`); else the panic says
/// `what` went unnoticed, and the outcome.
pub fn assert_plant_caught<T: std::fmt::Debug>(
    defect: Defect,
    what: &str,
    run: impl FnOnce() -> T,
    caught: impl FnOnce(&T) -> bool,
) {
    let _on = plant::on(defect).unwrap();
    let got = run();
    assert!(caught(&got), "{what} went unnoticed: {got:?}");
}

/// Each planted defect of `plants` (the defect, what it breaks, the index of the prompt of
/// `prompts` it is planted on, and a text one of that prompt's mismatches must then hold)
/// is caught by [`prompt_mismatches`].
pub fn assert_prompt_plants_caught<M: QwenMixer>(
    model: &QwenImageModel<M>,
    g: &Golden,
    imgs: &[QwenVlPixels],
    prompts: &[Value],
    plants: &[(Defect, &str, usize, &str)],
) {
    for &(defect, what, i, needle) in plants {
        assert_plant_caught(
            defect,
            what,
            || prompt_mismatches(model, g, imgs, &prompts[i]),
            |bad| mentions(bad, needle),
        );
    }
}

/// Whether one of the mismatches `bad` names `needle`.
pub fn mentions(bad: &[String], needle: &str) -> bool {
    bad.iter().any(|m| m.contains(needle))
}

/// The Qwen golden goldens/vision/`dir`/golden.json, and its images through the engine's
/// decode and the processor of `model_dir` ([`qwen_images`]).
pub fn qwen_golden(dir: &str, model_dir: &Path) -> (Golden, Vec<QwenVlPixels>) {
    let g = Golden::read(dir, "golden.json");
    let imgs = qwen_images(&g, model_dir);
    (g, imgs)
}

/// The golden's images through the engine's decode and the Qwen-VL processor of `model_dir`
/// (its preprocessor_config.json): each one's patches and grid, whose SHA-256 and grid must
/// be the reference processor's.
pub fn qwen_images(g: &Golden, model_dir: &Path) -> Vec<QwenVlPixels> {
    let cfg = std::fs::read_to_string(model_dir.join("preprocessor_config.json")).unwrap();
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
/// grids (the engine's `qwen_lm::patches_of`).
pub fn patches_of(all: &[QwenVlPixels], chosen: &[usize]) -> (Array, Vec<[i32; 3]>) {
    let picked: Vec<QwenVlPixels> = chosen.iter().map(|&i| all[i].clone()).collect();
    qwen_lm::patches_of(&picked).unwrap()
}

/// The tower's outputs on the golden's three images in one call against `want` (its `merged`
/// entry and, where it has them, its `deepstack` entries): every mismatch, named by `what`;
/// the merged features must come out in `dtype`.
pub fn tower_mismatches(
    vit: &QwenVit,
    g: &Golden,
    imgs: &[QwenVlPixels],
    want: &Value,
    dtype: Dtype,
    what: &str,
) -> Vec<String> {
    let (x, grids) = patches_of(imgs, &[0, 1, 2]);
    let out = vit.forward(&x, &grids).unwrap();
    assert_eq!(out.merged.dtype(), dtype, "{what}: merged dtype");
    let mut bad = Vec::new();
    bad.extend(g.differs(&format!("{what} merged"), &out.merged, &want["merged"]));
    let deep = want["deepstack"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default();
    assert_eq!(out.deepstack.len(), deep.len(), "{what}: deepstack count");
    for (i, (got, entry)) in out.deepstack.iter().zip(deep).enumerate() {
        bad.extend(g.differs(&format!("{what} deepstack {i}"), got, entry));
    }
    bad
}

/// The model (its weights in bf16) against the golden's bf16 run: every mismatch of the
/// tower's outputs (in bf16) and of the bf16 prompt (prompt `bf16.prompt.index` with the bf16
/// run's logits, decode steps' logits and greedy ids), and that prompt.
pub fn bf16_mismatches<M: QwenMixer>(
    model: &QwenImageModel<M>,
    g: &Golden,
    imgs: &[QwenVlPixels],
) -> (Vec<String>, Value) {
    let want = &g.json["bf16"];
    let mut bad = tower_mismatches(&model.vit, g, imgs, &want["tower"], Dtype::Bfloat16, "bf16");
    let index = want["prompt"]["index"].as_u64().unwrap() as usize;
    let mut p = g.json["prompts"][index].clone();
    for k in ["logits", "step_logits", "greedy"] {
        p[k] = want["prompt"][k].clone();
    }
    bad.extend(prompt_mismatches(model, g, imgs, &p));
    (bad, p)
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

/// The largest |Δ| between `got` and `want`, where any value differs in its bits.
fn max_delta_if_not_bit_equal(got: &[f32], want: &[f32]) -> Option<f32> {
    let differs = got
        .iter()
        .zip(want)
        .any(|(a, b)| a.to_bits() != b.to_bits());
    differs.then(|| {
        got.iter()
            .zip(want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max)
    })
}

/// A golden prompt's ids, its images' patches and grids, and the name its mismatches go by
/// (`{n}-image {path}`).
fn prompt_inputs(
    imgs: &[QwenVlPixels],
    p: &Value,
    path: &str,
) -> (Vec<u32>, Array, Vec<[i32; 3]>, String) {
    let chosen: Vec<usize> = serde_json::from_value(p["images"].clone()).unwrap();
    let ids: Vec<u32> = serde_json::from_value(p["ids"].clone()).unwrap();
    let (x, grids) = patches_of(imgs, &chosen);
    (ids, x, grids, format!("{}-image {path}", chosen.len()))
}

/// One golden prompt through the image path: every mismatch (M-RoPE positions, rope delta,
/// the prompt's logits at every position, each greedy step's logits and id).
pub fn prompt_mismatches<M: QwenMixer>(
    model: &QwenImageModel<M>,
    g: &Golden,
    imgs: &[QwenVlPixels],
    p: &Value,
) -> Vec<String> {
    let (ids, x, grids, what) = prompt_inputs(imgs, p, "prompt");
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
    let (_, want_steps) = g.f32_tensor(&p["step_logits"]);
    let vocab = logits.shape()[1] as usize;
    let last = logits.index(-1).as_dtype(Dtype::Float32).unwrap();
    let mut y = argmax(last.as_slice::<f32>());
    let mut greedy = vec![y];
    for (s, want) in want_steps.chunks_exact(vocab).enumerate() {
        let step = model.decode(&[y], out.rope_delta, &mut caches).unwrap();
        let row = step.index((0, -1)).as_dtype(Dtype::Float32).unwrap();
        let got = row.as_slice::<f32>();
        if let Some(max) = max_delta_if_not_bit_equal(got, want) {
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
pub fn generate_mismatches<M: QwenMixer>(
    model: &QwenImageModel<M>,
    g: &Golden,
    imgs: &[QwenVlPixels],
    p: &Value,
) -> Vec<String> {
    let (ids, x, grids, what) = prompt_inputs(imgs, p, "generate_step");
    let want = &p["generate"];
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
    let (_, want_lp) = g.f32_tensor(&want["logprobs"]);
    let vocab = out.logits.shape()[2] as usize;
    let mut last = out.logits.index((.., -1, ..));
    let mut got_ids = Vec::new();
    for (s, want) in want_lp.chunks_exact(vocab).enumerate() {
        let lp = last
            .subtract(last.logsumexp_axis(-1, true).unwrap())
            .unwrap()
            .as_dtype(Dtype::Float32)
            .unwrap();
        let got = lp.as_slice::<f32>();
        if let Some(max) = max_delta_if_not_bit_equal(got, want) {
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

/// A copy of the checkpoint in `model_dir` (every file but model.safetensors as it is) whose
/// tensors are `rewrite`'s of each (name, tensor), saved with metadata format `format`.
pub fn rewritten_checkpoint(
    model_dir: &Path,
    format: &str,
    rewrite: impl Fn(String, Array) -> (String, Array),
) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for f in std::fs::read_dir(model_dir).unwrap().flatten() {
        if f.file_name() != "model.safetensors" {
            std::fs::copy(f.path(), dir.path().join(f.file_name())).unwrap();
        }
    }
    let tensors = Array::load_safetensors(model_dir.join("model.safetensors")).unwrap();
    let out: Vec<(String, Array)> = tensors
        .into_iter()
        .map(|(name, a)| rewrite(name, a))
        .collect();
    let meta = std::collections::HashMap::from([("format".to_owned(), format.to_owned())]);
    Array::save_safetensors(out, &meta, dir.path().join("model.safetensors")).unwrap();
    dir
}

/// The fixture's weights and processor config with the generator's overlay over them.
pub fn assembled(model: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let base = super::goldens().join("models").join(model);
    // gemma4's processor reads processor_config.json (the generator's `files`).
    let processor = match model {
        "tiny-gemma4-vl" => "processor_config.json",
        _ => "preprocessor_config.json",
    };
    for f in ["model.safetensors", processor, "generation_config.json"] {
        std::fs::copy(base.join(f), dir.path().join(f)).unwrap();
    }
    for entry in std::fs::read_dir(super::goldens().join("vision/generate").join(model)).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, dir.path().join(p.file_name().unwrap())).unwrap();
    }
    dir
}
