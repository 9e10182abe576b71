//! `engine train` on the families LoRA gained for issue 21 (their steps are gated against
//! mlx-lm's trainer in tests/train_lora.rs): phi3, the gemma3 / gemma4 wrappers and the MoE
//! families train from the CLI with mlx-lm's default keys, save adapters under mlx-lm's
//! names (the wrappers' under `language_model.`, the experts' as [experts, …] stacks), and
//! `generate --adapter-path` loads them; `--segment-size` is refused on them before anything
//! is written.

mod common;

use std::path::Path;
use std::process::{Command, Output};

use common::goldens;

fn engine(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_engine"))
        .args(args)
        .env_remove("RUST_BACKTRACE")
        .output()
        .unwrap()
}

/// `engine train` of `model` on the chat data, 2 iterations, adapters to `out`.
fn train(model: &str, out: &Path, extra: &[&str]) -> Output {
    let model_dir = goldens().join("models").join(model);
    let data = goldens().join("data/sft-chat");
    let mut args = vec![
        "train",
        "--quiet",
        "--model",
        model_dir.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--iters",
        "2",
        "--adapter-path",
        out.to_str().unwrap(),
    ];
    args.extend(extra);
    engine(&args)
}

/// The saved adapters' names and shapes.
fn saved(out: &Path) -> Vec<(String, Vec<i32>)> {
    let tensors = mlx_rs::Array::load_safetensors(out.join("adapters.safetensors")).unwrap();
    let mut all: Vec<_> = tensors
        .iter()
        .map(|(k, a)| (k.clone(), a.shape().to_vec()))
        .collect();
    all.sort();
    all
}

#[test]
fn new_families_train_save_mlx_lm_names_and_generate() {
    let dir = tempfile::tempdir().unwrap();
    // (model, a name its adapters must have with its lora_a shape)
    let cases: [(&str, &str, &[i32]); 6] = [
        (
            "tiny-phi3",
            "model.layers.1.self_attn.qkv_proj.lora_a",
            &[64, 8],
        ),
        (
            "tiny-gemma3-mm",
            "language_model.model.layers.3.mlp.down_proj.lora_a",
            &[128, 8],
        ),
        (
            "tiny-gemma4-mm",
            "language_model.model.layers.5.per_layer_projection.lora_a",
            &[16, 8],
        ),
        (
            "tiny-qwen3-moe",
            "model.layers.3.mlp.switch_mlp.down_proj.lora_a",
            &[8, 8, 32],
        ),
        (
            "tiny-mixtral",
            "model.layers.1.block_sparse_moe.switch_mlp.gate_proj.lora_a",
            &[8, 8, 64],
        ),
        (
            "tiny-qwen2-moe",
            "model.layers.1.mlp.shared_expert_gate.lora_a",
            &[64, 8],
        ),
    ];
    for (model, name, shape) in cases {
        let out = dir.path().join(model);
        let trained = train(model, &out, &[]);
        assert!(
            trained.status.success(),
            "{model}: {}",
            String::from_utf8_lossy(&trained.stderr)
        );
        let names = saved(&out);
        assert!(
            names.iter().any(|(n, s)| n == name && s == shape),
            "{model}: no {name} {shape:?} among {names:?}"
        );
        let generated = engine(&[
            "generate",
            "--model",
            goldens().join("models").join(model).to_str().unwrap(),
            "--adapter-path",
            out.to_str().unwrap(),
            "--ignore-chat-template",
            "--prompt",
            "The old clock",
            "--max-tokens",
            "4",
        ]);
        assert!(
            generated.status.success(),
            "{model}: {}",
            String::from_utf8_lossy(&generated.stderr)
        );
    }
}

#[test]
fn segment_size_is_refused_on_the_new_families() {
    let dir = tempfile::tempdir().unwrap();
    for model in ["tiny-gemma3-mm", "tiny-qwen3-moe", "tiny-phi3"] {
        let out = dir.path().join(model);
        let refused = train(model, &out, &["--segment-size", "1"]);
        let err = String::from_utf8_lossy(&refused.stderr);
        assert!(!refused.status.success(), "{model}");
        assert!(
            err.contains("--segment-size is not available for model_type"),
            "{model}: {err}"
        );
        assert!(!out.exists(), "a refused run wrote {}", out.display());
    }
}
