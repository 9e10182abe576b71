//! `POST /v1/embeddings` end to end on tiny-qwen3-embedding (Qwen3-Embedding's layout):
//!
//! 1. bit-exact against mlx-lm (goldens/serve/embeddings-mlx.json, oracles/gen_embeddings.py:
//!    `model.model(ids)` → pooling → normalization in MLX, f32): the base64 answers equal the
//!    golden's bytes (max |Δ| = 0), for a text, a batch of different lengths, token-id
//!    inputs, `dimensions` and mean pooling (`--embedding-pooling mean`, on the batch lane);
//! 2. cosine ≥ 0.9999 against sentence-transformers 6.2.0 (goldens/serve/embeddings-st.json),
//!    and the token ids it fed the model equal ours (`usage`);
//! 3. a server with planted defects (pooling the token before the last; a request embedded
//!    in one turn) fails 1, 2 and 4;
//! 4. a streamed generation sent while a long embeddings request is being embedded ends
//!    first (each input takes a turn between the generation's steps), on both lanes;
//! 5. hostile bodies: every one a 200 or a 4xx JSON error, the server unharmed.
//!
//! One test, three servers started together (the embeddings one, mean pooling with
//! `--batch 4`, and the planted one).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use serde_json::{json, Value};

use crate::common;
use common::server::{http, post, serve_dir_with_env, serve_model, stats, wait_for};

const MODEL: &str = "tiny-qwen3-embedding";

