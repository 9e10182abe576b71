//! `harness bench`: the engine against mlx-lm on the same model and the same prompt ids.
//! Every leg is a fresh process (a discarded warm-up inside it, then one measured run);
//! legs alternate ABBA over the rounds; each metric is the median over the rounds.
//! Preflight runs before and after: `--clean` refuses a dirty machine, and a run that went
//! dirty is tagged `went-dirty` and never promoted.

pub mod batch_spec;
pub mod constrain;
pub mod distributed;
pub mod hostile;
pub mod kept;
pub mod models;
pub mod progress;
pub mod ready;
pub mod restart;
pub mod serve;
pub mod spec;
pub mod spread;
pub mod train;
pub mod train_grpo;
pub mod train_leg;
pub mod train_pref;
pub mod train_promote;

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Deserialize;

use crate::db::{Db, Row};
use crate::preflight::{self, MachineState, Thresholds};
use models::BenchModel;
pub use progress::Progress;

/// What one leg prints (the engine's and `oracles/bench_leg.py`'s JSON line).
#[derive(Debug, Clone, Deserialize)]
pub struct Leg {
    pub stack: String,
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    pub ttft_s: f64,
    pub prefill_tps: f64,
    pub decode_tps: f64,
    pub peak_memory_bytes: f64,
    /// KV cache bytes after the run (engine legs only).
    #[serde(default)]
    pub kv_bytes: Option<f64>,
}

pub struct Options {
    pub models: Vec<BenchModel>,
    pub rounds: spread::Rounds,
    /// The prompt lengths to measure at (one: a plain run; several: a context sweep, one
    /// set of rows per length).
    pub contexts: Vec<usize>,
    pub max_tokens: usize,
    pub peer: bool,
    /// Add an eager-decode engine leg ("engine-eager").
    pub eager: bool,
    /// Add the L2 and L3 presets ("engine-l2", "engine-l3"; the default engine is L1).
    pub tiers: bool,
    pub clean: bool,
    pub force: bool,
}

/// Deterministic prompt ids in [0, vocab) (a 64-bit LCG; no RNG crate needed).
pub fn prompt_ids(n: usize, vocab: i32, seed: u64) -> Vec<u32> {
    let mut state = seed ^ 0x9E37_79B9_7F4A_7C15;
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((state >> 33) % vocab as u64) as u32
        })
        .collect()
}

pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Runs one fresh-process leg and parses the JSON line it prints last; a failed leg is an
/// error naming it and quoting its stderr.
pub fn run_json_leg<T: serde::de::DeserializeOwned>(cmd: &mut Command, what: &str) -> Result<T> {
    let out = cmd
        .output()
        .with_context(|| format!("starting the {what} leg"))?;
    if !out.status.success() {
        bail!(
            "{what} leg failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .with_context(|| format!("the {what} leg printed no JSON"))?;
    Ok(serde_json::from_str(line)?)
}

/// ABBA: round r runs A then B when r is even, B then A when odd.
pub fn leg_order(rounds: usize, stacks: &[&'static str]) -> Vec<&'static str> {
    (0..rounds)
        .flat_map(|r| {
            let mut s = stacks.to_vec();
            if r % 2 == 1 {
                s.reverse();
            }
            s
        })
        .collect()
}

fn run_leg(stack: &str, model_dir: &Path, ids_file: &Path, max_tokens: usize) -> Result<Leg> {
    let mut cmd = match stack {
        "engine" | "engine-eager" | "engine-l2" | "engine-l3" => {
            let mut c = Command::new(std::env::current_exe()?);
            c.arg("leg-engine").arg("--stack").arg(stack);
            match stack {
                "engine-eager" => {
                    c.arg("--no-compile");
                }
                "engine-l2" => {
                    c.arg("--l2");
                }
                "engine-l3" => {
                    c.arg("--l3");
                }
                _ => {}
            }
            c
        }
        _ => {
            let mut c = Command::new(crate::oracle::python());
            c.arg(crate::oracle::repo_root().join("oracles/bench_leg.py"));
            if stack == "mlx-optiq" {
                c.arg("--optiq-kv-config")
                    .arg(model_dir.join("kv_config.json"));
            }
            c
        }
    };
    cmd.arg("--model")
        .arg(model_dir)
        .arg("--prompt-ids")
        .arg(ids_file)
        .arg("--max-tokens")
        .arg(max_tokens.to_string());
    run_json_leg(&mut cmd, stack)
}

/// Median results per stack for one model at one prompt length.
pub struct ModelResult {
    pub model: BenchModel,
    pub prompt_tokens: usize,
    pub medians: Vec<(String, Metrics)>,
    /// Every leg's figures, in the order they ran (a stack's i-th leg ran in round i).
    pub legs: kept::Kept,
    pub rounds: usize,
    /// Why `--rounds auto` stopped adding rounds (None: a fixed count).
    pub ended: Option<String>,
}

#[derive(Debug, Clone, Copy, Default)]
pub struct Metrics {
    pub decode_tps: f64,
    pub prefill_tps: f64,
    pub ttft_ms: f64,
    pub peak_mb: f64,
    /// NaN where the stack does not report it (the Python peer).
    pub kv_mb: f64,
}

impl Metrics {
    /// The figures a kept leg stores (NaN ones left out).
    pub fn figures(&self) -> Vec<(String, f64)> {
        self.named()
            .into_iter()
            .filter(|(_, v, _, _)| !v.is_nan())
            .map(|(n, v, _, _)| (n.to_owned(), v))
            .collect()
    }

    pub fn named(&self) -> [(&'static str, f64, &'static str, bool); 5] {
        // (metric, value, unit, higher is better)
        [
            ("decode_tps", self.decode_tps, "tok/s", true),
            ("prefill_tps", self.prefill_tps, "tok/s", true),
            ("ttft_ms", self.ttft_ms, "ms", false),
            ("peak_memory_mb", self.peak_mb, "MB", false),
            ("kv_memory_mb", self.kv_mb, "MB", false),
        ]
    }
}

/// A leg's figures in the table's units.
fn metrics(l: &Leg) -> Metrics {
    Metrics {
        decode_tps: l.decode_tps,
        prefill_tps: l.prefill_tps,
        ttft_ms: l.ttft_s * 1e3,
        peak_mb: l.peak_memory_bytes / 1e6,
        kv_mb: l.kv_bytes.map_or(f64::NAN, |b| b / 1e6),
    }
}

/// Each figure's median over `stack`'s legs.
fn medians(legs: &kept::Kept, stack: &str) -> Metrics {
    let m = |figure: &str| legs.median(stack, figure);
    Metrics {
        decode_tps: m("decode_tps"),
        prefill_tps: m("prefill_tps"),
        ttft_ms: m("ttft_ms"),
        peak_mb: m("peak_memory_mb"),
        kv_mb: m("kv_memory_mb"),
    }
}

fn spinner(msg: String) -> ProgressBar {
    let pb = ProgressBar::new_spinner();
    pb.set_style(ProgressStyle::with_template("{spinner} {msg} ({elapsed})").unwrap());
    pb.enable_steady_tick(std::time::Duration::from_millis(120));
    pb.set_message(msg);
    pb
}

/// Creates the oracle venv if it is missing (first use), showing progress.
pub fn ensure_oracle_venv() -> Result<()> {
    if crate::oracle::python().exists() {
        return Ok(());
    }
    let pb = spinner("creating the oracle venv (oracles/setup.sh, first use only)".into());
    let out = Command::new("bash")
        .arg(crate::oracle::repo_root().join("oracles/setup.sh"))
        .output()
        .context("running oracles/setup.sh")?;
    pb.finish_and_clear();
    if !out.status.success() {
        bail!(
            "oracles/setup.sh failed:\n{}\n(or run with --no-peer to measure the engine alone)",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// Runs the whole benchmark; returns results and the before/after machine states.
pub fn run(opts: &Options) -> Result<(Vec<ModelResult>, MachineState, MachineState)> {
    let thresholds = Thresholds::from_env();
    let before = preflight::check(&thresholds);
    if !before.clean && !opts.force {
        let reasons = before
            .reasons
            .iter()
            .map(|r| format!("  - {r}"))
            .collect::<Vec<_>>()
            .join("\n");
        let what = if opts.clean {
            "--clean refuses to measure"
        } else {
            "refusing to measure"
        };
        bail!(
            "this machine is not clean, so {what}:\n{reasons}\nLet it settle (stop other work, wait for \
             the load to drop) and retry, or pass --force to measure anyway (rows are then tagged \
             dirty and never promoted)."
        );
    }
    if opts.peer {
        ensure_oracle_venv()?;
    }
    let mut stacks: Vec<&'static str> = vec!["engine"];
    if opts.eager {
        stacks.push("engine-eager");
    }
    if opts.tiers {
        stacks.extend(["engine-l2", "engine-l3"]);
        if opts.peer {
            stacks.push("mlx-optiq");
        }
    }
    if opts.peer {
        stacks.push("mlx-lm");
    }
    let first = match opts.rounds {
        spread::Rounds::Fixed(n) => n,
        spread::Rounds::Auto if opts.peer => spread::AUTO_FIRST,
        spread::Rounds::Auto => spread::AUTO_FIXED,
    };
    let tmp = tempfile::tempdir()?;
    let progress = Progress::new(
        "decode",
        opts.models.len() * opts.contexts.len() * first * stacks.len(),
    );
    let mut results = Vec::new();
    for model in &opts.models {
        progress.start(format!(
            "preparing bench model {} ({:.1} M params)",
            model.name,
            model.parameter_count()? as f64 / 1e6
        ));
        let dir = model.ensure()?;
        for &prompt_tokens in &opts.contexts {
            let ids = prompt_ids(prompt_tokens, model.vocab, model.seed);
            let ids_file: PathBuf = tmp
                .path()
                .join(format!("{}-{prompt_tokens}.json", model.name));
            std::fs::write(&ids_file, serde_json::to_string(&ids)?)?;
            let what = format!("{} · prompt {prompt_tokens}", model.name);
            let LegRounds {
                legs,
                rounds,
                ended,
            } = rounds_of_legs(opts, &stacks, first, &progress, &what, &dir, &ids_file)?;
            let medians = stacks
                .iter()
                .map(|s| (s.to_string(), medians(&legs, s)))
                .collect();
            results.push(ModelResult {
                model: *model,
                prompt_tokens,
                medians,
                legs,
                rounds,
                ended,
            });
        }
    }
    progress.finish();
    let after = preflight::check_since(&before, &thresholds);
    Ok((results, before, after))
}

/// One model and prompt length's legs, round after round (ABBA), until `opts.rounds` says
/// stop (`auto`: `spread::auto_ended`).
fn rounds_of_legs(
    opts: &Options,
    stacks: &[&'static str],
    first: usize,
    progress: &Progress,
    what: &str,
    dir: &Path,
    ids_file: &Path,
) -> Result<LegRounds> {
    let auto = opts.rounds == spread::Rounds::Auto && opts.peer;
    let mut legs = kept::Kept::default();
    let started = std::time::Instant::now();
    let mut rounds = 0;
    let ended = loop {
        for stack in leg_order(rounds + 1, stacks).split_off(rounds * stacks.len()) {
            progress.start(format!("{what} · {stack}"));
            let leg = run_leg(stack, dir, ids_file, opts.max_tokens)?;
            legs.push(stack, metrics(&leg).figures());
            progress.done();
        }
        rounds += 1;
        if !auto {
            if rounds >= first {
                break (opts.rounds == spread::Rounds::Auto)
                    .then(|| format!("no peer to compare with: {rounds} rounds"));
            }
            continue;
        }
        // Rounds are added in ABBA pairs, so each stack leads as often as it trails.
        if rounds >= first && rounds % 2 == 0 {
            let decode = legs.interval("engine", "mlx-lm", "decode_tps");
            if let Some(why) = spread::auto_ended(decode.as_ref(), rounds, started.elapsed()) {
                break Some(why);
            }
        }
        if rounds >= first {
            progress.add_legs(stacks.len());
        }
    };
    Ok(LegRounds {
        legs,
        rounds,
        ended,
    })
}

/// What `rounds_of_legs` ran (as `ModelResult` keeps it).
struct LegRounds {
    legs: kept::Kept,
    rounds: usize,
    ended: Option<String>,
}

/// The table printed after a run: each metric per stack, and engine / mlx-lm.
pub fn table(results: &[ModelResult]) -> String {
    type Cell = Option<(&'static str, f64, &'static str, bool)>;
    let fmt = |v: Cell| v.map_or("-".to_owned(), |x| format!("{:.1}", x.1));
    let ratio = |a: Cell, b: Cell| match (a, b) {
        (Some(a), Some(b)) if b.1 > 0.0 => format!("{:.2}x", a.1 / b.1),
        _ => "-".to_owned(),
    };
    let mut s = format!(
        "{:<10} {:<22} {:>10} {:>12} {:>10} {:>11} {:>15}\n",
        "model", "metric", "engine", "engine-eager", "mlx-lm", "eng/mlx-lm", "compiled/eager"
    );
    let sweep = results
        .iter()
        .any(|r| r.prompt_tokens != results[0].prompt_tokens);
    // One prompt length: the model's name; a context sweep: name@length.
    let label = |r: &ModelResult| {
        if sweep {
            format!("{}@{}", r.model.name, r.prompt_tokens)
        } else {
            r.model.name.to_owned()
        }
    };
    for r in results {
        let find = |name: &str| r.medians.iter().find(|(k, _)| k == name).map(|(_, m)| *m);
        let (engine, eager, peer) = (find("engine"), find("engine-eager"), find("mlx-lm"));
        for i in 0..5 {
            let (e, g, p): (Cell, Cell, Cell) = (
                engine.map(|m| m.named()[i]),
                eager.map(|m| m.named()[i]),
                peer.map(|m| m.named()[i]),
            );
            let (name, unit) = e.or(p).map(|x| (x.0, x.2)).unwrap_or(("?", ""));
            s.push_str(&format!(
                "{:<10} {:<22} {:>10} {:>12} {:>10} {:>11} {:>15}\n",
                label(r),
                format!("{name} ({unit})"),
                fmt(e),
                fmt(g),
                fmt(p),
                ratio(e, p),
                ratio(e, g)
            ));
        }
    }
    if results
        .iter()
        .any(|r| r.medians.iter().any(|(k, _)| k == "engine-l2"))
    {
        s.push_str(&format!(
            "\n{:<10} {:<22} {:>10} {:>10} {:>10} {:>10} {:>9} {:>9} {:>9}\n",
            "model", "metric", "L1", "L2", "L3", "optiq", "L2/L1", "L3/L2", "L2/optiq"
        ));
        for r in results {
            let find = |name: &str| r.medians.iter().find(|(k, _)| k == name).map(|(_, m)| *m);
            let (l1, l2, l3, optiq) = (
                find("engine"),
                find("engine-l2"),
                find("engine-l3"),
                find("mlx-optiq"),
            );
            for i in [0, 4] {
                let (a, b, c, o): (Cell, Cell, Cell, Cell) = (
                    l1.map(|m| m.named()[i]),
                    l2.map(|m| m.named()[i]),
                    l3.map(|m| m.named()[i]),
                    optiq.map(|m| m.named()[i]),
                );
                let (name, unit) = a.map(|x| (x.0, x.2)).unwrap_or(("?", ""));
                s.push_str(&format!(
                    "{:<10} {:<22} {:>10} {:>10} {:>10} {:>10} {:>9} {:>9} {:>9}\n",
                    label(r),
                    format!("{name} ({unit})"),
                    fmt(a),
                    fmt(b),
                    fmt(c),
                    fmt(o),
                    ratio(b, a),
                    ratio(c, b),
                    ratio(b, o)
                ));
            }
        }
    }
    s
}

/// What every row of one bench run records about it: tags (rounds, order, how legs ran,
/// dirty or went dirty), the preflight verdict, and the machine state before and after.
pub fn run_labels(
    rounds: usize,
    legs: &str,
    before: &MachineState,
    after: &MachineState,
) -> Result<(Vec<String>, &'static str, String)> {
    let tags = vec![
        format!("median-of-{rounds}"),
        "abba".to_owned(),
        legs.to_owned(),
    ];
    machine_labels(tags, before, after)
}

/// `tags` plus the machine's: dirty before (`forced-dirty`) or during (`went-dirty`) the
/// run; the preflight verdict (clean only if clean before and after) and both states as
/// JSON. Every measured row (benches, the quality suite) is labelled this way.
pub fn machine_labels(
    mut tags: Vec<String>,
    before: &MachineState,
    after: &MachineState,
) -> Result<(Vec<String>, &'static str, String)> {
    if !before.clean {
        tags.push("forced-dirty".into());
    }
    if before.clean && !after.clean {
        tags.push("went-dirty".into());
    }
    let preflight = if before.clean && after.clean {
        "clean"
    } else {
        "dirty"
    };
    let state = serde_json::to_string(&serde_json::json!({"before": before, "after": after}))?;
    Ok((tags, preflight, state))
}

/// Stores one row per (model, stack, metric).
pub fn record(
    db: &Db,
    opts: &Options,
    results: &[ModelResult],
    before: &MachineState,
    after: &MachineState,
) -> Result<usize> {
    let fewest = results.iter().map(|r| r.rounds).min().unwrap_or(0);
    let (mut tags, preflight, state) = run_labels(fewest, "fresh-process-legs", before, after)?;
    if opts.rounds == spread::Rounds::Auto {
        tags.push("rounds-auto".into());
    }
    if opts.contexts.len() > 1 {
        // The rows of one sweep share this tag (and their timestamp): promote plots them.
        tags.push("context-sweep".into());
    }
    let mut n = 0;
    for r in results {
        for (stack, metrics) in &r.medians {
            for (metric, value, unit, _) in metrics.named() {
                if value.is_nan() {
                    continue;
                }
                let peer = match stack.as_str() {
                    "engine-l2" | "engine-l3" if opts.peer => Some("mlx-optiq"),
                    s if s.starts_with("engine") && opts.peer => Some("mlx-lm"),
                    _ => None,
                };
                db.insert(&Row {
                    ts: after.at.clone(),
                    commit: before.commit.clone(),
                    dirty: before.dirty,
                    machine_key: before.machine_key.clone(),
                    machine_state: state.clone(),
                    preflight: preflight.into(),
                    suite: "decode".into(),
                    model: r.model.name.into(),
                    metric: metric.into(),
                    value,
                    unit: unit.into(),
                    stack: stack.clone(),
                    peer: peer.map(str::to_owned),
                    // Every leg's figure, and the ratio's interval against the peer's legs.
                    params: r
                        .legs
                        .row_params(
                            serde_json::json!({
                                "prompt_tokens": r.prompt_tokens,
                                "max_tokens": opts.max_tokens,
                                "rounds": r.rounds,
                                "rounds_ended": r.ended,
                                "params_m": (r.model.parameter_count()? as f64 / 1e5).round() / 10.0,
                            }),
                            stack,
                            peer,
                            metric,
                        )
                        .to_string(),
                    tags: tags.join(" "),
                })?;
                n += 1;
            }
        }
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn abba_order_and_medians() {
        assert_eq!(
            leg_order(4, &["e", "p"]),
            ["e", "p", "p", "e", "e", "p", "p", "e"]
        );
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), 2.5);
    }

    #[test]
    fn prompt_ids_are_deterministic_and_in_range() {
        let a = prompt_ids(100, 4096, 7);
        assert_eq!(a, prompt_ids(100, 4096, 7));
        assert_ne!(a, prompt_ids(100, 4096, 8));
        assert!(a.iter().all(|&i| i < 4096));
    }
}
