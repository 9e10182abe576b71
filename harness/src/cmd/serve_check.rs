//! `harness serve-check`: `engine serve` on the built-in model, in this process on a free
//! loopback port, checked by the official `openai` Python client (oracles/openai_client.py
//! in the oracle venv); then on models/tiny-qwen3-tools, an agent-style exchange with the
//! same client (tool call, tool result, final answer; oracles/openai_agent.py); and the
//! client's Responses API on the first model (oracles/openai_responses.py); the official
//! `anthropic` client's Messages API on each (oracles/anthropic_client.py: the basic group on
//! the first, a streamed agent exchange with thinking on the second). Each group runs once
//! more with its planted client-side difference, which must fail.
//! `harness serve-diff`: the same greedy requests to `engine serve` and `mlx_lm.server` on
//! the same model, compared response by response and chunk by chunk (oracles/serve_diff.py;
//! on tiny-qwen3-tools its tools suite: tool calls and reasoning), then once more with a
//! planted difference that must be caught. `harness serve-diff --ranks N`: the same with both
//! servers as N tensor-parallel ranks on loopback — ours as N `harness leg-serve` processes
//! given mlx.launch's environment, the peer under `mlx.launch --backend ring -n N`.
//! `harness serve-diff --vision`: images, against `mlx_vlm.server` (serve_diff_vision.rs).

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

