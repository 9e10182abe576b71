//! The harness: proves the engine correct (parity gates against committed goldens and live
//! oracles) and measures it honestly. It depends on the engine, never the reverse, and owns
//! every oracle call.

pub mod bench;
pub mod compare;
pub mod db;
pub mod eval;
pub mod fixtures;
pub mod goldens;
pub mod machine;
pub mod manifest;
pub mod oracle;
pub mod parity;
pub mod plot;
pub mod preflight;
pub mod probe;
pub mod promote;
pub mod sweep;

/// The harness's cache dir (shared with the engine's build: `$ENGINE_CACHE_DIR`, else
/// `$XDG_CACHE_HOME/mlx-engine`, else `~/.cache/mlx-engine`): bench models, results DB,
/// fetched fixtures.
pub use fixtures::cache_dir;

/// Writes a verdict line straight to the process's stdout, past the test harness's output
/// capture, so `cargo test` shows gate summaries (e.g. "L1 tiny-llama: 85/85 …") without
/// `--nocapture`.
pub fn announce(line: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    // Start on a fresh line: the test runner may have printed "test name ... " already.
    let _ = writeln!(out, "\n{line}");
    let _ = out.flush();
}
