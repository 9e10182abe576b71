//! DPO, CPO and SimPO (`engine/src/train/preference.rs`): every term and d loss / d
//! per-token log-prob (MLX autodiff through the loss) against the float64 port of TRL 1.16's
//! losses (`oracles/preference_reference.py`: B = 1 and B = 4 pairs of unequal prompt and
//! sequence lengths, padded; each DPO loss type, label smoothing, CPO's α, SimPO's γ), with
//! three planted defects failing it; the reference pass equals the base model even over
//! trained adapters; a DPO and a SimPO run learn the "prefer uppercase" preference and the
//! swapped data does not; segmented and prefix-shared DPO agree with the joint step; malformed data and flags
//! that do not apply are refused with the line or flag named, before anything is written.

use crate::common;

use common::{goldens, model};
use engine::train::orpo_prefix::OrpoForward;
use engine::train::preference::{pref_terms, DpoLoss, PairObjective};
use mlx_rs::error::Exception;
use mlx_rs::Array;
use serde_json::Value;
use std::path::Path;
use std::process::Command;

fn matrix(v: &Value) -> Array {
    let rows: Vec<Vec<f32>> = serde_json::from_value(v.clone()).unwrap();
    Array::from_slice(&rows.concat(), &[rows.len() as i32, rows[0].len() as i32])
}

fn floats(a: &Array) -> Vec<f64> {
    let a = a.as_dtype(mlx_rs::Dtype::Float32).unwrap();
    a.eval().unwrap();
    a.as_slice::<f32>().iter().map(|&x| x as f64).collect()
}

fn objective(case: &Value) -> PairObjective {
    let f = |k: &str| case[k].as_f64().unwrap_or(0.0) as f32;
    match case["method"].as_str().unwrap() {
        "dpo" => PairObjective::Dpo {
            beta: f("beta"),
            loss: match case["loss"].as_str().unwrap() {
                "sigmoid" => DpoLoss::Sigmoid,
                "hinge" => DpoLoss::Hinge,
                "ipo" => DpoLoss::Ipo,
                "robust" => DpoLoss::Robust,
                other => panic!("{other}"),
            },
            label_smoothing: f("label_smoothing"),
        },
        "cpo" => PairObjective::Cpo {
            beta: f("beta"),
            label_smoothing: f("label_smoothing"),
            cpo_alpha: f("cpo_alpha"),
        },
        "simpo" => PairObjective::Simpo {
            beta: f("beta"),
            label_smoothing: f("label_smoothing"),
            cpo_alpha: f("cpo_alpha"),
            gamma: f("gamma"),
        },
        other => panic!("{other}"),
    }
}

/// The largest gap of any term or gradient entry over every set and case, each gap
/// relative to max(1, |reference|): (gap, its largest absolute |Δ|).
fn reference_gap() -> (f64, f64) {
    let r: Value = serde_json::from_str(
        &std::fs::read_to_string(goldens().join("train/preference-reference.json")).unwrap(),
    )
    .unwrap();
    let (mut worst, mut worst_abs) = (0.0f64, 0.0f64);
    for (name, set) in r["sets"].as_object().unwrap() {
        let (lp, mask) = (matrix(&set["token_logps"]), matrix(&set["response_mask"]));
        let refs: Vec<f32> = serde_json::from_value(set["reference"].clone()).unwrap();
        let refs = Array::from_slice(&refs, &[refs.len() as i32]);
        for case in set["cases"].as_array().unwrap() {
            let obj = objective(case);
            let reference = obj.needs_reference().then_some(&refs);
            let terms = pref_terms(&obj, &lp, &mask, reference).unwrap().into_vec();
            let f = |x: &[Array]| -> Result<Vec<Array>, Exception> {
                Ok(vec![pref_terms(&obj, &x[0], &mask, reference)?.loss])
            };
            let (_, grad) =
                mlx_rs::transforms::value_and_grad(f)(std::slice::from_ref(&lp)).unwrap();
            let want_grad: Vec<Vec<f64>> = serde_json::from_value(case["grad"].clone()).unwrap();
            let mut pairs: Vec<(f64, f64)> = floats(&grad[0])
                .into_iter()
                .zip(want_grad.concat())
                .collect();
            for (n, t) in obj.names().iter().zip(&terms) {
                pairs.push((floats(t)[0], case["expected"][*n].as_f64().unwrap()));
            }
            let (mut gap, mut abs) = (0.0f64, 0.0f64);
            for (ours, want) in pairs {
                let d = (ours - want).abs();
                abs = abs.max(d);
                gap = gap.max(d / want.abs().max(1.0));
            }
            println!("{name} {obj:?}: gap {gap:.2e} (|Δ| {abs:.2e})");
            worst = worst.max(gap);
            worst_abs = worst_abs.max(abs);
        }
    }
    (worst, worst_abs)
}

