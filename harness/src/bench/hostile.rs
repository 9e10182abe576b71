//! `harness bench --suite hostile`: normal requests next to adversarial clients, on a
//! fresh `engine serve` per scenario (issue 18, item 7). Each scenario starts its
//! adversaries, then sends normal chat requests one after another and measures each one's
//! latency (request sent → full answer); p50 and max per scenario. Scenarios: one stream
//! nobody reads (serial lane); four long requests read by their clients (serial lane);
//! eight unread streams filling `--batch 8`; six 4 MB prompts (each beyond the context).
//! The server runs with every limit at its default (`--stall-timeout 5`, …).

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::median;

/// A scenario: its name, the engine's `--batch`, and how it attacks.
pub struct Scenario {
    pub name: &'static str,
    pub batch: usize,
    attack: Attack,
}

#[derive(Clone, Copy)]
enum Attack {
    None,
    Unread(usize),
    LongReaders(usize),
    BigPrompts(usize),
}

pub const SCENARIOS: [Scenario; 5] = [
    Scenario {
        name: "baseline",
        batch: 1,
        attack: Attack::None,
    },
    Scenario {
        name: "unread-stream-serial",
        batch: 1,
        attack: Attack::Unread(1),
    },
    Scenario {
        name: "four-long-serial",
        batch: 1,
        attack: Attack::LongReaders(4),
    },
    Scenario {
        name: "eight-unread-batch8",
        batch: 8,
        attack: Attack::Unread(8),
    },
    Scenario {
        name: "six-4mb-prompts",
        batch: 1,
        attack: Attack::BigPrompts(6),
    },
];

/// One scenario's normal-request latencies.
pub struct Outcome {
    pub scenario: &'static str,
    pub batch: usize,
    pub latencies_ms: Vec<f64>,
}

impl Outcome {
    pub fn p50_ms(&self) -> f64 {
        median(self.latencies_ms.clone())
    }

    pub fn max_ms(&self) -> f64 {
        self.latencies_ms.iter().copied().fold(0.0, f64::max)
    }
}

fn send(port: u16, path: &str, body: &str, close: bool) -> Result<TcpStream> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n{}\r\n{body}",
        body.len(),
        if close { "Connection: close\r\n" } else { "" }
    )?;
    Ok(s)
}

/// A long streamed completion, EOS biased away (ids 2 and 6 on the committed tiny models).
fn long_body() -> String {
    serde_json::json!({"prompt": "The little robot", "max_tokens": 4090, "stream": true,
                       "logit_bias": {"2": -100, "6": -100}})
    .to_string()
}

/// One normal request: its latency, or an error if it was not a 200.
fn normal(port: u16) -> Result<Duration> {
    let start = Instant::now();
    let body =
        serde_json::json!({"messages": [{"role": "user", "content": "What color is the sky?"}],
                                  "max_tokens": 32})
        .to_string();
    let mut s = send(port, "/v1/chat/completions", &body, true)?;
    s.set_read_timeout(Some(Duration::from_secs(600)))?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    let elapsed = start.elapsed();
    if !text.starts_with("HTTP/1.1 200") {
        bail!(
            "a normal request failed: {}",
            text.lines().next().unwrap_or("")
        );
    }
    Ok(elapsed)
}

