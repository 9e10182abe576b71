//! How far a bench's figures can be trusted: each stack's legs as min / median / max, and the
//! engine-to-peer ratio with a confidence interval from paired legs.
//!
//! The legs run in ABBA rounds, so round i's engine leg and peer leg ran next to each other
//! under the same machine conditions: the ratio is taken per round (r_i = engine_i / peer_i)
//! and its interval is the exact distribution-free interval for the median of the r_i (the
//! sign-test / order-statistic method): with n rounds and r sorted, [r_(k), r_(n+1−k)]
//! holds the true median with probability 1 − 2·P(Binomial(n, ½) ≤ k − 1). k is the largest
//! whose coverage is at least 95 %; below 6 rounds none is, and [min, max] is reported with
//! its coverage (75 % for 3 rounds). No assumption about the legs' distribution is made.

use serde::Serialize;

use super::{Metrics, ModelResult};

/// The coverage an interval aims at.
pub const COVERAGE: f64 = 0.95;

/// `--rounds`: a fixed count, or `auto` — the decode suite adds ABBA rounds until the decode
/// ratio's interval is within ±`AUTO_BOUND` of its median, or a cap ends it; the serve
/// suite takes `AUTO_FIRST` rounds (its 15 ratios cannot all be narrowed in a sitting), and
/// the suites whose legs take minutes (train, spec, constrain, restart, distributed)
/// `AUTO_FIXED`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rounds {
    Fixed(usize),
    Auto,
}

/// The first rounds of `auto` (the fewest whose [min, max] covers ≥ 95 %).
pub const AUTO_FIRST: usize = 6;
/// `auto`'s round cap.
pub const AUTO_CAP: usize = 16;
/// `auto`'s time cap per model and prompt length.
pub const AUTO_TIME_CAP: std::time::Duration = std::time::Duration::from_secs(15 * 60);
/// Ratios this close to 1 in every round call the stacks the same.
const SAME: f64 = 0.005;
/// `auto`'s bound on the interval's half-width, relative to the median ratio.
pub const AUTO_BOUND: f64 = 0.03;
/// The rounds of the suites that do not adapt yet.
pub const AUTO_FIXED: usize = 3;

impl std::str::FromStr for Rounds {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Rounds::Auto),
            n => match n.parse::<usize>() {
                Ok(n) if n >= 3 => Ok(Rounds::Fixed(n)),
                Ok(_) => Err("at least 3 (a median of fewer is not a number to record)".into()),
                Err(_) => Err(format!("`{n}` is neither a count of rounds nor `auto`")),
            },
        }
    }
}

impl Rounds {
    /// The count a suite without adaptive rounds runs.
    pub fn count(self) -> usize {
        self.fixed_or(AUTO_FIXED)
    }

    /// The fixed count, or `auto` for `Auto`.
    pub fn fixed_or(self, auto: usize) -> usize {
        match self {
            Rounds::Fixed(n) => n,
            Rounds::Auto => auto,
        }
    }
}

/// Why `auto` stopped adding rounds (or that the count was fixed).
pub fn auto_ended(
    interval: Option<&RatioInterval>,
    rounds: usize,
    elapsed: std::time::Duration,
) -> Option<String> {
    match interval {
        Some(i) if rounds >= AUTO_FIRST && i.relative_half_width() <= AUTO_BOUND => Some(format!(
            "the decode ratio's interval is ±{:.1} % ≤ ±{:.0} % after {rounds} rounds",
            i.relative_half_width() * 100.0,
            AUTO_BOUND * 100.0
        )),
        _ if rounds >= AUTO_CAP => Some(format!("the round cap ({AUTO_CAP}) was reached")),
        _ if elapsed >= AUTO_TIME_CAP => Some(format!(
            "the time cap ({} min) was reached after {rounds} rounds",
            AUTO_TIME_CAP.as_secs() / 60
        )),
        _ => None,
    }
}

/// A stack's legs: their smallest, median and largest value.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Spread {
    pub min: f64,
    pub median: f64,
    pub max: f64,
}

