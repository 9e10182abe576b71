//! `engine serve` end to end over loopback HTTP: the OpenAI-shaped endpoints, streaming,
//! hostile input (every bad request a 4xx naming the problem, the server unharmed), a
//! client leaving mid-stream, 32 concurrent clients (the fuzz and the security checks are
//! in serve_hardening.rs).

use std::io::Read;
use std::net::TcpStream;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::AtomicUsize;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::common;
use common::server::{ask, http, post, send_stream, serve_model, stats, wait_for, Server};

fn serve(extra: &[&str]) -> Server {
    serve_model("tiny-llama-trained", extra)
}

#[test]
fn chat_completions_streaming_and_models() {
    let s = serve(&[]);
    let (code, r) = post(
        s.port,
        "/v1/chat/completions",
        &ask("What color is the sky?"),
    );
    assert_eq!(code, 200, "{r}");
    assert_eq!(r["choices"][0]["message"]["content"], "The sky is blue.");
    assert_eq!(r["choices"][0]["finish_reason"], "stop");
    assert_eq!(r["usage"]["prompt_tokens"], 14);
    assert_eq!(r["object"], "chat.completion");
    // The same without the /v1 prefix (mlx_lm.server accepts both).
    let (code, _) = post(s.port, "/chat/completions", &ask("What color is the sky?"));
    assert_eq!(code, 200);

    let mut body = ask("What color is the sky?");
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let (code, text) = http(
        s.port,
        "POST",
        "/v1/chat/completions",
        body.to_string().as_bytes(),
    );
    assert_eq!(code, 200);
    let data: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(data.last(), Some(&"[DONE]"));
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let streamed: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(streamed, "The sky is blue.");
    assert!(chunks
        .iter()
        .all(|c| c["object"] == "chat.completion.chunk"));
    let finish = chunks
        .iter()
        .find(|c| c["choices"][0]["finish_reason"] == "stop")
        .unwrap();
    // As mlx_lm.server: usage only in the include_usage chunk, which comes last.
    assert!(finish.get("usage").is_none(), "{finish}");
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"], json!([]), "include_usage chunk last");
    // Five text tokens and the EOS that ended them, counted as mlx_lm.server counts.
    assert_eq!(last["usage"]["completion_tokens"], 6);
    assert_eq!(
        chunks.iter().filter(|c| c.get("usage").is_some()).count(),
        1
    );

    let (code, r) = post(
        s.port,
        "/v1/completions",
        &json!({"prompt": "The little robot", "max_tokens": 6, "logprobs": 3}),
    );
    assert_eq!(code, 200, "{r}");
    assert_eq!(r["choices"][0]["finish_reason"], "length");
    assert_eq!(r["usage"]["completion_tokens"], 6);
    let lp = &r["choices"][0]["logprobs"]["content"];
    assert_eq!(lp.as_array().unwrap().len(), 6);
    assert_eq!(lp[0]["top_logprobs"].as_array().unwrap().len(), 3);
    assert!(lp[0]["logprob"].as_f64().unwrap() <= 0.0);

    let (code, m) = http(s.port, "GET", "/v1/models", b"");
    assert_eq!(code, 200);
    let m: Value = serde_json::from_str(&m).unwrap();
    assert!(m["data"][0]["id"]
        .as_str()
        .unwrap()
        .ends_with("tiny-llama-trained"));
    assert_eq!(http(s.port, "GET", "/health", b"").0, 200);
}

