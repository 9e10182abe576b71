//! A Chrome DevTools Protocol client of our own, just what the chat page's tests use.
//!
//! Chromium runs with `--remote-debugging-pipe`: it reads commands from its fd 3 and writes
//! answers and events to its fd 4, each message one JSON object ended by a NUL byte. A
//! writer thread owns our end of fd 3 (a command is queued, never blocks its caller) and a
//! reader thread our end of fd 4: it hands each answer to the command's caller, answers
//! Fetch.requestPaused at once from the tab's interceptor (so a page's request is answered
//! while the test waits on a command or polls the DOM), and passes the events a caller
//! watches (`Tab::navigate`'s load) on. A tab is a target attached with `flatten: true`:
//! its commands and events carry its sessionId. Every wait has a deadline and its error
//! names what was awaited.

use base64::Engine as _;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

mod tab;
pub use tab::Tab;

/// How long a command may wait for its answer.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a Chromium just started may take to answer its first command.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// What to do when Chromium cannot be started.
const FIX: &str = "install Debian's chromium: `apt-get install -y chromium`, as scripts/test.sh does, or set CHROMIUM to a Chromium binary";

/// How long Browser.close may take before the browser is killed.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);

/// What an interceptor does with a paused request.
pub enum Paused {
    /// Let it go on to the network (Fetch.continueRequest).
    Continue,
    /// Answer it (Fetch.fulfillRequest).
    Fulfill {
        status: u16,
        headers: Vec<(String, String)>,
        body: Vec<u8>,
    },
}

/// Called on the reader thread with each Fetch.requestPaused's params.
type Interceptor = dyn Fn(&Value) -> Paused + Send + Sync;

