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