/// Every hostile body gets a 4xx with an OpenAI-style error naming the field where there
/// is one; the server keeps answering.
#[test]
fn hostile_inputs_are_4xx_and_harmless() {
    let s = serve(&["--max-body-bytes", "65536"]);
    let user = |extra: Value| {
        let mut b = ask("hi");
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b.to_string().into_bytes()
    };
    let cases: Vec<(&str, Vec<u8>, Option<&str>)> = vec![
        ("malformed JSON", b"{\"messages\": [".to_vec(), None),
        ("not an object", b"[1, 2]".to_vec(), None),
        ("empty body", b"".to_vec(), None),
        (
            "invalid UTF-8",
            b"{\"prompt\": \"\xff\xfe\"}".to_vec(),
            None,
        ),
        ("no messages", b"{}".to_vec(), Some("messages")),
        (
            "empty messages",
            br#"{"messages": []}"#.to_vec(),
            Some("messages"),
        ),
        (
            "messages not a list",
            br#"{"messages": "hi"}"#.to_vec(),
            Some("messages"),
        ),
        (
            "unknown role",
            br#"{"messages": [{"role": "wizard", "content": "x"}]}"#.to_vec(),
            Some("messages[0].role"),
        ),
        (
            "content wrong type",
            br#"{"messages": [{"role": "user", "content": 5}]}"#.to_vec(),
            Some("messages[0].content"),
        ),
        (
            "max_tokens 0",
            user(json!({"max_tokens": 0})),
            Some("max_tokens"),
        ),
        (
            "max_tokens negative",
            user(json!({"max_tokens": -5})),
            Some("max_tokens"),
        ),
        (
            "max_tokens absurd",
            user(json!({"max_tokens": 1_000_000_000u64})),
            Some("max_tokens"),
        ),
        (
            "max_tokens a string",
            user(json!({"max_tokens": "ten"})),
            Some("max_tokens"),
        ),
        (
            "temperature negative",
            user(json!({"temperature": -1})),
            Some("temperature"),
        ),
        ("top_p above 1", user(json!({"top_p": 1.5})), Some("top_p")),
        (
            "stream not bool",
            user(json!({"stream": "yes"})),
            Some("stream"),
        ),
        ("stop wrong type", user(json!({"stop": 3})), Some("stop")),
        (
            "logit_bias keys",
            user(json!({"logit_bias": {"abc": 1}})),
            Some("logit_bias"),
        ),
        (
            "top_logprobs too many",
            user(json!({"top_logprobs": 50})),
            Some("top_logprobs"),
        ),
        (
            "model not a string",
            user(json!({"model": 7})),
            Some("model"),
        ),
        (
            "prompt longer than the context",
            user(json!({"messages": [{"role": "user", "content": "robot ".repeat(5000)}]})),
            Some("messages"),
        ),
        ("oversize body", vec![b' '; 70_000], None),
    ];
    for (name, body, param) in &cases {
        let (code, text) = http(s.port, "POST", "/v1/chat/completions", body);
        assert!((400..500).contains(&code), "{name}: status {code}: {text}");
        let err: Value =
            serde_json::from_str(&text).unwrap_or_else(|_| panic!("{name}: not JSON: {text}"));
        assert!(err["error"]["message"].is_string(), "{name}: {err}");
        if let Some(p) = param {
            assert_eq!(err["error"]["param"], *p, "{name}: {err}");
        }
    }
    let (code, text) = http(s.port, "POST", "/v1/completions", br#"{"prompt": 12}"#);
    assert_eq!(code, 400, "{text}");
    assert_eq!(http(s.port, "GET", "/nope", b"").0, 404);
    // Unharmed: a good request still works, and /stats counted the rejections.
    let (code, r) = post(
        s.port,
        "/v1/chat/completions",
        &ask("What color is the sky?"),
    );
    assert_eq!(
        (code, r["choices"][0]["message"]["content"].as_str()),
        (200, Some("The sky is blue."))
    );
    let st = stats(s.port);
    assert_eq!(st["failed"], 0, "{st}");
    println!(
        "hostile-input suite: {} cases, 0 crashes, stats {st}",
        cases.len() + 2
    );
}

/// A client that disconnects mid-stream frees the model for the next request.
#[test]
fn a_client_leaving_mid_stream_is_cancelled() {
    let s = serve(&[]);
    let conn = open_stream(
        s.port,
        json!({"prompt": "The little robot", "max_tokens": 4000, "stream": true,
               "temperature": 1.0, "seed": 3}),
    );
    drop(conn);
    let start = Instant::now();
    loop {
        let st = stats(s.port);
        if st["cancelled"] == 1 && st["running"] == 0 {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "not cancelled: {st}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let (code, _) = post(
        s.port,
        "/v1/chat/completions",
        &ask("What color is the sky?"),
    );
    assert_eq!(code, 200);
}

/// 32 concurrent clients, 2 requests each: all answered, none lost, within a time bound.
#[test]
fn load_test_32_concurrent_clients() {
    let s = serve(&[]);
    let port = s.port;
    let start = Instant::now();
    let handles: Vec<_> = (0..32)
        .map(|i| {
            std::thread::spawn(move || {
                let mut ok = 0;
                for j in 0..2 {
                    let body = if (i + j) % 2 == 0 {
                        ask("What color is the sky?")
                    } else {
                        json!({"prompt": "The little robot", "max_tokens": 16})
                    };
                    let path = if (i + j) % 2 == 0 {
                        "/v1/chat/completions"
                    } else {
                        "/v1/completions"
                    };
                    let (code, r) = post(port, path, &body);
                    if code == 200 && r["choices"][0]["finish_reason"].is_string() {
                        ok += 1;
                    }
                }
                ok
            })
        })
        .collect();
    let ok: usize = handles.into_iter().map(|h| h.join().unwrap()).sum();
    let elapsed = start.elapsed();
    // The counters are bumped after a response is sent (and its caches kept): wait for
    // the last one to land, with a deadline of its own.
    let st = wait_for(port, "all 64 counted", Duration::from_secs(60), |st| {
        st["completed"] == 64 && st["running"] == 0
    });
    println!("load test: 64 requests from 32 clients, {ok} ok, {elapsed:?}, stats {st}");
    assert_eq!(ok, 64, "errors under load: {st}");
    assert_eq!(st["completed"], 64, "none lost: {st}");
    assert!(elapsed < Duration::from_secs(120));
}

/// The prompt cache across requests: a chat's second turn reuses the first turn's caches
/// (usage.prompt_tokens_details.cached_tokens, /stats hits) and answers exactly as a server
/// without a prompt cache does.
#[test]
fn second_turn_hits_the_prompt_cache_and_answers_the_same() {
    second_turn_reuses(&[]);
}

/// As above on the batch lane: a row leaving the batch leaves its caches to the prompt cache.
#[test]
fn batch_lane_rows_feed_the_prompt_cache() {
    second_turn_reuses(&["--batch", "4"]);
}

fn second_turn_reuses(extra: &[&str]) {
    let turn1 = json!({"messages": [{"role": "user", "content": "What color is the sky?"}]});
    let turn2 = |answer: &str| {
        json!({"messages": [
            {"role": "user", "content": "What color is the sky?"},
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "What color is the grass?"},
        ]})
    };
    let cached = serve(extra);
    let (_, r1) = post(cached.port, "/v1/chat/completions", &turn1);
    let answer = r1["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    let (code, r2) = post(cached.port, "/v1/chat/completions", &turn2(&answer));
    assert_eq!(code, 200);
    let reused = r2["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(reused >= 14, "turn 2 reused {reused} tokens: {r2}");
    // The model thread stores the new entry just after the answer went out.
    let start = Instant::now();
    let st = loop {
        let st = stats(cached.port);
        if st["prompt_cache"]["bytes"].as_u64().unwrap() > 0 {
            break st;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "no entry kept: {st}"
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    assert_eq!(st["prompt_cache"]["hits"], 1, "{st}");

    let plain = serve(&["--prompt-cache-size", "0"]);
    post(plain.port, "/v1/chat/completions", &turn1);
    let (_, fresh) = post(plain.port, "/v1/chat/completions", &turn2(&answer));
    assert_eq!(fresh["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(
        r2["choices"][0]["message"]["content"], fresh["choices"][0]["message"]["content"],
        "a cache hit must answer as a fresh prefill does"
    );
}

/// The tier presets apply to the server too (`--l2` with optiq's kv_config).
#[test]
fn serve_with_the_l2_preset() {
    let kv = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../goldens/l2/tiny-llama-trained/kv_config.json");
    let s = serve(&["--l2", "--kv-config", kv.to_str().unwrap()]);
    let (code, r) = post(
        s.port,
        "/v1/chat/completions",
        &ask("What color is the sky?"),
    );
    assert_eq!(code, 200, "{r}");
    assert_eq!(r["choices"][0]["message"]["content"], "The sky is blue.");
}

/// The batch lane (`--batch 8`): concurrent requests decode together and every answer is
/// exactly the serial lane's (greedy; chat and completions; different lengths and limits);
/// 32 concurrent clients, 0 errors; a client leaving mid-stream frees its row.
#[test]
fn batch_lane_answers_exactly_like_the_serial_lane() {
    let requests: Vec<(&str, Value)> = vec![
        ("/v1/chat/completions", ask("What color is the sky?")),
        ("/v1/chat/completions", ask("Who brought the broken clock?")),
        (
            "/v1/completions",
            json!({"prompt": "The little robot", "max_tokens": 24}),
        ),
        (
            "/v1/completions",
            json!({"prompt": "On Friday the robot went to the market.", "max_tokens": 9}),
        ),
        (
            "/v1/completions",
            json!({"prompt": "Question: What color is the grass? Answer:", "max_tokens": 30}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "system", "content": "You answer in one sentence."}, {"role": "user", "content": "What does the robot like?"}], "max_tokens": 40}),
        ),
        (
            "/v1/completions",
            json!({"prompt": "The", "max_tokens": 16, "stop": [" robot"]}),
        ),
        (
            "/v1/completions",
            json!({"prompt": "The little robot", "max_tokens": 12, "repetition_penalty": 1.3}),
        ),
    ];
    let text = |r: &Value| {
        let c = &r["choices"][0];
        c["message"]["content"]
            .as_str()
            .or(c["text"].as_str())
            .unwrap_or("")
            .to_owned()
    };
    let serial = serve(&[]);
    let expected: Vec<String> = requests
        .iter()
        .map(|(path, body)| text(&post(serial.port, path, body).1))
        .collect();
    drop(serial);
    // Prefill chunks of 4 tokens: long prompts are admitted over several decode steps of
    // the rows already running.
    let batched = serve(&["--batch", "8", "--prefill-step-size", "4"]);
    let port = batched.port;
    let handles: Vec<_> = requests
        .iter()
        .cloned()
        .map(|(path, body)| std::thread::spawn(move || post(port, path, &body)))
        .collect();
    for (h, want) in handles.into_iter().zip(&expected) {
        let (code, r) = h.join().unwrap();
        assert_eq!(code, 200, "{r}");
        assert_eq!(&text(&r), want, "batch lane vs serial lane");
    }
    // Under load: 32 clients × 2 requests.
    let handles: Vec<_> = (0..32)
        .map(|i| {
            std::thread::spawn(move || {
                (0..2)
                    .filter(|j| {
                        let (code, r) = if (i + j) % 2 == 0 {
                            post(port, "/v1/chat/completions", &ask("What color is the sky?"))
                        } else {
                            post(
                                port,
                                "/v1/completions",
                                &json!({"prompt": "The little robot", "max_tokens": 16}),
                            )
                        };
                        code == 200 && r["choices"][0]["finish_reason"].is_string()
                    })
                    .count()
            })
        })
        .collect();
    let ok: usize = handles.into_iter().map(|h| h.join().unwrap()).sum();
    assert_eq!(ok, 64, "{}", stats(port));
    // A client that leaves mid-stream frees its row.
    // EOS ids (6, 2) biased away: the stream runs until the client leaves.
    let conn = open_stream(
        port,
        json!({"prompt": "The little robot", "max_tokens": 4000, "stream": true,
               "temperature": 1.0, "logit_bias": {"6": -100, "2": -100}}),
    );
    // While that stream decodes, another request joins it: two rows share a step for
    // certain (not only when the threads above happened to overlap).
    assert_eq!(post(port, "/v1/chat/completions", &ask("hi")).0, 200);
    drop(conn);
    let st = wait_for(
        port,
        "the leaving stream cancelled",
        Duration::from_secs(60),
        |st| st["cancelled"] == 1 && st["running"] == 0,
    );
    assert_eq!(st["failed"], 0, "{st}");
    assert_eq!(st["lanes"]["batch_slots"], 8, "{st}");
    assert!(
        st["lanes"]["batch_peak_rows"].as_u64().unwrap() >= 2,
        "rows never shared a step: {st}"
    );
    println!("batch lane: {st}");
}

/// On the batch lane a lone request steps alone (as a single-sequence session: no batch
/// mask, the compiled step where it pays), joins the batch when a second one arrives, and
/// goes on alone again when that one leaves: every token of the second one (which joins the
/// running row without a step of its own, `admit::joins_running`) has top-10
/// log-probabilities equal to the serial lane's, across both moves.
#[test]
fn a_lone_row_steps_alone_and_answers_as_the_serial_lane() {
    let (alone, batched, st) = lone_row_run(&[]);
    assert_eq!(
        batched, alone,
        "the row after the other left vs the serial lane"
    );
    assert!(
        st["lanes"]["batch_lone_steps"].as_u64().unwrap() > 8,
        "the last row never stepped alone: {st}"
    );
    assert_eq!(st["failed"], 0, "{st}");
}

#[test]
fn planted_lone_row_losing_its_newest_position_is_caught() {
    let (alone, batched, _) = lone_row_run(&[("ENGINE_PLANT", "LoneRowLosesNewest")]);
    assert_ne!(batched, alone, "the planted defect went unseen");
}

/// The second request of `lone_row_run` joins a running batch without a step of its own
/// (`admit::joins_running`): its first id comes from the batched step that feeds its last
/// prompt token, so its log-probabilities from the first token on are that path's. Planted,
/// it is fed the token before instead.
#[test]
fn planted_joining_row_fed_the_wrong_token_is_caught() {
    let (alone, batched, _) = lone_row_run(&[("ENGINE_PLANT", "JoinedRowRefeeds")]);
    assert_ne!(batched, alone, "the planted defect went unseen");
}

/// Uncached prompts that arrive together are prefilled together (issue 43 item 3): four
/// short completions reach an idle lane at once (no prompt cache); it prefills them in one
/// right-padded forward (/stats `lanes.batch_prompt_batches`), and every token's top-5
/// log-probabilities of each answer equal the serial lane's.
#[test]
fn prompts_arriving_together_are_prefilled_together_exactly() {
    let bodies: Vec<Value> = [
        ("The little robot", 12),
        ("On Friday the robot went to the market.", 9),
        ("Question: What color is the grass? Answer:", 10),
        ("Once upon a time", 8),
    ]
    .iter()
    .map(|(p, n)| json!({"prompt": p, "max_tokens": n, "logprobs": 5}))
    .collect();
    let lp = |r: &Value| r["choices"][0]["logprobs"]["content"].clone();
    let serial = serve(&[]);
    let alone: Vec<Value> = bodies
        .iter()
        .map(|b| lp(&post(serial.port, "/v1/completions", b).1))
        .collect();
    drop(serial);
    // No prompt cache: a hit (here the prompts share at least BOS) sends a prompt to its own
    // prefill after the cached prefix. The idle lane waits for all four requests
    // (`BatchGathersFour`), so that they arrive together on any machine.
    let batched = common::server::serve_dir_with_env(
        &common::goldens().join("models/tiny-llama-trained"),
        &["--batch", "8", "--prompt-cache-size", "0"],
        &[("ENGINE_PLANT", "BatchGathersFour")],
    );
    let port = batched.port;
    let handles: Vec<_> = bodies
        .iter()
        .cloned()
        .map(|b| std::thread::spawn(move || post(port, "/v1/completions", &b)))
        .collect();
    for (h, want) in handles.into_iter().zip(&alone) {
        let (code, r) = h.join().unwrap();
        assert_eq!(code, 200, "{r}");
        assert_eq!(
            &lp(&r),
            want,
            "a row of the prompt batch vs the serial lane"
        );
    }
    let st = stats(port);
    assert!(
        st["lanes"]["batch_prompt_batches"].as_u64().unwrap() == 1,
        "the four prompts were never prefilled together: {st}"
    );
}

/// `a_row_left_behind` on tiny-llama-trained (EOS ids 6 and 2 biased away) on a
/// `--batch 4` server (environment `env`) against a serial one; and the batch server's
/// /stats after it.
fn lone_row_run(env: &[(&str, &str)]) -> (Vec<Value>, Vec<Value>, Value) {
    let serial = serve(&[]);
    let batched = common::server::serve_dir_with_env(
        &common::goldens().join("models/tiny-llama-trained"),
        &["--batch", "4"],
        env,
    );
    let bias: serde_json::Map<String, Value> = [("6", json!(-100)), ("2", json!(-100))]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
    let (batched_lp, alone_lp) = a_row_left_behind(batched.port, serial.port, &bias);
    (alone_lp, batched_lp, stats(batched.port))
}

/// The SSD tier across a restart: turn 1 on one server, turn 2 on a new server over the
/// same --ssd-cache directory restores the prefix from disk and answers exactly as a
/// server without caches does.
#[test]
fn a_restarted_server_resumes_a_conversation_from_the_ssd_tier() {
    restart_resumes(&[]);
}

/// As above on the batch lane: rows leaving the batch reach the SSD tier, and a restored
/// prefix joins the batch.
#[test]
fn a_restarted_batch_lane_resumes_from_the_ssd_tier() {
    restart_resumes(&["--batch", "4"]);
}

fn restart_resumes(extra: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let ssd = dir.path().to_str().unwrap().to_owned();
    let turn1 = ask("What color is the sky?");
    let turn2 = |answer: &str| {
        json!({"messages": [
            {"role": "user", "content": "What color is the sky?"},
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "What color is the grass?"},
        ]})
    };
    let opts: Vec<&str> = ["--ssd-cache", ssd.as_str()]
        .into_iter()
        .chain(extra.iter().copied())
        .collect();
    let first = serve(&opts);
    let (_, r1) = post(first.port, "/v1/chat/completions", &turn1);
    let answer = r1["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    // Written behind the response: wait for it.
    let start = Instant::now();
    while stats(first.port)["ssd_cache"]["spills"] != 1 {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{}",
            stats(first.port)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(first);

    let second = serve(&opts);
    assert_eq!(
        stats(second.port)["ssd_cache"]["entries"],
        1,
        "found on disk after the restart"
    );
    let (code, r2) = post(second.port, "/v1/chat/completions", &turn2(&answer));
    assert_eq!(code, 200);
    assert!(
        r2["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            >= 14,
        "{r2}"
    );
    assert_eq!(stats(second.port)["ssd_cache"]["restores"], 1);

    let plain = serve(&["--prompt-cache-size", "0"]);
    let (_, fresh) = post(plain.port, "/v1/chat/completions", &turn2(&answer));
    assert_eq!(
        r2["choices"][0]["message"]["content"],
        fresh["choices"][0]["message"]["content"]
    );
}

/// The SSD tier's write-behind is debounced: nothing is written while the lane has not been
/// idle for the debounce time; what the RAM tier evicts is written at once; what is still
/// pending is written when the server is stopped (SIGTERM) — so a restart finds both.
#[test]
fn ssd_write_behind_waits_for_idle_and_spills_on_eviction_and_stop() {
    let dir = tempfile::tempdir().unwrap();
    let ssd = dir.path().to_str().unwrap().to_owned();
    let opts = [
        "--ssd-cache",
        &ssd,
        "--ssd-cache-debounce-ms",
        "600000",
        "--prompt-cache-size",
        "1",
    ];
    let mut first = serve(&opts);
    let spills = |port| stats(port)["ssd_cache"]["spills"].as_u64().unwrap();
    post(
        first.port,
        "/v1/chat/completions",
        &ask("What color is the sky?"),
    );
    // Once the request is counted, its caches are in RAM: a write that did not wait for
    // the (10-minute) idle time would have happened by then.
    wait_for(
        first.port,
        "the request counted",
        Duration::from_secs(60),
        |st| st["completed"] == 1,
    );
    assert_eq!(spills(first.port), 0, "written before the lane was idle");
    // A second conversation evicts the first from RAM (one entry): spilled at once.
    post(
        first.port,
        "/v1/chat/completions",
        &ask("Who brought the broken clock?"),
    );
    let start = Instant::now();
    while spills(first.port) != 1 {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{}",
            stats(first.port)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let pid = first.child.id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let status = first.child.wait().unwrap();
    assert!(status.success(), "SIGTERM is a clean stop: {status}");
    let second = serve(&opts);
    assert_eq!(
        stats(second.port)["ssd_cache"]["entries"],
        2,
        "{}",
        stats(second.port)
    );
}

/// Speculative decoding in the server (`--draft-model`, rows drafting in the batch lane):
/// greedy answers equal a plain server's, drafts are counted, a chat's second turn reuses
/// the model's and the drafter's caches, and requests with logits processors or
/// `num_draft_tokens: 0` run without drafting.
#[test]
fn serve_with_a_draft_model() {
    let draft = Path::new(env!("CARGO_MANIFEST_DIR")).join("../goldens/models/tiny-llama-draft");
    let spec = serve(&["--draft-model", draft.to_str().unwrap(), "--batch", "4"]);
    let plain = serve(&["--prompt-cache-size", "0"]);
    let turn1 = ask("What color is the sky?");
    let (code, r1) = post(spec.port, "/v1/chat/completions", &turn1);
    assert_eq!(code, 200, "{r1}");
    let (_, p1) = post(plain.port, "/v1/chat/completions", &turn1);
    assert_eq!(r1["choices"][0]["message"], p1["choices"][0]["message"]);
    let answer = r1["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    let turn2 = json!({"messages": [
        {"role": "user", "content": "What color is the sky?"},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "Who brought the broken clock?"},
    ], "max_tokens": 40});
    let (_, r2) = post(spec.port, "/v1/chat/completions", &turn2);
    let (_, p2) = post(plain.port, "/v1/chat/completions", &turn2);
    assert_eq!(r2["choices"][0]["message"], p2["choices"][0]["message"]);
    assert!(
        r2["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            >= 14,
        "{r2}"
    );
    let st = stats(spec.port);
    let s = &st["speculative"];
    assert!(
        s["drafted"].as_u64().unwrap() > 0 && s["accepted"].as_u64().unwrap() > 0,
        "{st}"
    );
    assert_eq!(
        st["lanes"]["batch_slots"], 4,
        "a draft model drafts in the batch lane (batch_draft::)"
    );
    assert_eq!(st["lanes"]["serial_reason"], Value::Null, "{st}");
    let mut penalised = ask("What color is the sky?");
    penalised["repetition_penalty"] = json!(1.3);
    assert_eq!(post(spec.port, "/v1/chat/completions", &penalised).0, 200);
    let mut undrafted = ask("What color is the sky?");
    undrafted["num_draft_tokens"] = json!(0);
    assert_eq!(post(spec.port, "/v1/chat/completions", &undrafted).0, 200);
    assert_eq!(stats(spec.port)["speculative"]["fallbacks"], 2);

    // A turn decoded without drafting still leaves a whole entry (the drafter's caches catch
    // up on what the model was fed): the next drafted turn of that conversation reuses it and
    // drafts exactly as a server meeting the conversation fresh does.
    let mut off = ask("Who brought the broken clock?");
    off["num_draft_tokens"] = json!(0);
    let (_, c1) = post(spec.port, "/v1/chat/completions", &off);
    let follow = json!({"messages": [
        {"role": "user", "content": "Who brought the broken clock?"},
        {"role": "assistant", "content": c1["choices"][0]["message"]["content"]},
        {"role": "user", "content": "What color is the sky?"},
    ], "max_tokens": 40});
    let before = stats(spec.port)["speculative"].clone();
    let (_, c2) = post(spec.port, "/v1/chat/completions", &follow);
    let after = stats(spec.port)["speculative"].clone();
    let cached = c2["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached > c1["usage"]["prompt_tokens"].as_u64().unwrap(),
        "the undrafted turn's entry was not reused: {c2}"
    );
    // The same lane (the batch lane drafts from the drafter's own batch, fed otherwise
    // than the serial lane's drafter: its acceptance is its own).
    let fresh = serve(&[
        "--draft-model",
        draft.to_str().unwrap(),
        "--batch",
        "4",
        "--prompt-cache-size",
        "0",
    ]);
    let (_, f2) = post(fresh.port, "/v1/chat/completions", &follow);
    assert_eq!(c2["choices"][0]["message"], f2["choices"][0]["message"]);
    let fresh_spec = &stats(fresh.port)["speculative"];
    for key in ["drafted", "accepted"] {
        let delta = after[key].as_u64().unwrap() - before[key].as_u64().unwrap();
        assert_eq!(
            delta, fresh_spec[key],
            "{key}: reused caches {before} → {after}, fresh {fresh_spec}"
        );
    }
}

/// optiq's assistant drafter in the server: completions equal a plain server's (greedy),
/// drafts are counted.
#[test]
fn serve_with_an_assistant_drafter() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../goldens/models/tiny-gemma4-assistant");
    let spec = serve_model("tiny-gemma4", &["--draft-model", dir.to_str().unwrap()]);
    let plain = serve_model("tiny-gemma4", &[]);
    let body = json!({"prompt": "The old clock", "max_tokens": 24});
    let (code, r) = post(spec.port, "/v1/completions", &body);
    assert_eq!(code, 200, "{r}");
    let (_, p) = post(plain.port, "/v1/completions", &body);
    assert_eq!(r["choices"][0]["text"], p["choices"][0]["text"]);
    let st = stats(spec.port);
    assert!(st["speculative"]["drafted"].as_u64().unwrap() > 0, "{st}");
}

/// The chat page: `/` serves the embedded page (HTML with the input box and the streaming
/// client over /v1/chat/completions); the endpoints it uses answer as it expects.
#[test]
fn the_chat_page_is_served_at_the_root() {
    let s = serve(&["--no-open"]);
    let (code, page) = http(s.port, "GET", "/", b"");
    assert_eq!(code, 200);
    for needle in [
        "<title>engine · chat</title>",
        "id=\"input\"",
        "id=\"stop\"",
        "/v1/chat/completions",
        "/v1/models",
        "tok/s",
    ] {
        assert!(page.contains(needle), "the page lacks {needle}");
    }
    assert_eq!(http(s.port, "GET", "/index.html", b"").1, page);
    let (code, models) = http(s.port, "GET", "/v1/models", b"");
    assert_eq!(code, 200);
    assert!(models.contains("tiny-llama-trained"));
}

/// `--batch N` on a model the batch lane does not take (dynamic RoPE's caches): served on
/// the serial lane, and /stats says why. Gemma 3's sliding-window rings are batched.
#[test]
fn a_model_the_batch_lane_cannot_take_says_why() {
    let server = serve_model("tiny-llama-dynamic", &["--batch", "4"]);
    let st = stats(server.port);
    assert_eq!(st["lanes"]["batch_slots"], 0, "{st}");
    let why = st["lanes"]["serial_reason"].as_str().unwrap_or_default();
    assert!(why.contains("dynamic RoPE"), "{st}");
    assert_eq!(post(server.port, "/v1/chat/completions", &ask("Hi")).0, 200);
    let gemma = serve_model("tiny-gemma3", &["--batch", "4"]);
    assert_eq!(stats(gemma.port)["lanes"]["batch_slots"], 4);
    assert_eq!(post(gemma.port, "/v1/chat/completions", &ask("Hi")).0, 200);
    // A draft model where the batch cannot give a row's positions back (gemma3's sliding
    // windows): drafting stays on the serial lane, and says why.
    let drafter = common::goldens().join("models/tiny-gemma3");
    let drafted = serve_model(
        "tiny-gemma3",
        &["--batch", "4", "--draft-model", drafter.to_str().unwrap()],
    );
    let st = stats(drafted.port);
    assert_eq!(st["lanes"]["batch_slots"], 0, "{st}");
    let why = st["lanes"]["serial_reason"].as_str().unwrap_or_default();
    assert!(why.contains("row by row"), "{st}");
    assert_eq!(
        post(drafted.port, "/v1/chat/completions", &ask("Hi")).0,
        200
    );
}

/// `--batch N` on a hybrid (gated delta nets' recurrent states beside attention layers):
/// the batch lane takes it (no serial reason), and concurrent requests joining a running
/// batch — prompts admitted over several 4-token prefill chunks, rows of different lengths
/// leaving at their limits — answer exactly as the serial lane does.
#[test]
fn a_hybrid_model_takes_the_batch_lane() {
    let run = hybrid_batch_lane("tiny-qwen3-5", &[8, 2], &[]);
    assert_eq!(run.batched, run.alone, "batch lane vs serial lane");
    assert_eq!(run.stayer_batched, run.stayer_alone, "the row left behind");
}

/// falcon_h1 (a Mamba-2 state beside K/V in every layer's `CacheList`, batched part by
/// part) through `engine serve --batch`: concurrent requests with different prompts, joining
/// a running batch and leaving it at different steps, each answer (text and per-token
/// log-probabilities) equal to the same request answered alone (greedy); a row that stays
/// when the row before it leaves decodes on as it does alone. Planted: a batch mask that
/// forgets the left padding (`BatchUnmaskedPadding`, in the server process).
#[test]
fn falcon_h1_takes_the_batch_lane_through_the_server() {
    let run = hybrid_batch_lane("tiny-falcon-h1", &[6, 2], &[]);
    assert_eq!(run.batched, run.alone, "batch lane vs serial lane");
    assert_eq!(run.stayer_batched, run.stayer_alone, "the row left behind");
    for (answer, n) in run.alone.iter().zip([12, 7, 16, 9]) {
        assert_eq!(
            answer["logprobs"].as_array().map(Vec::len),
            Some(n),
            "{answer}"
        );
    }
    // The state-rows plant (the row left behind decoding on the leaver's state) moves this
    // model's logits by 2e-3 at most (the in-process gate: 20/35 vectors, ids all equal),
    // below the bf16 log-probabilities' resolution; a mask that forgets the left padding
    // (5.9e-2) shows.
    let planted = hybrid_batch_lane(
        "tiny-falcon-h1",
        &[6, 2],
        &[("ENGINE_PLANT", "BatchUnmaskedPadding")],
    );
    assert_eq!(planted.alone, run.alone);
    let differ = (planted.batched.iter().zip(&planted.alone))
        .filter(|(b, a)| b != a)
        .count();
    let same = (planted.stayer_batched.iter())
        .zip(&planted.stayer_alone)
        .take_while(|(b, a)| b == a)
        .count();
    println!(
        "planted unmasked padding: {differ} of 4 concurrent answers differ; the row left \
         behind follows its lone run for {same} of {} tokens",
        planted.stayer_alone.len()
    );
    assert!(
        differ > 0 || same < planted.stayer_alone.len(),
        "the planted defect went unseen"
    );
}

/// The answers of one hybrid-lane run: each request's text and per-token log-probabilities
/// (the sampled id's, as f32) answered alone (the serial lane), and the same requests sent
/// at once to a batch lane; and the per-token log-probabilities of a row left behind
/// ([`a_row_left_behind`]) on the batch lane, and of its request answered alone.
struct LaneRun {
    alone: Vec<Value>,
    batched: Vec<Value>,
    stayer_alone: Vec<Value>,
    stayer_batched: Vec<Value>,
}

/// Four /v1/completions requests (different prompts and limits, `logprobs: 1`: the random
/// tiny models' greedy texts often repeat one token whatever the state, their
/// log-probabilities never do) on `model`, first one at a
/// time on a serial server, then all at once on a `--batch 5 --prefill-step-size 4` server
/// (its environment `env`) while a stream decodes there (`eos`: the model's EOS ids, biased
/// away so that the stream runs until its client leaves): the requests join a running batch
/// for certain. Checks the batch lane's /stats (it took the model, rows shared a step, none
/// failed, the leaving stream was cancelled). Then [`a_row_left_behind`] on the same servers.
fn hybrid_batch_lane(model: &str, eos: &[u32], env: &[(&str, &str)]) -> LaneRun {
    let bodies: Vec<Value> = [
        ("The little robot", 12),
        ("On Friday the robot went to the market.", 7),
        ("The", 16),
        ("Question: What color is the grass? Answer:", 9),
    ]
    .iter()
    .map(|(p, n)| json!({"prompt": p, "max_tokens": n, "logprobs": 1}))
    .collect();
    let text = |r: &Value| {
        let c = &r["choices"][0];
        json!({"text": c["text"], "logprobs": c["logprobs"]["content"]})
    };
    let serial = serve_model(model, &[]);
    let alone: Vec<Value> = bodies
        .iter()
        .map(|b| text(&post(serial.port, "/v1/completions", b).1))
        .collect();
    let batched = common::server::serve_dir_with_env(
        &common::goldens().join("models").join(model),
        &["--batch", "5", "--prefill-step-size", "4"],
        env,
    );
    let port = batched.port;
    let bias: serde_json::Map<String, Value> =
        eos.iter().map(|id| (id.to_string(), json!(-100))).collect();
    let conn = open_stream(
        port,
        json!({"prompt": "The little robot", "max_tokens": 4000, "stream": true,
               "logit_bias": bias}),
    );
    let handles: Vec<_> = bodies
        .iter()
        .cloned()
        .map(|b| std::thread::spawn(move || post(port, "/v1/completions", &b)))
        .collect();
    let batched_answers = handles
        .into_iter()
        .map(|h| {
            let (code, r) = h.join().unwrap();
            assert_eq!(code, 200, "{model}: {r}");
            text(&r)
        })
        .collect();
    drop(conn);
    let st = wait_for(
        port,
        "the leaving stream cancelled",
        Duration::from_secs(60),
        |st| st["cancelled"] == 1 && st["running"] == 0,
    );
    assert_eq!(st["lanes"]["batch_slots"], 5, "{model}: {st}");
    assert!(st["lanes"]["serial_reason"].is_null(), "{model}: {st}");
    assert_eq!(st["failed"], 0, "{model}: {st}");
    assert!(
        st["lanes"]["batch_peak_rows"].as_u64().unwrap() >= 2,
        "{model}: rows never shared a step: {st}"
    );
    let (stayer_batched, stayer_alone) = a_row_left_behind(port, serial.port, &bias);
    LaneRun {
        alone,
        batched: batched_answers,
        stayer_alone,
        stayer_batched,
    }
}

/// A stream that runs until its client leaves (`bias`: EOS ids biased away), and one that
/// joins the batch after it (its row after the first): once the second decodes, the first
/// client leaves; when /stats counts it cancelled, the second is read for 8 tokens more. Its
/// per-token log-probabilities, and those of the same request answered alone by the serial
/// server on `serial`.
fn a_row_left_behind(
    port: u16,
    serial: u16,
    bias: &serde_json::Map<String, Value>,
) -> (Vec<Value>, Vec<Value>) {
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    use std::sync::Arc;
    let cancelled = stats(port)["cancelled"].as_u64().unwrap();
    let leaver = open_stream(
        port,
        json!({"prompt": "The little robot", "max_tokens": 4000, "stream": true,
               "logit_bias": bias}),
    );
    let mut body = json!({"prompt": "On Friday the robot went to the market.",
                          "max_tokens": 4000, "stream": true, "logprobs": 10, "logit_bias": bias});
    let conn = send_stream(port, &body);
    let (got, want) = (
        Arc::new(AtomicUsize::new(0)),
        Arc::new(AtomicUsize::new(usize::MAX)),
    );
    let reader = {
        let (got, want) = (got.clone(), want.clone());
        std::thread::spawn(move || read_logprobs(conn, &got, &want))
    };
    let limit = Duration::from_secs(60);
    wait_for(port, "the second stream decoding", limit, |_| {
        got.load(SeqCst) >= 1
    });
    drop(leaver);
    wait_for(port, "the first stream cancelled", limit, |st| {
        st["cancelled"] == cancelled + 1
    });
    let n = got.load(SeqCst) + 8;
    want.store(n, SeqCst);
    let batched = reader.join().unwrap();
    assert_eq!(batched.len(), n);
    wait_for(port, "the second stream cancelled", limit, |st| {
        st["cancelled"] == cancelled + 2 && st["running"] == 0
    });
    body["stream"] = json!(false);
    body["max_tokens"] = json!(n);
    let (code, r) = post(serial, "/v1/completions", &body);
    assert_eq!(code, 200, "{r}");
    let alone = r["choices"][0]["logprobs"]["content"].as_array().unwrap();
    (batched, alone.clone())
}

/// The per-token log-probability entries of a streamed completion on `conn`, read until
/// there are `want` of them (`got`: how many so far) or the stream ends.
fn read_logprobs(mut conn: TcpStream, got: &AtomicUsize, want: &AtomicUsize) -> Vec<Value> {
    use std::sync::atomic::Ordering::SeqCst;
    conn.set_read_timeout(Some(Duration::from_secs(120)))
        .unwrap();
    let (mut raw, mut out, mut buf) = (Vec::new(), Vec::new(), [0u8; 4096]);
    while out.len() < want.load(SeqCst) {
        let n = conn.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        raw.extend_from_slice(&buf[..n]);
        while let Some(end) = raw.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = raw.drain(..=end).collect();
            let line = String::from_utf8_lossy(&line);
            let Some(data) = line.trim_end().strip_prefix("data: ") else {
                continue;
            };
            let Ok(event) = serde_json::from_str::<Value>(data) else {
                continue;
            };
            if let Some(tokens) = event["choices"][0]["logprobs"]["content"].as_array() {
                out.extend(tokens.iter().cloned());
                got.store(out.len(), SeqCst);
            }
        }
    }
    out.truncate(want.load(SeqCst));
    out
}

/// Sends `body` as a streamed /v1/completions request on a raw connection and returns the
/// connection once the first bytes of the stream arrived: the stream is decoding then, and
/// ends when the connection is dropped.
fn open_stream(port: u16, body: Value) -> TcpStream {
    let mut conn = send_stream(port, &body);
    let mut first = [0u8; 512];
    let _ = conn.read(&mut first).unwrap();
    conn
}
