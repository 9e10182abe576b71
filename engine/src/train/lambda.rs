//! The dynamic-λ controller, as the design specifies it for ORPO
//! (`shared/reference/orpo-dynamic-lambda.md`): λ is a process variable, pushed as high as
//! the model bears while the chosen responses stay likely, pulled back on displacement. It
//! runs after each validation eval on the response-only ℓw and ℓr. The value it moves is any
//! objective's weight (`Actuated`): ORPO's λ, DPO's or CPO's β, SimPO's β or γ, with the
//! same laws; ℓw and ℓr are then the objective's own response scores (SimPO's means, DPO's
//! and CPO's sums), and "λ" below reads as that weight.
//!
//! - ε_sft and ε_disp are multiples of the measured noise of ΔLw, unless set to fixed
//!   values: each eval measures the standard error of validation ℓw's mean over the
//!   validation pairs (s/√n), and ΔLw between two evals has noise √(se₁² + se₂²). The first
//!   eval calibrates (ε from √2·se) and is the hard stop's reference (the start of warm-up).
//! - Warm-up (λ = λ_min): stays while ℓw rises; |ΔLw| < ε_sft for K consecutive evals (SFT
//!   saturated) → ramp, with the first step taken at once.
//! - Ramp: λ += step each eval (capped at λ_max; `P`/`Pd`/`Pid` compute the step from
//!   e = ΔLw + ε_disp instead, never negative) while chosen holds.
//! - Displacement, in any phase after warm-up: ΔLw < −ε_disp (chosen falling on its own),
//!   or ΔLr < −lr_drop·ε_disp with ΔLw ≤ 0 (margin bought by rejected falling while chosen
//!   does not rise) → back-off: λ ×= backoff each eval until chosen recovers (ΔLw ≥ 0), then
//!   hold (hysteresis): K consecutive evals without displacement before ramping again.
//! - Hard stop: ℓw below its value at the start of warm-up by more than `hard_drop` → λ to
//!   λ_min, no further changes.
//!
//! Every change is returned with its cause; the trainer logs it to metrics.jsonl and the
//! console (`λ 0.100 → 0.150 (SFT saturated, ramping)`).

use serde::Serialize;

/// The objective weight the controller moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Actuated {
    /// ORPO's odds-ratio weight λ.
    Lambda,
    /// DPO's, CPO's or SimPO's β.
    Beta,
    /// SimPO's target margin γ.
    Gamma,
}

impl Actuated {
    /// The key of its value in metrics.jsonl lines.
    pub fn key(self) -> &'static str {
        match self {
            Actuated::Lambda => "lambda",
            Actuated::Beta => "beta",
            Actuated::Gamma => "gamma",
        }
    }

    /// Its symbol in console lines.
    pub fn symbol(self) -> &'static str {
        match self {
            Actuated::Lambda => "λ",
            Actuated::Beta => "β",
            Actuated::Gamma => "γ",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Law {
    Aimd,
    P,
    Pd,
    Pid,
}

/// A threshold on ΔLw: a fixed value, or a multiple of the measured noise of validation ℓw.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Eps {
    Fixed(f64),
    Sigmas(f64),
}

impl std::str::FromStr for Eps {
    type Err = String;

    /// `0.02` (fixed) or `2sigma` (two standard errors of validation ℓw).
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("`{s}`: expected a number (0.02) or a noise multiple (2sigma)");
        match s.strip_suffix("sigma") {
            Some(z) => z.trim().parse().map(Eps::Sigmas).map_err(|_| bad()),
            None => s.trim().parse().map(Eps::Fixed).map_err(|_| bad()),
        }
    }
}

