//! engine-desktop: a window around `engine serve`. It shows a "starting…" splash, starts
//! the server on a port the OS picks, loads the server's own chat page (`/#/chat`) once
//! `/v1/models` answers, and stops the server when the window closes or the process is
//! asked to stop (SIGTERM / Ctrl-C).

mod server;

use std::ffi::OsString;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use clap::Parser;
use percent_encoding::{utf8_percent_encode, NON_ALPHANUMERIC};
use tauri::webview::PageLoadEvent;
use tauri::{RunEvent, Url, WebviewUrl, WebviewWindow, WebviewWindowBuilder};

#[derive(Parser, Debug)]
#[command(
    version,
    about = "A desktop window around `engine serve` and its chat page",
    after_help = "Flags after `--` go to `engine serve` (e.g. -- --prompt-cache-size 4)."
)]
struct Options {
    /// Model directory (Hugging Face layout) for `engine serve --model`.
    #[arg(long, env = "ENGINE_DESKTOP_MODEL")]
    model: Option<PathBuf>,
    /// The engine binary (default: $ENGINE_BIN, `engine` next to this program, or on PATH).
    #[arg(long)]
    engine: Option<PathBuf>,
    /// Open the chat with this first message (the page's #/chat?q= link).
    #[arg(long)]
    message: Option<String>,
    /// More `engine serve` flags.
    #[arg(last = true)]
    serve_args: Vec<OsString>,
}

/// Test-only planted defects, for the smoke test's proof that it can fail
/// (`ENGINE_DESKTOP_PLANT=keep-server|no-deathsig|wrong-page`).
pub(crate) fn planted(defect: &str) -> bool {
    std::env::var("ENGINE_DESKTOP_PLANT").is_ok_and(|v| v == defect)
}

type Running = Arc<Mutex<Option<server::Server>>>;

fn main() {
    let options = Options::parse();
    let running: Running = Arc::default();
    let on_exit = running.clone();
    let app = tauri::Builder::default()
        .setup(move |app| {
            let window =
                WebviewWindowBuilder::new(app, "main", WebviewUrl::App("index.html".into()))
                    .title("engine")
                    .inner_size(960.0, 680.0)
                    // Files dropped on the window go to the page (its drop handler attaches
                    // images) instead of to Tauri's own handler, which claims every file
                    // drop for IPC events (this shell has no IPC) and on Linux and macOS
                    // keeps it from the webview.
                    .disable_drag_drop_handler()
                    .on_page_load(|_, payload| {
                        if payload.event() == PageLoadEvent::Finished {
                            eprintln!("engine-desktop: page loaded: {}", payload.url());
                        }
                    })
                    .build()?;
            #[cfg(unix)]
            stop_on_signals(app.handle().clone());
            let running = running.clone();
            std::thread::spawn(move || launch(&options, &window, &running));
            Ok(())
        })
        .build(tauri::generate_context!())
        .expect("could not start the desktop window (is a display available?)");
    app.run(move |_, event| {
        if let RunEvent::Exit = event {
            let server = on_exit.lock().ok().and_then(|mut s| s.take());
            match server {
                Some(_) if planted("keep-server") => {}
                Some(server) => server.stop(),
                None => {}
            }
        }
    });
}

/// Starts the server and points the window at its chat page, or shows why it could not.
fn launch(options: &Options, window: &WebviewWindow, running: &Running) {
    let status = |text: &str| {
        let _ = window.eval(format!(
            "window.setStatus && window.setStatus({})",
            js_string(text)
        ));
    };
    let Some(model) = &options.model else {
        return show_error(
            window,
            "No model chosen. Start engine-desktop with --model DIR (a model directory in \
             Hugging Face layout) or set ENGINE_DESKTOP_MODEL.",
        );
    };
    let engine = server::find_engine(options.engine.clone());
    let mut serve_args = vec![OsString::from("--model"), model.clone().into_os_string()];
    serve_args.extend(options.serve_args.iter().cloned());
    let server = match server::start(&engine, &serve_args, status) {
        Ok(server) => server,
        Err(message) => return show_error(window, &message),
    };
    let page = chat_url(&server.base, options.message.as_deref());
    eprintln!("engine-desktop: server pid {}", server.pid());
    if let Ok(mut slot) = running.lock() {
        *slot = Some(server);
    }
    match page {
        Ok(url) => {
            if let Err(e) = window.navigate(url) {
                show_error(window, &format!("could not open the chat page: {e}"));
            }
        }
        Err(message) => show_error(window, &message),
    }
    // On Linux the server is told to stop when the thread that started it ends
    // (PR_SET_PDEATHSIG is per thread), so this thread lives as long as the app.
    loop {
        std::thread::park();
    }
}

/// `{base}/#/chat`, with `?q=<message>` when there is a first message.
fn chat_url(base: &str, message: Option<&str>) -> Result<Url, String> {
    let mut url = Url::parse(base).map_err(|e| format!("bad server address {base}: {e}"))?;
    if planted("wrong-page") {
        url.set_path("/no-such-page");
    }
    let fragment = match message {
        Some(text) => format!("/chat?q={}", utf8_percent_encode(text, NON_ALPHANUMERIC)),
        None => "/chat".to_owned(),
    };
    url.set_fragment(Some(&fragment));
    Ok(url)
}

/// A JavaScript string literal holding `text`.
fn js_string(text: &str) -> String {
    serde_json::Value::from(text).to_string()
}

fn show_error(window: &WebviewWindow, message: &str) {
    eprintln!("engine-desktop: {message}");
    let _ = window.eval(format!(
        "window.showError && window.showError({})",
        js_string(message)
    ));
}

/// SIGTERM and Ctrl-C close the app through its normal exit path, so the server is
/// stopped (and writes its pending caches) instead of being orphaned.
#[cfg(unix)]
fn stop_on_signals(app: tauri::AppHandle) {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let Ok(mut signals) = signal_hook::iterator::Signals::new([SIGTERM, SIGINT]) else {
        return;
    };
    std::thread::spawn(move || {
        if signals.forever().next().is_some() {
            app.exit(0);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_links_carry_an_encoded_first_message() {
        let url = chat_url("http://127.0.0.1:4242", Some("Why & how? #1")).unwrap();
        assert_eq!(
            url.as_str(),
            "http://127.0.0.1:4242/#/chat?q=Why%20%26%20how%3F%20%231"
        );
        let url = chat_url("http://127.0.0.1:4242", None).unwrap();
        assert_eq!(url.as_str(), "http://127.0.0.1:4242/#/chat");
    }
}
