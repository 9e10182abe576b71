//! The chat page in headless Chromium with its chat endpoint answered by the test: the
//! page and /v1/models come from a live `engine serve` (the page as the binary embeds
//! it, or a planted variant of it), every POST to /v1/chat/completions is intercepted
//! over the DevTools protocol (Fetch.enable + Fetch.fulfillRequest) and answered with the
//! next canned body, and the request bodies the page sent are kept for the test to read.
//! A case may also answer GET /v1/models with a list of its own (`CannedPage::models`:
//! adapters and unloaded models, which the tiny model's server does not list).
//!
//! One server serves every case, and a few Chromiums run the cases side by side
//! (`Fixture`: the server and one Chromium). Each case gets a browser context of its own
//! (Target.createBrowserContext, an incognito profile: its own localStorage, cache and
//! cookies, so one case's saved settings cannot make another's pass) with one tab, sized
//! as the case asks. Chromium is driven over its DevTools pipe by our own client (cdp.rs).

use base64::Engine as _;
use serde_json::{json, Value};
use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::cdp::{Browser, Paused, Tab};
use super::common::server::{http, serve_model, Server};

/// How long a DOM condition may take to hold (the page reacts in milliseconds).
pub const DOM_TIMEOUT: Duration = Duration::from_secs(20);

/// How long a state that the page's last redraw has already settled may take to read back
/// (a planted page that never reaches it fails after this, not after DOM_TIMEOUT).
pub const SETTLED_TIMEOUT: Duration = Duration::from_secs(2);

pub fn chromium() -> PathBuf {
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

/// Chromium's flags besides the profile and the pipe (cdp.rs adds those).
const FLAGS: &[&str] = &[
    "--headless",
    // Root in a container: Chromium's sandbox needs user namespaces it may not have.
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    // A small /dev/shm in a container would crash renderers.
    "--disable-dev-shm-usage",
    // Nothing but the test's pages: no first-run, update, sync or background traffic.
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--disable-extensions",
    "--disable-breakpad",
    "--metrics-recording-only",
    "--password-store=basic",
    "--use-mock-keychain",
    // Several Chromiums share the cores: no page may be throttled as hidden or hung.
    "--disable-background-timer-throttling",
    "--disable-backgrounding-occluded-windows",
    "--disable-renderer-backgrounding",
    "--disable-hang-monitor",
    "--disable-ipc-flooding-protection",
    "--disable-popup-blocking",
    "--force-color-profile=srgb",
    "--enable-automation",
];

pub fn launch(window: (u32, u32)) -> Result<Browser, String> {
    let mut args: Vec<String> = FLAGS.iter().map(|f| f.to_string()).collect();
    args.push(format!("--window-size={},{}", window.0, window.1));
    Browser::launch(&chromium(), &args).map_err(|x| format!("starting chromium: {x}"))
}

/// The server every case shares (the page and /v1/models come from it).
pub fn server() -> Server {
    serve_model("tiny-llama-trained", &["--no-open"])
}

/// The shared server and a Chromium of this fixture's own (killed when dropped), which
/// runs one case at a time.
pub struct Fixture<'s> {
    pub server: &'s Server,
    browser: Browser,
}

impl<'s> Fixture<'s> {
    pub fn start(server: &'s Server) -> Result<Fixture<'s>, String> {
        let browser = launch((1200, 1000))?;
        Ok(Fixture { server, browser })
    }

    /// A tab in a new browser context (nothing shared with earlier cases' pages), its
    /// viewport `window` (width, height) in CSS pixels; closed when dropped.
    pub fn tab(&self, window: (u32, u32)) -> Result<CaseTab, String> {
        let tab = CaseTab(Arc::new(self.browser.new_tab(window.0, window.1)?));
        // The viewport the case was written for, whatever size the window came out.
        tab.0.call(
            "Emulation.setDeviceMetricsOverride",
            json!({ "width": window.0, "height": window.1, "deviceScaleFactor": 1, "mobile": false }),
        )?;
        Ok(tab)
    }
}

/// A case's tab; closing it when dropped leaves the browser with no page of the case's
/// running (a page still streaming or polling would otherwise go on beside later cases).
pub struct CaseTab(pub Arc<Tab>);

impl Drop for CaseTab {
    fn drop(&mut self) {
        let _ = self.0.close();
    }
}

pub fn e2e_dir() -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/e2e");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A planted page: the served page with `from` replaced by `to` (`from` must occur).
pub struct Plant {
    pub from: &'static str,
    pub to: &'static str,
}

/// An answer to one chat request.
#[derive(Clone)]
pub struct Reply {
    pub status: u16,
    pub content_type: &'static str,
    pub body: String,
}

impl Reply {
    /// A 200 of server-sent events (see `sse`).
    pub fn sse(body: String) -> Reply {
        Reply {
            status: 200,
            content_type: "text/event-stream",
            body,
        }
    }

