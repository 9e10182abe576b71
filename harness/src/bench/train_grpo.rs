//! The train suite's GRPO rows: one GRPO iteration — `PROMPTS` prompts × `GROUP` sampled
//! completions of `COMPLETION` tokens at temperature 1, a length reward, group advantages,
//! one policy update (forward over prompt + completion, the clipped token loss, LoRA
//! gradients, AdamW) — timed in its two parts, for the engine (`grpo_train::generation` and
//! `update`, the code `engine train --method grpo` runs) and for mlx-lm-lora 5.10.2
//! (`oracles/train_leg_grpo.py`: its `generate_grpo` and its train step's
//! `nn.value_and_grad(grpo_loss)` + `optimizer.update`), on the same model and prompt ids,
//! LoRA rank 8 on every linear of every block. The bench models' random weights almost never
//! sample EOS, so both sides decode the whole budget (each leg reports its mean completion
//! length). Fresh process per leg; one warm-up iteration, then the median of the timed ones.

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use anyhow::Result;
use engine::train::grpo::{GrpoLoss, GrpoLossConfig, RewardScale};
use engine::train::grpo_train::{generation, update, GrpoConfig, GrpoExample};
use engine::train::optim::{AdamW, Schedule};
use engine::train::reward::Rewards;
use serde::{Deserialize, Serialize};

use super::median;
use super::train_leg::RANK;

pub const PROMPTS: usize = 2;
pub const GROUP: usize = 4;
pub const COMPLETION: usize = 32;
pub const PROMPT_TOKENS: usize = 16;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GrpoLeg {
    pub stack: String,
    /// Sampling the completions.
    pub generate_s: f64,
    /// The policy update on them.
    pub update_s: f64,
    pub peak_memory_bytes: f64,
    pub completion_tokens: f64,
}

/// The prompts' ids (one list per prompt).
pub fn prompts(vocab: i32) -> Vec<Vec<u32>> {
    (0..PROMPTS as u64)
        .map(|i| super::prompt_ids(PROMPT_TOKENS, vocab, 31 + i))
        .collect()
}

/// One engine leg in this process (`harness leg-grpo`).
pub fn leg(model: &Path, prompts_file: &Path, steps: usize, num_layers: usize) -> Result<GrpoLeg> {
    let m = engine::model::load(model)?;
    let tokenizer = engine::load::tokenizer::Tokenizer::load(model)?;
    let ids: Vec<Vec<u32>> = serde_json::from_str(&std::fs::read_to_string(prompts_file)?)?;
    let data: Vec<GrpoExample> = ids
        .into_iter()
        .map(|prompt| GrpoExample {
            prompt,
            text: String::new(),
            line: serde_json::json!({}),
        })
        .collect();
    let rewards = Rewards::parse(&format!(
        r#"[{{"kind": "length", "target": {COMPLETION}, "unit": "tokens"}}]"#
    ))
    .map_err(anyhow::Error::msg)?;
    let adapters = super::train_leg::attach(m.as_ref(), num_layers)?;
    let mut opt = AdamW::new(Schedule::Constant(1e-6), 0.01);
    let cfg = GrpoConfig {
        iters: steps,
        batch_size: PROMPTS,
        group_size: GROUP,
        max_completion_length: COMPLETION,
        temperature: 1.0,
        iterations: 1,
        scale_rewards: RewardScale::Group,
        loss: GrpoLossConfig {
            loss_type: GrpoLoss::Grpo,
            epsilon_low: 0.2,
            epsilon_high: 0.2,
            beta: 0.0,
            max_completion_length: COMPLETION,
        },
        micro_batch: PROMPTS,
        max_grad_norm: None,
        steps_per_eval: usize::MAX,
        save_every: 0,
        seed: 0,
    };
    let all: Vec<usize> = (0..data.len()).collect();
    let (mut gen_t, mut upd_t, mut lengths) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..steps + 1 {
        if i == 1 {
            engine::runtime::reset_peak_memory()?;
        }
        let t0 = Instant::now();
        let g = generation(
            m.as_ref(),
            &adapters,
            &tokenizer,
            &data,
            &all,
            &rewards,
            &cfg,
            i,
        )?;
        let t1 = Instant::now();
        update(m.as_ref(), &adapters, &mut opt, &g, &cfg)?;
        if i >= 1 {
            gen_t.push((t1 - t0).as_secs_f64());
            upd_t.push(t1.elapsed().as_secs_f64());
            lengths.push(g.completion_tokens());
        }
    }
    Ok(GrpoLeg {
        stack: "engine".into(),
        generate_s: median(gen_t),
        update_s: median(upd_t),
        peak_memory_bytes: engine::runtime::memory()?.peak as f64,
        completion_tokens: median(lengths),
    })
}

