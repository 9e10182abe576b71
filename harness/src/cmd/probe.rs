use anyhow::{bail, Context, Result};
use harness::bench::models;
use harness::db::Db;

#[derive(clap::Subcommand)]
pub enum Command {
    /// Peak memory per training phase, whole vs segmented backward, at 1×, 2× and 4×
    /// --seq; rows go to the results DB (suite memory-probe); fails on a leak.
    Memory {
        /// A built-in bench model (tiny, small, …) or a model directory.
        #[arg(long, default_value = "tiny")]
        model: String,
        /// The base sequence length (also run at 2× and 4×).
        #[arg(long, default_value_t = 128)]
        seq: usize,
        #[arg(long, default_value_t = 1)]
        segment_size: usize,
        /// Steps per configuration (the last one is reported; leaks compare first and last).
        #[arg(long, default_value_t = 3)]
        steps: usize,
    },
}

pub fn run(command: Command) -> Result<()> {
    let Command::Memory {
        model,
        seq,
        segment_size,
        steps,
    } = command;
    let (name, dir) = match models::by_name(&model) {
        Some(m) => (m.name.to_owned(), m.ensure()?),
        None => {
            let dir = std::path::PathBuf::from(&model);
            if !dir.join("config.json").is_file() {
                bail!(
                    "`{model}` is neither a bench model ({}) nor a model directory",
                    models::NAMES
                );
            }
            (model.clone(), dir)
        }
    };
    let seqs = [seq, 2 * seq, 4 * seq];
    let r =
        harness::probe::memory(&dir, &seqs, segment_size, steps.max(2)).context("memory probe")?;
    print!("{}", r.table());
    let whole = |s: usize| {
        r.steps
            .iter()
            .find(|x| x.0 == "whole" && x.1 == s)
            .map(|x| x.2)
    };
    let seg = |s: usize| {
        r.steps
            .iter()
            .find(|x| x.0 != "whole" && x.1 == s)
            .map(|x| x.2)
    };
    for s in seqs {
        if let (Some(w), Some(g)) = (whole(s), seg(s)) {
            println!(
                "seq {s}: segmented step peak {:.1} % of whole",
                100.0 * g / w
            );
        }
    }
    let state = harness::preflight::check(&harness::preflight::Thresholds::from_env());
    let db = Db::open_default()?;
    let ctx = harness::db::RowContext::at(&state, "single-process");
    for (mode, s, peak, a0, a1) in &r.steps {
        let params =
            serde_json::json!({"mode": mode, "seq": s, "batch": 2, "rank": 8, "steps": steps});
        for m in [
            ("step_peak_above_start_mb", *peak, "MB"),
            ("active_growth_mb", a1 - a0, "MB"),
        ] {
            db.insert(&ctx.row("memory-probe", &name, m, "engine", None, params.clone()))?;
        }
    }
    // A leak: active memory growing across steps of the same configuration (tolerance:
    // 1 MB, the optimizer state is created on the first step and stays).
    let leaks: Vec<String> = r
        .steps
        .iter()
        .filter(|(_, _, _, a0, a1)| a1 - a0 > 1.0)
        .map(|(m, s, _, a0, a1)| format!("{m} seq {s}: {a0:.1} → {a1:.1} MB"))
        .collect();
    if !leaks.is_empty() {
        bail!("active memory grew across steps: {}", leaks.join("; "));
    }
    println!("no leak: active memory flat across steps in every configuration");
    Ok(())
}
