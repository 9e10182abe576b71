//! `harness sweep lambda`: the static-λ sweep against the dynamic-λ controller. Every run
//! is `engine train --method orpo` (the `simpo` study: `--method simpo`, whose γ is the
//! weight swept and moved) on a preference set × a tiny trained model × a seed, for
//! each λ configuration (a static λ, or an adaptive law with optional knob overrides); per
//! run the final validation accuracy, margin, ℓw and ℓw's drop from its best (a coherence
//! signal), the controller's back-offs, and the λ/ℓw/ℓr trajectories for the plots.
//!
//! Runs go in-process one after another, or, with an `engine` binary, as child processes
//! (`jobs` at a time). A finished run leaves `result.json` in its directory and is reused
//! by the next sweep over the same directory, so an interrupted study resumes and a report
//! can be drawn while the rest still runs.

pub mod report;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

use anyhow::{bail, Context, Result};
use serde_json::Value;

pub use report::{plots, table, verdict, verdict_against};

/// The λ the trainer uses when none is given (`engine train --orpo-lambda`'s default).
pub const DEFAULT_STATIC: f64 = 0.1;

/// The objective a study trains and the weight it sweeps: ORPO's λ, or SimPO's γ.
#[derive(Debug, Clone, PartialEq)]
pub struct Objective {
    pub method: &'static str,
    /// The flag that sets the weight of a static config.
    pub static_flag: &'static str,
    /// The weight's key in eval lines.
    pub key: &'static str,
    /// The trainer's default value of the weight.
    pub default: f64,
    /// Further fixed flags of the method.
    pub extra: &'static [&'static str],
}

/// ORPO's λ (`--orpo-lambda`, default 0.1).
pub const ORPO: Objective = Objective {
    method: "orpo",
    static_flag: "--orpo-lambda",
    key: "lambda",
    default: DEFAULT_STATIC,
    extra: &[],
};

/// SimPO's γ (`--simpo-gamma`, TRL's default 0.5), at β 2 (the SimPO paper's range; TRL's
/// β 0.1 would shift the logits by γ/β = 5 at the default γ).
pub const SIMPO: Objective = Objective {
    method: "simpo",
    static_flag: "--simpo-gamma",
    key: "gamma",
    default: 0.5,
    extra: &["--beta", "2.0"],
};

/// The controller's knobs a config may override (`--lambda-<knob>`).
pub const KNOBS: [&str; 13] = [
    "min",
    "max",
    "step",
    "backoff",
    "k",
    "eps-sft",
    "eps-disp",
    "lr-drop",
    "hard-drop",
    "kp",
    "kd",
    "ki",
    "window",
];
pub const LAWS: [&str; 4] = ["aimd", "p", "pd", "pid"];

/// One λ configuration: `static-<λ>`, or `adaptive-<law>[+<knob>=<value>…]` (e.g.
/// `adaptive-aimd+max=2`: AIMD with `--lambda-max 2`).
#[derive(Debug, Clone, PartialEq)]
pub enum Config {
    Static(f64),
    Adaptive {
        law: String,
        knobs: Vec<(String, String)>,
    },
}

impl std::str::FromStr for Config {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if let Some(l) = s.strip_prefix("static-") {
            return match l.parse::<f64>() {
                Ok(v) if v.is_finite() && v >= 0.0 => Ok(Config::Static(v)),
                _ => Err(format!("`{s}`: static λ must be a number ≥ 0 (static-0.5)")),
            };
        }
        let Some(rest) = s.strip_prefix("adaptive-") else {
            return Err(format!(
                "`{s}`: expected static-<λ> or adaptive-<law>[+<knob>=<value>…]"
            ));
        };
        let mut parts = rest.split('+');
        let law = parts.next().unwrap_or_default();
        if !LAWS.contains(&law) {
            return Err(format!(
                "`{s}`: law `{law}` is not one of {}",
                LAWS.join(", ")
            ));
        }
        let mut knobs = Vec::new();
        for p in parts {
            let Some((k, v)) = p.split_once('=') else {
                return Err(format!("`{s}`: `{p}` is not <knob>=<value>"));
            };
            if !KNOBS.contains(&k) || v.is_empty() {
                return Err(format!(
                    "`{s}`: `{p}`: knobs are {} with a value",
                    KNOBS.join(", ")
                ));
            }
            knobs.push((k.to_string(), v.to_string()));
        }
        Ok(Config::Adaptive {
            law: law.into(),
            knobs,
        })
    }
}

