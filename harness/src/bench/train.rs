//! `harness bench --suite train`: one ORPO training step — forward over chosen and
//! rejected, LoRA gradients, AdamW update — timed and its peak memory read, for the engine
//! and for mlx-lm-lora's ORPO trainer step (`oracles/train_leg.py`), on the same models and
//! the same token pairs (rank 8 on every linear of every block). mlx-lm-lora's ORPO is not
//! canonical (response-only NLL; log-odds of its own kind), so only time and memory are
//! compared. The engine runs its default forward (prefix-shared: the prompt both rows of
//! a pair share runs once) as `engine`, and the joint one (one forward of 2B rows, TRL's)
//! as `engine-joint`, and the default forward through the compiled step (one MLX graph for
//! loss and gradients, `engine/src/train/compiled.rs`; the update stays eager) as
//! `engine-compiled`.
//! Fresh process per leg, ABBA over rounds, median of the steps in a leg and of the legs.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use engine::train::data::Pair;
use engine::train::optim::{AdamW, Schedule};
use engine::train::orpo::SftScope;
use engine::train::orpo_prefix::{orpo_loss_by, OrpoForward};

use super::median;

use super::train_leg::PairIds;
pub use super::train_leg::{TrainLeg, RANK};
pub const PAIRS: usize = 4;

/// Deterministic pairs: a shared prompt of `prompt` ids, responses of `response` ids.
fn pairs(vocab: i32, seed: u64, prompt: usize, response: usize) -> Vec<PairIds> {
    (0..PAIRS as u64)
        .map(|i| {
            let p = super::prompt_ids(prompt, vocab, seed + i);
            let mut chosen = p.clone();
            chosen.extend(super::prompt_ids(response, vocab, seed + 100 + i));
            let mut rejected = p.clone();
            rejected.extend(super::prompt_ids(response, vocab, seed + 200 + i));
            PairIds {
                prompt_len: prompt,
                chosen,
                rejected,
            }
        })
        .collect()
}

/// One engine leg in this process (`harness leg-train`).
pub fn leg(
    model: &Path,
    pairs_file: &Path,
    steps: usize,
    num_layers: usize,
    forward: OrpoForward,
    compiled: bool,
) -> Result<TrainLeg> {
    let m = engine::model::load(model)?;
    let pairs = super::train_leg::load_pairs(pairs_file)?;
    let refs: Vec<&Pair> = pairs.iter().collect();
    let adapters = super::train_leg::attach(m.as_ref(), num_layers)?;
    let mut opt = AdamW::new(Schedule::Constant(1e-4), 0.01);
    let mut graph =
        compiled.then(|| engine::train::compiled::CompiledStep::new(m.as_ref(), &adapters));
    let mut times = Vec::new();
    for i in 0..steps + 2 {
        if i == 2 {
            engine::runtime::reset_peak_memory()?;
        }
        let t0 = Instant::now();
        let (out, grads) = match &mut graph {
            Some(g) => g.pair_grads(&refs, 0.1, SftScope::Full, forward)?,
            None => engine::train::value_and_grad(&adapters, || {
                Ok(orpo_loss_by(m.as_ref(), &refs, 0.1, SftScope::Full, forward)?.into_vec())
            })?,
        };
        engine::train::apply_update(&mut opt, &adapters, &grads, &[&out[0]])?;
        if i >= 2 {
            times.push(t0.elapsed().as_secs_f64());
        }
    }
    drop(graph);
    Ok(TrainLeg {
        stack: if compiled {
            COMPILED
        } else {
            stack_of(forward)
        }
        .into(),
        step_s: median(times),
        peak_memory_bytes: engine::runtime::memory()?.peak as f64,
    })
}

/// The bench's name for an engine leg by `forward`.
pub fn stack_of(forward: OrpoForward) -> &'static str {
    match forward {
        OrpoForward::PrefixShared => "engine",
        OrpoForward::Joint => "engine-joint",
    }
}

/// The engine stack whose step runs compiled (the default forward).
pub const COMPILED: &str = "engine-compiled";

/// The forward of an engine stack (None: the peer).
pub fn forward_of(stack: &str) -> Option<OrpoForward> {
    if stack == COMPILED {
        return Some(OrpoForward::PrefixShared);
    }
    [OrpoForward::PrefixShared, OrpoForward::Joint]
        .into_iter()
        .find(|&f| stack_of(f) == stack)
}

fn run_leg(
    stack: &str,
    model: &Path,
    pairs: &Path,
    steps: usize,
    layers: usize,
) -> Result<TrainLeg> {
    let method = super::train_pref::method_of(stack);
    let mut cmd = if let (Some(m), true) = (method, stack.starts_with("engine")) {
        let mut c = Command::new(std::env::current_exe()?);
        c.arg("leg-train")
            .arg("--num-layers")
            .arg(layers.to_string())
            .arg("--method")
            .arg(m);
        c
    } else if let Some(forward) = forward_of(stack) {
        let mut c = Command::new(std::env::current_exe()?);
        c.arg("leg-train")
            .arg("--num-layers")
            .arg(layers.to_string())
            .arg("--forward")
            .arg(forward.name());
        if stack == COMPILED {
            c.arg("--compiled");
        }
        c
    } else {
        let mut c = Command::new(crate::oracle::python());
        c.arg(crate::oracle::repo_root().join("oracles/train_leg.py"))
            .arg("--rank")
            .arg(RANK.to_string())
            .arg("--num-layers")
            .arg(layers.to_string());
        if let Some(m) = method {
            c.arg("--method").arg(m);
        }
        c
    };
    cmd.arg("--model")
        .arg(model)
        .arg("--pairs")
        .arg(pairs)
        .arg("--steps")
        .arg(steps.to_string());
    super::run_json_leg(&mut cmd, stack)
}