    /// A JSON answer with this status (an error, as the server sends it).
    pub fn json(status: u16, body: Value) -> Reply {
        Reply {
            status,
            content_type: "application/json",
            body: body.to_string(),
        }
    }
}

/// What the interceptor shares with the test.
#[derive(Default)]
struct Shared {
    /// The page to serve at / instead of the server's (a planted variant).
    page: Option<String>,
    /// Answers to the coming chat requests, in order (the last one repeats).
    replies: VecDeque<Reply>,
    /// The JSON bodies the page posted to /v1/chat/completions.
    requests: Vec<String>,
    /// The body for GET /v1/models, when the case lists models of its own.
    models: Option<String>,
    /// Events the interceptor could not handle.
    errors: Vec<String>,
}

pub struct CannedPage<'f> {
    pub server: &'f Server,
    /// Held for the page's lifetime (dropping it closes the tab).
    _tab: CaseTab,
    pub tab: Arc<Tab>,
    shared: Arc<Mutex<Shared>>,
}

/// A script that runs before the page's own: the clipboard records what is written to it
/// (window.__copied), as a headless browser has no clipboard to read back.
const CLIPBOARD_STUB: &str = r#"Object.defineProperty(navigator, "clipboard", { configurable: true,
  value: { writeText: async t => { window.__copied = t; } } });"#;

impl<'f> CannedPage<'f> {
    /// Opens a tab on `fx`'s browser with the interception; `replies` answer the chat
    /// requests in order. The page is not loaded yet (see `open`).
    pub fn start(
        fx: &'f Fixture<'_>,
        plant: Option<&Plant>,
        replies: Vec<String>,
        window: (u32, u32),
    ) -> Result<CannedPage<'f>, String> {
        Self::start_with_models(fx, plant, replies, None, window)
    }

    /// As `start`, with GET /v1/models answered by `models` (a JSON body) when given.
    pub fn start_with_models(
        fx: &'f Fixture<'_>,
        plant: Option<&Plant>,
        replies: Vec<String>,
        models: Option<Value>,
        window: (u32, u32),
    ) -> Result<CannedPage<'f>, String> {
        let replies = replies.into_iter().map(Reply::sse).collect();
        Self::start_with_replies(fx, plant, replies, models, window)
    }

    /// As `start_with_models`, each chat request answered by the next `Reply` (its status,
    /// type and body).
    pub fn start_with_replies(
        fx: &'f Fixture<'_>,
        plant: Option<&Plant>,
        replies: Vec<Reply>,
        models: Option<Value>,
        window: (u32, u32),
    ) -> Result<CannedPage<'f>, String> {
        let server = fx.server;
        let page = plant.map(|p| planted_page(server.port, p));
        let stub_models = models.is_some();
        let shared = Arc::new(Mutex::new(Shared {
            page,
            replies: replies.into(),
            models: models.map(|m| m.to_string()),
            ..Shared::default()
        }));
        let case_tab = fx.tab(window)?;
        let tab = case_tab.0.clone();
        let mut patterns = vec![
            json!({ "urlPattern": "*/v1/chat/completions", "requestStage": "Request" }),
            json!({ "urlPattern": "*", "resourceType": "Document", "requestStage": "Request" }),
        ];
        if stub_models {
            patterns.push(json!({ "urlPattern": "*/v1/models", "requestStage": "Request" }));
        }
        let for_events = shared.clone();
        tab.intercept(Value::Array(patterns), move |event| {
            intercept(&for_events, event)
        })?;
        tab.add_script(CLIPBOARD_STUB)?;
        Ok(CannedPage {
            server,
            _tab: case_tab,
            tab,
            shared,
        })
    }

    /// Loads the page at `#/chat` (plus `query`) and waits until it knows the model.
    pub fn open(&self, query: &str) -> Result<(), String> {
        let url = format!("http://127.0.0.1:{}/#/chat{query}", self.server.port);
        self.tab
            .navigate(&url)
            .map_err(|x| format!("loading {url}: {x}"))?;
        wait_js(
            &self.tab,
            "document.getElementById('model').dataset.refreshed >= 1 && document.getElementById('model').value.endsWith('/tiny-llama-trained')",
            "the page to list the models and pick the server's",
        )
    }

    /// From now on GET /v1/models answers `models` (a case that lists its own).
    pub fn set_models(&self, models: &Value) {
        self.shared.lock().unwrap().models = Some(models.to_string());
    }

    /// Reloads the page (a new document: the old one's marker is gone) and waits until it
    /// knows the model.
    pub fn reload(&self) -> Result<(), String> {
        js(&self.tab, "window.__old_document = true")?;
        self.tab.reload().map_err(|x| format!("reloading: {x}"))?;
        wait_js(
            &self.tab,
            "window.__old_document === undefined && document.getElementById('model').dataset.refreshed >= 1",
            "the reloaded page to list the models",
        )
    }

    /// The request bodies the page has posted so far, parsed.
    pub fn requests(&self) -> Vec<Value> {
        let s = self.shared.lock().unwrap();
        s.requests
            .iter()
            .map(|b| serde_json::from_str(b).unwrap_or(Value::String(b.clone())))
            .collect()
    }

    pub fn intercept_errors(&self) -> Vec<String> {
        self.shared.lock().unwrap().errors.clone()
    }

    pub fn screenshot(&self, name: &str) -> Result<PathBuf, String> {
        let png = self.tab.screenshot_png()?;
        let path = e2e_dir().join(name);
        std::fs::write(&path, png).map_err(|x| x.to_string())?;
        Ok(path)
    }
}

