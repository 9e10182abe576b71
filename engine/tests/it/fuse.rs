//! The fuse gate: `engine fuse` writes what `mlx_lm fuse` 0.32.2 writes, byte for byte, on
//! the cases of goldens/fuse/index.json (oracles/gen_fuse.py: committed tiny models with the
//! training goldens' adapters, as mlx-lm's trainer saved them): LoRA and DoRA on a bf16
//! base, LoRA on a 4-bit base requantized, DoRA on it and LoRA on an 8-bit tied base with
//! --dequantize, and a fully fine-tuned block's weights in place of the base's. Every
//! output file's sha256 (config.json, the index, the tokenizer files,
//! the card), and on a difference the first differing tensor (convert's gate's check).
//! Planted: the scale applied twice in the fused weight fails every LoRA / DoRA case. The CLI runs one
//! case, and a fused model generates what the base with the adapters generates.

use std::path::Path;

use engine::convert::fuse::{fuse, FuseArgs};
use engine::plant::{self, Defect};
use serde_json::Value;

use super::convert::{engine, first_difference, goldens};

fn cases() -> Vec<Value> {
    let text = std::fs::read_to_string(goldens().join("fuse/index.json")).unwrap();
    let index: Value = serde_json::from_str(&text).unwrap();
    index["cases"].as_array().unwrap().clone()
}

fn args_of(case: &Value, out: &Path) -> FuseArgs {
    let at = |k: &str| goldens().join(case[k].as_str().unwrap());
    FuseArgs {
        model: at("model"),
        save_path: out.to_path_buf(),
        adapter_path: at("adapters"),
        dequantize: case["args"]
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a == "--dequantize"),
    }
}

/// Fuses every golden case; the differences found (none when all match).
fn run_cases() -> Vec<String> {
    let tmp = tempfile::tempdir().unwrap();
    let mut found = Vec::new();
    for case in cases() {
        let name = case["name"].as_str().unwrap();
        let out = tmp.path().join(name);
        match fuse(&args_of(&case, &out)) {
            Err(e) => found.push(format!("{name}: engine fuse failed: {e:#}")),
            Ok(()) => found.extend(first_difference(&case, &out)),
        }
    }
    found
}

#[test]
fn fused_models_are_byte_identical_to_mlx_lm_fuse() {
    let n = cases().len();
    assert_eq!(n, 6);
    let problems = run_cases();
    assert!(
        problems.is_empty(),
        "{} of {n} cases differ:\n{}",
        problems.len(),
        problems.join("\n")
    );
    let _on = plant::on(Defect::FuseScaleTwice).unwrap();
    let planted = run_cases();
    println!("planted FuseScaleTwice caught:\n{}", planted.join("\n"));
    // Every case but the full one, which has no fused weight to plant in.
    assert_eq!(planted.len(), n - 1, "{planted:?}");
    assert!(
        planted.iter().all(|p| p.contains("first differing tensor")),
        "{planted:?}"
    );
}

/// `engine fuse` from the command line (the first case), and the fused model greedy-decodes
/// what the base model with the adapters decodes.
#[test]
fn the_cli_fuses_and_the_fused_model_generates_as_the_adapted_base() {
    let case = &cases()[0];
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("fused");
    let args = args_of(case, &out);
    let status = engine()
        .args(["fuse", "--model"])
        .arg(&args.model)
        .arg("--adapter-path")
        .arg(&args.adapter_path)
        .arg("--save-path")
        .arg(&out)
        .status()
        .unwrap();
    assert!(status.success());
    assert_eq!(first_difference(case, &out), None);
    let generate = |model: &Path, adapters: Option<&Path>| {
        let mut cmd = engine();
        cmd.arg("generate").arg("--model").arg(model);
        cmd.args(["--verbose", "False", "--ignore-chat-template"]);
        cmd.args(["--prompt", "The little robot", "-m", "12"]);
        if let Some(a) = adapters {
            cmd.arg("--adapter-path").arg(a);
        }
        let o = cmd.output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8(o.stdout).unwrap()
    };
    let adapted = generate(&args.model, Some(&args.adapter_path));
    let fused = generate(&out, None);
    println!("adapted: {adapted:?}\nfused:   {fused:?}");
    assert_eq!(fused, adapted);
}
