//! Preflight: is this machine quiet enough for a number to mean something? Reads load,
//! memory, swap, big foreign processes, CPU frequency and temperature (where the OS shows
//! them), the commit, and the versions in play; returns clean or dirty with reasons. The
//! check after a run also judges the run's window since the check before it (`window`: CPU
//! steal, other processes' CPU time, CPU pressure).

mod window;
pub use window::{CpuCounters, Window};

use std::path::{Path, PathBuf};
use std::process::Command;

use serde::Serialize;

/// Limits a clean machine stays within. Defaults documented in docs/harness.md; each can be
/// set through the environment (`HARNESS_MAX_LOAD`, `HARNESS_MIN_FREE_PCT`,
/// `HARNESS_MAX_SWAP_MB`, `HARNESS_MAX_FOREIGN_RSS_MB`, `HARNESS_MAX_TEMP_C`,
/// `HARNESS_MAX_STEAL_PCT`, `HARNESS_MAX_FOREIGN_CPU_PCT`).
#[derive(Debug, Clone, Serialize)]
pub struct Thresholds {
    /// 1-minute load average, per core.
    pub max_load_per_core: f64,
    pub min_free_pct: f64,
    pub max_swap_mb: f64,
    pub max_foreign_rss_mb: f64,
    pub max_temp_c: f64,
    /// CPU steal during a run, % of the machine's CPU time.
    pub max_steal_pct: f64,
    /// Other processes' CPU time during a run, % of the machine's CPU time.
    pub max_foreign_cpu_pct: f64,
    /// How far the mean CPU clock may fall below its highest sample during a run, %.
    pub max_freq_drop_pct: f64,
}

impl Default for Thresholds {
    fn default() -> Self {
        Thresholds {
            max_load_per_core: 0.75,
            min_free_pct: 35.0,
            max_swap_mb: 512.0,
            max_foreign_rss_mb: 2048.0,
            max_temp_c: 90.0,
            max_steal_pct: 2.0,
            max_foreign_cpu_pct: 10.0,
            max_freq_drop_pct: 10.0,
        }
    }
}

impl Thresholds {
    pub fn from_env() -> Self {
        let mut t = Thresholds::default();
        let read = |name: &str, slot: &mut f64| {
            if let Some(v) = std::env::var(name).ok().and_then(|v| v.parse().ok()) {
                *slot = v;
            }
        };
        read("HARNESS_MAX_LOAD", &mut t.max_load_per_core);
        read("HARNESS_MIN_FREE_PCT", &mut t.min_free_pct);
        read("HARNESS_MAX_SWAP_MB", &mut t.max_swap_mb);
        read("HARNESS_MAX_FOREIGN_RSS_MB", &mut t.max_foreign_rss_mb);
        read("HARNESS_MAX_TEMP_C", &mut t.max_temp_c);
        read("HARNESS_MAX_STEAL_PCT", &mut t.max_steal_pct);
        read("HARNESS_MAX_FOREIGN_CPU_PCT", &mut t.max_foreign_cpu_pct);
        read("HARNESS_MAX_FREQ_DROP_PCT", &mut t.max_freq_drop_pct);
        t
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct BigProcess {
    pub pid: u32,
    pub name: String,
    pub rss_mb: f64,
}

/// What preflight saw; stored as JSON with every result row.
#[derive(Debug, Clone, Serialize)]
pub struct MachineState {
    pub machine_key: String,
    pub host: String,
    pub cores: usize,
    pub load1: Option<f64>,
    pub mem_total_mb: Option<f64>,
    pub free_pct: Option<f64>,
    pub swap_used_mb: Option<f64>,
    pub big_foreign_procs: Vec<BigProcess>,
    pub cpu_mhz: Option<f64>,
    pub max_temp_c: Option<f64>,
    pub commit: String,
    pub dirty: bool,
    pub engine_version: String,
    pub mlx_version: String,
    pub oracle_versions: std::collections::BTreeMap<String, String>,
    pub thresholds: Thresholds,
    pub clean: bool,
    pub reasons: Vec<String>,
    pub at: String,
    /// The run's window since the check before it (after-checks only).
    pub window: Option<Window>,
    #[serde(skip)]
    pub counters: CpuCounters,
}

fn meminfo_mb(info: &str, key: &str) -> Option<f64> {
    info.lines()
        .find(|l| l.starts_with(key))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<f64>().ok())
        .map(|kb| kb / 1024.0)
}

/// Processes (not ours, not our children's kind) with RSS over `limit_mb`.
fn big_processes(limit_mb: f64) -> Vec<BigProcess> {
    let me = std::process::id();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for entry in entries.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if pid == me {
            continue;
        }
        let Ok(status) = std::fs::read_to_string(entry.path().join("status")) else {
            continue;
        };
        let name = status
            .lines()
            .find_map(|l| l.strip_prefix("Name:"))
            .unwrap_or("?")
            .trim()
            .to_owned();
        // The stacks under test are not foreign.
        if ["engine", "harness"].contains(&name.as_str()) {
            continue;
        }
        if let Some(rss) = meminfo_mb(&status, "VmRSS:") {
            if rss > limit_mb {
                out.push(BigProcess {
                    pid,
                    name,
                    rss_mb: rss,
                });
            }
        }
    }
    out
}

