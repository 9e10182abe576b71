//! What happened on the machine *during* a run, which a check before and a check after cannot
//! see: a virtual machine's CPU steal (time the hypervisor gave this VM's vCPUs to another
//! guest), CPU time spent by processes that are not this harness and its children (a noisy
//! neighbour that started mid-run and may have ended before the after-check), and CPU
//! pressure (`/proc/pressure/cpu`, the share of time some runnable task waited for a CPU).
//!
//! Counters from `/proc/stat`'s `cpu` line (jiffies), this process's own CPU time with its
//! reaped children's (`/proc/self/stat` utime + stime + cutime + cstime) plus its live
//! descendants', and PSI's `some total` (µs) are read at the start and at the end; the
//! window's shares are the differences over the machine's total CPU time in between:
//! - steal % = Δsteal / Δtotal,
//! - foreign % = (Δbusy − Δours) / Δtotal, busy = user + nice + system + irq + softirq
//!   (guest time is inside user),
//! - pressure % = Δsome / wall time (reported, not judged: our own legs' threads wait for
//!   the two cores too),
//! - frequency drop % = 1 − min / max of the mean CPU clock, sampled once a second by a
//!   thread from the start reading until the window is taken (a throttled or power-capped
//!   CPU runs later legs slower than earlier ones).

use std::sync::{Arc, Mutex, Weak};

use serde::Serialize;

/// How often the frequency watch samples the CPU clock.
const FREQ_PERIOD: std::time::Duration = std::time::Duration::from_secs(1);

/// The mean clock of the machine's CPUs now (MHz): cpufreq's `scaling_cur_freq` where the
/// kernel exposes it, else `/proc/cpuinfo`'s `cpu MHz` lines (virtual machines).
pub fn cpu_mhz() -> Option<f64> {
    let mean = |v: Vec<f64>| (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64);
    let sys: Vec<f64> = std::fs::read_dir("/sys/devices/system/cpu")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| std::fs::read_to_string(e.path().join("cpufreq/scaling_cur_freq")).ok())
        .filter_map(|s| s.trim().parse::<f64>().ok().map(|khz| khz / 1000.0))
        .collect();
    mean(sys).or_else(|| {
        let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
        mean(
            info.lines()
                .filter(|l| l.starts_with("cpu MHz"))
                .filter_map(|l| l.split(':').nth(1)?.trim().parse().ok())
                .collect(),
        )
    })
}

/// The lowest and highest clock seen since the watch started (MHz).
#[derive(Debug, Default)]
pub struct FreqWatch {
    seen: Mutex<Option<(f64, f64)>>,
}

impl FreqWatch {
    /// Starts sampling; the thread ends once the last handle is dropped.
    pub fn start() -> Arc<FreqWatch> {
        let watch = Arc::new(FreqWatch::default());
        watch.sample();
        let weak: Weak<FreqWatch> = Arc::downgrade(&watch);
        let _ = std::thread::Builder::new()
            .name("preflight-freq".into())
            .spawn(move || loop {
                std::thread::sleep(FREQ_PERIOD);
                match weak.upgrade() {
                    Some(w) => w.sample(),
                    None => break,
                }
            });
        watch
    }

    fn sample(&self) {
        if let Some(mhz) = cpu_mhz() {
            self.record(mhz);
        }
    }

    fn record(&self, mhz: f64) {
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        *seen = Some(seen.map_or((mhz, mhz), |(lo, hi)| (lo.min(mhz), hi.max(mhz))));
    }

