//! `ENGINE_DECODE_PROFILE=1`: where a plain decode loop spends each step, the same phases
//! `benches/decode_profile.py` times in mlx-lm's `generate_step` loop. Per step: building
//! the next step's graph on the host (`build`: the model forward and the sampler), queuing
//! it (`async_eval`, which also blocks while MLX's scheduler has too many tasks in flight),
//! waiting for the current id (`wait`); per thread, CPU time from
//! `/proc/self/task/*/schedstat` (ns on a CPU, independent of what else the machine runs).
//! One JSON line on stderr when the loop ends. `ENGINE_DECODE_DOT=FILE` also writes the
//! graph of the 9th queued step (`ENGINE_DECODE_DOT_STEP=N`: the Nth; by default steps 1–16
//! are compiled and 17–32 eager while the session times both, `probe.rs`) with mlx-c's
//! `mlx_export_to_dot` and counts its primitives. The line also gives the probe's choice.
//! Off (the default), each hook is one branch on a cached flag.

use std::collections::HashMap;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use mlx_rs::Array;

/// Whether ENGINE_DECODE_PROFILE is set (read once).
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("ENGINE_DECODE_PROFILE").is_some_and(|v| v != "0"))
}

fn thread_cpu_ns() -> HashMap<String, u64> {
    let mut out = HashMap::new();
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return out;
    };
    for entry in dir.flatten() {
        let tid = entry.file_name().to_string_lossy().into_owned();
        let path = entry.path().join("schedstat");
        if let Some(ns) = std::fs::read_to_string(path)
            .ok()
            .and_then(|s| s.split_whitespace().next()?.parse().ok())
        {
            out.insert(tid, ns);
        }
    }
    out
}

/// CLOCK_MONOTONIC in ns (the clock `perf record -k mono` stamps events with), so a
/// scheduler trace can be cut to the decode loop.
#[cfg(target_os = "linux")]
fn monotonic_ns() -> i64 {
    extern "C" {
        fn clock_gettime(clock: i32, ts: *mut [i64; 2]) -> i32;
    }
    let mut ts = [0i64; 2];
    // SAFETY: CLOCK_MONOTONIC (1) with a timespec-sized buffer.
    unsafe { clock_gettime(1, &mut ts) };
    ts[0] * 1_000_000_000 + ts[1]
}

#[cfg(not(target_os = "linux"))]
fn monotonic_ns() -> i64 {
    0
}

fn this_tid() -> Option<String> {
    let link = std::fs::read_link("/proc/thread-self").ok()?;
    Some(link.file_name()?.to_string_lossy().into_owned())
}

/// Which phase of a step a duration belongs to.
#[derive(Clone, Copy)]
pub enum Phase {
    Build,
    AsyncEval,
    Wait,
}

/// The running totals of one decode loop.
pub struct Profile {
    steps: usize,
    phases: [Duration; 3],
    cpu0: HashMap<String, u64>,
    t0: Instant,
    primitives: Option<usize>,
    /// Each step's build time in µs (a retrace of the compiled step shows as an outlier).
    builds: Vec<u32>,
    /// When each step was queued: their differences are step times, and their low
    /// percentiles what a step takes when nothing else on the machine interferes.
    marks: Vec<Instant>,
    mono0: i64,
    /// The compile probe's choice and its median eager / compiled intervals (µs).
    choice: Option<(&'static str, f64, f64)>,
}

impl Profile {
    /// A profile when ENGINE_DECODE_PROFILE is set.
    pub fn start() -> Option<Self> {
        enabled().then(|| Profile {
            steps: 0,
            phases: [Duration::ZERO; 3],
            cpu0: thread_cpu_ns(),
            t0: Instant::now(),
            primitives: None,
            builds: Vec::new(),
            marks: Vec::new(),
            mono0: monotonic_ns(),
            choice: None,
        })
    }

    /// Whether the compile probe's choice is recorded.
    pub fn has_choice(&self) -> bool {
        self.choice.is_some()
    }

    /// Records the compile probe's choice (once it has one).
    pub fn choice(&mut self, path: super::probe::Path, eager: Duration, compiled: Duration) {
        let name = match path {
            super::probe::Path::Eager => "eager",
            super::probe::Path::Compiled => "compiled",
        };
        let us = |d: Duration| d.as_secs_f64() * 1e6;
        self.choice = Some((name, us(eager), us(compiled)));
    }

