//! The chat page fed canned answers (what real models stream through mlx_lm.server's
//! shapes): reasoning deltas, markdown with a code block and HTML payloads, tool-call
//! deltas whose arguments come in pieces. Each check has a name; a run collects the
//! names of the checks that failed, so a planted page can be shown to fail its own.

use serde_json::{json, Value};

use super::browser::{js, sse, wait_js, CannedPage, Fixture, Plant};

/// The reasoning the first answer streams, in pieces.
const REASONING: [&str; 3] = [
    "The user says hello. ",
    "I will answer with <b>markdown</b>, ",
    "code and two tool calls.",
];

/// The code block's text (HTML in code is text too).
const CODE: &str = r#"print("<script>window.__pwned = 'code'</script>")"#;

/// HTML a model might write, that must be shown as text and never run.
const SCRIPT_PAYLOAD: &str = "<script>window.__pwned = 'script'</script>";
const IMG_PAYLOAD: &str = r#"<img src="x" onerror="window.__pwned = 'img'">"#;

fn answer_markdown() -> String {
    format!(
        "Here is **bold**, *italic* and `inline <i>code</i>`.\n\n```python\n{CODE}\n```\n\n\
         {SCRIPT_PAYLOAD} {IMG_PAYLOAD} [a link](https://example.com/docs) and \
         [bad](javascript:window.__pwned='link')\n\n- one\n- two\n\n| a | b |\n|---|---|\n| 1 | 2 |\n"
    )
}

/// The first answer: reasoning, then the markdown in 7-character pieces (the fence
/// arrives split), then two tool calls (the first's arguments in pieces, OpenAI's
/// streaming shape; the second whole, mlx_lm.server's), finish_reason "tool_calls".
pub fn first_answer() -> String {
    let mut deltas: Vec<Value> = REASONING
        .iter()
        .map(|r| json!({"role": "assistant", "reasoning": r}))
        .collect();
    let md: Vec<char> = answer_markdown().chars().collect();
    deltas.extend(
        md.chunks(7)
            .map(|c| json!({"content": c.iter().collect::<String>()})),
    );
    let call = |v: Value| json!({"tool_calls": [v]});
    deltas.push(call(json!({"index": 0, "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": ""}})));
    deltas.push(call(
        json!({"index": 0, "function": {"arguments": "{\"city\": \"Pa"}}),
    ));
    deltas.push(call(
        json!({"index": 0, "function": {"arguments": "ris\", \"days\": 3}"}}),
    ));
    deltas.push(call(json!({"index": 1, "id": "call_2", "type": "function",
        "function": {"name": "get_time", "arguments": "{\"tz\": \"Europe/Paris\"}"}})));
    sse(&deltas, "tool_calls")
}

pub const SECOND: &str = "Second answer.";

pub fn second_answer() -> String {
    sse(&[json!({"role": "assistant", "content": SECOND})], "stop")
}

/// The settings the test types in.
const SYSTEM: &str = "You are terse.";
const TEMPERATURE: &str = "0.3";
const MAX_TOKENS: &str = "77";
const FIRST: &str = "Hello there";
const FOLLOW_UP: &str = "Thanks";

/// Names of the checks that failed, each with why.
#[derive(Default)]
pub struct Outcome {
    pub failed: Vec<(String, String)>,
    pub passed: Vec<String>,
}

impl Outcome {
    pub fn check(&mut self, name: &str, r: Result<(), String>) {
        match r {
            Ok(()) => self.passed.push(name.into()),
            Err(e) => self.failed.push((name.into(), e)),
        }
    }

    /// Why the check `name` failed, if it did.
    pub fn why(&self, name: &str) -> Option<String> {
        self.failed
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, why)| why.clone())
    }

    pub fn report(&self) -> String {
        let mut s = format!("passed: {:?}", self.passed);
        for (n, e) in &self.failed {
            s += &format!("\nFAILED {n}: {e}");
        }
        s
    }
}

fn ensure(ok: bool, what: impl FnOnce() -> String) -> Result<(), String> {
    if ok {
        Ok(())
    } else {
        Err(what())
    }
}

fn js_eq(page: &CannedPage, expr: &str, want: Value) -> Result<(), String> {
    let got = js(&page.tab, expr)?;
    ensure(got == want, || format!("`{expr}` is {got}, want {want}"))
}

fn click(page: &CannedPage, selector: &str) -> Result<(), String> {
    super::browser::click(&page.tab, selector)
}

fn type_into(page: &CannedPage, selector: &str, text: &str) -> Result<(), String> {
    super::browser::type_into(&page.tab, selector, text)
}

