//! The `engine serve` child process: found, started on a port the OS picks, waited for
//! until `/v1/models` answers 200, and stopped when the window goes.

use std::collections::VecDeque;
use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

/// How long a stopping server gets to write its pending caches before it is killed.
const STOP_GRACE: Duration = Duration::from_secs(10);
/// Lines of the server's stderr kept to explain a failed start.
const STDERR_TAIL: usize = 20;

/// A running `engine serve`.
pub struct Server {
    child: Child,
    /// `http://127.0.0.1:PORT`
    pub base: String,
}

/// The engine binary: `--engine`, else `$ENGINE_BIN`, else `engine` next to this
/// executable (how a bundle ships it), else `engine` on PATH.
pub fn find_engine(explicit: Option<PathBuf>) -> PathBuf {
    if let Some(path) = explicit.or_else(|| std::env::var_os("ENGINE_BIN").map(PathBuf::from)) {
        return path;
    }
    let name = format!("engine{}", std::env::consts::EXE_SUFFIX);
    std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|dir| dir.join(&name)))
        .filter(|sibling| sibling.is_file())
        .unwrap_or_else(|| PathBuf::from(name))
}

/// Starts `engine serve --no-open --port 0 <serve_args>` and waits until it answers.
///
/// Port 0 lets the OS pick a free ephemeral port at bind time, so the shell never
/// collides with a server of the user's own (8080) and there is no gap between choosing a
/// port and binding it; the server prints the address it bound as its first line.
/// `status` is told what is happening, for the splash.
pub fn start(
    engine: &PathBuf,
    serve_args: &[OsString],
    status: impl Fn(&str),
) -> Result<Server, String> {
    let mut command = Command::new(engine);
    command
        .args(["serve", "--no-open", "--port", "0"])
        .args(serve_args)
        // The window shows the server's last lines if it fails; a backtrace would bury
        // its one-line reason.
        .env_remove("RUST_BACKTRACE")
        .env_remove("RUST_LIB_BACKTRACE")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    die_with_parent(&mut command);
    let mut child = command.spawn().map_err(|e| {
        format!(
            "could not run {}: {e}\nBuild the engine (`cargo build --release -p engine`) and pass \
             --engine PATH or set ENGINE_BIN.",
            engine.display()
        )
    })?;
    let tail = Arc::new(Mutex::new(VecDeque::new()));
    let mut stderr = Some(forward_stderr(
        child.stderr.take().expect("piped"),
        tail.clone(),
    ));
    let (address_tx, address_rx) = mpsc::channel();
    forward_stdout(child.stdout.take().expect("piped"), address_tx);
    status("Loading the model…");

    let started = Instant::now();
    let mut base: Option<String> = None;
    loop {
        if let Ok(Some(exit)) = child.try_wait() {
            // Its last words are read to the end of the pipe first.
            if let Some(reader) = stderr.take() {
                let _ = reader.join();
            }
            let tail = tail.lock().map(|t| t.iter().cloned().collect::<Vec<_>>());
            return Err(format!(
                "engine serve exited ({exit}) before it was ready.\n\n{}",
                tail.unwrap_or_default().join("\n")
            ));
        }
        if base.is_none() {
            if let Ok(address) = address_rx.try_recv() {
                status("Waiting for the server…");
                base = Some(address);
            }
        }
        if let Some(base) = &base {
            if models_ready(base) {
                eprintln!(
                    "engine-desktop: server ready at {base} (pid {}, {:.1} s)",
                    child.id(),
                    started.elapsed().as_secs_f64()
                );
                return Ok(Server {
                    child,
                    base: base.clone(),
                });
            }
        }
        thread::sleep(Duration::from_millis(100));
    }
}

impl Server {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Asks the server to stop (SIGTERM: it finishes writing pending SSD snapshots and
    /// exits), and kills it if it has not gone within the grace period.
    pub fn stop(mut self) {
        #[cfg(unix)]
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM);
        }
        #[cfg(not(unix))]
        let _ = self.child.kill();
        let deadline = Instant::now() + STOP_GRACE;
        while Instant::now() < deadline {
            if let Ok(Some(exit)) = self.child.try_wait() {
                eprintln!("engine-desktop: server stopped ({exit})");
                return;
            }
            thread::sleep(Duration::from_millis(50));
        }
        eprintln!("engine-desktop: server did not stop in time; killing it");
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// On Linux the server also goes if this process dies without running its exit path.
fn die_with_parent(command: &mut Command) {
    #[cfg(target_os = "linux")]
    if !crate::planted("no-deathsig") {
        use std::os::unix::process::CommandExt;
        unsafe {
            command.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                Ok(())
            });
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = command;
}

/// The server's first stdout line is `engine serve: <model> on http://ADDR`; its address
/// goes to `address`, and every line is passed on to our stdout.
fn forward_stdout(stdout: impl Read + Send + 'static, address: mpsc::Sender<String>) {
    thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(url) = line
                .rsplit(" on ")
                .next()
                .filter(|u| u.starts_with("http://"))
            {
                let _ = address.send(url.replace("0.0.0.0", "127.0.0.1"));
            }
            println!("{line}");
        }
    });
}

/// Passes the server's stderr on, keeping its last lines for an error message.
fn forward_stderr(
    stderr: impl Read + Send + 'static,
    tail: Arc<Mutex<VecDeque<String>>>,
) -> thread::JoinHandle<()> {
    thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            eprintln!("{line}");
            if let Ok(mut tail) = tail.lock() {
                if tail.len() == STDERR_TAIL {
                    tail.pop_front();
                }
                tail.push_back(line);
            }
        }
    })
}

/// Whether `GET {base}/v1/models` answers 200.
fn models_ready(base: &str) -> bool {
    let Some(host_port) = base.strip_prefix("http://") else {
        return false;
    };
    let Ok(mut stream) = TcpStream::connect(host_port) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    let request =
        format!("GET /v1/models HTTP/1.1\r\nHost: {host_port}\r\nConnection: close\r\n\r\n");
    if stream.write_all(request.as_bytes()).is_err() {
        return false;
    }
    let mut status_line = String::new();
    BufReader::new(stream).read_line(&mut status_line).is_ok()
        && status_line.split_whitespace().nth(1) == Some("200")
}
