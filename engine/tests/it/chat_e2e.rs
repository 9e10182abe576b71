//! The chat page end to end in headless Chromium (Debian's `chromium`, or $CHROMIUM;
//! `scripts/test.sh` installs it), driven over the DevTools protocol by our own client
//! (chat_e2e/cdp.rs: `--remote-debugging-pipe`).
//!
//! Live: an `engine serve` on the trained tiny model, the page loaded with a first message
//! in its link (#/chat?q=…); the page's own JavaScript sends it and streams the answer.
//! The test waits for the page to mark the answer finished (a DOM condition, with a
//! timeout), then for the server's counters to show one completed chat request with
//! tokens, and saves a screenshot of the finished exchange (target/e2e/chat.png).
//! Planted: a page that posts to a wrong path must fail the same checks.
//!
//! Canned (chat_e2e/canned.rs, chat_e2e/stream.rs): the page from the same server, its
//! chat requests answered by the test with what real models stream (reasoning, markdown
//! with code and HTML payloads, tool calls in pieces), the DOM checked: Thinking section,
//! code blocks, HTML shown as text and never run, tool call blocks, the settings sent,
//! copy, regenerate, the history, settings kept across a reload. Each check has a
//! planted page (the served page with one edit) that must fail it.
//!
//! Picker (chat_e2e/picker.rs): the model picker against a /v1/models list of the test's
//! own (a model, its adapter, an unloaded model): listed, grouped and marked, the choice
//! sent as `model`, kept over a reload, and a choice the server drops falling back to the
//! first entry with a notice; the live case checks the picker lists the real server's
//! entries and has the first chosen.
//!
//! Images (chat_e2e/attach.rs, live_image.rs; the cases in image_cases.rs): two images
//! picked (the file input's files and change event) and one dropped on the composer, one
//! removed with its ×, sent as a content list of exactly those bytes in order, shown in the
//! sent message, sent again by Regenerate; one pasted; a 400 refusing it shown naming it and
//! kept out of the next request; a non-image, an image over 20 MB and a 9th image named in a
//! notice. Live: an `engine serve` on tiny-gemma3-vl, the page sends a picked image with its
//! message and shows the model's answer, mlx-vlm's greedy one.
//!
//! Every case runs in one #[test] on one server, each case in a browser context of its
//! own, side by side on WORKERS Chromiums (one case at a time each).
//! Each case is a claim (named as a test would be), run whatever the others did; the test
//! fails naming every claim that did not hold.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::common;
use common::server::stats;

mod attach;
mod browser;
mod canned;
mod cdp;
mod image_cases;
mod live_image;
mod markdown;
mod picker;
mod stream;

use browser::{e2e_dir, http_models, js, wait_js_within, Fixture, Plant};

/// How long the page may take to finish its answer (the tiny model needs well under 1 s).
const ANSWER_TIMEOUT: Duration = Duration::from_secs(60);

/// What a finished page shows: its answer text and the server's counters.
struct Finished {
    answer: String,
    stats: serde_json::Value,
}

