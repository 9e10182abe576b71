//! Preflight: is this machine quiet enough for a number to mean something? Reads load,
//! memory, swap, big foreign processes, CPU frequency and temperature (where the OS shows
//! them), the commit, and the versions in play; returns clean or dirty with reasons.

use std::path::Path;
use std::process::Command;

use serde::Serialize;

/// Limits a clean machine stays within. Defaults documented in docs/harness.md; each can be
/// set through the environment (`HARNESS_MAX_LOAD`, `HARNESS_MIN_FREE_PCT`,
/// `HARNESS_MAX_SWAP_MB`, `HARNESS_MAX_FOREIGN_RSS_MB`, `HARNESS_MAX_TEMP_C`).
#[derive(Debug, Clone, Serialize)]
pub struct Thresholds {
    /// 1-minute load average, per core.
    pub max_load_per_core: f64,
    pub min_free_pct: f64,
    pub max_swap_mb: f64,
    pub max_foreign_rss_mb: f64,
    pub max_temp_c: f64,
}

impl Default for Thresholds {
    fn default() -> Self {
        Thresholds {
            max_load_per_core: 0.75,
            min_free_pct: 35.0,
            max_swap_mb: 512.0,
            max_foreign_rss_mb: 2048.0,
            max_temp_c: 90.0,
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

pub use engine::clock::now_utc;

/// Reads the machine now and judges it against `t`.
pub fn check(t: &Thresholds) -> MachineState {
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
    let big = big_processes(t.max_foreign_rss_mb);
    let cpu_mhz =
        read_f64("/sys/devices/system/cpu/cpu0/cpufreq/scaling_cur_freq").map(|khz| khz / 1000.0);
    let temp = max_thermal_c();
    let repo = crate::oracle::repo_root();
    let (commit, dirty) = commit_state(&repo);
    let oracle_versions = crate::oracle::probe()
        .map(|i| i.versions)
        .unwrap_or_default();

    let mut reasons = Vec::new();
    if let Some(l) = load1 {
        let limit = t.max_load_per_core * cores as f64;
        if l > limit {
            reasons.push(format!(
                "1-minute load {l:.2} > {limit:.2} ({} per core × {cores} cores)",
                t.max_load_per_core
            ));
        }
    }
    if let Some(f) = free_pct {
        if f < t.min_free_pct {
            reasons.push(format!("free memory {f:.1}% < {:.0}%", t.min_free_pct));
        }
    }
    if let Some(s) = swap_used {
        if s > t.max_swap_mb {
            reasons.push(format!("swap in use {s:.0} MB > {:.0} MB", t.max_swap_mb));
        }
    }
    for p in &big {
        reasons.push(format!(
            "foreign process {} (pid {}) holds {:.0} MB RSS > {:.0} MB",
            p.name, p.pid, p.rss_mb, t.max_foreign_rss_mb
        ));
    }
    if let Some(c) = temp {
        if c > t.max_temp_c {
            reasons.push(format!("temperature {c:.0} °C > {:.0} °C", t.max_temp_c));
        }
    }
    MachineState {
        machine_key: crate::machine::machine_key(),
        host: std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_owned())
            .unwrap_or_default(),
        cores,
        load1,
        mem_total_mb: mem_total,
        free_pct,
        swap_used_mb: swap_used,
        big_foreign_procs: big,
        cpu_mhz,
        max_temp_c: temp,
        commit,
        dirty,
        engine_version: engine::VERSION.to_owned(),
        mlx_version: engine::runtime::mlx_version(),
        oracle_versions,
        thresholds: t.clone(),
        clean: reasons.is_empty(),
        reasons,
        at: now_utc(),
    }
}

impl MachineState {
    pub fn verdict(&self) -> &'static str {
        if self.clean {
            "clean"
        } else {
            "dirty"
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
        };
        assert!(check(&lax).clean);
    }

    #[test]
    fn timestamps_are_rfc3339_utc() {
        let t = now_utc();
        assert_eq!(t.len(), 20, "{t}");
        assert!(t.ends_with('Z') && t.as_bytes()[10] == b'T');
    }
}
