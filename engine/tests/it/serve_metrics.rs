//! `engine serve`'s observability and tokenizer routes, and what a stream sends while its
//! prompt prefills, on tiny-llama-trained:
//!
//! 1. `/metrics` is a valid Prometheus text exposition (every line read by the
//!    `prometheus-parse` crate's line parser; none it cannot read) whose numbers move as
//!    known requests make them: each response counted under its route and status, tokens
//!    in and out equal to the answers' usage, the latency histograms' counts equal to the
//!    generations.
//! 2. `/tokenize` gives the tokenizer's ids (and pieces); of a chat, exactly the prompt the
//!    chat route runs (`usage.prompt_tokens` of it); `/detokenize` gives the text back,
//!    special tokens kept or skipped; ids outside the vocabulary are refused.
//! 3. A slow prefill (a small `--prefill-step-size` and the test builds' per-chunk delay,
//!    `ENGINE_TEST_PREFILL_DELAY_MS`) streams `: keep-alive` comments (chat, completions,
//!    responses) and, with `return_progress`, prompt_progress chunks before the first token.
//!
//! One clean server runs every check (and a `--batch 2` one the stream checks); one server carrying the planted defects each check
//! must catch (keep-alive off, progress dropped, generated tokens uncounted, a chat
//! tokenized with extra special tokens) and one with a malformed exposition line show them
//! failing.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use prometheus_parse::{LineInfo, Scrape, Value as Metric};
use serde_json::{json, Value};

use crate::common;
use crate::common::server::{http_with, post, serve_dir_with_env, Server};

const MODEL: &str = "tiny-llama-trained";
/// Keep-alive interval (s) and per-chunk prefill delay (ms): a prompt of ~100 tokens in
/// chunks of 4 prefills for about half a second, ten keep-alive intervals.
const KEEP_ALIVE: &str = "0.05";
const DELAY_MS: &str = "20";

fn server(plant: &str) -> Server {
    server_with(plant, &[])
}

fn server_with(plant: &str, extra: &[&str]) -> Server {
    let mut env = vec![("ENGINE_TEST_PREFILL_DELAY_MS", DELAY_MS)];
    if !plant.is_empty() {
        env.push(("ENGINE_PLANT", plant));
    }
    serve_dir_with_env(
        &common::goldens().join("models").join(MODEL),
        &[
            &["--prefill-step-size", "4", "--sse-keep-alive", KEEP_ALIVE],
            extra,
        ]
        .concat(),
        &env,
    )
}

/// GET /metrics: its content type and text.
fn scrape_text(port: u16) -> Result<(String, String), String> {
    let (status, headers, body) = http_with(port, "GET", "/metrics", &["Host: localhost"], b"");
    if status != 200 {
        return Err(format!("/metrics answered {status}: {body}"));
    }
    let ctype = headers
        .lines()
        .find_map(|l| l.strip_prefix("content-type:"))
        .unwrap_or("")
        .trim()
        .to_owned();
    Ok((ctype, body))
}

/// The exposition parsed strictly: a line the parser cannot read (it would skip it) or a
/// sample whose value is not a number fails the scrape.
fn parse(text: &str) -> Result<Scrape, String> {
    for (i, line) in text.lines().enumerate() {
        match LineInfo::parse(line) {
            LineInfo::Ignored if !line.trim_start().starts_with('#') => {
                return Err(format!("line {} is not valid exposition: {line:?}", i + 1))
            }
            LineInfo::Sample { value, .. } if value.parse::<f64>().is_err() => {
                let ok = ["NaN", "+Inf", "-Inf"].contains(&value);
                if !ok {
                    return Err(format!("line {}: value {value:?} is not a number", i + 1));
                }
            }
            _ => {}
        }
    }
    Scrape::parse(text.lines().map(|l| Ok(l.to_owned()))).map_err(|e| e.to_string())
}

pub(crate) fn scrape(port: u16) -> Result<Scrape, String> {
    let (ctype, text) = scrape_text(port)?;
    if !ctype.starts_with("text/plain; version=0.0.4") {
        return Err(format!("/metrics content type is {ctype:?}"));
    }
    parse(&text)
}