fn wait_running(port: u16, want: u64) -> Result<()> {
    let start = Instant::now();
    loop {
        let mut s = TcpStream::connect(("127.0.0.1", port))?;
        write!(
            s,
            "GET /stats HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
        )?;
        let mut text = String::new();
        s.read_to_string(&mut text)?;
        let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
        let v: serde_json::Value = serde_json::from_str(body).unwrap_or_default();
        let busy = v["running"].as_u64().unwrap_or(0) + v["queued"].as_u64().unwrap_or(0);
        if busy >= want {
            return Ok(());
        }
        if start.elapsed() > Duration::from_secs(60) {
            bail!("the adversaries did not start within 60 s: {v}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Runs one scenario on a fresh server: `normals` normal requests, one after another.
pub fn run_one(model: &Path, sc: &Scenario, normals: usize) -> Result<Outcome> {
    let server = super::serve::start("engine", model, sc.batch)?;
    let port = server.port;
    normal(port)?; // warm-up
    let mut held: Vec<TcpStream> = Vec::new();
    let mut threads: Vec<std::thread::JoinHandle<String>> = Vec::new();
    match sc.attack {
        Attack::None => {}
        Attack::Unread(k) => {
            for _ in 0..k {
                held.push(send(port, "/v1/completions", &long_body(), false)?);
            }
            wait_running(port, k as u64)?;
        }
        Attack::LongReaders(k) => {
            for _ in 0..k {
                let s = send(port, "/v1/completions", &long_body(), true)?;
                held.push(s.try_clone()?);
                threads.push(std::thread::spawn(move || {
                    let mut s = s;
                    let mut sink = Vec::new();
                    let _ = s.read_to_end(&mut sink);
                    String::new()
                }));
            }
            wait_running(port, k as u64)?;
        }
        Attack::BigPrompts(k) => {
            for i in 0..k {
                let prompt = format!("{i} ") + &"the little robot walks home ".repeat(145_000);
                let body = serde_json::json!({"prompt": prompt, "max_tokens": 4}).to_string();
                let s = send(port, "/v1/completions", &body, true)?;
                threads.push(std::thread::spawn(move || {
                    let mut s = s;
                    let mut answer = String::new();
                    let _ = s.read_to_string(&mut answer);
                    answer.lines().next().unwrap_or("").to_owned()
                }));
            }
            // The uploads are in; the normal requests go right behind them.
        }
    }
    let latencies_ms = (0..normals)
        .map(|_| normal(port).map(|d| d.as_secs_f64() * 1e3))
        .collect::<Result<Vec<_>>>()
        .with_context(|| format!("scenario {}", sc.name))?;
    for s in &held {
        let _ = s.shutdown(Shutdown::Both);
    }
    let big_prompts = matches!(sc.attack, Attack::BigPrompts(_));
    for t in threads {
        let status = t.join().unwrap_or_default();
        // Each big prompt must have been read and refused (beyond the context), not lost.
        if big_prompts && !status.starts_with("HTTP/1.1 400") {
            bail!("a 4 MB prompt was answered `{status}`, not 400");
        }
    }
    drop(server);
    Ok(Outcome {
        scenario: sc.name,
        batch: sc.batch,
        latencies_ms,
    })
}

/// Every scenario, in order.
pub fn run(model: &Path, normals: usize) -> Result<Vec<Outcome>> {
    SCENARIOS
        .iter()
        .map(|sc| run_one(model, sc, normals))
        .collect()
}

pub fn table(model: &str, outcomes: &[Outcome]) -> String {
    let mut s = format!(
        "{:<24} {:>6} {:>8} {:>12} {:>12}\n",
        format!("hostile ({model})"),
        "batch",
        "normals",
        "p50 ms",
        "max ms"
    );
    for o in outcomes {
        s.push_str(&format!(
            "{:<24} {:>6} {:>8} {:>12.1} {:>12.1}\n",
            o.scenario,
            o.batch,
            o.latencies_ms.len(),
            o.p50_ms(),
            o.max_ms()
        ));
    }
    s
}

/// `harness bench --suite hostile`: runs, prints, and records one row per scenario and
/// statistic (suite `hostile`, tagged with the preflight verdicts around the run).
pub fn main(model_name: &str, normals: usize) -> Result<()> {
    use crate::preflight::{self, Thresholds};
    let thresholds = Thresholds::from_env();
    let before = preflight::check(&thresholds);
    let dir = super::serve::model_dir(model_name)?;
    let outcomes = run(&dir, normals.max(1))?;
    let after = preflight::check_since(&before, &thresholds);
    print!("{}", table(model_name, &outcomes));
    let db = crate::db::Db::open_default()?;
    let mut labels = super::run_labels(1, "fresh-server-processes", &before, &after)?;
    // One pass per scenario: no median, no ABBA order.
    labels
        .0
        .retain(|t| t != "abba" && !t.starts_with("median-of-"));
    let ctx = crate::db::RowContext::between(&before, &after, labels);
    let mut rows = 0;
    for o in &outcomes {
        let params = serde_json::json!({"batch": o.batch, "normals": o.latencies_ms.len(),
                                        "latencies_ms": o.latencies_ms});
        for (stat, value) in [("p50", o.p50_ms()), ("max", o.max_ms())] {
            let metric = format!("{}_normal_{stat}_ms", o.scenario);
            db.insert(&ctx.row(
                "hostile",
                model_name,
                (&metric, value, "ms"),
                "engine",
                None,
                params.clone(),
            ))?;
            rows += 1;
        }
    }
    println!(
        "recorded {rows} rows (preflight before: {}, after: {})",
        before.summary(),
        after.summary()
    );
    Ok(())
}
