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

/// A scratch copy's JSON file, to edit and write back.
fn read_json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
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
    let mut config = read_json(&path);
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
    let mut config = read_json(&path);
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

/// Nemotron 3's mixture-of-experts blocks (`E`) load from Hugging Face's per-expert layout
/// (tiny-nemotron-h-moe-grouped: stacked by the sanitize at load) and from mlx-community's
/// stacked, quantized one (tiny-nemotron-h-moe-q4, what `mlx_lm.convert -q` writes): both
/// keep a cache only for their M and * blocks, and list LoRA's targets as mlx-lm's default
/// keys have them: never the router `gate` (mlx-lm's `MoEGate`, not a Linear).
#[test]
fn nemotron_h_moe_blocks_load_from_both_expert_layouts() {
    for name in ["tiny-nemotron-h-moe-grouped", "tiny-nemotron-h-moe-q4"] {
        let model = engine::model::load(&model_dir(name)).unwrap();
        assert_eq!(model.model_type(), "nemotron_h");
        // ME*E-: the Mamba-2 mixer and the attention keep caches, the E and - blocks none.
        assert_eq!(model.make_caches().len(), 2, "{name}");
        let linears = model.linears();
        assert!(!linears.is_empty(), "{name}: no LoRA targets listed");
        assert!(
            linears.iter().all(|(n, _)| !n.ends_with("mixer.gate")),
            "{name}: the router listed as a LoRA target"
        );
    }
}

/// tiny-nemotron-h-moe's dense bf16 expert stacks cannot run on MLX's CPU (gather_mm is
/// float32 only, in mlx-lm as here): refused at load naming the stack, the cause and the way
/// out, not at the first forward.
#[test]
fn nemotron_h_moe_bf16_experts_are_refused_on_the_cpu_naming_gather_mm() {
    if !engine::runtime::default_device().starts_with("cpu") {
        return;
    }
    let err = load_err(&model_dir("tiny-nemotron-h-moe"));
    assert!(
        err.contains("backbone.layers.1.mixer.switch_mlp.fc1.weight")
            && err.contains("gather_mm")
            && err.contains("use float32 or quantized experts"),
        "{err}"
    );
}

