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
            "--ignore-chat-template",
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

/// Every seconds flag of `engine serve` refuses what no clock can wait (`inf`, `1e300`, NaN,
/// a negative) when the command line is read, naming the flag and the range: before, a huge
/// finite value panicked in `Duration` after the model loaded.
#[test]
fn serve_seconds_flags_refuse_what_no_clock_can_wait() {
    let flags = [
        "--stall-timeout",
        "--request-timeout",
        "--drain-timeout",
        "--sse-keep-alive",
        "--budget-wait",
        "--model-ttl",
        "--load-timeout",
    ];
    let tiny = model("tiny-llama");
    for flag in flags {
        for value in ["inf", "1e300", "NaN", "-1"] {
            let out = engine()
                .args(["serve", "--model", &tiny, "--port", "0"])
                .arg(format!("{flag}={value}"))
                .output()
                .unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{flag}={value}: {err}");
            assert!(
                err.contains(flag) && err.contains("ten years"),
                "{flag}={value}: {err}"
            );
        }
    }
}

/// A model with a recurrent state (lfm2's short convolutions) drafts like any other: as
/// target with a draft model, as the draft model, and with prompt lookup, `engine generate`
/// prints the text plain decoding prints (the states roll back by checkpoint; the gate is
/// engine/tests/it/spec_hybrid.rs).
#[test]
fn speculation_over_a_recurrent_state_prints_the_plain_text() {
    let run = |extra: &[&str]| {
        let mut args = vec![
            "generate",
            "--prompt",
            "The little robot",
            "--max-tokens",
            "24",
            "--verbose",
            "false",
        ];
        args.extend_from_slice(extra);
        let out = engine().args(&args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{extra:?}: {err}");
        out.stdout
    };
    let (lfm2, draft, llama) = (
        model("tiny-lfm2"),
        model("tiny-llama-draft"),
        model("tiny-llama-trained"),
    );
    let plain_lfm2 = run(&["--model", &lfm2]);
    let plain_llama = run(&["--model", &llama]);
    let cases: [(Vec<&str>, &Vec<u8>); 3] = [
        (vec!["--model", &lfm2, "--draft-model", &draft], &plain_lfm2),
        (
            vec!["--model", &llama, "--draft-model", &lfm2],
            &plain_llama,
        ),
        (
            vec!["--model", &lfm2, "--prompt-lookup-num-tokens", "3"],
            &plain_lfm2,
        ),
    ];
    for (extra, plain) in cases {
        assert_eq!(
            &run(&extra),
            plain,
            "{extra:?}: not the text plain decoding prints"
        );
    }
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
                "--ignore-chat-template",
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
    assert!(String::from_utf8_lossy(&bad.stderr).contains("penalties"));
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
                "--ignore-chat-template",
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
        !wrong.status.success() && log.contains("drafts for Gemma 4 models only"),
        "{log}"
    );
}

/// goldens/cli: what mlx_lm.generate printed for each case (oracles/gen_cli.py).
fn cli_golden() -> serde_json::Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../goldens/cli/index.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; make it with `oracles/.venv/bin/python oracles/gen_cli.py --out \
             goldens/cli`",
            path.display()
        )
    });
    serde_json::from_str(&text).unwrap()
}

/// The golden's derived model dirs, rebuilt from its recipe as gen_cli.py builds them:
/// `kwargs` (the template in chat_template.jinja behind a prefix that prints
/// enable_thinking and persona) and `thinking` (plus `<think>`/`</think>` tokens).
fn derived_models(golden: &serde_json::Value, root: &Path) {
    let recipe = &golden["derived"];
    let base = model(recipe["base"].as_str().unwrap());
    for (name, think) in [("kwargs", false), ("thinking", true)] {
        let dir = root.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        for f in std::fs::read_dir(&base).unwrap().flatten() {
            std::fs::copy(f.path(), dir.join(f.file_name())).unwrap();
        }
        let read = |f: &str| -> serde_json::Value {
            serde_json::from_str(&std::fs::read_to_string(dir.join(f)).unwrap()).unwrap()
        };
        let mut config = read("tokenizer_config.json");
        let template = config.as_object_mut().unwrap().remove("chat_template");
        let prefix = recipe["template_prefix"].as_str().unwrap();
        let jinja = format!("{prefix}{}", template.unwrap().as_str().unwrap());
        std::fs::write(dir.join("chat_template.jinja"), jinja).unwrap();
        std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
        if think {
            let mut tok = read("tokenizer.json");
            for t in recipe["think_tokens"].as_array().unwrap() {
                tok["added_tokens"]
                    .as_array_mut()
                    .unwrap()
                    .push(serde_json::json!({
                        "id": t[0], "content": t[1], "single_word": false, "lstrip": false,
                        "rstrip": false, "normalized": false, "special": false
                    }));
            }
            std::fs::write(dir.join("tokenizer.json"), tok.to_string()).unwrap();
        }
    }
}

