//! Training: ORPO's loss against an independent TRL-semantics numpy reference
//! (oracles/orpo_reference.py: B = 4 pairs of unequal lengths, both scopes, to 1e-6, a
//! planted per-pair-mean NLL fails it); the full-scope NLL against the SFT loss (one-token
//! prompt; B = 4 unequal lengths); the dynamic-λ controller's positive and negative
//! controls and its refusal without validation data;
//! the positive control ("prefer uppercase": ORPO learns a preference the base model does
//! not have, and swapping chosen and rejected makes it learn the opposite); data errors
//! named by line; seeded dropout masks reproducible.

use crate::common;

use common::{goldens, model};
use engine::train::orpo::{orpo_terms, SftScope};
use mlx_rs::Array;
use serde_json::Value;
use std::path::Path;
use std::process::Command;

fn matrix(v: &Value) -> Array {
    let rows: Vec<Vec<f32>> = serde_json::from_value(v.clone()).unwrap();
    Array::from_slice(&rows.concat(), &[rows.len() as i32, rows[0].len() as i32])
}

fn value(a: &Array) -> f64 {
    a.eval().unwrap();
    a.as_slice::<f32>()[0] as f64
}

/// The largest |Δ| of each scope's terms (full, response) against the TRL-semantics
/// reference: B = 4 pairs of unequal prompt and sequence lengths.
fn reference_gaps(lambda_scale: f32) -> [f64; 2] {
    let r: Value = serde_json::from_str(
        &std::fs::read_to_string(goldens().join("train/orpo-reference.json")).unwrap(),
    )
    .unwrap();
    let (lp, pm, rm) = (
        matrix(&r["token_logps"]),
        matrix(&r["prompt_mask"]),
        matrix(&r["response_mask"]),
    );
    assert_eq!(lp.shape()[0], 8, "B = 4 pairs");
    let lambda = r["lambda"].as_f64().unwrap() as f32 * lambda_scale;
    [(SftScope::Full, "full"), (SftScope::Response, "response")].map(|(scope, key)| {
        let t = orpo_terms(&lp, &pm, &rm, lambda, scope).unwrap();
        let ours = [&t.loss, &t.nll, &t.or, &t.accuracy, &t.margin, &t.lw, &t.lr];
        let mut worst = 0.0f64;
        for (name, a) in engine::train::orpo::OrpoTerms::NAMES.iter().zip(ours) {
            let want = r["expected"][key][*name].as_f64().unwrap();
            let gap = (value(a) - want).abs();
            println!(
                "{key} {name}: ours {} reference {want} |Δ| {gap:e}",
                value(a)
            );
            worst = worst.max(gap);
        }
        worst
    })
}

#[test]
fn orpo_loss_equals_the_trl_semantics_reference_at_b4() {
    let [full, response] = reference_gaps(1.0);
    assert!(
        full <= 1e-6 && response <= 1e-6,
        "largest gaps {full:e}, {response:e}"
    );
}

#[test]
fn planted_lambda_fails_the_reference() {
    assert!(reference_gaps(1.1).iter().all(|&g| g > 1e-6));
}

/// A per-pair mean NLL (each pair's token mean, then the mean over pairs) fails the B = 4
/// gate in both scopes.
#[test]
fn planted_per_pair_mean_nll_fails_the_reference() {
    let _on = engine::plant::on(engine::plant::Defect::OrpoNllPerPairMean).unwrap();
    let [full, response] = reference_gaps(1.0);
    println!("planted per-pair mean: largest gaps {full:e}, {response:e}");
    assert!(full > 1e-3 && response > 1e-3, "{full:e}, {response:e}");
}

