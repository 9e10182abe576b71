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
        /// Long context: also the chunked cross-entropy, this many tokens a chunk, alone and
        /// with segmented backward, at 1×, 2×, 4× and 8× --seq (the 8× claim: chunked +
        /// segmented at 8× within the whole step's peak at 1×).
        #[arg(long)]
        loss_chunk: Option<usize>,
        /// Write the peaks and step times against the sequence length here (SVG).
        #[arg(long)]
        plot: Option<std::path::PathBuf>,
    },
}

/// A bench model (made if missing) or a model directory: its name in the rows and plots
/// (a directory's own name, not the whole path) and its directory.
fn resolve(model: &str) -> Result<(String, std::path::PathBuf)> {
    if let Some(m) = models::by_name(model) {
        return Ok((m.name.to_owned(), m.ensure()?));
    }
    let dir = std::path::PathBuf::from(model);
    if !dir.join("config.json").is_file() {
        bail!(
            "`{model}` is neither a bench model ({}) nor a model directory",
            models::NAMES
        );
    }
    let name = dir
        .file_name()
        .map_or(model.to_owned(), |n| n.to_string_lossy().into_owned());
    Ok((name, dir))
}

pub fn run(command: Command) -> Result<()> {
    let Command::Memory {
        model,
        seq,
        segment_size,
        steps,
        loss_chunk,
        plot,
    } = command;
    let (name, dir) = resolve(&model)?;
    let mut seqs = vec![seq, 2 * seq, 4 * seq];
    let r = match loss_chunk {
        None => harness::probe::memory(&dir, &seqs, segment_size, steps.max(2)),
        Some(n) => {
            seqs.push(8 * seq);
            harness::probe::memory_modes(&dir, &seqs, &long_modes(segment_size, n), steps.max(2))
        }
    }
    .context("memory probe")?;
    print!("{}", r.table());
    if let Some(n) = loss_chunk {
        long_context_summary(&r, &seqs, segment_size, n);
    }
    if let Some(path) = plot {
        // A model directory is named by its last component.
        let short = std::path::Path::new(&name)
            .file_name()
            .map_or(name.clone(), |n| n.to_string_lossy().into_owned());
        let title = format!(
            "training step memory, {short} ({})",
            harness::machine::machine_key()
        );
        std::fs::write(&path, r.plot(&title)).with_context(|| path.display().to_string())?;
        println!("plot: {}", path.display());
    }
    let whole = |s: usize| {
        r.steps
            .iter()
            .find(|x| x.0 == "whole" && x.1 == s)
            .map(|x| x.2)
    };
    let seg = |s: usize| {
        let name = format!("segmented-{segment_size}");
        r.steps
            .iter()
            .find(|x| x.0 == name && x.1 == s)
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
    let times = r.step_ms.iter().zip(&r.step_cpu_ms);
    for ((mode, s, peak, a0, a1), ((_, _, ms), (_, _, cpu))) in r.steps.iter().zip(times) {
        let params =
            serde_json::json!({"mode": mode, "seq": s, "batch": 2, "rank": 8, "steps": steps});
        for m in [
            ("step_peak_above_start_mb", *peak, "MB"),
            ("active_growth_mb", a1 - a0, "MB"),
            ("step_ms", *ms, "ms"),
            ("step_cpu_ms", *cpu, "ms"),
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

/// The long-context probe's configurations: whole, segmented, chunked, chunked + segmented.
fn long_modes(segment_size: usize, loss_chunk: usize) -> Vec<harness::probe::Mode> {
    let mode = |segment_size, loss_chunk| harness::probe::Mode {
        segment_size,
        loss_chunk,
    };
    vec![
        mode(None, None),
        mode(Some(segment_size), None),
        mode(None, Some(loss_chunk)),
        mode(Some(segment_size), Some(loss_chunk)),
    ]
}

/// Prints the 8× claim (chunked + segmented at 8× --seq against the whole step at 1×) and
/// the step-time overheads of segments and chunks at each length.
fn long_context_summary(r: &harness::probe::ProbeResult, seqs: &[usize], seg: usize, n: usize) {
    let names = long_modes(seg, n)
        .iter()
        .map(|m| m.name())
        .collect::<Vec<_>>();
    let (base, top) = (seqs[0], seqs[seqs.len() - 1]);
    if let (Some(w), Some(c)) = (r.at(&names[0], base), r.at(&names[3], top)) {
        let verdict = if c.0 <= w.0 { "within" } else { "ABOVE" };
        println!(
            "{} at seq {top} ({}×): step peak {:.1} MB, {verdict} the whole step's {:.1} MB at \
             seq {base} ({:.0} %)",
            names[3],
            top / base,
            c.0,
            w.0,
            100.0 * c.0 / w.0
        );
    }
    for &s in seqs {
        let t = |i: usize| r.at(&names[i], s).map_or(f64::NAN, |x| x.1);
        let c = |i: usize| r.cpu_at(&names[i], s).unwrap_or(f64::NAN);
        println!(
            "seq {s}: step time (wall; CPU) segmented / whole {:.2}×; {:.2}×, chunked / whole \
             {:.2}×; {:.2}×, chunked+segmented / chunked {:.2}×; {:.2}× (the segments' overhead)",
            t(1) / t(0),
            c(1) / c(0),
            t(2) / t(0),
            c(2) / c(0),
            t(3) / t(2),
            c(3) / c(2)
        );
    }
}