/// What the reader and the callers share.
#[derive(Default)]
struct State {
    /// The callers waiting for answers, by command id.
    pending: HashMap<u64, Sender<Result<Value, String>>>,
    /// Commands sent without waiting (answers to paused requests): session and what.
    posted: HashMap<u64, (String, String)>,
    /// Those of them that failed: session and why.
    failures: Vec<(String, String)>,
    /// Each session's interceptor.
    interceptors: HashMap<String, Arc<Interceptor>>,
    /// Events watched: (session, method) and where they go, by watch id.
    watchers: HashMap<u64, (String, &'static str, Sender<Value>)>,
    /// Why the connection ended, once it has.
    closed: Option<String>,
}

struct Conn {
    outbox: Sender<Vec<u8>>,
    next_id: AtomicU64,
    state: Mutex<State>,
}

impl Conn {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Queues command `id` (a closed writer shows as the connection's end).
    fn send(&self, id: u64, session: Option<&str>, method: &str, params: Value) {
        let mut msg = json!({ "id": id, "method": method, "params": params });
        if let Some(s) = session {
            msg["sessionId"] = s.into();
        }
        let mut bytes = serde_json::to_vec(&msg).expect("a command serializes");
        bytes.push(0);
        let _ = self.outbox.send(bytes);
    }

    /// Sends a command and waits up to `limit` for its answer (its `result`).
    fn call(
        &self,
        session: Option<&str>,
        method: &str,
        params: Value,
        limit: Duration,
    ) -> Result<Value, String> {
        let (to, answer) = mpsc::channel();
        let id = self.next_id();
        {
            let mut st = self.state();
            if let Some(why) = &st.closed {
                return Err(format!("{method}: {why}"));
            }
            st.pending.insert(id, to);
        }
        self.send(id, session, method, params);
        match answer.recv_timeout(limit) {
            Ok(Ok(result)) => Ok(result),
            Ok(Err(why)) => Err(format!("{method}: {why}")),
            Err(RecvTimeoutError::Timeout) => {
                self.state().pending.remove(&id);
                Err(format!(
                    "{method}: no answer from Chromium within {limit:?}"
                ))
            }
            Err(RecvTimeoutError::Disconnected) => {
                let why = self.state().closed.clone().unwrap_or_default();
                Err(format!("{method}: {why}"))
            }
        }
    }

    /// Hands one message from Chromium to whoever waits for it (on the reader thread).
    fn dispatch(&self, mut msg: Value) {
        if let Some(id) = msg["id"].as_u64() {
            let answer = match msg.get("error") {
                Some(e) => Err(match (e["message"].as_str(), e["data"].as_str()) {
                    (Some(m), Some(data)) => format!("{m} ({data})"),
                    (Some(m), None) => m.to_owned(),
                    _ => e.to_string(),
                }),
                None => Ok(msg["result"].take()),
            };
            let mut st = self.state();
            if let Some(to) = st.pending.remove(&id) {
                let _ = to.send(answer);
            } else if let (Some((session, what)), Err(why)) = (st.posted.remove(&id), answer) {
                st.failures.push((session, format!("{what}: {why}")));
            }
            return;
        }
        let Some(method) = msg["method"].as_str() else {
            return;
        };
        let session = msg["sessionId"].as_str().unwrap_or("");
        let params = &msg["params"];
        if method == "Fetch.requestPaused" {
            let interceptor = self.state().interceptors.get(session).cloned();
            let decision = interceptor.map_or(Paused::Continue, |f| f(params));
            self.answer_paused(session, params, decision);
        }
        let st = self.state();
        for (s, m, to) in st.watchers.values() {
            if s == session && *m == method {
                let _ = to.send(params.clone());
            }
        }
    }

    fn answer_paused(&self, session: &str, params: &Value, decision: Paused) {
        let request_id = params["requestId"].clone();
        let url = params["request"]["url"].as_str().unwrap_or("?");
        let (method, params) = match decision {
            Paused::Continue => ("Fetch.continueRequest", json!({ "requestId": request_id })),
            Paused::Fulfill {
                status,
                headers,
                body,
            } => (
                "Fetch.fulfillRequest",
                json!({
                    "requestId": request_id,
                    "responseCode": status,
                    "responseHeaders": headers.iter()
                        .map(|(name, value)| json!({ "name": name, "value": value }))
                        .collect::<Vec<_>>(),
                    "body": base64::engine::general_purpose::STANDARD.encode(body),
                }),
            ),
        };
        let what = format!("{method} for {url}");
        // Recorded before sending: the answer cannot come back before its entry exists.
        let id = self.next_id();
        self.state().posted.insert(id, (session.to_owned(), what));
        self.send(id, Some(session), method, params);
    }

    /// The connection has ended: every waiter learns why.
    fn close(&self, why: String) {
        let mut st = self.state();
        for (_, to) in st.pending.drain() {
            let _ = to.send(Err(why.clone()));
        }
        st.watchers.clear();
        st.closed.get_or_insert(why);
    }
}

/// A headless Chromium of our own (killed when dropped) and its DevTools pipe.
pub struct Browser {
    conn: Arc<Conn>,
    child: Child,
    stderr: Arc<Mutex<String>>,
    profile: Option<tempfile::TempDir>,
}

/// Moves `fd` to a number of 5 or more (close-on-exec), clear of the 3 and 4 the child
/// gets, so that dup2-ing one end cannot overwrite the other.
fn above_4(fd: OwnedFd) -> std::io::Result<OwnedFd> {
    // SAFETY: F_DUPFD_CLOEXEC on an open fd returns a new fd that we then own.
    let moved = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 5) };
    if moved < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `moved` is a fresh fd nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(moved) })
}

