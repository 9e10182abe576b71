//! Images in requests, over HTTP (docs/vision.md, "Images in requests"): every API reads
//! its image parts, checks each image (source, bytes, size) and answers a clear 400 naming
//! the part; a text model refuses checked images, naming why; the server keeps answering.
//! `--allow-local-files DIR` reads files under DIR only. Planted: `ImageOutsideAllowedDir`
//! (a `..` path out of DIR is read).

use base64::Engine as _;
use serde_json::{json, Value};

use crate::common;
use crate::common::server::{post, serve_dir, serve_dir_with_env, Server};

fn image(name: &str) -> Vec<u8> {
    std::fs::read(common::goldens().join("vision").join(name)).unwrap()
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

fn data_url(bytes: &[u8]) -> String {
    format!("data:image/png;base64,{}", b64(bytes))
}

fn chat(url: &str) -> Value {
    json!({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is in it?"},
        {"type": "image_url", "image_url": {"url": url}}]}]})
}

/// A 400 whose message holds `want`; the message and the param (OpenAI's shape, or
/// Anthropic's, which has no param).
fn refused(port: u16, path: &str, body: &Value, want: &str) -> (String, Option<String>) {
    let (status, v) = post(port, path, body);
    assert_eq!(status, 400, "{path}: {v}");
    let message = v["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(message.contains(want), "{path}: `{want}` not in {v}");
    (message, v["error"]["param"].as_str().map(str::to_owned))
}

fn start(dir: &std::path::Path, env: &[(&str, &str)]) -> Server {
    let model = common::goldens().join("models/tiny-llama");
    serve_dir_with_env(&model, &["--allow-local-files", dir.to_str().unwrap()], env)
}

#[test]
fn image_parts_are_checked_on_every_api_and_a_text_model_refuses_them_clearly() {
    let root = tempfile::tempdir().unwrap();
    let allowed = root.path().join("allowed");
    std::fs::create_dir(&allowed).unwrap();
    std::fs::write(allowed.join("in.png"), image("images/bilevel_19x13.png")).unwrap();
    std::fs::write(
        root.path().join("out.png"),
        image("images/bilevel_19x13.png"),
    )
    .unwrap();
    let sneaky = format!("file://{}/../out.png", allowed.display());
    let inside = format!("file://{}/in.png", allowed.display());
    let (clean, planted) = std::thread::scope(|s| {
        let planted = s.spawn(|| start(&allowed, &[("ENGINE_PLANT", "ImageOutsideAllowedDir")]));
        (start(&allowed, &[]), planted.join().unwrap())
    });
    let port = clean.port;
    let png = image("images/bilevel_19x13.png");
    let text_only = "reads text only";

    // Chat: a good image reaches the model's refusal, with the part's path.
    let (_, param) = refused(
        port,
        "/v1/chat/completions",
        &chat(&data_url(&png)),
        text_only,
    );
    assert_eq!(param.as_deref(), Some("messages[0].content[1]"));
    // Local files: under the allowed dir read; out of it refused.
    refused(port, "/v1/chat/completions", &chat(&inside), text_only);
    refused(
        port,
        "/v1/chat/completions",
        &chat(&sneaky),
        "not a readable file under",
    );
    refused(
        planted.port,
        "/v1/chat/completions",
        &chat(&sneaky),
        text_only,
    );
    // Bad sources and bytes, each named.
    for (url, want) in [
        ("https://example.com/cat.png".to_owned(), "fetches no URLs"),
        ("data:image/png;base64,!!".to_owned(), "not valid base64"),
        (data_url(&image("hostile/truncated.png")), "truncated"),
        (
            data_url(&image("hostile/header_30000x30000.png")),
            "over the limit",
        ),
        (
            data_url(&image("hostile/zipbomb_20000x20000.png")),
            "over the limit",
        ),
        (
            data_url(&image("hostile/not_an_image.html")),
            "not an image",
        ),
    ] {
        let (_, param) = refused(port, "/v1/chat/completions", &chat(&url), want);
        assert_eq!(param.as_deref(), Some("messages[0].content[1]"), "{want}");
    }
    let many: Vec<Value> = (0..9)
        .map(|_| json!({"type": "image_url", "image_url": {"url": data_url(&png)}}))
        .collect();
    let body = json!({"max_tokens": 4, "messages": [{"role": "user", "content": many}]});
    refused(
        port,
        "/v1/chat/completions",
        &body,
        "--max-images-per-request",
    );

    // Responses: input_image.
    let body = json!({"max_output_tokens": 4, "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": data_url(&png)},
        {"type": "input_text", "text": "What is in it?"}]}]});
    let (_, param) = refused(port, "/v1/responses", &body, text_only);
    assert_eq!(param.as_deref(), Some("input[0].content[0]"));
    let body = json!({"input": [{"role": "user", "content": [
        {"type": "input_image", "file_id": "file-1"}]}]});
    refused(port, "/v1/responses", &body, "file_id is not supported");

    // Messages: base64 image blocks (Anthropic's error shape names no param).
    let block = |data: String| {
        json!({"max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
            {"type": "text", "text": "What is in it?"}]}]})
    };
    refused(port, "/v1/messages", &block(b64(&png)), text_only);
    refused(
        port,
        "/v1/messages",
        &block(b64(&image("hostile/truncated.jpg"))),
        "truncated",
    );

    // The server answers text as before.
    let (status, v) = post(port, "/v1/chat/completions", &common::server::ask("hi"));
    assert_eq!(status, 200, "{v}");
}

