//! An `engine serve` process on a free loopback port, and raw HTTP/1.1 to it: what the
//! server tests share.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::Value;

/// A running server; killed when dropped.
pub struct Server {
    pub child: Child,
    pub port: u16,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `engine serve --model goldens/models/<name> --port 0 <extra>`, once it has printed the
/// address it listens on.
pub fn serve_model(name: &str, extra: &[&str]) -> Server {
    serve_dir(&super::goldens().join("models").join(name), extra)
}

/// The engine binary under test: this build's, or `ENGINE_BIN` (how a test is shown to
/// fail on an older build).
pub fn engine_bin() -> String {
    std::env::var("ENGINE_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_engine").to_owned())
}

pub fn serve_dir(model: &std::path::Path, extra: &[&str]) -> Server {
    serve_dir_with_env(model, extra, &[])
}

/// `serve_dir` with these environment variables set in the server (e.g. ENGINE_PLANT).
pub fn serve_dir_with_env(model: &std::path::Path, extra: &[&str], env: &[(&str, &str)]) -> Server {
    let mut child = Command::new(engine_bin())
        .args(["serve", "--model", model.to_str().unwrap(), "--port", "0"])
        .args(extra)
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let port = line
        .trim()
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no address in `{line}`"));
    Server { child, port }
}

/// One HTTP/1.1 request (Connection: close) with the headers a JSON client sends; returns
/// status and the de-chunked body.
pub fn http(port: u16, method: &str, path: &str, body: &[u8]) -> (u16, String) {
    let (status, _, body) = http_with(
        port,
        method,
        path,
        &["Host: localhost", "Content-Type: application/json"],
        body,
    );
    (status, body)
}

/// One HTTP/1.1 request with exactly these header lines (plus Content-Length and
/// Connection: close); returns status, the response's header block (lowercase) and its
/// body.
pub fn http_with(
    port: u16,
    method: &str,
    path: &str,
    headers: &[&str],
    body: &[u8],
) -> (u16, String, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(180))).unwrap();
    let mut head = format!("{method} {path} HTTP/1.1\r\n");
    for h in headers {
        head.push_str(h);
        head.push_str("\r\n");
    }
    head.push_str(&format!(
        "Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    ));
    s.write_all(head.as_bytes()).unwrap();
    let _ = s.write_all(body);
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (headers, rest) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = headers
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = if headers
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(rest)
    } else {
        rest.to_owned()
    };
    (status, headers.to_ascii_lowercase(), body)
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        s = rest[n..].trim_start_matches("\r\n");
    }
    out
}

/// POSTs JSON; the answer parsed (or the raw text as a JSON string).
pub fn post(port: u16, path: &str, body: &Value) -> (u16, Value) {
    let (status, text) = http(port, "POST", path, body.to_string().as_bytes());
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

pub fn stats(port: u16) -> Value {
    serde_json::from_str(&http(port, "GET", "/stats", b"").1).unwrap()
}

/// Waits (polling /stats, up to `limit`) until `done` holds; fails naming `what`, with
/// the last stats, if not.
pub fn wait_for(port: u16, what: &str, limit: Duration, done: impl Fn(&Value) -> bool) -> Value {
    let start = std::time::Instant::now();
    loop {
        let st = stats(port);
        if done(&st) {
            return st;
        }
        assert!(
            start.elapsed() < limit,
            "{what}: not within {limit:?}: {st}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A one-user-turn chat body.
pub fn ask(content: &str) -> Value {
    serde_json::json!({"model": "m", "messages": [{"role": "user", "content": content}]})
}

/// Sends `body` as a streamed /v1/completions request on a raw connection (nothing read).
pub fn send_stream(port: u16, body: &Value) -> TcpStream {
    let mut conn = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let body = body.to_string();
    write!(
        conn,
        "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    conn
}

/// Fails on a source location or a build machine's path in a response's text: those say
/// where we were built, nothing a client can act on.
pub fn assert_no_source_paths(text: &str) {
    for needle in [".rs:", ".cpp:", "/root/", "/home/", "/Users/", ".cargo"] {
        assert!(
            !text.contains(needle),
            "a source path in a response: {text}"
        );
    }
}