/// An `E` block without a field its router needs is refused naming the field (mlx-lm
/// would fail inside its first forward).
#[test]
fn nemotron_h_moe_without_its_router_fields_is_refused_naming_them() {
    for field in ["routed_scaling_factor", "n_group", "num_experts_per_tok"] {
        let tmp = copy_of("tiny-nemotron-h-moe-grouped");
        let path = tmp.path().join("config.json");
        let mut config = read_json(&path);
        config.as_object_mut().unwrap().remove(field);
        std::fs::write(&path, config.to_string()).unwrap();
        let err = load_err(tmp.path());
        assert!(
            err.contains(&format!("the mixture-of-experts blocks `E` need `{field}`")),
            "{field}: {err}"
        );
    }
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
    let q4 = Some(QuantParams::affine(64, 4));
    let q8 = Some(QuantParams::affine(64, 8));
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

/// Each module's mode as mlx-lm's loader finds it: explicit entries from config.json (no
/// `mode`: affine; `null`s: the mode's defaults), the others inferred from the stored
/// tensors (uint8 scales of 4 bits in groups of 32: mxfp4; of 16: nvfp4; 8 bits: mxfp8).
#[test]
fn quantization_modes_are_read_and_inferred_as_mlx_lm_does() {
    use engine::load::config::{QuantMode, QuantParams};
    let params = |name: &str| {
        let dir = model_dir(name);
        let config = ModelConfig::read(&dir).unwrap();
        let mut w = Weights::load(&dir).unwrap();
        w.set_quantization(config.quantization.clone());
        move |path: &str, in_dims: i32| w.quant_params(path, in_dims).unwrap()
    };
    let fp = |group_size, bits, mode| {
        Some(QuantParams {
            group_size,
            bits,
            mode,
        })
    };
    let mixed = params("tiny-llama-mixed-modes");
    assert_eq!(
        mixed("model.layers.0.mlp.gate_proj", 128),
        fp(32, 4, QuantMode::Mxfp4)
    );
    assert_eq!(
        mixed("model.layers.2.mlp.down_proj", 320),
        fp(32, 4, QuantMode::Mxfp4)
    );
    assert_eq!(
        mixed("model.layers.1.self_attn.q_proj", 128),
        Some(QuantParams::affine(64, 8))
    );
    assert_eq!(
        mixed("model.embed_tokens", 128),
        Some(QuantParams::affine(32, 4))
    );
    assert_eq!(mixed("lm_head", 128), fp(32, 8, QuantMode::Mxfp8));
    let nvfp4 = params("tiny-llama-nvfp4");
    assert_eq!(
        nvfp4("model.layers.0.mlp.down_proj", 320),
        fp(16, 4, QuantMode::Nvfp4)
    );
    let mxfp8 = params("tiny-llama-mxfp8");
    assert_eq!(
        mxfp8("model.embed_tokens", 128),
        fp(32, 8, QuantMode::Mxfp8)
    );
    let moe = params("tiny-qwen3-moe-mxfp4");
    assert_eq!(
        moe("model.layers.0.mlp.switch_mlp.down_proj", 32),
        fp(32, 4, QuantMode::Mxfp4)
    );
    assert_eq!(
        moe("model.layers.0.mlp.gate", 64),
        Some(QuantParams::affine(64, 8))
    );
}

/// The modes MLX does not know, and bits or group sizes a mode does not allow, are refused
/// at load with the reason (mxfp4, nvfp4 and mxfp8 load: tests/it/l1_models.rs).
#[test]
fn unknown_quantization_modes_are_refused_clearly() {
    let tmp = copy_of("tiny-qwen3-q8");
    let path = tmp.path().join("config.json");
    let original = read_json(&path);
    let mut config = original.clone();
    config["quantization"]["mode"] = serde_json::json!("mxfp5");
    std::fs::write(&path, config.to_string()).unwrap();
    let err = load_err(tmp.path());
    assert!(err.contains("unknown mode `mxfp5`"), "{err}");
    let mut config = original;
    config["quantization"]["mode"] = serde_json::json!("mxfp4");
    std::fs::write(&path, config.to_string()).unwrap();
    let err = load_err(tmp.path());
    assert!(
        err.contains(
            "mxfp4 quantization requires group size 32 and 4 bits, got group size 32 and 8 bits"
        ),
        "{err}"
    );
}

/// A directory as transformers 5 saves it: the chat template in `chat_template.jinja`, not
/// in tokenizer_config.json. It is read, and it wins over a template left in the config (as
/// transformers reads them). Planted: with the file removed, the copy has no template.
#[test]
fn chat_template_jinja_is_the_template_as_transformers_reads_it() {
    let original = Tokenizer::load(&model_dir("tiny-llama-trained")).unwrap();
    let template = original.chat_template().unwrap().to_owned();
    let tmp = copy_of("tiny-llama-trained");
    let config_path = tmp.path().join("tokenizer_config.json");
    let mut config = read_json(&config_path);
    config.as_object_mut().unwrap().remove("chat_template");
    std::fs::write(&config_path, config.to_string()).unwrap();
    let jinja = tmp.path().join("chat_template.jinja");
    std::fs::write(&jinja, &template).unwrap();
    let t = Tokenizer::load(tmp.path()).unwrap();
    assert_eq!(t.chat_template(), Some(template.as_str()));
    // The file takes priority over a template still in the config.
    config["chat_template"] = "stale {{ messages }}".into();
    std::fs::write(&config_path, config.to_string()).unwrap();
    let t = Tokenizer::load(tmp.path()).unwrap();
    assert_eq!(t.chat_template(), Some(template.as_str()));
    // Planted: without the file, only the stale one is left.
    std::fs::remove_file(&jinja).unwrap();
    let t = Tokenizer::load(tmp.path()).unwrap();
    assert_eq!(t.chat_template(), Some("stale {{ messages }}"));
}

/// tokenizer_config.json may hold a list of named templates; the one named "default" is
/// used (as transformers' `get_chat_template`), `additional_chat_templates/` adds others.
#[test]
fn named_chat_templates_are_read_and_default_is_used() {
    let tmp = copy_of("tiny-llama-trained");
    let config_path = tmp.path().join("tokenizer_config.json");
    let mut config = read_json(&config_path);
    config["chat_template"] = serde_json::json!([
        {"name": "default", "template": "D{{ messages[0].content }}"},
        {"name": "tool_use", "template": "T{{ messages[0].content }}"},
    ]);
    std::fs::write(&config_path, config.to_string()).unwrap();
    let t = Tokenizer::load(tmp.path()).unwrap();
    assert_eq!(t.chat_template(), Some("D{{ messages[0].content }}"));
    let names: Vec<&str> = t.chat_template_names().collect();
    assert_eq!(names, ["default", "tool_use"]);
    // transformers 5's layout: chat_template.jinja plus additional_chat_templates/*.jinja.
    std::fs::write(tmp.path().join("chat_template.jinja"), "J").unwrap();
    std::fs::create_dir(tmp.path().join("additional_chat_templates")).unwrap();
    std::fs::write(tmp.path().join("additional_chat_templates/rag.jinja"), "R").unwrap();
    let t = Tokenizer::load(tmp.path()).unwrap();
    assert_eq!(t.chat_template(), Some("J"));
    assert_eq!(
        t.chat_template_names().collect::<Vec<_>>(),
        ["default", "rag"]
    );
    // A list entry without a template is an error naming the file.
    config["chat_template"] = serde_json::json!([{"name": "default"}]);
    std::fs::remove_file(tmp.path().join("chat_template.jinja")).unwrap();
    std::fs::remove_dir_all(tmp.path().join("additional_chat_templates")).unwrap();
    std::fs::write(&config_path, config.to_string()).unwrap();
    let err = Tokenizer::load(tmp.path()).err().unwrap().to_string();
    assert!(
        err.contains("tokenizer_config.json") && err.contains("\"template\""),
        "{err}"
    );
}

/// Without generation_config.json the EOS ids come from config.json (as mlx-lm's
/// load_config leaves them): Gemma 3 without it must still stop at `<end_of_turn>`.
/// generation_config.json's ids win where both are given. Planted: with neither, only the
/// tokenizer's eos is left.
#[test]
fn eos_ids_come_from_config_json_without_generation_config() {
    let tmp = copy_of("tiny-gemma3");
    let tok_eos = Tokenizer::load(&model_dir("tiny-gemma3")).unwrap();
    let tokenizer_eos = tok_eos
        .token_to_id(tok_eos.eos_token.as_deref().unwrap())
        .unwrap();
    std::fs::remove_file(tmp.path().join("generation_config.json")).unwrap();
    let config_path = tmp.path().join("config.json");
    let mut config = read_json(&config_path);
    config["eos_token_id"] = serde_json::json!([6, 2]);
    std::fs::write(&config_path, config.to_string()).unwrap();
    let mut ids = Tokenizer::load(tmp.path()).unwrap().eos_token_ids;
    ids.sort();
    let mut want = vec![6, 2, tokenizer_eos];
    want.sort();
    want.dedup();
    assert_eq!(ids, want);
    // generation_config.json's eos_token_id wins over config.json's.
    std::fs::write(
        tmp.path().join("generation_config.json"),
        r#"{"eos_token_id": 3}"#,
    )
    .unwrap();
    let mut ids = Tokenizer::load(tmp.path()).unwrap().eos_token_ids;
    ids.sort();
    let mut want = vec![3, tokenizer_eos];
    want.sort();
    want.dedup();
    assert_eq!(ids, want);
    // Planted: neither file names any.
    std::fs::remove_file(tmp.path().join("generation_config.json")).unwrap();
    config.as_object_mut().unwrap().remove("eos_token_id");
    std::fs::write(&config_path, config.to_string()).unwrap();
    assert_eq!(
        Tokenizer::load(tmp.path()).unwrap().eos_token_ids,
        [tokenizer_eos]
    );
}

/// Weights are `model*.safetensors`, as mlx-lm globs them: a mistralai repo's extra
/// `consolidated.safetensors` (the same weights under other names) is not read. Planted:
/// named `model-consolidated.safetensors` it is read, and its unknown tensors are refused.
#[test]
fn only_model_safetensors_files_are_weights() {
    let tmp = copy_of("tiny-llama");
    let mut renamed = std::collections::HashMap::new();
    let mut w = Weights::load(tmp.path()).unwrap();
    for name in ["model.norm.weight", "model.embed_tokens.weight"] {
        renamed.insert(format!("consolidated.{name}"), w.take(name).unwrap());
    }
    drop(w);
    let consolidated = tmp.path().join("consolidated.safetensors");
    mlx_rs::Array::save_safetensors(renamed.iter(), None, &consolidated).unwrap();
    engine::model::load(tmp.path()).unwrap();
    std::fs::rename(
        &consolidated,
        tmp.path().join("model-consolidated.safetensors"),
    )
    .unwrap();
    let err = load_err(tmp.path());
    assert!(err.contains("consolidated."), "{err}");
    // No model*.safetensors at all: the error says which files are read.
    for entry in std::fs::read_dir(tmp.path()).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "safetensors") {
            std::fs::rename(&path, path.with_extension("bin")).unwrap();
        }
    }
    let err = load_err(tmp.path());
    assert!(err.contains("no model*.safetensors files"), "{err}");
}