/// One leg of `stack` ("engine" or "mlx-lm-lora") in a fresh process.
pub fn run_leg(
    stack: &str,
    model: &Path,
    prompts: &Path,
    steps: usize,
    layers: usize,
) -> Result<GrpoLeg> {
    let mut cmd = if stack == "engine" {
        let mut c = Command::new(std::env::current_exe()?);
        c.arg("leg-grpo");
        c
    } else {
        let mut c = Command::new(crate::oracle::python());
        c.arg(crate::oracle::repo_root().join("oracles/train_leg_grpo.py"))
            .arg("--rank")
            .arg(RANK.to_string())
            .arg("--group")
            .arg(GROUP.to_string())
            .arg("--max-tokens")
            .arg(COMPLETION.to_string());
        c
    };
    cmd.arg("--model")
        .arg(model)
        .arg("--prompts")
        .arg(prompts)
        .arg("--steps")
        .arg(steps.to_string())
        .arg("--num-layers")
        .arg(layers.to_string());
    super::run_json_leg(&mut cmd, stack)
}

/// The median leg of each stack.
pub fn summarize(stacks: &[&str], all: &[GrpoLeg]) -> Vec<GrpoLeg> {
    stacks
        .iter()
        .map(|s| {
            let mine: Vec<&GrpoLeg> = all.iter().filter(|l| l.stack == *s).collect();
            let med = |f: fn(&GrpoLeg) -> f64| median(mine.iter().map(|l| f(l)).collect());
            GrpoLeg {
                stack: (*s).into(),
                generate_s: med(|l| l.generate_s),
                update_s: med(|l| l.update_s),
                peak_memory_bytes: med(|l| l.peak_memory_bytes),
                completion_tokens: med(|l| l.completion_tokens),
            }
        })
        .collect()
}

/// The GRPO rows of one model, as a text table.
pub fn table(model: &str, legs: &[GrpoLeg]) -> String {
    let mut s = format!(
        "train (GRPO iteration, {PROMPTS} prompts × {GROUP} completions of ≤ {COMPLETION} tokens, \
         LoRA rank {RANK}) on {model}\n"
    );
    let engine = legs.iter().find(|l| l.stack == "engine");
    for l in legs {
        let total = l.generate_s + l.update_s;
        let ratio = engine.map_or(f64::NAN, |e| total / (e.generate_s + e.update_s));
        s += &format!(
            "  {:12} generate {:8.1} ms  update {:8.1} ms  ({:.2}× engine)  peak {:8.1} MB  \
             {:.1} tokens/completion\n",
            l.stack,
            l.generate_s * 1e3,
            l.update_s * 1e3,
            ratio,
            l.peak_memory_bytes / 1e6,
            l.completion_tokens
        );
    }
    s
}

/// `harness leg-grpo`: one engine GRPO leg in this fresh process.
#[derive(clap::Args)]
pub struct LegArgs {
    #[arg(long)]
    model: std::path::PathBuf,
    #[arg(long)]
    prompts: std::path::PathBuf,
    #[arg(long)]
    steps: usize,
    #[arg(long)]
    num_layers: usize,
}

pub fn leg_main(args: LegArgs) -> Result<()> {
    let leg = leg(&args.model, &args.prompts, args.steps, args.num_layers)?;
    println!("{}", serde_json::to_string(&leg)?);
    Ok(())
}

/// A GRPO leg's figures, named as the results DB's metrics (ms, MB).
pub fn figures(l: &GrpoLeg) -> [(&'static str, f64, &'static str); 4] {
    [
        ("iteration_ms", (l.generate_s + l.update_s) * 1e3, "ms"),
        ("generate_ms", l.generate_s * 1e3, "ms"),
        ("update_ms", l.update_s * 1e3, "ms"),
        ("peak_memory_mb", l.peak_memory_bytes / 1e6, "MB"),
    ]
}

/// The GRPO rows on every train-suite target: (model, each stack's median leg, every leg).
pub fn run(
    rounds: usize,
    steps: usize,
    peer: bool,
) -> Result<Vec<(String, Vec<GrpoLeg>, super::kept::Kept)>> {
    super::train::check_peer(peer)?;
    let stacks: Vec<&'static str> = if peer {
        vec!["engine", "mlx-lm-lora"]
    } else {
        vec!["engine"]
    };
    let mut results = Vec::new();
    for (name, dir, vocab, layers, _) in super::train::targets()? {
        // Completions are decoded for their reward: a bench model gets its word-level
        // tokenizer (no EOS, so every completion runs the whole budget on both stacks).
        if let Some(bench) = name.strip_prefix("bench-").and_then(super::models::by_name) {
            bench.ensure_tokenizer(&dir)?;
        }
        let tmp = tempfile::tempdir()?;
        let file = tmp.path().join("prompts.json");
        std::fs::write(&file, serde_json::to_string(&prompts(vocab))?)?;
        let order = super::leg_order(rounds, &stacks);
        let bar = super::Progress::new("train-grpo", order.len());
        let mut all = Vec::new();
        let mut kept = super::kept::Kept::default();
        for stack in order {
            bar.start(format!("{name} · grpo · {stack}"));
            let leg = run_leg(stack, &dir, &file, steps, layers)?;
            kept.push(stack, figures(&leg).map(|(n, v, _)| (n.to_owned(), v)));
            all.push(leg);
            bar.done();
        }
        bar.finish();
        results.push((name, summarize(&stacks, &all), kept));
    }
    Ok(results)
}