/// The gate: terms and gradients within 1e-6 (relative to max(1, |x|)) of the float64
/// reference over 18 cases; β applied twice, the reference taken from the policy, and
/// SimPO's γ not divided by β each fail it.
#[test]
fn preference_losses_and_gradients_equal_the_trl_reference() {
    let (gap, abs) = reference_gap();
    println!("largest gap {gap:e}, largest |Δ| {abs:e}");
    assert!(gap <= 1e-6, "largest gap {gap:e}");
    use engine::plant::{on, Defect};
    for defect in [
        Defect::DpoBetaTwice,
        Defect::DpoReferenceFromPolicy,
        Defect::SimpoGammaNotOverBeta,
    ] {
        let _on = on(defect).unwrap();
        let (planted, _) = reference_gap();
        println!("planted {defect:?}: largest gap {planted:e}");
        assert!(planted > 1e-3, "{defect:?} passed the gate ({planted:e})");
    }
}

/// The reference pass zeroes every adapter's B: over adapters with B ≠ 0 it gives the base
/// model's log-probs bit for bit (the model with the adapters detached), and it leaves the
/// adapters as they were.
/// Two pairs of unequal lengths on tiny-llama-trained's tokenizer (the longer response
/// chosen in one, rejected in the other).
fn two_pairs() -> Vec<engine::train::data::Pair> {
    let tok =
        engine::load::tokenizer::Tokenizer::load(&goldens().join("models/tiny-llama-trained"))
            .unwrap();
    let enc = |t: &str| tok.encode(t, true).unwrap();
    vec![
        engine::train::data::Pair {
            prompt_len: 3,
            chosen: enc("The robot took a spring from the jar."),
            rejected: enc("The robot sold it."),
        },
        engine::train::data::Pair {
            prompt_len: 2,
            chosen: enc("A cat sat."),
            rejected: enc("A cat sat on the warm mat by the door."),
        },
    ]
}

#[test]
fn the_reference_pass_is_the_base_model_even_over_trained_adapters() {
    use engine::train::lora::{AdapterConfig, Adapters};
    use engine::train::preference::{reference_logps, summed_logps};
    let m = model("tiny-llama-trained");
    let pairs = two_pairs();
    let base = summed_logps(m.as_ref(), &pairs, 2).unwrap();
    let config = AdapterConfig::lora(2, 4);
    let adapters = Adapters::attach(m.as_ref(), config, 0).unwrap();
    // "Trained" adapters: every B non-zero.
    let trained: Vec<Array> = adapters
        .params()
        .iter()
        .enumerate()
        .map(|(k, p)| {
            if k % 2 == 1 {
                let key = mlx_rs::random::key(k as u64).unwrap();
                mlx_rs::random::normal::<f32>(p.shape(), None, Some(0.05), &key).unwrap()
            } else {
                p.clone()
            }
        })
        .collect();
    adapters.set(&trained);
    let policy = summed_logps(m.as_ref(), &pairs, 2).unwrap();
    let reference = reference_logps(m.as_ref(), &adapters, &pairs, 2).unwrap();
    println!("base {base:?}\npolicy {policy:?}\nreference {reference:?}");
    assert_ne!(policy, base, "the trained adapters change the log-probs");
    assert_eq!(reference, base);
    assert_eq!(summed_logps(m.as_ref(), &pairs, 2).unwrap(), policy);
    let _on = engine::plant::on(engine::plant::Defect::DpoReferenceKeepsAdapters).unwrap();
    let planted = reference_logps(m.as_ref(), &adapters, &pairs, 2).unwrap();
    assert_ne!(planted, base, "the planted reference pass passed");
}