fn read_f64(path: &str) -> Option<f64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

fn max_thermal_c() -> Option<f64> {
    let zones = std::fs::read_dir("/sys/class/thermal").ok()?;
    zones
        .flatten()
        .filter_map(|z| read_f64(&z.path().join("temp").to_string_lossy()))
        .map(|milli| milli / 1000.0)
        .reduce(f64::max)
}

fn git(repo: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .arg("-C")
        .arg(repo)
        .args(args)
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// The commit of `repo` and whether its tracked files differ from it.
pub fn commit_state(repo: &Path) -> (String, bool) {
    let commit =
        git(repo, &["rev-parse", "--short=12", "HEAD"]).unwrap_or_else(|| "unknown".into());
    let dirty = git(repo, &["status", "--porcelain", "--untracked-files=no"])
        .is_some_and(|s| !s.is_empty());
    (commit, dirty)
}

/// Why this binary may not be the code in `repo` (None when it is): a tracked file of the
/// crates compiled into it changed after it was built. Running `target/release/harness` by
/// hand after an edit measures the old code under the new commit; `cargo run` rebuilds.
pub fn stale_binary(repo: &Path) -> Option<String> {
    let exe = std::env::current_exe().ok()?;
    let built = exe.metadata().ok()?.modified().ok()?;
    let files = git(
        repo,
        &["ls-files", "engine", "harness", "Cargo.toml", "Cargo.lock"],
    )?;
    let paths: Vec<PathBuf> = files.lines().map(|f| repo.join(f)).collect();
    newer_than(&paths, built).map(|newer| {
        format!(
            "{} was built before {} last changed: it would measure older code than the \
             commit it records. Rebuild first (`cargo run --release -p harness -- bench …` \
             does)",
            exe.display(),
            newer.display()
        )
    })
}

/// The first of `paths` modified after `time`.
fn newer_than(paths: &[PathBuf], time: std::time::SystemTime) -> Option<&PathBuf> {
    paths.iter().find(|p| {
        std::fs::metadata(p)
            .and_then(|m| m.modified())
            .is_ok_and(|m| m > time)
    })
}

pub use engine::clock::now_utc;

/// The readings that can change while a bench waits for the machine to settle: /proc and
/// /sys only, cheap enough to take every second (no git, no Python).
#[derive(Debug, Clone, Default)]
pub struct Readings {
    pub cores: usize,
    pub load1: Option<f64>,
    pub mem_total_mb: Option<f64>,
    pub free_pct: Option<f64>,
    pub swap_used_mb: Option<f64>,
    pub big_foreign_procs: Vec<BigProcess>,
    pub cpu_mhz: Option<f64>,
    pub max_temp_c: Option<f64>,
}

/// Reads load, memory, swap, big foreign processes, CPU frequency and temperature now.
pub fn read_machine(t: &Thresholds) -> Readings {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let load1 = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse().ok()));
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let mem_total = meminfo_mb(&meminfo, "MemTotal:");
    let mem_avail = meminfo_mb(&meminfo, "MemAvailable:");
    let free_pct = mem_total
        .zip(mem_avail)
        .map(|(t, a)| 100.0 * a / t.max(1.0));
    let swap_used = meminfo_mb(&meminfo, "SwapTotal:")
        .zip(meminfo_mb(&meminfo, "SwapFree:"))
        .map(|(t, f)| t - f);
    Readings {
        cores,
        load1,
        mem_total_mb: mem_total,
        free_pct,
        swap_used_mb: swap_used,
        big_foreign_procs: big_processes(t.max_foreign_rss_mb),
        cpu_mhz: window::cpu_mhz(),
        max_temp_c: max_thermal_c(),
    }
}

