//! The chat page end to end in headless Chromium (Debian's `chromium`; `.ci/run` installs
//! it): a live `engine serve` on the trained tiny model, the page loaded with a first
//! message in its link (#/chat?q=…), the page's own JavaScript sends it and streams the
//! answer; the server's counters show one streamed chat request completed with tokens, and
//! the screenshot (target/e2e/chat.png) shows the exchange.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn chromium() -> PathBuf {
    let path = std::env::var_os("CHROMIUM")
        .map_or_else(|| PathBuf::from("/usr/bin/chromium"), PathBuf::from);
    assert!(
        path.exists(),
        "headless Chromium is needed for this test: install Debian's chromium (`apt-get install -y chromium`, as .ci/run does) or set CHROMIUM"
    );
    path
}

fn get(port: u16, path: &str) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out.split("\r\n\r\n").nth(1).unwrap_or_default().to_owned()
}

#[test]
fn the_chat_page_streams_an_answer_in_chromium() {
    let browser = chromium();
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("../goldens/models/tiny-llama-trained");
    let mut server = Command::new(env!("CARGO_BIN_EXE_engine"))
        .args(["serve", "--no-open", "--port", "0", "--model"])
        .arg(&model)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(server.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let port: u16 = line.trim().rsplit(':').next().unwrap().parse().unwrap();
    let out_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/e2e");
    std::fs::create_dir_all(&out_dir).unwrap();
    let shot = out_dir.join("chat.png");
    let _ = std::fs::remove_file(&shot);
    let profile = tempfile::tempdir().unwrap();
    let url = format!("http://127.0.0.1:{port}/#/chat?q=What%20color%20is%20the%20sky%3F");
    let run = Command::new(&browser)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--virtual-time-budget=10000",
            "--window-size=900,500",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .arg(format!("--screenshot={}", shot.display()))
        .arg(&url)
        .output()
        .unwrap();
    let stats = get(port, "/stats");
    let _ = server.kill();
    let _ = server.wait();
    assert!(
        run.status.success(),
        "chromium failed: {}",
        String::from_utf8_lossy(&run.stderr)
    );
    let stats: serde_json::Value = serde_json::from_str(&stats).unwrap();
    println!("server after the page's request: {stats}");
    assert_eq!(
        stats["completed"], 1,
        "the page's chat request did not complete: {stats}"
    );
    assert!(stats["completion_tokens"].as_u64().unwrap() >= 3, "{stats}");
    let png = std::fs::read(&shot).unwrap();
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 5_000,
        "screenshot missing or blank"
    );
    println!("screenshot: {}", shot.display());
}
