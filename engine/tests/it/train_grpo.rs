//! GRPO against trl 1.16.0's semantics (`oracles/grpo_reference.py`, a float64 numpy port
//! of `GRPOTrainer`'s advantages and `_compute_loss`): 8 completions in 2 groups of 4 with
//! unequal lengths (padding), two reward functions with unscored entries, the old policy
//! both the policy itself (μ = 1) and a given one (ratios clipped on both sides), every
//! loss type, β ≠ 0, each reward scaling — the advantages, the loss, the KL and clip
//! fractions, and d loss / d logp by MLX autodiff. Then `engine train --method grpo` end to
//! end: the reward it is given moves, and a reward pointed the other way moves the other way.

use crate::common::goldens;
use engine::train::grpo::{advantages, grpo_terms, GrpoLoss, GrpoLossConfig, RewardScale};
use mlx_rs::Array;
use serde_json::Value;
use std::path::Path;
use std::process::Command;

fn matrix(v: &Value) -> Array {
    let rows: Vec<Vec<f32>> = serde_json::from_value(v.clone()).unwrap();
    Array::from_slice(&rows.concat(), &[rows.len() as i32, rows[0].len() as i32])
}

fn floats(a: &Array) -> Vec<f64> {
    a.eval().unwrap();
    a.as_slice::<f32>().iter().map(|&x| x as f64).collect()
}

fn loss_type(name: &str) -> GrpoLoss {
    match name {
        "grpo" => GrpoLoss::Grpo,
        "bnpo" => GrpoLoss::Bnpo,
        "dapo" => GrpoLoss::Dapo,
        "dr_grpo" => GrpoLoss::DrGrpo,
        other => panic!("{other}"),
    }
}

fn scale(name: &str) -> RewardScale {
    match name {
        "group" => RewardScale::Group,
        "batch" => RewardScale::Batch,
        _ => RewardScale::None,
    }
}

