//! The chat page end to end in headless Chromium (Debian's `chromium`, or $CHROMIUM;
//! `scripts/test.sh` installs it), driven over the DevTools protocol (headless_chrome): a
//! live `engine serve` on the trained tiny model, the page loaded with a first message in
//! its link (#/chat?q=…); the page's own JavaScript sends it and streams the answer. The
//! test waits for the page to mark the answer finished (a DOM condition, with a timeout),
//! then for the server's counters to show one completed chat request with tokens, and
//! saves a screenshot of the finished exchange (target/e2e/chat.png). Planted: a page
//! that posts to a wrong path must fail the same checks.

use headless_chrome::protocol::cdp::Page;
use headless_chrome::{Browser, LaunchOptions};
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

mod common;
use common::server::{serve_model, stats};

/// How long the page may take to finish its answer (the tiny model needs well under 1 s).
const ANSWER_TIMEOUT: Duration = Duration::from_secs(60);

fn chromium() -> PathBuf {
    let path = std::env::var_os("CHROMIUM")
        .map(PathBuf::from)
        .or_else(|| which_chromium("chromium"))
        .or_else(|| which_chromium("chromium-browser"));
    path.expect(
        "headless Chromium is needed for this test: install Debian's chromium (`apt-get install -y chromium`, as scripts/test.sh does) or set CHROMIUM",
    )
}

fn which_chromium(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(name))
            .find(|p| p.is_file())
    })
}

/// What a finished page shows: its answer text and the server's counters.
struct Finished {
    answer: String,
    stats: serde_json::Value,
}

/// Loads the chat page with a first message, waits until the page marks its answer done,
/// checks it, saves a screenshot at `shot`. `plant_wrong_path` makes the page post its chat
/// request to a path the server does not serve (the planted defect).
fn run_page(plant_wrong_path: bool, shot: &Path) -> Result<Finished, String> {
    let e = |e: &dyn std::fmt::Display| e.to_string();
    let server = serve_model("tiny-llama-trained", &["--no-open"]);
    let browser = Browser::new(LaunchOptions {
        path: Some(chromium()),
        headless: true,
        // Root in a container: Chromium's sandbox needs user namespaces it may not have.
        sandbox: false,
        window_size: Some((900, 500)),
        args: vec![OsStr::new("--disable-quic")],
        ..LaunchOptions::default()
    })
    .map_err(|x| format!("starting chromium: {x}"))?;
    let tab = browser.new_tab().map_err(|x| e(&x))?;
    if plant_wrong_path {
        // Runs before the page's own script: every fetch of the chat endpoint goes astray.
        tab.call_method(Page::AddScriptToEvaluateOnNewDocument {
            source: r#"const realFetch = window.fetch;
window.fetch = (url, init) => realFetch(url === "/v1/chat/completions" ? "/v1/chat/complete" : url, init);"#
                .into(),
            world_name: None,
            include_command_line_api: None,
            run_immediately: None,
        })
        .map_err(|x| e(&x))?;
    }
    let url = format!(
        "http://127.0.0.1:{}/#/chat?q=What%20color%20is%20the%20sky%3F",
        server.port
    );
    tab.navigate_to(&url)
        .and_then(|t| t.wait_until_navigated())
        .map_err(|x| format!("loading {url}: {x}"))?;
    // The page sets data-done on the assistant's message once its request has ended
    // (answer complete, error or abort) and drops data-streaming.
    let done = tab
        .wait_for_element_with_custom_timeout(".msg.assistant[data-done]", ANSWER_TIMEOUT)
        .map_err(|x| {
            let html = tab.get_content().unwrap_or_default();
            format!(
                "the page did not finish its answer within {ANSWER_TIMEOUT:?} ({x}); page: {html}"
            )
        })?;
    let answer = done.get_inner_text().map_err(|x| e(&x))?;
    let class = done
        .get_attribute_value("class")
        .map_err(|x| e(&x))?
        .unwrap_or_default();
    let shot_png = tab
        .capture_screenshot(Page::CaptureScreenshotFormatOption::Png, None, None, true)
        .map_err(|x| e(&x))?;
    std::fs::write(shot, &shot_png).map_err(|x| e(&x))?;
    if class.split(' ').any(|c| c == "error") {
        return Err(format!("the page's answer is an error: {answer}"));
    }
    if answer.trim().is_empty() {
        return Err("the page finished with an empty answer".into());
    }
    // The server counts a request completed just after its last token went out (it stores
    // the prompt-cache entry first), so the page can finish before the counter moves.
    let deadline = Instant::now() + Duration::from_secs(10);
    let stats = loop {
        let stats = stats(server.port);
        if stats["completed"] == 1 {
            break stats;
        }
        if Instant::now() > deadline {
            return Err(format!("the page's chat request did not complete: {stats}"));
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    if stats["completion_tokens"].as_u64().unwrap_or(0) < 3 {
        return Err(format!("too few tokens streamed: {stats}"));
    }
    Ok(Finished { answer, stats })
}

fn e2e_dir() -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/e2e");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn the_chat_page_streams_an_answer_in_chromium() {
    let shot = e2e_dir().join("chat.png");
    let _ = std::fs::remove_file(&shot);
    let done = run_page(false, &shot).unwrap_or_else(|e| panic!("{e}"));
    println!("the page's answer: {:?}", done.answer);
    println!("server after the page's request: {}", done.stats);
    let png = std::fs::read(&shot).unwrap();
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 5_000,
        "screenshot missing or blank"
    );
    println!("screenshot: {}", shot.display());
}

#[test]
fn a_page_posting_to_a_wrong_path_is_caught() {
    let shot = e2e_dir().join("chat-planted.png");
    let err = match run_page(true, &shot) {
        Ok(done) => panic!("planted defect not caught: {:?}", done.answer),
        Err(err) => err,
    };
    assert!(err.contains("is an error"), "{err}");
    println!("caught: {err}");
}