impl std::fmt::Display for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Config::Static(l) => write!(f, "static-{l}"),
            Config::Adaptive { law, knobs } => {
                write!(f, "adaptive-{law}")?;
                knobs.iter().try_for_each(|(k, v)| write!(f, "+{k}={v}"))
            }
        }
    }
}

impl Config {
    /// The `engine train` flags that select this configuration of `objective`'s weight.
    pub fn args(&self, objective: &Objective) -> Vec<String> {
        match self {
            Config::Static(l) => vec![objective.static_flag.into(), l.to_string()],
            Config::Adaptive { law, knobs } => {
                let mut a: Vec<String> = vec![
                    "--orpo-lambda-schedule".into(),
                    "adaptive".into(),
                    "--lambda-law".into(),
                    law.clone(),
                ];
                for (k, v) in knobs {
                    a.extend([format!("--lambda-{k}"), v.clone()]);
                }
                a
            }
        }
    }
}

/// A whole study: what is crossed with what, and the fixed training settings.
#[derive(Debug, Clone)]
pub struct Study {
    pub name: String,
    pub objective: Objective,
    /// Preference-set directories (train.jsonl + valid.jsonl).
    pub datasets: Vec<PathBuf>,
    /// Model names under goldens/models.
    pub models: Vec<String>,
    pub configs: Vec<Config>,
    pub seeds: Vec<u64>,
    pub iters: usize,
    pub learning_rate: f64,
    pub steps_per_eval: usize,
}

impl Study {
    /// The study of 2026-11-30: uppercase and brevity, 120 iterations at lr 2e-3.
    pub fn classic() -> Self {
        let data = crate::goldens::goldens_root().join("data");
        Study {
            name: "classic".into(),
            objective: ORPO,
            datasets: vec![data.join("uppercase"), data.join("brevity")],
            models: vec!["tiny-llama-trained".into(), "tiny-llama-draft".into()],
            configs: configs(
                &["0.05", "0.1", "0.2", "0.5", "1"],
                &["aimd", "p", "pd", "pid"],
            ),
            seeds: vec![0, 1, 2],
            iters: 120,
            learning_rate: 2e-3,
            steps_per_eval: 10,
        }
    }

    /// The displacement study: two preference sets whose rejected response is the chosen
    /// one cut short (goldens/data/study/{complete,shout}), where a high λ can buy margin by
    /// lowering the shared prefix; 240 iterations; λ up to 5; the controller with the
    /// design's defaults (λ_max 0.5) and with room to find the cliff itself (λ_max 5,
    /// step 0.25, so 24 evals can reach it).
    pub fn displace() -> Self {
        let data = crate::goldens::goldens_root().join("data/study");
        Study {
            name: "displace".into(),
            objective: ORPO,
            datasets: vec![data.join("complete"), data.join("shout")],
            models: vec!["tiny-llama-draft".into(), "tiny-llama-trained".into()],
            configs: configs(
                &["0.05", "0.1", "0.2", "0.5", "1", "2", "5"],
                &["aimd", "aimd+max=5+step=0.25"],
            ),
            seeds: vec![0, 1, 2],
            iters: 240,
            learning_rate: 2e-3,
            steps_per_eval: 10,
        }
    }