/// Template features real templates use. `{% generation %}` (transformers' assistant-mask
/// tag) renders its body, whitespace control kept; without the rewrite minijinja refuses
/// the template (planted: the raw source fails to parse). `tools` and `documents` are None,
/// as apply_chat_template passes them: Llama 3.1's `tools is not none` branch stays off.
#[test]
fn generation_tags_and_absent_tools_render_as_in_transformers() {
    use engine::load::template::{ChatTemplate, Message};
    let t = Tokenizer::load(&model_dir("tiny-llama-trained")).unwrap();
    let messages = [Message::new("user", "hi"), Message::new("assistant", "yo")];
    let tagged = "{% for m in messages %}{% if m.role == 'assistant' %}\n  {%- generation -%}\n  [{{ m.content }}]\n  {%- endgeneration %}\n{% else %}<{{ m.content }}>{% endif %}{% endfor %}";
    let plain = "{% for m in messages %}{% if m.role == 'assistant' %}\n  {%- if true -%}\n  [{{ m.content }}]\n  {%- endif %}\n{% else %}<{{ m.content }}>{% endif %}{% endfor %}";
    let render = |src: &str| {
        ChatTemplate::new(src, &t)
            .unwrap()
            .render(&messages, false)
            .unwrap()
    };
    assert_eq!(render(tagged), render(plain));
    assert_eq!(render(tagged), "<hi>[yo]");
    // Planted: minijinja itself does not know the tag.
    let mut env = minijinja::Environment::new();
    assert!(env.add_template("raw", tagged).is_err());
    let tools =
        "{% if tools is not none %}TOOLS{% endif %}{% if documents is none %}none{% endif %}";
    assert_eq!(render(tools), "none");
}

