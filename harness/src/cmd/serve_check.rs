//! `harness serve-check`: `engine serve` on the built-in model, in this process on a free
//! loopback port, checked by the official `openai` Python client (oracles/openai_client.py
//! in the oracle venv); then on models/tiny-qwen3-tools, an agent-style exchange with the
//! same client (tool call, tool result, final answer; oracles/openai_agent.py).
//! `harness serve-diff`: the same greedy requests to `engine serve` and `mlx_lm.server` on
//! the same model, compared response by response and chunk by chunk (oracles/serve_diff.py;
//! on tiny-qwen3-tools its tools suite: tool calls and reasoning), then once more with a
//! planted difference that must be caught.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// `GET path` on loopback `port`: the status and the body, or None if nothing answers.
fn get(port: u16, path: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let status = out.split_whitespace().nth(1)?.parse().ok()?;
    Some((status, out.split("\r\n\r\n").nth(1)?.to_owned()))
}

/// Waits (up to 120 s) until the server on `port` answers `GET /v1/models` with 200 and
/// `ours(body)` accepts it, while `gone()` says the server has not exited. A port picked by
/// `free_port` can be taken by someone else before the server binds it: then the server
/// exits (seen at once, not after the timeout) and a stranger's answer is not taken for it.
fn wait_ready(
    port: u16,
    what: &str,
    mut gone: impl FnMut() -> Option<String>,
    ours: impl Fn(&str) -> bool,
) -> Result<()> {
    let start = Instant::now();
    loop {
        if let Some(why) = gone() {
            bail!("{what} exited before it was ready on port {port}: {why}");
        }
        if let Some((200, body)) = get(port, "/v1/models") {
            if ours(&body) {
                return Ok(());
            }
            bail!("port {port} is answered by another server than {what}: {body}");
        }
        if start.elapsed() > Duration::from_secs(120) {
            bail!("{what} did not come up on port {port} within 120 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `engine serve` for `model` on a thread of this process; returns its port. (It stays up,
/// idle, until the process ends.)
fn serve_in_process(model: &std::path::Path) -> Result<u16> {
    let port = free_port()?;
    let serve_args = super::bench::serve_args(model, port)?;
    let (failed_tx, failed) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let end = engine::serve::run(serve_args)
            .map_or_else(|e| format!("{e:#}"), |()| "stopped".to_owned());
        let _ = failed_tx.send(end);
    });
    // Our server names the model it serves by its canonical path.
    let id = model.canonicalize()?.display().to_string();
    wait_ready(
        port,
        "engine serve",
        || failed.try_recv().ok(),
        |body| {
            serde_json::from_str::<serde_json::Value>(body)
                .is_ok_and(|v| v["data"][0]["id"] == id.as_str())
        },
    )?;
    Ok(port)
}

/// The model the agent exchange of `serve-check` runs on (trained to call a tool).
const TOOLS_MODEL: &str = "tiny-qwen3-tools";

/// oracles/openai_client.py (with `extra` arguments) against our server on `port`; a
/// `quiet` run prints nothing of its own.
fn openai_client(port: u16, extra: &[&str], quiet: bool) -> Result<bool> {
    let mut cmd = std::process::Command::new(harness::oracle::python());
    cmd.arg(harness::oracle::repo_root().join("oracles/openai_client.py"))
        .arg("--base-url")
        .arg(format!("http://127.0.0.1:{port}/v1"))
        .args(extra);
    if quiet {
        cmd.stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
    }
    Ok(cmd
        .status()
        .context("running oracles/openai_client.py")?
        .success())
}

pub fn run() -> Result<()> {
    harness::bench::ensure_oracle_venv()?;
    let model = harness::goldens::model_dir(super::DEFAULT_MODEL)?;
    println!("== {}: the openai client", super::DEFAULT_MODEL);
    let basic = openai_client(serve_in_process(&model)?, &[], false)?;
    // The first server stays up, idle, while the second one answers.
    let tools = harness::goldens::model_dir(TOOLS_MODEL)?;
    println!("== {TOOLS_MODEL}: an agent exchange with the openai client");
    let port = serve_in_process(&tools)?;
    let agent = openai_client(port, &["--agent"], false)?;
    if openai_client(port, &["--agent", "--plant"], true)? {
        bail!("the agent exchange's planted difference (requests without tools) was not caught");
    }
    println!("planted difference caught");
    match (basic, agent) {
        (true, true) => Ok(()),
        (false, true) => bail!("the openai client checks failed"),
        (true, false) => bail!("the openai client's agent exchange failed"),
        (false, false) => bail!("the openai client checks and its agent exchange failed"),
    }
}

/// The models `serve-diff` compares on, with serve_diff.py's suite for each: the trained
/// one (real answers, EOS stops), an untrained Gemma 3 (special tokens and padding ids in
/// its output), and the tool-calling one (tool calls, tool results, reasoning).
const DIFF_MODELS: [(&str, &str); 3] = [
    ("tiny-llama-trained", "basic"),
    ("tiny-gemma3", "basic"),
    (TOOLS_MODEL, "tools"),
];

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
    for (name, suite) in DIFF_MODELS {
        let model = harness::goldens::model_dir(name)?;
        let ours = serve_in_process(&model)?;
        let peer_port = free_port()?;
        let mut peer = Peer(
            std::process::Command::new(harness::oracle::python())
                .args(["-m", "mlx_lm", "server", "--port", &peer_port.to_string()])
                .arg("--model")
                .arg(&model)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .context("starting mlx_lm.server in the oracle venv")?,
        );
        wait_ready(
            peer_port,
            "mlx_lm.server",
            || peer.0.try_wait().ok().flatten().map(|s| s.to_string()),
            |_| true,
        )?;
        let compare = |plant: bool| -> Result<bool> {
            let mut cmd = std::process::Command::new(harness::oracle::python());
            cmd.arg(repo.join("oracles/serve_diff.py"))
                .args(["--ours", &format!("http://127.0.0.1:{ours}")])
                .args(["--peer", &format!("http://127.0.0.1:{peer_port}")])
                .arg("--model")
                .arg(&model)
                .args(["--suite", suite]);
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
            let planted = match suite {
                "tools" => "our requests without tools and chat_template_kwargs",
                _ => "our answers cut at 4 tokens",
            };
            bail!("{name}: the planted difference ({planted}) was not caught");
        }
        println!("planted difference caught");
        // Had the peer lost its port to someone else, it would have exited by now: the
        // answers compared were then not its own.
        if let Some(status) = peer.0.try_wait()? {
            bail!("{name}: mlx_lm.server exited ({status}) during the diff; its answers are not trusted");
        }
    }
    if !failed.is_empty() {
        bail!("engine serve differs from mlx_lm.server on {failed:?}");
    }
    Ok(())
}
