//! Images in requests, over HTTP (docs/vision.md, "Images in requests"): every API reads
//! its image parts, checks each image (source, bytes, size) and answers a clear 400 naming
//! the part; a text model refuses checked images, naming why; the server keeps answering.
//! `--allow-local-files DIR` reads files under DIR only. Planted: `ImageOutsideAllowedDir`
//! (a `..` path out of DIR is read).

use base64::Engine as _;
use serde_json::{json, Value};

use crate::common;
use crate::common::server::{post, serve_dir_with_env, Server};

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