/// `engine train` on tiny-llama-trained with `data`, adapters and metrics to `out`.
fn engine_train(data: &Path, out: &Path, args: &[&str]) -> std::process::Output {
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

/// A short seeded run of `method` on `data`: (first eval, last eval).
fn control_run(data: &Path, out: &Path, method: &str, extra: &[&str]) -> (Value, Value) {
    let mut args = vec![
        "--method",
        method,
        "--iters",
        "12",
        "--batch-size",
        "2",
        "--learning-rate",
        "2e-3",
        "--num-layers",
        "3",
        "--lora-rank",
        "8",
        "--val-batches",
        "0",
        "--steps-per-eval",
        "12",
        "--seed",
        "0",
    ];
    args.extend(extra);
    let run = engine_train(data, out, &args);
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let evals = metrics_of(out, "eval");
    let trains = metrics_of(out, "train");
    assert!(trains[0]["rewards/accuracies"].is_number(), "{}", trains[0]);
    println!(
        "{method} {}: {}\n  -> {}",
        data.display(),
        evals[0],
        evals[evals.len() - 1]
    );
    (evals[0].clone(), evals[evals.len() - 1].clone())
}

/// The uppercase pairs with chosen and rejected swapped in train.jsonl (valid.jsonl kept).
fn swapped_data(dir: &Path) -> std::path::PathBuf {
    let swapped = dir.join("swapped");
    std::fs::create_dir_all(&swapped).unwrap();
    let src = goldens().join("data/uppercase");
    std::fs::copy(src.join("valid.jsonl"), swapped.join("valid.jsonl")).unwrap();
    let text = std::fs::read_to_string(src.join("train.jsonl")).unwrap();
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
    swapped
}

/// The positive control: 12 seeded steps of DPO (and of SimPO, whose base-model margin
/// starts negative: the base prefers lowercase) on the uppercase pairs raise the validation
/// reward margin above 0 with reward accuracy 1 on the 4 unseen pairs (CPO's summed margin
/// closes more than half its starting gap); DPO with chosen and
/// rejected swapped in the training pairs drives the margin below 0 with accuracy 0, so the
/// gate can fail.
#[test]
fn dpo_and_simpo_learn_to_prefer_uppercase_and_swapped_pairs_do_not() {
    let dir = tempfile::tempdir().unwrap();
    let data = goldens().join("data/uppercase");
    let margin = |v: &Value| v["rewards/margins"].as_f64().unwrap();
    let acc = |v: &Value| v["rewards/accuracies"].as_f64().unwrap();
    for (method, extra) in [("dpo", &[][..]), ("simpo", &["--beta", "2.0"][..])] {
        let (first, last) = control_run(&data, &dir.path().join(method), method, extra);
        assert!(
            margin(&last) > margin(&first).max(0.0) + 0.1,
            "{method}: {first} -> {last}"
        );
        assert!(acc(&last) >= 0.99, "{method}: {last}");
    }
    // CPO scores summed log-probs, and the capitals' rows are longer: its reward margin
    // starts far below 0 (−23) and 12 steps close most of the gap without flipping it.
    let (first, last) = control_run(&data, &dir.path().join("cpo"), "cpo", &[]);
    let rise = margin(&last) - margin(&first);
    assert!(rise > 0.5 * margin(&first).abs(), "cpo: {first} -> {last}");
    let swapped = swapped_data(dir.path());
    let (first, last) = control_run(&swapped, &dir.path().join("swapped"), "dpo", &[]);
    assert!(
        margin(&last) < margin(&first) - 0.1,
        "swapped: {first} -> {last}"
    );
    assert!(acc(&last) <= 0.01, "swapped: {last}");
}

/// DPO's terms and gradients on one batch of 2 pairs, whole or with `--segment-size 1`, by
/// `forward`.
fn dpo_batch_grads(
    segment_size: Option<usize>,
    forward: OrpoForward,
) -> (Vec<Vec<f64>>, Vec<Vec<f64>>) {
    use engine::train::lora::{AdapterConfig, Adapters};
    use engine::train::preference_data::PairSet;
    use engine::train::trainer::{batch_grads, Dataset, Method, TrainConfig};
    let m = model("tiny-llama-trained");
    let pairs = two_pairs();
    let config = AdapterConfig::lora(3, 4);
    let adapters = Adapters::attach(m.as_ref(), config, 0).unwrap();
    // Adapters with B ≠ 0, so A's gradients are not zero either.
    let moved: Vec<Array> = adapters
        .params()
        .iter()
        .enumerate()
        .map(|(k, p)| {
            let key = mlx_rs::random::key(100 + k as u64).unwrap();
            let noise = mlx_rs::random::normal::<f32>(p.shape(), None, Some(0.01), &key).unwrap();
            if k % 2 == 1 {
                noise
            } else {
                p.clone()
            }
        })
        .collect();
    adapters.set(&moved);
    let reference = engine::train::preference::reference_logps(m.as_ref(), &adapters, &pairs, 2);
    let data = Dataset::Pairs(PairSet {
        pairs,
        reference: Some(reference.unwrap()),
    });
    let cfg = TrainConfig {
        method: Method::Pairs(PairObjective::Dpo {
            beta: 0.1,
            loss: DpoLoss::Sigmoid,
            label_smoothing: 0.0,
        }),
        iters: 1,
        batch_size: 2,
        grad_accumulation: 1,
        max_grad_norm: None,
        steps_per_eval: usize::MAX,
        val_batches: 0,
        save_every: 0,
        max_seq_length: 2048,
        seed: 0,
        orpo_lambda: 0.1,
        sft_scope: engine::train::orpo::SftScope::Full,
        segment_size,
        orpo_forward: forward,
        lambda_controller: None,
        actuated: engine::train::lambda::Actuated::Lambda,
        loss_chunk: None,
    };
    let (out, grads) = batch_grads(m.as_ref(), &adapters, &data, &[0, 1], &cfg, &mut ()).unwrap();
    (
        out.iter().map(floats).collect(),
        grads.iter().map(floats).collect(),
    )
}

/// The segmented backward (`--segment-size`, any loss of the logits; it runs the joint
/// forward) gives DPO's terms and gradients of the whole joint backward (measured
/// bit-identical; gate 1e-6 of the largest value), and the planted dropped cotangent fails
/// it; the prefix-shared forward (the default) gives the joint forward's terms bit for bit
/// (its gradients differ by rounding only: `orpo_prefix.rs`'s gate, the same log-probs).
#[test]
fn segmented_and_prefix_shared_dpo_agree_with_the_joint_step() {
    let (terms, grads) = dpo_batch_grads(None, OrpoForward::Joint);
    let (shared, _) = dpo_batch_grads(None, OrpoForward::PrefixShared);
    println!("joint terms {terms:?}\nprefix-shared terms {shared:?}");
    assert_eq!(shared, terms);
    let whole: Vec<Vec<f64>> = terms.into_iter().chain(grads).collect();
    let seg = |planted: bool| {
        let _on = planted.then(|| engine::plant::on(engine::plant::Defect::DropCotangent).unwrap());
        let (t, g) = dpo_batch_grads(Some(1), OrpoForward::Joint);
        t.into_iter().chain(g).collect::<Vec<_>>()
    };
    let gap = |other: &[Vec<f64>]| {
        let scale = whole.iter().flatten().fold(0.0f64, |a, x| a.max(x.abs()));
        let worst = whole
            .iter()
            .flatten()
            .zip(other.iter().flatten())
            .fold(0.0f64, |a, (x, y)| a.max((x - y).abs()));
        worst / scale
    };
    let segmented = gap(&seg(false));
    println!("segmented vs whole: largest gap / largest value {segmented:e}");
    assert!(segmented <= 1e-6, "{segmented:e}");
    let planted = gap(&seg(true));
    println!("planted DropCotangent: {planted:e}");
    assert!(planted > 1e-3, "{planted:e}");
}

/// Malformed preference data is refused before any step, naming the file and line, and
/// nothing is written: a missing field, an empty response, a prompt that leaves no response
/// token within --max-seq-length, bytes that are not UTF-8, reference log-probs that are
/// not finite numbers (or only one of the two), and reference log-probs on some lines only.
#[test]
fn malformed_preference_data_is_named_by_line_and_nothing_is_written() {
    let good = r#"{"prompt": "Shout: fix the clock", "chosen": "FIX THE CLOCK", "rejected": "fix the clock"}"#;
    let long_prompt = format!(
        r#"{{"prompt": "{}", "chosen": "A", "rejected": "b"}}"#,
        "word ".repeat(80)
    );
    let with_ref = |c: &str, r: &str| {
        format!(
            r#"{{"prompt": "Shout: go", "chosen": "GO", "rejected": "go", "ref_chosen_logps": {c}, "ref_rejected_logps": {r}}}"#
        )
    };
    let good_ref = with_ref("-3.5", "-4.0");
    let cases: Vec<(Vec<u8>, &[&str], &str)> = vec![
        (
            format!("{good}\n{{\"prompt\": \"Shout: go\", \"chosen\": \"GO\"}}\n").into_bytes(),
            &[],
            "`rejected` must be a string or a message list",
        ),
        (
            format!(
                "{good}\n{{\"prompt\": \"Shout: go\", \"chosen\": \"\", \"rejected\": \"go\"}}\n"
            )
            .into_bytes(),
            &[],
            "`chosen` is empty",
        ),
        (
            format!("{good}\n{long_prompt}\n").into_bytes(),
            &["--max-seq-length", "40"],
            "leaves no response token",
        ),
        (
            [
                format!("{good}\n").as_bytes(),
                b"{\"prompt\": \"Shout: \xff\", \"chosen\": \"A\", \"rejected\": \"a\"}\n",
            ]
            .concat(),
            &[],
            "not UTF-8",
        ),
        (
            format!("{good_ref}\n{}\n", with_ref("\"NaN\"", "-2.0")).into_bytes(),
            &[],
            "`ref_chosen_logps` must be a finite number",
        ),
        (
            format!("{good_ref}\n{}\n", with_ref("-1.0", "3.5")).into_bytes(),
            &[],
            "`ref_rejected_logps` is 3.5, above 0",
        ),
        (
            format!("{good_ref}\n{good}\n").into_bytes(),
            &[],
            "are missing here but present on the first line",
        ),
    ];
    let dir = tempfile::tempdir().unwrap();
    for (i, (bytes, extra, what)) in cases.iter().enumerate() {
        let data = dir.path().join(format!("data{i}"));
        std::fs::create_dir_all(&data).unwrap();
        std::fs::write(data.join("train.jsonl"), bytes).unwrap();
        let out = dir.path().join(format!("out{i}"));
        let mut args = vec!["--method", "dpo", "--iters", "1", "--batch-size", "1"];
        args.extend(*extra);
        let run = engine_train(&data, &out, &args);
        let err = String::from_utf8_lossy(&run.stderr);
        println!("case {i}: {}", err.trim());
        assert!(!run.status.success(), "case {i} ran");
        assert!(
            err.contains("train.jsonl line 2: ") && err.contains(what),
            "case {i}: {err}"
        );
        assert!(!out.exists(), "case {i} wrote {}", out.display());
    }
}

/// Flags that do not apply to the method are refused before the model loads, naming the
/// flag and the fix.
#[test]
fn flags_that_do_not_apply_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let data = goldens().join("data/uppercase");
    let cases: [(&[&str], &str); 9] = [
        (
            &["--method", "dpo", "--simpo-gamma", "1"],
            "--simpo-gamma applies to --method simpo, not dpo",
        ),
        (
            &["--method", "dpo", "--cpo-alpha", "1"],
            "--cpo-alpha applies to --method cpo or simpo, not dpo",
        ),
        (
            &["--method", "cpo", "--dpo-loss", "ipo"],
            "--dpo-loss applies to --method dpo, not cpo",
        ),
        (
            &["--method", "orpo", "--beta", "0.2"],
            "--beta applies to --method dpo, cpo or simpo",
        ),
        (
            &["--method", "dpo", "--label-smoothing", "0.1"],
            "pass --dpo-loss robust",
        ),
        (
            &["--method", "cpo", "--simpo-gamma", "1"],
            "--simpo-gamma applies to --method simpo, not cpo",
        ),
        (
            &[
                "--method",
                "dpo",
                "--orpo-lambda-schedule",
                "adaptive",
                "--adaptive-weight",
                "gamma",
            ],
            "--method dpo has no gamma to move: --adaptive-weight takes beta",
        ),
        (
            &["--method", "sft", "--orpo-lambda-schedule", "adaptive"],
            "--method sft has none",
        ),
        (
            &["--method", "simpo", "--adaptive-weight", "beta"],
            "add --orpo-lambda-schedule adaptive",
        ),
    ];
    for (i, (args, what)) in cases.iter().enumerate() {
        let out = dir.path().join(format!("out{i}"));
        let run = engine_train(&data, &out, args);
        let err = String::from_utf8_lossy(&run.stderr);
        assert!(
            !run.status.success() && err.contains(what),
            "{args:?}: {err}"
        );
        assert!(!out.exists());
    }
}

