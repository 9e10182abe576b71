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
//!
//! A long-lived owner of many sessions (a server's model thread) shares one [`Memo`]: a
//! session starting where a recent probe chose (same model, same context-length octave,
//! contexts under 256 counted as one, same KV quantization) takes that path from its first
//! step instead of timing both. The probe
//! costs a session its `PHASE` eager steps (on tiny-llama-trained 2.2 ms against 1.5 ms
//! compiled: ~13 % of a 56-token answer), so served requests paid it on every answer. Every
//! [`REUSES`] + 1-th session at a key probes again, so a choice made on a noisy moment does
//! not stick.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
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
    /// Whether no step has asked for a path yet (the moment a memo's choice can be adopted).
    pub fn untouched(&self) -> bool {
        self.calls == 0 && self.choice.is_none()
    }

    /// Takes `path` without timing (a memo's recent choice at the session's key).
    pub fn adopt(&mut self, path: Path) {
        self.choice = Some(path);
    }

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
        let timed = !self.eager.is_empty() && !self.compiled.is_empty();
        self.choice
            .filter(|_| timed)
            .map(|_| (median(&self.eager), median(&self.compiled)))
    }
}

/// Sessions after a probe's choice at one key take it without timing this many times.
pub const REUSES: usize = 15;

/// Where a probe's choice holds: the model (its address while it lives: a server's sessions
/// share it), the octave of the context length the session decoded from (`octave`: the
/// compiled step's cost grows with the bound it attends over), and whether KV is quantized.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MemoKey {
    model: usize,
    octave: u32,
    quantized: bool,
}

impl MemoKey {
    pub fn new(model: &dyn crate::model::LanguageModel, context: i32, quantized: bool) -> Self {
        MemoKey {
            model: model as *const dyn crate::model::LanguageModel as *const () as usize,
            octave: octave(context),
            quantized,
        }
    }
}

/// The bit length of a context length, contexts under two attention bounds of the compiled
/// step (`compiled::BOUND_STEP`, 128) counted as one: 8 for 0–255, 9 for 256–511, 10 for
/// 512–1023, … (short prompts differ in length much, and the step attends over 128 or 256
/// positions for all of them alike).
fn octave(context: i32) -> u32 {
    u32::BITS - (context.max(super::compiled::BOUND_STEP) as u32).leading_zeros()
}

#[derive(Debug, Clone, Copy)]
struct Kept {
    path: Path,
    reused: usize,
}

/// Probe choices shared by the sessions of one owner (`SessionOptions::probe_memo`); the
/// default shares nothing, and every session probes for itself.
#[derive(Clone, Default)]
pub struct Memo(Option<Arc<Mutex<HashMap<MemoKey, Kept>>>>);

impl Memo {
    /// A memo whose clones share their choices.
    pub fn shared() -> Self {
        Memo(Some(Arc::default()))
    }

    /// The path a session at `key` takes without timing, when a recent probe chose one; counts
    /// the use. None once it was reused `REUSES` times (that session probes again).
    pub fn adopt(&self, key: MemoKey) -> Option<Path> {
        let mut kept = self.0.as_ref()?.lock().ok()?;
        let entry = kept.get_mut(&key)?;
        if entry.reused >= REUSES {
            kept.remove(&key);
            return None;
        }
        entry.reused += 1;
        Some(entry.path)
    }

    /// A probe's choice at `key`, for the sessions after it.
    pub fn record(&self, key: MemoKey, path: Path) {
        if let Some(mut kept) = self.0.as_ref().and_then(|m| m.lock().ok()) {
            kept.insert(key, Kept { path, reused: 0 });
        }
    }
}

impl std::fmt::Debug for Memo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "Memo(shared)"
        } else {
            "Memo(none)"
        })
    }
}

/// Options compare equal whatever their memo: it changes which path runs first, never a
/// logit (both paths are bit-exact where the probe runs).
impl PartialEq for Memo {
    fn eq(&self, _: &Self) -> bool {
        true
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

    fn key(octave: u32) -> MemoKey {
        MemoKey {
            model: 1,
            octave,
            quantized: false,
        }
    }

    #[test]
    fn a_memo_hands_a_choice_to_the_next_sessions_then_probes_again() {
        let memo = Memo::shared();
        let twin = memo.clone();
        assert_eq!(memo.adopt(key(6)), None, "nothing chosen yet");
        memo.record(key(6), Path::Eager);
        for i in 0..REUSES {
            assert_eq!(twin.adopt(key(6)), Some(Path::Eager), "reuse {i}");
        }
        assert_eq!(
            twin.adopt(key(6)),
            None,
            "the session after the reuses probes"
        );
        assert_eq!(twin.adopt(key(6)), None, "until its probe records again");
        twin.record(key(6), Path::Compiled);
        assert_eq!(memo.adopt(key(6)), Some(Path::Compiled));
        assert_eq!(memo.adopt(key(7)), None, "another octave probes for itself");
        let quantized = MemoKey {
            quantized: true,
            ..key(6)
        };
        assert_eq!(
            memo.adopt(quantized),
            None,
            "quantized KV probes for itself"
        );
    }

    #[test]
    fn the_default_memo_shares_nothing() {
        let memo = Memo::default();
        memo.record(key(6), Path::Eager);
        assert_eq!(memo.clone().adopt(key(6)), None);
    }

    #[test]
    fn an_adopted_choice_holds_from_the_first_step_and_times_nothing() {
        let mut p = CompileProbe::default();
        assert!(p.untouched());
        p.adopt(Path::Eager);
        let t = Instant::now();
        for i in 0..3 * PHASE {
            assert_eq!(p.next(t + Duration::from_millis(i as u64)), Path::Eager);
        }
        assert_eq!(p.decided(), Some(Path::Eager));
        assert_eq!(p.medians(), None, "nothing was timed");
    }

    #[test]
    fn context_octaves_split_at_powers_of_two_from_256() {
        let o = octave;
        assert_eq!((o(0), o(5), o(127), o(128), o(255)), (8, 8, 8, 8, 8));
        assert_eq!((o(256), o(511), o(512), o(16_511)), (9, 9, 10, 15));
    }
}
