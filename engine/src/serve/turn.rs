//! The process-wide MLX turn: MLX is not thread-safe, so when several model threads share
//! a process (`fleet`), one at a time does MLX work. A model thread takes the turn when it
//! starts (its load is MLX work), gives it up around every wait (for a job, for a client:
//! `outside`) and offers it at each step (`pass`: a fair handoff, so two busy models
//! alternate step by step instead of one starving the other). With one model nobody waits
//! for it and each call is an uncontended lock.
//!
//! The turn is a ticket lock: every taker draws the next ticket and waits until it is
//! served, so the order is first come, first served, whether a waiter is parked or still
//! on its way to park. `pass` with a waiter serves the next ticket and draws a new one
//! behind it, so the waiter steps before the passer steps again (a spin-then-park lock's
//! fair unlock hands off only to a parked waiter, and under load two busy threads could
//! run many steps each without a switch). The held ticket lives in a thread-local so that
//! the waits deep in the lanes need no plumbing; a thread that ends holding it gives it up.

use std::cell::RefCell;

use parking_lot::{Condvar, Mutex};

/// Tickets drawn so far and the one being served: the holder's ticket is `serving` while
/// `serving < drawn`; `drawn - serving - 1` threads wait.
struct Tickets {
    drawn: u64,
    serving: u64,
}

static TICKETS: Mutex<Tickets> = parking_lot::const_mutex(Tickets {
    drawn: 0,
    serving: 0,
});
static SERVED: Condvar = Condvar::new();

/// The turn held by this thread; dropping it serves the next ticket.
struct Held;

impl Drop for Held {
    fn drop(&mut self) {
        let mut t = TICKETS.lock();
        t.serving += 1;
        SERVED.notify_all();
    }
}

thread_local! {
    static HELD: RefCell<Option<Held>> = const { RefCell::new(None) };
}

/// Draws a ticket (under the lock already taken) and waits until it is served.
fn wait_for_ticket(t: &mut parking_lot::MutexGuard<'_, Tickets>) {
    let mine = t.drawn;
    t.drawn += 1;
    while t.serving != mine {
        SERVED.wait(t);
    }
}

/// Takes the turn for this thread (waiting for it); a no-op where it holds it already.
pub fn enter() {
    HELD.with(|h| {
        let mut h = h.borrow_mut();
        if h.is_none() {
            wait_for_ticket(&mut TICKETS.lock());
            *h = Some(Held);
        }
    });
}

/// Takes the turn, then runs `work`, keeping the turn after (a model thread's start).
pub fn keep<T>(work: impl FnOnce() -> T) -> T {
    enter();
    work()
}

/// Gives the turn up (fairly: the longest waiter gets it next); a no-op where this thread
/// does not hold it.
pub fn leave() {
    let held = HELD.with(|h| h.borrow_mut().take());
    drop(held);
}

/// Whether this thread holds the turn.
pub fn holds() -> bool {
    HELD.with(|h| h.borrow().is_some())
}

/// Runs `wait` (which must do no MLX work) without the turn, taking it back after, where
/// this thread held it.
pub fn outside<T>(wait: impl FnOnce() -> T) -> T {
    if !holds() {
        return wait();
    }
    leave();
    let out = wait();
    enter();
    out
}

/// Hands the turn to the longest waiter, if one waits, and takes it back after that
/// thread's step (a no-op when nobody waits or this thread does not hold it).
pub fn pass() {
    // Planted: the turn is never offered, so a busy model keeps it to its request's end
    // (caught by engine/tests/it/serve_fleet.rs: two busy models' streams do not overlap).
    if crate::plant::is(crate::plant::Defect::TurnNeverPassed) {
        return;
    }
    if !holds() {
        return;
    }
    let mut t = TICKETS.lock();
    if t.drawn - t.serving > 1 {
        // Serve the waiter and queue behind it in one critical section, so no third
        // thread can slip in between and the waiter's step comes first.
        t.serving += 1;
        SERVED.notify_all();
        wait_for_ticket(&mut t);
    }
}

/// Runs `work` (MLX work off a model thread) with the turn.
pub fn with<T>(work: impl FnOnce() -> T) -> T {
    let held = holds();
    enter();
    let out = work();
    if !held {
        leave();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    /// Two threads that each hold the turn across 2,000 "steps" and pass it at each one never
    /// overlap and strictly alternate, however the OS schedules them: a pass with a waiter
    /// always lets the waiter's step come first. Each first passes the turn until the other
    /// has had it once (bounded), so the check does not depend on when the OS starts the
    /// second thread.
    #[test]
    fn busy_threads_alternate_and_never_overlap() {
        let inside = Arc::new(AtomicUsize::new(0));
        let log = Arc::new(parking_lot::Mutex::new(Vec::new()));
        let started = Arc::new(AtomicUsize::new(0));
        let threads: Vec<_> = (0..2)
            .map(|who| {
                let (inside, log, started) = (inside.clone(), log.clone(), started.clone());
                std::thread::spawn(move || {
                    enter();
                    started.fetch_add(1, Ordering::SeqCst);
                    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
                    while started.load(Ordering::SeqCst) < 2 {
                        assert!(
                            std::time::Instant::now() < deadline,
                            "the other thread never got the turn"
                        );
                        pass();
                        std::thread::yield_now();
                    }
                    for _ in 0..2000 {
                        assert_eq!(inside.fetch_add(1, Ordering::SeqCst), 0, "overlap");
                        log.lock().push(who);
                        std::thread::yield_now();
                        inside.fetch_sub(1, Ordering::SeqCst);
                        pass();
                    }
                    outside(std::thread::yield_now);
                    assert!(holds());
                    leave();
                    assert!(!holds());
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let log = log.lock();
        assert_eq!(log.len(), 4000);
        // Once both are in, every step is followed by the other thread's step.
        let repeats = log.windows(2).filter(|w| w[0] == w[1]).count();
        assert_eq!(
            repeats, 0,
            "a thread stepped twice in a row {repeats} times"
        );
    }
}
