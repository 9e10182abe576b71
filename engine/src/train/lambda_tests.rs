//! The controller's transitions, one test per rule of the design.

use super::*;

/// Each eval's standard error of ℓw: ΔLw's noise is √2·SE = 0.01 (ε_sft = ε_disp = 0.02).
const SE: f64 = 0.01 / std::f64::consts::SQRT_2;

/// A controller calibrated at ℓw −3.0.
fn calibrated(law: Law) -> Controller {
    let mut c = Controller::new(ControllerConfig::new(law));
    c.calibrate(-3.0, -3.5, SE).unwrap();
    c
}

/// Feeds ℓw values (ℓr fixed at −3.5) and returns the last change.
fn feed(c: &mut Controller, lws: &[f64]) -> Option<Change> {
    lws.iter().filter_map(|&lw| c.update(lw, -3.5, SE)).last()
}

fn near(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-12
}

/// Warm-up until SFT saturates (K = 3 flat evals), then in ramp at λ 0.10.
fn ramping(law: Law) -> Controller {
    let mut c = calibrated(law);
    let ch = feed(&mut c, &[-2.5, -2.0, -2.0, -2.0, -2.0]).unwrap();
    assert_eq!(
        (c.phase, ch.cause.as_str()),
        (Phase::Ramp, "SFT saturated, ramping")
    );
    assert!((c.lambda - 0.10).abs() < 1e-12);
    c
}

#[test]
fn defaults_are_the_designs() {
    let c = ControllerConfig::new(Law::Aimd);
    assert_eq!((c.min, c.max, c.step, c.k), (0.05, 0.5, 0.05, 3));
    assert_eq!(
        (c.eps_sft, c.eps_disp),
        (Eps::Sigmas(2.0), Eps::Sigmas(2.0))
    );
}

#[test]
fn warm_up_waits_for_k_flat_evals_and_ramps_at_once() {
    let mut c = calibrated(Law::Aimd);
    // Rising by more than ε_sft: warm-up stays; two flat evals are not K = 3.
    assert!(feed(&mut c, &[-2.5, -2.0, -2.0, -2.0]).is_none());
    assert_eq!((c.phase, c.lambda), (Phase::Warmup, 0.05));
    let ch = c.update(-2.0, -3.5, SE).unwrap();
    assert_eq!(ch.line(), "λ 0.050 → 0.100 (SFT saturated, ramping)");
    // Chosen holds: +step each eval, capped at λ_max.
    feed(&mut c, &[-2.0; 20]);
    assert_eq!(c.lambda, 0.5);
}

#[test]
fn eps_come_from_the_measured_noise_or_fixed_values() {
    let mut c = calibrated(Law::Aimd);
    assert!(near(c.eps_sft, 0.02) && near(c.eps_disp, 0.02));
    // Each eval re-measures: ΔLw's noise is √(se₁² + se₂²).
    c.update(-2.0, -3.5, 3.0 * SE);
    let want = SE.hypot(3.0 * SE);
    assert!(near(c.eps_sft, 2.0 * want) && near(c.eps_disp, 2.0 * want));
    assert_eq!("2sigma".parse::<Eps>(), Ok(Eps::Sigmas(2.0)));
    assert_eq!("0.03".parse::<Eps>(), Ok(Eps::Fixed(0.03)));
    assert!("two".parse::<Eps>().is_err());
    let mut cfg = ControllerConfig::new(Law::Aimd);
    cfg.eps_disp = Eps::Fixed(0.07);
    let mut fixed = Controller::new(cfg.clone());
    fixed.calibrate(-3.0, -3.5, SE).unwrap();
    assert!(near(fixed.eps_sft, 0.02) && fixed.eps_disp == 0.07);
    // A noise multiple with no measurable noise is refused.
    let err = Controller::new(cfg)
        .calibrate(-3.0, -3.5, f64::NAN)
        .unwrap_err();
    assert!(err.contains("--lambda-eps-sft"), "{err}");
    assert!((standard_error(&[1.0, 2.0, 3.0]) - (1.0f64 / 3.0).sqrt()).abs() < 1e-12);
}

