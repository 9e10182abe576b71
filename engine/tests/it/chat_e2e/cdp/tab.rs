//! A tab of cdp.rs's browser: a page target in a browser context of its own, attached
//! with `flatten: true` (its commands and events carry its sessionId).

use base64::Engine as _;
use serde_json::{json, Value};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Conn, Paused, COMMAND_TIMEOUT};

/// How long a navigation may take to fire its load event.
const LOAD_TIMEOUT: Duration = Duration::from_secs(30);

/// A page target attached over the browser's pipe (see `close`).
pub struct Tab {
    conn: Arc<Conn>,
    target: String,
    session: String,
    context: String,
}

/// Events of one method on one tab, from when the watch began until it is dropped.
struct Watch<'c> {
    conn: &'c Conn,
    id: u64,
    events: Receiver<Value>,
}

impl Watch<'_> {
    /// Waits up to `limit` for an event whose params satisfy `wanted`.
    fn wait(
        &self,
        wanted: impl Fn(&Value) -> bool,
        limit: Duration,
        what: &str,
    ) -> Result<Value, String> {
        let deadline = Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.events.recv_timeout(left) {
                Ok(event) if wanted(&event) => return Ok(event),
                Ok(_) => {}
                Err(RecvTimeoutError::Timeout) => {
                    return Err(format!("waited {limit:?} for {what}"))
                }
                Err(RecvTimeoutError::Disconnected) => {
                    let why = self.conn.state().closed.clone().unwrap_or_default();
                    return Err(format!("waiting for {what}: {why}"));
                }
            }
        }
    }
}

impl Drop for Watch<'_> {
    fn drop(&mut self) {
        self.conn.state().watchers.remove(&self.id);
    }
}

impl Tab {
    /// A tab of `width`×`height` in a new browser context, attached, its lifecycle events
    /// on; a tab that did not open leaves no context behind.
    pub(super) fn new(conn: &Arc<Conn>, width: u32, height: u32) -> Result<Tab, String> {
        let context = conn.call(
            None,
            "Target.createBrowserContext",
            json!({}),
            COMMAND_TIMEOUT,
        )?;
        let mut tab = Tab {
            conn: conn.clone(),
            target: String::new(),
            session: String::new(),
            context: context["browserContextId"]
                .as_str()
                .ok_or("Target.createBrowserContext gave no browserContextId")?
                .to_owned(),
        };
        match tab.open(width, height) {
            Ok(()) => Ok(tab),
            Err(e) => {
                let _ = tab.close();
                Err(e)
            }
        }
    }

