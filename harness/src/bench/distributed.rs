//! `harness bench --suite distributed`: one rank against two (tensor parallel, and pipeline
//! parallel where mlx-lm 0.32.2 pipelines the family), the engine against mlx-lm on the
//! same ranks, in one run. Each leg is one fresh process per rank: the engine's ranks are
//! `harness leg-dist` (the engine joined to the group as `engine generate` joins it), the
//! peer's are `oracles/bench_dist_leg.py` (mlx-lm's `sharded_load`, bench_leg.py's timing).
//! Both are started as `mlx.launch --backend ring` starts ranks on one machine: two free
//! loopback ports in a hostfile, `MLX_RANK` and `MLX_HOSTFILE` per rank; the harness starts
//! them itself so that each rank is bounded, its exit status is its own and a failed leg's
//! ranks are killed by pid. Rank 0's timings are the leg's; peak memory is every rank's.
//! Legs alternate ABBA over the rounds; each number is the median over the rounds.
//!
//! Two loopback ranks on one machine share its cores: this measures what splitting costs
//! (collectives, a second process), not a speed-up.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Result};
use mlx_rs::{Array, Dtype};
use serde::{Deserialize, Serialize};

use super::median;
use super::models::{BenchModel, Family};

mod launch;
mod report;

pub use launch::launch;

/// How one leg runs: one process, or two ranks splitting the model one way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    Single,
    Tensor,
    Pipeline,
}

impl Split {
    pub fn name(self) -> &'static str {
        match self {
            Split::Single => "single",
            Split::Tensor => "tensor",
            Split::Pipeline => "pipeline",
        }
    }

    pub fn ranks(self) -> usize {
        match self {
            Split::Single => 1,
            _ => 2,
        }
    }

    /// "1 rank", "tensor ×2", "pipeline ×2".
    pub fn label(self) -> String {
        match self {
            Split::Single => "1 rank".into(),
            s => format!("{} ×{}", s.name(), s.ranks()),
        }
    }
}

/// What one rank prints (the engine's `harness leg-dist` and `bench_dist_leg.py`): a
/// leg's line, as every suite's legs print it, with the rank.
#[derive(Debug, Clone, Deserialize)]
pub struct RankLeg {
    pub rank: usize,
    #[serde(flatten)]
    pub leg: super::Leg,
}

/// A bench model as the suite runs it: a name, a directory both stacks can shard, and the
/// splits the family has in mlx-lm 0.32.2.
pub struct DistModel {
    pub name: String,
    pub dir: PathBuf,
    pub splits: Vec<Split>,
}

/// The suite's view of a bench model, generated once next to it in the bench cache:
/// Llama-layout models become their qwen2 form (the same weights, zero q/k/v biases:
/// mlx-lm's llama has tensor parallel only, its qwen2 both), qwen3_moe is kept as is; both
/// get the `model.safetensors.index.json` mlx-lm's pipelined `sharded_load` reads.
pub fn prepare(model: &BenchModel) -> Result<DistModel> {
    let (name, splits) = match model.family {
        Family::Llama => (format!("{}-qwen2", model.name), all_splits()),
        Family::Qwen3Moe => (model.name.to_owned(), all_splits()),
        _ => bail!(
            "the distributed suite runs on the Llama-layout bench models (as qwen2) and \
             moe-tiny (qwen3_moe); `{}` is a family mlx-lm 0.32.2 does not shard",
            model.name
        ),
    };
    let src = model.ensure()?;
    let dir = src.with_file_name(format!(
        "{}-dist",
        src.file_name().unwrap().to_string_lossy()
    ));
    let index = dir.join("model.safetensors.index.json");
    if !index.is_file() {
        write_view(model, &src, &dir)?;
    }
    Ok(DistModel { name, dir, splits })
}

fn all_splits() -> Vec<Split> {
    vec![Split::Single, Split::Tensor, Split::Pipeline]
}

