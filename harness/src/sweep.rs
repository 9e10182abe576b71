//! `harness sweep lambda`: the static-λ sweep against the dynamic-λ controller. Every run
//! is `engine train --method orpo` (in this process, one after another) on a synthetic
//! preference set × a tiny trained model × a seed, for each static λ and each adaptive law;
//! per run the final validation accuracy, margin, ℓw and ℓw's drop from its best (a
//! coherence signal), and the λ/ℓw/ℓr trajectories for the plots.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde_json::Value;

pub const STATIC: [f64; 5] = [0.05, 0.1, 0.2, 0.5, 1.0];
pub const LAWS: [&str; 4] = ["aimd", "p", "pd", "pid"];
pub const DATASETS: [&str; 2] = ["uppercase", "brevity"];
pub const MODELS: [&str; 2] = ["tiny-llama-trained", "tiny-llama-draft"];

#[derive(Debug, Clone, serde::Serialize)]
pub struct Run {
    pub dataset: String,
    pub model: String,
    pub config: String,
    pub seed: u64,
    pub accuracy: f64,
    pub margin: f64,
    pub lw: f64,
    pub lw_drop: f64,
    pub lambda_changes: usize,
    /// (step, λ, ℓw, ℓr) at each eval.
    pub trace: Vec<(f64, f64, f64, f64)>,
}

/// One run of the study: its data, model, λ configuration (`static-<λ>` or
/// `adaptive-<law>`), seed, length and output directory.
struct RunSpec<'a> {
    data: &'a Path,
    model: &'a Path,
    config: &'a str,
    seed: u64,
    iters: usize,
    out: &'a Path,
}

/// One `engine train --method orpo` run of the study, and what its metrics.jsonl says.
fn run_one(spec: &RunSpec) -> Result<Run> {
    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        train: engine::train::cli::TrainArgs,
    }
    let cli = <Cli as clap::Parser>::try_parse_from(train_argv(spec))?;
    engine::train::cli::run(cli.train)?;
    let metrics = spec.out.join("metrics.jsonl");
    results(spec.data, spec.model, spec.config, spec.seed, &metrics)
}