/// Loads the chat page with a first message, waits until the page marks its answer done,
/// checks it, saves a screenshot at `shot`. `plant_wrong_path` makes the page post its chat
/// request to a path the server does not serve (the planted defect). The server is
/// shared: its counters are read before, and the page's request must move them by one.
fn run_page(fx: &Fixture, plant_wrong_path: bool, shot: &Path) -> Result<Finished, String> {
    let server = fx.server;
    let before = stats(server.port);
    let count = |st: &serde_json::Value, key: &str| st[key].as_u64().unwrap_or(0);
    let case_tab = fx.tab((900, 500))?;
    let tab = &case_tab.0;
    if plant_wrong_path {
        // Runs before the page's own script: every fetch of the chat endpoint goes astray.
        tab.add_script(
            r#"const realFetch = window.fetch;
window.fetch = (url, init) => realFetch(url === "/v1/chat/completions" ? "/v1/chat/complete" : url, init);"#,
        )?;
    }
    let url = format!(
        "http://127.0.0.1:{}/#/chat?q=What%20color%20is%20the%20sky%3F",
        server.port
    );
    tab.navigate(&url)
        .map_err(|x| format!("loading {url}: {x}"))?;
    // The page sets data-done on the assistant's message once its request has ended
    // (answer complete, error or abort) and drops data-streaming.
    const DONE: &str = ".msg.assistant[data-done]";
    wait_js_within(
        tab,
        &format!("document.querySelector('{DONE}') !== null"),
        "the page to finish its answer",
        ANSWER_TIMEOUT,
    )
    .map_err(|x| {
        let html = js(tab, "document.documentElement.outerHTML").unwrap_or_default();
        let html = html.as_str().unwrap_or_default();
        format!("the page did not finish its answer within {ANSWER_TIMEOUT:?} ({x}); page: {html}")
    })?;
    let done = js(
        tab,
        &format!("(e => [e.innerText, e.className])(document.querySelector('{DONE}'))"),
    )?;
    let answer = done[0].as_str().unwrap_or_default().to_owned();
    let class = done[1].as_str().unwrap_or_default().to_owned();
    let shot_png = tab.screenshot_png()?;
    std::fs::write(shot, &shot_png).map_err(|x| x.to_string())?;
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
        if count(&stats, "completed") == count(&before, "completed") + 1 {
            break stats;
        }
        if Instant::now() > deadline {
            return Err(format!("the page's chat request did not complete: {stats}"));
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let tokens =
        count(&stats, "completion_tokens").saturating_sub(count(&before, "completion_tokens"));
    if tokens < 3 {
        return Err(format!(
            "too few tokens streamed: {tokens} (before the page: {before}; after: {stats})"
        ));
    }
    // The picker lists what the server lists, and sent the first entry (nothing was kept).
    let ids = http_models(server.port);
    let picker = js(
        tab,
        "[document.getElementById('model').value, Array.from(document.getElementById('model').options).map(o => o.value)]",
    )?;
    if picker != serde_json::json!([ids.first(), ids]) {
        return Err(format!(
            "the picker shows {picker}, want the server's /v1/models ids {ids:?}, the first chosen"
        ));
    }
    Ok(Finished { answer, stats })
}

fn the_chat_page_streams_an_answer_in_chromium(fx: &Fixture) {
    let shot = e2e_dir().join("chat.png");
    let _ = std::fs::remove_file(&shot);
    let done = run_page(fx, false, &shot).unwrap_or_else(|e| panic!("{e}"));
    println!("the page's answer: {:?}", done.answer);
    println!("server after the page's request: {}", done.stats);
    let png = std::fs::read(&shot).unwrap();
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 5_000,
        "screenshot missing or blank"
    );
    println!("screenshot: {}", shot.display());
}

fn a_page_posting_to_a_wrong_path_is_caught(fx: &Fixture) {
    let shot = e2e_dir().join("chat-planted.png");
    let err = match run_page(fx, true, &shot) {
        Ok(done) => panic!("planted defect not caught: {:?}", done.answer),
        Err(err) => err,
    };
    assert!(err.contains("is an error"), "{err}");
    println!("caught: {err}");
}

/// Runs the canned exchange on `plant`'s page and returns its outcome; the screenshot of
/// the first answer goes to target/e2e/`shot`.
fn canned_outcome(fx: &Fixture, plant: Option<&Plant>, shot: &str) -> canned::Outcome {
    canned::run(fx, plant, shot).unwrap_or_else(|e| panic!("the canned exchange did not run: {e}"))
}

fn the_chat_page_renders_what_real_models_stream(fx: &Fixture) {
    let out = canned_outcome(fx, None, "chat-canned.png");
    println!("{}", out.report());
    assert!(out.failed.is_empty(), "{}", out.report());
    assert_eq!(out.passed.len(), 9, "{}", out.report());
    println!(
        "screenshot: {}",
        e2e_dir().join("chat-canned.png").display()
    );
}

/// A planted page must fail `check` (others may fail too: printed); returns why it did.
fn planted_fails(fx: &Fixture, name: &str, check: &str, plant: Plant) -> String {
    let out = canned_outcome(fx, Some(&plant), &format!("chat-planted-{name}.png"));
    caught(&out, name, check)
}

/// Why a planted page's outcome failed `check` (its report printed); panics if it passed.
fn caught(out: &canned::Outcome, name: &str, check: &str) -> String {
    println!("{}", out.report());
    out.why(check).unwrap_or_else(|| {
        panic!(
            "planted defect ({name}) not caught by the {check} check:\n{}",
            out.report()
        )
    })
}

fn a_page_rendering_model_html_is_caught(fx: &Fixture) {
    // What a renderer that trusts the model's markup does: text goes in as HTML.
    let why = planted_fails(
        fx,
        "raw-html",
        "xss",
        Plant {
            from: "parent.appendChild(document.createTextNode(s));",
            to: "parent.insertAdjacentHTML(\"beforeend\", s);",
        },
    );
    // The payload did run there (its image's error handler set the flag).
    assert!(why.contains("window.__pwned is \"img\""), "{why}");
}

