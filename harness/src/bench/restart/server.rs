//! `harness bench --suite restart --restart-via server`: the restart suite through
//! `engine serve` over loopback HTTP, as a client sees it. The bench model gets a variant
//! whose config admits the prompt (`BenchModel::long_context`) and a word-level tokenizer
//! (`ensure_tokenizer`), so the prompt text is exactly the bench's prompt ids. Legs, each a
//! fresh server process: "store" (SSD tier on: one request, then SIGTERM, which writes the
//! conversation to the store); "fresh" (SSD tier off: the whole prompt is prefilled);
//! "restored" (a copy of the stored directory: the server finds the prefix, restores it and
//! prefills one token; /stats must count the restore). Each server answers a short warm-up
//! request first. TTFT: request sent → first streamed text; decode: (chunks − 1) / (last −
//! first chunk time), one chunk per token; and the server's CPU time per decoded token
//! over the same span (/proc/PID/task/*/schedstat), which other load on the machine
//! inflates far less than the wall-clock rate.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::RestartLeg;
use crate::bench::serve::{get, stream_completion};

/// What the server legs run with.
pub struct ServerLegs<'a> {
    pub model: &'a Path,
    /// `--kv-quant config --kv-config PATH` on every server.
    pub kv_config: Option<&'a Path>,
    /// `--quantized-kv-start` with `kv_config`: a cache converts once it holds this many
    /// tokens (the bench passes the prompt's length less one: the prompt is prefilled
    /// dense, decode and the stored entry are quantized; see `RestartOptions::kv_start`).
    pub kv_start: i32,
    pub prompt: &'a str,
    /// A short prompt sharing no first token with `prompt` (never restores anything).
    pub warmup: &'a str,
    pub max_tokens: usize,
    /// The store leg's directory; restored legs run on copies of it.
    pub ssd: &'a Path,
    /// Where the servers' stderr goes (quoted when a leg fails).
    pub logs: &'a Path,
}

/// A started server, killed (and reaped) when dropped.
struct Server {
    child: Child,
    port: u16,
    log: PathBuf,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }
}

/// Server start and shutdown bounds.
const START_TIMEOUT: Duration = Duration::from_secs(120);
const STOP_TIMEOUT: Duration = Duration::from_secs(300);
/// A client's read bound: a 16k-token prefill on `small` takes minutes.
const READ_TIMEOUT: Duration = Duration::from_secs(1800);

fn start(legs: &ServerLegs, ssd: Option<&Path>, name: &str) -> Result<Server> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let log = legs.logs.join(format!("{name}.log"));
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.arg("leg-serve")
        .arg("--model")
        .arg(legs.model)
        .arg("--port")
        .arg(port.to_string())
        .arg("--")
        .args(["--max-tokens", &legs.max_tokens.to_string()]);
    if let Some(dir) = ssd {
        // Nothing is written while the leg runs: only at shutdown (the store leg).
        cmd.arg("--ssd-cache")
            .arg(dir)
            .args(["--ssd-cache-debounce-ms", "86400000"]);
    }
    if let Some(kv) = legs.kv_config {
        cmd.args(["--kv-quant", "config", "--kv-config"]).arg(kv);
        cmd.args(["--quantized-kv-start", &legs.kv_start.to_string()]);
    }
    let child = cmd
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log)?)
        .spawn()
        .context("starting the engine server")?;
    let mut server = Server { child, port, log };
    let t0 = Instant::now();
    loop {
        if let Ok((200, _)) = get(port, "/health") {
            return Ok(server);
        }
        if let Some(status) = server.child.try_wait()? {
            bail!(
                "the {name} server exited ({status}) before answering /health:\n{}",
                server.log_tail()
            );
        }
        if t0.elapsed() > START_TIMEOUT {
            bail!(
                "the {name} server did not answer /health within {} s",
                START_TIMEOUT.as_secs()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// CPU seconds that process `pid` has run so far, all its threads (`schedstat`'s first
/// field, in ns); NaN where /proc cannot tell.
fn cpu_seconds(pid: u32) -> f64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return f64::NAN;
    };
    tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<f64>().ok())
        .sum::<f64>()
        * 1e-9
}

/// Minor page faults process `pid` has taken so far (`/proc/PID/stat` field 10, all its
/// threads); NaN where /proc cannot tell.
fn minor_faults(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return f64::NAN;
    };
    // The fields after the command name, which ends at the last ')': state is field 3.
    stat.rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().nth(7)?.parse::<f64>().ok())
        .unwrap_or(f64::NAN)
}

/// One streamed completion as a client sees it.
struct Streamed {
    ttft_s: f64,
    decode_tps: f64,
    /// The server's CPU time (all threads) between the first and the last chunk, per
    /// token after the first: less sensitive to other load than the wall-clock rate.
    decode_cpu_ms_per_token: f64,
    /// The server's minor page faults over the same span, per token after the first.
    minor_faults_per_token: f64,
}

/// One greedy streaming completion to the server `pid` listening on `port`.
fn stream(port: u16, pid: u32, prompt: &str, max_tokens: usize) -> Result<Streamed> {
    let sent = Instant::now();
    let (mut first, mut last, mut chunks) = (None, None, 0usize);
    let (mut cpu_first, mut cpu_last) = (f64::NAN, f64::NAN);
    let (mut faults_first, mut faults_last) = (f64::NAN, f64::NAN);
    let head = stream_completion(port, prompt, max_tokens, READ_TIMEOUT, |now| {
        chunks += 1;
        if first.is_none() {
            cpu_first = cpu_seconds(pid);
            faults_first = minor_faults(pid);
        }
        first.get_or_insert(now);
        last = Some(now);
        cpu_last = cpu_seconds(pid);
        faults_last = minor_faults(pid);
    })?;
    let (Some(first), Some(last)) = (first, last) else {
        bail!(
            "the streamed request produced no text; the server answered:\n{}",
            head.trim()
        );
    };
    let span = last.duration_since(first).as_secs_f64();
    let tps = if chunks > 1 && span > 0.0 {
        (chunks - 1) as f64 / span
    } else {
        0.0
    };
    let per_token = |first: f64, last: f64| match chunks > 1 {
        true => (last - first) / (chunks - 1) as f64,
        false => f64::NAN,
    };
    Ok(Streamed {
        ttft_s: first.duration_since(sent).as_secs_f64(),
        decode_tps: tps,
        decode_cpu_ms_per_token: per_token(cpu_first, cpu_last) * 1e3,
        minor_faults_per_token: per_token(faults_first, faults_last),
    })
}