/// The ids the server lists at GET /v1/models, in its order.
pub fn http_models(port: u16) -> Vec<String> {
    let (status, body) = http(port, "GET", "/v1/models", b"");
    assert_eq!(status, 200, "GET /v1/models answered {status}: {body}");
    let list: Value = serde_json::from_str(&body).unwrap();
    list["data"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| m["id"].as_str().map(str::to_owned))
        .collect()
}

/// The server's page with the plant applied; panics when the plant no longer applies
/// (the page changed under it), so a stale plant cannot pass as caught.
fn planted_page(port: u16, plant: &Plant) -> String {
    let (status, page) = http(port, "GET", "/", b"");
    assert_eq!(status, 200, "GET / answered {status}");
    assert!(
        page.contains(plant.from),
        "the plant's text is no longer in the page: {:?}",
        plant.from
    );
    page.replace(plant.from, plant.to)
}

/// The answer to a paused request (Fetch.requestPaused's params), on cdp.rs's reader thread.
fn intercept(shared: &Mutex<Shared>, paused: &Value) -> Paused {
    let request = &paused["request"];
    let url = request["url"].as_str().unwrap_or_default();
    let mut s = shared.lock().unwrap();
    let (status, content_type, body) = if url.ends_with("/v1/chat/completions") {
        s.requests.push(post_body(request));
        let reply = if s.replies.len() > 1 {
            s.replies.pop_front()
        } else {
            s.replies.front().cloned()
        };
        match reply {
            Some(r) => (r.status, r.content_type, r.body),
            None => {
                s.errors.push("a chat request with no reply left".into());
                (200, "text/event-stream", String::new())
            }
        }
    } else if let (true, Some(models)) = (url.ends_with("/v1/models"), &s.models) {
        (200, "application/json", models.clone())
    } else if let Some(page) = &s.page {
        (200, "text/html; charset=utf-8", page.clone())
    } else {
        return Paused::Continue;
    };
    Paused::Fulfill {
        status,
        headers: vec![("Content-Type".into(), content_type.into())],
        body: body.into_bytes(),
    }
}