    /// (min, max) so far.
    pub fn range(&self) -> Option<(f64, f64)> {
        *self.seen.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A reading of the counters a window is judged from.
#[derive(Debug, Clone, Default)]
pub struct CpuCounters {
    /// Every CPU's time (jiffies): user … steal.
    pub total: u64,
    /// user + nice + system + irq + softirq.
    pub busy: u64,
    pub steal: u64,
    /// This process, its reaped children and its live descendants (jiffies).
    pub ours: u64,
    /// `/proc/pressure/cpu` `some total` (µs), where the kernel has PSI.
    pub psi_some_us: Option<u64>,
    pub at: Option<std::time::Instant>,
    /// The CPU clock from this reading on (the start of a window).
    pub freq: Option<Arc<FreqWatch>>,
}

/// The window's shares, stored with the after-check.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Window {
    pub seconds: f64,
    pub steal_pct: f64,
    pub foreign_cpu_pct: f64,
    pub cpu_pressure_pct: Option<f64>,
    /// The lowest and highest mean CPU clock sampled during the window (MHz).
    pub mhz_min: Option<f64>,
    pub mhz_max: Option<f64>,
}

impl Window {
    /// How far the clock fell below its highest sample, % (None where it is not readable).
    pub fn freq_drop_pct(&self) -> Option<f64> {
        match (self.mhz_min, self.mhz_max) {
            (Some(lo), Some(hi)) if hi > 0.0 => Some(100.0 * (1.0 - lo / hi)),
            _ => None,
        }
    }
}

/// `/proc/stat`'s aggregate line → (total, busy, steal).
fn parse_stat(stat: &str) -> Option<(u64, u64, u64)> {
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .map(|x| x.parse().unwrap_or(0))
        .collect();
    let at = |i: usize| v.get(i).copied().unwrap_or(0);
    let (user, nice, system, idle, iowait, irq, softirq, steal) =
        (at(0), at(1), at(2), at(3), at(4), at(5), at(6), at(7));
    let busy = user + nice + system + irq + softirq;
    Some((busy + idle + iowait + steal, busy, steal))
}

/// A `/proc/PID/stat` line → (ppid, utime + stime + cutime + cstime). The name in
/// parentheses may hold spaces: fields are counted after its closing parenthesis.
fn parse_proc_stat(s: &str) -> Option<(u32, u64)> {
    let rest = &s[s.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // f[0] is the state (field 3): ppid is field 4, utime … cstime fields 14–17.
    let ppid = f.get(1)?.parse().ok()?;
    let cpu = (11..15)
        .map(|i| f.get(i).and_then(|x| x.parse::<i64>().ok()).unwrap_or(0))
        .sum::<i64>()
        .max(0) as u64;
    Some((ppid, cpu))
}

/// This process's CPU time with its reaped children's, plus every live descendant's.
fn our_cpu() -> u64 {
    let me = std::process::id();
    let mut procs: Vec<(u32, u32, u64)> = Vec::new();
    if let Ok(entries) = std::fs::read_dir("/proc") {
        for e in entries.flatten() {
            let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
                continue;
            };
            if let Some((ppid, cpu)) = std::fs::read_to_string(e.path().join("stat"))
                .ok()
                .and_then(|s| parse_proc_stat(&s))
            {
                procs.push((pid, ppid, cpu));
            }
        }
    }
    let mut ours = vec![me];
    let mut total = 0;
    let mut i = 0;
    while i < ours.len() {
        let parent = ours[i];
        for &(pid, ppid, cpu) in &procs {
            if pid == parent {
                total += cpu;
            }
            if ppid == parent && !ours.contains(&pid) {
                ours.push(pid);
            }
        }
        i += 1;
    }
    total
}

fn psi_some_us() -> Option<u64> {
    let psi = std::fs::read_to_string("/proc/pressure/cpu").ok()?;
    let some = psi.lines().find(|l| l.starts_with("some "))?;
    some.split_whitespace()
        .find_map(|kv| kv.strip_prefix("total="))?
        .parse()
        .ok()
}

impl CpuCounters {
    /// Reads the counters now (zeros where /proc does not have them).
    pub fn read() -> Self {
        let (total, busy, steal) = std::fs::read_to_string("/proc/stat")
            .ok()
            .and_then(|s| parse_stat(&s))
            .unwrap_or_default();
        CpuCounters {
            total,
            busy,
            steal,
            ours: our_cpu(),
            psi_some_us: psi_some_us(),
            at: Some(std::time::Instant::now()),
            freq: Some(FreqWatch::start()),
        }
    }