fn a_page_ignoring_reasoning_deltas_is_caught(fx: &Fixture) {
    let _ = planted_fails(
        fx,
        "no-reasoning",
        "reasoning",
        Plant {
            from: "delta.reasoning != null ? delta.reasoning : delta.reasoning_content",
            to: "delta.reasoning_content",
        },
    );
}

fn a_page_without_code_fences_is_caught(fx: &Fixture) {
    let _ = planted_fails(
        fx,
        "no-fences",
        "markdown",
        Plant {
            from: "const FENCE = /^( {0,3})(`{3,}|~{3,})",
            to: "const FENCE = /^( {0,3})(`{4,}|~{4,})",
        },
    );
}

fn a_page_keeping_only_the_last_argument_piece_is_caught(fx: &Fixture) {
    let _ = planted_fails(
        fx,
        "tool-arguments",
        "tools",
        Plant {
            from: "call.arguments += f.arguments;",
            to: "call.arguments = f.arguments;",
        },
    );
}

fn a_page_not_sending_its_settings_is_caught(fx: &Fixture) {
    let _ = planted_fails(
        fx,
        "settings-unsent",
        "request",
        Plant {
            from: "{ model: modelId, messages: history, stream: true }, settings()",
            to: "{ model: modelId, messages: history, stream: true }, {}",
        },
    );
}

fn a_page_regenerating_with_the_old_answer_in_history_is_caught(fx: &Fixture) {
    let _ = planted_fails(
        fx,
        "regenerate-keeps-answer",
        "regenerate",
        Plant {
            from: "  messages.pop();\n  wrap.remove();",
            to: "  wrap.remove();",
        },
    );
}

fn a_page_forgetting_its_settings_is_caught(fx: &Fixture) {
    let _ = planted_fails(
        fx,
        "settings-not-kept",
        "persist",
        Plant {
            from: "localStorage.setItem(SETTINGS_KEY, JSON.stringify(s));",
            to: "void s;",
        },
    );
}

/// Runs the picker's checks on `plant`'s page (None: the served page), up to `last`.
fn picker_outcome(fx: &Fixture, plant: Option<&Plant>, last: Option<&str>) -> canned::Outcome {
    picker::run(fx, plant, last).unwrap_or_else(|e| panic!("the picker case did not run: {e}"))
}

fn the_picker_lists_every_model_and_sends_the_choice(fx: &Fixture) {
    let out = picker_outcome(fx, None, None);
    println!("{}", out.report());
    assert!(out.failed.is_empty(), "{}", out.report());
    assert_eq!(out.passed.len(), 4, "{}", out.report());
}

/// A planted page must fail the picker's `check`; returns why it did.
fn picker_plant_fails(fx: &Fixture, check: &str, plant: Plant) -> String {
    caught(
        &picker_outcome(fx, Some(&plant), Some(check)),
        "picker",
        check,
    )
}

fn a_page_ignoring_its_picker_is_caught(fx: &Fixture) {
    // The choice is shown but never taken: requests keep naming the first entry.
    let why = picker_plant_fails(
        fx,
        "sent",
        Plant {
            from: "  choose(picker.value);\n",
            to: "  void 0;\n",
        },
    );
    assert!(why.contains("named the model"), "{why}");
}

fn a_page_forgetting_its_model_is_caught(fx: &Fixture) {
    let _ = picker_plant_fails(
        fx,
        "kept",
        Plant {
            from: "localStorage.setItem(MODEL_KEY, id);",
            to: "void id;",
        },
    );
}

fn a_silent_model_fallback_is_caught(fx: &Fixture) {
    let why = picker_plant_fails(
        fx,
        "fallback",
        Plant {
            from: "notice.hidden = false;",
            to: "notice.hidden = true;",
        },
    );
    assert!(why.contains("no visible notice"), "{why}");
}

fn the_thinking_section_is_open_while_streaming_and_closed_after(fx: &Fixture) {
    stream::run(fx, None).unwrap_or_else(|e| panic!("{e}"));
    println!(
        "screenshot: {}",
        e2e_dir().join("chat-stream.png").display()
    );
}

fn a_thinking_section_that_never_closes_is_caught(fx: &Fixture) {
    let plant = Plant {
        from: "view.thinking.open = false;",
        to: "view.thinking.open = true;",
    };
    let err = stream::run(fx, Some(&plant)).expect_err("planted defect not caught");
    assert!(err.contains("to close once the answer starts"), "{err}");
    println!("caught: {err}");
}