/// On the model at B = 4 with unequal lengths, the full-scope NLL is one token-weighted
/// cross-entropy over the chosen half: mlx-lm's SFT loss of the four chosen sequences with
/// lengths [1, L − 1] (the same per-token cross-entropies, summed in another order).
#[test]
fn full_scope_nll_at_b4_is_the_sft_loss_of_the_chosen_rows() {
    let m = model("tiny-llama-trained");
    let tok =
        engine::load::tokenizer::Tokenizer::load(&goldens().join("models/tiny-llama-trained"))
            .unwrap();
    let enc = |t: &str| tok.encode(t, true).unwrap();
    let texts = [
        (
            "The robot took a spring from the jar and fixed the clock.",
            "The robot sold it.",
        ),
        ("A cat.", "A cat sat on the warm mat by the door all day."),
        ("The old lamp", "The old lamp is broken"),
        ("Rain fell on the quiet town all night long.", "Rain."),
    ];
    let pairs: Vec<engine::train::data::Pair> = texts
        .iter()
        .zip([3, 1, 2, 4])
        .map(|(&(c, r), p)| engine::train::data::Pair {
            prompt_len: p,
            chosen: enc(c),
            rejected: enc(r),
        })
        .collect();
    let refs: Vec<&engine::train::data::Pair> = pairs.iter().collect();
    let t = engine::train::orpo::orpo_loss(m.as_ref(), &refs, 0.1, SftScope::Full).unwrap();
    let width = pairs.iter().map(|p| p.chosen.len()).max().unwrap();
    let mut ids = vec![0i32; 4 * width];
    let mut lengths = Vec::new();
    for (j, p) in pairs.iter().enumerate() {
        for (k, &x) in p.chosen.iter().enumerate() {
            ids[j * width + k] = x as i32;
        }
        lengths.extend([1, p.chosen.len() as i32 - 1]);
    }
    let batch = Array::from_slice(&ids, &[4, width as i32]);
    let lengths = Array::from_slice(&lengths, &[4, 2]);
    let (sft, _) = engine::train::loss::default_loss(m.as_ref(), &batch, &lengths).unwrap();
    let (a, b) = (value(&t.nll), value(&sft));
    println!("B = 4 full NLL {a} vs SFT {b}: |Δ| {:e}", (a - b).abs());
    assert!((a - b).abs() <= 1e-5 * b.abs(), "{a} vs {b}");
}

/// With a one-token prompt, the full-scope NLL covers every label-shifted position: it is
/// mlx-lm's SFT loss of that sequence with lengths [1, L − 1] (the same per-token
/// cross-entropies, summed in another order).
#[test]
fn full_scope_nll_with_a_one_token_prompt_is_the_sft_loss() {
    let m = model("tiny-llama-trained");
    let tok =
        engine::load::tokenizer::Tokenizer::load(&goldens().join("models/tiny-llama-trained"))
            .unwrap();
    let chosen = tok
        .encode(
            "The robot took a spring from the jar and fixed the clock.",
            true,
        )
        .unwrap();
    let rejected = tok.encode("The robot sold the clock.", true).unwrap();
    let pair = engine::train::data::Pair {
        prompt_len: 1,
        chosen: chosen.clone(),
        rejected,
    };
    let t = engine::train::orpo::orpo_loss(m.as_ref(), &[&pair], 0.1, SftScope::Full).unwrap();
    let ids: Vec<i32> = chosen.iter().map(|&x| x as i32).collect();
    let batch = Array::from_slice(&ids, &[1, ids.len() as i32]);
    let lengths = Array::from_slice(&[1, ids.len() as i32 - 1], &[1, 2]);
    let (sft, _) = engine::train::loss::default_loss(m.as_ref(), &batch, &lengths).unwrap();
    let (a, b) = (value(&t.nll), value(&sft));
    println!("full NLL {a} vs SFT {b}: |Δ| {:e}", (a - b).abs());
    // Measured: 0 or one f32 ulp (summation order).
    assert!((a - b).abs() <= 1e-6 * b.abs(), "{a} vs {b}");
}

/// `engine train` on tiny-llama-trained with `data`, adapters and metrics to `out`.
pub(super) fn engine_train(data: &Path, out: &Path, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_engine"))
        .args(["train", "--quiet", "--model"])
        .arg(goldens().join("models/tiny-llama-trained"))
        .arg("--data")
        .arg(data)
        .arg("--adapter-path")
        .arg(out)
        .args(args)
        .output()
        .unwrap()
}

