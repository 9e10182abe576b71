//! Helpers shared by the engine's integration tests (each test binary uses a subset).
#![allow(dead_code)]

pub mod lane;
pub mod server;
pub mod train;
pub mod vision;

use std::path::{Path, PathBuf};

use engine::generate::sampler::{Sampler, SamplingParams};
use engine::generate::{generate_in, Flow, Session};

/// One tiny model per hybrid family (recurrent states beside or instead of attention):
/// qwen3_5 and its MoE, qwen3_next (gated delta nets), lfm2 and its MoE (short conv),
/// mamba2, nemotron_h, granitemoehybrid (Mamba-2); and nemotron_h with Nemotron 3's `E`
/// blocks (mixtures of experts with no cache of their own, beside Mamba-2 states and K/V).
pub const HYBRIDS: [&str; 9] = [
    "tiny-qwen3-5",
    "tiny-qwen3-5-moe",
    "tiny-qwen3-next",
    "tiny-lfm2",
    "tiny-lfm2-moe",
    "tiny-mamba2",
    "tiny-nemotron-h",
    "tiny-granite-h",
    "tiny-nemotron-h-moe-q4",
];

/// The hybrids whose layers keep a `CacheList` (falcon_h1: a Mamba-2 state beside K/V in
/// every layer, mlx-lm's `CacheList(ArraysCache(2), KVCache())`). Apart from `HYBRIDS`
/// because the caches' gates treat a list apart (LoRA and segmented backward take falcon_h1
/// through the train gate's manifest rows, engine/tests/it/segmented.rs).
pub const LIST_HYBRIDS: [&str; 1] = ["tiny-falcon-h1"];

/// The committed goldens directory.
pub fn goldens() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../goldens")
}

/// The rows of the tiny models' manifest (goldens/models/manifest.json).
pub fn manifest() -> Vec<serde_json::Value> {
    let path = goldens().join("models").join("manifest.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The cases of `model`'s L1 golden: each case's name and prompt ids.
pub fn l1_cases(model: &str) -> Vec<(String, Vec<u32>)> {
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(goldens().join(format!("l1/{model}/index.json"))).unwrap(),
    )
    .unwrap();
    index["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["name"].as_str().unwrap().to_owned(),
                serde_json::from_value(c["prompt_ids"].clone()).unwrap(),
            )
        })
        .collect()
}

/// A committed tiny model with its config's `sliding_window` set to `window` (same
/// weights), loaded from a copy (the directory is returned: the model outlives no file).
pub fn with_sliding_window(
    name: &str,
    window: usize,
) -> (tempfile::TempDir, Box<dyn engine::model::LanguageModel>) {
    let dir = tempfile::tempdir().unwrap();
    for f in std::fs::read_dir(goldens().join("models").join(name))
        .unwrap()
        .flatten()
    {
        std::fs::copy(f.path(), dir.path().join(f.file_name())).unwrap();
    }
    let cfg = dir.path().join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
    config["sliding_window"] = window.into();
    // A wrapper's text model reads its own (gemma3n's `text_config`).
    if let Some(text) = config
        .get_mut("text_config")
        .and_then(|t| t.as_object_mut())
    {
        text.insert("sliding_window".into(), window.into());
    }
    std::fs::write(&cfg, config.to_string()).unwrap();
    let model = engine::model::load(dir.path()).unwrap();
    (dir, model)
}

/// A committed tiny model.
pub fn model(name: &str) -> Box<dyn engine::model::LanguageModel> {
    engine::model::load(&goldens().join("models").join(name)).unwrap()
}

/// A committed model's directory.
pub fn committed(name: &str) -> std::path::PathBuf {
    goldens().join("models").join(name)
}

/// `name` converted to float32 (same weights, upcast) under `tmp`; an f32 model as it is.
pub fn f32_copy(name: &str, tmp: &std::path::Path) -> std::path::PathBuf {
    if model(name).activation_dtype() == mlx_rs::Dtype::Float32 {
        return committed(name);
    }
    let out = tmp.join(name);
    let mut args = engine::convert::ConvertArgs::new(committed(name), &out);
    args.dtype = Some("float32".into());
    engine::convert::convert(&args).unwrap();
    out
}

/// An SSD-store identity of tiny-llama-trained with config fingerprint `fp`.
pub fn ssd_identity(fp: &str) -> engine::cache::kvstore::Identity {
    engine::cache::kvstore::Identity {
        model_id: "tiny-llama-trained".into(),
        config_fingerprint: fp.into(),
        ns: String::new(),
        tokenizer_hash: "t".into(),
    }
}

/// Greedy generation of `n` ids in `session` (whose caches hold `prompt[..cached]`);
/// returns the ids and each step's log-probabilities as f32.
pub fn greedy_run(
    session: &mut Session,
    prompt: &[u32],
    cached: usize,
    n: usize,
) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut sampler = Sampler::new(SamplingParams::default()).unwrap();
    let (mut ids, mut lps) = (Vec::new(), Vec::new());
    generate_in(session, prompt, cached, n, &[], &mut sampler, |id, lp| {
        ids.push(id);
        let lp = lp.as_dtype(mlx_rs::Dtype::Float32)?;
        lp.eval()?;
        lps.push(lp.as_slice::<f32>().to_vec());
        Ok(Flow::Continue)
    })
    .unwrap();
    (ids, lps)
}

/// An array's row-major bytes.
pub fn bytes(a: &mlx_rs::Array) -> Vec<u8> {
    let v = a.reshape(&[-1]).unwrap().view::<u8>().unwrap();
    v.eval().unwrap();
    v.as_slice::<u8>().to_vec()
}

/// A JSON Schema dumped from an official client's types (goldens/serve/NAME, whose
/// provenance names the `client` package it came from), as a validator.
pub fn client_schema(name: &str, client: &str) -> jsonschema::Validator {
    let path = goldens().join("serve").join(name);
    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert!(
        s["x-provenance"][client].is_string(),
        "{name}: no provenance"
    );
    jsonschema::validator_for(&s).unwrap()
}

/// `doc` against a client schema: Err says which document (`what`) and why.
pub fn client_valid(
    v: &jsonschema::Validator,
    doc: &serde_json::Value,
    what: &str,
    client: &str,
) -> Result<(), String> {
    v.validate(doc)
        .map_err(|e| format!("{what} does not validate against the {client} schema: {e}\n{doc}"))
}