/// The largest relative gap of every case's advantages, terms and gradients against the
/// reference (|Δ| / max(1, |reference|)).
fn worst_gap() -> f64 {
    let r: Value = serde_json::from_str(
        &std::fs::read_to_string(goldens().join("train/grpo-reference.json")).unwrap(),
    )
    .unwrap();
    let per_func: Vec<Vec<Option<f64>>> =
        serde_json::from_value(r["rewards_per_func"].clone()).unwrap();
    let weights: Vec<f64> = serde_json::from_value(r["reward_weights"].clone()).unwrap();
    let groups = r["groups"].as_u64().unwrap() as usize;
    let (lp, old, refr, mask) = (
        matrix(&r["token_logps"]),
        matrix(&r["old_logps"]),
        matrix(&r["ref_logps"]),
        matrix(&r["mask"]),
    );
    let mut worst = 0.0f64;
    let mut gap = |what: &str, ours: &[f64], want: &[f64]| {
        assert_eq!(ours.len(), want.len(), "{what}");
        for (a, b) in ours.iter().zip(want) {
            worst = worst.max((a - b).abs() / b.abs().max(1.0));
        }
        let g = ours
            .iter()
            .zip(want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        println!("{what}: max |Δ| {g:e}");
    };
    for case in r["cases"].as_array().unwrap() {
        let c = &case["config"];
        let cfg = GrpoLossConfig {
            loss_type: loss_type(c["loss_type"].as_str().unwrap()),
            epsilon_low: c["eps_low"].as_f64().unwrap() as f32,
            epsilon_high: c["eps_high"].as_f64().unwrap() as f32,
            beta: c["beta"].as_f64().unwrap() as f32,
            max_completion_length: c["max_completion_length"].as_u64().unwrap() as usize,
        };
        let label = c.to_string();
        let group = per_func.len() / groups;
        let (_, adv) = advantages(
            &per_func,
            &weights,
            group,
            scale(c["scale"].as_str().unwrap()),
        );
        let want_adv: Vec<f64> = serde_json::from_value(case["advantages"].clone()).unwrap();
        let adv: Vec<f64> = adv.iter().map(|&a| a as f64).collect();
        gap(&format!("{label} advantages"), &adv, &want_adv);
        let adv = Array::from_slice(
            &adv.iter().map(|&a| a as f32).collect::<Vec<_>>(),
            &[adv.len() as i32],
        );
        let old = (c["old"] == "given").then_some(&old);
        let refr = (cfg.beta != 0.0).then_some(&refr);
        let terms = |x: &[Array]| -> Result<Vec<Array>, mlx_rs::error::Exception> {
            let t = grpo_terms(&x[0], old, refr, &mask, &adv, &cfg, None)?;
            Ok(vec![t.loss, t.kl, t.clip_ratio])
        };
        let mut vg = mlx_rs::transforms::value_and_grad_with_argnums(terms, &[0]);
        let (out, grads) = vg(std::slice::from_ref(&lp)).unwrap();
        for (k, name) in ["loss", "kl", "clip_ratio"].iter().enumerate() {
            let want = case[*name].as_f64().unwrap();
            gap(&format!("{label} {name}"), &floats(&out[k]), &[want]);
        }
        let want: Vec<Vec<f64>> = serde_json::from_value(case["grad"].clone()).unwrap();
        gap(
            &format!("{label} d loss / d logp"),
            &floats(&grads[0]),
            &want.concat(),
        );
    }
    worst
}

/// The bound: f32 arithmetic against float64 (measured max |Δ| 5.9e-8).
const BOUND: f64 = 2e-6;

#[test]
fn grpo_advantages_loss_and_gradients_match_the_trl_reference() {
    let gap = worst_gap();
    assert!(gap <= BOUND, "worst relative gap {gap:e}");
    let _on = engine::plant::on(engine::plant::Defect::GrpoBatchMeanBaseline).unwrap();
    let planted = worst_gap();
    assert!(
        planted > 1e-2,
        "the batch-mean baseline was not caught ({planted:e})"
    );
}

fn engine_grpo(data: &Path, out: &Path, spec: &str, extra: &[&str]) -> std::process::Output {
    std::fs::write(out.with_extension("json"), spec).unwrap();
    Command::new(env!("CARGO_BIN_EXE_engine"))
        .args(["train", "--quiet", "--method", "grpo", "--model"])
        .arg(goldens().join("models/tiny-llama-trained"))
        .arg("--data")
        .arg(data)
        .arg("--adapter-path")
        .arg(out)
        .arg("--reward-spec")
        .arg(out.with_extension("json"))
        .args(extra)
        .output()
        .unwrap()
}

/// The train lines' mean of `key` over the first and the last four steps.
fn ends(out: &Path, key: &str) -> (f64, f64) {
    let text = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let xs: Vec<f64> = text
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|v| v["type"] == "train")
        .map(|v| v[key].as_f64().unwrap())
        .collect();
    let mean = |s: &[f64]| s.iter().sum::<f64>() / s.len() as f64;
    (mean(&xs[..4]), mean(&xs[xs.len() - 4..]))
}

const RUN: [&str; 14] = [
    "--grpo-group-size",
    "8",
    "--max-completion-length",
    "8",
    "--batch-size",
    "2",
    "--iters",
    "16",
    "--learning-rate",
    "5e-4",
    "--lr-schedule",
    "constant",
    "--steps-per-eval",
    "100",
];