pub(super) fn free_port() -> Result<u16> {
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
pub(super) fn wait_ready(
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

/// `engine serve` for `model` (with `extra` flags) on a thread of this process; returns its
/// port. (It stays up, idle, until the process ends.)
pub(super) fn serve_in_process(model: &std::path::Path, extra: &[String]) -> Result<u16> {
    let port = free_port()?;
    let serve_args = super::bench::serve_args_with(model, port, extra)?;
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

/// An oracle client script (`oracles/SCRIPT`) against `base_url` with `args`; with
/// `--plant` among them the run prints nothing of its own (it is expected to fail).
fn oracle_client(script: &str, base_url: String, args: &[&str]) -> Result<bool> {
    let mut cmd = std::process::Command::new(harness::oracle::python());
    cmd.arg(harness::oracle::repo_root().join("oracles").join(script))
        .arg("--base-url")
        .arg(base_url)
        .args(args);
    if args.contains(&"--plant") {
        cmd.stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
    }
    Ok(cmd
        .status()
        .with_context(|| format!("running oracles/{script}"))?
        .success())
}

/// `--plant` when `plant`.
fn planted(plant: bool) -> &'static [&'static str] {
    if plant {
        &["--plant"]
    } else {
        &[]
    }
}

/// oracles/openai_client.py (with `extra` arguments) against our server on `port`.
fn openai_client(port: u16, extra: &[&str]) -> Result<bool> {
    oracle_client(
        "openai_client.py",
        format!("http://127.0.0.1:{port}/v1"),
        extra,
    )
}

/// oracles/openai_responses.py (the client's `responses.create`) against our server on
/// `port`; `plant`: its second turn without previous_response_id, which must fail.
fn openai_responses(port: u16, plant: bool) -> Result<bool> {
    oracle_client(
        "openai_responses.py",
        format!("http://127.0.0.1:{port}/v1"),
        planted(plant),
    )
}

/// oracles/anthropic_client.py (the official `anthropic` client's Messages API) against our
/// server on `port`: the basic group, or with `agent` the agent exchange on the tools model;
/// `plant`: its planted client-side difference, which must fail.
fn anthropic_client(port: u16, agent: bool, plant: bool) -> Result<bool> {
    let mut args = if agent { vec!["--agent"] } else { vec![] };
    args.extend(planted(plant));
    oracle_client(
        "anthropic_client.py",
        format!("http://127.0.0.1:{port}"),
        &args,
    )
}

/// oracles/prometheus_check.py: our server's /metrics on `port` scraped and parsed by the
/// Prometheus org's Python parser around two known requests; then once more with a line of
/// the exposition broken (`--plant`), which the parser must refuse. Fails if either goes
/// the wrong way.
fn prometheus_check(port: u16) -> Result<()> {
    let run = |plant: bool| {
        oracle_client(
            "prometheus_check.py",
            format!("http://127.0.0.1:{port}"),
            planted(plant),
        )
    };
    println!(
        "== {}: /metrics through the Prometheus parser",
        super::DEFAULT_MODEL
    );
    if !run(false)? {
        bail!("the /metrics checks failed");
    }
    if run(true)? {
        bail!("the /metrics check's planted malformed line was not caught");
    }
    println!("planted difference caught");
    Ok(())
}

pub fn run() -> Result<()> {
    harness::bench::ensure_oracle_venv()?;
    let model = harness::goldens::model_dir(super::DEFAULT_MODEL)?;
    println!("== {}: the openai client", super::DEFAULT_MODEL);
    let port = serve_in_process(&model, &[])?;
    let basic = openai_client(port, &[])?;
    println!(
        "== {}: the openai client's Responses API",
        super::DEFAULT_MODEL
    );
    let responses = openai_responses(port, false)?;
    prometheus_check(port)?;
    if openai_responses(port, true)? {
        bail!("the Responses check's planted difference (turn 2 without previous_response_id) was not caught");
    }
    println!("planted difference caught");
    println!(
        "== {}: the anthropic client's Messages API",
        super::DEFAULT_MODEL
    );
    let messages = anthropic_client(port, false, false)?;
    if anthropic_client(port, false, true)? {
        bail!("the Messages check's planted difference (count_tokens without the system prompt) was not caught");
    }
    println!("planted difference caught");
    // The first server stays up, idle, while the second one answers.
    let tools = harness::goldens::model_dir(TOOLS_MODEL)?;
    println!("== {TOOLS_MODEL}: an agent exchange with the openai client");
    let port = serve_in_process(&tools, &[])?;
    let agent = openai_client(port, &["--agent"])?;
    if openai_client(port, &["--agent", "--plant"])? {
        bail!("the agent exchange's planted difference (requests without tools) was not caught");
    }
    println!("planted difference caught");
    println!("== {TOOLS_MODEL}: an agent exchange with the anthropic client (thinking, streamed)");
    let anthropic_agent = anthropic_client(port, true, false)?;
    if anthropic_client(port, true, true)? {
        bail!("the anthropic agent exchange's planted difference (requests without tools) was not caught");
    }
    println!("planted difference caught");
    if !messages {
        bail!("the anthropic client's Messages API checks failed");
    }
    if !anthropic_agent {
        bail!("the anthropic client's agent exchange failed");
    }
    if !responses {
        bail!("the openai client's Responses API checks failed");
    }
    match (basic, agent) {
        (true, true) => Ok(()),
        (false, true) => bail!("the openai client checks failed"),
        (true, false) => bail!("the openai client's agent exchange failed"),
        (false, false) => bail!("the openai client checks and its agent exchange failed"),
    }
}

/// The models `serve-diff` compares on, with serve_diff.py's suite for each and a Jinja
/// comment both servers get appended to the model's own template (`--chat-template`): the
/// trained one (real answers, EOS stops), an untrained Gemma 3 (special tokens and padding
/// ids in its output), and the tool-calling one (tool calls, tool results, reasoning) —
/// once as it is (json_tools) and once with `<arg_key>` in its template text, which makes
/// both servers parse its calls with glm47 (its JSON-object fallback; a call cut by
/// max_tokens goes to its plain-text fallback). The rendered prompts are the same.
const DIFF_MODELS: [(&str, &str, Option<&str>); 4] = [
    ("tiny-llama-trained", "basic", None),
    ("tiny-gemma3", "basic", None),
    (TOOLS_MODEL, "tools", None),
    (TOOLS_MODEL, "tools", Some("{# glm47 marker: <arg_key> #}")),
];

/// The adapter row of the diff: ours serves `--adapter trained=DIR` and is asked for
/// "trained"; mlx_lm.server runs with `--adapter-path DIR` (its requests name the adapter).
const DIFF_ADAPTER: (&str, &str) = ("tiny-llama-trained", "train/tiny-llama-trained/adapters");

/// The `--chat-template` flags for a diff row's template comment (none without one).
fn template_flags(model: &std::path::Path, comment: Option<&str>) -> Result<Vec<String>> {
    let Some(comment) = comment else {
        return Ok(Vec::new());
    };
    let path = model.join("chat_template.jinja");
    let template = std::fs::read_to_string(&path).with_context(|| format!("{path:?}"))?;
    Ok(vec![
        "--chat-template".into(),
        format!("{template}{comment}"),
    ])
}

/// Kills the peer server when the diff ends, however it ends.
pub(super) struct Peer(pub(super) std::process::Child);

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `harness serve-diff` flags.
#[derive(clap::Args, Debug)]
pub struct DiffArgs {
    /// Both servers as this many ranks on loopback: ours given mlx.launch's environment,
    /// mlx_lm.server under `mlx.launch --backend ring -n N` (tensor parallel on
    /// tiny-llama-trained).
    #[arg(long, default_value_t = 1)]
    ranks: usize,
    /// With --ranks: pipeline parallel instead (tiny-qwen2; both get --pipeline).
    #[arg(long)]
    pipeline: bool,
    /// One of our ranks in this process: `engine serve` for this model (used by --ranks).
    #[arg(long, hide = true)]
    serve_rank: Option<std::path::PathBuf>,
    #[arg(long, hide = true, default_value_t = 0)]
    port: u16,
    /// Requests with images against mlx_vlm.server on the vision fixtures (its venv:
    /// oracles/requirements-vision-serve.txt).
    #[arg(long)]
    pub vision: bool,
    /// With --vision: mlx_vlm.server on both sides (checks the requests and the plant).
    #[arg(long, requires = "vision")]
    pub peer_only: bool,
}

pub fn diff(args: DiffArgs) -> Result<()> {
    if let Some(model) = &args.serve_rank {
        let mut serve = super::bench::serve_args(model, args.port)?;
        serve.dist.pipeline = args.pipeline;
        // Requests sent at once decode together, as mlx_lm.server's BatchGenerator decodes
        // them (its --prompt-concurrency: 8), tensor-parallel or pipeline ranks alike.
        serve.batch = 8;
        return engine::serve::run(serve);
    }
    if args.ranks > 1 {
        return diff_ranks(args.ranks, args.pipeline);
    }
    harness::bench::ensure_oracle_venv()?;
    let repo = harness::oracle::repo_root();
    let mut failed = Vec::new();
    let adapter_row = (DIFF_ADAPTER.0, "basic", None);
    for (row, (name, suite, comment)) in DIFF_MODELS.into_iter().chain([adapter_row]).enumerate() {
        let model = harness::goldens::model_dir(name)?;
        let mut flags = template_flags(&model, comment)?;
        let mut peer_flags = flags.clone();
        let adapter = (row == DIFF_MODELS.len()).then(|| repo.join("goldens").join(DIFF_ADAPTER.1));
        if let Some(dir) = &adapter {
            flags.extend(["--adapter".to_owned(), format!("trained={}", dir.display())]);
            peer_flags.extend(["--adapter-path".to_owned(), dir.display().to_string()]);
        }
        let ours = serve_in_process(&model, &flags)?;
        let peer_port = free_port()?;
        let mut peer = Peer(
            std::process::Command::new(harness::oracle::python())
                .args(["-m", "mlx_lm", "server", "--port", &peer_port.to_string()])
                .arg("--model")
                .arg(&model)
                .args(&peer_flags)
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
            if let Some(dir) = &adapter {
                cmd.args(["--ours-model", "trained", "--peer-adapters"])
                    .arg(dir);
            }
            if plant {
                cmd.arg("--plant").stdout(std::process::Stdio::null());
            }
            Ok(cmd
                .status()
                .context("running oracles/serve_diff.py")?
                .success())
        };
        let with = match (&adapter, comment) {
            (Some(_), _) => " (adapter `trained`)".to_owned(),
            (None, c) => c.map_or(String::new(), |c| format!(" (template + {c})")),
        };
        println!("== {name}{with}: engine serve vs mlx_lm.server");
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

/// Ranks (ours, or mlx.launch and its ranks) killed when the diff ends, however it ends:
/// each started in a process group of its own, which is killed whole.
struct Ranks(Vec<std::process::Child>);

impl Drop for Ranks {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = std::process::Command::new("kill")
                .args(["-KILL", "--", &format!("-{}", c.id())])
                .status();
            let _ = c.wait();
        }
    }
}

impl Ranks {
    /// Why a rank (or the launcher) has exited, if one has.
    fn gone(&mut self) -> Option<String> {
        self.0.iter_mut().enumerate().find_map(|(r, c)| {
            let status = c.try_wait().ok().flatten()?;
            Some(format!("process {r} exited ({status})"))
        })
    }
}

/// `n` consecutive loopback ports free now (mlx.launch's ring counts up from `-p`).
fn free_run(n: u16) -> Result<u16> {
    for _ in 0..100 {
        let start = free_port()?;
        if start.checked_add(n).is_none() {
            continue;
        }
        let held: Result<Vec<_>, _> = (start..start + n)
            .map(|p| std::net::TcpListener::bind(("127.0.0.1", p)))
            .collect();
        if held.is_ok() {
            return Ok(start);
        }
    }
    bail!("no {n} consecutive free loopback ports")
}

/// A process in a process group of its own (so that its children are killed with it).
fn own_group(cmd: &mut std::process::Command) -> &mut std::process::Command {
    use std::os::unix::process::CommandExt;
    cmd.process_group(0)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
}

/// `engine serve` as `n` ranks (rank 0 serves HTTP on `port`): this binary's hidden
/// `serve-diff --serve-rank` with MLX_RANK and MLX_HOSTFILE as mlx.launch sets them.
fn our_ranks(
    model: &std::path::Path,
    n: usize,
    port: u16,
    hostfile: &std::path::Path,
    pipeline: bool,
) -> Result<Ranks> {
    let start = free_run(n as u16)?;
    let hosts: Vec<Vec<String>> = (0..n as u16)
        .map(|r| vec![format!("127.0.0.1:{}", start + r)])
        .collect();
    std::fs::write(hostfile, serde_json::to_string(&hosts)?)?;
    let mut ranks = Ranks(Vec::new());
    for r in 0..n {
        let mut cmd = std::process::Command::new(std::env::current_exe()?);
        cmd.args(["serve-diff", "--port", &port.to_string(), "--serve-rank"])
            .arg(model)
            .args(pipeline.then_some("--pipeline"))
            .env("MLX_RANK", r.to_string())
            .env("MLX_HOSTFILE", hostfile);
        // Our ranks' own messages (their group, a failure) are worth seeing.
        let rank = own_group(&mut cmd).stderr(std::process::Stdio::inherit());
        ranks.0.push(rank.spawn()?);
    }
    Ok(ranks)
}

/// mlx_lm.server as `n` ranks under `mlx.launch --backend ring` (rank 0 serves on `port`).
fn peer_ranks(model: &std::path::Path, n: usize, port: u16, pipeline: bool) -> Result<Ranks> {
    let bin = harness::oracle::venv_dir().join("bin");
    let mut cmd = std::process::Command::new(bin.join("mlx.launch"));
    cmd.args(["--backend", "ring", "-n", &n.to_string()])
        .args(["-p", &free_run(n as u16)?.to_string(), "--"])
        .arg(bin.join("mlx_lm.server"))
        .args(["--port", &port.to_string(), "--model"])
        .arg(model)
        .args(pipeline.then_some("--pipeline"));
    Ok(Ranks(vec![own_group(&mut cmd)
        .spawn()
        .context("starting mlx.launch in the oracle venv")?]))
}

/// The models `serve-diff --ranks N` compares on: Llama tensor parallel, qwen2 pipeline
/// parallel (the families both engines split each way).
const TP_MODEL: &str = "tiny-llama-trained";
const PP_MODEL: &str = "tiny-qwen2";

/// The directory mlx-lm's pipeline load reads: `model` itself when it has
/// model.safetensors.index.json, else `view` made as a copy of links to its files with a
/// one-file index (mlx-lm's sharded_load reads the index to pick each stage's files).
fn pp_view(model: &std::path::Path, view: &std::path::Path) -> Result<std::path::PathBuf> {
    if model.join("model.safetensors.index.json").exists() {
        return Ok(model.to_path_buf());
    }
    std::fs::create_dir_all(view)?;
    for entry in std::fs::read_dir(model)? {
        let entry = entry?;
        let link = view.join(entry.file_name());
        if !link.exists() {
            std::os::unix::fs::symlink(entry.path().canonicalize()?, &link)?;
        }
    }
    let bytes = std::fs::read(model.join("model.safetensors"))?;
    let len = u64::from_le_bytes(bytes[..8].try_into()?) as usize;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + len])?;
    let weight_map: serde_json::Map<_, _> = header
        .keys()
        .filter(|k| *k != "__metadata__")
        .map(|k| (k.clone(), serde_json::json!("model.safetensors")))
        .collect();
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(view.join("model.safetensors.index.json"), index.to_string())?;
    Ok(view.to_path_buf())
}