/// The value of the sample `name` whose labels include `labels` (0 when there is none,
/// as a counter not yet incremented is absent).
pub(crate) fn value(s: &Scrape, name: &str, labels: &[(&str, &str)]) -> f64 {
    s.samples
        .iter()
        .filter(|x| x.metric == name)
        .filter(|x| labels.iter().all(|(k, v)| x.labels.get(k) == Some(*v)))
        .map(|x| match &x.value {
            Metric::Counter(v) | Metric::Gauge(v) | Metric::Untyped(v) => *v,
            _ => 0.0,
        })
        .sum()
}

fn present(s: &Scrape, name: &str) -> Result<(), String> {
    match s.samples.iter().any(|x| x.metric == name) {
        true => Ok(()),
        false => Err(format!("/metrics has no {name}")),
    }
}

fn chat_body(content: &str, stream: bool) -> Value {
    json!({"model": "m", "messages": [{"role": "user", "content": content}],
           "max_tokens": 6, "stream": stream, "stream_options": {"include_usage": true}})
}

/// Check 1: the exposition parses and moves with known requests.
fn metrics_move(port: u16) -> Result<(), String> {
    let before = scrape(port)?;
    let (status, whole) = post(port, "/v1/chat/completions", &chat_body("Hi there", false));
    if status != 200 {
        return Err(format!("chat answered {status}: {whole}"));
    }
    let events = stream(port, "/v1/chat/completions", &chat_body("What is up", true))?;
    let streamed = events
        .iter()
        .filter_map(|e| e.data.as_ref())
        .find(|d| !d["usage"].is_null())
        .map(|d| d["usage"].clone())
        .ok_or("the stream had no usage chunk")?;
    let (bad, _) = post(port, "/v1/chat/completions", &json!({"messages": "no"}));
    let (missing, _, _) = http_with(port, "GET", "/no/such/route", &["Host: localhost"], b"");
    if (bad, missing) != (400, 404) {
        return Err(format!("expected 400 and 404, got {bad} and {missing}"));
    }
    let after = scrape(port)?;
    let delta = |name: &str, labels: &[(&str, &str)]| {
        value(&after, name, labels) - value(&before, name, labels)
    };
    let usages = [&whole["usage"], &streamed];
    let sum = |k: &str| {
        usages
            .iter()
            .map(|u| u[k].as_f64().unwrap_or(-1.0))
            .sum::<f64>()
    };
    let chat = [("method", "POST"), ("route", "/v1/chat/completions")];
    let expect = [
        (
            "chat 200s",
            delta(
                "engine_http_requests_total",
                &[chat[0], chat[1], ("code", "200")],
            ),
            2.0,
        ),
        (
            "chat 400s",
            delta(
                "engine_http_requests_total",
                &[chat[0], chat[1], ("code", "400")],
            ),
            1.0,
        ),
        (
            "unmatched 404s",
            delta(
                "engine_http_requests_total",
                &[("route", "unmatched"), ("code", "404")],
            ),
            1.0,
        ),
        (
            "scrapes (the first counted after it answered)",
            delta(
                "engine_http_requests_total",
                &[("route", "/metrics"), ("code", "200")],
            ),
            1.0,
        ),
        (
            "prompt tokens",
            delta("engine_prompt_tokens_total", &[]),
            sum("prompt_tokens"),
        ),
        (
            "generated tokens",
            delta("engine_generation_tokens_total", &[]),
            sum("completion_tokens"),
        ),
        (
            "first-token latencies",
            delta("engine_time_to_first_token_seconds_count", &[]),
            2.0,
        ),
        (
            "per-token latencies (answers of 2+ tokens)",
            delta("engine_time_per_output_token_seconds_count", &[]),
            usages
                .iter()
                .filter(|u| u["completion_tokens"].as_u64().unwrap_or(0) >= 2)
                .count() as f64,
        ),
        (
            "durations",
            delta("engine_request_duration_seconds_count", &[]),
            2.0,
        ),
        (
            "completed",
            delta("engine_requests_outcome_total", &[("outcome", "completed")]),
            2.0,
        ),
        // Admitted requests have left the queue (a request still counts as running until
        // just after its last event, so `running` is not checked here).
        ("queue depth", value(&after, "engine_queue_depth", &[]), 0.0),
        (
            "batch-lane rows (a serial server)",
            value(&after, "engine_running_requests", &[("lane", "batch")]),
            0.0,
        ),
    ];
    for (what, got, want) in expect {
        if got != want {
            return Err(format!("/metrics {what}: {got}, expected {want}"));
        }
    }
    if sum("completion_tokens") <= 0.0 {
        return Err(format!("no usage in the answers: {usages:?}"));
    }
    for lane in ["serial", "batch"] {
        let labelled = after
            .samples
            .iter()
            .any(|x| x.metric == "engine_running_requests" && x.labels.get("lane") == Some(lane));
        if !labelled {
            return Err(format!(
                "/metrics has no engine_running_requests{{lane=\"{lane}\"}}"
            ));
        }
    }
    // Every series is the model's, labelled with the id /v1/models lists.
    let (_, _, models) = http_with(port, "GET", "/v1/models", &["Host: localhost"], b"");
    let models: Value = serde_json::from_str(&models).map_err(|e| e.to_string())?;
    let id = models["data"][0]["id"].as_str().unwrap_or("?");
    if let Some(x) = after
        .samples
        .iter()
        .find(|x| x.labels.get("model") != Some(id))
    {
        return Err(format!(
            "/metrics {} is not labelled model={id:?}: {:?}",
            x.metric, x.labels
        ));
    }
    for name in [
        "engine_running_requests",
        "engine_batch_slots",
        "engine_prompt_cache_hits_total",
        "engine_prompt_cache_misses_total",
        "engine_kv_cache_bytes",
        "engine_time_to_first_token_seconds_sum",
    ] {
        present(&after, name)?;
    }
    Ok(())
}

