//! The dynamic-λ controller for ORPO: λ treated as a process variable, pushed as high as the
//! model bears while its response log-likelihood ℓw holds, and pulled back on confirmed
//! displacement (the margin bought by ℓr falling while ℓw falls too). It runs after each
//! validation eval on the response-only ℓw and ℓr.
//!
//! Phases (every variant): warm-up at λ_min until ℓw settles (|ΔLw| < ε_sft for K evals);
//! then the control law; a hard stop back to λ_min (and no further changes) if ℓw falls more
//! than `hard_drop` below its value when warm-up ended. Control laws:
//! - `Aimd`: additive ramp (+ramp per eval) while ℓw holds (ΔLw ≥ −ε_disp); multiplicative
//!   back-off (×backoff) on displacement confirmed for K consecutive evals; hold after a
//!   back-off until ℓw recovers (ΔLw ≥ 0), then ramp again.
//! - `P`, `Pd`, `Pid`: λ += kp·e, plus kd times a robust (Theil–Sen) slope of e over a
//!   window, plus ki·Σe with the sum clamped (anti-windup); e = ΔLw + ε_disp, positive while
//!   ℓw holds and negative on displacement; lowering λ needs K evals of displacement.
//!
//! Every change is returned with its cause (the trainer logs it to metrics.jsonl).

use serde::Serialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Law {
    Aimd,
    P,
    Pd,
    Pid,
}

#[derive(Debug, Clone, Serialize)]
pub struct ControllerConfig {
    pub law: Law,
    pub min: f64,
    pub max: f64,
    pub ramp: f64,
    pub backoff: f64,
    /// Evals a condition must hold before it changes the phase or lowers λ.
    pub k: usize,
    pub eps_sft: f64,
    pub eps_disp: f64,
    pub hard_drop: f64,
    pub kp: f64,
    pub kd: f64,
    pub ki: f64,
    pub window: usize,
}