/// Runs one golden case through `engine generate` (its args, then `extra`); a mismatch with
/// what mlx_lm.generate printed (response text, prompt token count) is described.
fn run_cli_case(case: &serde_json::Value, derived: &Path, extra: &[&str]) -> Result<(), String> {
    let name = case["model"].as_str().unwrap();
    let dir = match name {
        "kwargs" | "thinking" => derived.join(name).display().to_string(),
        _ => model(name),
    };
    let args: Vec<&str> = case["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    let mut child = engine()
        .args(["generate", "--model", &dir])
        .args(&args)
        .args(extra)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stdin = case["stdin"].as_str().unwrap_or("").to_owned();
    let mut pipe = child.stdin.take().unwrap();
    std::io::Write::write_all(&mut pipe, stdin.as_bytes()).unwrap();
    drop(pipe);
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        return Err(format!("failed: {stderr}"));
    }
    let want_text = format!("{}\n", case["text"].as_str().unwrap());
    let text = String::from_utf8_lossy(&out.stdout);
    let tokens = format!("Prompt: {} tokens,", case["prompt_tokens"]);
    match (text == want_text, stderr.contains(&tokens)) {
        (true, true) => Ok(()),
        (false, _) => Err(format!("text {text:?}, mlx_lm.generate {want_text:?}")),
        (true, false) => Err(format!("{stderr}: mlx_lm.generate has `{tokens}`")),
    }
}