/// The peer stack an engine stack's legs are compared with (None: an engine variant or a
/// peer itself).
pub fn peer_of(stack: &str) -> Option<&'static str> {
    match stack {
        "engine" => Some("mlx-lm-lora"),
        s if s.starts_with("engine-") => {
            super::train_pref::method_of(s).and_then(super::train_pref::peer_stack)
        }
        _ => None,
    }
}

pub struct TrainResult {
    pub model: String,
    pub tokens_per_pair: usize,
    pub legs: Vec<TrainLeg>,
    /// Every leg's `step_ms` and `peak_memory_mb`, in the order they ran.
    pub kept: super::kept::Kept,
}

/// A model the train suite runs: its name, directory, vocabulary, blocks (all adapted) and
/// the ORPO rows' response length.
pub type Target = (String, PathBuf, i32, usize, usize);

/// The models: the committed trained tiny model and the `tiny` bench model (random
/// weights, twice as wide). The `small` one takes ~16 s per step on a 2-core CPU.
pub fn targets() -> Result<Vec<Target>> {
    let bench = super::models::by_name("tiny").context("bench model tiny")?;
    Ok(vec![
        (
            "tiny-llama-trained".into(),
            crate::goldens::model_dir("tiny-llama-trained")?,
            1024,
            3,
            24,
        ),
        (
            format!("bench-{}", bench.name),
            bench.ensure()?,
            bench.vocab,
            bench.layers as usize,
            64,
        ),
    ])
}

/// Whether the peer is installed (an error saying how to install it, when asked for and
/// missing).
pub fn check_peer(peer: bool) -> Result<()> {
    if peer
        && !crate::oracle::repo_root()
            .join("oracles/.lora-peer/mlx_lm_lora")
            .is_dir()
    {
        bail!("the train bench's peer is missing: run `bash oracles/setup_lora_peer.sh` (or pass --no-peer)");
    }
    Ok(())
}

/// The ORPO rows on every target.
pub fn run(rounds: usize, steps: usize, peer: bool) -> Result<Vec<TrainResult>> {
    check_peer(peer)?;
    let mut results = Vec::new();
    for (name, dir, vocab, layers, response) in targets()? {
        let tmp = tempfile::tempdir()?;
        let file = tmp.path().join("pairs.json");
        let prompt = response / 2;
        std::fs::write(
            &file,
            serde_json::to_string(&pairs(vocab, 17, prompt, response))?,
        )?;
        let mut stacks: Vec<&'static str> = vec!["engine", COMPILED, "engine-joint"];
        if peer {
            stacks.push("mlx-lm-lora");
        }
        for (_, engine, peer_stack) in super::train_pref::METHODS {
            stacks.push(engine);
            if peer {
                stacks.push(peer_stack);
            }
        }
        let order = super::leg_order(rounds, &stacks);
        let bar = super::Progress::new("train", order.len());
        let mut all = Vec::new();
        let mut kept = super::kept::Kept::default();
        for stack in order {
            bar.start(format!("{name} · {stack}"));
            let leg = run_leg(stack, &dir, &file, steps, layers)?;
            kept.push(
                stack,
                [
                    ("step_ms".to_owned(), leg.step_s * 1e3),
                    ("peak_memory_mb".to_owned(), leg.peak_memory_bytes / 1e6),
                ],
            );
            all.push(leg);
            bar.done();
        }
        bar.finish();
        let legs = stacks
            .iter()
            .map(|s| {
                let mine: Vec<&TrainLeg> = all.iter().filter(|l| l.stack == *s).collect();
                TrainLeg {
                    stack: (*s).into(),
                    step_s: median(mine.iter().map(|l| l.step_s).collect()),
                    peak_memory_bytes: median(mine.iter().map(|l| l.peak_memory_bytes).collect()),
                }
            })
            .collect();
        results.push(TrainResult {
            model: name,
            tokens_per_pair: prompt + response,
            legs,
            kept,
        });
    }
    Ok(results)
}

impl TrainResult {
    pub fn table(&self) -> String {
        let mut s = format!(
            "train (ORPO step; -dpo, -cpo, -simpo: that method's step, {PAIRS} pairs × {} tokens, LoRA rank {RANK}) on {}\n",
            self.tokens_per_pair, self.model
        );
        let engine = self.legs.iter().find(|l| l.stack == "engine");
        for l in &self.legs {
            // A preference method's legs against the engine's leg of that method, ORPO
            // legs against the engine's ORPO.
            let base = match super::train_pref::method_of(&l.stack) {
                Some(m) => {
                    let e = super::train_pref::engine_stack(m);
                    self.legs.iter().find(|l| Some(l.stack.as_str()) == e)
                }
                None => engine,
            };
            let ratio = base.map_or(f64::NAN, |e| l.step_s / e.step_s);
            s += &format!(
                "  {:20} step {:8.1} ms ({:.2}× engine)  peak {:8.1} MB\n",
                l.stack,
                l.step_s * 1e3,
                ratio,
                l.peak_memory_bytes / 1e6
            );
        }
        for l in self.legs.iter().filter(|l| peer_of(&l.stack).is_some()) {
            let kinds = [("step_ms", "ms", false), ("peak_memory_mb", "MB", false)];
            s += &format!("  {}:\n", l.stack);
            s += &self.kept.lines(&kinds, &l.stack, peer_of(&l.stack));
        }
        s
    }
}