/// Opens the settings, types them, sends the first message, waits for its answer.
fn ask_first(page: &CannedPage) -> Result<(), String> {
    click(page, "#settings-toggle")?;
    type_into(page, "#set-system", SYSTEM)?;
    type_into(page, "#set-temperature", TEMPERATURE)?;
    type_into(page, "#set-max-tokens", MAX_TOKENS)?;
    type_into(page, "#input", FIRST)?;
    page.tab.press_key("Enter")?;
    wait_js(
        &page.tab,
        "document.querySelectorAll('.msg.assistant[data-done]').length === 1",
        "the first answer to finish",
    )
}

/// Every check of the canned exchange, on `plant`'s page (None: the served page), in a
/// tab of `fx`'s browser. Saves a screenshot of the first answer as `shot` (under
/// target/e2e).
pub fn run(fx: &Fixture, plant: Option<&Plant>, shot: &str) -> Result<Outcome, String> {
    let page = CannedPage::start(
        fx,
        plant,
        vec![first_answer(), second_answer()],
        (1200, 1000),
    )?;
    page.open("")?;
    let mut out = Outcome::default();
    ask_first(&page)?;
    out.check("request", check_request(&page));
    out.check("reasoning", check_reasoning(&page));
    out.check("markdown", check_markdown(&page));
    out.check("xss", check_xss(&page));
    out.check("tools", check_tools(&page));
    out.check("copy", check_copy(&page));
    page.screenshot(shot)?;
    out.check("regenerate", check_regenerate(&page));
    out.check("history", check_history(&page));
    out.check("persist", check_persist(&page));
    let errors = page.intercept_errors();
    if !errors.is_empty() {
        return Err(format!("the interception failed: {errors:?}"));
    }
    Ok(out)
}

fn check_request(page: &CannedPage) -> Result<(), String> {
    let requests = page.requests();
    let body = requests
        .first()
        .ok_or("no chat request reached the server")?;
    let model = js(&page.tab, "document.getElementById('model').value")?;
    let want = json!({
        "model": model,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": FIRST}],
        "stream": true,
        "temperature": 0.3,
        "max_tokens": 77,
    });
    ensure(body == &want, || {
        format!("the request was {body}, want {want}")
    })
}

/// Facts the page's DOM shows, read in one evaluation (each CDP call costs a round trip);
/// `facts` is a JavaScript object literal over `m`, the first assistant message.
fn facts(page: &CannedPage, facts: &str) -> Result<Value, String> {
    js(
        &page.tab,
        &format!("(m => ({facts}))(document.querySelector('.msg.assistant'))"),
    )
}

fn facts_eq(page: &CannedPage, expr: &str, want: Value) -> Result<(), String> {
    let got = facts(page, expr)?;
    ensure(got == want, || format!("the page shows {got}, want {want}"))
}

fn check_reasoning(page: &CannedPage) -> Result<(), String> {
    facts_eq(
        page,
        "{ sections: m.querySelectorAll('details.thinking').length, \
           text: (m.querySelector('details.thinking .reasoning') || {}).textContent, \
           open: (m.querySelector('details.thinking') || {}).open, \
           in_answer: m.querySelector('.content').textContent.includes('The user says hello') }",
        json!({"sections": 1, "text": REASONING.concat(), "open": false, "in_answer": false}),
    )?;
    click(page, ".msg.assistant details.thinking summary")?;
    wait_js(
        &page.tab,
        "document.querySelector('.msg.assistant details.thinking').open === true",
        "the Thinking section to open when its summary is clicked",
    )
}

fn check_markdown(page: &CannedPage) -> Result<(), String> {
    let all = |sel: &str| {
        format!("Array.from(m.querySelectorAll('.content {sel}')).map(e => e.textContent)")
    };
    facts_eq(
        page,
        &format!(
            "{{ code: {}, code_class: {}, copy_buttons: m.querySelectorAll('.content .code .code-bar button.copy').length, \
               strong: {}, em: {}, inline_code: {}, items: {}, cells: {} }}",
            all("pre > code"),
            "Array.from(m.querySelectorAll('.content pre > code')).map(e => e.className)",
            all("p strong"),
            all("p em"),
            all("p > code"),
            all("ul > li"),
            all("table th, .content table td"),
        ),
        json!({
            "code": [CODE], "code_class": ["language-python"], "copy_buttons": 1,
            "strong": ["bold"], "em": ["italic"], "inline_code": ["inline <i>code</i>"],
            "items": ["one", "two"], "cells": ["a", "b", "1", "2"],
        }),
    )
}