#[test]
fn chosen_falling_on_its_own_backs_off() {
    let mut c = ramping(Law::Aimd);
    // ℓw falls by more than ε_disp while ℓr stays: displacement.
    let ch = c.update(-2.05, -3.5, SE).unwrap();
    assert_eq!(c.phase, Phase::Backoff);
    assert!((ch.to - 0.05).abs() < 1e-12 && ch.cause.starts_with("displacement"));
}

#[test]
fn rejected_collapsing_with_chosen_flat_backs_off() {
    let mut c = ramping(Law::Aimd);
    c.update(-2.0, -3.5, SE);
    let l = c.lambda;
    // ℓw flat (within ε_disp), ℓr down by more than lr_drop·ε_disp.
    let ch = c.update(-2.005, -3.6, SE).unwrap();
    assert_eq!((c.phase, ch.to), (Phase::Backoff, l * 0.5));
    // ℓr falling while ℓw rises is the healthy case: no back-off.
    let mut h = ramping(Law::Aimd);
    h.update(-1.9, -3.9, SE);
    assert_eq!(h.phase, Phase::Ramp);
}

#[test]
fn back_off_until_recovery_then_hold_k_evals() {
    let mut c = ramping(Law::Aimd);
    feed(&mut c, &[-2.0, -2.0, -2.0]); // λ 0.25
    c.update(-2.1, -3.5, SE); // displacement: 0.125
    let ch = c.update(-2.2, -3.5, SE).unwrap(); // still falling: 0.0625
    assert!(ch.cause.starts_with("displacement"));
    let ch = c.update(-2.19, -3.5, SE).unwrap(); // recovered (ΔLw ≥ 0): hold
    assert_eq!((c.phase, ch.from, ch.to), (Phase::Hold, 0.0625, 0.0625));
    // Hysteresis: K = 3 evals without displacement before ramping again.
    assert!(feed(&mut c, &[-2.19, -2.19]).is_none());
    let ch = c.update(-2.19, -3.5, SE).unwrap();
    assert_eq!(
        (c.phase, ch.cause.as_str()),
        (Phase::Ramp, "held 3 evals, ramping again")
    );
    // Displacement during a hold backs off again.
    let mut h = ramping(Law::Aimd);
    h.update(-2.1, -3.5, SE);
    h.update(-2.09, -3.5, SE);
    assert_eq!(h.phase, Phase::Hold);
    h.update(-2.2, -3.5, SE);
    assert_eq!(h.phase, Phase::Backoff);
}

#[test]
fn hard_stop_is_measured_from_the_start_of_warm_up() {
    let mut c = ramping(Law::Aimd); // ℓw started at −3.0, rose to −2.0
                                    // 1.5 below where warm-up ended, but not 1.0 below its start: no hard stop.
    c.update(-3.5 + 0.01, -3.5, SE);
    assert_ne!(c.phase, Phase::Stopped);
    let ch = c.update(-4.1, -3.5, SE).unwrap();
    assert_eq!((c.phase, ch.to), (Phase::Stopped, 0.05));
    assert!(ch.cause.contains("hard stop") && ch.cause.contains("-3.000"));
    assert!(c.update(-2.0, -3.5, SE).is_none());
}

#[test]
fn pid_ramps_only_upward_and_backs_off_on_displacement() {
    let mut c = ramping(Law::Pid);
    let up = c.update(-1.9, -3.6, SE).unwrap();
    assert!(up.to > up.from, "{up:?}");
    let l = c.lambda;
    let ch = c.update(-2.0, -3.6, SE).unwrap();
    assert_eq!((c.phase, ch.to), (Phase::Backoff, l * 0.5));
}

#[test]
fn theil_sen_ignores_an_outlier() {
    assert_eq!(robust_slope(&[0.0, 1.0, 2.0, 30.0, 4.0]), 1.0);
}