/// The `kind` lines of a run's metrics.jsonl.
fn metrics_of(out: &Path, kind: &str) -> Vec<Value> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|v| v["type"] == kind)
        .collect()
}

/// The positive control's ORPO run (rank 8, lr 2e-3 with 10 warm-up steps, 120 iterations,
/// the whole validation set at each eval).
const CONTROL: [&str; 16] = [
    "--method",
    "orpo",
    "--iters",
    "120",
    "--batch-size",
    "2",
    "--learning-rate",
    "2e-3",
    "--warmup",
    "10",
    "--num-layers",
    "3",
    "--lora-rank",
    "8",
    "--val-batches",
    "0",
];

fn train_uppercase(data: &Path, out: &Path) -> f64 {
    let mut args = CONTROL.to_vec();
    args.extend(["--orpo-lambda", "1.0", "--steps-per-eval", "40"]);
    let run = engine_train(data, out, &args);
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let last_eval = metrics_of(out, "eval").pop().unwrap();
    println!("{}: final eval {last_eval}", data.display());
    last_eval["accuracy"].as_f64().unwrap()
}

/// The positive control: ORPO on 12 "Shout: …" pairs (chosen: capitals) reaches validation
/// accuracy ≥ 0.95 on 4 unseen phrases in 120 iterations; with chosen and rejected swapped
/// in the training pairs only, the same run learns the opposite preference and scores
/// ≤ 0.05 on the (unswapped) validation pairs, so the gate can fail.
#[test]
fn orpo_positive_control_prefers_uppercase() {
    let dir = tempfile::tempdir().unwrap();
    let acc = train_uppercase(&goldens().join("data/uppercase"), &dir.path().join("a"));
    assert!(acc >= 0.95, "validation accuracy {acc}");
    let swapped = dir.path().join("swapped");
    std::fs::create_dir_all(&swapped).unwrap();
    std::fs::copy(
        goldens().join("data/uppercase/valid.jsonl"),
        swapped.join("valid.jsonl"),
    )
    .unwrap();
    let text = std::fs::read_to_string(goldens().join("data/uppercase/train.jsonl")).unwrap();
    let lines: Vec<String> = text
        .lines()
        .map(|l| {
            let mut v: Value = serde_json::from_str(l).unwrap();
            let c = v["chosen"].take();
            v["chosen"] = v["rejected"].take();
            v["rejected"] = c;
            v.to_string()
        })
        .collect();
    std::fs::write(swapped.join("train.jsonl"), lines.join("\n") + "\n").unwrap();
    let flipped = train_uppercase(&swapped, &dir.path().join("b"));
    assert!(flipped <= 0.05, "swapped pairs still scored {flipped}");
}

#[test]
fn a_bad_data_line_is_named() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("train.jsonl"),
        "{\"text\": \"fine\"}\n{\"txt\": \"typo\"}\n",
    )
    .unwrap();
    let out = engine_train(
        dir.path(),
        &dir.path().join("out"),
        &["--iters", "1", "--batch-size", "1"],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("train.jsonl line 2") && err.contains("expected"),
        "{err}"
    );
}

/// Dropout masks come from the seed: the same seed trains the same adapters, another seed
/// different ones.
#[test]
fn dropout_is_reproducible_from_the_seed() {
    let run = |seed: &str, out: &Path| {
        let args = [
            "--iters",
            "3",
            "--batch-size",
            "2",
            "--learning-rate",
            "1e-3",
            "--num-layers",
            "2",
        ];
        let mut args = args.to_vec();
        args.extend(["--lora-rank", "4", "--lora-dropout", "0.3", "--seed", seed]);
        assert!(engine_train(&goldens().join("data/sft-chat"), out, &args)
            .status
            .success());
        std::fs::read(out.join("adapters.safetensors")).unwrap()
    };
    let dir = tempfile::tempdir().unwrap();
    let a = run("1", &dir.path().join("a"));
    let b = run("1", &dir.path().join("b"));
    let c = run("2", &dir.path().join("c"));
    assert_eq!(a, b);
    assert_ne!(a, c);
}