    /// The window from `self` (the start) to `end`; None where /proc gave no counters.
    pub fn window_to(&self, end: &CpuCounters) -> Option<Window> {
        let total = end.total.checked_sub(self.total)?;
        if total == 0 {
            return None;
        }
        let pct = |x: u64| 100.0 * x as f64 / total as f64;
        let busy = end.busy.saturating_sub(self.busy);
        let ours = end.ours.saturating_sub(self.ours);
        // Planted: every busy jiffy counted as ours, so no neighbour is ever seen.
        let foreign = if engine::plant::is(engine::plant::Defect::PreflightForeignCpuAsOurs) {
            0
        } else {
            busy.saturating_sub(ours)
        };
        let seconds = match (self.at, end.at) {
            (Some(a), Some(b)) => b.duration_since(a).as_secs_f64(),
            _ => 0.0,
        };
        let pressure = match (self.psi_some_us, end.psi_some_us) {
            (Some(a), Some(b)) if seconds > 0.0 => {
                Some(100.0 * b.saturating_sub(a) as f64 / (seconds * 1e6))
            }
            _ => None,
        };
        // The clock over the window: the start's watch, and the end's own first sample.
        // Planted: the samples are ignored.
        let unseen = engine::plant::is(engine::plant::Defect::PreflightClockDropUnseen);
        let mut range = self.freq.as_ref().and_then(|f| f.range());
        if let Some((lo, hi)) = end.freq.as_ref().and_then(|f| f.range()) {
            range = Some(range.map_or((lo, hi), |(a, b)| (a.min(lo), b.max(hi))));
        }
        if unseen {
            range = None;
        }
        Some(Window {
            seconds,
            steal_pct: pct(end.steal.saturating_sub(self.steal)),
            foreign_cpu_pct: pct(foreign),
            cpu_pressure_pct: pressure,
            mhz_min: range.map(|r| r.0),
            mhz_max: range.map(|r| r.1),
        })
    }
}

/// One reason per limit the window breaks (steal, foreign CPU, clock drop); empty means
/// clean.
pub fn window_reasons(w: &Window, t: &super::Thresholds) -> Vec<String> {
    let (max_steal_pct, max_foreign_cpu_pct) = (t.max_steal_pct, t.max_foreign_cpu_pct);
    let mut reasons = Vec::new();
    if let Some(drop) = w.freq_drop_pct().filter(|d| *d > t.max_freq_drop_pct) {
        reasons.push(format!(
            "the CPU clock fell {drop:.1}% during the run ({:.0} → {:.0} MHz) > {:.1}% \
             (throttling or a power cap slowed later legs)",
            w.mhz_max.unwrap_or(f64::NAN),
            w.mhz_min.unwrap_or(f64::NAN),
            t.max_freq_drop_pct
        ));
    }
    if w.steal_pct > max_steal_pct {
        reasons.push(format!(
            "CPU steal {:.1}% of the machine's CPU time during the run > {max_steal_pct:.1}% \
             (the hypervisor gave this VM's CPUs to others)",
            w.steal_pct
        ));
    }
    if w.foreign_cpu_pct > max_foreign_cpu_pct {
        reasons.push(format!(
            "other processes used {:.1}% of the machine's CPU time during the run > \
             {max_foreign_cpu_pct:.1}% (a neighbour ran beside the legs)",
            w.foreign_cpu_pct
        ));
    }
    reasons
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_lines_are_read_by_field() {
        let stat = "cpu  100 5 20 1000 7 3 2 11 4 0\ncpu0 50 2 10 500 3 1 1 5 2 0\n";
        assert_eq!(parse_stat(stat), Some((1148, 130, 11)));
        // A name with spaces and parentheses; ppid 41, utime 7 stime 3 cutime 20 cstime 1.
        let line = "42 (a b) c)) S 41 42 42 0 -1 4194560 100 0 0 0 7 3 20 1 20 0 1 0 5 0";
        assert_eq!(parse_proc_stat(line), Some((41, 31)));
    }

    fn counters(total: u64, busy: u64, steal: u64, ours: u64) -> CpuCounters {
        CpuCounters {
            total,
            busy,
            steal,
            ours,
            ..CpuCounters::default()
        }
    }

    #[test]
    fn the_window_is_judged_on_its_differences() {
        let w = counters(1000, 300, 10, 200)
            .window_to(&counters(2000, 1100, 60, 900))
            .unwrap();
        assert_eq!((w.steal_pct, w.foreign_cpu_pct), (5.0, 10.0));
        let r = window_reasons(&w, &limits(2.0, 5.0));
        assert_eq!(r.len(), 2, "{r:?}");
        assert!(
            r[0].starts_with("CPU steal 5.0%") && r[1].starts_with("other processes used 10.0%")
        );
        assert!(window_reasons(&w, &limits(5.0, 10.0)).is_empty());
    }

    fn limits(steal: f64, foreign: f64) -> super::super::Thresholds {
        super::super::Thresholds {
            max_steal_pct: steal,
            max_foreign_cpu_pct: foreign,
            ..Default::default()
        }
    }

    /// A window whose clock fell from 2300 to 1900 MHz (17 %) between the start's samples
    /// and the end's is dirty, and one at a steady clock is not. Planted: the samples are
    /// ignored → caught.
    #[test]
    fn a_clock_that_fell_during_the_window_makes_it_dirty() {
        let at = |mhz: &[f64]| {
            let w = Arc::new(FreqWatch::default());
            mhz.iter().for_each(|m| w.record(*m));
            CpuCounters {
                freq: Some(w),
                ..counters(1000, 0, 0, 0)
            }
        };
        let judge = |start: &[f64], end: &[f64]| {
            let mut end = at(end);
            end.total = 2000;
            let w = at(start).window_to(&end).unwrap();
            window_reasons(&w, &limits(100.0, 100.0))
        };
        let gate = || {
            let fell = judge(&[2300.0, 2290.0], &[1900.0]);
            let steady = judge(&[2300.0, 2298.0], &[2299.0]);
            fell.len() == 1
                && fell[0].starts_with("the CPU clock fell 17.4% during the run (2300 → 1900 MHz)")
                && steady.is_empty()
        };
        assert!(gate(), "{:?}", judge(&[2300.0, 2290.0], &[1900.0]));
        assert!(
            cpu_mhz().is_some_and(|m| m > 0.0),
            "this machine's clock is readable"
        );
        let _on = engine::plant::on(engine::plant::Defect::PreflightClockDropUnseen).unwrap();
        assert!(!gate(), "the planted defect was not caught");
    }

    /// A CPU burner that is not ours (its shell exits without waiting for it, so its time
    /// never reaches our children's) runs during a window: the window sees at least its CPU
    /// time as foreign and is judged dirty. Planted: foreign time counted as ours → caught.
    #[test]
    fn a_foreign_cpu_burner_during_the_window_makes_it_dirty() {
        let judge = || {
            let start = CpuCounters::read();
            let out = std::process::Command::new("sh")
                .args(["-c", "(while :; do :; done) >/dev/null 2>&1 & echo $!"])
                .output()
                .unwrap();
            let pid: u32 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
            let cpu = || {
                std::fs::read_to_string(format!("/proc/{pid}/stat"))
                    .ok()
                    .and_then(|s| parse_proc_stat(&s))
                    .map_or(0, |(_, c)| c)
            };
            // Until the burner has had a second of CPU (100 jiffies), or 60 s.
            let t0 = std::time::Instant::now();
            while cpu() < 100 && t0.elapsed().as_secs() < 60 {
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            let burned = cpu();
            let end = CpuCounters::read();
            let _ = std::process::Command::new("kill")
                .arg(pid.to_string())
                .status();
            let w = start.window_to(&end).unwrap();
            let burned_pct = 100.0 * burned as f64 / (end.total - start.total) as f64;
            (w, burned_pct)
        };
        // The gate: the burner's time is seen as foreign, and the window is dirty for it.
        let gate = || -> Result<(), String> {
            let (w, burned_pct) = judge();
            println!("{w:?}, the burner alone {burned_pct:.1}%");
            if burned_pct <= 1.0 {
                return Err(format!("the burner did not run: {burned_pct}"));
            }
            if w.foreign_cpu_pct < 0.9 * burned_pct
                || window_reasons(&w, &limits(100.0, 0.9 * burned_pct)).is_empty()
            {
                return Err(format!("{w:?} missed the burner's {burned_pct:.1}%"));
            }
            Ok(())
        };
        gate().unwrap();
        let _on = engine::plant::on(engine::plant::Defect::PreflightForeignCpuAsOurs).unwrap();
        let planted = gate();
        assert!(planted.is_err(), "the planted defect was not caught");
    }
}