/// Check 2: /tokenize and /detokenize against the tokenizer and the chat route.
fn tokenize_checks(port: u16) -> Result<(), String> {
    let tokenizer =
        engine::load::tokenizer::Tokenizer::load(&common::goldens().join("models").join(MODEL))
            .map_err(|e| e.to_string())?;
    let text = "The sky is blue today.";
    let ids_of = |v: &Value| -> Vec<u64> {
        v["tokens"]
            .as_array()
            .map(|a| a.iter().filter_map(Value::as_u64).collect())
            .unwrap_or_default()
    };
    let call = |path: &str, body: Value| -> Result<Value, String> {
        match post(port, path, &body) {
            (200, v) => Ok(v),
            (s, v) => Err(format!("{path} {body} answered {s}: {v}")),
        }
    };
    for add in [false, true] {
        let want: Vec<u64> = tokenizer
            .encode(text, add)
            .map_err(|e| e.to_string())?
            .into_iter()
            .map(u64::from)
            .collect();
        let got = ids_of(&call(
            "/tokenize",
            json!({"content": text, "add_special": add}),
        )?);
        if got != want {
            return Err(format!(
                "tokenize add_special={add}: {got:?}, tokenizer {want:?}"
            ));
        }
    }
    let pieces = call("/tokenize", json!({"content": text, "with_pieces": true}))?;
    let joined: String = pieces["tokens"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|t| t["piece"].as_str().unwrap_or("\u{0}"))
        .collect();
    if joined != text {
        return Err(format!("the pieces join to {joined:?}: {pieces}"));
    }
    // A chat: the ids the chat route prefills (its usage), and the template's specials.
    let chat = json!({"messages": [{"role": "user", "content": "What color is the grass?"}]});
    let chat_ids = ids_of(&call("/tokenize", chat.clone())?);
    let mut ask = chat.clone();
    ask["max_tokens"] = json!(1);
    let usage = call("/v1/chat/completions", ask)?["usage"].clone();
    if Some(chat_ids.len() as u64) != usage["prompt_tokens"].as_u64() {
        return Err(format!(
            "tokenize(messages) is {} ids, the chat route's prompt {}",
            chat_ids.len(),
            usage["prompt_tokens"]
        ));
    }
    let rendered = call("/detokenize", json!({"tokens": chat_ids}))?["content"].clone();
    let plain = call(
        "/detokenize",
        json!({"tokens": chat_ids, "skip_special": true}),
    )?;
    let rendered = rendered.as_str().unwrap_or("");
    let plain = plain["content"].as_str().unwrap_or("");
    if !rendered.starts_with("<|bos|><|user|>") || plain.contains("<|") || !plain.contains("grass")
    {
        return Err(format!("detokenize kept {rendered:?}, skipped {plain:?}"));
    }
    let round = call(
        "/detokenize",
        json!({"tokens": ids_of(&call("/tokenize", json!({"content": text}))?)}),
    )?;
    if round["content"] != text {
        return Err(format!("detokenize(tokenize(text)) = {round}"));
    }
    let refusals = [
        (
            "/detokenize",
            json!({"tokens": [1, 1_000_000]}),
            "tokens[1]",
        ),
        ("/detokenize", json!({"tokens": [-1]}), "tokens[0]"),
        ("/detokenize", json!({}), "tokens"),
        (
            "/tokenize",
            json!({"content": "a", "messages": []}),
            "messages",
        ),
        ("/tokenize", json!({"add_special": true}), "content"),
    ];
    for (path, body, param) in refusals {
        let (status, v) = post(port, path, &body);
        if status != 400 || v["error"]["param"] != param {
            return Err(format!(
                "{path} {body}: {status} {v}, expected 400 naming {param}"
            ));
        }
    }
    Ok(())
}