/// `--segment-size` trains the same adapters as the whole-model backward (its gradients are
/// bit-identical, engine/tests/it/segmented.rs), for SFT and ORPO.
#[test]
fn segmented_training_gives_the_same_adapters() {
    let run = |data: &str, method: &str, extra: &[&str], out: &Path| {
        let mut args = vec!["--method", method, "--iters", "3", "--batch-size", "2"];
        args.extend([
            "--learning-rate",
            "1e-3",
            "--num-layers",
            "3",
            "--lora-rank",
            "4",
        ]);
        args.extend(extra);
        assert!(engine_train(&goldens().join(data), out, &args)
            .status
            .success());
        std::fs::read(out.join("adapters.safetensors")).unwrap()
    };
    let dir = tempfile::tempdir().unwrap();
    for (data, method) in [("data/sft-chat", "sft"), ("data/uppercase", "orpo")] {
        // Segmented runs take the joint forward; so does the whole run compared with it.
        let whole_flags: &[&str] = match method {
            "orpo" => &["--orpo-forward", "joint"],
            _ => &[],
        };
        let whole = run(
            data,
            method,
            whole_flags,
            &dir.path().join(format!("{method}-whole")),
        );
        let seg = run(
            data,
            method,
            &["--segment-size", "1"],
            &dir.path().join(format!("{method}-seg")),
        );
        assert_eq!(whole, seg, "{method}");
    }
}

/// An adaptive run on the positive control's settings (evals every 10 steps), `extra`'s
/// flags replacing or adding to them,
/// without --quiet: its λ events from metrics.jsonl and its console output.
fn lambda_run(data: &Path, out: &Path, extra: &[&str]) -> (Vec<Value>, String) {
    // CONTROL's flags that `extra` sets again are dropped (clap takes each flag once).
    let mut args: Vec<&str> = CONTROL
        .chunks(2)
        .filter(|kv| !extra.contains(&kv[0]))
        .flatten()
        .copied()
        .collect();
    args.extend([
        "--steps-per-eval",
        "10",
        "--orpo-lambda-schedule",
        "adaptive",
    ]);
    args.extend(extra);
    let run = Command::new(env!("CARGO_BIN_EXE_engine"))
        .args(["train", "--model"])
        .arg(goldens().join("models/tiny-llama-trained"))
        .arg("--data")
        .arg(data)
        .arg("--adapter-path")
        .arg(out)
        .args(&args)
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let console = String::from_utf8_lossy(&run.stdout).into_owned();
    let events = metrics_of(out, "lambda");
    for e in &events {
        println!(
            "step {}: {} → {} ({})",
            e["step"], e["from"], e["to"], e["cause"]
        );
    }
    (events, console)
}

fn causes(events: &[Value]) -> Vec<&str> {
    events
        .iter()
        .map(|e| e["cause"].as_str().unwrap())
        .collect()
}

/// Under the positive control the adaptive controller leaves warm-up and ramps λ, and
/// never backs off (no displacement, no hard stop); every change is logged with its cause,
/// in metrics.jsonl and on the console.
#[test]
fn adaptive_lambda_ramps_under_the_positive_control() {
    let dir = tempfile::tempdir().unwrap();
    let (events, console) = lambda_run(&goldens().join("data/uppercase"), dir.path(), &[]);
    let causes = causes(&events);
    assert!(causes.contains(&"SFT saturated, ramping"), "{causes:?}");
    assert!(
        causes.iter().filter(|c| c.contains("ramping")).count() >= 2,
        "{causes:?}"
    );
    assert!(
        !causes
            .iter()
            .any(|c| c.contains("displacement") || c.contains("hard stop")),
        "{causes:?}"
    );
    let last = events.last().unwrap()["to"].as_f64().unwrap();
    assert!(last > 0.05 + 1e-9, "λ ended at {last}");
    assert!(
        console.contains("λ 0.050 → 0.100 (SFT saturated, ramping)"),
        "{console}"
    );
}

