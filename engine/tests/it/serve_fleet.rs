//! Many models in one server (docs/serve.md, "Many models"): requests route by `model`,
//! models load on demand and unload by LRU (`--max-models`) and TTL (`--model-ttl`), pinned
//! ones stay; each model answers as its own single-model server does; one
//! `--memory-budget` for all of them unloads to make room. Planted defects:
//! `FleetRoutesToDefault`, `FleetLoadsTwice`, `FleetTtlIgnored`, `FleetBudgetIgnored`,
//! `MetricsDefaultModelOnly` (`/metrics` must give each model the numbers `/stats` does),
//! `FleetLoadTimeoutIgnored` (a load kept waiting by busy models must end in a 503),
//! `TurnNeverPassed` (two busy models must stream at once), `FleetFirstLoadNotRetried`
//! (a first load that needs more than estimated must make room and load, not fail).

use std::time::Duration;

use serde_json::{json, Value};

use crate::common;
use crate::common::server::{http, http_with, post, stats, wait_for, Server};

const A: &str = "tiny-llama-trained";
const B: &str = "tiny-qwen3";

fn dir(name: &str) -> String {
    common::goldens()
        .join("models")
        .join(name)
        .display()
        .to_string()
}

/// `engine serve --model A --model B <extra>` with `env`, once it prints its address.
fn fleet(extra: &[&str], env: &[(&str, &str)]) -> Server {
    let (a, b) = (dir(A), dir(B));
    let mut args = vec!["--model", &a, "--model", &b];
    args.extend_from_slice(extra);
    // serve_dir_with_env adds the first --model itself.
    common::server::serve_dir_with_env(std::path::Path::new(&a), &args[2..], env)
}

