//! `engine serve --adapter NAME=DIR`: a request's `model` picks a LoRA adapter, its answer
//! is `engine generate --adapter-path`'s, requests of different adapters taking turns (the
//! serial lane) or batched (`--batch`, grouped by adapter) each get their own answer, the
//! prompt cache keeps adapters apart, and adapters mount and unmount at run time. Each
//! check runs on a clean server and, where a planted defect breaks it, on a server with
//! the defect, which it must catch.

use std::path::PathBuf;
use std::process::Command;

use serde_json::{json, Value};

use crate::common::goldens;
use crate::common::server::{
    assert_no_source_paths, engine_bin, http, post, serve_dir_with_env, stats, Server,
};

const STORY: &str = "Tell me a story.";

fn model() -> PathBuf {
    goldens().join("models/tiny-llama-trained")
}

fn adapter() -> PathBuf {
    goldens().join("train/tiny-llama-trained/adapters")
}

fn server(extra: &[&str], plant: &str) -> Server {
    let flag = format!("trained={}", adapter().display());
    let mut args = vec!["--adapter", &flag];
    args.extend(extra);
    serve_dir_with_env(&model(), &args, &[("ENGINE_PLANT", plant)])
}

/// `engine generate --chat` on `prompt`, greedy, 16 tokens, with the adapter or without.
fn cli(prompt: &str, adapted: bool) -> String {
    let mut cmd = Command::new(engine_bin());
    cmd.args(["generate", "--model", model().to_str().unwrap(), "--chat"])
        .args(["--prompt", prompt, "-m", "16", "--verbose", "False"]);
    if adapted {
        cmd.args(["--adapter-path", adapter().to_str().unwrap()]);
    }
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .trim_end_matches('\n')
        .to_owned()
}

/// A chat answer of `model` (None: no `model` field), greedy, 16 tokens.
fn chat(port: u16, model: Option<&str>, prompt: &str) -> Result<String, String> {
    let mut body = json!({"messages": [{"role": "user", "content": prompt}], "max_tokens": 16});
    if let Some(m) = model {
        body["model"] = json!(m);
    }
    let (status, v) = post(port, "/v1/chat/completions", &body);
    match v["choices"][0]["message"]["content"].as_str() {
        Some(text) if status == 200 => Ok(text.to_owned()),
        _ => Err(format!("{status} {v}")),
    }
}

/// A raw completion of 48 tokens that never ends early (the EOS ids banned), so that
/// concurrent requests overlap.
fn long(port: u16, model: &str, prompt: &str) -> String {
    let body = json!({
        "model": model, "prompt": prompt, "max_tokens": 48,
        "logit_bias": {"2": -100, "6": -100},
    });
    let (status, v) = post(port, "/v1/completions", &body);
    assert_eq!(status, 200, "{v}");
    v["choices"][0]["text"].as_str().unwrap().to_owned()
}

/// The requests `interleaved_equal_solo` sends: base and adapted, two prompts.
const CASES: [(&str, &str); 4] = [
    ("tiny-llama-trained", "Once upon a time"),
    ("trained", "Once upon a time"),
    ("tiny-llama-trained", "The robot"),
    ("trained", "The robot"),
];

/// Each of `CASES` answered alone, one after another.
fn solo_answers(port: u16) -> Vec<String> {
    CASES.iter().map(|(m, p)| long(port, m, p)).collect()
}