    pub fn add(&mut self, phase: Phase, since: Instant) {
        let d = since.elapsed();
        self.phases[phase as usize] += d;
        if let Phase::Build = phase {
            self.builds.push(d.as_micros() as u32);
        }
    }

    /// A step ended; the graph of `outputs` (not yet queued) is written out at the 9th.
    pub fn step(&mut self, outputs: &[&Array]) {
        self.steps += 1;
        self.marks.push(Instant::now());
        static DOT_STEP: OnceLock<usize> = OnceLock::new();
        let dot_step = *DOT_STEP.get_or_init(|| {
            std::env::var("ENGINE_DECODE_DOT_STEP")
                .ok()
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(9)
        });
        if self.steps == dot_step {
            if let Some(path) = std::env::var_os("ENGINE_DECODE_DOT") {
                self.primitives = export_dot(std::path::Path::new(&path), outputs);
            }
        }
    }

    /// The summary line.
    pub fn report(&self) -> serde_json::Value {
        let n = self.steps.max(1) as f64;
        let wall = self.t0.elapsed().as_secs_f64();
        let cpu1 = thread_cpu_ns();
        let me = this_tid().unwrap_or_default();
        let per = |tid: &String, ns: &u64| (ns - self.cpu0.get(tid).copied().unwrap_or(0)) as f64;
        let mut others: Vec<f64> = cpu1
            .iter()
            .filter(|(t, _)| **t != me)
            .map(|(t, ns)| per(t, ns) / n / 1e3)
            .collect();
        others.sort_by(|a, b| b.total_cmp(a));
        let us = |d: Duration| d.as_secs_f64() / n * 1e6;
        let mut builds = self.builds.clone();
        builds.sort_unstable();
        let slow: Vec<u32> = self.builds.iter().copied().filter(|&b| b > 2000).collect();
        let mut gaps: Vec<f64> = self
            .marks
            .windows(2)
            .map(|w| (w[1] - w[0]).as_secs_f64() * 1e6)
            .collect();
        gaps.sort_by(f64::total_cmp);
        let pct = |p: usize| gaps.get(gaps.len() * p / 100).copied();
        serde_json::json!({
            "stack": "engine",
            "steps": self.steps,
            "tok_s": n / wall,
            "step_us": wall / n * 1e6,
            "step_p10_us": pct(10),
            "step_p25_us": pct(25),
            "step_p50_us": pct(50),
            "host_build_us": us(self.phases[0]),
            "host_async_eval_us": us(self.phases[1]),
            "host_wait_us": us(self.phases[2]),
            "host_build_p50_us": builds.get(builds.len() / 2),
            "host_build_over_2ms_us": slow,
            "host_cpu_us": cpu1.get(&me).map_or(0.0, |ns| per(&me, ns) / n / 1e3),
            "busiest_other_thread_cpu_us": others.first().copied().unwrap_or(0.0),
            "other_threads_cpu_us": others.iter().sum::<f64>(),
            "step_graph_primitives": self.primitives,
            "window_mono_ns": [self.mono0, monotonic_ns()],
            "compile_choice": self.choice.map(|c| c.0),
            "probe_median_eager_us": self.choice.map(|c| c.1),
            "probe_median_compiled_us": self.choice.map(|c| c.2),
        })
    }
}

/// Writes the graph of `outputs` as DOT and counts its primitives (mlx-c writes one
/// `shape=rectangle` node per primitive).
fn export_dot(path: &std::path::Path, outputs: &[&Array]) -> Option<usize> {
    let c_path = std::ffi::CString::new(path.to_str()?).ok()?;
    // SAFETY: the vector and namer are created and freed here; the arrays are live for the
    // call; the FILE is opened and closed here.
    unsafe {
        let vec = mlx_sys::mlx_vector_array_new();
        for a in outputs {
            mlx_sys::mlx_vector_array_append_value(vec, a.as_ptr());
        }
        let namer = mlx_sys::mlx_node_namer_new();
        let file = mlx_sys::fopen(c_path.as_ptr(), c"w".as_ptr());
        let status = if file.is_null() {
            -1
        } else {
            let s = mlx_sys::mlx_export_to_dot(file, namer, vec);
            mlx_sys::fclose(file);
            s
        };
        mlx_sys::mlx_node_namer_free(namer);
        mlx_sys::mlx_vector_array_free(vec);
        if status != 0 {
            return None;
        }
    }
    let text = std::fs::read_to_string(path).ok()?;
    Some(
        text.lines()
            .filter(|l| l.contains("shape=rectangle"))
            .count(),
    )
}