/// Starts several servers at once (each loads while the others do).
fn start_all(n: usize, start: impl Fn(usize) -> Server + Sync) -> Vec<Server> {
    std::thread::scope(|s| {
        let start = &start;
        let handles: Vec<_> = (0..n).map(|i| s.spawn(move || start(i))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// The four requests each model answers: chat and completions, whole and streamed
/// (greedy; each body names `model`).
fn bodies(model: &str) -> Vec<(&'static str, Value)> {
    let chat = json!({"model": model, "max_tokens": 12,
        "messages": [{"role": "user", "content": "Tell me about the sea"}]});
    let text = json!({"model": model, "max_tokens": 12, "prompt": "Once upon a time"});
    let stream = |mut v: Value| {
        v["stream"] = json!(true);
        v
    };
    vec![
        ("/v1/chat/completions", chat.clone()),
        ("/v1/chat/completions", stream(chat)),
        ("/v1/completions", text.clone()),
        ("/v1/completions", stream(text)),
    ]
}

/// A request's answer text and finish reason (streamed: its deltas joined).
fn answer(port: u16, path: &str, body: &Value) -> String {
    let (status, text) = http(port, "POST", path, body.to_string().as_bytes());
    assert_eq!(status, 200, "{path} {body}: {text}");
    let piece = |c: &Value| {
        let t = c["message"]["content"]
            .as_str()
            .or(c["delta"]["content"].as_str())
            .or(c["text"].as_str())
            .unwrap_or("");
        let f = c["finish_reason"].as_str().unwrap_or("");
        (t.to_owned(), f.to_owned())
    };
    if body["stream"] != json!(true) {
        let v: Value = serde_json::from_str(&text).unwrap();
        let (t, f) = piece(&v["choices"][0]);
        return format!("{t}|{f}");
    }
    let (mut all, mut finish) = (String::new(), String::new());
    for line in text.lines() {
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            break;
        }
        let v: Value = serde_json::from_str(data).unwrap();
        if let Some(c) = v["choices"].get(0) {
            let (t, f) = piece(c);
            all.push_str(&t);
            if !f.is_empty() {
                finish = f;
            }
        }
    }
    format!("{all}|{finish}")
}

fn model_stats(port: u16, name: &str) -> Value {
    stats(port)["models"][name].clone()
}

/// Whether `/metrics` gives model `name` the numbers `/stats` gives it (requests completed,
/// tokens in and out, its chat and completions 200s): the first that differs.
fn metrics_agree_with_stats(port: u16, name: &str) -> Result<(), String> {
    use crate::serve_metrics::{scrape, value};
    let scraped = scrape(port)?;
    let st = model_stats(port, name);
    let model = ("model", name);
    let ok_200s: f64 = ["/v1/chat/completions", "/v1/completions"]
        .iter()
        .map(|route| {
            let labels = [model, ("route", route), ("code", "200")];
            value(&scraped, "engine_http_requests_total", &labels)
        })
        .sum();
    let pairs = [
        (
            "completed",
            value(
                &scraped,
                "engine_requests_outcome_total",
                &[model, ("outcome", "completed")],
            ),
        ),
        (
            "prompt_tokens",
            value(&scraped, "engine_prompt_tokens_total", &[model]),
        ),
        (
            "completion_tokens",
            value(&scraped, "engine_generation_tokens_total", &[model]),
        ),
        ("completed", ok_200s),
    ];
    for (field, got) in pairs {
        let want = st[field].as_f64().unwrap_or(-1.0);
        if got != want || want <= 0.0 {
            return Err(format!("{name}: /metrics {field} {got}, /stats {want}"));
        }
    }
    Ok(())
}

/// The answers of `model` from its own server, and from the fleet taking turns with the
/// other model (each request of one model follows one of the other's under
/// --max-models 1, so every one of them needs a load).
fn alternate(fleet: u16, own: [u16; 2]) -> Vec<(String, String, String)> {
    let mut seen = Vec::new();
    for k in 0..4 {
        for (m, name) in [A, B].iter().enumerate() {
            let (path, body) = &bodies(name)[k];
            let want = answer(own[m], path, body);
            let got = answer(fleet, path, body);
            seen.push((
                format!("{name} {path} stream={}", body["stream"]),
                want,
                got,
            ));
        }
    }
    seen
}

#[test]
fn models_take_turns_under_max_models_1_and_answer_as_their_own_servers() {
    let servers = start_all(4, |i| match i {
        0 => common::server::serve_model(A, &[]),
        1 => common::server::serve_model(B, &[]),
        2 => fleet(&["--max-models", "1"], &[]),
        _ => fleet(
            &["--max-models", "1"],
            &[("ENGINE_PLANT", "FleetRoutesToDefault")],
        ),
    });
    let (own, port, planted) = (
        [servers[0].port, servers[1].port],
        servers[2].port,
        servers[3].port,
    );

    // /v1/models lists both, loaded or not.
    let (status, text) = http(port, "GET", "/v1/models", b"");
    assert_eq!(status, 200);
    let listed: Value = serde_json::from_str(&text).unwrap();
    let ids: Vec<&str> = listed["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, [A, B]);
    assert_eq!(listed["data"][0]["loaded"], true, "{listed}");
    assert_eq!(listed["data"][1]["loaded"], false, "{listed}");

    for (what, want, got) in alternate(port, own) {
        assert_eq!(
            got, want,
            "{what}: the fleet's answer differs from the model's own server"
        );
    }
    let st = stats(port);
    let (a, b) = (&st["models"][A], &st["models"][B]);
    // A loaded at start and again after each of B's turns; B once per turn.
    assert_eq!(
        (a["loads"].as_u64(), b["loads"].as_u64()),
        (Some(4), Some(4)),
        "{st}"
    );
    assert_eq!(
        (a["unloads"].as_u64(), b["unloads"].as_u64()),
        (Some(4), Some(3)),
        "{st}"
    );
    assert!(a["load_ms"].as_f64().unwrap() > 0.0 && b["load_ms"].as_f64().unwrap() > 0.0);
    // The top level is the default model's, as a single-model server's.
    assert_eq!(st["completed"], a["completed"]);
    assert_eq!(b["completed"], 4, "{st}");
    eprintln!("fleet load_ms: {A} {}, {B} {}", a["load_ms"], b["load_ms"]);
    // /metrics: every model's own series (loaded or not: A is not now) and its loads.
    let (status, text) = http(port, "GET", "/metrics", b"");
    assert_eq!(status, 200);
    for name in [A, B] {
        metrics_agree_with_stats(port, name).unwrap();
    }
    for line in [
        format!("engine_model_load_seconds_count{{model=\"{A}\"}} 4"),
        format!("engine_model_loads_total{{model=\"{B}\"}} 4"),
        format!("engine_model_unloads_total{{model=\"{B}\"}} 3"),
        format!("engine_model_loaded{{model=\"{A}\"}} 0"),
        format!("engine_model_loaded{{model=\"{B}\"}} 1"),
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "no `{line}` in /metrics:\n{text}"
        );
    }

    // Planted: the front router sends every request to the default model.
    let caught = alternate(planted, own)
        .into_iter()
        .any(|(what, want, got)| what.starts_with(B) && want != got);
    assert!(caught, "FleetRoutesToDefault was not caught");

    // Concurrent requests for the unloaded model share one load (B is loaded now).
    let before = model_stats(port, A)["loads"].as_u64().unwrap();
    let body = bodies(A)[2].1.clone();
    let want = answer(own[0], "/v1/completions", &body);
    let answers: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..6)
            .map(|_| s.spawn(|| answer(port, "/v1/completions", &body)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(answers.iter().all(|a| *a == want), "{answers:?} vs {want}");
    assert_eq!(model_stats(port, A)["loads"].as_u64(), Some(before + 1));

    // Hostile names: a 404 listing the models (no filesystem lookup can reach a model
    // that is not configured), a 400 for a name that is not a string; served after each.
    let others = [
        "gpt-4o".to_owned(),
        String::new(),
        format!("../{B}"),
        format!("{B}/../{A}"),
        "tiny-qwen3-q8".into(),
        dir("tiny-qwen3-q8"),
        "/etc/passwd".into(),
        "..".into(),
        "x".repeat(100_000),
    ];
    for name in &others {
        let (status, v) = post(
            port,
            "/v1/chat/completions",
            &json!({"model": name,
            "messages": [{"role": "user", "content": "hi"}]}),
        );
        assert_eq!(status, 404, "{name:.40}: {v}");
        assert_eq!(v["error"]["code"], "model_not_found", "{v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.contains(A) && message.contains(B), "{message}");
        assert!(
            message.len() < 1000,
            "the name is echoed whole: {}",
            message.len()
        );
        assert_eq!(http(port, "GET", "/health", b"").0, 200);
    }
    let (status, v) = post(
        port,
        "/v1/messages",
        &json!({"model": "claude-x",
        "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}),
    );
    assert_eq!(status, 404, "{v}");
    assert_eq!(v["error"]["type"], "not_found_error", "{v}");
    let (status, v) = post(port, "/v1/completions", &json!({"model": 5, "prompt": "x"}));
    assert_eq!(
        (status, v["error"]["param"].as_str()),
        (400, Some("model")),
        "{v}"
    );
    // No configured model was loaded or failed by any of those.
    let st = stats(port);
    for name in [A, B] {
        assert!(st["models"][name]["last_error"].is_null(), "{st}");
    }
    // BASE:ADAPTER routes by BASE (the adapter is the model's to resolve): B loads.
    assert_eq!(model_stats(port, B)["loaded"], false);
    post(
        port,
        "/v1/completions",
        &json!({"model": format!("{B}:x"), "prompt": "x",
        "max_tokens": 1}),
    );
    assert_eq!(model_stats(port, B)["loaded"], true);
    assert_eq!(answer(port, "/v1/completions", &body), want);
}

#[test]
fn idle_models_unload_after_the_ttl_and_pinned_ones_stay() {
    // A model that cannot load: its tokenizer loads, its weights (an empty file) do not.
    let models = tempfile::tempdir().unwrap();
    let broken = models.path().join("broken");
    std::fs::create_dir(&broken).unwrap();
    for file in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        let from = common::goldens().join("models").join(B).join(file);
        std::fs::copy(from, broken.join(file)).unwrap();
    }
    std::fs::write(broken.join("model.safetensors"), b"").unwrap();
    let models_dir = models.path().display().to_string();
    let servers = start_all(2, |i| match i {
        0 => fleet(
            &[
                "--pin",
                A,
                "--max-models",
                "2",
                "--model-ttl",
                "0.3",
                "--api-key",
                "k",
                "--models-dir",
                &models_dir,
            ],
            &[],
        ),
        _ => fleet(
            &["--max-models", "2", "--model-ttl", "0.3"],
            &[(
                "ENGINE_PLANT",
                "FleetLoadsTwice,FleetTtlIgnored,MetricsDefaultModelOnly",
            )],
        ),
    });
    let (port, planted) = (servers[0].port, servers[1].port);
    let keyed = |path: &str, body: &Value| {
        let (status, _, text) = http_with(
            port,
            "POST",
            path,
            &[
                "Host: localhost",
                "Content-Type: application/json",
                "Authorization: Bearer k",
            ],
            body.to_string().as_bytes(),
        );
        (status, text)
    };
    let get_stats = || {
        let (_, _, text) = http_with(
            port,
            "GET",
            "/stats",
            &["Host: localhost", "Authorization: Bearer k"],
            b"",
        );
        serde_json::from_str::<Value>(&text).unwrap()
    };
    // The guard runs before any load: no key, no load.
    let body = json!({"model": B, "prompt": "x", "max_tokens": 2});
    assert_eq!(post(port, "/v1/completions", &body).0, 401);
    assert_eq!(get_stats()["models"][B]["loads"], 0);
    assert_eq!(keyed("/v1/completions", &body).0, 200);
    let wait = |what: &str, done: &dyn Fn(&Value) -> bool| {
        let start = std::time::Instant::now();
        loop {
            let st = get_stats();
            if done(&st) {
                return st;
            }
            assert!(start.elapsed() < Duration::from_secs(20), "{what}: {st}");
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let st = wait("B unloaded after its TTL", &|st| {
        st["models"][B]["unloads"] == 1 && st["models"][B]["loaded"] == false
    });
    // A (pinned) was idle as long, and stays.
    assert_eq!(st["models"][A]["loaded"], true, "{st}");
    assert_eq!(st["models"][A]["unloads"], 0, "{st}");
    assert_eq!(st["models"][A]["loads"], 1, "{st}");

    // A model that fails to load: a 500 naming why, each time (the next request tries
    // again); the server goes on serving.
    let body = json!({"model": "broken", "prompt": "x", "max_tokens": 2});
    for _ in 0..2 {
        let (status, text) = keyed("/v1/completions", &body);
        assert_eq!(status, 500, "{text}");
        assert!(text.contains("broken could not be loaded"), "{text}");
    }
    let st = get_stats();
    assert!(st["models"]["broken"]["last_error"].is_string(), "{st}");
    assert_eq!(st["models"]["broken"]["loads"], 0, "{st}");
    assert_eq!(st["models"][A]["loaded"], true, "{st}");
    let body = json!({"model": A, "prompt": "x", "max_tokens": 2});
    assert_eq!(keyed("/v1/completions", &body).0, 200);

    // Planted: a request arriving during a load starts another one.
    let body = bodies(B)[2].1.clone();
    std::thread::scope(|s| {
        for _ in 0..6 {
            s.spawn(|| assert_eq!(post(planted, "/v1/completions", &body).0, 200));
        }
    });
    let loads = model_stats(planted, B)["loads"].as_u64().unwrap();
    assert!(loads > 1, "FleetLoadsTwice was not caught: {loads} loads");
    // Planted: /metrics exports only the default model's series.
    let missing = metrics_agree_with_stats(planted, B);
    assert!(missing.is_err(), "MetricsDefaultModelOnly was not caught");
    // Planted: the TTL never unloads B (it would within a few of its 0.3 s ticks).
    let ttl_caught = std::panic::catch_unwind(|| {
        wait_for(planted, "B unloaded", Duration::from_secs(2), |st| {
            st["models"][B]["loaded"] == false
        })
    })
    .is_err();
    assert!(ttl_caught, "FleetTtlIgnored was not caught");
}

/// A request for B sent while A (`--max-models 1`) is mid-request: its answer (status,
/// headers, body), and A's request's status.
fn b_while_a_is_busy(port: u16) -> ((u16, String, String), u16) {
    let long = json!({"model": A, "prompt": "word ".repeat(120), "max_tokens": 2});
    let other = json!({"model": B, "prompt": "Once upon a time", "max_tokens": 2});
    std::thread::scope(|s| {
        let busy = s.spawn(|| post(port, "/v1/completions", &long).0);
        wait_for(port, "A's request holds A", Duration::from_secs(20), |st| {
            st["models"][A]["leases"] == 1
        });
        let answer = http_with(
            port,
            "POST",
            "/v1/completions",
            &["Host: localhost", "Content-Type: application/json"],
            other.to_string().as_bytes(),
        );
        (answer, busy.join().unwrap())
    })
}

/// `--max-models 1` with A mid-request: a request for B waits for A past `--load-timeout`
/// and gets 503 with Retry-After and the reason; A's request still ends whole, and B loads
/// on the next try. (A's prefill is slowed by the test builds' per-chunk delay: 30 chunks
/// of 50 ms, five times the timeout.) Planted: the timeout is ignored → B waits, no 503.
#[test]
fn a_load_kept_waiting_by_a_busy_model_is_a_503_with_retry_after_and_the_next_try_loads() {
    let flags = [
        "--max-models",
        "1",
        "--load-timeout",
        "0.3",
        "--prefill-step-size",
        "4",
    ];
    let delay = ("ENGINE_TEST_PREFILL_DELAY_MS", "50");
    let servers = start_all(2, |i| match i {
        0 => fleet(&flags, &[delay]),
        _ => fleet(
            &flags,
            &[delay, ("ENGINE_PLANT", "FleetLoadTimeoutIgnored")],
        ),
    });
    let (port, planted) = (servers[0].port, servers[1].port);
    // The planted server runs the same scene at the same time.
    let planted = std::thread::spawn(move || b_while_a_is_busy(planted));
    let ((status, headers, text), a_status) = b_while_a_is_busy(port);
    assert_eq!((status, a_status), (503, 200), "{text}");
    assert!(headers.lines().any(|l| l == "retry-after: 5"), "{headers}");
    assert!(text.contains("--load-timeout"), "{text}");
    let other = json!({"model": B, "prompt": "Once upon a time", "max_tokens": 2});
    assert_eq!(post(port, "/v1/completions", &other).0, 200);
    let st = stats(port);
    assert_eq!(st["models"][B]["loaded"], true, "{st}");
    assert_eq!(st["models"][A]["completed"], 1, "{st}");

    let ((status, _, text), _) = planted.join().unwrap();
    assert_ne!(
        status, 503,
        "FleetLoadTimeoutIgnored was not caught: {text}"
    );
}

/// A streamed completion read chunk by chunk: its text chunks, and whether the stream ended by itself (`[DONE]`). `go_on(chunks so far)` is asked after each
/// chunk; `false` drops the connection, which cancels the request.
struct Streamed {
    chunks: Vec<String>,
    ended: bool,
}

fn stream_chunks(port: u16, body: &Value, mut go_on: impl FnMut(usize) -> bool) -> Streamed {
    use std::io::BufRead;
    let conn = common::server::send_stream(port, body);
    let mut out = Streamed {
        chunks: Vec::new(),
        ended: false,
    };
    for line in std::io::BufReader::new(conn).lines() {
        let line = line.unwrap();
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            out.ended = true;
            break;
        }
        let v: Value = serde_json::from_str(data).unwrap();
        if let Some(piece) = v["choices"][0]["text"].as_str().filter(|t| !t.is_empty()) {
            out.chunks.push(piece.to_string());
            if !go_on(out.chunks.len()) {
                break;
            }
        }
    }
    assert!(!out.chunks.is_empty(), "no text streamed");
    out
}

/// `--max-models 2`, both models busy at once: each answers exactly what it answers alone
/// (their model threads share the process's MLX, one step at a time), and the two streams
/// run together (the MLX turn is handed over at every step). A long stream of model A
/// (up to 2,500 tokens) is kept open until a 100-token stream of model B, sent once A's
/// first chunk is in, has ended: B must run from start to end while A is mid-answer. That
/// claim does not depend on when B's request lands or how the client's reader threads are
/// scheduled (A cannot end first unless B waits 2,500 of A's steps); the step-by-step
/// alternation itself is `serve::turn`'s unit test. EOS banned by `logit_bias`. Planted: the
/// turn is never offered → B starts only after A has ended.
#[test]
fn two_busy_models_stream_at_once_and_each_answers_as_alone() {
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
    let servers = start_all(2, |i| match i {
        0 => fleet(&["--max-models", "2"], &[]),
        _ => fleet(
            &["--max-models", "2"],
            &[("ENGINE_PLANT", "TurnNeverPassed")],
        ),
    });
    // Both models' EOS ids (their generation_config.json: 6 and 2; 8 and 2).
    let body = |model: &str, max_tokens: u32| {
        json!({"model": model, "prompt": "Once upon a time", "max_tokens": max_tokens,
               "stream": true, "logit_bias": {"2": -100, "6": -100, "8": -100}})
    };
    const SHORT: usize = 100;
    // Whether B ended while A was still mid-answer.
    let together = |port: u16| {
        let alone = |m: &str| stream_chunks(port, &body(m, SHORT as u32), |_| true).chunks;
        let (alone_a, alone_b) = (alone(A), alone(B));
        let (a_started, b_done) = (std::sync::mpsc::channel(), AtomicBool::new(false));
        let (a, b) = std::thread::scope(|s| {
            let (started, b_done) = (a_started.0, &b_done);
            let a = s.spawn(move || {
                stream_chunks(port, &body(A, 2500), |n| {
                    if n == 1 {
                        started.send(()).unwrap();
                    }
                    !b_done.load(SeqCst)
                })
            });
            a_started
                .1
                .recv_timeout(Duration::from_secs(120))
                .expect("A never streamed");
            let b = stream_chunks(port, &body(B, SHORT as u32), |_| true);
            b_done.store(true, SeqCst);
            (a.join().unwrap(), b)
        });
        assert!(b.ended, "B's stream did not end");
        assert_eq!(b.chunks, alone_b, "B answers differently beside A");
        // A's answer so far is its answer alone (the last chunk of a capped stream may
        // hold back partial UTF-8, so it is left out of the comparison).
        let n = (alone_a.len() - 1).min(a.chunks.len());
        assert_eq!(
            a.chunks[..n],
            alone_a[..n],
            "A answers differently beside B"
        );
        // A was cut (by the reader, after B's end) rather than ended by itself.
        !a.ended
    };
    let (clean, planted) = std::thread::scope(|s| {
        let planted = s.spawn(|| together(servers[1].port));
        (together(servers[0].port), planted.join().unwrap())
    });
    assert!(
        clean,
        "the two models did not stream together: A ended before B"
    );
    assert!(
        !planted,
        "TurnNeverPassed was not caught: B ran while A was mid-answer"
    );
}

/// `--adapter` in many-model mode mounts on the default model: `A:trained` answers as a
/// single-model server with that adapter does, across an unload and a reload of A (the
/// adapter comes back with it); `B:trained` names an adapter B does not have: a 404.
#[test]
fn the_default_models_adapters_follow_it_through_unloads() {
    let adapter = format!(
        "trained={}",
        common::goldens()
            .join("train/tiny-llama-trained/adapters")
            .display()
    );
    let servers = start_all(3, |i| match i {
        0 => common::server::serve_model(A, &["--adapter", &adapter]),
        1 => fleet(&["--max-models", "1", "--adapter", &adapter], &[]),
        _ => fleet(
            &["--max-models", "1", "--adapter", &adapter],
            &[("ENGINE_PLANT", "FleetAdaptersOnEveryModel")],
        ),
    });
    let (own, port, planted) = (servers[0].port, servers[1].port, servers[2].port);
    let path = "/v1/chat/completions";
    let named = |m: &str| {
        json!({"model": m, "max_tokens": 16,
            "messages": [{"role": "user", "content": "Tell me a story."}]})
    };
    let want = answer(own, path, &named("trained"));
    let base = answer(own, path, &named(A));
    assert_ne!(
        want, base,
        "the adapter changes nothing: the check could not fail"
    );
    let adapted = format!("{A}:trained");
    assert_eq!(answer(port, path, &named(&adapted)), want);
    let (_, text) = http(port, "GET", "/v1/models", b"");
    let listed: Value = serde_json::from_str(&text).unwrap();
    let entry = listed["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["id"] == json!(adapted))
        .unwrap_or_else(|| panic!("{adapted} is not listed: {listed}"));
    assert_eq!(entry["parent"], A, "{entry}");
    // B's turn unloads A; A comes back with its adapter.
    let (status, v) = post(port, path, &named(&format!("{B}:trained")));
    assert_eq!(status, 404, "{v}");
    answer(port, path, &bodies(B)[0].1);
    assert_eq!(answer(port, path, &named(&adapted)), want);
    assert_eq!(model_stats(port, A)["loads"].as_u64(), Some(2));
    // Planted: B loads with A's adapter, which is not B's: its requests fail.
    let (status, v) = post(planted, path, &bodies(B)[0].1);
    assert_ne!(status, 200, "FleetAdaptersOnEveryModel was not caught: {v}");
}

/// Holds either tiny model with its requests (llama: ~1.56 MB of weights + ~0.36 MB of
/// MLX buffer cache at --prefill-step-size 32 + ~0.65 MB per request here), not both
/// (~3.25 MB with one request's least need).
const ONE_MODEL_BUDGET: &str = "2900000";

/// The largest of the two models' *.safetensors sizes: what one loaded model may charge.
fn largest_model_file() -> u64 {
    [A, B]
        .iter()
        .map(|m| {
            std::fs::metadata(std::path::Path::new(&dir(m)).join("model.safetensors"))
                .unwrap()
                .len()
        })
        .max()
        .unwrap()
}

#[test]
fn a_shared_memory_budget_holds_one_model_at_a_time_and_both_answer() {
    let args = [
        "--max-models",
        "2",
        "--memory-budget",
        ONE_MODEL_BUDGET,
        "--prefill-step-size",
        "32",
    ];
    let servers = start_all(2, |i| match i {
        0 => fleet(&args, &[]),
        _ => fleet(&args, &[("ENGINE_PLANT", "FleetBudgetIgnored")]),
    });
    let (port, planted) = (servers[0].port, servers[1].port);
    let one = largest_model_file();

    // Alternating models: each request's model unloads the other (the budget, not
    // --max-models 2, makes it); the same request answers the same every time.
    let mut first = std::collections::HashMap::new();
    for round in 0..2 {
        for k in 0..4 {
            for name in [A, B] {
                let (path, body) = &bodies(name)[k];
                let got = answer(port, path, body);
                let what = format!("{name} {path} stream={}", body["stream"]);
                let want = first.entry(what.clone()).or_insert_with(|| got.clone());
                assert_eq!(&got, want, "{what}: round {round} answered otherwise");
                let st = stats(port);
                let budget = &st["memory"]["budget"];
                assert_eq!(budget["budget"].as_u64(), Some(2_900_000), "{st}");
                let weights = budget["weights"].as_u64().unwrap();
                assert!(
                    weights > 0 && weights <= one,
                    "{what}: the budget charges {weights} bytes of weights, more than one \
                     model's ({one}): {budget}"
                );
                let other = if name == A { B } else { A };
                assert_eq!(st["models"][other]["loaded"], false, "{what}: {st}");
            }
        }
    }
    let st = stats(port);
    let unloads = |n: &str| st["models"][n]["unloads"].as_u64().unwrap();
    // A loaded at start; each of the 16 requests switched models.
    assert_eq!((unloads(A), unloads(B)), (8, 7), "{st}");
    assert_eq!(
        st["memory"]["budget"]["models"]
            .as_object()
            .map(|m| m.len()),
        Some(1),
        "{st}"
    );

    // Planted: the fleet loads without making room: A stays loaded, and B either fails
    // its load (the load's own check: the two do not fit) or is charged beside A.
    answer(planted, bodies(A)[2].0, &bodies(A)[2].1);
    let (status, text) = http(
        planted,
        "POST",
        bodies(B)[2].0,
        bodies(B)[2].1.to_string().as_bytes(),
    );
    let st = stats(planted);
    let weights = st["memory"]["budget"]["weights"].as_u64().unwrap();
    assert_eq!(st["models"][A]["loaded"], true, "{st}");
    assert!(
        status != 200 || weights > one,
        "FleetBudgetIgnored was not caught: {status} {text} {st}"
    );

    // Two pinned models that cannot both fit: refused at startup, naming the fix.
    let (a, b) = (dir(A), dir(B));
    let out = std::process::Command::new(common::server::engine_bin())
        .args([
            "serve", "--model", &a, "--model", &b, "--pin", A, "--pin", B,
        ])
        .args(args)
        .args(["--port", "0"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    for part in [
        "does not fit in the memory budget",
        "--memory-budget 2900000",
        "--pin",
    ] {
        assert!(err.contains(part), "{part:?} not in {err}");
    }
}

/// A model's least request by the budget's own accounting (docs/serve.md "Memory budget"):
/// its K/V for one token (the cache grows in steps of 256) and one token's activations at
/// `--prefill-step-size 32`, from its row of `/stats`' `memory.budget.models`.
fn one_token_need(m: &Value) -> u64 {
    let u = |k: &str| m[k].as_u64().unwrap();
    u("kv_fixed") + u("kv_per_token") * (1 + 256) + u("act_chunk") + u("act_per_token").div_ceil(32)
}

/// A big model's first load beside a small one, under a budget between what the fleet
/// estimates before the big one is measured (the small one's weights and buffer cache, the
/// big one's files, the small one's least request) and what the big one's own check then
/// measures (both models' weights, its buffer cache and least request): the first try's
/// check refuses, the load makes room for the measured need (the small model, idle, goes)
/// and the big one answers. Planted `FleetFirstLoadNotRetried`: the refused check is the
/// client's answer, a 500. The budget comes from a probe server's measurements; the pair is
/// tiny-llama (width 64) then tiny-llama-trained (width 128, 3× the K/V per token), so the
/// window is ~0.5 MB wide where a process's activation measurement moves by ~45 KB.
#[test]
fn a_first_load_that_needs_more_than_estimated_makes_room_and_answers() {
    const SMALL: &str = "tiny-llama";
    const BIG: &str = "tiny-llama-trained";
    let start = |budget: &str, env: &[(&str, &str)]| {
        let big = dir(BIG);
        let extra = [
            "--model",
            &big,
            "--max-models",
            "2",
            "--prefill-step-size",
            "32",
            "--memory-budget",
            budget,
        ];
        common::server::serve_dir_with_env(std::path::Path::new(&dir(SMALL)), &extra, env)
    };
    let probe = start("100000000", &[]);
    let (path, body) = &bodies(BIG)[2];
    answer(probe.port, path, body);
    let st = stats(probe.port);
    drop(probe);
    let models = &st["memory"]["budget"]["models"];
    let row = |name: &str| {
        let end = format!("/{name}");
        let rows = models.as_object().unwrap();
        rows.iter().find(|(k, _)| k.ends_with(&end)).unwrap().1
    };
    let (small, big) = (row(SMALL), row(BIG));
    let u = |m: &Value, k: &str| m[k].as_u64().unwrap();
    let big_files = std::fs::metadata(std::path::Path::new(&dir(BIG)).join("model.safetensors"))
        .unwrap()
        .len();
    let estimate = u(small, "weights") + u(small, "act_chunk") + big_files + one_token_need(small);
    let measured = u(small, "weights")
        + u(big, "weights")
        + u(small, "act_chunk").max(u(big, "act_chunk"))
        + one_token_need(big);
    eprintln!("estimate {estimate}, measured {measured}");
    assert!(
        estimate + 200_000 < measured,
        "no room between the estimate {estimate} and the measured need {measured}: {st}"
    );
    let budget = ((estimate + measured) / 2).to_string();
    let servers = start_all(2, |i| match i {
        0 => start(&budget, &[]),
        _ => start(&budget, &[("ENGINE_PLANT", "FleetFirstLoadNotRetried")]),
    });
    let (status, text) = http(servers[0].port, "POST", path, body.to_string().as_bytes());
    let st = stats(servers[0].port);
    assert_eq!(status, 200, "budget {budget}: {text} {st}");
    assert_eq!(st["models"][SMALL]["loaded"], false, "{st}");
    assert_eq!(st["models"][BIG]["loaded"], true, "{st}");
    let (status, text) = http(servers[1].port, "POST", path, body.to_string().as_bytes());
    assert_eq!(
        status, 500,
        "FleetFirstLoadNotRetried was not caught (budget {budget}): {status} {text}"
    );
}

/// ~3.2 MB beside both models' weights and MLX's buffer cache (~2.6 MB): room for one of
/// A's ~600-token requests (~1.4 MB) and one or two of its prompt-cache entries (~0.9 MB
/// each), and for one B request sized to need more than A's cache leaves (`sized_for_b`).
const CACHES_BUDGET: u64 = 5_800_000;

/// A distinct prompt of `groups` × 4 words (90: ~600 tokens for A; 7 tokens a group for B
/// while `i * 7 + groups` < 1000, so `b_prompt_tokens`).
fn long_prompt(i: usize, groups: usize) -> String {
    let words: Vec<String> = (0..groups)
        .map(|j| format!("w{} the cat sat", i * 7 + j))
        .collect();
    format!("client {i} says: {}", words.join(" "))
}

/// B's tokens for `long_prompt(100, groups)` ("client 100 says:" 10, and 7 a group: `w`, three
/// digits, three words); the request's usage checks it.
fn b_prompt_tokens(groups: usize) -> u64 {
    10 + 7 * groups as u64
}

/// What a request of `prompt` tokens and `max_tokens` reserves by model `m`'s measured
/// bounds in /stats (docs/serve.md "Memory budget": kv(T) + act(P, T), chunk 32).
fn reservation(m: &Value, prompt: u64, max_tokens: u64) -> u64 {
    let u = |k: &str| m[k].as_u64().unwrap();
    let (chunk, total) = (32, prompt + max_tokens);
    let kv = u("kv_fixed") + u("kv_per_token") * (total + 256);
    let act = u("act_chunk")
        + u("act_per_token") * prompt.saturating_sub(chunk)
        + u("act_per_token").div_ceil(chunk) * total;
    kv + act
}

/// Groups of a B prompt whose reservation lies halfway between what the budget leaves
/// beside A's cache (`a_cache`) and what it leaves without it: admitted only once A's
/// cache gives way. Sized from the bounds this server measured at startup, which vary
/// between processes (B's act_per_token 675 in one CI run, 1304 here: a fixed prompt fit
/// beside A's cache there).
fn sized_for_b(budget: &Value, b: &str, a_cache: u64) -> usize {
    let u = |k: &str| budget[k].as_u64().unwrap();
    let room = CACHES_BUDGET - u("weights") - u("mlx_cache_limit");
    let target = room - a_cache / 2;
    (1..300)
        .find(|&g| reservation(&budget["models"][b], b_prompt_tokens(g), 8) >= target)
        .expect("a B prompt under 300 groups reaches the target")
}

/// A's prompt cache fills the room the budget leaves; then a B request needs it. Returns
/// /stats' budget after B's request, and A's prompt-cache bytes before and after it.
fn caches_then_other_model(port: u16) -> (Value, u64, u64) {
    let path = |m: &str| std::fs::canonicalize(dir(m)).unwrap().display().to_string();
    let (a, b) = (path(A), path(B));
    let cache = |st: &Value| st["memory"]["budget"]["models"][&a]["prompt_cache"].as_u64();
    // B loaded first (a load beside A's full cache is not what this shows).
    answer(port, bodies(B)[2].0, &bodies(B)[2].1);
    for i in 0..6 {
        let body = json!({"model": A, "prompt": long_prompt(i, 90), "max_tokens": 1});
        answer(port, "/v1/completions", &body);
    }
    // A's last request has ended (its entry kept, the cache trimmed).
    let st = wait_for(port, "A's requests done", Duration::from_secs(10), |st| {
        st["memory"]["budget"]["reservations"] == 0
    });
    let before = cache(&st).expect("A's prompt cache in /stats");
    assert!(before > 0, "A's requests left no prompt cache: {st}");
    let groups = sized_for_b(&st["memory"]["budget"], &b, before);
    let body = json!({"model": B, "prompt": long_prompt(100, groups), "max_tokens": 8});
    let (status, text) = http(port, "POST", "/v1/completions", body.to_string().as_bytes());
    assert_eq!(status, 200, "B's request of {groups} groups: {text}");
    let usage: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        usage["usage"]["prompt_tokens"].as_u64(),
        Some(b_prompt_tokens(groups)),
        "B's prompt is not the size its reservation was computed for: {text}"
    );
    let st = stats(port);
    let after = cache(&st).unwrap();
    // A's thread trimmed and goes on serving.
    let body = json!({"model": A, "prompt": long_prompt(0, 90), "max_tokens": 1});
    answer(port, "/v1/completions", &body);
    (st["memory"]["budget"].clone(), before, after)
}

#[test]
fn one_models_prompt_cache_gives_way_to_anothers_requests_within_the_budget() {
    let budget = CACHES_BUDGET.to_string();
    let args = [
        "--max-models",
        "2",
        "--memory-budget",
        &budget,
        "--prefill-step-size",
        "32",
        "--budget-wait",
        "5",
    ];
    let servers = start_all(2, |i| match i {
        0 => fleet(&args, &[]),
        _ => fleet(
            &args,
            &[("ENGINE_PLANT", "BudgetOtherModelsCacheUncounted")],
        ),
    });
    let u = |b: &Value, k: &str| b[k].as_u64().unwrap();

    // B's request, sized to need more than A's cache leaves, answers (200): A's cache gave
    // it room, and what the ledger held (weights, MLX's buffer cache, reservations, both
    // caches) never passed the budget.
    let (b, before, after) = caches_then_other_model(servers[0].port);
    let room = CACHES_BUDGET - u(&b, "weights") - u(&b, "mlx_cache_limit");
    assert!(
        before > 0 && before <= room,
        "A's prompt cache ({before} bytes) is not in the room ({room}): {b}"
    );
    assert!(
        after < before,
        "A's cache was not trimmed for B: {before} → {after}: {b}"
    );
    assert!(u(&b, "peak_held") <= CACHES_BUDGET, "{b}");
    let now =
        u(&b, "weights") + u(&b, "mlx_cache_limit") + u(&b, "reserved") + u(&b, "prompt_caches");
    assert!(now <= CACHES_BUDGET, "{b}");
    eprintln!(
        "A's cache {before} → {after} bytes; peak held {} of {CACHES_BUDGET}",
        u(&b, "peak_held")
    );

    // Planted: A's cache is not counted against B: B's request runs beside it, past the
    // budget.
    let (b, _, _) = caches_then_other_model(servers[1].port);
    eprintln!(
        "planted: peak held {} of {CACHES_BUDGET}",
        u(&b, "peak_held")
    );
    assert!(
        u(&b, "peak_held") > CACHES_BUDGET,
        "the planted BudgetOtherModelsCacheUncounted stayed within the budget: {b}"
    );
}

/// The ledger's peak over the budget (0: within it) when B loads beside A's prompt cache
/// filled by ten short requests, and the cache's bytes just before B's load.
fn load_beside_a_full_cache(port: u16) -> (u64, i64) {
    for i in 0..10 {
        let words: Vec<String> = (0..10).map(|j| format!("w{}", i * 7 + j)).collect();
        let body = json!({"model": A, "prompt": format!("client {i} {}", words.join(" ")),
                          "max_tokens": 1});
        answer(port, "/v1/completions", &body);
    }
    // A's last entry is kept (its `running` drops after the keep).
    let st = wait_for(port, "A's requests kept", Duration::from_secs(10), |st| {
        st["models"][A]["running"] == 0
    });
    let cache = st["memory"]["budget"]["prompt_caches"].as_u64().unwrap();
    answer(
        port,
        "/v1/completions",
        &json!({"model": B, "prompt": "hi", "max_tokens": 2}),
    );
    let b = stats(port)["memory"]["budget"].clone();
    let over = b["peak_held"].as_i64().unwrap() - b["budget"].as_i64().unwrap();
    (cache, over)
}

/// A load beside another model's full prompt cache (3.91 MB: A's weights and MLX's buffer
/// cache leave ~2 MB, which A's ten entries fill): B's weights wait for A's cache to give
/// way (a reservation that presses it, then held as weights in one step), so the ledger
/// never holds more than the budget. Planted `FleetLoadBesideCaches` (B's weights counted
/// at once): the ledger's peak passes the budget.
#[test]
fn a_load_waits_for_another_models_prompt_cache_to_give_way() {
    let args = [
        "--max-models",
        "2",
        "--memory-budget",
        "3910000",
        "--prefill-step-size",
        "32",
    ];
    let servers = start_all(2, |i| match i {
        0 => fleet(&args, &[]),
        _ => fleet(&args, &[("ENGINE_PLANT", "FleetLoadBesideCaches")]),
    });
    let (cache, over) = load_beside_a_full_cache(servers[0].port);
    eprintln!("A's cache {cache} bytes before B's load; peak over the budget: {over}");
    assert!(cache > 1_000_000, "A's cache did not fill: {cache}");
    assert!(over <= 0, "the ledger passed the budget by {over} bytes");
    let (_, over) = load_beside_a_full_cache(servers[1].port);
    eprintln!("planted FleetLoadBesideCaches: peak over the budget: {over}");
    assert!(over > 0, "FleetLoadBesideCaches was not caught");
}
