//! `CompileDecode::WherePays`: the session times its first one-token steps on each path and
//! keeps the faster one. Both paths give the same logits bit for bit (the compiled step is
//! only turned on where that holds, `Session::compiled_decode_is_exact`), so the choice
//! changes the speed and nothing else.
//!
//! Why measure: compiling fuses the elementwise chains and saves host work per step, but
//! attends over a bounded prefix with masked positions and retraces at each new bound. On
//! this CPU backend that wins where dispatch dominates (bench `tiny`: compiled 1.04–1.09× of
//! eager) and loses where the step is one long stream of GEMMs with the host already hidden
//! (`small`: 0.98×); on a GPU the host side is expected to dominate (not measured here). No
//! static rule fits every backend and model size; a few steps of each path do.
//!
//! The steps are timed from one one-token call to the next, which in the pipelined loop is
//! one step of throughput. The first [`SKIP`] intervals of each phase are dropped: they
//! straddle the switch (a step of the other path still in flight) and hold the trace.

use std::time::{Duration, Instant};

/// One-token steps run on each path before the choice.
pub const PHASE: usize = 16;
/// Intervals dropped at the start of each phase.
pub const SKIP: usize = 2;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    Eager,
    Compiled,
}

/// The first `2 × PHASE` one-token steps: compiled, then eager, each interval timed. The
/// context grows meanwhile, so the later (eager) phase's steps attend over `PHASE` more
/// positions: the order leans the choice toward the compiled step, the one that was the
/// default before the probe (on `small` ~0.3 ms of a 57 ms step; the gaps measured were
/// 2.7–3.3 ms).
#[derive(Debug, Default)]
pub struct CompileProbe {
    calls: usize,
    last: Option<Instant>,
    eager: Vec<Duration>,
    compiled: Vec<Duration>,
    choice: Option<Path>,
}

impl CompileProbe {
    /// The path for the step starting `now`; records the interval since the last call,
    /// attributed to the path that call took. After the last probe step it returns the
    /// choice (`decided` is then Some).
    pub fn next(&mut self, now: Instant) -> Path {
        if let Some(path) = self.choice {
            return path;
        }
        if let Some(last) = self.last.replace(now) {
            let prev = self.calls - 1;
            let (phase, at) = match prev < PHASE {
                true => (&mut self.compiled, prev),
                false => (&mut self.eager, prev - PHASE),
            };
            if at >= SKIP {
                phase.push(now - last);
            }
        }
        self.calls += 1;
        let full = PHASE - SKIP;
        if self.eager.len() >= full && self.compiled.len() >= full {
            self.choice = Some(choose(&self.eager, &self.compiled));
        }
        match self.choice {
            Some(path) => path,
            None if self.calls <= PHASE => Path::Compiled,
            None => Path::Eager,
        }
    }

    /// The choice, once both phases are timed.
    pub fn decided(&self) -> Option<Path> {
        self.choice
    }

    /// The median intervals timed (eager, compiled), for the profile line.
    pub fn medians(&self) -> Option<(Duration, Duration)> {
        self.choice
            .map(|_| (median(&self.eager), median(&self.compiled)))
    }
}

fn median(times: &[Duration]) -> Duration {
    let mut t = times.to_vec();
    t.sort();
    t[t.len() / 2]
}

/// Compiled unless eager's median interval is strictly shorter.
pub fn choose(eager: &[Duration], compiled: &[Duration]) -> Path {
    match median(eager) < median(compiled) {
        true => Path::Eager,
        false => Path::Compiled,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(eager_ms: u64, compiled_ms: u64) -> (Vec<Path>, Option<Path>) {
        let mut p = CompileProbe::default();
        let mut now = Instant::now();
        let mut paths = Vec::new();
        for _ in 0..2 * PHASE + 3 {
            let path = p.next(now);
            paths.push(path);
            // A trace-sized outlier in the first interval, which SKIP drops.
            let first = paths.len() == 1;
            let ms = match (path, first) {
                (_, true) => 500,
                (Path::Eager, _) => eager_ms,
                (Path::Compiled, _) => compiled_ms,
            };
            now += Duration::from_millis(ms);
        }
        (paths, p.decided())
    }

    #[test]
    fn compiled_then_eager_then_the_faster() {
        let (paths, choice) = run(10, 9);
        assert!(paths[..PHASE].iter().all(|&p| p == Path::Compiled));
        assert!(paths[PHASE..2 * PHASE].iter().all(|&p| p == Path::Eager));
        assert_eq!(choice, Some(Path::Compiled));
        assert!(paths[2 * PHASE..].iter().all(|&p| p == Path::Compiled));

        let (paths, choice) = run(9, 10);
        assert_eq!(choice, Some(Path::Eager));
        assert!(paths[2 * PHASE..].iter().all(|&p| p == Path::Eager));
    }

    #[test]
    fn a_tie_keeps_compiled_and_outliers_do_not_decide() {
        assert_eq!(run(10, 10).1, Some(Path::Compiled));
        let ms = Duration::from_millis;
        let mut eager = vec![ms(10); PHASE - SKIP];
        eager[0] = ms(1);
        eager[1] = ms(1);
        assert_eq!(choose(&eager, &[ms(9); PHASE - SKIP]), Path::Compiled);
    }

    #[test]
    fn no_choice_before_both_phases_are_timed() {
        let mut p = CompileProbe::default();
        let t = Instant::now();
        for i in 0..2 * PHASE {
            p.next(t + Duration::from_millis(i as u64));
            assert_eq!(p.decided(), None, "call {i}");
        }
        p.next(t + Duration::from_millis(2 * PHASE as u64));
        assert!(p.decided().is_some());
    }
}