impl Eps {
    fn resolve(self, noise: f64) -> f64 {
        match self {
            Eps::Fixed(v) => v,
            Eps::Sigmas(z) => z * noise,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct ControllerConfig {
    pub law: Law,
    pub min: f64,
    pub max: f64,
    /// The ramp's additive step.
    pub step: f64,
    /// The back-off's multiplier.
    pub backoff: f64,
    /// Evals a condition must hold for a phase flip (warm-up's end, hold's end).
    pub k: usize,
    pub eps_sft: Eps,
    pub eps_disp: Eps,
    /// "ΔLr ≪ 0": ΔLr below −lr_drop·ε_disp.
    pub lr_drop: f64,
    pub hard_drop: f64,
    pub kp: f64,
    pub kd: f64,
    pub ki: f64,
    pub window: usize,
}

impl ControllerConfig {
    /// The design's defaults: λ_min 0.05, λ_max 0.5, step 0.05, K 3; ε_sft and ε_disp two
    /// standard errors of ΔLw (the design names no multiple).
    pub fn new(law: Law) -> Self {
        ControllerConfig {
            law,
            min: 0.05,
            max: 0.5,
            step: 0.05,
            backoff: 0.5,
            k: 3,
            eps_sft: Eps::Sigmas(2.0),
            eps_disp: Eps::Sigmas(2.0),
            lr_drop: 3.0,
            hard_drop: 1.0,
            kp: 0.5,
            kd: 0.25,
            ki: 0.1,
            window: 4,
        }
    }
}

/// The refusal of `adaptive` without validation data.
pub fn needs_validation(data: &str) -> String {
    format!(
        "--orpo-lambda-schedule adaptive steers λ from validation evals, and {data} has no \
         valid.jsonl: add validation pairs there (the same format as train.jsonl), or use \
         --orpo-lambda-schedule static"
    )
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    Warmup,
    Ramp,
    Backoff,
    Hold,
    Stopped,
}

/// A λ change (or a phase flip that keeps λ) and why it happened.
#[derive(Debug, Clone, Serialize)]
pub struct Change {
    pub from: f64,
    pub to: f64,
    pub cause: String,
    /// The phase after the change.
    pub phase: Phase,
}

impl Change {
    /// The console line: `λ 0.100 → 0.150 (SFT saturated, ramping)`.
    pub fn line(&self) -> String {
        self.line_for(Actuated::Lambda)
    }

    /// The console line for the weight `w` moves: `γ 0.100 → 0.150 (…)`.
    pub fn line_for(&self, w: Actuated) -> String {
        format!(
            "{} {:.3} → {:.3} ({})",
            w.symbol(),
            self.from,
            self.to,
            self.cause
        )
    }
}

pub struct Controller {
    pub cfg: ControllerConfig,
    pub lambda: f64,
    pub phase: Phase,
    /// ε_sft and ε_disp as resolved at calibration.
    pub eps_sft: f64,
    pub eps_disp: f64,
    /// The last eval's standard error of ℓw.
    noise: f64,
    prev: Option<(f64, f64)>,
    lw_start: f64,
    streak: usize,
    errors: Vec<f64>,
    integral: f64,
}

/// Theil–Sen slope of `ys` over their index (median of pairwise slopes).
pub fn robust_slope(ys: &[f64]) -> f64 {
    let mut slopes = Vec::new();
    for i in 0..ys.len() {
        for j in i + 1..ys.len() {
            slopes.push((ys[j] - ys[i]) / (j - i) as f64);
        }
    }
    if slopes.is_empty() {
        return 0.0;
    }
    slopes.sort_by(|a, b| a.total_cmp(b));
    let n = slopes.len();
    if n % 2 == 1 {
        slopes[n / 2]
    } else {
        (slopes[n / 2 - 1] + slopes[n / 2]) / 2.0
    }
}

/// The noise of a validation ℓw: the standard error of the mean of the per-pair values.
pub fn standard_error(xs: &[f64]) -> f64 {
    let n = xs.len() as f64;
    if xs.len() < 2 {
        return f64::NAN;
    }
    let mean = xs.iter().sum::<f64>() / n;
    let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0);
    (var / n).sqrt()
}

impl Controller {
    pub fn new(cfg: ControllerConfig) -> Self {
        Controller {
            lambda: cfg.min,
            cfg,
            phase: Phase::Warmup,
            eps_sft: f64::NAN,
            eps_disp: f64::NAN,
            noise: f64::NAN,
            prev: None,
            lw_start: f64::NAN,
            streak: 0,
            errors: Vec::new(),
            integral: 0.0,
        }
    }

    fn set(&mut self, to: f64, phase: Phase, cause: String) -> Option<Change> {
        let to = to.clamp(self.cfg.min, self.cfg.max);
        let flipped = phase != self.phase;
        self.phase = phase;
        if (to - self.lambda).abs() < 1e-12 && !flipped {
            self.lambda = to;
            return None;
        }
        let change = Change {
            from: self.lambda,
            to,
            cause,
            phase,
        };
        self.lambda = to;
        Some(change)
    }

    /// The first eval: ε_sft and ε_disp from `noise` (the standard error of validation ℓw),
    /// and ℓw's reference for the hard stop. Refused where a noise multiple is asked for
    /// and the noise is not measurable (fewer than two validation pairs).
    pub fn calibrate(&mut self, lw: f64, lr: f64, noise: f64) -> Result<Change, String> {
        let measured = |e: Eps| matches!(e, Eps::Sigmas(_));
        if (measured(self.cfg.eps_sft) || measured(self.cfg.eps_disp))
            && !(noise.is_finite() && noise > 0.0)
        {
            return Err(format!(
                "the dynamic-λ controller cannot measure the noise of validation ℓw (standard \
                 error {noise}; it needs at least two validation pairs that differ): add \
                 validation pairs, or set --lambda-eps-sft and --lambda-eps-disp to fixed values"
            ));
        }
        self.noise = noise;
        self.resolve_eps(std::f64::consts::SQRT_2 * noise);
        self.prev = Some((lw, lr));
        self.lw_start = lw;
        Ok(Change {
            from: self.lambda,
            to: self.lambda,
            cause: format!(
                "warm-up: lw {lw:.3}, noise {noise:.4} → eps_sft {:.4}, eps_disp {:.4}",
                self.eps_sft, self.eps_disp
            ),
            phase: Phase::Warmup,
        })
    }

    fn resolve_eps(&mut self, noise: f64) {
        self.eps_sft = self.cfg.eps_sft.resolve(noise);
        self.eps_disp = self.cfg.eps_disp.resolve(noise);
    }

    /// Feeds one later eval's response-only ℓw and ℓr and the standard error of that ℓw;
    /// returns the change, if any.
    pub fn update(&mut self, lw: f64, lr: f64, noise: f64) -> Option<Change> {
        let (lw0, lr0) = self.prev.replace((lw, lr))?;
        if noise.is_finite() && noise > 0.0 {
            self.resolve_eps(self.noise.hypot(noise));
            self.noise = noise;
        }
        let (dlw, dlr) = (lw - lw0, lr - lr0);
        if self.phase == Phase::Stopped {
            return None;
        }
        if lw < self.lw_start - self.cfg.hard_drop {
            return Some(self.stop_hard(lw));
        }
        let displaced =
            dlw < -self.eps_disp || (dlw <= 0.0 && dlr < -self.cfg.lr_drop * self.eps_disp);
        let d = format!(
            "dLw {dlw:+.3}, dLr {dlr:+.3}, eps_disp {:.3}",
            self.eps_disp
        );
        let (step, backoff, k) = (self.cfg.step, self.cfg.backoff, self.cfg.k);
        match self.phase {
            Phase::Warmup => {
                self.streak = if dlw.abs() < self.eps_sft {
                    self.streak + 1
                } else {
                    0
                };
                if self.streak < k {
                    return None;
                }
                self.streak = 0;
                let to = self.lambda + step;
                self.set(to, Phase::Ramp, "SFT saturated, ramping".into())
            }
            _ if displaced => {
                let to = self.lambda * backoff;
                self.set(
                    to,
                    Phase::Backoff,
                    format!("displacement ({d}), backing off"),
                )
            }
            Phase::Ramp => self.ramp(dlw),
            Phase::Backoff if dlw >= 0.0 => {
                self.streak = 0;
                let cause = format!("chosen recovered ({d}), holding {k} evals");
                self.set(self.lambda, Phase::Hold, cause)
            }
            Phase::Backoff => {
                let to = self.lambda * backoff;
                self.set(
                    to,
                    Phase::Backoff,
                    format!("chosen still falling ({d}), backing off"),
                )
            }
            Phase::Hold => {
                self.streak += 1;
                if self.streak < k {
                    return None;
                }
                let to = self.lambda + step;
                self.set(to, Phase::Ramp, format!("held {k} evals, ramping again"))
            }
            Phase::Stopped => None,
        }
    }

    /// ℓw fell more than `hard_drop` below its value at the start of warm-up: λ to its
    /// minimum, and no further changes.
    fn stop_hard(&mut self, lw: f64) -> Change {
        let cause = format!(
            "hard stop: lw {lw:.3} fell more than {} below its warm-up start {:.3}; λ frozen",
            self.cfg.hard_drop, self.lw_start
        );
        let (from, min) = (self.lambda, self.cfg.min);
        self.set(min, Phase::Stopped, cause.clone())
            .unwrap_or(Change {
                from,
                to: min,
                cause,
                phase: Phase::Stopped,
            })
    }

    /// One ramp step: AIMD's additive step, or the P/PD/PID law's (pushing only: lowering
    /// λ is the back-off's job).
    fn ramp(&mut self, dlw: f64) -> Option<Change> {
        let c = self.cfg.clone();
        if c.law == Law::Aimd {
            let to = self.lambda + c.step;
            return self.set(
                to,
                Phase::Ramp,
                format!("chosen holds (dLw {dlw:+.3}), ramping"),
            );
        }
        let e = dlw + self.eps_disp;
        self.errors.push(e);
        if self.errors.len() > c.window {
            self.errors.remove(0);
        }
        let mut delta = c.kp * e;
        if matches!(c.law, Law::Pd | Law::Pid) {
            delta += c.kd * robust_slope(&self.errors);
        }
        if c.law == Law::Pid {
            // Anti-windup: the integral stays within what can move λ across its range.
            let limit = (c.max - c.min) / c.ki.max(1e-9);
            self.integral = (self.integral + e).clamp(-limit, limit);
            delta += c.ki * self.integral;
        }
        let law = format!("{:?}", c.law).to_lowercase();
        let cause = format!("{law}: e {e:+.3} → Δλ {:+.3}, ramping", delta.max(0.0));
        self.set(self.lambda + delta.max(0.0), Phase::Ramp, cause)
    }
}

#[cfg(test)]
#[path = "lambda_tests.rs"]
mod tests;
