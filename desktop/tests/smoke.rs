//! The desktop shell end to end under Xvfb: the window starts `engine serve` on the trained
//! tiny model, loads the server's chat page with a first message in its link, the page's
//! JavaScript (inside the shell's webview) streams the answer, a screenshot of the screen
//! is saved (target/e2e/desktop.png), and SIGTERM to the shell stops the server too, as
//! does closing the window (a WM_DELETE_WINDOW message, as a window manager sends).
//! Two planted defects (a shell that leaves its server running, one that opens the wrong
//! page) must each be caught.
//!
//! Needs Xvfb and ImageMagick's `import` (Debian: xvfb, imagemagick) and the engine binary
//! (`../target/debug/engine`, or $ENGINE_BIN); `bash desktop/run.sh test` sees to all three.
//!
//! Nothing here waits a fixed time: each step waits, with a deadline, for what it needs
//! (a line from the shell, a server counter, the screen showing a page's state, a process
//! gone). The webview offers no automation protocol, so a page's state is read off the
//! screen: the colours its CSS gives the elements that mark that state.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::time::{Duration, Instant};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn engine_bin() -> PathBuf {
    let path = std::env::var_os("ENGINE_BIN")
        .map_or_else(|| repo().join("target/debug/engine"), PathBuf::from);
    assert!(
        path.is_file(),
        "no engine binary at {}: run `cargo build -p engine` in the repository root or set ENGINE_BIN",
        path.display()
    );
    path
}

/// A virtual X display for the life of a test.
struct Xvfb {
    child: Child,
    display: String,
}

impl Xvfb {
    fn start() -> Xvfb {
        let mut child = Command::new("Xvfb")
            .args([
                "-displayfd",
                "1",
                "-screen",
                "0",
                "1024x720x24",
                // A black root instead of the stipple: the only colours on screen are the
                // window's (see `wait_for_screen`).
                "-br",
                "-nolisten",
                "tcp",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("Xvfb is needed for this test (Debian: apt-get install -y xvfb)");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let display = format!(":{}", line.trim());
        Xvfb { child, display }
    }

    fn screenshot(&self, path: &Path) -> Result<(), String> {
        let out = Command::new("import")
            .args(["-display", &self.display, "-window", "root"])
            .arg(path)
            .output()
            .map_err(|e| {
                format!("ImageMagick's import is needed (apt-get install -y imagemagick): {e}")
            })?;
        if out.status.success() {
            Ok(())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).into_owned())
        }
    }
}

/// A colour and how many screen pixels of it a state shows (at least `min`, at most `max`).
struct Shade {
    rgb: [u8; 3],
    min: usize,
    max: usize,
    name: &'static str,
}

const fn shade(name: &'static str, rgb: u32, min: usize, max: usize) -> Shade {
    Shade {
        rgb: [(rgb >> 16) as u8, (rgb >> 8) as u8, rgb as u8],
        min,
        max,
        name,
    }
}

/// The chat page with its answer finished (engine/src/serve/page/chat.html): the user's
/// bubble is on screen and the Send button is back (it is hidden, Stop shown, from the
/// moment the bubble appears until the request has ended), so every token is painted.
const CHAT_DONE: [Shade; 2] = [
    shade("the user's bubble (#e8f0fe)", 0xe8f0fe, 500, usize::MAX),
    shade("the Send button (#0071e3)", 0x0071e3, 500, usize::MAX),
];

/// The splash showing the engine's error (desktop/splash/index.html): its background, the
/// error's white box, and no spinner (hidden once failed). A webview that has not painted
/// the splash yet is all white, without the background.
const SPLASH_ERROR: [Shade; 3] = [
    shade(
        "the splash's background (#f5f7fa)",
        0xf5f7fa,
        10_000,
        usize::MAX,
    ),
    shade("the error's box (#ffffff)", 0xffffff, 2_000, usize::MAX),
    shade("the spinner (#2b6cb0)", 0x2b6cb0, 0, 0),
];

impl Xvfb {
    /// The whole screen as packed 8-bit RGB.
    fn pixels(&self) -> Result<Vec<u8>, String> {
        let out = Command::new("import")
            .args(["-display", &self.display, "-window", "root", "-depth", "8"])
            .arg("rgb:-")
            .output()
            .map_err(|e| {
                format!("ImageMagick's import is needed (apt-get install -y imagemagick): {e}")
            })?;
        if out.status.success() {
            Ok(out.stdout)
        } else {
            Err(String::from_utf8_lossy(&out.stderr).into_owned())
        }
    }