/// Base and adapted requests sent together each get their `solo` answer.
fn interleaved_equal_solo(port: u16, solo: &[String]) -> Result<(), String> {
    let together: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = CASES
            .iter()
            .map(|&(m, p)| s.spawn(move || long(port, m, p)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    if solo[0] == solo[1] {
        return Err("the adapter changes nothing on this prompt".into());
    }
    match solo == together {
        true => Ok(()),
        false => Err(format!("solo {solo:?}\ntogether {together:?}")),
    }
}

/// A prompt long enough that the KV it leaves in the cache steers what follows.
const CACHED: &str = "On Friday the robot found a little box of rags in the workshop and";

/// An adapted answer, then the same prompt on the base: the base's answer is a fresh
/// base answer (`fresh`), not one continuing the adapter's cached KV.
fn cache_keeps_adapters_apart(port: u16, fresh: &str) -> Result<(), String> {
    long(port, "trained", CACHED);
    let base = long(port, "tiny-llama-trained", CACHED);
    match base == fresh {
        true => Ok(()),
        false => Err(format!("after the adapter: {base:?}, fresh: {fresh:?}")),
    }
}

/// 4xx with `code` / `type` as given.
fn refused(status: u16, v: &Value, want: u16) {
    assert_eq!(status, want, "{v}");
}

#[test]
fn adapted_answers_match_the_cli_and_leave_the_base_alone() {
    let (with, without) = (cli(STORY, true), cli(STORY, false));
    assert_ne!(with, without, "the adapter must change the answer");
    let s = server(&[], "");
    let p = s.port;
    // Before any adapted request of that prompt.
    let fresh = long(p, "tiny-llama-trained", CACHED);
    assert_eq!(chat(p, Some("trained"), STORY).unwrap(), with);
    assert_eq!(
        chat(p, Some("tiny-llama-trained:trained"), STORY).unwrap(),
        with
    );
    assert_eq!(chat(p, None, STORY).unwrap(), without);
    assert_eq!(chat(p, Some("tiny-llama-trained"), STORY).unwrap(), without);
    cache_keeps_adapters_apart(p, &fresh).unwrap();
    let solo = solo_answers(p);
    interleaved_equal_solo(p, &solo).unwrap();

    // /v1/models lists the adapter after the base.
    let models: Value = serde_json::from_str(&http(p, "GET", "/v1/models", b"").1).unwrap();
    let data = models["data"].as_array().unwrap();
    let base = data[0]["id"].as_str().unwrap().to_owned();
    assert_eq!(data[1]["id"], format!("{base}:trained"));
    assert_eq!(data[1]["parent"], base);

    // Unknown names: OpenAI's model_not_found on every API, Anthropic's not_found_error.
    let ask = json!({"model": "nope", "messages": [{"role": "user", "content": "hi"}]});
    let (st, v) = post(p, "/v1/chat/completions", &ask);
    refused(st, &v, 404);
    assert_eq!(v["error"]["code"], "model_not_found", "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains(":trained"),
        "{v}"
    );
    let (st, v) = post(
        p,
        "/v1/completions",
        &json!({"model": format!("{base}:nope"), "prompt": "x"}),
    );
    refused(st, &v, 404);
    let (st, v) = post(p, "/v1/embeddings", &json!({"model": "nope", "input": "x"}));
    refused(st, &v, 404);
    let (st, v) = post(p, "/v1/responses", &json!({"model": "nope", "input": "x"}));
    refused(st, &v, 404);
    let msg =
        json!({"model": "nope", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]});
    let (st, v) = post(p, "/v1/messages", &msg);
    refused(st, &v, 404);
    assert_eq!(v["error"]["type"], "not_found_error", "{v}");
    // The adapter's embeddings are its own.
    let emb = |m: &str| post(p, "/v1/embeddings", &json!({"model": m, "input": "sky"})).1;
    assert_ne!(emb("trained")["data"], emb("tiny-llama-trained")["data"]);

    // Mount at run time, answer, unmount; the hostile values refused.
    let dir = adapter().display().to_string();
    let (st, v) = post(p, "/v1/adapters", &json!({"name": "again", "path": dir}));
    assert_eq!(st, 200, "{v}");
    assert_eq!(chat(p, Some("again"), STORY).unwrap(), with);
    let (st, v) = post(p, "/v1/adapters", &json!({"name": "again", "path": dir}));
    refused(st, &v, 409);
    for (name, path) in [
        ("a:b", dir.clone()),
        ("../x", dir.clone()),
        (
            "phi",
            goldens()
                .join("train/tiny-phi3/adapters")
                .display()
                .to_string(),
        ),
        ("notone", goldens().join("models").display().to_string()),
    ] {
        let (st, v) = post(p, "/v1/adapters", &json!({"name": name, "path": path}));
        refused(st, &v, 400);
    }
    let (st, v) = post(p, "/v1/adapters", &json!({"name": 7}));
    refused(st, &v, 400);
    let (st, body) = http(p, "DELETE", "/v1/adapters/again", b"");
    assert_eq!(st, 200, "{body}");
    let (st, body) = http(p, "DELETE", "/v1/adapters/again", b"");
    assert_eq!(st, 404, "{body}");
    assert!(chat(p, Some("again"), STORY)
        .unwrap_err()
        .starts_with("404"));
    assert_eq!(chat(p, Some("trained"), STORY).unwrap(), with);
    let st = stats(p);
    assert_eq!(st["failed"], 0);
    // A serial server has no batch lane to group rows in.
    assert!(st["lanes"]["batch_adapters"].is_null(), "{st}");

    // Each planted defect is caught by its check.
    let planted = server(&[], "AdapterCacheSharedWithBase");
    assert!(cache_keeps_adapters_apart(planted.port, &fresh).is_err());
    drop(planted);
    // The planted lane gathers the four before it starts, so they interleave however
    // loaded the machine is (a request could otherwise end before the next arrives).
    let planted = server(&[], "AdapterSetOnceAtAdmission,SerialGathersFour");
    assert!(interleaved_equal_solo(planted.port, &solo).is_err());
}

/// An adapter directory whose tensors file is damaged is a 400 that says so, in words a
/// client can act on: MLX's reading error is quoted without its source locations (the
/// C++ file and line, our crate's path), which it carried before (issue 43's leftover).
#[test]
fn a_damaged_adapter_is_refused_without_source_paths() {
    let s = server(&[], "");
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        adapter().join("adapter_config.json"),
        dir.path().join("adapter_config.json"),
    )
    .unwrap();
    std::fs::write(
        dir.path().join("adapters.safetensors"),
        b"not a tensors file",
    )
    .unwrap();
    let path = dir.path().display().to_string();
    let (st, v) = post(
        s.port,
        "/v1/adapters",
        &json!({"name": "damaged", "path": path}),
    );
    refused(st, &v, 400);
    assert!(
        v["error"]["message"].as_str().unwrap_or("").contains(&path),
        "{v}"
    );
    assert_no_source_paths(&v.to_string().replace(&path, "ADAPTER"));
}