/// Sixteen GRPO steps (lr 5e-4: at 1e-3 Adam's steps on the near-zero gradients of groups
/// already at the target can throw the policy off) on tiny-llama-trained's "Shout: …"
/// prompts (seed 0) with a length
/// reward: aimed at 3 tokens, the sampled completions shorten and the reward climbs; aimed
/// at 8 (the limit), the same seed's completions lengthen instead. The reward is what moves
/// them, so a sign or baseline error in the update would fail one of the two.
#[test]
fn grpo_moves_the_reward_it_is_given_and_refuses_bad_inputs_before_a_step() {
    let dir = tempfile::tempdir().unwrap();
    let data = goldens().join("data/uppercase");
    let short = dir.path().join("short");
    let run = engine_grpo(
        &data,
        &short,
        r#"[{"kind": "length", "target": 3, "unit": "tokens"}]"#,
        &RUN,
    );
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let (r0, r1) = ends(&short, "reward");
    let (l0, l1) = ends(&short, "completion_length");
    println!("short: reward {r0:.3} → {r1:.3}, length {l0:.2} → {l1:.2}");
    assert!(
        r1 >= r0 + 0.4 && l1 <= l0 - 2.0,
        "short: reward {r0} → {r1}, length {l0} → {l1}"
    );
    let long = dir.path().join("long");
    let run = engine_grpo(
        &data,
        &long,
        r#"[{"kind": "length", "target": 8, "unit": "tokens"}]"#,
        &RUN,
    );
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let (m0, m1) = ends(&long, "completion_length");
    println!("long: length {m0:.2} → {m1:.2}");
    assert!(m1 >= m0 + 0.5 && m1 >= 7.5, "long: length {m0} → {m1}");

    // Bad inputs: each refused with its line or entry before anything is written.
    let bad = dir.path().join("bad");
    std::fs::create_dir_all(&bad).unwrap();
    let exact = r#"[{"kind": "exact_match", "field": "answer"}]"#;
    for (i, (lines, spec, extra, says)) in [
        (
            "{\"prompt\": \"hi\", \"answer\": \"HI\"}\n{\"promt\": \"x\"}\n",
            exact,
            "",
            "line 2",
        ),
        ("{\"prompt\": \"hi\"}\n", exact, "", "`answer`"),
        (
            "{\"prompt\": \"a long prompt of many words\", \"answer\": \"A\"}\n",
            exact,
            "5",
            "no room",
        ),
        (
            "{\"prompt\": \"hi\"}\n",
            r#"[{"kind": "regex", "pattern": "("}]"#,
            "",
            "entry 1",
        ),
    ]
    .into_iter()
    .enumerate()
    {
        std::fs::write(bad.join("train.jsonl"), lines).unwrap();
        let out = dir.path().join(format!("refused{i}"));
        let mut args = vec!["--batch-size", "1"];
        if !extra.is_empty() {
            args.extend(["--max-seq-length", extra]);
        }
        let run = engine_grpo(&bad, &out, spec, &args);
        let err = String::from_utf8_lossy(&run.stderr);
        assert!(
            !run.status.success() && err.contains(says),
            "case {i}: {err}"
        );
        assert!(!out.exists(), "case {i}: {} was written", out.display());
    }
}

