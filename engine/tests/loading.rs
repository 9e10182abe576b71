//! Loading model directories: what loads, and the clear errors for what does not.
//! Run single-threaded (MLX is not thread-safe): `bash scripts/test.sh`.

use std::path::{Path, PathBuf};

use engine::load::config::ModelConfig;
use engine::load::tokenizer::Tokenizer;
use engine::load::weights::Weights;
use engine::load::LoadError;

fn model_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../goldens/models")
        .join(name)
}

/// A scratch copy of a tiny model that a test may break.
fn copy_of(name: &str) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(model_dir(name)).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, tmp.path().join(path.file_name().unwrap())).unwrap();
    }
    tmp
}

fn load_err(dir: &Path) -> String {
    match engine::model::load(dir) {
        Ok(_) => panic!("{} loaded but should not", dir.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn a_model_dir_written_by_mlx_lm_save_loads() {
    // tiny-qwen3 was written by mlx_lm.utils.save_model + save_config (see its provenance):
    // the index file is mlx-lm's, the weights carry {"format": "mlx"} metadata.
    let dir = model_dir("tiny-qwen3");
    assert!(dir.join("model.safetensors.index.json").is_file());
    let model = engine::model::load(&dir).unwrap();
    assert_eq!(model.model_type(), "qwen3");
}

#[test]
fn weights_keep_their_dtype() {
    let mut bf16 = Weights::load(&model_dir("tiny-llama")).unwrap();
    assert_eq!(
        bf16.take("model.norm.weight").unwrap().dtype(),
        mlx_rs::Dtype::Bfloat16
    );
    let mut f32 = Weights::load(&model_dir("tiny-qwen3")).unwrap();
    assert_eq!(
        f32.take("model.norm.weight").unwrap().dtype(),
        mlx_rs::Dtype::Float32
    );
}

#[test]
fn a_foreign_quantization_format_is_refused_clearly() {
    let tmp = copy_of("tiny-llama");
    let path = tmp.path().join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config["quantization_config"] = serde_json::json!({"quant_method": "gptq", "bits": 4});
    std::fs::write(&path, config.to_string()).unwrap();
    let err = load_err(tmp.path());
    assert!(
        err.contains("is not supported") && err.contains("quantization_config"),
        "{err}"
    );
}

#[test]
fn a_corrupt_safetensors_header_is_a_clear_error() {
    let tmp = copy_of("tiny-llama");
    let path = tmp.path().join("model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[8..16].copy_from_slice(b"{garbage"); // JSON header now invalid
    std::fs::write(&path, &bytes).unwrap();
    let err = load_err(tmp.path());
    assert!(
        err.contains("model.safetensors: not a valid safetensors file"),
        "{err}"
    );

    // A header length pointing past the end of the file.
    bytes[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    std::fs::write(&path, &bytes).unwrap();
    let err = load_err(tmp.path());
    assert!(err.contains("not a valid safetensors file"), "{err}");
}

#[test]
fn a_missing_required_field_is_named() {
    let tmp = copy_of("tiny-llama");
    let path = tmp.path().join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config.as_object_mut().unwrap().remove("hidden_size");
    config["some_future_field"] = serde_json::json!(true); // unknown fields are fine
    std::fs::write(&path, config.to_string()).unwrap();
    let err = load_err(tmp.path());
    assert!(
        err.contains("missing field `hidden_size`") && err.contains("config.json"),
        "{err}"
    );
}

#[test]
fn missing_or_mismatched_weights_are_named() {
    let dir = model_dir("tiny-llama");
    let mut config = ModelConfig::read(&dir).unwrap();
    config.raw["num_hidden_layers"] = serde_json::json!(3);
    let err = engine::model::build(&config, Weights::load(&dir).unwrap())
        .err()
        .unwrap();
    assert!(matches!(err, LoadError::Weights(_)), "{err}");
    assert!(
        err.to_string().contains("missing tensor `model.layers.2."),
        "{err}"
    );
}

#[test]
fn an_unknown_architecture_is_refused_clearly() {
    let dir = model_dir("tiny-llama");
    let mut config = ModelConfig::read(&dir).unwrap();
    config.model_type = "mamba".into();
    let err = engine::model::build(&config, Weights::load(&dir).unwrap())
        .err()
        .unwrap();
    assert!(
        err.to_string()
            .contains("model_type `mamba` is not supported yet"),
        "{err}"
    );
}

#[test]
fn streaming_detokenizer_never_emits_half_a_character() {
    let tokenizer = Tokenizer::load(&model_dir("tiny-llama")).unwrap();
    let text = "Mira sagt: grüß dich ✓ — 日本 🤖!";
    let ids = tokenizer.encode(text, false).unwrap();
    assert!(ids.len() > text.chars().count() / 2);
    let mut detok = tokenizer.detokenizer();
    let mut out = String::new();
    let mut held = 0;
    for &id in &ids {
        let piece = detok.push(id).unwrap();
        assert!(
            !piece.contains('\u{FFFD}'),
            "emitted a broken character: {piece:?}"
        );
        held += piece.is_empty() as usize;
        out.push_str(&piece);
    }
    out.push_str(&detok.finish().unwrap());
    assert_eq!(out, text);
    assert!(
        held > 0,
        "multi-byte characters span tokens, so some pushes must hold back"
    );
}

#[test]
fn eos_ids_come_from_tokenizer_and_generation_config() {
    let tokenizer = Tokenizer::load(&model_dir("tiny-llama-trained")).unwrap();
    let end = tokenizer.token_to_id("<|end|>").unwrap();
    let eos = tokenizer.token_to_id("<|eos|>").unwrap();
    assert_eq!(tokenizer.eos_token_ids, vec![end, eos]);
}

#[test]
fn per_module_quantization_is_honoured() {
    use engine::load::config::QuantParams;
    let dir = model_dir("tiny-llama-trained-q4");
    let config = ModelConfig::read(&dir).unwrap();
    let mut w = Weights::load(&dir).unwrap();
    w.set_quantization(config.quantization.clone());
    let q4 = Some(QuantParams {
        group_size: 64,
        bits: 4,
    });
    let q8 = Some(QuantParams {
        group_size: 64,
        bits: 8,
    });
    assert_eq!(
        w.quant_params("model.layers.1.self_attn.q_proj", 128)
            .unwrap(),
        q4
    );
    assert_eq!(w.quant_params("model.embed_tokens", 128).unwrap(), q4);
    assert_eq!(
        w.quant_params("lm_head", 128).unwrap(),
        q8,
        "explicit per-module entry"
    );
    assert_eq!(
        w.quant_params("model.layers.0.mlp.down_proj", 320).unwrap(),
        None,
        "explicit false"
    );
    assert!(
        w.contains("model.layers.0.mlp.down_proj.weight")
            && !w.contains("model.layers.0.mlp.down_proj.scales")
    );
}

#[test]
fn non_affine_quantization_is_refused_clearly() {
    let tmp = copy_of("tiny-qwen3-q8");
    let path = tmp.path().join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config["quantization"]["mode"] = serde_json::json!("mxfp4");
    std::fs::write(&path, config.to_string()).unwrap();
    let err = load_err(tmp.path());
    assert!(
        err.contains("quantization mode `mxfp4`") && err.contains("not supported yet"),
        "{err}"
    );
}
