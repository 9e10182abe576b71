//! `engine train --fine-tune-type dora | full` from the command line (their math is gated
//! against mlx-lm's trainer in tests/it/train_dora.rs): each trains, saves what mlx-lm
//! saves, trains the same tensors with segmented backward, and `engine generate
//! --adapter-path` loads the result; DoRA adapters fuse (`engine fuse`).

use std::path::Path;
use std::process::Command;

use super::common::goldens;
use super::train::engine_train;

/// 3 SFT steps of `kind` on the chat set; the saved tensors.
fn train(kind: &str, out: &Path, extra: &[&str]) -> Vec<u8> {
    let layers = if kind == "full" { "1" } else { "3" };
    let mut args = vec![
        "--fine-tune-type",
        kind,
        "--iters",
        "3",
        "--batch-size",
        "2",
    ];
    args.extend(["--learning-rate", "1e-3", "--num-layers", layers]);
    args.extend(["--lora-rank", "4"]);
    args.extend(extra);
    let run = engine_train(&goldens().join("data/sft-chat"), out, &args);
    assert!(
        run.status.success(),
        "{kind}: {}",
        String::from_utf8_lossy(&run.stderr)
    );
    std::fs::read(out.join("adapters.safetensors")).unwrap()
}

fn generate(model: &Path, adapters: Option<&Path>) -> String {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_engine"));
    cmd.arg("generate").arg("--model").arg(model);
    cmd.args(["--verbose", "False", "--ignore-chat-template"]);
    cmd.args(["--prompt", "The little robot", "-m", "8"]);
    if let Some(a) = adapters {
        cmd.arg("--adapter-path").arg(a);
    }
    let o = cmd.output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout).unwrap()
}

#[test]
fn dora_and_full_train_segment_load_and_fuse_from_the_cli() {
    let dir = tempfile::tempdir().unwrap();
    let model = goldens().join("models/tiny-llama-trained");
    for kind in ["dora", "full"] {
        let out = dir.path().join(kind);
        let whole = train(kind, &out, &[]);
        let seg = train(
            kind,
            &dir.path().join(format!("{kind}-seg")),
            &["--segment-size", "1"],
        );
        assert_eq!(
            whole, seg,
            "{kind}: segmented backward trains other tensors"
        );
        let config: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(out.join("adapter_config.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(config["fine_tune_type"], kind);
        let names: Vec<String> = mlx_rs::Array::load_safetensors(out.join("adapters.safetensors"))
            .unwrap()
            .into_keys()
            .collect();
        let want = match kind {
            "dora" => ".m",
            _ => "model.layers.2.input_layernorm.weight",
        };
        assert!(names.iter().any(|n| n.ends_with(want)), "{kind}: {names:?}");
        if kind == "full" {
            assert!(
                names.iter().all(|n| n.starts_with("model.layers.2.")),
                "{names:?}"
            );
        }
        println!("{kind}: {:?}", generate(&model, Some(&out)));
    }
    let fused = dir.path().join("fused");
    let status = Command::new(env!("CARGO_BIN_EXE_engine"))
        .args(["fuse", "--model"])
        .arg(&model)
        .arg("--adapter-path")
        .arg(dir.path().join("dora"))
        .arg("--save-path")
        .arg(&fused)
        .status()
        .unwrap();
    assert!(status.success());
    println!("fused dora: {:?}", generate(&fused, None));
}