/// One SSE line as read, and when.
struct Line {
    at: Instant,
    comment: bool,
    data: Option<Value>,
    raw: String,
}

/// POSTs a streaming request and reads its SSE lines (chunk-size lines of the chunked
/// transfer skipped) until `[DONE]` or the end.
fn stream(port: u16, path: &str, body: &Value) -> Result<Vec<Line>, String> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(120)))
        .map_err(|e| e.to_string())?;
    let body = body.to_string();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .map_err(|e| e.to_string())?;
    let mut lines = Vec::new();
    let mut reader = BufReader::new(s);
    let mut head = String::new();
    reader.read_line(&mut head).map_err(|e| e.to_string())?;
    if !head.contains(" 200 ") {
        return Err(format!("{path} answered {head}"));
    }
    loop {
        let mut raw = String::new();
        match reader.read_line(&mut raw) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) => return Err(format!("reading the stream: {e}")),
        }
        let line = raw.trim_end();
        let data = line.strip_prefix("data: ");
        if data == Some("[DONE]") {
            break;
        }
        lines.push(Line {
            at: Instant::now(),
            comment: line.starts_with(':'),
            data: data.and_then(|d| serde_json::from_str(d).ok()),
            raw: line.to_owned(),
        });
    }
    Ok(lines)
}

/// A prompt of about 100 tokens (25 chunks of 4, half a second at 20 ms each), its own
/// words for each `n`, so that no stream's prompt is in the prompt cache from another.
fn long_prompt(n: usize) -> String {
    format!("{n}: ") + &"the sky is blue and the grass is green; ".repeat(10)
}