/// The dynamic-λ controller as an actuator of SimPO's γ: with thresholds no eval can cross
/// (warm-up ends at the second eval, then a ramp step per eval), a 12-step SimPO run moves
/// γ from λ_min 0.05 up by 0.05 per eval to 0.25, each move a `lambda` line naming `gamma`,
/// and each eval line carries the γ its steps trained with; in process, the weight the controller
/// sets is the objective's (planted `WeightNotActuated`, which leaves the objective's γ
/// as given, fails it).
#[test]
fn the_controller_moves_simpos_gamma_and_the_objective_takes_it() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("adaptive");
    let args = [
        "--method",
        "simpo",
        "--beta",
        "2.0",
        "--iters",
        "12",
        "--batch-size",
        "2",
        "--learning-rate",
        "2e-3",
        "--num-layers",
        "3",
        "--lora-rank",
        "8",
        "--val-batches",
        "0",
        "--steps-per-eval",
        "3",
        "--orpo-lambda-schedule",
        "adaptive",
        "--lambda-k",
        "1",
        "--lambda-eps-sft",
        "100",
        "--lambda-eps-disp",
        "100",
    ];
    let run = engine_train(&goldens().join("data/uppercase"), &out, &args);
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let moves = metrics_of(&out, "lambda");
    let gammas: Vec<f64> = metrics_of(&out, "eval")
        .iter()
        .map(|v| v["gamma"].as_f64().unwrap())
        .collect();
    println!("γ at evals {gammas:?}; moves {moves:?}");
    assert!(moves.iter().all(|m| m["weight"] == "gamma"), "{moves:?}");
    assert_eq!(gammas[0], 0.05f32 as f64, "warm-up starts at λ_min");
    assert!(gammas.windows(2).all(|w| w[1] >= w[0]), "{gammas:?}");
    // An eval line carries the γ its steps trained with: a move's `from`.
    let evals = metrics_of(&out, "eval");
    for m in &moves {
        let at = evals.iter().find(|e| e["step"] == m["step"]).unwrap();
        let (was, from) = (at["gamma"].as_f64().unwrap(), m["from"].as_f64().unwrap());
        assert!(
            (was - from).abs() < 1e-6,
            "step {}: {was} vs {from}",
            m["step"]
        );
    }
    assert!(
        moves.last().unwrap()["to"].as_f64().unwrap() > 0.2,
        "{moves:?}"
    );

    let simpo = |gamma| PairObjective::Simpo {
        beta: 2.0,
        label_smoothing: 0.0,
        cpo_alpha: 0.0,
        gamma,
    };
    use engine::train::trainer::{Method, TrainConfig};
    let actuated = |planted: bool| {
        let _on =
            planted.then(|| engine::plant::on(engine::plant::Defect::WeightNotActuated).unwrap());
        let mut cfg = TrainConfig {
            steps_per_eval: 1,
            actuated: engine::train::lambda::Actuated::Gamma,
            ..crate::common::train::config(Method::Pairs(simpo(0.5)))
        };
        cfg.set_weight(0.25);
        cfg.method == Method::Pairs(simpo(0.25)) && cfg.weight() == Some(0.25)
    };
    assert!(
        actuated(false),
        "the controller's γ did not reach the objective"
    );
    assert!(!actuated(true), "planted WeightNotActuated was not caught");
}
