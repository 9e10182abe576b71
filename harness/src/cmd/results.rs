use std::path::PathBuf;

use anyhow::Result;
use harness::db::Db;
use harness::preflight::{self, Thresholds};
use harness::{oracle, promote};

pub fn preflight(json: bool) -> Result<()> {
    let state = preflight::check(&Thresholds::from_env());
    if json {
        println!("{}", serde_json::to_string_pretty(&state)?);
    } else {
        print!("{}", state.render());
    }
    Ok(())
}

pub fn results(suite: Option<&str>, limit: usize) -> Result<()> {
    let path = harness::db::default_path();
    let db = Db::open(&path)?;
    let rows = db.query(suite, limit)?;
    println!("{} row(s) from {}", rows.len(), path.display());
    println!(
        "{:<20} {:<12} {:<10} {:<12} {:<24} {:<7} {:>12} {:<6} {:<8} tags",
        "ts", "commit", "suite", "model", "metric", "stack", "value", "unit", "preflt"
    );
    for r in rows {
        println!(
            "{:<20} {:<12} {:<10} {:<12} {:<24} {:<7} {:>12.3} {:<6} {:<8} {}",
            r.ts,
            r.commit,
            r.suite,
            r.model,
            r.metric,
            r.stack,
            r.value,
            r.unit,
            r.preflight,
            r.tags
        );
    }
    Ok(())
}

pub fn promote(out: Option<PathBuf>) -> Result<()> {
    let db = Db::open_default()?;
    let rows = db.latest_clean()?;
    let out = out.unwrap_or_else(|| oracle::repo_root().join("RESULTS.md"));
    let existing = std::fs::read_to_string(&out).ok();
    let machine = harness::machine::machine_key();
    let (md, used) = promote::merge(existing.as_deref(), &machine, &rows);
    // The section's plots, next to RESULTS.md (each written atomically).
    let plots_dir = out
        .parent()
        .unwrap_or(std::path::Path::new("."))
        .join(promote::PLOTS_DIR);
    std::fs::create_dir_all(&plots_dir)?;
    for p in promote::plots(&machine, &rows) {
        engine::train::write_atomic(&plots_dir.join(&p.file), p.svg.as_bytes())
            .map_err(|e| anyhow::anyhow!("writing {}: {e}", p.file))?;
        println!("wrote {}/{}", plots_dir.display(), p.file);
    }
    let tmp = out.with_extension("md.tmp");
    std::fs::write(&tmp, &md)?;
    std::fs::rename(&tmp, &out)?;
    let kept: Vec<String> = promote::sections(&md)
        .into_keys()
        .filter(|k| *k != machine)
        .collect();
    println!(
        "wrote {}: the section of `{machine}` from {used} promotable row(s){}",
        out.display(),
        if kept.is_empty() {
            String::new()
        } else {
            format!("; kept as they were: {}", kept.join(", "))
        }
    );
    Ok(())
}