/// The negative control: the same data pushed hard (learning rate 5e-3, λ steps of 4 up to
/// 40, K = 2) displaces — ℓw falls while ℓr collapses — and the controller backs off,
/// holds K evals once chosen recovers, then ramps again.
#[test]
fn adaptive_lambda_backs_off_a_displacing_run() {
    let dir = tempfile::tempdir().unwrap();
    // Found on the joint forward: on a bf16 model each forward's gradients carry their own
    // rounding (docs/training.md), and this run's trajectory follows it.
    let extra = [
        "--orpo-forward",
        "joint",
        "--learning-rate",
        "5e-3",
        "--iters",
        "90",
        "--lambda-step",
        "4",
        "--lambda-max",
        "40",
        "--lambda-k",
        "2",
    ];
    let (events, console) = lambda_run(&goldens().join("data/uppercase"), dir.path(), &extra);
    let at = |prefix: &str| {
        events
            .iter()
            .position(|e| e["cause"].as_str().unwrap().starts_with(prefix))
            .unwrap_or_else(|| panic!("no `{prefix}` in {:?}", causes(&events)))
    };
    let (back, hold, again) = (
        at("displacement"),
        at("chosen recovered"),
        at("held 2 evals"),
    );
    assert!(back < hold && hold < again, "{:?}", causes(&events));
    let b = &events[back];
    assert!(b["to"].as_f64().unwrap() < b["from"].as_f64().unwrap());
    assert!(console.contains("backing off"), "{console}");
}

/// `adaptive` steers from validation evals: without valid.jsonl it is refused, naming the
/// fix, before anything is written.
#[test]
fn adaptive_lambda_without_validation_data_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    std::fs::copy(
        goldens().join("data/uppercase/train.jsonl"),
        data.join("train.jsonl"),
    )
    .unwrap();
    let out = dir.path().join("out");
    let run = engine_train(
        &data,
        &out,
        &["--method", "orpo", "--orpo-lambda-schedule", "adaptive"],
    );
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success());
    assert!(
        err.contains("has no valid.jsonl: add validation pairs there")
            && err.contains("--orpo-lambda-schedule static"),
        "{err}"
    );
    assert!(!out.exists(), "a refused run wrote {}", out.display());
}

/// Gemma 3 and 4 train LoRA adapters from the CLI (their steps are gated against mlx-lm in
/// tests/it/train_lora.rs) and `generate --adapter-path` loads them; segmented, both write the
/// same adapters (Gemma 4's donor K/V carried across segments, engine/tests/it/segmented.rs).
#[test]
fn gemma_models_train_segmented_alike() {
    let dir = tempfile::tempdir().unwrap();
    let engine = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_engine"))
            .args(args)
            .env_remove("RUST_BACKTRACE")
            .output()
            .unwrap()
    };
    let data = goldens().join("data/sft-chat");
    let train = |model_dir: &Path, out: &Path, extra: &[&str]| {
        let mut args = vec![
            "train",
            "--quiet",
            "--model",
            model_dir.to_str().unwrap(),
            "--data",
            data.to_str().unwrap(),
            "--iters",
            "3",
            "--adapter-path",
            out.to_str().unwrap(),
        ];
        args.extend(extra);
        let trained = engine(&args);
        assert!(
            trained.status.success(),
            "{}: {}",
            model_dir.display(),
            String::from_utf8_lossy(&trained.stderr)
        );
        std::fs::read(out.join("adapters.safetensors")).unwrap()
    };
    for model in ["tiny-gemma3", "tiny-gemma4"] {
        let model_dir = goldens().join("models").join(model);
        let out = dir.path().join(model);
        let whole = train(&model_dir, &out, &[]);
        let seg = dir.path().join(format!("{model}-segmented"));
        let segmented = train(&model_dir, &seg, &["--segment-size", "1"]);
        assert!(whole == segmented, "segmented {model} adapters differ");
        let generated = engine(&[
            "generate",
            "--model",
            model_dir.to_str().unwrap(),
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
