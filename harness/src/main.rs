use anyhow::{bail, Result};
use clap::{Parser, Subcommand};
use harness::goldens::{Layer, TensorGolden};
use harness::{machine, oracle, parity};

/// Verification and measurement for the engine: parity gates against committed goldens and
/// live oracles, and honest numbers.
#[derive(Parser)]
#[command(name = "harness", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Check this machine end to end: the engine's MLX runtime, the machine key, the runtime
    /// golden reproduced bit for bit, and the oracle venv (if present).
    Doctor,
    /// Run parity gates from the committed goldens and print per-model verdicts.
    Parity {
        /// The tier to run (only l1 so far).
        #[arg(long, default_value = "l1")]
        tier: String,
        /// One model (default: every model with goldens).
        #[arg(long)]
        model: Option<String>,
    },
    /// The Python oracle environment (oracles/.venv).
    Oracle {
        #[command(subcommand)]
        command: OracleCommand,
    },
}

#[derive(Subcommand)]
enum OracleCommand {
    /// Report the venv, its package versions, and whether its libmlx is the same wheel
    /// (version and bytes) as the engine's.
    Doctor,
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Command::Doctor => doctor(),
        Command::Parity { tier, model } => parity_cmd(&tier, model.as_deref()),
        Command::Oracle {
            command: OracleCommand::Doctor,
        } => oracle_doctor(true).map(|_| ()),
    }
}

/// The built-in default model (committed under goldens/models).
const DEFAULT_MODEL: &str = "tiny-llama-trained";

fn parity_cmd(tier: &str, model: Option<&str>) -> Result<()> {
    if tier != "l1" {
        bail!("tier `{tier}` has no gates yet (available: l1)");
    }
    let models: Vec<&str> = match model {
        Some(m) => vec![m],
        None => parity::l1::MODELS.to_vec(),
    };
    let mut failed = Vec::new();
    for name in models {
        let report = parity::l1::check_named(name, |_| {})?;
        println!("{}", report.summary());
        for line in report.details() {
            println!("{line}");
        }
        if !report.passed() {
            failed.push(name);
        }
    }
    if !failed.is_empty() {
        bail!("L1 failed for: {}", failed.join(", "));
    }
    Ok(())
}

fn doctor() -> Result<()> {
    println!(
        "engine {} · MLX {} · backend {} · device {}",
        engine::VERSION,
        engine::runtime::mlx_version(),
        engine::runtime::backend(),
        engine::runtime::default_device()
    );
    engine::runtime::self_check()?;
    println!("runtime self-check: ok");
    println!("machine key: {}", machine::machine_key());

    let golden = TensorGolden::open("runtime")?;
    let layer = match golden.layer {
        Layer::Reference => "reference set",
        Layer::Machine => "this machine's override",
    };
    println!("runtime golden: {} ({layer})", golden.dir.display());
    let reports = parity::runtime::check_all(&golden)?;
    let exact = reports.iter().filter(|r| r.comparison.bit_exact).count();
    for r in reports.iter().filter(|r| !r.comparison.bit_exact) {
        println!("  {}/{}: {}", r.case, r.tensor, r.comparison);
    }
    println!(
        "runtime golden: {exact}/{} tensors bit-exact vs Python mlx",
        reports.len()
    );

    let l1 = parity::l1::check_named(DEFAULT_MODEL, |_| {})?;
    println!("{}", l1.summary());

    println!();
    let oracle_ok = oracle_doctor(false)?;
    if exact != reports.len() {
        bail!("runtime golden not reproduced bit for bit");
    }
    if !l1.passed() {
        bail!(
            "L1 gate failed on {DEFAULT_MODEL}:\n{}",
            l1.details().join("\n")
        );
    }
    if !oracle_ok {
        println!("(oracle venv not ready: gates from committed goldens still run; `--live` diffs need it)");
    }
    Ok(())
}

/// Prints the oracle report; with `strict`, a missing venv or a runtime mismatch is an error.
fn oracle_doctor(strict: bool) -> Result<bool> {
    println!("oracle venv: {}", oracle::venv_dir().display());
    let info = match oracle::probe() {
        Ok(info) => info,
        Err(e) if !strict => {
            println!("  {e}");
            return Ok(false);
        }
        Err(e) => return Err(e.into()),
    };
    println!("  python {}", info.python);
    for (name, version) in &info.versions {
        println!("  {name}=={version}");
    }
    let same = oracle::same_runtime(&info);
    println!(
        "  engine runtime: {} {} at {}",
        oracle::engine_wheel(),
        same.engine_version,
        same.engine_lib
            .as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_else(|| "?".into())
    );
    println!(
        "  oracle libmlx: {}",
        info.libmlx.as_deref().unwrap_or("not found")
    );
    let bytes = match same.bytes_match() {
        Some(true) => "identical bytes (sha256 match)",
        Some(false) => "DIFFERENT bytes",
        None => "bytes not compared (a library path is unknown)",
    };
    let verdict = same.versions_match() && same.bytes_match() != Some(false);
    println!(
        "  same libmlx as the engine: {} — {} {} vs {}, {bytes}",
        if verdict { "yes" } else { "NO" },
        oracle::engine_wheel(),
        same.engine_version,
        same.oracle_version.as_deref().unwrap_or("absent"),
    );
    if strict && !verdict {
        bail!("the oracle venv's libmlx differs from the engine's: re-run `bash oracles/setup.sh`");
    }
    Ok(verdict)
}