    /// The displacement study's regime with SimPO's γ as the weight (issue 42: the
    /// controller as an actuator of a second objective): the same two preference sets, 240
    /// iterations, on tiny-llama-trained; static γ from 0.1 to 5 (TRL's default 0.5) and the
    /// same two adaptive configs.
    pub fn simpo() -> Self {
        let data = crate::goldens::goldens_root().join("data/study");
        Study {
            name: "simpo".into(),
            objective: SIMPO,
            datasets: vec![data.join("complete"), data.join("shout")],
            models: vec!["tiny-llama-trained".into()],
            configs: configs(
                &["0.1", "0.25", "0.5", "1", "2", "5"],
                &["aimd", "aimd+max=5+step=0.25"],
            ),
            seeds: vec![0, 1, 2],
            iters: 240,
            learning_rate: 2e-3,
            steps_per_eval: 10,
        }
    }

    pub fn named(name: &str) -> Result<Self> {
        match name {
            "classic" => Ok(Self::classic()),
            "displace" => Ok(Self::displace()),
            "simpo" => Ok(Self::simpo()),
            _ => bail!("unknown study `{name}`: classic, displace or simpo"),
        }
    }

    /// Every run, in the order they go: seeds innermost, so a partial study has all seeds
    /// of its first cells.
    pub fn specs(&self, out: &Path) -> Result<Vec<RunSpec>> {
        let mut specs = Vec::new();
        for data in &self.datasets {
            for model in &self.models {
                let model_dir = crate::goldens::model_dir(model)?;
                for config in &self.configs {
                    for &seed in &self.seeds {
                        let dir = out.join(format!("{}/{model}/{config}/seed{seed}", name(data)));
                        specs.push(RunSpec {
                            data: data.clone(),
                            model: model_dir.clone(),
                            config: config.clone(),
                            seed,
                            out: dir,
                        });
                    }
                }
            }
        }
        Ok(specs)
    }
}

/// `static-<λ>` for each λ, then `adaptive-<law>` for each law (knobs allowed).
fn configs(statics: &[&str], laws: &[&str]) -> Vec<Config> {
    statics
        .iter()
        .map(|l| format!("static-{l}"))
        .chain(laws.iter().map(|l| format!("adaptive-{l}")))
        .map(|c| c.parse().expect("a built-in config parses"))
        .collect()
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
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
    /// λ changes caused by displacement (back-offs) and hard stops.
    #[serde(default)]
    pub backoffs: usize,
    #[serde(default)]
    pub hard_stops: usize,
    /// λ at the last eval.
    #[serde(default)]
    pub final_lambda: f64,
    /// (step, λ, ℓw, ℓr) at each eval.
    pub trace: Vec<(f64, f64, f64, f64)>,
}

/// One run of a study: its data, model, λ configuration, seed and output directory.
#[derive(Debug, Clone)]
pub struct RunSpec {
    pub data: PathBuf,
    pub model: PathBuf,
    pub config: Config,
    pub seed: u64,
    pub out: PathBuf,
}