/// A request's body (Network.Request): postData, or its postDataEntries (base64) joined.
fn post_body(request: &Value) -> String {
    if let Some(data) = request["postData"].as_str() {
        return data.to_owned();
    }
    let bytes: Vec<u8> = request["postDataEntries"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| e["bytes"].as_str())
        .flat_map(|b| {
            base64::engine::general_purpose::STANDARD
                .decode(b)
                .unwrap_or_default()
        })
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// The JSON value of a JavaScript expression in the page (an exception is an error).
pub fn js(tab: &Tab, expr: &str) -> Result<Value, String> {
    let wrapped = format!(
        "(() => {{ try {{ return JSON.stringify({{ ok: ({expr}) }}); }} catch (e) {{ return JSON.stringify({{ err: String(e) }}); }} }})()"
    );
    let out = tab.evaluate(&wrapped)?;
    let text = out
        .as_str()
        .ok_or_else(|| format!("`{expr}` gave no value: {out}"))?;
    let v: Value = serde_json::from_str(text).map_err(|x| x.to_string())?;
    match v.get("err") {
        Some(err) => Err(format!("`{expr}` threw {err}")),
        None => Ok(v.get("ok").cloned().unwrap_or(Value::Null)),
    }
}

/// A mouse click (Input.dispatchMouseEvent) at the middle of the element `selector`
/// picks, scrolled into view; an error if the element is missing or something else is on
/// top of it there (a user could not click it).
pub fn click(tab: &Tab, selector: &str) -> Result<(), String> {
    let sel = serde_json::to_string(selector).unwrap();
    let at = js(
        tab,
        &format!(
            "(() => {{ const e = document.querySelector({sel}); if (!e) return 'no such element'; \
             e.scrollIntoView({{ block: 'center', behavior: 'instant' }}); \
             const r = e.getBoundingClientRect(), x = r.left + r.width / 2, y = r.top + r.height / 2; \
             const hit = document.elementFromPoint(x, y); \
             return hit && (hit === e || e.contains(hit)) ? [x, y] : 'covered by ' + (hit ? hit.outerHTML.slice(0, 120) : 'nothing'); }})()"
        ),
    )?;
    let (Some(x), Some(y)) = (at[0].as_f64(), at[1].as_f64()) else {
        return Err(format!("cannot click {selector}: {at}"));
    };
    tab.click_point(x, y)
        .map_err(|e| format!("clicking {selector}: {e}"))
}

/// Clicks into the field and enters `text` as a keyboard's text input does (one
/// Input.insertText: the field's input event fires, as for typing).
pub fn type_into(tab: &Tab, selector: &str, text: &str) -> Result<(), String> {
    click(tab, selector)?;
    tab.insert_text(text)
        .map_err(|x| format!("typing into {selector}: {x}"))
}

/// Waits (up to DOM_TIMEOUT) until `cond` is true in the page.
pub fn wait_js(tab: &Tab, cond: &str, what: &str) -> Result<(), String> {
    wait_js_within(tab, cond, what, DOM_TIMEOUT)
}

/// Waits up to `limit` until `cond` is true in the page (evaluated at least once).
pub fn wait_js_within(tab: &Tab, cond: &str, what: &str, limit: Duration) -> Result<(), String> {
    let deadline = Instant::now() + limit;
    loop {
        let last = js(tab, cond);
        if last == Ok(Value::Bool(true)) {
            return Ok(());
        }
        if Instant::now() > deadline {
            let body = js(tab, "document.getElementById('log').outerHTML").unwrap_or_default();
            // An answer to a paused request that Chromium refused leaves the page waiting.
            let refused = tab.intercept_failures();
            let refused = if refused.is_empty() {
                String::new()
            } else {
                format!("; answers Chromium refused: {refused:?}")
            };
            return Err(format!(
                "waited {limit:?} for {what} (`{cond}` is {last:?}); the log: {body}{refused}"
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A streamed chat response as mlx_lm.server writes it: one `data:` event per delta,
/// the last with `finish`, then `[DONE]`.
pub fn sse(deltas: &[Value], finish: &str) -> String {
    let chunk = |delta: &Value, finish: Value| {
        serde_json::json!({
            "id": "chatcmpl-test", "object": "chat.completion.chunk", "created": 1,
            "model": "tiny-llama-trained",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        })
    };
    let mut out = String::new();
    for d in deltas {
        out += &format!("data: {}\n\n", chunk(d, Value::Null));
    }
    out += &format!(
        "data: {}\n\n",
        chunk(&serde_json::json!({}), Value::String(finish.into()))
    );
    out + "data: [DONE]\n\n"
}
