use anyhow::Result;
use harness::db::Db;

#[derive(clap::Subcommand)]
pub enum Command {
    /// The static-λ sweep (λ ∈ {0.05, 0.1, 0.2, 0.5, 1.0}) against the adaptive controller
    /// (aimd, p, pd, pid) on the uppercase and brevity preference sets × tiny-llama-trained
    /// and tiny-llama-draft × seeds; a results table, DB rows (suite lambda-sweep) and SVG
    /// plots of λ, ℓw and ℓr.
    Lambda {
        #[arg(long, default_value_t = 3)]
        seeds: u64,
        #[arg(long, default_value_t = 120)]
        iters: usize,
        /// Where the runs' adapters and metrics go.
        #[arg(long, default_value = "target/sweep-lambda")]
        out: std::path::PathBuf,
        /// Where the plots go.
        #[arg(long, default_value = "docs/plots")]
        plots: std::path::PathBuf,
    },
}

pub fn run(command: Command) -> Result<()> {
    let Command::Lambda {
        seeds,
        iters,
        out,
        plots,
    } = command;
    let seeds: Vec<u64> = (0..seeds).collect();
    let total = harness::sweep::DATASETS.len()
        * harness::sweep::MODELS.len()
        * (harness::sweep::STATIC.len() + harness::sweep::LAWS.len())
        * seeds.len();
    let bar = indicatif::ProgressBar::new(total as u64);
    let runs = harness::sweep::run(&seeds, iters, &out, |r| {
        bar.set_message(format!(
            "{} {} {} seed {}",
            r.dataset, r.model, r.config, r.seed
        ));
        bar.inc(1);
    })?;
    bar.finish_and_clear();
    let table = harness::sweep::table(&runs);
    print!("{table}");
    std::fs::write(out.join("results.md"), &table)?;
    std::fs::write(out.join("runs.json"), serde_json::to_string_pretty(&runs)?)?;
    for p in harness::sweep::plots(&runs, &plots)? {
        println!("plot: {}", p.display());
    }
    let state = harness::preflight::check(&harness::preflight::Thresholds::from_env());
    let db = Db::open_default()?;
    let ctx = harness::db::RowContext::at(&state, "");
    for r in &runs {
        let params = serde_json::json!({"dataset": r.dataset, "config": r.config, "seed": r.seed, "iters": iters});
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
