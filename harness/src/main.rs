//! The harness binary: thin command handlers over the harness library.

mod cmd;

use anyhow::Result;
use clap::{Parser, Subcommand};

/// Verification and measurement for the engine: parity gates against committed goldens and
/// live oracles, clean-machine preflight, benchmarks against mlx-lm, a results DB and
/// RESULTS.md.
#[derive(Parser)]
#[command(name = "harness", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Check this machine end to end: the engine's MLX runtime, the machine key, the runtime
    /// golden and L1 on the built-in model reproduced bit for bit, the oracle venv (if any).
    Doctor,
    /// Run parity gates and print per-model verdicts (non-zero exit on any failure).
    /// From the committed goldens by default; `--live` runs the oracle now instead.
    Parity(cmd::parity::Args),
    /// Goldens: which layer each resolves to, their provenance, regeneration.
    Goldens {
        #[command(subcommand)]
        command: cmd::goldens::Command,
    },
    /// Is this machine quiet enough to measure? Prints the state and a clean/dirty verdict.
    Preflight {
        /// Print the machine state as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Benchmark the engine against mlx-lm (decode, prefill, TTFT, peak memory).
    Bench(cmd::bench::Args),
    /// Probes: `memory` reads MLX's peak memory per training phase (whole vs segmented
    /// backward at 1×, 2×, 4× a sequence length) and checks for leaks.
    Probe {
        #[command(subcommand)]
        command: cmd::probe::Command,
    },
    /// Sweeps: `lambda` runs the static-λ sweep against the dynamic-λ controller.
    Sweep {
        #[command(subcommand)]
        command: cmd::sweep::Command,
    },
    /// Quality per tier on held-out text: teacher-forced KL(L1 ‖ L2/L3) per position (mean,
    /// max nats), top-1 agreement, perplexity (mlx_lm.perplexity's computation; `--oracle`
    /// runs it in the oracle venv too). Rows under suite `quality`.
    Eval(cmd::eval::Args),
    /// Query the results DB.
    Results {
        /// Only rows of this suite (e.g. decode, parity-l1).
        #[arg(long)]
        suite: Option<String>,
        /// How many rows, newest first.
        #[arg(long, default_value_t = 40)]
        limit: usize,
    },
    /// Write RESULTS.md from the newest preflight-clean rows of the results DB.
    Promote {
        /// Where to write (default: RESULTS.md at the repository root).
        #[arg(long)]
        out: Option<std::path::PathBuf>,
    },
    /// The Python oracle environment (oracles/.venv).
    Oracle {
        #[command(subcommand)]
        command: OracleCommand,
    },
    /// Freeze the L3 perf oracle: 64 greedy ids per prompt from our own L2 engine, with a
    /// fingerprint of the graph-shaping config (the L3 envelope gate compares against it).
    FreezePerfOracle {
        /// One model (default: every model the L3 gate covers).
        #[arg(long)]
        model: Option<String>,
    },
    /// Check `engine serve` with the official `openai` Python client (oracle venv).
    ServeCheck,
    /// Live diff: the same greedy requests to `engine serve` and `mlx_lm.server` (oracle
    /// venv) on the tiny models; texts, streamed chunks, finish reasons and token counts
    /// must be identical (plus a planted difference that must be caught).
    ServeDiff(cmd::serve_check::DiffArgs),
    /// One rank of a distributed gate, under `mlx.launch` (or with MLX_RANK and MLX_HOSTFILE
    /// set): `l1` checks this rank's part of the model against `goldens/l1-dist`; rank 0
    /// prints the verdict as one JSON line.
    DistRank {
        #[command(subcommand)]
        command: cmd::dist_rank::Command,
    },
    /// One restart-suite leg in this fresh process (used by `harness bench --suite restart`).
    #[command(hide = true)]
    LegRestart(cmd::bench::LegRestartArgs),
    /// One train-suite leg in this fresh process (used by `harness bench --suite train`).
    #[command(hide = true)]
    LegTrain(cmd::bench::LegTrainArgs),
    /// One GRPO train-suite leg in this fresh process (used by `harness bench --suite train`).
    #[command(hide = true)]
    LegGrpo(harness::bench::train_grpo::LegArgs),
    /// One spec-suite leg in this fresh process (used by `harness bench --suite spec`).
    #[command(hide = true)]
    LegSpec(cmd::bench::LegSpecArgs),
    /// `engine serve` in this fresh process (used by `harness bench --suite serve`).
    #[command(hide = true)]
    LegServe(cmd::bench::LegServeArgs),
    /// One engine rank of a distributed-suite leg (used by `harness bench --suite distributed`).
    #[command(hide = true)]
    LegDist(harness::bench::distributed::LegArgs),
    /// One constrain-suite leg in this fresh process (used by `harness bench --suite constrain`).
    #[command(hide = true)]
    LegConstrain(harness::bench::constrain::LegArgs),
    /// One engine benchmark leg in this fresh process (used by `harness bench`).
    #[command(hide = true)]
    LegEngine(cmd::bench::LegArgs),
}

#[derive(Subcommand)]
enum OracleCommand {
    /// Report the venv, its package versions, and whether its libmlx is the same wheel
    /// (version and bytes) as the engine's.
    Doctor,
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Command::Doctor => cmd::doctor::run(),
        Command::Parity(args) => cmd::parity::run(args),
        Command::Goldens { command } => cmd::goldens::run(command),
        Command::Preflight { json } => cmd::results::preflight(json),
        Command::Bench(args) => cmd::bench::run(args),
        Command::Eval(args) => cmd::eval::run(args),
        Command::Probe { command } => cmd::probe::run(command),
        Command::Sweep { command } => cmd::sweep::run(command),
        Command::Results { suite, limit } => cmd::results::results(suite.as_deref(), limit),
        Command::Promote { out } => cmd::results::promote(out),
        Command::Oracle {
            command: OracleCommand::Doctor,
        } => cmd::doctor::oracle(true).map(|_| ()),
        Command::DistRank { command } => cmd::dist_rank::run(command),
        Command::LegEngine(args) => cmd::bench::leg(args),
        Command::FreezePerfOracle { model } => cmd::parity::freeze(model),
        Command::ServeCheck => cmd::serve_check::run(),
        Command::ServeDiff(args) if args.vision => cmd::serve_diff_vision::run(args.peer_only),
        Command::ServeDiff(args) => cmd::serve_check::diff(args),
        Command::LegServe(args) => cmd::bench::leg_serve(args),
        Command::LegRestart(args) => cmd::bench::leg_restart(args),
        Command::LegSpec(args) => cmd::bench::leg_spec(args),
        Command::LegTrain(args) => cmd::bench::leg_train(args),
        Command::LegGrpo(args) => harness::bench::train_grpo::leg_main(args),
        Command::LegDist(args) => harness::bench::distributed::leg(args),
        Command::LegConstrain(args) => harness::bench::constrain::leg(args),
    }
}