fn a_thinking_section_closed_while_streaming_is_caught(fx: &Fixture) {
    let plant = Plant {
        from: "view.thinking.open = true;",
        to: "view.thinking.open = false;",
    };
    let err = stream::run(fx, Some(&plant)).expect_err("planted defect not caught");
    assert!(err.contains("open while the model reasons"), "{err}");
    println!("caught: {err}");
}

fn the_markdown_renderer_matches_its_table(fx: &Fixture) {
    let bad = markdown::mismatches(fx, None).unwrap_or_else(|e| panic!("{e}"));
    for (md, want, got) in &bad {
        println!("{md:?}\n  want {want}\n  got  {got}");
    }
    assert!(
        bad.is_empty(),
        "{} of {} cases differ",
        bad.len(),
        markdown::CASES.len()
    );
    println!("{} cases rendered as expected", markdown::CASES.len());
}

fn a_renderer_linking_any_scheme_is_caught(fx: &Fixture) {
    let plant = Plant {
        // A renderer that links whatever URL the model writes.
        from: r#"if (!/^https?:\/\//i.test(raw)) return null;
  try {
    const u = new URL(raw);
    return u.protocol === "http:" || u.protocol === "https:" ? u.href : null;"#,
        to: r#"try {
    const u = new URL(raw);
    return u.href;"#,
    };
    let bad = markdown::mismatches(fx, Some(&plant)).unwrap_or_else(|e| panic!("{e}"));
    assert!(
        bad.iter()
            .any(|(md, _, got)| md.contains("javascript:") && got.contains("href=\"javascript:")),
        "planted defect not caught: {bad:?}"
    );
    println!("caught: {bad:?}");
}

/// A claim, and the case that shows it (panics when it does not hold).
type Case = (&'static str, fn(&Fixture));

/// Every case, longest first after the live model's so that the workers finish together.
/// Only the first case's page reaches the server's chat endpoint (the planted one posts
/// to a path the server does not serve, the others' chat requests are answered by the
/// test in the browser), so its request alone moves the server's counters.
const CASES: &[Case] = &[
    (
        "the_chat_page_streams_an_answer_in_chromium",
        the_chat_page_streams_an_answer_in_chromium,
    ),
    (
        "a_page_posting_to_a_wrong_path_is_caught",
        a_page_posting_to_a_wrong_path_is_caught,
    ),
    (
        "the_page_sends_an_image_to_a_vision_model_and_shows_its_answer",
        image_cases::the_page_sends_an_image_to_a_vision_model_and_shows_its_answer,
    ),
    (
        "a_page_sending_the_image_before_the_text_is_caught_by_the_vision_model",
        image_cases::a_page_sending_the_image_before_the_text_is_caught_by_the_vision_model,
    ),
    (
        "the_page_attaches_images_and_sends_them_in_order",
        image_cases::the_page_attaches_images_and_sends_them_in_order,
    ),
    (
        "the_chat_page_renders_what_real_models_stream",
        the_chat_page_renders_what_real_models_stream,
    ),
    (
        "a_page_attaching_any_file_is_caught",
        image_cases::a_page_attaching_any_file_is_caught,
    ),
    (
        "a_page_resending_a_refused_image_is_caught",
        image_cases::a_page_resending_a_refused_image_is_caught,
    ),
    (
        "a_page_hiding_the_servers_refusal_is_caught",
        image_cases::a_page_hiding_the_servers_refusal_is_caught,
    ),
    (
        "a_page_dropping_images_from_its_history_is_caught",
        image_cases::a_page_dropping_images_from_its_history_is_caught,
    ),
    (
        "a_sent_message_without_its_thumbnails_is_caught",
        image_cases::a_sent_message_without_its_thumbnails_is_caught,
    ),
    (
        "a_page_sending_images_out_of_order_is_caught",
        image_cases::a_page_sending_images_out_of_order_is_caught,
    ),
    (
        "a_remove_button_dropping_the_last_image_is_caught",
        image_cases::a_remove_button_dropping_the_last_image_is_caught,
    ),
    (
        "a_page_ignoring_pasted_images_is_caught",
        image_cases::a_page_ignoring_pasted_images_is_caught,
    ),
    (
        "a_page_taking_drops_on_the_text_box_only_is_caught",
        image_cases::a_page_taking_drops_on_the_text_box_only_is_caught,
    ),
    (
        "a_picker_taking_only_the_first_file_is_caught",
        image_cases::a_picker_taking_only_the_first_file_is_caught,
    ),
    (
        "a_page_rendering_model_html_is_caught",
        a_page_rendering_model_html_is_caught,
    ),
    (
        "a_page_ignoring_reasoning_deltas_is_caught",
        a_page_ignoring_reasoning_deltas_is_caught,
    ),
    (
        "a_page_without_code_fences_is_caught",
        a_page_without_code_fences_is_caught,
    ),
    (
        "a_page_keeping_only_the_last_argument_piece_is_caught",
        a_page_keeping_only_the_last_argument_piece_is_caught,
    ),
    (
        "a_page_not_sending_its_settings_is_caught",
        a_page_not_sending_its_settings_is_caught,
    ),
    (
        "a_page_regenerating_with_the_old_answer_in_history_is_caught",
        a_page_regenerating_with_the_old_answer_in_history_is_caught,
    ),
    (
        "a_page_forgetting_its_settings_is_caught",
        a_page_forgetting_its_settings_is_caught,
    ),
    (
        "the_picker_lists_every_model_and_sends_the_choice",
        the_picker_lists_every_model_and_sends_the_choice,
    ),
    (
        "a_page_ignoring_its_picker_is_caught",
        a_page_ignoring_its_picker_is_caught,
    ),
    (
        "a_page_forgetting_its_model_is_caught",
        a_page_forgetting_its_model_is_caught,
    ),
    (
        "a_silent_model_fallback_is_caught",
        a_silent_model_fallback_is_caught,
    ),
    (
        "the_thinking_section_is_open_while_streaming_and_closed_after",
        the_thinking_section_is_open_while_streaming_and_closed_after,
    ),
    (
        "a_thinking_section_that_never_closes_is_caught",
        a_thinking_section_that_never_closes_is_caught,
    ),
    (
        "a_thinking_section_closed_while_streaming_is_caught",
        a_thinking_section_closed_while_streaming_is_caught,
    ),
    (
        "the_markdown_renderer_matches_its_table",
        the_markdown_renderer_matches_its_table,
    ),
    (
        "a_renderer_linking_any_scheme_is_caught",
        a_renderer_linking_any_scheme_is_caught,
    ),
];

/// What a case's panic said.
fn panic_text(payload: Box<dyn std::any::Any + Send>) -> String {
    match payload.downcast::<String>() {
        Ok(s) => *s,
        Err(payload) => payload
            .downcast_ref::<&str>()
            .map_or_else(|| "a panic without a message".into(), |s| s.to_string()),
    }
}

/// How many Chromiums run the cases at once (each case waits on DevTools round trips far
/// more than it computes): with the image cases, 5 took a run from ≈50 s to ≈42 s on 2
/// cores, under the old DevTools crate; on our pipe client (`cdp.rs`) a run takes ≈19–24 s
/// with 5, not re-tuned since.
const WORKERS: usize = 5;

/// Runs `case`, returning what its panic said if it did not hold.
fn run_case(fx: &Fixture, (claim, case): &Case) -> Result<(), String> {
    let t = Instant::now();
    let outcome = catch_unwind(AssertUnwindSafe(|| case(fx)));
    let verdict = if outcome.is_ok() { "ok" } else { "FAILED" };
    println!("{claim}: {verdict} in {:.2?}", t.elapsed());
    outcome.map_err(|payload| format!("{claim}: {}", panic_text(payload)))
}

#[test]
fn the_chat_page_holds_every_claim_and_each_planted_page_is_caught() {
    let start = Instant::now();
    let server = browser::server();
    let (next, failed) = (AtomicUsize::new(0), Mutex::new(Vec::new()));
    std::thread::scope(|scope| {
        for _ in 0..WORKERS {
            let (server, next, failed) = (&server, &next, &failed);
            scope.spawn(move || {
                let fx = Fixture::start(server).unwrap_or_else(|e| panic!("{e}"));
                while let Some(case) = CASES.get(next.fetch_add(1, Ordering::SeqCst)) {
                    if let Err(why) = run_case(&fx, case) {
                        failed.lock().unwrap().push(why);
                    }
                }
            });
        }
    });
    let failed = failed.into_inner().unwrap();
    println!("{} cases in {:.2?}", CASES.len(), start.elapsed());
    assert!(
        failed.is_empty(),
        "{} of {} claims failed:\n{}",
        failed.len(),
        CASES.len(),
        failed.join("\n")
    );
}
