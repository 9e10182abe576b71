//! The progress every bench suite shows on stderr while it runs: legs done / total, what
//! runs now (model, stack, setting), elapsed time and an ETA. On a terminal it is a bar
//! redrawn in place; elsewhere (a log, CI) a plain line as each leg ends. Stdout is left to
//! the suite's final table.

use std::cell::{Cell, RefCell};
use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// One suite's progress over its legs (see the module docs).
pub struct Progress {
    bar: ProgressBar,
    plain: bool,
    suite: String,
    total: Cell<usize>,
    done: Cell<usize>,
    started: Instant,
    leg_started: Cell<Instant>,
    current: RefCell<String>,
}

impl Progress {
    /// Progress for `total` legs of `suite`, drawn as a bar when stderr is a terminal.
    pub fn new(suite: &str, total: usize) -> Self {
        Self::with_terminal(suite, total, std::io::stderr().is_terminal())
    }

    fn with_terminal(suite: &str, total: usize, tty: bool) -> Self {
        let bar = if tty {
            let b = ProgressBar::with_draw_target(Some(total as u64), ProgressDrawTarget::stderr());
            b.set_style(
                ProgressStyle::with_template(
                    "{prefix} [{bar:20}] {pos}/{len} legs, {elapsed} elapsed, ETA {eta} · {wide_msg}",
                )
                .expect("a valid template")
                .progress_chars("=> "),
            );
            b.enable_steady_tick(Duration::from_millis(250));
            b
        } else {
            ProgressBar::hidden()
        };
        bar.set_prefix(format!("bench {suite}"));
        let now = Instant::now();
        Progress {
            bar,
            plain: !tty,
            suite: suite.to_owned(),
            total: Cell::new(total),
            done: Cell::new(0),
            started: now,
            leg_started: Cell::new(now),
            current: RefCell::new(String::new()),
        }
    }

    /// `n` more legs than announced (a suite that adds rounds as it goes).
    pub fn add_legs(&self, n: usize) {
        self.total.set(self.total.get() + n);
        self.bar.inc_length(n as u64);
    }

    /// A leg starts: `what` names it (model, stack, setting).
    pub fn start(&self, what: impl Into<String>) {
        let what = what.into();
        self.bar.set_message(what.clone());
        *self.current.borrow_mut() = what;
        self.leg_started.set(Instant::now());
    }

    /// The current leg ended (failed legs count too: the ETA is about the legs left).
    pub fn done(&self) {
        let done = self.done.get() + 1;
        self.done.set(done);
        self.bar.inc(1);
        if self.plain {
            let elapsed = self.started.elapsed();
            eprintln!(
                "{}",
                plain_line(&LegLine {
                    suite: &self.suite,
                    done,
                    total: self.total.get(),
                    what: &self.current.borrow(),
                    leg: self.leg_started.get().elapsed(),
                    elapsed,
                    eta: eta(done, self.total.get(), elapsed),
                })
            );
        }
    }

    /// A message above the bar (or a plain line).
    pub fn println(&self, line: impl AsRef<str>) {
        if self.plain {
            eprintln!("{}", line.as_ref());
        } else {
            self.bar.println(line.as_ref());
        }
    }

    /// Removes the bar (the suite's table follows on stdout).
    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.bar.finish_and_clear();
    }
}

/// What a plain progress line says.
pub struct LegLine<'a> {
    pub suite: &'a str,
    pub done: usize,
    pub total: usize,
    pub what: &'a str,
    pub leg: Duration,
    pub elapsed: Duration,
    pub eta: Option<Duration>,
}

/// Time left at the mean pace of the legs so far (None before the first leg ends).
pub fn eta(done: usize, total: usize, elapsed: Duration) -> Option<Duration> {
    if done == 0 {
        return None;
    }
    let left = total.saturating_sub(done) as f64;
    Some(Duration::from_secs_f64(
        elapsed.as_secs_f64() / done as f64 * left,
    ))
}

/// `1m05s`, `42s`, `3.2s`.
pub fn human(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s < 10.0 {
        format!("{s:.1}s")
    } else if s < 60.0 {
        format!("{s:.0}s")
    } else {
        let s = s.round() as u64;
        format!("{}m{:02}s", s / 60, s % 60)
    }
}

/// `bench decode: 3/12 legs (tiny · mlx-lm, 4.1s); 12s elapsed, ETA 36s`.
pub fn plain_line(l: &LegLine) -> String {
    let eta = l.eta.map_or("?".to_owned(), human);
    format!(
        "bench {}: {}/{} legs ({}, {}); {} elapsed, ETA {eta}",
        l.suite,
        l.done,
        l.total,
        if l.what.is_empty() { "-" } else { l.what },
        human(l.leg),
        human(l.elapsed)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eta_and_plain_line() {
        assert_eq!(eta(0, 10, Duration::from_secs(5)), None);
        assert_eq!(
            eta(3, 12, Duration::from_secs(12)),
            Some(Duration::from_secs(36))
        );
        assert_eq!(
            eta(4, 4, Duration::from_secs(9)),
            Some(Duration::from_secs(0))
        );
        let line = plain_line(&LegLine {
            suite: "decode",
            done: 3,
            total: 12,
            what: "tiny · mlx-lm",
            leg: Duration::from_millis(4100),
            elapsed: Duration::from_secs(12),
            eta: Some(Duration::from_secs(65)),
        });
        assert_eq!(
            line,
            "bench decode: 3/12 legs (tiny · mlx-lm, 4.1s); 12s elapsed, ETA 1m05s"
        );
    }

    #[test]
    fn a_hidden_progress_counts_legs() {
        let p = Progress::with_terminal("restart", 2, false);
        p.start("tiny · fresh");
        p.done();
        assert_eq!(p.done.get(), 1);
        assert_eq!(&*p.current.borrow(), "tiny · fresh");
        p.finish();
        // The terminal bar's template parses (it is drawn only on a terminal).
        let bar = Progress::with_terminal("restart", 2, true);
        bar.start("tiny · restored");
        bar.done();
        assert_eq!(bar.bar.position(), 1);
        bar.finish();
    }
}