/// One reason per limit in `t` that `r` breaks; empty means clean.
pub fn reasons(r: &Readings, t: &Thresholds) -> Vec<String> {
    let mut reasons = Vec::new();
    if let Some(l) = r.load1 {
        let limit = t.max_load_per_core * r.cores as f64;
        if l > limit {
            reasons.push(format!(
                "1-minute load {l:.2} > {limit:.2} ({} per core × {} cores)",
                t.max_load_per_core, r.cores
            ));
        }
    }
    if let Some(f) = r.free_pct {
        if f < t.min_free_pct {
            reasons.push(format!("free memory {f:.1}% < {:.0}%", t.min_free_pct));
        }
    }
    if let Some(s) = r.swap_used_mb {
        if s > t.max_swap_mb {
            reasons.push(format!("swap in use {s:.0} MB > {:.0} MB", t.max_swap_mb));
        }
    }
    for p in &r.big_foreign_procs {
        reasons.push(format!(
            "foreign process {} (pid {}) holds {:.0} MB RSS > {:.0} MB",
            p.name, p.pid, p.rss_mb, t.max_foreign_rss_mb
        ));
    }
    if let Some(c) = r.max_temp_c {
        if c > t.max_temp_c {
            reasons.push(format!("temperature {c:.0} °C > {:.0} °C", t.max_temp_c));
        }
    }
    reasons
}

/// Reads the machine now and judges it against `t`.
pub fn check(t: &Thresholds) -> MachineState {
    let counters = CpuCounters::read();
    let r = read_machine(t);
    let reasons = reasons(&r, t);
    let repo = crate::oracle::repo_root();
    let (commit, dirty) = commit_state(&repo);
    let oracle_versions = crate::oracle::probe()
        .map(|i| i.versions)
        .unwrap_or_default();
    MachineState {
        machine_key: crate::machine::machine_key(),
        host: std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_owned())
            .unwrap_or_default(),
        cores: r.cores,
        load1: r.load1,
        mem_total_mb: r.mem_total_mb,
        free_pct: r.free_pct,
        swap_used_mb: r.swap_used_mb,
        big_foreign_procs: r.big_foreign_procs,
        cpu_mhz: r.cpu_mhz,
        max_temp_c: r.max_temp_c,
        commit,
        dirty,
        engine_version: engine::VERSION.to_owned(),
        mlx_version: engine::runtime::mlx_version(),
        oracle_versions,
        thresholds: t.clone(),
        clean: reasons.is_empty(),
        reasons,
        at: now_utc(),
        window: None,
        counters,
    }
}

/// The check after a run: `check`, and the window since `before` judged too (steal and
/// other processes' CPU time during the run, which the machine may no longer show).
pub fn check_since(before: &MachineState, t: &Thresholds) -> MachineState {
    let mut after = check(t);
    after.window = before.counters.window_to(&after.counters);
    if let Some(w) = &after.window {
        after.reasons.extend(window::window_reasons(w, t));
        after.clean = after.reasons.is_empty();
    }
    after
}

/// Time as the settle wait sees it: injectable, so its test neither sleeps nor races.
pub trait Clock {
    /// Time since the wait began.
    fn elapsed(&self) -> std::time::Duration;
    fn sleep(&mut self, d: std::time::Duration);
}

/// The wall clock.
pub struct WallClock(std::time::Instant);

impl WallClock {
    pub fn start() -> Self {
        WallClock(std::time::Instant::now())
    }
}

impl Clock for WallClock {
    fn elapsed(&self) -> std::time::Duration {
        self.0.elapsed()
    }
    fn sleep(&mut self, d: std::time::Duration) {
        std::thread::sleep(d);
    }
}

/// Waits (up to `timeout`, reading every `poll`) for readings that break no limit: a
/// machine still busy from the build that preceded the bench settles within a minute or
/// two. Ok(time waited) once clean; Err(the last reasons) if still dirty at the deadline.
/// `progress` gets the current reasons and the time waited before each pause.
pub fn settle(
    t: &Thresholds,
    timeout: std::time::Duration,
    poll: std::time::Duration,
    mut read: impl FnMut() -> Readings,
    clock: &mut impl Clock,
    mut progress: impl FnMut(&[String], std::time::Duration),
) -> Result<std::time::Duration, Vec<String>> {
    loop {
        let reasons = reasons(&read(), t);
        let waited = clock.elapsed();
        if reasons.is_empty() {
            return Ok(waited);
        }
        if waited >= timeout {
            return Err(reasons);
        }
        progress(&reasons, waited);
        clock.sleep(poll.min(timeout - waited));
    }
}