/// Every model_type the registry loads has an L1-gated tiny model in the manifest, or is
/// linked to one that has by mlx-lm's `MODEL_REMAPPING` (`registry::REMAPPED`: the same
/// builder; minimax's tiny model is written as a `minimax_m2` config): "loads" and "matches
/// mlx-lm" are the same list. Prints the count (issue 38's before/after figure).
#[test]
fn every_registered_family_has_an_l1_gated_tiny_model() {
    let manifest = crate::common::manifest();
    let l1_types: std::collections::BTreeSet<&str> = manifest
        .iter()
        .filter(|r| r["gates"].as_array().unwrap().iter().any(|g| g == "l1"))
        .map(|r| r["model_type"].as_str().unwrap())
        .collect();
    let same_module = engine::model::registry::same_module;
    let gated = |t: &str| l1_types.iter().any(|g| same_module(t, g));
    let missing: Vec<_> = engine::model::registry::FAMILIES
        .iter()
        .map(|f| f.model_type)
        .filter(|t| !gated(t))
        .collect();
    assert!(
        missing.is_empty(),
        "families without an L1 model: {missing:?}"
    );
    assert!(!gated("no_such_family"), "the check must be able to fail");
    println!(
        "{} model types load and match mlx-lm 0.32.2 at L1 ({} with tiny models of their own)",
        engine::model::registry::FAMILIES.len(),
        l1_types.len()
    );
}
