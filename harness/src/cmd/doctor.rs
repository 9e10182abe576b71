use anyhow::{bail, Result};
use harness::goldens::{Layer, TensorGolden};
use harness::parity::gates::{L1, RUNTIME};
use harness::{machine, oracle};

use super::DEFAULT_MODEL;

pub fn run() -> Result<()> {
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
    let runtime = RUNTIME.run("", None)?;
    println!("{}", runtime.summary());
    for line in runtime.details() {
        println!("{line}");
    }
    let l1 = L1.run(DEFAULT_MODEL, None)?;
    println!("{}", l1.summary());

    println!();
    let oracle_ok = oracle(false)?;
    if !runtime.passed() {
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
pub fn oracle(strict: bool) -> Result<bool> {
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