/// `serve-diff --ranks N [--pipeline]`: serve_diff.py's `dist` suite (the basic one plus
/// seeded sampled requests) against both servers as N ranks, then the planted difference.
fn diff_ranks(n: usize, pipeline: bool) -> Result<()> {
    harness::bench::ensure_oracle_venv()?;
    let repo = harness::oracle::repo_root();
    let (name, mode) = match pipeline {
        true => (PP_MODEL, "pipeline"),
        false => (TP_MODEL, "tensor"),
    };
    let tmp = std::env::temp_dir().join(format!("serve-diff-{}", std::process::id()));
    std::fs::create_dir_all(&tmp)?;
    let model = harness::goldens::model_dir(name)?;
    let model = match pipeline {
        true => pp_view(&model, &tmp.join(name))?,
        false => model,
    };
    let result = compare_ranks(&repo, &model, n, pipeline, &tmp.join("hostfile.json"));
    let _ = std::fs::remove_dir_all(&tmp);
    println!("({name}, {n} {mode}-parallel ranks each)");
    result
}

fn compare_ranks(
    repo: &std::path::Path,
    model: &std::path::Path,
    n: usize,
    pipeline: bool,
    hostfile: &std::path::Path,
) -> Result<()> {
    let (ours, peer_port) = (free_port()?, free_port()?);
    let mut mine = our_ranks(model, n, ours, hostfile, pipeline)?;
    let id = model.canonicalize()?.display().to_string();
    wait_ready(
        ours,
        "engine serve (rank 0)",
        || mine.gone(),
        |body| {
            serde_json::from_str::<serde_json::Value>(body)
                .is_ok_and(|v| v["data"][0]["id"] == id.as_str())
        },
    )?;
    let mut peer = peer_ranks(model, n, peer_port, pipeline)?;
    wait_ready(
        peer_port,
        "mlx_lm.server under mlx.launch",
        || peer.gone(),
        |_| true,
    )?;
    let compare = |plant: bool| -> Result<bool> {
        let mut cmd = std::process::Command::new(harness::oracle::python());
        cmd.arg(repo.join("oracles/serve_diff.py"))
            .args(["--ours", &format!("http://127.0.0.1:{ours}")])
            .args(["--peer", &format!("http://127.0.0.1:{peer_port}")])
            .arg("--model")
            .arg(model)
            .args(["--suite", "dist"]);
        if plant {
            cmd.arg("--plant").stdout(std::process::Stdio::null());
        }
        Ok(cmd
            .status()
            .context("running oracles/serve_diff.py")?
            .success())
    };
    println!("== engine serve vs mlx_lm.server, {n} ranks each");
    let same = compare(false)?;
    // The requests sent at once did decode together on our ranks.
    let lanes = get(ours, "/stats")
        .and_then(|(_, body)| serde_json::from_str::<serde_json::Value>(&body).ok())
        .map(|st| st["lanes"].clone())
        .context("rank 0's /stats")?;
    println!("our rank 0's lanes: {lanes}");
    if lanes["batch_peak_rows"].as_u64() < Some(2) {
        bail!("our ranks did not decode the requests sent at once together: {lanes}");
    }
    if compare(true)? {
        bail!("the planted difference (our answers cut at 4 tokens) was not caught");
    }
    println!("planted difference caught");
    // A rank that exited mid-diff (or a peer that lost its port) makes the answers untrusted.
    for (what, ranks) in [("engine serve", &mut mine), ("mlx.launch", &mut peer)] {
        if let Some(why) = ranks.gone() {
            bail!("{what}: {why} during the diff; its answers are not trusted");
        }
    }
    if !same {
        bail!("engine serve differs from mlx_lm.server on {n} ranks");
    }
    Ok(())
}