/// The `engine train` command line of one run: the study's fixed settings, then the run's
/// data, model, length, seed, output and λ configuration.
fn train_argv(spec: &RunSpec) -> Vec<String> {
    let RunSpec {
        data,
        model,
        config,
        seed,
        iters,
        out,
    } = *spec;
    let mut argv: Vec<String> = [
        "engine",
        "--method",
        "orpo",
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
        "--steps-per-eval",
        "10",
        "--val-batches",
        "0",
        "--quiet",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    argv.extend([
        "--model".into(),
        model.display().to_string(),
        "--data".into(),
        data.display().to_string(),
    ]);
    argv.extend([
        "--iters".into(),
        iters.to_string(),
        "--seed".into(),
        seed.to_string(),
    ]);
    argv.extend([
        "--adapter-path".into(),
        out.display().to_string(),
        "--save-every".into(),
        "0".into(),
    ]);
    match config.strip_prefix("static-") {
        Some(l) => argv.extend(["--orpo-lambda".into(), l.into()]),
        None => argv.extend([
            "--orpo-lambda-schedule".into(),
            "adaptive".into(),
            "--lambda-law".into(),
            config.strip_prefix("adaptive-").unwrap_or(config).into(),
        ]),
    }
    argv
}

fn file_name(p: &Path) -> String {
    p.file_name()
        .unwrap_or_default()
        .to_string_lossy()
        .into_owned()
}

/// A run's results from its `metrics` (metrics.jsonl): the last eval's accuracy, margin and
/// ℓw, ℓw's drop from its best after the first eval, the λ changes and the per-eval trace.
fn results(data: &Path, model: &Path, config: &str, seed: u64, metrics: &Path) -> Result<Run> {
    let text = std::fs::read_to_string(metrics)?;
    let lines: Vec<Value> = text
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let evals: Vec<&Value> = lines.iter().filter(|v| v["type"] == "eval").collect();
    let last = evals.last().context("no eval")?;
    let f = |v: &Value, k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    let best_lw = evals
        .iter()
        .skip(1)
        .map(|v| f(v, "lw"))
        .fold(f64::NEG_INFINITY, f64::max);
    Ok(Run {
        dataset: file_name(data),
        model: file_name(model),
        config: config.into(),
        seed,
        accuracy: f(last, "accuracy"),
        margin: f(last, "margin"),
        lw: f(last, "lw"),
        lw_drop: best_lw - f(last, "lw"),
        // The controller also logs its noise calibration and the phase flips that keep λ
        // (from = to): only a moved λ is a change.
        lambda_changes: lines
            .iter()
            .filter(|v| v["type"] == "lambda" && v["from"] != v["to"])
            .count(),
        trace: evals
            .iter()
            .map(|v| (f(v, "step"), f(v, "lambda"), f(v, "lw"), f(v, "lr")))
            .collect(),
    })
}

/// Every run of the study; `progress` after each.
pub fn run(
    seeds: &[u64],
    iters: usize,
    out: &Path,
    mut progress: impl FnMut(&Run),
) -> Result<Vec<Run>> {
    let configs: Vec<String> = STATIC
        .iter()
        .map(|l| format!("static-{l}"))
        .chain(LAWS.iter().map(|l| format!("adaptive-{l}")))
        .collect();
    let mut runs = Vec::new();
    for dataset in DATASETS {
        for model in MODELS {
            for config in &configs {
                for &seed in seeds {
                    let dir: PathBuf = out.join(format!("{dataset}/{model}/{config}/seed{seed}"));
                    let r = run_one(&RunSpec {
                        data: &crate::goldens::goldens_root().join("data").join(dataset),
                        model: &crate::goldens::model_dir(model)?,
                        config,
                        seed,
                        iters,
                        out: &dir,
                    })?;
                    progress(&r);
                    runs.push(r);
                }
            }
        }
    }
    Ok(runs)
}

fn mean_sd(xs: &[f64]) -> (f64, f64) {
    let n = xs.len().max(1) as f64;
    let m = xs.iter().sum::<f64>() / n;
    let v = xs.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
    (m, v.sqrt())
}

/// Per (dataset, model, config): mean ± sd over seeds of accuracy, margin, ℓw, ℓw drop.
pub fn table(runs: &[Run]) -> String {
    let mut s = String::from(
        "| dataset | model | config | val accuracy | margin | final ℓw | ℓw drop from best | λ changes |\n|---|---|---|---|---|---|---|---|\n",
    );
    let mut keys: Vec<(String, String, String)> = Vec::new();
    for r in runs {
        let k = (r.dataset.clone(), r.model.clone(), r.config.clone());
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    for (d, m, c) in keys {
        let mine: Vec<&Run> = runs
            .iter()
            .filter(|r| r.dataset == d && r.model == m && r.config == c)
            .collect();
        let stat = |f: fn(&Run) -> f64| mean_sd(&mine.iter().map(|r| f(r)).collect::<Vec<_>>());
        let (a, asd) = stat(|r| r.accuracy);
        let (mg, mgsd) = stat(|r| r.margin);
        let (lw, lwsd) = stat(|r| r.lw);
        let (dr, drsd) = stat(|r| r.lw_drop);
        let changes: usize = mine.iter().map(|r| r.lambda_changes).sum();
        s += &format!(
            "| {d} | {m} | {c} | {a:.2} ± {asd:.2} | {mg:.3} ± {mgsd:.3} | {lw:.3} ± {lwsd:.3} | {dr:.3} ± {drsd:.3} | {changes} |\n"
        );
    }
    s
}

/// One SVG per (dataset, model): λ, ℓw and ℓr over steps for every config, first seed.
pub fn plots(runs: &[Run], dir: &Path) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir)?;
    let mut written = Vec::new();
    for d in DATASETS {
        for m in MODELS {
            let mine: Vec<&Run> = runs
                .iter()
                .filter(|r| r.dataset == d && r.model == m && r.seed == runs[0].seed)
                .collect();
            if mine.is_empty() {
                continue;
            }
            let path = dir.join(format!("lambda-{d}-{m}.svg"));
            engine::train::write_atomic(&path, svg(&format!("{d} · {m}"), &mine).as_bytes())
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            written.push(path);
        }
    }
    Ok(written)
}

/// (step, λ, ℓw, ℓr) → one of them.
type Getter = fn(&(f64, f64, f64, f64)) -> f64;

/// λ, ℓw and ℓr over steps, one line per config (`crate::plot`).
fn svg(title: &str, runs: &[&Run]) -> String {
    let panels: [(&str, Getter); 3] = [
        ("λ", |t| t.1),
        ("ℓw (chosen)", |t| t.2),
        ("ℓr (rejected)", |t| t.3),
    ];
    let fig = crate::plot::Figure {
        title: title.into(),
        legend: runs.iter().map(|r| r.config.clone()).collect(),
        panels: panels
            .iter()
            .enumerate()
            .map(|(p, (name, get))| crate::plot::Panel {
                title: (*name).into(),
                x_label: "step".into(),
                // ℓ panels skip the first eval (the untrained model), which would flatten
                // the rest.
                series: runs
                    .iter()
                    .map(|r| {
                        Some(crate::plot::Series {
                            name: r.config.clone(),
                            points: r
                                .trace
                                .iter()
                                .skip(usize::from(p > 0))
                                .map(|t| (t.0, get(t)))
                                .collect(),
                        })
                    })
                    .collect(),
                log_x: false,
                y_from_zero: false,
            })
            .collect(),
    };
    crate::plot::svg(&fig)
}