/// The after-check of a suite that loads every core itself (N ranks, a server and its 32
/// clients): waits (up to two minutes) for that load to decay, then judges. It is there to
/// catch what else ran during the run, which a foreign load still shows after the wait.
pub fn check_after_own_load(before: &MachineState, t: &Thresholds) -> MachineState {
    let _ = settle(
        t,
        std::time::Duration::from_secs(120),
        std::time::Duration::from_secs(2),
        || read_machine(t),
        &mut WallClock::start(),
        |_, _| {},
    );
    check_since(before, t)
}

impl MachineState {
    pub fn verdict(&self) -> &'static str {
        if self.clean {
            "clean"
        } else {
            "dirty"
        }
    }

    /// The verdict, with its reasons when dirty (the line a bench ends with).
    pub fn summary(&self) -> String {
        match self.clean {
            true => "clean".into(),
            false => format!("dirty: {}", self.reasons.join("; ")),
        }
    }

    /// A human-readable report.
    pub fn render(&self) -> String {
        let opt =
            |v: Option<f64>, unit: &str| v.map_or("n/a".to_owned(), |v| format!("{v:.1}{unit}"));
        let mut s = String::new();
        s.push_str(&format!(
            "machine      {} ({}, {} cores)\n",
            self.machine_key, self.host, self.cores
        ));
        s.push_str(&format!("load (1 min) {}\n", opt(self.load1, "")));
        s.push_str(&format!(
            "free memory  {} of {}\n",
            opt(self.free_pct, "%"),
            opt(self.mem_total_mb, " MB")
        ));
        s.push_str(&format!("swap used    {}\n", opt(self.swap_used_mb, " MB")));
        s.push_str(&format!("cpu freq     {}\n", opt(self.cpu_mhz, " MHz")));
        s.push_str(&format!("temperature  {}\n", opt(self.max_temp_c, " °C")));
        if let Some(w) = &self.window {
            s.push_str(&format!(
                "during run   {:.0} s: steal {:.1}%, other processes {:.1}% of the CPU time, \
                 CPU pressure {}\n",
                w.seconds,
                w.steal_pct,
                w.foreign_cpu_pct,
                opt(w.cpu_pressure_pct, "%")
            ));
        }
        s.push_str(&format!(
            "commit       {}{}\n",
            self.commit,
            if self.dirty { " (dirty)" } else { "" }
        ));
        s.push_str(&format!(
            "engine {} · MLX {}",
            self.engine_version, self.mlx_version
        ));
        for (k, v) in &self.oracle_versions {
            s.push_str(&format!(" · {k} {v}"));
        }
        s.push('\n');
        s.push_str(&format!("verdict      {}\n", self.verdict()));
        for r in &self.reasons {
            s.push_str(&format!("  - {r}\n"));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A source file touched after the binary was built makes it stale; one from before
    /// does not.
    #[test]
    fn a_binary_built_before_a_source_edit_is_stale() {
        let dir = tempfile::tempdir().unwrap();
        let (old, new) = (dir.path().join("old.rs"), dir.path().join("new.rs"));
        let now = std::time::SystemTime::now();
        let hour = std::time::Duration::from_secs(3600);
        for (path, at) in [(&old, now - hour), (&new, now + hour)] {
            let f = std::fs::File::create(path).unwrap();
            f.set_modified(at).unwrap();
        }
        assert_eq!(newer_than(std::slice::from_ref(&old), now), None);
        assert_eq!(newer_than(&[old.clone(), new.clone()], now), Some(&new));
    }

    #[test]
    fn a_tight_threshold_makes_the_machine_dirty_with_a_reason() {
        let strict = Thresholds {
            min_free_pct: 100.1,
            ..Thresholds::default()
        };
        let state = check(&strict);
        assert!(!state.clean);
        assert!(
            state.reasons.iter().any(|r| r.starts_with("free memory")),
            "{:?}",
            state.reasons
        );
        let lax = Thresholds {
            max_load_per_core: 1e9,
            min_free_pct: 0.0,
            max_swap_mb: 1e12,
            max_foreign_rss_mb: 1e12,
            max_temp_c: 1e9,
            ..Thresholds::default()
        };
        assert!(check(&lax).clean);
    }

    /// A clock that moves only when slept on: the settle tests neither sleep nor race.
    #[derive(Default)]
    struct FakeClock {
        now: Duration,
        slept: Vec<Duration>,
    }

    impl Clock for FakeClock {
        fn elapsed(&self) -> Duration {
            self.now
        }
        fn sleep(&mut self, d: Duration) {
            self.now += d;
            self.slept.push(d);
        }
    }

    /// Two cores at this 1-minute load, nothing else out of bounds.
    fn loaded(load: f64) -> Readings {
        Readings {
            cores: 2,
            load1: Some(load),
            ..Readings::default()
        }
    }

    use std::time::Duration;
    const S: Duration = Duration::from_secs(1);

    #[test]
    fn settle_waits_for_the_load_to_drop_then_passes() {
        // The default limit on 2 cores is 1.50; a finished build's load decays below it.
        let mut loads = [1.78, 1.70, 1.55, 1.42].into_iter();
        let mut clock = FakeClock::default();
        let mut shown = Vec::new();
        let waited = settle(
            &Thresholds::default(),
            300 * S,
            5 * S,
            || loaded(loads.next().expect("read after it settled")),
            &mut clock,
            |reasons, waited| shown.push((reasons.join("; "), waited)),
        )
        .expect("settled");
        assert_eq!(waited, 15 * S);
        assert_eq!(clock.slept, [5 * S; 3]);
        assert_eq!(shown.len(), 3);
        assert!(
            shown[0].0.starts_with("1-minute load 1.78 > 1.50"),
            "{shown:?}"
        );
        assert_eq!(shown[2].1, 10 * S);
    }

    #[test]
    fn settle_refuses_a_machine_that_stays_busy_past_the_timeout() {
        let mut clock = FakeClock::default();
        let mut reads = 0;
        let reasons = settle(
            &Thresholds::default(),
            12 * S,
            5 * S,
            || {
                reads += 1;
                loaded(1.9)
            },
            &mut clock,
            |_, _| {},
        )
        .expect_err("a busy machine must be refused");
        // Reads at 0, 5, 10 and at the deadline (12 s): the last pause is cut to fit.
        assert_eq!(reads, 4);
        assert_eq!(clock.slept, [5 * S, 5 * S, 2 * S]);
        assert_eq!(reasons.len(), 1);
        assert!(
            reasons[0].starts_with("1-minute load 1.90 > 1.50"),
            "{reasons:?}"
        );
    }

    #[test]
    fn settle_with_no_timeout_judges_once() {
        let mut clock = FakeClock::default();
        let busy = settle(
            &Thresholds::default(),
            Duration::ZERO,
            5 * S,
            || loaded(1.9),
            &mut clock,
            |_, _| {},
        );
        assert!(busy.is_err());
        let quiet = settle(
            &Thresholds::default(),
            Duration::ZERO,
            5 * S,
            || loaded(0.2),
            &mut clock,
            |_, _| {},
        );
        assert_eq!(quiet, Ok(Duration::ZERO));
        assert!(clock.slept.is_empty());
    }

    #[test]
    fn every_limit_is_a_reason_to_wait() {
        let r = Readings {
            cores: 2,
            load1: Some(3.0),
            mem_total_mb: Some(1000.0),
            free_pct: Some(10.0),
            swap_used_mb: Some(600.0),
            big_foreign_procs: vec![BigProcess {
                pid: 7,
                name: "rustc".into(),
                rss_mb: 3000.0,
            }],
            cpu_mhz: None,
            max_temp_c: Some(95.0),
        };
        let reasons = reasons(&r, &Thresholds::default());
        let starts: Vec<&str> = reasons
            .iter()
            .map(|r| r.split(' ').next().unwrap())
            .collect();
        assert_eq!(
            starts,
            ["1-minute", "free", "swap", "foreign", "temperature"]
        );
    }

    #[test]
    fn timestamps_are_rfc3339_utc() {
        let t = now_utc();
        assert_eq!(t.len(), 20, "{t}");
        assert!(t.ends_with('Z') && t.as_bytes()[10] == b'T');
    }
}