#[test]
fn the_batch_lane_groups_rows_by_adapter() {
    let s = server(&["--batch", "4"], "");
    let solo = solo_answers(s.port);
    interleaved_equal_solo(s.port, &solo).unwrap();
    let st = stats(s.port);
    assert_eq!(st["lanes"]["batch_adapters"], "grouped", "{st}");
    assert_eq!(st["lanes"]["batch_slots"], 4, "{st}");
    drop(s);
    // Gathered before the lane starts, the four rows share the batch whatever the load.
    let planted = server(&["--batch", "4"], "AdapterBatchMixed,BatchGathersFour");
    assert!(interleaved_equal_solo(planted.port, &solo).is_err());
}

/// An adapter in use is not unmounted (409 naming the requests), then is once they end.
#[test]
fn an_adapter_in_use_is_not_unmounted() {
    use std::io::Read;
    let s = server(&["--stall-timeout", "30"], "");
    let p = s.port;
    let body = json!({
        "model": "trained", "prompt": "Once upon a time", "max_tokens": 3000, "stream": true,
        "logit_bias": {"2": -100, "6": -100},
    });
    let mut conn = crate::common::server::send_stream(p, &body);
    let mut first = [0u8; 64];
    let _ = conn.read(&mut first).unwrap();
    let (st, text) = http(p, "DELETE", "/v1/adapters/trained", b"");
    assert_eq!(st, 409, "{text}");
    assert!(text.contains("in use by 1 request"), "{text}");
    drop(conn);
    let start = std::time::Instant::now();
    loop {
        let (st, text) = http(p, "DELETE", "/v1/adapters/trained", b"");
        if st == 200 {
            break;
        }
        assert_eq!(st, 409, "{text}");
        assert!(start.elapsed().as_secs() < 20, "still in use: {text}");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(chat(p, None, STORY).is_ok());
}

/// An adapted answer's caches written to the SSD tier (`dir`), then a restarted server's
/// base answer of that prompt: a fresh base answer, not one restored from the adapter's
/// entry.
fn ssd_keeps_adapters_apart(dir: &str, plant: &str, fresh: &str) -> Result<(), String> {
    let opts = ["--ssd-cache", dir, "--ssd-cache-debounce-ms", "0"];
    let first = server(&opts, plant);
    long(first.port, "trained", CACHED);
    let start = std::time::Instant::now();
    while stats(first.port)["ssd_cache"]["spills"] != 1 {
        assert!(start.elapsed().as_secs() < 30, "{}", stats(first.port));
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    drop(first);
    let second = server(&opts, plant);
    let base = long(second.port, "tiny-llama-trained", CACHED);
    match base == fresh {
        true => Ok(()),
        false => Err(format!("after a restart: {base:?}, fresh: {fresh:?}")),
    }
}

#[test]
fn the_ssd_tier_keeps_adapters_apart() {
    let fresh = {
        let s = server(&[], "");
        long(s.port, "tiny-llama-trained", CACHED)
    };
    let (clean, planted) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let path = |d: &tempfile::TempDir| d.path().to_str().unwrap().to_owned();
    ssd_keeps_adapters_apart(&path(&clean), "", &fresh).unwrap();
    let caught = ssd_keeps_adapters_apart(&path(&planted), "AdapterCacheSharedWithBase", &fresh);
    assert!(caught.is_err());
}