/// The `engine train` arguments of one run (after `train`): the study's fixed settings,
/// then the run's data, model, length, seed, output and λ configuration.
pub fn train_args(study: &Study, spec: &RunSpec) -> Vec<String> {
    let mut argv: Vec<String> = [
        "--method",
        study.objective.method,
        "--batch-size",
        "2",
        "--warmup",
        "10",
        "--num-layers",
        "3",
        "--lora-rank",
        "8",
        "--val-batches",
        "0",
        "--save-every",
        "0",
        "--quiet",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let path = |p: &Path| p.display().to_string();
    argv.extend([
        "--learning-rate".into(),
        study.learning_rate.to_string(),
        "--steps-per-eval".into(),
        study.steps_per_eval.to_string(),
        "--iters".into(),
        study.iters.to_string(),
        "--model".into(),
        path(&spec.model),
        "--data".into(),
        path(&spec.data),
        "--seed".into(),
        spec.seed.to_string(),
        "--adapter-path".into(),
        path(&spec.out),
    ]);
    argv.extend(study.objective.extra.iter().map(|s| s.to_string()));
    argv.extend(spec.config.args(&study.objective));
    argv
}

fn name(p: &Path) -> String {
    p.file_name()
        .unwrap_or_default()
        .to_string_lossy()
        .into_owned()
}

/// One run, in this process (`engine` None) or as `engine train …`; its metrics.jsonl's
/// results, also written to `result.json` in its directory.
fn run_one(study: &Study, spec: &RunSpec, engine: Option<&Path>) -> Result<Run> {
    let args = train_args(study, spec);
    match engine {
        None => {
            #[derive(clap::Parser)]
            struct Cli {
                #[command(flatten)]
                train: engine::train::cli::TrainArgs,
            }
            let argv = std::iter::once("engine".to_string()).chain(args);
            let cli = <Cli as clap::Parser>::try_parse_from(argv)?;
            engine::train::cli::run(cli.train)?;
        }
        Some(bin) => {
            std::fs::create_dir_all(&spec.out)?;
            let log = std::fs::File::create(spec.out.join("train.log"))?;
            let status = Command::new(bin)
                .arg("train")
                .args(&args)
                .stdout(log.try_clone()?)
                .stderr(log)
                .status()
                .with_context(|| format!("starting {}", bin.display()))?;
            if !status.success() {
                let text = std::fs::read_to_string(spec.out.join("train.log")).unwrap_or_default();
                let tail: String = text.lines().rev().take(5).collect::<Vec<_>>().join(" | ");
                bail!("{} failed ({status}): {tail}", spec.out.display());
            }
        }
    }
    let metrics = std::fs::read_to_string(spec.out.join("metrics.jsonl"))?;
    let r = results(spec, &metrics, &study.objective)?;
    std::fs::write(
        spec.out.join("result.json"),
        serde_json::to_string(&r)? + "\n",
    )?;
    Ok(r)
}

/// A finished run's results, if its directory has them: its result.json, or a
/// metrics.jsonl whose last eval is at the study's last step (a run of the same command
/// line made outside this sweep).
pub fn finished(study: &Study, spec: &RunSpec) -> Option<Run> {
    if let Ok(text) = std::fs::read_to_string(spec.out.join("result.json")) {
        return serde_json::from_str(&text).ok();
    }
    let metrics = std::fs::read_to_string(spec.out.join("metrics.jsonl")).ok()?;
    let r = results(spec, &metrics, &study.objective).ok()?;
    (r.trace.last()?.0 == study.iters as f64).then_some(r)
}

/// A run's results from its metrics.jsonl text: the last eval's accuracy, margin and ℓw,
/// ℓw's drop from its best after the first eval, the λ changes and the per-eval trace.
pub fn results(spec: &RunSpec, metrics: &str, objective: &Objective) -> Result<Run> {
    let lines: Vec<Value> = metrics
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let evals: Vec<&Value> = lines.iter().filter(|v| v["type"] == "eval").collect();
    let last = evals.last().context("no eval")?;
    let f = |v: &Value, k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    // ORPO's accuracy is ℓw > ℓr; the pair objectives log TRL's reward accuracy (the same
    // comparison for SimPO, whose rewards are β·ℓ).
    let accuracy = |v: &Value| {
        v.get("accuracy")
            .or_else(|| v.get("rewards/accuracies"))
            .and_then(Value::as_f64)
            .unwrap_or(f64::NAN)
    };
    let best_lw = evals
        .iter()
        .skip(1)
        .map(|v| f(v, "lw"))
        .fold(f64::NEG_INFINITY, f64::max);
    // The controller also logs its noise calibration and the phase flips that keep λ
    // (from = to): only a moved λ is a change.
    let lambda: Vec<&Value> = lines.iter().filter(|v| v["type"] == "lambda").collect();
    let caused = |p: &str| {
        lambda
            .iter()
            .filter(|v| v["cause"].as_str().unwrap_or("").starts_with(p))
            .count()
    };
    Ok(Run {
        dataset: name(&spec.data),
        model: name(&spec.model),
        config: spec.config.to_string(),
        seed: spec.seed,
        accuracy: accuracy(last),
        // ORPO logs the mean ℓw − ℓr; the pair objectives' margin is of rewards, so take
        // ℓw − ℓr from their scores (SimPO's means, as ORPO's).
        margin: last
            .get("margin")
            .and_then(Value::as_f64)
            .unwrap_or(f(last, "lw") - f(last, "lr")),
        lw: f(last, "lw"),
        lw_drop: best_lw - f(last, "lw"),
        lambda_changes: lambda.iter().filter(|v| v["from"] != v["to"]).count(),
        backoffs: caused("displacement"),
        hard_stops: caused("hard stop"),
        final_lambda: f(last, objective.key),
        trace: evals
            .iter()
            .map(|v| (f(v, "step"), f(v, objective.key), f(v, "lw"), f(v, "lr")))
            .collect(),
    })
}

/// Every run of `study` under `out` (finished ones reused); `progress` after each with
/// whether it ran now. `report_only`: no new runs, only the finished ones.
pub fn run(
    study: &Study,
    out: &Path,
    engine: Option<&Path>,
    jobs: usize,
    report_only: bool,
    progress: impl Fn(&Run, bool) + Sync,
) -> Result<Vec<Run>> {
    if engine.is_none() && jobs > 1 {
        bail!("--jobs > 1 needs --engine: in-process runs share one MLX and go one at a time");
    }
    let specs = study.specs(out)?;
    let slots: Vec<Mutex<Option<Run>>> = specs.iter().map(|_| Mutex::new(None)).collect();
    let next = Mutex::new(0usize);
    let failed: Mutex<Option<anyhow::Error>> = Mutex::new(None);
    let work = || loop {
        let i = {
            let mut n = next.lock().unwrap();
            *n += 1;
            *n - 1
        };
        if i >= specs.len() || failed.lock().unwrap().is_some() {
            return;
        }
        let r = match finished(study, &specs[i]) {
            Some(r) => Ok((r, false)),
            None if report_only => continue,
            None => run_one(study, &specs[i], engine).map(|r| (r, true)),
        };
        match r {
            Ok((r, fresh)) => {
                progress(&r, fresh);
                *slots[i].lock().unwrap() = Some(r);
            }
            Err(e) => *failed.lock().unwrap() = Some(e),
        }
    };
    std::thread::scope(|s| {
        for _ in 0..jobs.max(1) {
            s.spawn(work);
        }
    });
    if let Some(e) = failed.into_inner().unwrap() {
        return Err(e);
    }
    Ok(slots
        .into_iter()
        .filter_map(|m| m.into_inner().unwrap())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configs_parse_and_print_back() {
        for s in [
            "static-0.5",
            "static-2",
            "adaptive-aimd",
            "adaptive-pd+max=2",
            "adaptive-pid+max=2+eps-disp=1sigma",
        ] {
            let c: Config = s.parse().unwrap();
            assert_eq!(c.to_string(), s);
        }
        assert_eq!(
            "static-0.10".parse::<Config>().unwrap(),
            Config::Static(0.1)
        );
    }

    #[test]
    fn bad_configs_are_refused_with_the_syntax() {
        for (s, says) in [
            ("static-x", "number"),
            ("static--1", "number"),
            ("fixed-0.1", "expected static-<λ>"),
            ("adaptive-pi", "law `pi`"),
            ("adaptive-aimd+max", "<knob>=<value>"),
            ("adaptive-aimd+gain=2", "knobs are"),
            ("adaptive-aimd+max=", "knobs are"),
        ] {
            let e = s.parse::<Config>().unwrap_err();
            assert!(e.contains(says), "{s}: {e}");
        }
    }

    #[test]
    fn a_config_selects_its_engine_flags() {
        assert_eq!(
            Config::Static(0.2).args(&ORPO),
            ["--orpo-lambda", "0.2"].map(String::from)
        );
        let c: Config = "adaptive-pd+max=2+k=2".parse().unwrap();
        assert_eq!(
            c.args(&ORPO).join(" "),
            "--orpo-lambda-schedule adaptive --lambda-law pd --lambda-max 2 --lambda-k 2"
        );
    }

    fn spec(config: &str) -> RunSpec {
        RunSpec {
            data: "d/swap".into(),
            model: "m/tiny-llama-draft".into(),
            config: config.parse().unwrap(),
            seed: 1,
            out: "o".into(),
        }
    }

    #[test]
    fn results_count_moves_backoffs_and_take_the_last_eval() {
        let metrics = r#"{"type":"eval","step":1,"lambda":0.05,"lw":-9.0,"lr":-9.0,"accuracy":0.5,"margin":0.0}
{"type":"lambda","step":1,"from":0.05,"to":0.05,"cause":"warm-up: lw -9"}
{"type":"eval","step":10,"lambda":0.05,"lw":-2.0,"lr":-3.0,"accuracy":0.75,"margin":1.0}
{"type":"lambda","step":10,"from":0.05,"to":0.1,"cause":"SFT saturated, ramping"}
{"type":"eval","step":20,"lambda":0.1,"lw":-2.5,"lr":-4.0,"accuracy":1.0,"margin":1.5}
{"type":"lambda","step":20,"from":0.1,"to":0.05,"cause":"displacement (dLw -0.5), backing off"}
"#;
        let r = results(&spec("adaptive-aimd"), metrics, &ORPO).unwrap();
        assert_eq!(
            (r.dataset.as_str(), r.model.as_str()),
            ("swap", "tiny-llama-draft")
        );
        assert_eq!((r.accuracy, r.margin, r.lw), (1.0, 1.5, -2.5));
        assert!((r.lw_drop - 0.5).abs() < 1e-12);
        assert_eq!((r.lambda_changes, r.backoffs, r.hard_stops), (2, 1, 0));
        assert_eq!(r.final_lambda, 0.1);
        assert_eq!(r.trace.len(), 3);
        assert!(results(&spec("static-1"), "", &ORPO).is_err());
        // SimPO's eval lines: γ is the weight, TRL's reward accuracy, margin from ℓw − ℓr.
        let simpo = r#"{"type":"eval","step":1,"gamma":0.05,"lw":-9.0,"lr":-9.5,"rewards/accuracies":0.5,"rewards/margins":1.0}
{"type":"eval","step":10,"gamma":0.25,"lw":-2.0,"lr":-3.5,"rewards/accuracies":0.75,"rewards/margins":3.0}
"#;
        let r = results(&spec("adaptive-aimd"), simpo, &SIMPO).unwrap();
        assert_eq!((r.accuracy, r.margin, r.final_lambda), (0.75, 1.5, 0.25));
        assert_eq!(r.trace[0].1, 0.05);
    }

    #[test]
    fn a_run_gets_the_studys_settings_and_its_own() {
        let mut study = Study {
            name: "t".into(),
            objective: ORPO,
            datasets: vec![],
            models: vec![],
            configs: vec![],
            seeds: vec![],
            iters: 300,
            learning_rate: 2e-3,
            steps_per_eval: 10,
        };
        let a = train_args(&study, &spec("static-2")).join(" ");
        for part in [
            "--method orpo",
            "--iters 300",
            "--learning-rate 0.002",
            "--seed 1",
            "--data d/swap",
            "--adapter-path o",
            "--orpo-lambda 2",
        ] {
            assert!(a.contains(part), "{part} in {a}");
        }
        study.objective = SIMPO;
        let a = train_args(&study, &spec("static-2")).join(" ");
        assert!(
            a.contains("--method simpo") && a.contains("--beta 2.0 --simpo-gamma 2"),
            "{a}"
        );
        let a = train_args(&study, &spec("adaptive-aimd")).join(" ");
        assert!(a.contains("--orpo-lambda-schedule adaptive"), "{a}");
    }
}