/// The update's micro-batches (parts of one prompt's group, parts of 3 rows that cut
/// across groups, and single rows; each cut to its longest row and scored from its
/// shortest prompt's end) against the whole batch at once, on a sampled generation of
/// tiny-llama-trained (2 prompts of different lengths × 4 completions of unequal length,
/// μ = 2 and β ≠ 0 so the old and reference log-probs are cut too; its f32 copy), for
/// every loss type:
/// the loss, KL, clip fraction and every adapter gradient agree to f32 rounding (the parts
/// sum in another order and their matmuls have fewer rows; measured ≤ 9.6e-7 relative to
/// each tensor's largest entry, the bound is 1e-5). The rows of a part run their common
/// prompt once (a group's whole prompt; "Shout:" across groups; nothing for a single row,
/// the plain forward), so this is also the prefix-shared forward's gate against the plain
/// one. Planted: each part divides by its own counts, or the shared prompt's K/V pass no
/// gradient → caught.
#[test]
fn grpo_micro_batches_add_up_to_the_whole_batch() {
    use engine::train::grpo_train::{generation, terms_and_grads, GrpoConfig, GrpoExample};
    use engine::train::reward::Rewards;
    // In f32: the shared prompt's forward is a matmul of other shapes, which bf16 would
    // round apart by its epsilon (the bf16 bound is `orpo_prefix.rs`'s).
    let tmp = tempfile::tempdir().unwrap();
    let m =
        engine::model::load(&crate::common::f32_copy("tiny-llama-trained", tmp.path())).unwrap();
    let dir = goldens().join("models/tiny-llama-trained");
    let tokenizer = engine::load::tokenizer::Tokenizer::load(&dir).unwrap();
    let adapters = crate::common::train::attach_nonzero(m.as_ref(), 40);
    let data: Vec<GrpoExample> = ["Shout: hello there", "Shout: a quiet morning"]
        .iter()
        .map(|t| GrpoExample {
            prompt: tokenizer.encode(t, true).unwrap(),
            text: t.to_string(),
            line: serde_json::json!({}),
        })
        .collect();
    let rewards = Rewards::parse(r#"[{"kind": "length", "target": 4, "unit": "tokens"}]"#).unwrap();
    let mut cfg = GrpoConfig {
        iters: 1,
        batch_size: 2,
        group_size: 4,
        max_completion_length: 24,
        temperature: 1.0,
        iterations: 2,
        scale_rewards: RewardScale::Group,
        loss: GrpoLossConfig {
            loss_type: GrpoLoss::Dapo,
            epsilon_low: 0.2,
            epsilon_high: 0.2,
            beta: 0.04,
            max_completion_length: 24,
        },
        micro_batch: 0,
        max_grad_norm: None,
        steps_per_eval: usize::MAX,
        save_every: 0,
        seed: 3,
    };
    // The first seeded generation whose groups both have rows of unequal length (padding
    // inside a part, and parts of different widths).
    let unequal = |l: &[usize]| l.iter().any(|&x| x != l[0]);
    let g = (0..32)
        .map(|step| {
            generation(
                m.as_ref(),
                &adapters,
                &tokenizer,
                &data,
                &[0, 1],
                &rewards,
                &cfg,
                step,
            )
            .unwrap()
        })
        .find(|g| {
            let l = g.row_lengths();
            unequal(&l[..4]) && unequal(&l[4..]) && l[..4].iter().max() != l[4..].iter().max()
        })
        .expect("a generation with rows of unequal length");
    println!("row lengths {:?}", g.row_lengths());
    let gap = |cfg: &GrpoConfig| -> f64 {
        let (wo, wg) = terms_and_grads(m.as_ref(), &adapters, &g, cfg, 0).unwrap();
        let mut worst = 0.0f64;
        // A group per part, and parts of 3 that cut across groups (the last one of 2).
        for part in [4, 3, 1] {
            let (po, pg) = terms_and_grads(m.as_ref(), &adapters, &g, cfg, part).unwrap();
            for (w, p) in wo.iter().chain(&wg).zip(po.iter().chain(&pg)) {
                let (w, p) = (floats(w), floats(p));
                let top = w.iter().fold(1e-12f64, |a, x| a.max(x.abs()));
                for (x, y) in w.iter().zip(&p) {
                    worst = worst.max((x - y).abs() / top);
                }
            }
        }
        worst
    };
    for loss in ["grpo", "bnpo", "dapo", "dr_grpo"] {
        cfg.loss.loss_type = loss_type(loss);
        let worst = gap(&cfg);
        println!("{loss}: micro-batches vs whole batch, worst relative gap {worst:.2e}");
        assert!(worst <= 1e-5, "{loss}: {worst:e}");
    }
    let planted = {
        let _on = engine::plant::on(engine::plant::Defect::GrpoMicroBatchOwnTotals).unwrap();
        cfg.loss.loss_type = GrpoLoss::Dapo;
        gap(&cfg)
    };
    println!("planted own counts: worst relative gap {planted:.2e}");
    assert!(
        planted > 1e-2,
        "micro-batches over their own counts were not caught ({planted:e})"
    );
    let planted = {
        let _on = engine::plant::on(engine::plant::Defect::OrpoPrefixKvNoGrad).unwrap();
        gap(&cfg)
    };
    println!("planted prompt K/V without gradient: worst relative gap {planted:.2e}");
    assert!(
        planted > 1e-2,
        "a shared prompt without gradient was not caught ({planted:e})"
    );
}