/// The store leg: one request with the SSD tier on, then SIGTERM (the server writes the
/// conversation while it stops). Fails unless an entry is on disk afterwards.
pub fn store(legs: &ServerLegs) -> Result<()> {
    let mut server = start(legs, Some(legs.ssd), "store")?;
    let pid = server.child.id();
    stream(server.port, pid, legs.prompt, legs.max_tokens).context("the store leg's request")?;
    let pid = pid.to_string();
    let status = Command::new("kill").args(["-TERM", &pid]).status()?;
    if !status.success() {
        bail!("could not send SIGTERM to the store server ({pid})");
    }
    let t0 = Instant::now();
    while server.child.try_wait()?.is_none() {
        if t0.elapsed() > STOP_TIMEOUT {
            bail!(
                "the store server did not stop within {} s of SIGTERM",
                STOP_TIMEOUT.as_secs()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    if entries(legs.ssd)? == 0 {
        bail!(
            "the store server wrote no kv-store entry to {}:\n{}",
            legs.ssd.display(),
            server.log_tail()
        );
    }
    Ok(())
}

/// `*.mlxkv` files under `dir`.
fn entries(dir: &Path) -> Result<usize> {
    let mut n = 0;
    for e in std::fs::read_dir(dir)? {
        let p = e?.path();
        if p.is_dir() {
            n += entries(&p)?;
        } else if p.extension().is_some_and(|x| x == "mlxkv") {
            n += 1;
        }
    }
    Ok(n)
}

fn copy_dir(from: &Path, to: &Path) -> Result<()> {
    std::fs::create_dir_all(to)?;
    for e in std::fs::read_dir(from)? {
        let e = e?;
        let (src, dst) = (e.path(), to.join(e.file_name()));
        if e.file_type()?.is_dir() {
            copy_dir(&src, &dst)?;
        } else {
            std::fs::copy(&src, &dst)?;
            // On disk before the leg starts: the kernel's writeback of the copy would
            // otherwise run during the restored leg's decode, on the same two cores.
            std::fs::File::open(&dst)?.sync_all()?;
        }
    }
    Ok(())
}

/// The server's `/stats` count of one-token steps run through the compiled graph.
fn compiled_steps(port: u16) -> Result<u64> {
    let (_, body) = get(port, "/stats")?;
    let stats: serde_json::Value =
        serde_json::from_str(&body).with_context(|| format!("/stats is not JSON: {body}"))?;
    stats["decode"]["compiled_steps"]
        .as_u64()
        .with_context(|| format!("/stats has no decode.compiled_steps: {body}"))
}

/// A "fresh" (SSD tier off) or "restored" (on a copy of the store) leg; `n` numbers the
/// leg's files.
pub fn leg(legs: &ServerLegs, mode: &str, n: usize) -> Result<RestartLeg> {
    let ssd = match mode {
        "fresh" => None,
        "restored" => {
            let copy = legs.logs.join(format!("ssd-{n}"));
            copy_dir(legs.ssd, &copy)?;
            Some(copy)
        }
        other => bail!("unknown restart leg `{other}`"),
    };
    let server = start(legs, ssd.as_deref(), &format!("{mode}-{n}"))?;
    let pid = server.child.id();
    stream(server.port, pid, legs.warmup, 8).context("the warm-up request")?;
    let before = compiled_steps(server.port)?;
    let got = stream(server.port, pid, legs.prompt, legs.max_tokens)
        .with_context(|| format!("the {mode} leg's request:\n{}", server.log_tail()))?;
    // The measured request's own: the `WherePays` probe chooses per session.
    let compiled = compiled_steps(server.port)? - before;
    let mut out = RestartLeg {
        mode: mode.into(),
        ttft_s: got.ttft_s,
        decode_tps: got.decode_tps,
        decode_cpu_ms_per_token: Some(got.decode_cpu_ms_per_token),
        restore_ms: 0.0,
        checksum_ms: 0.0,
        checksum_wait_ms: 0.0,
        compiled_steps: Some(compiled as usize),
        minor_faults_per_token: Some(got.minor_faults_per_token),
    };
    if mode == "restored" {
        let (_, body) = get(server.port, "/stats")?;
        let stats: serde_json::Value =
            serde_json::from_str(&body).with_context(|| format!("/stats is not JSON: {body}"))?;
        let ssd = &stats["ssd_cache"];
        if ssd["restores"].as_u64().unwrap_or(0) == 0 {
            bail!("the restored leg's server restored nothing from the store (/stats: {ssd})");
        }
        out.restore_ms = ssd["restore_ms_last"].as_f64().unwrap_or(f64::NAN);
        out.checksum_ms = ssd["checksum_ms_last"].as_f64().unwrap_or(f64::NAN);
        out.checksum_wait_ms = f64::NAN;
    }
    drop(server);
    if let Some(copy) = ssd {
        let _ = std::fs::remove_dir_all(copy);
    }
    Ok(out)
}
