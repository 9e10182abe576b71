//! `harness serve-check`: `engine serve` on the built-in model, in this process on a free
//! loopback port, checked by the official `openai` Python client (oracles/openai_client.py
//! in the oracle venv). `harness serve-diff`: the same greedy requests to `engine serve` and
//! `mlx_lm.server` on the same model, compared response by response and chunk by chunk
//! (oracles/serve_diff.py), then once more with a planted difference that must be caught.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

fn wait_for(port: u16, what: &str) -> Result<()> {
    let start = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if start.elapsed() > Duration::from_secs(120) {
            bail!("{what} did not come up on port {port}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// `engine serve` for `model` on a thread of this process; returns its port. (It stays up,
/// idle, until the process ends.)
fn serve_in_process(model: &std::path::Path) -> Result<u16> {
    let port = free_port()?;
    let serve_args = super::bench::serve_args(model, port)?;
    std::thread::spawn(move || {
        if let Err(e) = engine::serve::run(serve_args) {
            eprintln!("engine serve failed: {e:#}");
        }
    });
    wait_for(port, "engine serve")?;
    Ok(port)
}

pub fn run() -> Result<()> {
    harness::bench::ensure_oracle_venv()?;
    let model = harness::goldens::model_dir(super::DEFAULT_MODEL)?;
    let port = serve_in_process(&model)?;
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

/// The models `serve-diff` compares on: the trained one (real answers, EOS stops) and an
/// untrained Gemma 3 (special tokens and padding ids in its output).
const DIFF_MODELS: [&str; 2] = ["tiny-llama-trained", "tiny-gemma3"];

/// Kills the peer server when the diff ends, however it ends.
struct Peer(std::process::Child);

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub fn diff() -> Result<()> {
    harness::bench::ensure_oracle_venv()?;
    let repo = harness::oracle::repo_root();
    let mut failed = Vec::new();
    for name in DIFF_MODELS {
        let model = harness::goldens::model_dir(name)?;
        let ours = serve_in_process(&model)?;
        let peer_port = free_port()?;
        let _peer = Peer(
            std::process::Command::new(harness::oracle::python())
                .args(["-m", "mlx_lm", "server", "--port", &peer_port.to_string()])
                .arg("--model")
                .arg(&model)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .context("starting mlx_lm.server in the oracle venv")?,
        );
        wait_for(peer_port, "mlx_lm.server")?;
        let compare = |plant: bool| -> Result<bool> {
            let mut cmd = std::process::Command::new(harness::oracle::python());
            cmd.arg(repo.join("oracles/serve_diff.py"))
                .args(["--ours", &format!("http://127.0.0.1:{ours}")])
                .args(["--peer", &format!("http://127.0.0.1:{peer_port}")])
                .arg("--model")
                .arg(&model);
            if plant {
                cmd.arg("--plant").stdout(std::process::Stdio::null());
            }
            Ok(cmd
                .status()
                .context("running oracles/serve_diff.py")?
                .success())
        };
        println!("== {name}: engine serve vs mlx_lm.server");
        if !compare(false)? {
            failed.push(name);
        }
        if compare(true)? {
            bail!("{name}: the planted difference (our answers cut at 4 tokens) was not caught");
        }
        println!("planted difference caught");
    }
    if !failed.is_empty() {
        bail!("engine serve differs from mlx_lm.server on {failed:?}");
    }
    Ok(())
}
