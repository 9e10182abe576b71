//! Bounds on waiting for other ranks. MLX's ring has no timeouts: a peer that never
//! connects leaves `accept()` blocked, and a stalled peer (stopped, or cut off without a
//! reset) leaves a collective waiting forever. A thread watches a deadline and ends the
//! process, naming what it waited for.

use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// A one-off deadline: unless dropped first, `on_expiry` runs and its status ends the
/// process.
pub struct Deadline {
    state: std::sync::Arc<(Mutex<bool>, Condvar)>,
}

impl Deadline {
    pub fn start(after: Duration, on_expiry: impl FnOnce() -> i32 + Send + 'static) -> Self {
        let state = std::sync::Arc::new((Mutex::new(false), Condvar::new()));
        let watched = state.clone();
        std::thread::spawn(move || {
            let (done, cv) = &*watched;
            let end = Instant::now() + after;
            let mut finished = done.lock().unwrap_or_else(|e| e.into_inner());
            while !*finished {
                let now = Instant::now();
                if now >= end {
                    std::process::exit(on_expiry());
                }
                finished = cv
                    .wait_timeout(finished, end - now)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
        });
        Deadline { state }
    }
}

impl Drop for Deadline {
    fn drop(&mut self) {
        let (done, cv) = &*self.state;
        *done.lock().unwrap_or_else(|e| e.into_inner()) = true;
        cv.notify_all();
    }
}

/// The step watchdog: armed once the model is loaded, it expects a [`tick`] at least every
/// timeout (each generated token, each shared round plan).
struct Steps {
    timeout: Mutex<Duration>,
    last: Mutex<Option<(Instant, &'static str)>>,
    cv: Condvar,
}

static STEPS: OnceLock<Steps> = OnceLock::new();

fn steps() -> &'static Steps {
    STEPS.get_or_init(|| Steps {
        timeout: Mutex::new(Duration::from_secs(60)),
        last: Mutex::new(None),
        cv: Condvar::new(),
    })
}

pub(super) fn set_timeout(t: Duration) {
    *steps().timeout.lock().unwrap_or_else(|e| e.into_inner()) = t;
}

/// A wait on the other ranks outside the step watchdog (the fingerprint exchange): unless
/// the returned deadline is dropped within `--dist-timeout`, the rank exits with
/// [`super::exit::STALLED`], naming `what` it waited for. None outside a group.
pub fn bound(what: &'static str) -> Option<Deadline> {
    if !super::active() {
        return None;
    }
    let timeout = *steps().timeout.lock().unwrap_or_else(|e| e.into_inner());
    Some(Deadline::start(timeout, move || {
        let g = super::group().map(|g| g.addresses.as_str()).unwrap_or("");
        eprintln!(
            "error: no progress for {:.1} s while waiting on the other ranks ({what}; {g}): \
             a peer stalled or is unreachable (--dist-timeout)",
            timeout.as_secs_f64()
        );
        super::exit::STALLED
    }))
}

/// Starts watching (idempotent): from now on a rank that goes `timeout` without a tick
/// exits with [`super::exit::STALLED`]. A no-op outside a group.
pub fn arm(what: &'static str) {
    if !super::active() {
        return;
    }
    let s = steps();
    let mut last = s.last.lock().unwrap_or_else(|e| e.into_inner());
    if last.is_some() {
        *last = Some((Instant::now(), what));
        return;
    }
    *last = Some((Instant::now(), what));
    drop(last);
    std::thread::spawn(|| watch(steps()));
    // A dead peer is seen by its sockets' hang-up, whatever MLX's ring does about it.
    if let Some(g) = super::group() {
        super::peers::watch(g);
    }
}

/// Progress: the rank finished a step that needed every rank (`what` names the next one).
pub fn tick(what: &'static str) {
    if !super::active() {
        return;
    }
    let s = steps();
    let mut last = s.last.lock().unwrap_or_else(|e| e.into_inner());
    if last.is_some() {
        *last = Some((Instant::now(), what));
    }
    s.cv.notify_all();
}

fn watch(s: &'static Steps) {
    let mut last = s.last.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        let timeout = *s.timeout.lock().unwrap_or_else(|e| e.into_inner());
        let Some((at, what)) = *last else { return };
        let waited = at.elapsed();
        if waited >= timeout {
            let g = super::group().map(|g| g.addresses.as_str()).unwrap_or("");
            eprintln!(
                "error: no progress for {:.1} s while waiting on the other ranks ({what}; {g}): \
                 a peer stalled or is unreachable (--dist-timeout)",
                waited.as_secs_f64()
            );
            std::process::exit(super::exit::STALLED);
        }
        last =
            s.cv.wait_timeout(last, timeout - waited)
                .unwrap_or_else(|e| e.into_inner())
                .0;
    }
}