impl ControllerConfig {
    pub fn new(law: Law) -> Self {
        ControllerConfig {
            law,
            min: 0.05,
            max: 1.0,
            ramp: 0.1,
            backoff: 0.5,
            k: 2,
            eps_sft: 0.2,
            eps_disp: 0.02,
            hard_drop: 1.0,
            kp: 0.5,
            kd: 0.25,
            ki: 0.1,
            window: 4,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    Warmup,
    Control,
    Hold,
    Stopped,
}

/// A λ change and why it happened.
#[derive(Debug, Clone, Serialize)]
pub struct Change {
    pub from: f64,
    pub to: f64,
    pub cause: String,
    pub phase: Phase,
}

pub struct Controller {
    pub cfg: ControllerConfig,
    pub lambda: f64,
    pub phase: Phase,
    prev: Option<(f64, f64)>,
    lw_ref: Option<f64>,
    settle: usize,
    displaced: usize,
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

impl Controller {
    pub fn new(cfg: ControllerConfig) -> Self {
        Controller {
            lambda: cfg.min,
            cfg,
            phase: Phase::Warmup,
            prev: None,
            lw_ref: None,
            settle: 0,
            displaced: 0,
            errors: Vec::new(),
            integral: 0.0,
        }
    }

    fn set(&mut self, to: f64, cause: String) -> Option<Change> {
        let to = to.clamp(self.cfg.min, self.cfg.max);
        if (to - self.lambda).abs() < 1e-12 {
            return None;
        }
        let change = Change {
            from: self.lambda,
            to,
            cause,
            phase: self.phase,
        };
        self.lambda = to;
        Some(change)
    }

    /// Feeds one eval's response-only ℓw and ℓr; returns the change, if any.
    pub fn update(&mut self, lw: f64, lr: f64) -> Option<Change> {
        let (lw0, lr0) = self.prev.replace((lw, lr))?;
        let (dlw, dlr) = (lw - lw0, lr - lr0);
        if self.phase == Phase::Stopped {
            return None;
        }
        if let Some(reference) = self.lw_ref {
            if lw < reference - self.cfg.hard_drop {
                return Some(self.stop_hard(lw, reference));
            }
        }
        // Displacement: the margin grows because ℓr falls while ℓw falls as well.
        let displacing = dlw < -self.cfg.eps_disp && dlr < dlw;
        self.displaced = if displacing { self.displaced + 1 } else { 0 };
        match self.phase {
            Phase::Warmup => self.warm_up(lw, dlw),
            Phase::Hold => self.hold(dlw, dlr, displacing),
            Phase::Control => match self.cfg.law {
                Law::Aimd => self.aimd(dlw, dlr),
                Law::P | Law::Pd | Law::Pid => self.pid(dlw),
            },
            Phase::Stopped => None,
        }
    }

    /// ℓw fell more than `hard_drop` below `reference` (its value when warm-up ended): λ to
    /// its minimum, and no further changes.
    fn stop_hard(&mut self, lw: f64, reference: f64) -> Change {
        self.phase = Phase::Stopped;
        let cause = format!(
            "hard stop: lw {lw:.3} fell more than {} below {reference:.3}",
            self.cfg.hard_drop
        );
        self.set(self.cfg.min, cause).unwrap_or_else(|| Change {
            from: self.lambda,
            to: self.lambda,
            cause: "hard stop".into(),
            phase: Phase::Stopped,
        })
    }

    /// Warm-up: control starts once ℓw has settled (|ΔLw| < ε_sft) for K evals.
    fn warm_up(&mut self, lw: f64, dlw: f64) -> Option<Change> {
        self.settle = if dlw.abs() < self.cfg.eps_sft {
            self.settle + 1
        } else {
            0
        };
        if self.settle < self.cfg.k {
            return None;
        }
        self.phase = Phase::Control;
        self.lw_ref = Some(lw);
        Some(Change {
            from: self.lambda,
            to: self.lambda,
            cause: format!("warm-up done: lw settled at {lw:.3}"),
            phase: Phase::Control,
        })
    }

    /// After a back-off: ramp again once ℓw recovers, back off again while displacement
    /// persists for K evals.
    fn hold(&mut self, dlw: f64, dlr: f64, displacing: bool) -> Option<Change> {
        let c = self.cfg.clone();
        if dlw >= 0.0 && !displacing {
            self.phase = Phase::Control;
            return self.set(
                self.lambda + c.ramp,
                format!("lw recovered (dLw {dlw:+.3}): ramp again"),
            );
        }
        if self.displaced >= c.k {
            self.displaced = 0;
            return self.set(
                self.lambda * c.backoff,
                format!("displacement persists (dLw {dlw:+.3}, dLr {dlr:+.3})"),
            );
        }
        None
    }

    /// AIMD: back off (and hold) on displacement confirmed for K evals, ramp while ℓw holds.
    fn aimd(&mut self, dlw: f64, dlr: f64) -> Option<Change> {
        let c = self.cfg.clone();
        if self.displaced >= c.k {
            self.displaced = 0;
            self.phase = Phase::Hold;
            self.set(
                self.lambda * c.backoff,
                format!("displacement confirmed (dLw {dlw:+.3}, dLr {dlr:+.3}): back off"),
            )
        } else if dlw >= -c.eps_disp {
            self.set(
                self.lambda + c.ramp,
                format!("lw holds (dLw {dlw:+.3}): ramp"),
            )
        } else {
            None
        }
    }

    /// P, PD, PID on e = ΔLw + ε_disp; lowering λ needs displacement confirmed for K evals.
    fn pid(&mut self, dlw: f64) -> Option<Change> {
        let c = self.cfg.clone();
        let e = dlw + c.eps_disp;
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
        // Lowering λ needs confirmed displacement; pushing is the default.
        if delta < 0.0 && self.displaced < c.k {
            return None;
        }
        let law = format!("{:?}", c.law).to_lowercase();
        self.set(
            self.lambda + delta,
            format!("{law}: e {e:+.3} → Δλ {delta:+.3}"),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aimd_warms_up_ramps_backs_off_and_stops_hard() {
        let mut c = Controller::new(ControllerConfig::new(Law::Aimd));
        assert_eq!(c.lambda, 0.05);
        // Warm-up: ℓw settles after two small changes.
        for lw in [-3.0, -2.99, -2.98, -2.97] {
            c.update(lw, -3.5);
        }
        assert_eq!(c.phase, Phase::Control);
        // ℓw holds: ramp.
        let ch = c.update(-2.96, -3.6).unwrap();
        assert!(ch.to > ch.from && ch.cause.contains("ramp"));
        let before = c.lambda;
        // Displacement twice (ℓw falls, ℓr falls faster): back off multiplicatively.
        c.update(-3.1, -3.9);
        let ch = c.update(-3.25, -4.3).unwrap();
        assert!(
            (ch.to - before * 0.5).abs() < 1e-9 && ch.cause.contains("displacement"),
            "{ch:?}"
        );
        assert_eq!(c.phase, Phase::Hold);
        // ℓw collapses past the hard-stop bound: λ to its minimum for good.
        let ch = c.update(-5.0, -6.0).unwrap();
        assert_eq!((c.phase, c.lambda), (Phase::Stopped, 0.05));
        assert!(ch.cause.contains("hard stop"));
        assert!(c.update(-2.0, -6.0).is_none());
    }

    #[test]
    fn pid_pushes_while_lw_holds_and_needs_confirmation_to_lower() {
        let mut c = Controller::new(ControllerConfig::new(Law::Pid));
        for lw in [-3.0, -3.0, -3.0, -3.0] {
            c.update(lw, -3.5);
        }
        assert_eq!(c.phase, Phase::Control);
        let up = c.update(-2.9, -3.6).unwrap();
        assert!(up.to > up.from);
        // One bad eval is not enough to lower λ.
        let l = c.lambda;
        assert!(c.update(-3.2, -4.0).is_none());
        assert_eq!(c.lambda, l);
    }

    #[test]
    fn theil_sen_ignores_an_outlier() {
        assert_eq!(robust_slope(&[0.0, 1.0, 2.0, 30.0, 4.0]), 1.0);
    }
}