    /// Creates the target in the tab's context and attaches to it.
    fn open(&mut self, width: u32, height: u32) -> Result<(), String> {
        let target = self.call_browser(
            "Target.createTarget",
            json!({ "url": "about:blank", "width": width, "height": height,
                    "browserContextId": self.context }),
        )?;
        self.target = target["targetId"].as_str().unwrap_or_default().to_owned();
        let attached = self.call_browser(
            "Target.attachToTarget",
            json!({ "targetId": self.target, "flatten": true }),
        )?;
        self.session = attached["sessionId"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        self.call("Page.enable", json!({}))?;
        self.call("Page.setLifecycleEventsEnabled", json!({ "enabled": true }))
            .map(|_| ())
    }

    /// Sends a command to the page and waits for its result.
    pub fn call(&self, method: &str, params: Value) -> Result<Value, String> {
        self.conn
            .call(Some(&self.session), method, params, COMMAND_TIMEOUT)
    }

    fn watch(&self, method: &'static str) -> Watch<'_> {
        let (to, events) = mpsc::channel();
        let id = self.conn.next_id();
        let mut st = self.conn.state();
        st.watchers.insert(id, (self.session.clone(), method, to));
        drop(st);
        Watch {
            conn: &self.conn,
            id,
            events,
        }
    }

    /// Loads `url` and waits for its load event (the document and its subresources).
    pub fn navigate(&self, url: &str) -> Result<(), String> {
        let lifecycle = self.watch("Page.lifecycleEvent");
        let nav = self.call("Page.navigate", json!({ "url": url }))?;
        if let Some(err) = nav["errorText"].as_str() {
            return Err(format!("Page.navigate to {url}: {err}"));
        }
        // No loaderId: a navigation within the document (nothing to load).
        let Some(loader) = nav["loaderId"].as_str() else {
            return Ok(());
        };
        lifecycle
            .wait(
                |e| e["name"] == "load" && e["loaderId"] == loader,
                LOAD_TIMEOUT,
                &format!("{url} to load"),
            )
            .map(|_| ())
    }

    /// Reloads the page (Page.reload answers once the reload has begun).
    pub fn reload(&self) -> Result<(), String> {
        self.call("Page.reload", json!({ "ignoreCache": false }))
            .map(|_| ())
    }

    /// The value of a JavaScript expression (by value; a promise is not awaited).
    pub fn evaluate(&self, expr: &str) -> Result<Value, String> {
        let mut out = self.call(
            "Runtime.evaluate",
            json!({ "expression": expr, "returnByValue": true, "awaitPromise": false }),
        )?;
        if let Some(ex) = out.get("exceptionDetails") {
            let what = ex["exception"]["description"]
                .as_str()
                .or(ex["text"].as_str());
            return Err(format!("Runtime.evaluate threw {}", what.unwrap_or("?")));
        }
        Ok(out["result"]["value"].take())
    }

    /// Runs `source` in every document this tab loads from now on, before its own scripts.
    pub fn add_script(&self, source: &str) -> Result<(), String> {
        self.call(
            "Page.addScriptToEvaluateOnNewDocument",
            json!({ "source": source }),
        )
        .map(|_| ())
    }

    /// Enters `text` as a keyboard's text input does (the field's input event fires).
    pub fn insert_text(&self, text: &str) -> Result<(), String> {
        self.call("Input.insertText", json!({ "text": text }))
            .map(|_| ())
    }

    /// Presses and releases `key` (a key the tests use: Enter).
    pub fn press_key(&self, key: &str) -> Result<(), String> {
        // key, code, Windows key code, text: as a US keyboard sends them.
        let (code, key_code, text) = match key {
            "Enter" => ("Enter", 13, "\r"),
            _ => return Err(format!("press_key: no definition of the key {key:?}")),
        };
        for kind in ["keyDown", "keyUp"] {
            self.call(
                "Input.dispatchKeyEvent",
                json!({ "type": kind, "key": key, "code": code, "text": text,
                        "windowsVirtualKeyCode": key_code, "nativeVirtualKeyCode": key_code }),
            )?;
        }
        Ok(())
    }

    /// A left click at (x, y) in CSS pixels of the viewport: the mouse moves there, then
    /// presses and releases its button.
    pub fn click_point(&self, x: f64, y: f64) -> Result<(), String> {
        self.call(
            "Input.dispatchMouseEvent",
            json!({ "type": "mouseMoved", "x": x, "y": y }),
        )?;
        for kind in ["mousePressed", "mouseReleased"] {
            self.call(
                "Input.dispatchMouseEvent",
                json!({ "type": kind, "x": x, "y": y, "button": "left", "clickCount": 1 }),
            )?;
        }
        Ok(())
    }

    /// The viewport as a PNG.
    pub fn screenshot_png(&self) -> Result<Vec<u8>, String> {
        let shot = self.call(
            "Page.captureScreenshot",
            json!({ "format": "png", "fromSurface": true }),
        )?;
        let data = shot["data"]
            .as_str()
            .ok_or("Page.captureScreenshot gave no data")?;
        base64::engine::general_purpose::STANDARD
            .decode(data)
            .map_err(|e| format!("Page.captureScreenshot's data: {e}"))
    }

    /// Pauses the requests `patterns` (Fetch.RequestPattern objects) match and answers
    /// each as `interceptor` decides, on the reader thread.
    pub fn intercept(
        &self,
        patterns: Value,
        interceptor: impl Fn(&Value) -> Paused + Send + Sync + 'static,
    ) -> Result<(), String> {
        let mut st = self.conn.state();
        st.interceptors
            .insert(self.session.clone(), Arc::new(interceptor));
        drop(st);
        self.call("Fetch.enable", json!({ "patterns": patterns }))
            .map(|_| ())
    }

    /// The answers to paused requests that Chromium refused, so far.
    pub fn intercept_failures(&self) -> Vec<String> {
        let st = self.conn.state();
        st.failures
            .iter()
            .filter(|(s, _)| *s == self.session)
            .map(|(_, why)| why.clone())
            .collect()
    }

    /// Closes the tab and drops its browser context (nothing of the page runs on).
    pub fn close(&self) -> Result<(), String> {
        let closed = self.call_browser("Target.closeTarget", json!({ "targetId": self.target }));
        let disposed = self.call_browser(
            "Target.disposeBrowserContext",
            json!({ "browserContextId": self.context }),
        );
        let mut st = self.conn.state();
        st.interceptors.remove(&self.session);
        st.failures.retain(|(s, _)| *s != self.session);
        closed.and(disposed).map(|_| ())
    }

    fn call_browser(&self, method: &str, params: Value) -> Result<Value, String> {
        self.conn.call(None, method, params, COMMAND_TIMEOUT)
    }
}