impl Spread {
    pub fn of(values: &[f64]) -> Spread {
        let v: Vec<f64> = values.iter().copied().filter(|x| !x.is_nan()).collect();
        Spread {
            min: v.iter().copied().fold(f64::NAN, f64::min),
            median: super::median(v.clone()),
            max: v.iter().copied().fold(f64::NAN, f64::max),
        }
    }
}

/// The median of paired per-round ratios with its exact interval.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, serde::Deserialize)]
pub struct RatioInterval {
    pub median: f64,
    pub lo: f64,
    pub hi: f64,
    /// How often an interval made this way holds the true median ratio.
    pub coverage: f64,
    pub rounds: usize,
}

/// P(Binomial(n, ½) ≤ k).
fn binom_cdf_half(n: usize, k: usize) -> f64 {
    let mut c = 1.0f64; // C(n, 0)
    let mut sum = 0.0;
    for i in 0..=k.min(n) {
        if i > 0 {
            c = c * (n + 1 - i) as f64 / i as f64;
        }
        sum += c;
    }
    sum / 2f64.powi(n as i32)
}

/// The widest-coverage-first choice: the largest k (1-based) with coverage ≥ `COVERAGE`,
/// else k = 1; returns (k, its coverage).
fn order_statistic(n: usize) -> (usize, f64) {
    let cover = |k: usize| 1.0 - 2.0 * binom_cdf_half(n, k - 1);
    let mut best = (1, cover(1));
    for k in 2..=n.div_ceil(2) {
        let c = cover(k);
        if c >= COVERAGE {
            best = (k, c);
        } else {
            break;
        }
    }
    best
}

impl RatioInterval {
    /// From paired legs (`engine[i]` and `peer[i]` ran in round i); None without a pair.
    pub fn paired(engine: &[f64], peer: &[f64]) -> Option<RatioInterval> {
        let mut r: Vec<f64> = engine
            .iter()
            .zip(peer)
            .map(|(e, p)| e / p)
            .filter(|x| x.is_finite())
            .collect();
        if r.is_empty() {
            return None;
        }
        r.sort_by(|a, b| a.total_cmp(b));
        let n = r.len();
        let (k, coverage) = order_statistic(n);
        Some(RatioInterval {
            median: super::median(r.clone()),
            lo: r[k - 1],
            hi: r[n - k],
            coverage,
            rounds: n,
        })
    }

    /// The interval a results-DB row's parameters keep (`ratio_interval`), if any.
    pub fn of_params(params: &str) -> Option<RatioInterval> {
        let p: serde_json::Value = serde_json::from_str(params).ok()?;
        serde_json::from_value(p.get("ratio_interval")?.clone()).ok()
    }

    /// The peer-to-engine ratio's interval (a speed-up from a ratio of times).
    pub fn inverse(&self) -> RatioInterval {
        RatioInterval {
            median: 1.0 / self.median,
            lo: 1.0 / self.hi,
            hi: 1.0 / self.lo,
            ..*self
        }
    }

    /// `1.10× [0.95–1.30]`, with ` wide` past `--rounds auto`'s bound.
    pub fn cell(&self) -> String {
        let wide = self.relative_half_width() > AUTO_BOUND;
        format!(
            "{:.2}× [{:.2}–{:.2}]{}",
            self.median,
            self.lo,
            self.hi,
            if wide { " wide" } else { "" }
        )
    }

    /// The interval's half-width relative to its median (what `--rounds auto` narrows).
    pub fn relative_half_width(&self) -> f64 {
        (self.hi - self.lo) / 2.0 / self.median
    }

    /// In words, for a figure where a larger ratio is better for the engine (`higher_better`)
    /// or worse (times, memory): ahead, behind, or indistinguishable from the peer.
    pub fn verdict(&self, higher_better: bool) -> &'static str {
        if self.lo >= 1.0 - SAME && self.hi <= 1.0 + SAME {
            return "the same (within ±0.5 %)";
        }
        let (better, worse) = match higher_better {
            true => (self.lo > 1.0, self.hi < 1.0),
            false => (self.hi < 1.0, self.lo > 1.0),
        };
        match (better, worse) {
            (true, _) => "ahead",
            (_, true) => "behind",
            _ => "indistinguishable",
        }
    }

    /// `1.10× [0.95–1.30] (96.9 % exact interval, 6 paired rounds)`.
    pub fn describe(&self) -> String {
        format!(
            "{:.2}× [{:.2}–{:.2}] ({:.1} % exact interval, {} paired rounds)",
            self.median,
            self.lo,
            self.hi,
            self.coverage * 100.0,
            self.rounds
        )
    }
}