/// The HTML payloads are shown as text and none ran: no script, img, iframe or event
/// handler attribute in the log, the flag they would set is unset (read once any image
/// the page made has finished loading or failing: its error handler has run by then),
/// the javascript: link is text, the https link a link that opens apart.
fn check_xss(page: &CannedPage) -> Result<(), String> {
    wait_js(
        &page.tab,
        "Array.from(document.querySelectorAll('#log img')).every(i => i.complete)",
        "the images in the log to settle",
    )?;
    let got = facts(
        page,
        "{ flag: String(window.__pwned), \
           elements: document.querySelectorAll('#log script, #log img, #log iframe, #log [onerror]').length, \
           text: m.querySelector('.content').textContent, \
           links: Array.from(document.querySelectorAll('#log a')).map(a => [a.href, a.target, a.rel]) }",
    )?;
    ensure(got["flag"] == "undefined", || {
        format!("the model's HTML ran: window.__pwned is {}", got["flag"])
    })?;
    ensure(got["elements"] == 0, || {
        format!(
            "the model's HTML made {} elements in the log",
            got["elements"]
        )
    })?;
    let text = got["text"].as_str().unwrap_or_default();
    for payload in [
        SCRIPT_PAYLOAD,
        IMG_PAYLOAD,
        "[bad](javascript:window.__pwned='link')",
    ] {
        ensure(text.contains(payload), || {
            format!("the payload {payload:?} is not shown as text in {text:?}")
        })?;
    }
    let links = json!([[
        "https://example.com/docs",
        "_blank",
        "noopener noreferrer nofollow"
    ]]);
    ensure(got["links"] == links, || {
        format!("the links are {}, want {links}", got["links"])
    })
}

fn check_tools(page: &CannedPage) -> Result<(), String> {
    facts_eq(
        page,
        "{ calls: Array.from(m.querySelectorAll('.tool-call')).map(b => \
             [b.querySelector('.tool-name').textContent, b.querySelector('pre > code.tool-args').textContent]), \
           finish: m.dataset.finish }",
        json!({
            "calls": [
                ["get_weather", "{\n  \"city\": \"Paris\",\n  \"days\": 3\n}"],
                ["get_time", "{\n  \"tz\": \"Europe/Paris\"\n}"],
            ],
            "finish": "tool_calls",
        }),
    )
}

/// The answer's Copy puts its markdown on the clipboard, the code block's its code.
fn check_copy(page: &CannedPage) -> Result<(), String> {
    for (button, want) in [
        (".turn.assistant .actions button.copy", answer_markdown()),
        (".msg.assistant .code button.copy", CODE.to_owned()),
    ] {
        click(page, button)?;
        let sel = serde_json::to_string(button).unwrap();
        wait_js(
            &page.tab,
            &format!("document.querySelector({sel}).dataset.copied === 'true'"),
            &format!("{button} to copy"),
        )?;
        js(
            &page.tab,
            &format!("delete document.querySelector({sel}).dataset.copied"),
        )?;
        let got = js(&page.tab, "window.__copied")?;
        ensure(got == want, || {
            format!("{button} copied {got}, want {want:?}")
        })?;
    }
    Ok(())
}

fn check_regenerate(page: &CannedPage) -> Result<(), String> {
    click(page, ".turn.assistant .actions button.regen")?;
    wait_js(
        &page.tab,
        &format!(
            "document.querySelectorAll('.msg.assistant').length === 1 && \
             document.querySelectorAll('.msg.assistant[data-done]').length === 1 && \
             document.querySelector('.msg.assistant .content').textContent === '{SECOND}'"
        ),
        "the regenerated answer to replace the first",
    )?;
    let requests = page.requests();
    ensure(requests.len() == 2, || {
        format!("{} requests, want 2", requests.len())
    })?;
    ensure(requests[1] == requests[0], || {
        format!(
            "the regenerate request was {}, want the first's {}",
            requests[1], requests[0]
        )
    })?;
    js_eq(
        page,
        "document.querySelectorAll('.tool-call, details.thinking').length",
        json!(0),
    )
}

fn check_history(page: &CannedPage) -> Result<(), String> {
    type_into(page, "#input", FOLLOW_UP)?;
    page.tab.press_key("Enter")?;
    wait_js(
        &page.tab,
        "document.querySelectorAll('.msg.assistant[data-done]').length === 2",
        "the follow-up's answer",
    )?;
    let requests = page.requests();
    let got = requests
        .get(2)
        .map(|r| r["messages"].clone())
        .unwrap_or_default();
    let want = json!([
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": FIRST},
        {"role": "assistant", "content": SECOND},
        {"role": "user", "content": FOLLOW_UP},
    ]);
    ensure(got == want, || {
        format!("the follow-up sent {got}, want {want}")
    })?;
    js_eq(
        page,
        "Array.from(document.querySelectorAll('.regen')).map(b => b.hidden)",
        json!([true, false]),
    )
}

fn check_persist(page: &CannedPage) -> Result<(), String> {
    page.reload()?;
    js_eq(
        page,
        "[document.getElementById('set-system').value, document.getElementById('set-temperature').value, \
         document.getElementById('set-max-tokens').value, document.getElementById('settings').hidden]",
        json!([SYSTEM, TEMPERATURE, MAX_TOKENS, false]),
    )
}
