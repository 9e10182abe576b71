use anyhow::Result;
use harness::db::Db;
use harness::sweep::{Config, Study};

#[derive(clap::Subcommand)]
pub enum Command {
    /// The static-λ sweep against the adaptive controller. `--study classic` (2026-11-30):
    /// λ ∈ {0.05, 0.1, 0.2, 0.5, 1.0} and aimd, p, pd, pid on the uppercase and brevity sets,
    /// 120 iterations. `--study displace`: λ ∈ {0.05, 0.1, 0.2, 0.5, 1, 2}, adaptive-aimd,
    /// adaptive-pd and adaptive-aimd+max=2 on goldens/data/study/{contradict,swap}, 300
    /// iterations. Both × tiny-llama-trained and tiny-llama-draft × seeds. `--study simpo`:
    /// the displace sets with SimPO's γ as the weight (static 0.1–5, the same adaptive
    /// configs), on tiny-llama-trained. Each: a results table,
    /// the verdict table, DB rows (suite lambda-sweep) and SVG plots. Finished runs (a
    /// result.json in their directory) are reused.
    Lambda {
        #[arg(long, default_value = "classic")]
        study: String,
        /// Seeds 0..N.
        #[arg(long, default_value_t = 3)]
        seeds: u64,
        /// Override the study's run length.
        #[arg(long)]
        iters: Option<usize>,
        /// Override the study's λ configurations: static-<λ> or
        /// adaptive-<law>[+<knob>=<value>…] (knobs: the --lambda-* names without the prefix).
        #[arg(long, value_delimiter = ',')]
        configs: Vec<Config>,
        /// Run each training as `ENGINE train …` (a child process) instead of in this
        /// process; a fixed engine binary keeps a long study on one build.
        #[arg(long)]
        engine: Option<std::path::PathBuf>,
        /// Child processes at a time (needs --engine).
        #[arg(long, default_value_t = 1)]
        jobs: usize,
        /// No new runs: the table, verdict and plots of the finished ones.
        #[arg(long)]
        report_only: bool,
        /// Where the runs' adapters and metrics go (default target/sweep-lambda/<study>).
        #[arg(long)]
        out: Option<std::path::PathBuf>,
        /// Where the plots go (named <machine>-lambda-*.svg).
        #[arg(long, default_value = "docs/plots")]
        plots: std::path::PathBuf,
    },
}

pub fn run(command: Command) -> Result<()> {
    let Command::Lambda {
        study,
        seeds,
        iters,
        configs,
        engine,
        jobs,
        report_only,
        out,
        plots,
    } = command;
    let mut study = Study::named(&study)?;
    study.seeds = (0..seeds).collect();
    if let Some(i) = iters {
        study.iters = i;
    }
    if !configs.is_empty() {
        study.configs = configs;
    }
    let out = out.unwrap_or_else(|| format!("target/sweep-lambda/{}", study.name).into());
    let total = study.datasets.len() * study.models.len() * study.configs.len() * seeds as usize;
    let bar = indicatif::ProgressBar::new(total as u64);
    let fresh = std::sync::Mutex::new(Vec::new());
    let runs = harness::sweep::run(
        &study,
        &out,
        engine.as_deref(),
        jobs,
        report_only,
        |r, ran| {
            bar.set_message(format!(
                "{} {} {} seed {}",
                r.dataset, r.model, r.config, r.seed
            ));
            bar.inc(1);
            if ran {
                fresh.lock().unwrap().push(r.clone());
            }
        },
    )?;
    bar.finish_and_clear();
    let table = harness::sweep::table(&runs);
    let verdict = harness::sweep::verdict_against(&runs, study.objective.default);
    print!("{table}\n{verdict}");
    std::fs::create_dir_all(&out)?;
    std::fs::write(out.join("results.md"), format!("{table}\n{verdict}"))?;
    std::fs::write(out.join("runs.json"), serde_json::to_string_pretty(&runs)?)?;
    // The ORPO studies' plots keep their names; another objective's are prefixed by it.
    let prefix = match study.objective.method {
        "orpo" => format!("{}-", harness::machine::machine_key()),
        m => format!("{}-{m}-", harness::machine::machine_key()),
    };
    for p in harness::sweep::plots(&runs, &plots, &prefix)? {
        println!("plot: {}", p.display());
    }
    let fresh = fresh.into_inner().unwrap();
    if fresh.is_empty() {
        return Ok(());
    }
    let state = harness::preflight::check(&harness::preflight::Thresholds::from_env());
    let db = Db::open_default()?;
    let ctx = harness::db::RowContext::at(&state, "");
    for r in &fresh {
        let params = serde_json::json!({"study": study.name, "dataset": r.dataset, "config": r.config, "seed": r.seed, "iters": study.iters});
        for m in [
            ("val_accuracy", r.accuracy, ""),
            ("margin", r.margin, ""),
            ("lw", r.lw, ""),
            ("lw_drop", r.lw_drop, ""),
        ] {
            db.insert(&ctx.row("lambda-sweep", &r.model, m, "engine", None, params.clone()))?;
        }
    }
    Ok(())
}