impl Browser {
    /// Starts `path` with `args` (the profile and the pipe are added) and waits until it
    /// answers over the pipe.
    pub fn launch(path: &Path, args: &[String]) -> Result<Browser, String> {
        let fail = |what: &str, e: std::io::Error| format!("{what} for Chromium: {e}");
        let profile = tempfile::Builder::new()
            .prefix("engine-chromium-")
            .tempdir()
            .map_err(|e| fail("making a profile directory", e))?;
        let (their_in, our_out) = std::io::pipe().map_err(|e| fail("a pipe", e))?;
        let (our_in, their_out) = std::io::pipe().map_err(|e| fail("a pipe", e))?;
        let their_in = above_4(their_in.into()).map_err(|e| fail("a pipe", e))?;
        let their_out = above_4(their_out.into()).map_err(|e| fail("a pipe", e))?;
        let (fd_in, fd_out) = (their_in.as_raw_fd(), their_out.as_raw_fd());
        let mut cmd = Command::new(path);
        cmd.args(args)
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .arg("--remote-debugging-pipe")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        // SAFETY: between fork and exec the closure only calls dup2, which is
        // async-signal-safe; dup2's copies at 3 and 4 are not close-on-exec.
        unsafe {
            cmd.pre_exec(move || {
                for (from, to) in [(fd_in, 3), (fd_out, 4)] {
                    if libc::dup2(from, to) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("starting {}: {e} ({FIX})", path.display()))?;
        drop((their_in, their_out));
        let stderr = Arc::new(Mutex::new(String::new()));
        let mut from_stderr = child.stderr.take().expect("stderr is piped");
        let tail = stderr.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n @ 1..) = from_stderr.read(&mut buf) {
                let mut t = tail.lock().unwrap_or_else(|e| e.into_inner());
                t.push_str(&String::from_utf8_lossy(&buf[..n]));
                if t.len() > 8192 {
                    let cut = t.len() - 4096;
                    let cut = (cut..t.len()).find(|&i| t.is_char_boundary(i)).unwrap();
                    t.drain(..cut);
                }
            }
        });
        let (outbox, queued) = mpsc::channel::<Vec<u8>>();
        let conn = Arc::new(Conn {
            outbox,
            next_id: AtomicU64::new(1),
            state: Mutex::default(),
        });
        // Weak: the writer ends once the connection is gone (its outbox dropped).
        let writer = Arc::downgrade(&conn);
        let mut to_browser = our_out;
        std::thread::spawn(move || {
            for bytes in queued {
                if let Err(e) = to_browser.write_all(&bytes) {
                    if let Some(conn) = writer.upgrade() {
                        conn.close(format!("writing to Chromium's DevTools pipe: {e}"));
                    }
                    return;
                }
            }
        });
        let reader = conn.clone();
        std::thread::spawn(move || {
            let mut from = BufReader::with_capacity(1 << 16, our_in);
            let mut buf = Vec::new();
            let why = loop {
                buf.clear();
                match from.read_until(0, &mut buf) {
                    Ok(0) => break "Chromium closed its DevTools pipe (it exited)".to_owned(),
                    Err(e) => break format!("reading Chromium's DevTools pipe: {e}"),
                    Ok(_) => {}
                }
                if buf.pop() != Some(0) {
                    break "Chromium's DevTools pipe ended inside a message".to_owned();
                }
                match serde_json::from_slice(&buf) {
                    Ok(msg) => reader.dispatch(msg),
                    Err(e) => break format!("an unreadable message from Chromium: {e}"),
                }
            };
            reader.close(why);
        });
        let mut browser = Browser {
            conn,
            child,
            stderr,
            profile: Some(profile),
        };
        if let Err(e) = browser
            .conn
            .call(None, "Browser.getVersion", json!({}), START_TIMEOUT)
        {
            let _ = browser.child.kill();
            let status = browser
                .child
                .wait()
                .map(|s| s.to_string())
                .unwrap_or_default();
            return Err(format!(
                "{} did not answer over its DevTools pipe ({e}; {status}; {FIX}); its stderr:\n{}",
                path.display(),
                browser.stderr.lock().unwrap_or_else(|e| e.into_inner())
            ));
        }
        Ok(browser)
    }

    /// A tab of `width`×`height` in a new browser context (its own storage and cache),
    /// attached, its lifecycle events on.
    pub fn new_tab(&self, width: u32, height: u32) -> Result<Tab, String> {
        Tab::new(&self.conn, width, height)
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        // Asked to close first (it shuts its other processes down and lets go of the
        // profile), killed if it has not exited by the deadline.
        let deadline = Instant::now() + CLOSE_TIMEOUT;
        let _ = self
            .conn
            .call(None, "Browser.close", json!({}), CLOSE_TIMEOUT);
        while matches!(self.child.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        // A process of the browser's may still be writing there for a moment: removing a
        // directory it has just written into fails, so removal is tried again.
        let Some(profile) = self.profile.take() else {
            return;
        };
        let dir = profile.keep();
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            match std::fs::remove_dir_all(&dir) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                _ => return,
            }
        }
    }
}