/// The lines a decode run ends with: per model and figure, each stack's min / median / max
/// and the engine / mlx-lm ratio's interval, in words.
pub fn summary(results: &[ModelResult]) -> String {
    let mut s = String::new();
    for r in results {
        s += &format!(
            "{} @ {} tokens, {} rounds{}\n",
            r.model.name,
            r.prompt_tokens,
            r.rounds,
            r.ended
                .as_ref()
                .map_or(String::new(), |e| format!(" (ended: {e})"))
        );
        let figures: Vec<_> = Metrics::default()
            .named()
            .iter()
            .map(|(name, _, unit, higher)| (*name, *unit, *higher))
            .collect();
        s += &r.legs.lines(&figures, "engine", Some("mlx-lm"));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_stops_on_a_narrow_interval_or_a_cap() {
        use std::time::Duration;
        let narrow = RatioInterval {
            median: 1.0,
            lo: 0.98,
            hi: 1.02,
            coverage: 0.97,
            rounds: 6,
        };
        let wide = RatioInterval {
            lo: 0.8,
            hi: 1.3,
            ..narrow
        };
        let z = Duration::ZERO;
        assert!(auto_ended(Some(&narrow), 6, z)
            .unwrap()
            .contains("±2.0 % ≤ ±3 %"));
        assert_eq!(
            auto_ended(Some(&narrow), 3, z),
            None,
            "fewer than the first rounds"
        );
        assert_eq!(auto_ended(Some(&wide), 8, z), None);
        assert!(auto_ended(Some(&wide), 16, z)
            .unwrap()
            .contains("round cap"));
        assert!(auto_ended(Some(&wide), 8, AUTO_TIME_CAP)
            .unwrap()
            .contains("time cap"));
        assert_eq!("auto".parse(), Ok(Rounds::Auto));
        assert_eq!("5".parse(), Ok(Rounds::Fixed(5)));
        assert!("2".parse::<Rounds>().is_err() && "many".parse::<Rounds>().is_err());
    }

    #[test]
    fn exact_intervals_have_the_binomial_coverage() {
        // 3 rounds: [min, max] covers 1 − 2/8.
        assert_eq!(order_statistic(3), (1, 0.75));
        // 6 rounds: [min, max] covers 1 − 2/64 = 96.9 %; k = 2 would cover 78 %.
        assert_eq!(order_statistic(6), (1, 1.0 - 2.0 / 64.0));
        // 10 rounds: k = 2 covers 1 − 2·11/1024 = 97.9 %, k = 3 89 %.
        let (k, c) = order_statistic(10);
        assert_eq!(k, 2);
        assert!((c - (1.0 - 22.0 / 1024.0)).abs() < 1e-12);
    }

    #[test]
    fn paired_ratios_give_the_median_and_its_interval() {
        let engine = [110.0, 100.0, 130.0, 90.0, 120.0, 105.0];
        let peer = [100.0; 6];
        let r = RatioInterval::paired(&engine, &peer).unwrap();
        assert_eq!((r.lo, r.hi, r.rounds), (0.9, 1.3, 6));
        assert!((r.median - 1.075).abs() < 1e-12, "{r:?}");
        assert_eq!(r.verdict(true), "indistinguishable");
        let same = RatioInterval::paired(&[10.91, 10.9], &[10.92, 10.9]).unwrap();
        assert_eq!(same.verdict(false), "the same (within ±0.5 %)");
        let ahead = RatioInterval::paired(&[1.2, 1.3, 1.25], &[1.0, 1.0, 1.0]).unwrap();
        assert_eq!(
            (ahead.verdict(true), ahead.verdict(false)),
            ("ahead", "behind")
        );
        assert!(ahead
            .describe()
            .starts_with("1.25× [1.20–1.30] (75.0 % exact interval, 3"));
        assert_eq!(
            Spread::of(&[3.0, 1.0, 2.0]),
            Spread {
                min: 1.0,
                median: 2.0,
                max: 3.0
            }
        );
    }
}