fn golden(name: &str) -> Value {
    let path = common::goldens().join("serve").join(name);
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn floats(b64: &str) -> Vec<f32> {
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(b64)
        .unwrap();
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// The golden case's request, base64, on `port`: its embeddings and usage.
fn ask(port: u16, case: &Value) -> Result<(Vec<Vec<f32>>, Value), String> {
    let mut body = case["body"].clone();
    body["model"] = json!("tiny-embedder");
    body["encoding_format"] = json!("base64");
    let (status, r) = post(port, "/v1/embeddings", &body);
    if status != 200 {
        return Err(format!("{}: status {status}: {r}", case["name"]));
    }
    assert_eq!(r["object"], "list", "{r}");
    assert_eq!(r["model"], "tiny-embedder", "{r}");
    let data = r["data"].as_array().unwrap();
    for (i, d) in data.iter().enumerate() {
        assert_eq!(
            (&d["object"], d["index"].as_u64()),
            (&json!("embedding"), Some(i as u64))
        );
    }
    let vecs = data
        .iter()
        .map(|d| floats(d["embedding"].as_str().unwrap()))
        .collect();
    Ok((vecs, r["usage"].clone()))
}

/// Gate 1: every golden case of `pooling` answered with the golden's exact bytes and token
/// count. Ok(cases compared), or what differed.
fn bit_exact(port: u16, pooling: &str) -> Result<usize, String> {
    let g = golden("embeddings-mlx.json");
    let cases: Vec<&Value> = g["cases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["pooling"] == pooling)
        .collect();
    for case in &cases {
        let (got, usage) = ask(port, case)?;
        let tokens = &case["prompt_tokens"];
        if usage != json!({"prompt_tokens": tokens, "total_tokens": tokens}) {
            return Err(format!(
                "{}: usage {usage}, expected {tokens} tokens",
                case["name"]
            ));
        }
        let want: Vec<Vec<f32>> = case["embeddings_base64"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| floats(b.as_str().unwrap()))
            .collect();
        let delta = got
            .iter()
            .flatten()
            .zip(want.iter().flatten())
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        let lens = |v: &[Vec<f32>]| v.iter().map(Vec::len).collect::<Vec<_>>();
        if lens(&got) != lens(&want) || delta != 0.0 {
            return Err(format!("{}: max |Δ| {delta:e} vs mlx-lm", case["name"]));
        }
    }
    Ok(cases.len())
}

/// Gate 2: the sentence-transformers cases of `pooling`, cosine ≥ 0.9999 each, and the
/// token counts of the ids it fed the model. Ok(the smallest cosine), or what differed.
fn st_cosine(port: u16, pooling: &str) -> Result<f64, String> {
    let g = golden("embeddings-st.json");
    let mut least = f64::MAX;
    for case in g["cases"].as_array().unwrap() {
        if case["pooling"] != pooling {
            continue;
        }
        let (got, usage) = ask(port, case)?;
        let st_tokens: usize = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|ids| ids.as_array().unwrap().len())
            .sum();
        assert_eq!(usage["prompt_tokens"], st_tokens, "{}", case["name"]);
        for (v, b) in got
            .iter()
            .zip(case["embeddings_base64"].as_array().unwrap())
        {
            let w = floats(b.as_str().unwrap());
            let dot = |a: &[f32], b: &[f32]| {
                a.iter()
                    .zip(b)
                    .map(|(x, y)| *x as f64 * *y as f64)
                    .sum::<f64>()
            };
            let cos = dot(v, &w) / (dot(v, v).sqrt() * dot(&w, &w).sqrt());
            least = least.min(cos);
            if cos < 0.9999 {
                return Err(format!(
                    "{}: cosine {cos} vs sentence-transformers",
                    case["name"]
                ));
            }
        }
    }
    Ok(least)
}

/// Gate 4: an embeddings request of `inputs` inputs is being embedded when a stream of
/// `tokens` tokens (EOS biased away) arrives. Embedded one input per turn, the request
/// leaves a turn to the stream between its inputs, so the stream ends long before the
/// request does; a request embedded in one turn would be answered before the stream was
/// even admitted. Ok, or which came first.
fn stream_beside(port: u16, inputs: usize, tokens: usize) -> Result<(), String> {
    let eos: Value = serde_json::from_str(
        &std::fs::read_to_string(
            common::goldens()
                .join("models")
                .join(MODEL)
                .join("generation_config.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let bias: serde_json::Map<String, Value> = eos["eos_token_id"]
        .as_array()
        .unwrap()
        .iter()
        .map(|id| (id.to_string(), json!(-100)))
        .collect();
    let order = Arc::new(AtomicUsize::new(0));
    let ids: Vec<Value> = (0..inputs).map(|i| json!([(i * 7) % 1000, 5, 9])).collect();
    let embedder = {
        let order = order.clone();
        // base64 and parsed after the answer is in: what is ordered is the server's answer,
        // not the time to build or parse a long JSON list of floats.
        let body = json!({"input": ids, "encoding_format": "base64"}).to_string();
        std::thread::spawn(move || {
            let (status, text) = http(port, "POST", "/v1/embeddings", body.as_bytes());
            let at = order.fetch_add(1, Ordering::SeqCst);
            (
                at,
                status,
                serde_json::from_str::<Value>(&text).unwrap_or(Value::Null),
            )
        })
    };
    // The request is on the model thread once it counts as running.
    let start = std::time::Instant::now();
    while stats(port)["running"] == 0 {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the embeddings never started"
        );
    }
    let body = json!({"prompt": "The little robot", "max_tokens": tokens, "stream": true,
                      "logit_bias": bias});
    let (status, text) = http(port, "POST", "/v1/completions", body.to_string().as_bytes());
    let streamed_at = order.fetch_add(1, Ordering::SeqCst);
    assert_eq!(status, 200, "{text}");
    assert!(
        text.contains("data: [DONE]"),
        "the stream did not complete: {text}"
    );
    let (embedded_at, status, r) = embedder.join().unwrap();
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["data"].as_array().map(Vec::len), Some(inputs));
    match streamed_at < embedded_at {
        true => Ok(()),
        false => Err(format!(
            "a {tokens}-token stream sent while {inputs} inputs were being embedded ended after \
             them: held up"
        )),
    }
}
/// Gate 5: hostile bodies are 200s or 4xx JSON errors (the expected param where named).
fn hostile_bodies(port: u16) {
    let many: Vec<Value> = vec![json!("a"); 2049];
    let long: Vec<u32> = vec![5; 5000];
    let cases: Vec<(&[u8], u16, Option<&str>)> = vec![
        (b"not json", 400, None),
        (b"[1, 2]", 400, None),
        (b"{}", 400, Some("input")),
        (b"{\"input\": [NaN]}", 400, None),
        (b"{\"input\": \"a\", \"dimensions\": 1e400}", 400, None),
    ];
    for (raw, want, param) in cases {
        let (status, text) = http(port, "POST", "/v1/embeddings", raw);
        let v: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        assert_eq!(status, want, "{}: {text}", String::from_utf8_lossy(raw));
        assert!(v["error"]["message"].is_string(), "{text}");
        if let Some(p) = param {
            assert_eq!(v["error"]["param"], p, "{text}");
        }
    }
    let bodies = [
        (json!({"input": null}), Some("input")),
        (json!({"input": 5}), Some("input")),
        (json!({"input": {"a": 1}}), Some("input")),
        (json!({"input": []}), Some("input")),
        (json!({"input": ""}), Some("input")),
        (json!({"input": ["a", ""]}), Some("input[1]")),
        (json!({"input": [[]]}), Some("input[0]")),
        (json!({"input": [-1]}), Some("input[0]")),
        (json!({"input": [1024]}), Some("input[0]")),
        (json!({"input": [4294967296u64]}), Some("input[0]")),
        (json!({"input": [1e300]}), Some("input[0]")),
        (json!({"input": [0.5]}), Some("input[0]")),
        (json!({"input": [[1, [2]]]}), Some("input[0][1]")),
        (json!({"input": [[[1]]]}), Some("input[0][0]")),
        (json!({"input": ["a", 1]}), Some("input[1]")),
        (json!({"input": [1, "a"]}), Some("input[1]")),
        (json!({"input": [true]}), Some("input[0]")),
        (json!({"input": many}), Some("input")),
        (json!({"input": [long]}), Some("input[0]")),
        (json!({"input": "a", "dimensions": 0}), Some("dimensions")),
        (json!({"input": "a", "dimensions": 65}), Some("dimensions")),
        (
            json!({"input": "a", "dimensions": u64::MAX}),
            Some("dimensions"),
        ),
        (json!({"input": "a", "dimensions": -1}), Some("dimensions")),
        (
            json!({"input": "a", "dimensions": 1e30}),
            Some("dimensions"),
        ),
        (json!({"input": "a", "dimensions": "8"}), Some("dimensions")),
        (
            json!({"input": "a", "encoding_format": "hex"}),
            Some("encoding_format"),
        ),
        (
            json!({"input": "a", "encoding_format": 1}),
            Some("encoding_format"),
        ),
        (json!({"input": "a", "model": 5}), Some("model")),
        (json!({"input": "a", "user": ["x"]}), Some("user")),
    ];
    for (body, param) in bodies {
        let (status, v) = post(port, "/v1/embeddings", &body);
        let shown: String = body.to_string().chars().take(120).collect();
        assert_eq!(status, 400, "{shown}: {v}");
        assert!(v["error"]["message"].is_string(), "{v}");
        assert_eq!(v["error"]["param"].as_str(), param, "{shown}: {v}");
    }
    // Odd but valid: answered.
    for body in [
        json!({"input": "NaN", "dimensions": 64, "user": "u", "encoding_format": "float"}),
        json!({"input": ["\u{0}", "😀", " "], "dimensions": 1}),
        json!({"input": [[0], [1023]]}),
    ] {
        let (status, v) = post(port, "/v1/embeddings", &body);
        assert_eq!(status, 200, "{body}: {v}");
    }
}

/// The floats answer (the default format) holds the same values as the base64 one.
fn floats_equal_base64(port: u16) {
    let body = json!({"input": ["one", "two words"], "dimensions": 8});
    let (s1, plain) = post(port, "/v1/embeddings", &body);
    let mut b = body.clone();
    b["encoding_format"] = json!("base64");
    let (s2, packed) = post(port, "/v1/embeddings", &b);
    assert_eq!((s1, s2), (200, 200), "{plain} {packed}");
    for (p, q) in plain["data"]
        .as_array()
        .unwrap()
        .iter()
        .zip(packed["data"].as_array().unwrap())
    {
        let p: Vec<f32> = p["embedding"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect();
        assert_eq!(p.len(), 8);
        assert_eq!(p, floats(q["embedding"].as_str().unwrap()));
    }
}

#[test]
fn embeddings_are_mlx_lm_to_the_bit_agree_with_sentence_transformers_and_never_hold_a_stream_up() {
    let dir = common::goldens().join("models").join(MODEL);
    let last = serve_model(MODEL, &[]);
    let mean = serve_model(MODEL, &["--embedding-pooling", "mean", "--batch", "4"]);
    let planted = serve_dir_with_env(
        &dir,
        &[],
        &[("ENGINE_PLANT", "EmbedPoolsBeforeLast,EmbedHoldsTheLane")],
    );

    // Gates 1 and 2, last-token pooling (serial lane) and mean pooling (batch lane).
    assert_eq!(bit_exact(last.port, "last"), Ok(5));
    assert_eq!(bit_exact(mean.port, "mean"), Ok(2));
    let cos_last = st_cosine(last.port, "last").unwrap();
    let cos_mean = st_cosine(mean.port, "mean").unwrap();
    eprintln!("cosine vs sentence-transformers: last {cos_last}, mean {cos_mean}");
    floats_equal_base64(last.port);

    // Gate 4 on both lanes.
    stream_beside(last.port, 1024, 256).unwrap();
    stream_beside(mean.port, 1024, 256).unwrap();

    // Gate 5, then the server still answers as before.
    hostile_bodies(last.port);
    assert_eq!(bit_exact(last.port, "last"), Ok(5));
    let st = wait_for(
        last.port,
        "nothing running",
        Duration::from_secs(30),
        |st| st["running"] == 0 && st["queued"] == 0,
    );
    assert_eq!(st["failed"], 0, "{st}");
    assert_eq!(stats(mean.port)["failed"], 0);

    // Gate 3: the planted server fails 1, 2 and 4.
    let e = bit_exact(planted.port, "last").unwrap_err();
    assert!(e.contains("max |Δ|"), "{e}");
    let e = st_cosine(planted.port, "last").unwrap_err();
    assert!(e.contains("cosine"), "{e}");
    let e = stream_beside(planted.port, 1024, 256).unwrap_err();
    eprintln!("planted: {e}");
    assert!(e.contains("held up"), "{e}");
}