/// goldens/vision/generate/generate.json's case of `model` with `n` images.
fn generate_case(model: &str, n: usize) -> Value {
    let path = common::goldens().join("vision/generate/generate.json");
    let g: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    g["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["model"] == model && c["images"].as_array().unwrap().len() == n)
        .unwrap()
        .clone()
}

fn url_part(name: &str) -> Value {
    json!({"type": "image_url", "image_url": {"url": data_url(&image(name))}})
}

/// A greedy chat request for `content`: its answer's tokens (vocabulary strings, as
/// `logprobs` names them), its text, its prompt tokens, and its first token's
/// log-probability.
fn answer(port: u16, content: Value) -> (Vec<String>, String, u64, f64) {
    let body = json!({"max_tokens": 8, "temperature": 0.0, "logprobs": true,
        "messages": [{"role": "user", "content": content}]});
    let (status, v) = post(port, "/v1/chat/completions", &body);
    assert_eq!(status, 200, "{v}");
    let lp = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    let tokens = lp.iter().map(|t| t["token"].as_str().unwrap().to_owned());
    (
        tokens.collect(),
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_owned(),
        v["usage"]["prompt_tokens"].as_u64().unwrap(),
        lp[0]["logprob"].as_f64().unwrap(),
    )
}

/// The golden case's generated ids as vocabulary strings.
fn golden_tokens(dir: &std::path::Path, case: &Value) -> Vec<String> {
    let tok = engine::load::tokenizer::Tokenizer::load(dir).unwrap();
    case["generated"]
        .as_array()
        .unwrap()
        .iter()
        .map(|id| tok.id_to_token(id.as_u64().unwrap() as u32).unwrap())
        .collect()
}

/// The deltas of a streamed chat request, joined.
fn streamed(port: u16, content: Value) -> String {
    let body = json!({"max_tokens": 8, "temperature": 0.0, "stream": true,
        "messages": [{"role": "user", "content": content}]});
    let (status, sse) = common::server::http(
        port,
        "POST",
        "/v1/chat/completions",
        body.to_string().as_bytes(),
    );
    assert_eq!(status, 200, "{sse}");
    sse.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|v| {
            v["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_owned)
        })
        .collect()
}

/// Two pictures of one size: the second is the first mirrored (EXIF orientation 2).
const SAME_SIZE: [&str; 2] = [
    "images/jpeg_orient1_48x32.jpg",
    "images/jpeg_orient2_48x32.jpg",
];

fn describe() -> Value {
    json!({"type": "text", "text": "Describe this."})
}

/// The first turn alone, one token: its entry holds just the prompt (the answer's one token
/// is not fed back), which [`conversation`] extends exactly (gemma3's sliding-window caches
/// cannot be trimmed, so an entry is used only as a whole prefix).
fn first_turn(port: u16, image: &str) {
    let body = json!({"max_tokens": 1, "messages": [{"role": "user",
        "content": [describe(), url_part(image)]}]});
    assert_eq!(post(port, "/v1/chat/completions", &body).0, 200);
}

fn conversation(image: &str) -> Value {
    json!([{"role": "user", "content": [describe(), url_part(image)]},
        {"role": "assistant", "content": "It is a picture."},
        {"role": "user", "content": "And the colors?"}])
}

/// A greedy answer to `turns` with its tokens' log-probabilities (the tiny models' texts
/// repeat), and the prompt tokens the cache gave.
fn ask_turns(port: u16, turns: &Value) -> (Value, u64) {
    let body = json!({"max_tokens": 8, "temperature": 0.0, "logprobs": true,
        "messages": turns});
    let (status, v) = post(port, "/v1/chat/completions", &body);
    assert_eq!(status, 200, "{v}");
    let reused = v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
    (v["choices"][0].clone(), reused.unwrap())
}

/// The prompt cache with images, on a server (`served`) against one without a prompt cache
/// (`uncached`): a conversation goes on from its cached prefix (the image's run in it) and
/// answers as a fresh prompt; the same conversation with another image of the same size (so
/// the same ids) reuses only the text before the image, and answers as a fresh prompt; on
/// `planted` (ids-only keys) it does not.
fn prompt_cache_claims(served: u16, uncached: u16, planted: Option<u16>) {
    let [a, b] = SAME_SIZE;
    first_turn(served, a);
    let (with_a, with_b) = (conversation(a), conversation(b));
    let (fresh_a, fresh_b) = (
        ask_turns(uncached, &with_a).0,
        ask_turns(uncached, &with_b).0,
    );
    assert_ne!(fresh_a, fresh_b, "the two images give one answer");
    let (got, reused_a) = ask_turns(served, &with_a);
    assert!(reused_a > 20, "no cached prefix: {reused_a}");
    assert_eq!(got, fresh_a, "a cached prefix changed the answer");
    let (got, reused_b) = ask_turns(served, &with_b);
    assert!(
        reused_b < reused_a,
        "another image's run was reused: {reused_b} tokens"
    );
    assert_eq!(got, fresh_b, "another image's prefix changed the answer");
    if let Some(planted) = planted {
        first_turn(planted, a);
        let got = ask_turns(planted, &with_b).0;
        assert_ne!(got, fresh_b, "planted ImageRequestCachedByIds: not caught");
    }
}

/// The SSD tier across a restart: the first turn's entry written to disk by one server, the
/// conversation restored from it by a new server over the same directory and answered as an
/// uncached server answers it; the mirrored picture's conversation reuses less.
fn ssd_tier_claims(model: &std::path::Path, uncached: u16) {
    let [a, b] = SAME_SIZE;
    let ssd = tempfile::tempdir().unwrap();
    let opts = [
        "--ssd-cache",
        ssd.path().to_str().unwrap(),
        "--ssd-cache-debounce-ms",
        "0",
    ];
    let first = serve_dir(model, &opts);
    first_turn(first.port, a);
    let limit = std::time::Duration::from_secs(30);
    common::server::wait_for(first.port, "the entry on disk", limit, |st| {
        st["ssd_cache"]["spills"] == 1
    });
    drop(first);
    let second = serve_dir(model, &opts);
    let (got, reused_a) = ask_turns(second.port, &conversation(a));
    assert!(reused_a > 20, "not restored from disk: {reused_a}");
    assert_eq!(
        got,
        ask_turns(uncached, &conversation(a)).0,
        "restored, it answers otherwise"
    );
    assert_eq!(
        common::server::stats(second.port)["ssd_cache"]["restores"],
        1
    );
    let (got, reused_b) = ask_turns(second.port, &conversation(b));
    assert!(
        reused_b < reused_a,
        "the mirrored picture's run was reused: {reused_b}"
    );
    assert_eq!(got, ask_turns(uncached, &conversation(b)).0);
}

#[test]
fn a_served_vision_model_answers_images_as_mlx_vlm_generates_on_every_api() {
    let gemma = common::vision::assembled("tiny-gemma3-vl");
    let qwen = common::vision::assembled("tiny-qwen3-vl-vision");
    let order = [("ENGINE_PLANT", "ServedImageEntriesFirst")];
    let cache = [("ENGINE_PLANT", "ImageRequestCachedByIds")];
    let (g, q, planted_order, planted_cache, (uncached, uncached_q, batched)) =
        std::thread::scope(|s| {
            let q = s.spawn(|| serve_dir(qwen.path(), &[]));
            let u = s.spawn(|| serve_dir(gemma.path(), &["--prompt-cache-size", "0"]));
            let uq = s.spawn(|| serve_dir(qwen.path(), &["--prompt-cache-size", "0"]));
            let bg = s.spawn(|| serve_dir(gemma.path(), &["--batch", "4"]));
            let po = s.spawn(|| serve_dir_with_env(qwen.path(), &[], &order));
            let pc = s.spawn(|| serve_dir_with_env(gemma.path(), &[], &cache));
            let g = serve_dir(gemma.path(), &[]);
            let joined = (q.join().unwrap(), po.join().unwrap(), pc.join().unwrap());
            let uncached = (u.join().unwrap(), uq.join().unwrap(), bg.join().unwrap());
            (g, joined.0, joined.1, joined.2, uncached)
        });
    let text = json!({"type": "text", "text": "Describe this."});
    let (a, b) = ("images/rgb_64x64.png", "images/rgb_97x61.png");

    // gemma3: its markers after the text (mlx-vlm's CLI layout, so its goldens apply), with
    // 1 and 2 images; the same answer streamed and through Responses and Messages.
    for (n, content) in [
        (1, json!([text, url_part(a)])),
        (2, json!([text, url_part(a), url_part(b)])),
    ] {
        let case = generate_case("tiny-gemma3-vl", n);
        let (got, text, prompt_tokens, _) = answer(g.port, content.clone());
        assert_eq!(
            got,
            golden_tokens(gemma.path(), &case),
            "gemma3, {n} image(s)"
        );
        assert_eq!(
            prompt_tokens as usize,
            case["prompt_ids"].as_array().unwrap().len()
        );
        // mlx_vlm.server strips whole answers, not streamed chat (`harness serve-diff
        // --vision` holds every chunk against it).
        assert_eq!(streamed(g.port, content).trim(), text, "gemma3 streamed");
    }
    let want = answer(g.port, json!([text, url_part(a)])).1;
    let body = json!({"max_output_tokens": 8, "temperature": 0.0, "input": [{"role": "user",
        "content": [{"type": "input_text", "text": "Describe this."},
                    {"type": "input_image", "image_url": data_url(&image(a))}]}]});
    let (status, v) = post(g.port, "/v1/responses", &body);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["output"][0]["content"][0]["text"], want, "responses: {v}");
    let body = json!({"max_tokens": 8, "temperature": 0.0, "messages": [{"role": "user",
        "content": [{"type": "text", "text": "Describe this."},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": b64(&image(a))}}]}]});
    let (status, v) = post(g.port, "/v1/messages", &body);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["content"][0]["text"], want, "messages: {v}");

    // Qwen3-VL, gemma4 and Qwen3.5: image entries first (the CLI's layout) gives the
    // goldens' answers; the client's order is kept, so text-then-image is another prompt.
    let more = ["tiny-gemma4-vl", "tiny-qwen3-5-vl"].map(common::vision::assembled);
    let more_servers = std::thread::scope(|s| {
        let started = more
            .each_ref()
            .map(|d| s.spawn(|| serve_dir(d.path(), &[])));
        started.map(|h| h.join().unwrap())
    });
    let models = [
        ("tiny-qwen3-vl-vision", qwen.path(), q.port),
        ("tiny-gemma4-vl", more[0].path(), more_servers[0].port),
        ("tiny-qwen3-5-vl", more[1].path(), more_servers[1].port),
    ];
    for (model, dir, port) in models {
        for (n, content) in [
            (1, json!([url_part(a), text])),
            (2, json!([url_part(a), url_part(b), text])),
        ] {
            let case = generate_case(model, n);
            let (got, _, prompt_tokens, _) = answer(port, content);
            assert_eq!(got, golden_tokens(dir, &case), "{model}, {n} image(s)");
            assert_eq!(
                prompt_tokens as usize,
                case["prompt_ids"].as_array().unwrap().len()
            );
        }
    }
    let image_first = answer(q.port, json!([url_part(a), text])).3;
    let text_first = |port| answer(port, json!([text, url_part(a)])).3;
    assert_ne!(
        text_first(q.port),
        image_first,
        "the client's part order was not kept"
    );
    assert_eq!(
        text_first(planted_order.port),
        image_first,
        "planted ServedImageEntriesFirst: not caught"
    );

    // The prompt cache (gemma3, Qwen3-VL; the SSD tier on Qwen3-VL); planted ids-only keys
    // caught on gemma3.
    prompt_cache_claims(g.port, uncached.port, Some(planted_cache.port));
    prompt_cache_claims(q.port, uncached_q.port, None);
    ssd_tier_claims(qwen.path(), uncached_q.port);

    // The batch lane: image rows answer as on the serial lane, beside text rows, and keep
    // their prompts in the prompt cache.
    let case = generate_case("tiny-gemma3-vl", 2);
    let port = batched.port;
    let text_row = std::thread::spawn(move || {
        let body = json!({"max_tokens": 64, "messages": [{"role": "user", "content": "Hi"}]});
        post(port, "/v1/chat/completions", &body)
    });
    let got = answer(port, json!([text, url_part(a), url_part(b)])).0;
    assert_eq!(
        got,
        golden_tokens(gemma.path(), &case),
        "gemma3 in the batch lane"
    );
    assert_eq!(text_row.join().unwrap().0, 200);
    let lanes = &common::server::stats(port)["lanes"];
    assert_eq!(
        (&lanes["batch_slots"], &lanes["serial_reason"]),
        (&json!(4), &Value::Null)
    );
    prompt_cache_claims(port, uncached.port, None);

    // The server goes on answering text.
    let (status, v) = post(g.port, "/v1/chat/completions", &common::server::ask("Hi"));
    assert_eq!(status, 200, "{v}");
}
