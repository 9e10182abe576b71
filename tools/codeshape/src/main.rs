//! Code-shape checks for the workspace, run by `.ci/run`:
//!
//! - `codeshape cycles <crate-src-dir>...`: import cycles between the modules of each crate
//!   (its `lib.rs` and its `main.rs`, each a crate of its own). Exits 1 when there is one.
//! - `codeshape long-fns [--max-lines 100] [--allow 3] <path>...`: fns over the limit outside
//!   tests. Exits 1 when there are more than `--allow`.
//! - `codeshape py-cycles <dir>...`: import cycles between the Python modules of each flat
//!   directory (oracles/). Exits 1 when there is one.
//!
//! The Rust checks read the source with `syn`, the Python one with a small tokenizer;
//! nothing is compiled or run, so they take well under a second.

mod attrs;
mod cycles;
mod long_fns;
mod py_cycles;
mod tree;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "codeshape")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Import cycles between modules: every reference (a `use`, a path in code or in a macro's
    /// arguments) from one module to another is lifted to the two sibling modules under their
    /// lowest common ancestor; a strongly connected set of siblings is a cycle. Test-only code
    /// is left out; paths into other crates are ignored.
    Cycles {
        /// A crate's source directory (holding lib.rs and/or main.rs).
        #[arg(required = true)]
        src_dirs: Vec<PathBuf>,
    },
    /// Functions longer than --max-lines outside tests (`#[test]` fns, `#[cfg(test)]` items
    /// and modules, files under tests/ and benches/ are left out).
    LongFns {
        #[arg(long, default_value_t = 100)]
        max_lines: usize,
        /// How many may be over the limit before the check fails.
        #[arg(long, default_value_t = 3)]
        allow: usize,
        /// Files, or directories searched for .rs files.
        #[arg(required = true)]
        paths: Vec<PathBuf>,
    },
    /// Import cycles between the Python modules of a flat directory (each `*.py` directly in
    /// it a module): `import X`, `from X import …`, `from . import X`, `__import__("X")` and
    /// `importlib.import_module("X")`, at module level or inside functions (a lazy import is
    /// an edge too); strings and comments are skipped.
    PyCycles {
        /// A directory of Python modules (its subdirectories are not read).
        #[arg(required = true)]
        dirs: Vec<PathBuf>,
    },
}

fn main() -> ExitCode {
    let result = match Cli::parse().command {
        Command::Cycles { src_dirs } => run_cycles(&src_dirs),
        Command::LongFns {
            max_lines,
            allow,
            paths,
        } => run_long_fns(&paths, max_lines, allow),
        Command::PyCycles { dirs } => run_py_cycles(&dirs),
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("codeshape: {e:#}");
            ExitCode::from(2)
        }
    }
}

/// Whether no crate has a cycle.
fn run_cycles(src_dirs: &[PathBuf]) -> anyhow::Result<bool> {
    let mut clean = true;
    for dir in src_dirs {
        let roots: Vec<PathBuf> = ["lib.rs", "main.rs"]
            .iter()
            .map(|f| dir.join(f))
            .filter(|f| f.is_file())
            .collect();
        anyhow::ensure!(
            !roots.is_empty(),
            "{}: neither lib.rs nor main.rs",
            dir.display()
        );
        for root in roots {
            let krate = tree::load(&root)?;
            let report = cycles::check(&krate);
            let modules = krate.modules.len();
            println!(
                "cycles: {}: {modules} modules, {} edges between sibling modules, {} cycle(s)",
                krate.root.display(),
                report.edges.len(),
                report.cycles.len()
            );
            for (n, cycle) in report.cycles.iter().enumerate() {
                clean = false;
                let parent = tree::show(&cycle[0][..cycle[0].len() - 1]);
                let names: Vec<&str> = cycle
                    .iter()
                    .map(|m| m.last().expect("not the root").as_str())
                    .collect();
                println!("  cycle {} under {parent}: {{{}}}", n + 1, names.join(", "));
                for ((from, to), sites) in &report.edges {
                    if !cycle.contains(from) || !cycle.contains(to) {
                        continue;
                    }
                    println!("    {} -> {}:", tree::show(from), tree::show(to));
                    const SHOWN: usize = 6;
                    for site in sites.iter().take(SHOWN) {
                        println!("      {site}");
                    }
                    if sites.len() > SHOWN {
                        println!("      ... and {} more", sites.len() - SHOWN);
                    }
                }
            }
        }
    }
    Ok(clean)
}

/// Whether no directory has a cycle between its Python modules.
fn run_py_cycles(dirs: &[PathBuf]) -> anyhow::Result<bool> {
    let mut clean = true;
    for dir in dirs {
        let report = py_cycles::check_dir(dir)?;
        let imports: usize = report.edges.values().map(|s| s.len()).sum();
        println!(
            "py-cycles: {}: {} modules, {} edges between them ({imports} imports), {} cycle(s)",
            dir.display(),
            report.modules.len(),
            report.edges.len(),
            report.cycles.len()
        );
        for (n, cycle) in report.cycles.iter().enumerate() {
            clean = false;
            println!("  cycle {}: {{{}}}", n + 1, cycle.join(", "));
            for ((from, to), sites) in &report.edges {
                if cycle.contains(from) && cycle.contains(to) {
                    println!("    {from} -> {to}:");
                    for site in sites {
                        println!("      {site}");
                    }
                }
            }
        }
    }
    Ok(clean)
}

/// Whether at most `allow` fns are over `max_lines`.
fn run_long_fns(paths: &[PathBuf], max_lines: usize, allow: usize) -> anyhow::Result<bool> {
    let files = long_fns::rust_files(paths)?;
    let found = long_fns::find(&files, max_lines)?;
    println!(
        "long-fns: {} files, {} fn(s) over {max_lines} lines outside tests (allowed: {allow})",
        files.len(),
        found.len()
    );
    for f in &found {
        println!(
            "  {}:{}: {} ({} lines)",
            f.file.display(),
            f.line,
            f.name,
            f.lines
        );
    }
    if found.len() > allow {
        println!("long-fns: {} over the allowance of {allow}", found.len());
    }
    Ok(found.len() <= allow)
}