/// The CLI gate: every goldens/cli case (default chat template, --ignore-chat-template,
/// --system-prompt, --prefill-response, -m, `\n` in the prompt, `--prompt -`,
/// --extra-eos-token, --chat-template-config reaching the template, the enable_thinking
/// default, Qwen3 and Gemma 3 templates) prints the response mlx_lm.generate printed, from a
/// prompt of the same number of tokens.
#[test]
fn generate_prints_what_mlx_lm_generate_prints() {
    let golden = cli_golden();
    let derived = tempfile::tempdir().unwrap();
    derived_models(&golden, derived.path());
    let cases = golden["cases"].as_array().unwrap();
    let failures: Vec<String> = cases
        .iter()
        .filter_map(|c| {
            run_cli_case(c, derived.path(), &[])
                .err()
                .map(|e| format!("{}: {e}", c["name"]))
        })
        .collect();
    eprintln!(
        "cli gate: {}/{} cases identical to mlx_lm.generate",
        cases.len() - failures.len(),
        cases.len()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(cases.len() >= 14);
}

/// The gate's planted half: invocations that drop what a case is about (the default
/// template, the system prompt, the template kwargs, the enable_thinking default) print
/// something else, and the comparison says so.
#[test]
fn the_cli_gate_fails_on_perturbed_invocations() {
    let golden = cli_golden();
    let derived = tempfile::tempdir().unwrap();
    derived_models(&golden, derived.path());
    let case = |name: &str| {
        golden["cases"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == name)
            .unwrap()
            .clone()
    };
    let without = |name: &str, flag: &str| {
        let mut c = case(name);
        let args = c["args"].as_array_mut().unwrap();
        let at = args.iter().position(|a| a == flag).unwrap();
        args.drain(at..at + 2);
        c
    };
    let perturbed = [
        (case("default-chat"), vec!["--ignore-chat-template"]),
        (without("system-prompt", "--system-prompt"), vec![]),
        (without("kwargs-config", "--chat-template-config"), vec![]),
        (
            case("thinking-default"),
            vec!["--chat-template-config", r#"{"enable_thinking": false}"#],
        ),
        (
            without("thinking-config-off", "--chat-template-config"),
            vec![],
        ),
        (without("extra-eos-token", "--extra-eos-token"), vec![]),
    ];
    for (i, (c, extra)) in perturbed.iter().enumerate() {
        let got = run_cli_case(c, derived.path(), extra);
        assert!(
            got.is_err(),
            "perturbation {i} ({}) still matched",
            c["name"]
        );
    }
}

/// `--chat` is redundant now (the template is the default) and `--system` spells
/// `--system-prompt`: the same prompt and text either way.
#[test]
fn chat_and_system_keep_working() {
    let run = |args: &[&str]| {
        let out = engine()
            .args(["generate", "--model", &model("tiny-llama-trained")])
            .args(["--prompt", "What color is the sky?"])
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success());
        let stderr = String::from_utf8(out.stderr).unwrap();
        let prompt = stderr.lines().find(|l| l.starts_with("Prompt: ")).unwrap();
        let tokens = prompt.split(',').next().unwrap().to_owned();
        (String::from_utf8(out.stdout).unwrap(), tokens)
    };
    let plain = run(&[]);
    assert_eq!(plain.1, "Prompt: 14 tokens");
    assert_eq!(run(&["--chat"]), plain);
    let system = run(&["--system-prompt", "You answer in one sentence."]);
    assert_eq!(
        run(&["--chat", "--system", "You answer in one sentence."]),
        system
    );
    assert_ne!(system, plain);
    assert_ne!(run(&["--ignore-chat-template"]), plain);
}

/// Bad `--chat-template-config` values, `--chat` with `--ignore-chat-template`, `--chat` on a
/// model without a template, and an unknown --extra-eos-token: exact messages.
#[test]
fn chat_flag_errors_are_exact() {
    let err = |model_dir: &str, args: &[&str]| {
        let out = engine()
            .args(["generate", "--model", model_dir, "--prompt", "hi"])
            .args(args)
            .env_remove("RUST_BACKTRACE")
            .env_remove("RUST_LIB_BACKTRACE")
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?}");
        String::from_utf8(out.stderr).unwrap()
    };
    let m = model("tiny-llama-trained");
    let example = "give a JSON object of template arguments, e.g. '{\"enable_thinking\": false}'";
    assert_eq!(
        err(&m, &["--chat-template-config", "{enable_thinking: false}"]),
        format!(
            "Error: --chat-template-config: invalid JSON (key must be a string at line 1 \
             column 2); {example}\n"
        )
    );
    assert_eq!(
        err(&m, &["--chat-template-config", "[true]"]),
        format!("Error: --chat-template-config: [true] is not a JSON object; {example}\n")
    );
    assert_eq!(
        err(
            &m,
            &[
                "--chat-template-config",
                r#"{"add_generation_prompt": false}"#
            ]
        ),
        "Error: --chat-template-config: `add_generation_prompt` is set by `engine generate` \
         itself (as by mlx_lm.generate); drop it\n"
    );
    assert_eq!(
        err(&m, &["--extra-eos-token", "<|nope|>"]),
        "Error: --extra-eos-token: '<|nope|>' is not a token for this tokenizer\n"
    );
    let both = err(&m, &["--chat", "--ignore-chat-template"]);
    assert!(
        both.starts_with(
            "error: the argument '--chat' cannot be used with '--ignore-chat-template'"
        ),
        "{both}"
    );
    // A copy of the model without any chat template.
    let dir = tempfile::tempdir().unwrap();
    for f in std::fs::read_dir(&m).unwrap().flatten() {
        std::fs::copy(f.path(), dir.path().join(f.file_name())).unwrap();
    }
    let config_path = dir.path().join("tokenizer_config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    config.as_object_mut().unwrap().remove("chat_template");
    std::fs::write(&config_path, config.to_string()).unwrap();
    let bare = dir.path().to_str().unwrap();
    assert_eq!(
        err(bare, &["--chat"]),
        format!(
            "Error: {bare} has no chat template (chat_template.jinja, or chat_template in \
             tokenizer_config.json); drop --chat\n"
        )
    );
    // Without --chat such a model takes the raw prompt, as mlx_lm.generate does.
    let raw = |dir: &str, extra: &[&str]| {
        engine()
            .args([
                "generate",
                "--model",
                dir,
                "--prompt",
                "The little robot",
                "-m",
                "8",
            ])
            .args(extra)
            .output()
            .unwrap()
            .stdout
    };
    assert_eq!(raw(bare, &[]), raw(&m, &["--ignore-chat-template"]));
}
