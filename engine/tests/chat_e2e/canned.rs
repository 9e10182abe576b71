//! The chat page fed canned answers (what real models stream through mlx_lm.server's
//! shapes): reasoning deltas, markdown with a code block and HTML payloads, tool-call
//! deltas whose arguments come in pieces. Each check has a name; a run collects the
//! names of the checks that failed, so a planted page can be shown to fail its own.

use headless_chrome::protocol::cdp::Input;
use serde_json::{json, Value};

use super::browser::{js, sse, wait_js, CannedPage, Plant};

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
    fn check(&mut self, name: &str, r: Result<(), String>) {
        match r {
            Ok(()) => self.passed.push(name.into()),
            Err(e) => self.failed.push((name.into(), e)),
        }
    }

    pub fn failed(&self, name: &str) -> bool {
        self.failed.iter().any(|(n, _)| n == name)
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
    page.tab
        .find_element(selector)
        .and_then(|e| e.click().map(|_| ()))
        .map_err(|x| format!("clicking {selector}: {x}"))
}

/// Clicks into the field and enters `text` as a keyboard's text input does (one
/// Input.insertText: the field's input event fires, as for typing).
fn type_into(page: &CannedPage, selector: &str, text: &str) -> Result<(), String> {
    click(page, selector)?;
    page.tab
        .call_method(Input::InsertText { text: text.into() })
        .map(|_| ())
        .map_err(|x| format!("typing into {selector}: {x}"))
}

/// Opens the settings, types them, sends the first message, waits for its answer.
fn ask_first(page: &CannedPage) -> Result<(), String> {
    click(page, "#settings-toggle")?;
    type_into(page, "#set-system", SYSTEM)?;
    type_into(page, "#set-temperature", TEMPERATURE)?;
    type_into(page, "#set-max-tokens", MAX_TOKENS)?;
    type_into(page, "#input", FIRST)?;
    page.tab.press_key("Enter").map_err(|x| x.to_string())?;
    wait_js(
        &page.tab,
        "document.querySelectorAll('.msg.assistant[data-done]').length === 1",
        "the first answer to finish",
    )
}

/// Every check of the canned exchange, on `plant`'s page (None: the served page).
/// Saves a screenshot of the first answer as `shot` (under target/e2e).
pub fn run(plant: Option<&Plant>, shot: &str) -> Result<Outcome, String> {
    let page = CannedPage::start(plant, vec![first_answer(), second_answer()], (1200, 1000))?;
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
    let model = js(&page.tab, "document.getElementById('model').textContent")?;
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

fn check_reasoning(page: &CannedPage) -> Result<(), String> {
    let msg = "document.querySelector('.msg.assistant')";
    js_eq(
        page,
        &format!("{msg}.querySelectorAll('details.thinking').length"),
        json!(1),
    )?;
    js_eq(
        page,
        &format!("{msg}.querySelector('details.thinking .reasoning').textContent"),
        json!(REASONING.concat()),
    )?;
    js_eq(
        page,
        &format!("{msg}.querySelector('details.thinking').open"),
        json!(false),
    )?;
    js_eq(
        page,
        &format!("{msg}.querySelector('.content').textContent.includes('The user says hello')"),
        json!(false),
    )?;
    click(page, ".msg.assistant details.thinking summary")?;
    wait_js(
        &page.tab,
        "document.querySelector('.msg.assistant details.thinking').open === true",
        "the Thinking section to open when its summary is clicked",
    )
}

fn check_markdown(page: &CannedPage) -> Result<(), String> {
    let c = "document.querySelector('.msg.assistant .content')";
    js_eq(
        page,
        &format!("{c}.querySelectorAll('pre > code').length"),
        json!(1),
    )?;
    js_eq(
        page,
        &format!("{c}.querySelector('pre > code').textContent"),
        json!(CODE),
    )?;
    js_eq(
        page,
        &format!("{c}.querySelector('pre > code').className"),
        json!("language-python"),
    )?;
    js_eq(
        page,
        &format!("{c}.querySelectorAll('.code .code-bar button.copy').length"),
        json!(1),
    )?;
    js_eq(
        page,
        &format!("{c}.querySelector('p strong').textContent"),
        json!("bold"),
    )?;
    js_eq(
        page,
        &format!("{c}.querySelector('p em').textContent"),
        json!("italic"),
    )?;
    js_eq(
        page,
        &format!("{c}.querySelector('p > code').textContent"),
        json!("inline <i>code</i>"),
    )?;
    js_eq(
        page,
        &format!("Array.from({c}.querySelectorAll('ul > li')).map(l => l.textContent)"),
        json!(["one", "two"]),
    )?;
    js_eq(
        page,
        &format!("Array.from({c}.querySelectorAll('table th, table td')).map(l => l.textContent)"),
        json!(["a", "b", "1", "2"]),
    )
}

fn check_xss(page: &CannedPage) -> Result<(), String> {
    js_eq(
        page,
        "document.querySelectorAll('#log script, #log img, #log iframe, #log [onerror]').length",
        json!(0),
    )?;
    js_eq(page, "typeof window.__pwned", json!("undefined"))?;
    let text = js(
        &page.tab,
        "document.querySelector('.msg.assistant .content').textContent",
    )?;
    let text = text.as_str().unwrap_or_default();
    for payload in [
        SCRIPT_PAYLOAD,
        IMG_PAYLOAD,
        "[bad](javascript:window.__pwned='link')",
    ] {
        ensure(text.contains(payload), || {
            format!("the payload {payload:?} is not shown as text in {text:?}")
        })?;
    }
    js_eq(
        page,
        "Array.from(document.querySelectorAll('#log a')).map(a => [a.href, a.target, a.rel])",
        json!([[
            "https://example.com/docs",
            "_blank",
            "noopener noreferrer nofollow"
        ]]),
    )
}

fn check_tools(page: &CannedPage) -> Result<(), String> {
    let calls = js(
        &page.tab,
        "Array.from(document.querySelectorAll('.msg.assistant .tool-call')).map(b => \
         [b.querySelector('.tool-name').textContent, b.querySelector('pre > code.tool-args').textContent])",
    )?;
    let want = json!([
        ["get_weather", "{\n  \"city\": \"Paris\",\n  \"days\": 3\n}"],
        ["get_time", "{\n  \"tz\": \"Europe/Paris\"\n}"],
    ]);
    ensure(calls == want, || {
        format!("tool call blocks {calls}, want {want}")
    })?;
    js_eq(
        page,
        "document.querySelector('.msg.assistant').dataset.finish",
        json!("tool_calls"),
    )
}

fn check_copy(page: &CannedPage) -> Result<(), String> {
    click(page, ".turn.assistant .actions button.copy")?;
    let want = serde_json::to_string(&answer_markdown()).unwrap();
    wait_js(
        &page.tab,
        &format!("window.__copied === {want}"),
        "the answer's Copy to copy its markdown",
    )?;
    click(page, ".msg.assistant .code button.copy")?;
    let want = serde_json::to_string(CODE).unwrap();
    wait_js(
        &page.tab,
        &format!("window.__copied === {want}"),
        "the code block's Copy to copy its code",
    )
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
    page.tab.press_key("Enter").map_err(|x| x.to_string())?;
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
