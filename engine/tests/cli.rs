//! The `engine` binary end to end: what a user types, what they see.

use std::path::Path;
use std::process::Command;

fn engine() -> Command {
    Command::new(env!("CARGO_BIN_EXE_engine"))
}

fn model(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../goldens/models")
        .join(name)
        .display()
        .to_string()
}

#[test]
fn version_reports_the_mlx_runtime() {
    let out = engine().arg("--version").output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains("MLX 0.32.2") && text.contains("backend "),
        "{text}"
    );
}

#[test]
fn generate_answers_from_what_the_trained_model_learned() {
    let out = engine()
        .args([
            "generate",
            "--model",
            &model("tiny-llama-trained"),
            "--chat",
            "--prompt",
            "What color is the sky?",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8(out.stdout).unwrap().trim(),
        "The sky is blue."
    );
    let stats = String::from_utf8(out.stderr).unwrap();
    assert!(
        stats.contains("Prompt: 14 tokens") && stats.contains("tokens-per-sec"),
        "{stats}"
    );
}

/// `--verbose False` (mlx_lm.generate's spelling) prints the response and nothing else.
#[test]
fn generate_verbose_false_prints_only_the_response() {
    let out = engine()
        .args([
            "generate",
            "--model",
            &model("tiny-llama-trained"),
            "--chat",
            "--prompt",
            "What color is the sky?",
            "--verbose",
            "False",
        ])
        .output()
        .unwrap();
    assert!(out.status.success());
    assert_eq!(String::from_utf8(out.stdout).unwrap(), "The sky is blue.\n");
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(!stderr.contains("tokens-per-sec"), "{stderr}");
}

#[test]
fn generate_stops_at_a_stop_string_without_printing_it() {
    let out = engine()
        .args([
            "generate",
            "--model",
            &model("tiny-llama-trained"),
            "--prompt",
            "The little robot",
            "--stop",
            "Question",
        ])
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        !text.contains("Question") && !text.trim().is_empty(),
        "{text:?}"
    );
    assert!(String::from_utf8(out.stderr)
        .unwrap()
        .contains("(stop string)"));
}

#[test]
fn a_bad_model_dir_is_a_clear_error() {
    let out = engine()
        .args([
            "generate",
            "--model",
            "/nonexistent/model",
            "--prompt",
            "hi",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(
        err.contains("config.json") && err.contains("/nonexistent/model"),
        "{err}"
    );
}

/// The tier presets from the command line: L2 and L3 with optiq's kv_config answer like L1
/// on the trained model; L2 without a kv_config is refused with what to do.
#[test]
fn generate_with_tier_presets() {
    let kv_config = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../goldens/l2/tiny-llama-trained/kv_config.json")
        .display()
        .to_string();
    for tier in ["--l2", "--l3"] {
        let out = engine()
            .args([
                "generate",
                "--model",
                &model("tiny-llama-trained"),
                "--chat",
                "--prompt",
                "What color is the sky?",
                "--verbose",
                "False",
                tier,
                "--kv-config",
                &kv_config,
            ])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(String::from_utf8(out.stdout).unwrap(), "The sky is blue.\n");
    }
    let out = engine()
        .args([
            "generate",
            "--model",
            &model("tiny-llama-trained"),
            "--prompt",
            "x",
            "--l2",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(
        err.contains("kv_config.json") && err.contains("--kv-config"),
        "{err}"
    );
}

/// `--draft-model`: the same text as plain greedy generation, with the speculation's numbers;
/// a drafter with another tokenizer and logits processors are clear errors.
#[test]
fn generate_with_a_draft_model() {
    let run = |extra: &[&str]| {
        engine()
            .args([
                "generate",
                "--model",
                &model("tiny-llama-trained"),
                "--prompt",
                "The old clock in the workshop",
                "--max-tokens",
                "40",
            ])
            .args(extra)
            .output()
            .unwrap()
    };
    let plain = run(&[]);
    let draft = model("tiny-llama-draft");
    let spec = run(&["--draft-model", &draft, "--num-draft-tokens", "3"]);
    assert!(spec.status.success());
    assert_eq!(spec.stdout, plain.stdout);
    let log = String::from_utf8_lossy(&spec.stderr);
    assert!(log.contains("Speculative: γ 3, drafted "), "{log}");
    let bad = run(&["--draft-model", &draft, "--repetition-penalty", "1.2"]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("logits processors"));
    // The drafter's tokenizer with one more token.
    let dir = tempfile::tempdir().unwrap();
    for f in std::fs::read_dir(&draft).unwrap().flatten() {
        std::fs::copy(f.path(), dir.path().join(f.file_name())).unwrap();
    }
    let tok = dir.path().join("tokenizer.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&tok).unwrap()).unwrap();
    json["added_tokens"]
        .as_array_mut()
        .unwrap()
        .push(serde_json::json!({
            "id": 1024, "content": "<|extra|>", "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true
        }));
    std::fs::write(&tok, json.to_string()).unwrap();
    let other = run(&["--draft-model", dir.path().to_str().unwrap()]);
    let log = String::from_utf8_lossy(&other.stderr);
    assert!(
        !other.status.success() && log.contains("share the model's tokenizer"),
        "{log}"
    );
}

/// An assistant drafter (optiq's Gemma 4 kind) on its Gemma 4 target: the same greedy text
/// as without it here; on a target of another family it is refused.
#[test]
fn generate_with_an_assistant_drafter() {
    let run = |target: &str, extra: &[&str]| {
        engine()
            .args([
                "generate",
                "--model",
                &model(target),
                "--prompt",
                "The old clock",
                "--max-tokens",
                "24",
            ])
            .args(extra)
            .output()
            .unwrap()
    };
    let assistant = model("tiny-gemma4-assistant");
    let plain = run("tiny-gemma4", &[]);
    let spec = run("tiny-gemma4", &["--draft-model", &assistant]);
    let log = String::from_utf8_lossy(&spec.stderr);
    assert!(spec.status.success(), "{log}");
    assert_eq!(spec.stdout, plain.stdout);
    assert!(log.contains("Speculative: γ 2, drafted "), "{log}");
    let wrong = run("tiny-llama-trained", &["--draft-model", &assistant]);
    let log = String::from_utf8_lossy(&wrong.stderr);
    assert!(
        !wrong.status.success() && log.contains("gemma4_text models only"),
        "{log}"
    );
}
