//! `harness bench --suite serve`: `engine serve` against `mlx_lm.server` on the same model,
//! each a fresh server process, driven over loopback HTTP by 1, 4, 8, 16 and 32 concurrent
//! streaming clients. Per level: median TTFT (request sent → first content chunk), median
//! per-request decode tok/s, and throughput (completion tokens / wall time of the level).
//! Direct generation (`engine generate`'s path in a warm process, no HTTP) at one client gives the served
//! overhead.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::median;

pub const LEVELS: [usize; 5] = [1, 4, 8, 16, 32];
const PROMPT: &str = "The little robot";

/// One request's timings.
#[derive(Debug, Clone, Copy)]
pub(super) struct Sample {
    pub ttft: f64,
    pub decode_tps: f64,
    pub tokens: usize,
}

/// One level's medians.
#[derive(Debug, Clone, Copy)]
pub struct Level {
    pub clients: usize,
    pub ttft_ms: f64,
    pub decode_tps: f64,
    pub throughput_tps: f64,
}

impl Level {
    /// (figure, unit, higher is better) of one level, named as its results-DB metric.
    pub fn kinds(clients: usize) -> [(String, &'static str, bool); 3] {
        [
            (format!("ttft_ms_c{clients}"), "ms", false),
            (format!("decode_tps_c{clients}"), "tok/s", true),
            (format!("throughput_tps_c{clients}"), "tok/s", true),
        ]
    }

    /// This level's figures, as `kinds` names them.
    pub fn figures(&self) -> Vec<(String, f64)> {
        let [t, d, p] = Self::kinds(self.clients);
        vec![
            (t.0, self.ttft_ms),
            (d.0, self.decode_tps),
            (p.0, self.throughput_tps),
        ]
    }
}

pub struct Server {
    child: Child,
    pub port: u16,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Starts `stack`'s server on `model` and waits for /health.
pub fn start(stack: &str, model: &Path, batch: usize) -> Result<Server> {
    start_with(stack, model, batch, &[])
}

/// `start`, the engine given more `engine serve` flags (`extra`; the batch-spec suite's
/// `--draft-model`).
pub fn start_with(stack: &str, model: &Path, batch: usize, extra: &[String]) -> Result<Server> {
    let server = spawn_with(stack, model, batch, extra)?;
    let start = Instant::now();
    loop {
        if let Ok((200, _)) = get(server.port, "/health") {
            return Ok(server);
        }
        if start.elapsed() > Duration::from_secs(120) {
            bail!("the {stack} server did not answer /health within 120 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Starts `stack`'s server on `model` on a free port, without waiting for it.
pub fn spawn(stack: &str, model: &Path, batch: usize) -> Result<Server> {
    spawn_with(stack, model, batch, &[])
}

fn spawn_with(stack: &str, model: &Path, batch: usize, extra: &[String]) -> Result<Server> {
    let port = free_port()?;
    let mut cmd = if stack == "engine" {
        let mut c = Command::new(std::env::current_exe()?);
        c.arg("leg-serve").arg("--batch").arg(batch.to_string());
        c
    } else {
        let mut c = Command::new(crate::oracle::python());
        c.args(["-m", "mlx_lm.server", "--log-level", "WARNING"]);
        c
    };
    cmd.arg("--model")
        .arg(model)
        .arg("--port")
        .arg(port.to_string())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    if stack == "engine" && !extra.is_empty() {
        // `engine serve` flags for leg-serve, after its own.
        cmd.arg("--").args(extra);
    }
    let child = cmd
        .spawn()
        .with_context(|| format!("starting the {stack} server"))?;
    Ok(Server { child, port })
}

/// GET `path` on a local server: (status, body); bounded by a 30 s read timeout.
pub(super) fn get(port: u16, path: &str) -> Result<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    let code = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_owned();
    Ok((code, body))
}

/// One streaming completion, retried (up to 20 times) when the server resets the
/// connection before answering — mlx_lm.server's listen backlog is small, so bursts of
/// clients can be refused at connect; TTFT counts from the first attempt.
fn stream_once(port: u16, max_tokens: usize) -> Result<Sample> {
    let first_try = Instant::now();
    let mut attempt = 0;
    loop {
        match stream_attempt(port, max_tokens, first_try) {
            Err(e) if attempt < 20 && is_refused(&e) => {
                attempt += 1;
                std::thread::sleep(Duration::from_millis(20 * attempt));
            }
            other => return other,
        }
    }
}

fn is_refused(e: &anyhow::Error) -> bool {
    e.downcast_ref::<std::io::Error>().is_some_and(|io| {
        matches!(
            io.kind(),
            std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::ConnectionRefused
        )
    })
}

fn stream_attempt(port: u16, max_tokens: usize, sent: Instant) -> Result<Sample> {
    // No "model" field: mlx_lm.server would try to fetch a model of that name.
    let body = serde_json::json!({
        "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0, "stream": true,
    });
    timed_stream(port, &body, sent)
}

/// One streamed request `body`, timed from `sent`: TTFT, per-stream decode tok/s (over the
/// chunks after the first) and the chunks that carried text.
pub(super) fn timed_stream(port: u16, body: &serde_json::Value, sent: Instant) -> Result<Sample> {
    let (mut first, mut last, mut chunks) = (None, None, 0usize);
    stream_body(port, body, Duration::from_secs(300), |now, _| {
        chunks += 1;
        first.get_or_insert(now);
        last = Some(now);
    })?;
    let (Some(first), Some(last)) = (first, last) else {
        bail!("a streamed request produced no text");
    };
    let span = last.duration_since(first).as_secs_f64();
    Ok(Sample {
        ttft: first.duration_since(sent).as_secs_f64(),
        decode_tps: if chunks > 1 && span > 0.0 {
            (chunks - 1) as f64 / span
        } else {
            0.0
        },
        tokens: chunks,
    })
}

/// `clients` threads at once, each making `per_client` calls of `call(client)`: every
/// result, and the wall time from the first start to the last end.
pub(super) fn fan_out<T: Send + 'static>(
    clients: usize,
    per_client: usize,
    call: impl Fn(usize) -> Result<T> + Send + Sync + 'static,
) -> Result<(Vec<T>, f64)> {
    let call = std::sync::Arc::new(call);
    let start = Instant::now();
    let handles: Vec<_> = (0..clients)
        .map(|i| {
            let call = call.clone();
            std::thread::spawn(move || -> Result<Vec<T>> {
                (0..per_client).map(|_| call(i)).collect()
            })
        })
        .collect();
    let mut out = Vec::new();
    for h in handles {
        out.extend(
            h.join()
                .map_err(|_| anyhow::anyhow!("a client thread panicked"))??,
        );
    }
    Ok((out, start.elapsed().as_secs_f64()))
}

/// One greedy streaming `/v1/completions` request of `prompt` to the server on `port`
/// (either stack): `on_text` runs at the arrival of every chunk that carries text. Returns
/// the first 4 KiB of what the server sent (for an error message when no text came).
pub fn stream_completion(
    port: u16,
    prompt: &str,
    max_tokens: usize,
    read_timeout: Duration,
    mut on_text: impl FnMut(Instant),
) -> Result<String> {
    let body = serde_json::json!({
        "prompt": prompt, "max_tokens": max_tokens,
        "temperature": 0.0, "stream": true,
    });
    stream_body(port, &body, read_timeout, |now, _| on_text(now))
}

/// `stream_completion` of a whole request `body` (its `stream` must be true); `on_text`
/// gets each chunk's text too.
pub fn stream_body(
    port: u16,
    body: &serde_json::Value,
    read_timeout: Duration,
    mut on_text: impl FnMut(Instant, &str),
) -> Result<String> {
    let body = body.to_string();
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(read_timeout))?;
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut buf = [0u8; 8192];
    let (mut pending, mut head) = (String::new(), String::new());
    loop {
        let n = s.read(&mut buf)?;
        if n == 0 {
            return Ok(head);
        }
        let now = Instant::now();
        pending.push_str(&String::from_utf8_lossy(&buf[..n]));
        while let Some(i) = pending.find('\n') {
            let line: String = pending.drain(..=i).collect();
            if head.len() < 4096 {
                head.push_str(&line);
            }
            let Some(data) = line.trim().strip_prefix("data: ") else {
                continue;
            };
            let v: serde_json::Value = serde_json::from_str(data).unwrap_or_default();
            if let Some(text) = v["choices"][0]["text"].as_str().filter(|t| !t.is_empty()) {
                on_text(now, text);
            }
        }
    }
}

/// Runs every level against a started server: each client sends `per_client` requests.
pub fn levels(port: u16, per_client: usize, max_tokens: usize) -> Result<Vec<Level>> {
    stream_once(port, max_tokens)?; // warm-up
    let mut out = Vec::new();
    for clients in LEVELS {
        let (samples, wall) = fan_out(clients, per_client, move |_| stream_once(port, max_tokens))?;
        let tokens: usize = samples.iter().map(|s| s.tokens).sum();
        out.push(Level {
            clients,
            ttft_ms: median(samples.iter().map(|s| s.ttft * 1e3).collect()),
            decode_tps: median(samples.iter().map(|s| s.decode_tps).collect()),
            throughput_tps: tokens as f64 / wall,
        });
    }
    Ok(out)
}

/// The committed model the serve suite runs on (servers need a tokenizer; the bench
/// checkpoints have none).
pub fn model_dir(name: &str) -> Result<PathBuf> {
    Ok(crate::goldens::model_dir(name)?)
}

/// Serve-suite options.
pub struct ServeOptions {
    pub model: String,
    pub rounds: usize,
    pub per_client: usize,
    pub max_tokens: usize,
    pub peer: bool,
    pub clean: bool,
    pub force: bool,
    /// `engine serve --batch` for the engine's server.
    pub batch: usize,
}

/// Medians over rounds, per stack and level, and every leg's figures; plus direct
/// generation's decode tok/s.
pub struct ServeResult {
    pub stacks: Vec<(String, Vec<Level>)>,
    pub legs: super::kept::Kept,
    pub direct_decode_tps: f64,
}

pub fn run(
    opts: &ServeOptions,
) -> Result<(
    ServeResult,
    crate::preflight::MachineState,
    crate::preflight::MachineState,
)> {
    use crate::preflight::{self, Thresholds};
    let thresholds = Thresholds::from_env();
    let before = preflight::check(&thresholds);
    if !before.clean && !opts.force {
        bail!(
            "this machine is not clean, so the serve bench refuses to measure:\n{}\nLet it settle \
             and retry, or pass --force (rows are then tagged dirty and never promoted).",
            before
                .reasons
                .iter()
                .map(|r| format!("  - {r}"))
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
    if opts.peer {
        super::ensure_oracle_venv()?;
    }
    let dir = model_dir(&opts.model)?;
    let mut stacks: Vec<&'static str> = vec!["engine"];
    if opts.peer {
        stacks.push("mlx-lm");
    }
    let order = super::leg_order(opts.rounds, &stacks);
    let bar = super::Progress::new("serve", order.len());
    let mut legs = super::kept::Kept::default();
    for stack in &order {
        bar.start(format!("{} · {stack}", opts.model));
        let server = start(stack, &dir, opts.batch)?;
        let measured = levels(server.port, opts.per_client, opts.max_tokens)
            .with_context(|| format!("serving with {stack}"))?;
        legs.push(stack, measured.iter().flat_map(Level::figures));
        drop(server);
        bar.done();
    }
    bar.finish();
    let stacks = stacks
        .iter()
        .map(|s| {
            let levels = LEVELS
                .iter()
                .map(|&c| {
                    let m = |name: &str| legs.median(s, &format!("{name}_c{c}"));
                    Level {
                        clients: c,
                        ttft_ms: m("ttft_ms"),
                        decode_tps: m("decode_tps"),
                        throughput_tps: m("throughput_tps"),
                    }
                })
                .collect();
            (s.to_string(), levels)
        })
        .collect();
    // Direct generation on the same model and prompt, no HTTP (engine generate's path),
    // stopping at the model's EOS as the served answers do: the same tokens.
    let model = engine::model::load(&dir)?;
    let tokenizer = engine::load::tokenizer::Tokenizer::load(&dir)?;
    let ids = tokenizer.encode(PROMPT, true)?;
    // A warm process, as the server is: the compile probe's choice carries over from the
    // warm-up to the measured generations (`probe::Memo`), as it does between requests.
    let session = engine::generate::SessionOptions::default().sharing_probe_choices();
    let direct: Vec<f64> = (0..opts.rounds)
        .map(|_| {
            engine::generate::bench::run_leg_until(
                model.as_ref(),
                &ids,
                opts.max_tokens,
                &tokenizer.eos_token_ids,
                "engine-direct",
                &session,
            )
            .map(|l| l.decode_tps)
        })
        .collect::<Result<_, _>>()?;
    for v in &direct {
        legs.push("engine", [("direct_decode_tps".to_owned(), *v)]);
    }
    // The servers and their 32 clients load every core: let that decay before judging.
    let after = preflight::check_after_own_load(&before, &thresholds);
    Ok((
        ServeResult {
            stacks,
            legs,
            direct_decode_tps: median(direct),
        },
        before,
        after,
    ))
}

pub fn table(model: &str, r: &ServeResult) -> String {
    let find = |s: &str| r.stacks.iter().find(|(k, _)| k == s).map(|(_, l)| l);
    let (e, p) = (find("engine"), find("mlx-lm"));
    let mut s = format!(
        "{:<20} {:>8} {:>14} {:>14} {:>10}\n",
        "serve", "clients", "engine", "mlx-lm", "eng/mlx"
    );
    for i in 0..LEVELS.len() {
        for (name, f) in [
            ("ttft_ms", (|l: &Level| l.ttft_ms) as fn(&Level) -> f64),
            ("decode_tps", |l: &Level| l.decode_tps),
            ("throughput_tps", |l: &Level| l.throughput_tps),
        ] {
            let a = e.map(|l| f(&l[i]));
            let b = p.map(|l| f(&l[i]));
            let cell = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.1}"));
            let ratio = match (a, b) {
                (Some(a), Some(b)) if b > 0.0 => format!("{:.2}x", a / b),
                _ => "-".into(),
            };
            s.push_str(&format!(
                "{:<20} {:>8} {:>14} {:>14} {:>10}\n",
                format!("{model} {name}"),
                LEVELS[i],
                cell(a),
                cell(b),
                ratio
            ));
        }
    }
    if let Some(e) = e {
        let served = e[0].decode_tps;
        s.push_str(&format!(
            "direct generation {:.1} tok/s vs served (1 client) {served:.1} tok/s: overhead {:.1} %\n",
            r.direct_decode_tps,
            100.0 * (1.0 - served / r.direct_decode_tps)
        ));
    }
    let peer = p.map(|_| "mlx-lm");
    for c in LEVELS {
        s.push_str(&format!("{c} client(s):\n"));
        let kinds = Level::kinds(c);
        let kinds: Vec<_> = kinds.iter().map(|(n, u, h)| (n.as_str(), *u, *h)).collect();
        s.push_str(&r.legs.lines(&kinds, "engine", peer));
    }
    s
}

/// Stores one row per (stack, metric) with the level in the metric name.
pub fn record(
    db: &crate::db::Db,
    opts: &ServeOptions,
    r: &ServeResult,
    before: &crate::preflight::MachineState,
    after: &crate::preflight::MachineState,
) -> Result<usize> {
    let (tags, preflight, state) =
        super::run_labels(opts.rounds, "fresh-server-processes", before, after)?;
    let mut rows: Vec<(String, String, f64, &str)> = Vec::new();
    for (stack, levels) in &r.stacks {
        for l in levels {
            for ((metric, unit, _), (_, value)) in
                Level::kinds(l.clients).into_iter().zip(l.figures())
            {
                rows.push((stack.clone(), metric, value, unit));
            }
        }
    }
    if let Some((_, e)) = r.stacks.iter().find(|(k, _)| k == "engine") {
        rows.push((
            "engine".into(),
            "direct_decode_tps".into(),
            r.direct_decode_tps,
            "tok/s",
        ));
        rows.push((
            "engine".into(),
            "served_overhead_pct".into(),
            100.0 * (1.0 - e[0].decode_tps / r.direct_decode_tps),
            "%",
        ));
    }
    for (stack, metric, value, unit) in &rows {
        db.insert(&crate::db::Row {
            ts: after.at.clone(),
            commit: before.commit.clone(),
            dirty: before.dirty,
            machine_key: before.machine_key.clone(),
            machine_state: state.clone(),
            preflight: preflight.into(),
            suite: "serve".into(),
            model: opts.model.clone(),
            metric: metric.clone(),
            value: *value,
            unit: (*unit).into(),
            stack: stack.clone(),
            peer: (stack == "engine" && opts.peer).then(|| "mlx-lm".into()),
            params: r
                .legs
                .row_params(
                    serde_json::json!({
                        "per_client": opts.per_client, "max_tokens": opts.max_tokens,
                        "rounds": opts.rounds, "levels": LEVELS, "prompt": PROMPT,
                        "engine_batch": opts.batch,
                    }),
                    stack,
                    (stack == "engine" && opts.peer).then_some("mlx-lm"),
                    metric,
                )
                .to_string(),
            tags: tags.join(" "),
        })?;
    }
    Ok(rows.len())
}
