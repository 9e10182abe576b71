//! `harness serve-check`: `engine serve` on the built-in model, in this process on a free
//! loopback port, checked by the official `openai` Python client (oracles/openai_client.py
//! in the oracle venv).

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

pub fn run() -> Result<()> {
    harness::bench::ensure_oracle_venv()?;
    let model = harness::goldens::model_dir(super::DEFAULT_MODEL)?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let serve_args = super::bench::serve_args(&model, port)?;
    std::thread::spawn(move || {
        if let Err(e) = engine::serve::run(serve_args) {
            eprintln!("engine serve failed: {e:#}");
        }
    });
    let start = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if start.elapsed() > Duration::from_secs(60) {
            bail!("engine serve did not come up on port {port}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let status = std::process::Command::new(harness::oracle::python())
        .arg(harness::oracle::repo_root().join("oracles/openai_client.py"))
        .arg("--base-url")
        .arg(format!("http://127.0.0.1:{port}/v1"))
        .status()
        .context("running oracles/openai_client.py")?;
    if !status.success() {
        bail!("the openai client checks failed");
    }
    Ok(())
}