/// Writes `dir` (through a temporary sibling, renamed): config, weights, index.
fn write_view(model: &BenchModel, src: &Path, dir: &Path) -> Result<()> {
    let tmp = dir.with_extension(format!("partial-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp)?;
    let mut config = model.config();
    let mut weights = Array::load_safetensors(src.join("model.safetensors"))
        .map_err(|e| anyhow::anyhow!("reading the bench model's weights: {e}"))?;
    if model.family == Family::Llama {
        config["model_type"] = "qwen2".into();
        config["architectures"] = serde_json::json!(["Qwen2ForCausalLM"]);
        for l in 0..model.layers {
            for p in ["q", "k", "v"] {
                let w = &weights[&format!("model.layers.{l}.self_attn.{p}_proj.weight")];
                let bias = mlx_rs::ops::zeros_dtype(&[w.shape()[0]], Dtype::Bfloat16)?;
                bias.eval()?;
                weights.insert(format!("model.layers.{l}.self_attn.{p}_proj.bias"), bias);
            }
        }
    }
    let meta = HashMap::from([("format".to_owned(), "mlx".to_owned())]);
    Array::save_safetensors(weights.iter(), &meta, tmp.join("model.safetensors"))?;
    std::fs::write(
        tmp.join("config.json"),
        serde_json::to_string_pretty(&config)?,
    )?;
    let mut names: Vec<&String> = weights.keys().collect();
    names.sort();
    let map: serde_json::Map<String, serde_json::Value> = names
        .into_iter()
        .map(|k| (k.clone(), "model.safetensors".into()))
        .collect();
    std::fs::write(
        tmp.join("model.safetensors.index.json"),
        serde_json::to_string_pretty(&serde_json::json!({"metadata": {}, "weight_map": map}))?,
    )?;
    match std::fs::rename(&tmp, dir) {
        Ok(()) => Ok(()),
        Err(_) if dir.join("model.safetensors.index.json").is_file() => {
            let _ = std::fs::remove_dir_all(&tmp);
            Ok(())
        }
        Err(e) => Err(e.into()),
    }
}

/// `harness leg-dist`: one engine rank of a leg in this fresh process (without MLX_RANK,
/// the single-process leg).
#[derive(clap::Args)]
pub struct LegArgs {
    #[arg(long)]
    model: PathBuf,
    #[arg(long)]
    prompt_ids: PathBuf,
    #[arg(long)]
    max_tokens: usize,
    /// Split layers (pipeline) instead of heads and features (tensor).
    #[arg(long)]
    pipeline: bool,
    /// Seconds to wait for the group to form, and for a step's peer.
    #[arg(long, default_value_t = 60.0, value_parser = engine::dist::seconds)]
    dist_timeout: f64,
}

pub fn leg(args: LegArgs) -> Result<()> {
    let dist = engine::dist::DistArgs {
        pipeline: args.pipeline,
        dist_backend: "ring".into(),
        dist_connect_timeout: args.dist_timeout,
        dist_timeout: args.dist_timeout,
    };
    let group = engine::dist::init(&dist)?;
    let rank = group.map_or(0, |g| g.rank);
    // A load refusal is an ordinary error (exit 1), as in `engine generate`.
    let model = engine::model::load(&args.model)?;
    match measure(model.as_ref(), &args, rank, group.is_some()) {
        Ok(line) => {
            println!("{line}");
            Ok(())
        }
        // A failed collective leaves the ring unusable: exit (status 4) so the peer stops.
        Err(e) if group.is_some() => engine::dist::fatal(&format!("{e:#}")),
        Err(e) => Err(e),
    }
}

fn measure(
    model: &dyn engine::model::LanguageModel,
    args: &LegArgs,
    rank: usize,
    grouped: bool,
) -> Result<String> {
    let ids: Vec<u32> = serde_json::from_str(&std::fs::read_to_string(&args.prompt_ids)?)?;
    let opts = engine::generate::SessionOptions::default();
    let r = engine::generate::bench::run_leg(model, &ids, args.max_tokens, "engine", &opts)?;
    if grouped {
        // No rank exits while a peer still needs it.
        engine::dist::finish()?;
    }
    #[derive(Serialize)]
    struct Printed {
        rank: usize,
        #[serde(flatten)]
        leg: engine::generate::bench::LegResult,
    }
    Ok(serde_json::to_string(&Printed { rank, leg: r })?)
}

/// The command for one rank of `stack` under `split`.
fn rank_command(
    stack: &str,
    split: Split,
    dir: &Path,
    ids: &Path,
    max_tokens: usize,
) -> Result<Command> {
    let mut c = if stack == "engine" {
        let mut c = Command::new(std::env::current_exe()?);
        c.arg("leg-dist");
        if split == Split::Pipeline {
            c.arg("--pipeline");
        }
        c
    } else {
        let mut c = Command::new(crate::oracle::python());
        c.arg(crate::oracle::repo_root().join("oracles/bench_dist_leg.py"))
            .arg("--mode")
            .arg(split.name());
        c
    };
    c.arg("--model")
        .arg(dir)
        .arg("--prompt-ids")
        .arg(ids)
        .arg("--max-tokens")
        .arg(max_tokens.to_string());
    Ok(c)
}

/// The medians of one (split, stack): rank 0's timings, every rank's peak memory.
#[derive(Debug, Clone)]
pub struct DistMetrics {
    pub decode_tps: f64,
    pub prefill_tps: f64,
    pub ttft_ms: f64,
    pub peak_mb: Vec<f64>,
}

impl DistMetrics {
    fn of(legs: &[Vec<RankLeg>]) -> Self {
        let rank0 = |f: fn(&RankLeg) -> f64| median(legs.iter().map(|l| f(&l[0])).collect());
        let ranks = legs.first().map_or(0, Vec::len);
        DistMetrics {
            decode_tps: rank0(|l| l.leg.decode_tps),
            prefill_tps: rank0(|l| l.leg.prefill_tps),
            ttft_ms: rank0(|l| l.leg.ttft_s * 1e3),
            peak_mb: (0..ranks)
                .map(|r| {
                    median(
                        legs.iter()
                            .map(|l| l[r].leg.peak_memory_bytes / 1e6)
                            .collect(),
                    )
                })
                .collect(),
        }
    }

    /// (metric, value, unit): one row each.
    pub fn rows(&self) -> Vec<(String, f64, &'static str)> {
        let mut v = vec![
            ("decode_tps".to_owned(), self.decode_tps, "tok/s"),
            ("prefill_tps".to_owned(), self.prefill_tps, "tok/s"),
            ("ttft_ms".to_owned(), self.ttft_ms, "ms"),
        ];
        for (r, mb) in self.peak_mb.iter().enumerate() {
            v.push((format!("peak_memory_mb_rank{r}"), *mb, "MB"));
        }
        v
    }
}

/// One (split, stack) of a run: its medians, or why its legs failed.
pub struct Cell {
    pub split: Split,
    pub stack: &'static str,
    pub result: Result<DistMetrics, String>,
}

pub struct DistResult {
    pub model: String,
    pub cells: Vec<Cell>,
    /// Every leg's figures, its stack named `kept_stack(stack, split)`, as they ran.
    pub kept: super::kept::Kept,
}

/// A (stack, split)'s name among the kept legs.
pub fn kept_stack(stack: &str, split: Split) -> String {
    format!("{stack} {}", split.label())
}

pub struct Options {
    pub rounds: usize,
    pub prompt_tokens: usize,
    pub max_tokens: usize,
    pub peer: bool,
    /// Bound on one leg (all its ranks), in seconds.
    pub leg_timeout: Duration,
}

/// Runs every (split, stack) of `model` over the rounds, ABBA. A (split, stack) whose leg
/// fails is reported with the error and not run again; the others go on.
pub fn run(model: &BenchModel, opts: &Options) -> Result<DistResult> {
    let pb = super::spinner(format!("preparing bench model {} for ranks", model.name));
    let dm = prepare(model)?;
    pb.finish_and_clear();
    let stacks: Vec<&'static str> = if opts.peer {
        vec!["engine", "mlx-lm"]
    } else {
        vec!["engine"]
    };
    let combos: Vec<(Split, &'static str)> = dm
        .splits
        .iter()
        .flat_map(|&s| stacks.iter().map(move |&k| (s, k)))
        .collect();
    let tmp = tempfile::tempdir()?;
    let ids_file = tmp.path().join("ids.json");
    let ids = super::prompt_ids(opts.prompt_tokens, model.vocab, model.seed);
    std::fs::write(&ids_file, serde_json::to_string(&ids)?)?;
    let order = order(opts.rounds, combos.len());
    let bar = super::Progress::new("distributed", order.len());
    let mut legs: Vec<Vec<Vec<RankLeg>>> = vec![Vec::new(); combos.len()];
    let mut failed: Vec<Option<String>> = vec![None; combos.len()];
    let mut kept = super::kept::Kept::default();
    for i in order {
        let (split, stack) = combos[i];
        let what = format!("{stack} {}", split.label());
        bar.start(format!("{} · {what}", dm.name));
        if failed[i].is_some() {
            bar.done();
            continue;
        }
        let make = || rank_command(stack, split, &dm.dir, &ids_file, opts.max_tokens);
        match launch(split.ranks(), &make, opts.leg_timeout, &what) {
            Ok(l) => {
                let figures = DistMetrics::of(std::slice::from_ref(&l)).rows();
                kept.push(
                    &kept_stack(stack, split),
                    figures.into_iter().map(|(n, v, _)| (n, v)),
                );
                legs[i].push(l);
            }
            Err(e) => {
                bar.println(format!("{what}: {e:#}"));
                failed[i] = Some(format!("{e:#}"));
            }
        }
        bar.done();
    }
    bar.finish();
    let cells = combos
        .iter()
        .enumerate()
        .map(|(i, &(split, stack))| Cell {
            split,
            stack,
            result: match &failed[i] {
                Some(e) => Err(e.clone()),
                None => Ok(DistMetrics::of(&legs[i])),
            },
        })
        .collect();
    Ok(DistResult {
        model: dm.name,
        cells,
        kept,
    })
}

/// ABBA over `n` items: round r runs them in order when r is even, reversed when odd.
pub fn order(rounds: usize, n: usize) -> Vec<usize> {
    (0..rounds)
        .flat_map(|r| {
            let mut v: Vec<usize> = (0..n).collect();
            if r % 2 == 1 {
                v.reverse();
            }
            v
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn abba_over_every_split_and_stack() {
        assert_eq!(order(2, 3), [0, 1, 2, 2, 1, 0]);
        assert_eq!(Split::Tensor.label(), "tensor ×2");
        assert_eq!(Split::Single.ranks(), 1);
    }

    #[test]
    fn medians_take_rank_zero_timings_and_every_ranks_memory() {
        let leg = |rank, tps, peak| RankLeg {
            rank,
            leg: crate::bench::Leg {
                stack: "engine".into(),
                prompt_tokens: 8,
                generated_tokens: 4,
                ttft_s: 0.5,
                prefill_tps: 16.0,
                decode_tps: tps,
                peak_memory_bytes: peak,
                kv_bytes: None,
            },
        };
        let legs = vec![
            vec![leg(0, 10.0, 1e6), leg(1, 99.0, 3e6)],
            vec![leg(0, 30.0, 2e6), leg(1, 99.0, 4e6)],
            vec![leg(0, 20.0, 1e6), leg(1, 99.0, 5e6)],
        ];
        let m = DistMetrics::of(&legs);
        assert_eq!(m.decode_tps, 20.0);
        assert_eq!(m.peak_mb, vec![1.0, 4.0]);
        let names: Vec<String> = m.rows().into_iter().map(|r| r.0).collect();
        assert_eq!(
            names,
            [
                "decode_tps",
                "prefill_tps",
                "ttft_ms",
                "peak_memory_mb_rank0",
                "peak_memory_mb_rank1"
            ]
        );
    }
}