    /// Waits (up to `limit`) until the screen shows every shade of `state`.
    fn wait_for_screen(&self, limit: Duration, what: &str, state: &[Shade]) -> Result<(), String> {
        let deadline = Instant::now() + limit;
        loop {
            let pixels = self.pixels()?;
            let counts: Vec<usize> = state
                .iter()
                .map(|s| pixels.chunks_exact(3).filter(|p| *p == s.rgb).count())
                .collect();
            if state
                .iter()
                .zip(&counts)
                .all(|(s, &n)| (s.min..=s.max).contains(&n))
            {
                return Ok(());
            }
            if Instant::now() > deadline {
                let seen: Vec<String> = state
                    .iter()
                    .zip(&counts)
                    .map(|(s, n)| format!("{}: {n} px", s.name))
                    .collect();
                return Err(format!(
                    "the screen did not show {what} within {limit:?} ({})",
                    seen.join(", ")
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Xvfb {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The shell's stderr lines, as they come.
fn lines(child: &mut Child) -> Receiver<String> {
    let (tx, rx) = mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            eprintln!("  | {line}");
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// The first line (within `limit`) for which `pick` gives a value.
fn wait_for<T>(
    rx: &Receiver<String>,
    limit: Duration,
    what: &str,
    mut pick: impl FnMut(&str) -> Option<Result<T, String>>,
) -> Result<T, String> {
    let deadline = Instant::now() + limit;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => {
                if let Some(found) = pick(&line) {
                    return found;
                }
            }
            Err(_) => return Err(format!("no sign of {what} within {limit:?}")),
        }
    }
}

fn get(base: &str, path: &str) -> Option<String> {
    let host = base.strip_prefix("http://")?;
    let mut s = TcpStream::connect(host).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    Some(out.split("\r\n\r\n").nth(1).unwrap_or_default().to_owned())
}

fn alive(pid: u32) -> bool {
    // A zombie has stopped running: its parent (the shell) is gone, and whether it is
    // reaped soon depends on the container's init, not on the shell.
    #[cfg(target_os = "linux")]
    if let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        let state = stat
            .rsplit_once(") ")
            .and_then(|(_, rest)| rest.chars().next());
        return state != Some('Z');
    }
    // Signal 0 checks that the process exists.
    Command::new("kill")
        .args(["-0", &pid.to_string()])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

struct Leftover(Option<u32>);

impl Drop for Leftover {
    fn drop(&mut self) {
        if let Some(pid) = self.0 {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
        }
    }
}

/// How a run ends.
#[derive(Clone, Copy, PartialEq)]
enum Ending {
    /// SIGTERM, as a logout or `kill` sends: the shell's own exit path stops the server.
    Term,
    /// SIGKILL: the shell gets no say; the server must still go (Linux: parent-death signal).
    Kill,
    /// The window closed, as a window manager closes it (Linux: WM_DELETE_WINDOW).
    #[cfg(target_os = "linux")]
    Close,
}

/// Asks the shell's window to close, as a window manager does when its close button is
/// pressed: a WM_DELETE_WINDOW client message to the top-level window titled "engine".
#[cfg(target_os = "linux")]
fn close_window(display: &str) -> Result<(), String> {
    use x11rb::connection::Connection;
    use x11rb::protocol::xproto::{AtomEnum, ClientMessageEvent, ConnectionExt, EventMask};
    let e = |e: &dyn std::fmt::Display| e.to_string();
    let (conn, screen) = x11rb::connect(Some(display)).map_err(|x| e(&x))?;
    let root = conn.setup().roots[screen].root;
    let atom = |name: &[u8]| -> Result<u32, String> {
        Ok(conn
            .intern_atom(false, name)
            .map_err(|x| e(&x))?
            .reply()
            .map_err(|x| e(&x))?
            .atom)
    };
    let (protocols, delete) = (atom(b"WM_PROTOCOLS")?, atom(b"WM_DELETE_WINDOW")?);
    let children = conn
        .query_tree(root)
        .map_err(|x| e(&x))?
        .reply()
        .map_err(|x| e(&x))?
        .children;
    let mut closed = 0;
    for window in children {
        let name = conn
            .get_property(false, window, AtomEnum::WM_NAME, AtomEnum::ANY, 0, 64)
            .map_err(|x| e(&x))?
            .reply()
            .map_err(|x| e(&x))?
            .value;
        if name == b"engine" {
            let message = ClientMessageEvent::new(32, window, protocols, [delete, 0, 0, 0, 0]);
            conn.send_event(false, window, EventMask::NO_EVENT, message)
                .map_err(|x| e(&x))?;
            closed += 1;
        }
    }
    conn.flush().map_err(|x| e(&x))?;
    if closed == 0 {
        return Err("no window titled \"engine\" to close".into());
    }
    Ok(())
}

/// One run of the shell: everything the smoke test checks, in order. `plant` names a
/// planted defect (ENGINE_DESKTOP_PLANT) or None for the real shell.
fn run_shell(plant: Option<&str>, ending: Ending, screenshot: &Path) -> Result<(), String> {
    let x = Xvfb::start();
    let model = repo().join("goldens/models/tiny-llama-trained");
    let mut command = Command::new(env!("CARGO_BIN_EXE_engine-desktop"));
    command
        .arg("--model")
        .arg(&model)
        .arg("--engine")
        .arg(engine_bin())
        .args(["--message", "What color is the sky?"])
        .env("DISPLAY", &x.display)
        // No GPU under Xvfb: WebKitGTK's DMA-BUF renderer would draw nothing.
        .env("WEBKIT_DISABLE_DMABUF_RENDERER", "1")
        .env_remove("ENGINE_DESKTOP_PLANT")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    if let Some(plant) = plant {
        command.env("ENGINE_DESKTOP_PLANT", plant);
    }
    let mut shell = command.spawn().map_err(|e| e.to_string())?;
    let rx = lines(&mut shell);
    let mut leftover = Leftover(None);
    let result = (|| {
        let (base, pid) = wait_for(&rx, Duration::from_secs(120), "a ready server", |l| {
            let rest = l.strip_prefix("engine-desktop: server ready at ")?;
            let (base, rest) = rest.split_once(" (pid ")?;
            let pid = rest.split(',').next()?.parse::<u32>().ok()?;
            Some(Ok((base.to_owned(), pid)))
        })?;
        leftover.0 = Some(pid);
        let chat = format!("{base}/#/chat");
        wait_for(&rx, Duration::from_secs(60), "the chat page loading", |l| {
            let url = l.strip_prefix("engine-desktop: page loaded: ")?;
            if url.starts_with(&chat) {
                Some(Ok(()))
            } else if url.starts_with(&base) {
                Some(Err(format!("the window loaded {url}, not the chat page")))
            } else {
                None // the splash
            }
        })?;
        // The page sends its first message by itself and streams the answer.
        let deadline = Instant::now() + Duration::from_secs(60);
        let stats = loop {
            let stats: serde_json::Value = get(&base, "/stats")
                .and_then(|s| serde_json::from_str(&s).ok())
                .ok_or("no /stats from the server")?;
            if stats["completed"] == 1 {
                break stats;
            }
            if Instant::now() > deadline {
                return Err(format!("the page's request did not complete: {stats}"));
            }
            std::thread::sleep(Duration::from_millis(200));
        };
        eprintln!("server after the page's request: {stats}");
        if stats["completion_tokens"].as_u64().unwrap_or(0) < 3 {
            return Err(format!("too few tokens streamed: {stats}"));
        }
        // The server has sent everything; the screenshot waits until the page has painted it.
        x.wait_for_screen(Duration::from_secs(30), "the finished answer", &CHAT_DONE)?;
        x.screenshot(screenshot)?;

        let signal = match ending {
            Ending::Term => "-TERM",
            Ending::Kill => "-KILL",
            #[cfg(target_os = "linux")]
            Ending::Close => {
                close_window(&x.display)?;
                "the window's close"
            }
        };
        if signal.starts_with('-') {
            Command::new("kill")
                .args([signal, &shell.id().to_string()])
                .status()
                .map_err(|e| e.to_string())?;
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        let exit = loop {
            if let Some(exit) = shell.try_wait().map_err(|e| e.to_string())? {
                break exit;
            }
            if Instant::now() > deadline {
                return Err(format!("the shell did not exit within 30 s of {signal}"));
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        if ending != Ending::Kill {
            if !exit.success() {
                return Err(format!("the shell exited with {exit}"));
            }
            // Its exit path waited for the server's clean stop (pending caches written).
            wait_for(&rx, Duration::from_secs(5), "the server's stop", |l| {
                l.starts_with("engine-desktop: server stopped (exit status: 0)")
                    .then_some(Ok(()))
            })
            .map_err(|e| format!("the shell exited without stopping its server cleanly ({e})"))?;
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while alive(pid) || get(&base, "/v1/models").is_some() {
            if Instant::now() > deadline {
                return Err(format!(
                    "the server (pid {pid}) is still running after the shell exited"
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        leftover.0 = None;
        Ok(())
    })();
    let _ = shell.kill();
    let _ = shell.wait();
    result
}

fn e2e_dir() -> PathBuf {
    let dir = repo().join("target/e2e");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn the_shell_shows_the_chat_page_and_stops_its_server() {
    let shot = e2e_dir().join("desktop.png");
    let _ = std::fs::remove_file(&shot);
    if let Err(e) = run_shell(None, Ending::Term, &shot) {
        panic!("desktop smoke test failed: {e}");
    }
    let png = std::fs::read(&shot).unwrap();
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 10_000,
        "screenshot missing or blank ({} bytes)",
        png.len()
    );
    println!("screenshot: {}", shot.display());
}

#[cfg(target_os = "linux")]
#[test]
fn closing_the_window_stops_the_server() {
    let shot = e2e_dir().join("desktop-closed.png");
    if let Err(e) = run_shell(None, Ending::Close, &shot) {
        panic!("{e}");
    }
}

#[cfg(target_os = "linux")]
#[test]
fn a_killed_shell_takes_its_server_with_it() {
    let shot = e2e_dir().join("desktop-killed.png");
    if let Err(e) = run_shell(None, Ending::Kill, &shot) {
        panic!("{e}");
    }
}

#[test]
fn a_server_that_cannot_start_is_explained_in_the_window() {
    let x = Xvfb::start();
    let mut shell = Command::new(env!("CARGO_BIN_EXE_engine-desktop"))
        .args(["--model", "/no/such/model"])
        .arg("--engine")
        .arg(engine_bin())
        .env("DISPLAY", &x.display)
        .env("WEBKIT_DISABLE_DMABUF_RENDERER", "1")
        .env_remove("ENGINE_DESKTOP_PLANT")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let rx = lines(&mut shell);
    let shown = wait_for(&rx, Duration::from_secs(60), "the start failure", |l| {
        l.starts_with("engine-desktop: engine serve exited")
            .then(|| Ok(l.to_owned()))
    });
    let shot = e2e_dir().join("desktop-error.png");
    let painted = shown.is_ok().then(|| {
        x.wait_for_screen(Duration::from_secs(30), "the splash's error", &SPLASH_ERROR)
            .and_then(|()| x.screenshot(&shot))
    });
    let still_open = shell.try_wait().unwrap().is_none();
    let _ = shell.kill();
    let _ = shell.wait();
    let mut reason = vec![shown.unwrap()];
    painted.unwrap().unwrap();
    assert!(still_open, "the window closed instead of showing the error");
    // The reason (the server's own error) comes with it: the rest of the shell's stderr,
    // read until the reader thread has seen its end (the shell is gone).
    let deadline = Instant::now() + Duration::from_secs(10);
    while let Ok(line) = rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
        reason.push(line);
    }
    let reason = reason.join("\n");
    assert!(reason.contains("/no/such/model"), "{reason}");
    println!("screenshot: {}", shot.display());
}

// Planted defects: each must make its check fail.

#[test]
fn a_shell_that_skips_stopping_its_server_is_caught() {
    let shot = e2e_dir().join("desktop-planted.png");
    let err =
        run_shell(Some("keep-server"), Ending::Term, &shot).expect_err("planted defect not caught");
    assert!(err.contains("without stopping its server"), "{err}");
}

#[cfg(target_os = "linux")]
#[test]
fn a_killed_shell_without_the_parent_death_signal_is_caught() {
    let shot = e2e_dir().join("desktop-planted.png");
    let err =
        run_shell(Some("no-deathsig"), Ending::Kill, &shot).expect_err("planted defect not caught");
    assert!(err.contains("still running"), "{err}");
}

#[test]
fn a_shell_that_opens_the_wrong_page_is_caught() {
    let shot = e2e_dir().join("desktop-planted.png");
    let err =
        run_shell(Some("wrong-page"), Ending::Term, &shot).expect_err("planted defect not caught");
    assert!(err.contains("not the chat page"), "{err}");
}