/// Check 3: comments (and progress chunks) before the first token, on chat, completions
/// and responses streams.
fn prefill_stream(port: u16) -> Result<(), String> {
    let first_token = |lines: &[Line], token: &dyn Fn(&Value) -> bool| {
        lines
            .iter()
            .position(|l| l.data.as_ref().is_some_and(token))
            .ok_or_else(|| {
                let raw: Vec<&str> = lines.iter().map(|l| l.raw.as_str()).collect();
                format!("no token in the stream: {raw:?}")
            })
    };
    let comments_before = |lines: &[Line], first: usize, what: &str| {
        let n = lines[..first]
            .iter()
            .filter(|l| l.comment && l.raw == ": keep-alive")
            .count();
        match n {
            0 => Err(format!(
                "{what}: no keep-alive comment before the first token"
            )),
            n => Ok(n),
        }
    };
    // Each planted defect must be seen on its own: every failure is said.
    let mut failed = Vec::new();
    // Chat with progress: progress chunks before the first token (they are events, so no
    // keep-alive comment is due between them).
    let mut body = chat_body(&long_prompt(1), true);
    body["return_progress"] = json!(true);
    let lines = stream(port, "/v1/chat/completions", &body)?;
    let first = first_token(&lines, &|d: &Value| {
        d["choices"][0]["delta"]["content"].is_string()
    })?;
    let progress: Vec<&Value> = lines[..first]
        .iter()
        .filter_map(|l| l.data.as_ref())
        .filter(|d| d["prompt_progress"].is_object())
        .map(|d| &d["prompt_progress"])
        .collect();
    let usage = lines
        .iter()
        .filter_map(|l| l.data.as_ref())
        .find(|d| !d["usage"].is_null())
        .map(|d| d["usage"].clone())
        .ok_or("the chat stream had no usage")?;
    let total = usage["prompt_tokens"].as_u64().unwrap_or(0);
    let processed: Vec<u64> = progress
        .iter()
        .filter_map(|p| p["processed"].as_u64())
        .collect();
    if progress.len() < 2
        || progress.iter().any(|p| p["total"].as_u64() != Some(total))
        || progress
            .iter()
            .any(|p| p["cache"] != usage["prompt_tokens_details"]["cached_tokens"])
        || processed.windows(2).any(|w| w[0] >= w[1])
        // The last prompt token is fed by the first decode step, not a chunk. (A progress
        // chunk the client had no room for is dropped, so the last one is not required to
        // say total - 1: that would fail on a starved client, not a wrong count.)
        || processed.iter().any(|&p| p > total - 1)
    {
        failed.push(format!(
            "chat: progress before the first token {progress:?} (prompt {total} tokens)"
        ));
    }
    let late = lines[first..].iter().any(|l| {
        l.data
            .as_ref()
            .is_some_and(|d| d["prompt_progress"].is_object())
    });
    if late {
        failed.push("chat: a progress chunk after the first token".into());
    }
    eprintln!(
        "serve_metrics: chat prefill of {total} tokens: {} progress chunks over {:?} before \
         the first token",
        progress.len(),
        lines[first].at - lines[0].at
    );
    // Completions without progress: keep-alive comments while the prompt prefills.
    let body = json!({"model": "m", "prompt": long_prompt(2), "max_tokens": 4, "stream": true});
    let lines = stream(port, "/v1/completions", &body)?;
    let first = first_token(&lines, &|d: &Value| {
        d["choices"][0]["text"]
            .as_str()
            .is_some_and(|t| !t.is_empty())
    })?;
    match comments_before(&lines, first, "completions") {
        Ok(n) => eprintln!(
            "serve_metrics: completions: {n} keep-alive comments over {:?} before the first \
             token",
            lines[first].at - lines[0].at
        ),
        Err(e) => failed.push(e),
    }
    // Responses: keep-alive comments too (its stream opens with response.created).
    let body =
        json!({"model": "m", "input": long_prompt(3), "max_output_tokens": 4, "stream": true});
    let lines = stream(port, "/v1/responses", &body)?;
    let first = first_token(&lines, &|d: &Value| {
        d["type"] == "response.output_text.delta"
    })?;
    if let Err(e) = comments_before(&lines, first, "responses") {
        failed.push(e);
    }
    match failed.is_empty() {
        true => Ok(()),
        false => Err(failed.join("; ")),
    }
}

fn all_checks(port: u16) -> [(&'static str, Result<(), String>); 3] {
    [
        ("metrics", metrics_move(port)),
        ("tokenize", tokenize_checks(port)),
        ("prefill stream", prefill_stream(port)),
    ]
}

#[test]
fn metrics_tokenize_and_prefill_streams_hold_and_their_planted_defects_are_caught() {
    let clean = server("");
    for (what, result) in all_checks(clean.port) {
        if let Err(e) = result {
            panic!("{what}: {e}");
        }
    }
    drop(clean);
    // The batch lane admits and prefills on its own path: the same stream checks there.
    let batch = server_with("", &["--batch", "2"]);
    let lanes = common::server::stats(batch.port)["lanes"].clone();
    assert_eq!(lanes["batch_slots"], 2, "not on the batch lane: {lanes}");
    if let Err(e) = prefill_stream(batch.port) {
        panic!("prefill stream, batch lane: {e}");
    }
    drop(batch);
    // Every check fails where its defect is planted.
    let planted = server(
        "SseKeepAliveOff,PromptProgressDropped,MetricsTokensOutUncounted,TokenizeChatAddsSpecial",
    );
    for (what, result) in all_checks(planted.port) {
        let e = match result {
            Ok(()) => panic!("{what}: its planted defect was not caught"),
            Err(e) => e,
        };
        eprintln!("planted, {what}: caught: {e}");
        // The stream check must name both of its defects.
        if what == "prefill stream" {
            assert!(
                e.contains("no keep-alive comment") && e.contains("progress before the first"),
                "{e}"
            );
        }
    }
    drop(planted);
    let malformed = server("MetricsMalformedLine");
    match scrape(malformed.port) {
        Ok(_) => panic!("a malformed exposition line was not caught"),
        Err(e) => eprintln!("planted, exposition: caught: {e}"),
    }
}
