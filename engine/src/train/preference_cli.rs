//! `engine train --method dpo|cpo|simpo`: the objectives' flags (defaults: TRL 1.16's
//! `DPOConfig` and `CPOConfig`) and the refusals of flags that do not apply, each naming the
//! cause and the fix.

use super::lambda::Actuated;
use super::preference::{DpoLoss, PairObjective};

/// Which pair objective a `--method` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PairMethod {
    Dpo,
    Cpo,
    Simpo,
}

/// TRL 1.16's defaults: β 0.1 (DPOConfig and CPOConfig, SimPO included), label smoothing 0,
/// CPO's α 1.0 (SimPO's 0.0, as TRL's `alphapo`/SimPO recipe), SimPO's γ 0.5.
pub const DEFAULT_BETA: f32 = 0.1;
pub const DEFAULT_CPO_ALPHA: f32 = 1.0;
pub const DEFAULT_SIMPO_GAMMA: f32 = 0.5;

#[derive(clap::Args, Debug, Clone, Default)]
pub struct PrefArgs {
    /// DPO, CPO, SimPO: β, the reward scale (DPO: the KL weight; IPO: τ). Default 0.1.
    #[arg(long)]
    pub beta: Option<f32>,
    /// CPO, SimPO, and DPO's robust loss: the probability ε that a label is flipped
    /// (default 0; TRL 1.16's DPO sigmoid, hinge and ipo losses do not use it).
    #[arg(long)]
    pub label_smoothing: Option<f32>,
    /// DPO's loss: sigmoid (default), hinge, ipo, robust.
    #[arg(long, value_enum)]
    pub dpo_loss: Option<DpoLoss>,
    /// CPO, SimPO: the weight α of the chosen responses' NLL (CPO 1.0, SimPO 0.0).
    #[arg(long)]
    pub cpo_alpha: Option<f32>,
    /// SimPO: the target reward margin γ (default 0.5).
    #[arg(long)]
    pub simpo_gamma: Option<f32>,
}

impl PrefArgs {
    /// The objective `method` trains with these flags (defaults filled in).
    pub fn objective(&self, method: PairMethod) -> PairObjective {
        let beta = self.beta.unwrap_or(DEFAULT_BETA);
        let label_smoothing = self.label_smoothing.unwrap_or(0.0);
        match method {
            PairMethod::Dpo => PairObjective::Dpo {
                beta,
                loss: self.dpo_loss.unwrap_or_default(),
                label_smoothing,
            },
            PairMethod::Cpo => PairObjective::Cpo {
                beta,
                label_smoothing,
                cpo_alpha: self.cpo_alpha.unwrap_or(DEFAULT_CPO_ALPHA),
            },
            PairMethod::Simpo => PairObjective::Simpo {
                beta,
                label_smoothing,
                cpo_alpha: self.cpo_alpha.unwrap_or(0.0),
                gamma: self.simpo_gamma.unwrap_or(DEFAULT_SIMPO_GAMMA),
            },
        }
    }

    /// The flags given, by name.
    fn given(&self) -> Vec<&'static str> {
        [
            ("--beta", self.beta.is_some()),
            ("--label-smoothing", self.label_smoothing.is_some()),
            ("--dpo-loss", self.dpo_loss.is_some()),
            ("--cpo-alpha", self.cpo_alpha.is_some()),
            ("--simpo-gamma", self.simpo_gamma.is_some()),
        ]
        .into_iter()
        .filter_map(|(n, on)| on.then_some(n))
        .collect()
    }

    /// Refuses flags that do not apply to `method` (None: sft or orpo) and values out of
    /// range.
    pub fn check(&self, method: Option<PairMethod>) -> Result<(), String> {
        let Some(method) = method else {
            return match self.given().first() {
                Some(flag) => Err(format!(
                    "{flag} applies to --method dpo, cpo or simpo: drop it, or pick one of those"
                )),
                None => Ok(()),
            };
        };
        let foreign: &[(&str, bool, &str)] = &[
            ("--dpo-loss", self.dpo_loss.is_some(), "dpo"),
            ("--simpo-gamma", self.simpo_gamma.is_some(), "simpo"),
            ("--cpo-alpha", self.cpo_alpha.is_some(), "cpo or simpo"),
        ];
        let name = self.objective(method).name();
        for &(flag, on, owner) in foreign {
            if on && !owner.split(" or ").any(|m| m == name) {
                return Err(format!(
                    "{flag} applies to --method {owner}, not {name}: drop it"
                ));
            }
        }
        self.check_values(method)
    }

    fn check_values(&self, method: PairMethod) -> Result<(), String> {
        let obj = self.objective(method);
        let beta = obj.beta();
        if !(beta.is_finite() && beta > 0.0) {
            return Err(format!("--beta {beta}: β must be a positive number"));
        }
        let eps = self.label_smoothing.unwrap_or(0.0);
        if let PairObjective::Dpo { loss, .. } = obj {
            if loss != DpoLoss::Robust && self.label_smoothing.is_some_and(|e| e != 0.0) {
                return Err(format!(
                    "--label-smoothing does nothing with --dpo-loss {} (TRL 1.16 reads it only \
                     in the robust DPO loss): pass --dpo-loss robust, or drop it",
                    serde_json::to_value(loss).expect("a name")
                ));
            }
        }
        if !(0.0..0.5).contains(&eps) {
            return Err(format!(
                "--label-smoothing {eps}: the flip probability ε must lie in [0, 0.5)"
            ));
        }
        if let Some(a) = self.cpo_alpha.filter(|a| !(a.is_finite() && *a >= 0.0)) {
            return Err(format!("--cpo-alpha {a}: the NLL weight must be ≥ 0"));
        }
        if let Some(g) = self.simpo_gamma.filter(|g| !g.is_finite()) {
            return Err(format!("--simpo-gamma {g}: γ must be a finite number"));
        }
        Ok(())
    }
}

/// The weight `--orpo-lambda-schedule adaptive` moves for `method` (`requested`, or the
/// method's default: ORPO's λ, DPO's and CPO's β, SimPO's γ); refused where the method has
/// no such weight, or where a weight is named without the adaptive schedule.
pub fn actuated_weight(
    method: &str,
    adaptive: bool,
    requested: Option<Actuated>,
) -> Result<Actuated, String> {
    let allowed: &[Actuated] = match method {
        "orpo" => &[Actuated::Lambda],
        "dpo" | "cpo" => &[Actuated::Beta],
        "simpo" => &[Actuated::Gamma, Actuated::Beta],
        _ => &[],
    };
    if !adaptive {
        if let Some(w) = requested {
            return Err(format!(
                "--adaptive-weight {} names the weight the controller moves: add \
                 --orpo-lambda-schedule adaptive, or drop it",
                w.key()
            ));
        }
        return Ok(allowed.first().copied().unwrap_or(Actuated::Lambda));
    }
    let Some(&default) = allowed.first() else {
        return Err(format!(
            "--orpo-lambda-schedule adaptive moves a preference objective's weight, and \
             --method {method} has none: train with orpo, dpo, cpo or simpo, or drop it"
        ));
    };
    match requested {
        None => Ok(default),
        Some(w) if allowed.contains(&w) => Ok(w),
        Some(w) => Err(format!(
            "--method {method} has no {} to move: --adaptive-weight takes {}",
            w.key(),
            allowed
                .iter()
                .map(|a| a.key())
                .collect::<Vec<_>>()
                .join(" or ")
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_trl_1_16s() {
        let none = PrefArgs::default();
        assert_eq!(
            none.objective(PairMethod::Dpo),
            PairObjective::Dpo {
                beta: 0.1,
                loss: DpoLoss::Sigmoid,
                label_smoothing: 0.0
            }
        );
        assert_eq!(
            none.objective(PairMethod::Cpo),
            PairObjective::Cpo {
                beta: 0.1,
                label_smoothing: 0.0,
                cpo_alpha: 1.0
            }
        );
        assert_eq!(
            none.objective(PairMethod::Simpo),
            PairObjective::Simpo {
                beta: 0.1,
                label_smoothing: 0.0,
                cpo_alpha: 0.0,
                gamma: 0.5
            }
        );
        for m in [PairMethod::Dpo, PairMethod::Cpo, PairMethod::Simpo] {
            assert_eq!(none.check(Some(m)), Ok(()));
        }
        assert_eq!(none.check(None), Ok(()));
    }

    #[test]
    fn out_of_range_values_are_refused() {
        let with = |f: fn(&mut PrefArgs)| {
            let mut a = PrefArgs::default();
            f(&mut a);
            a
        };
        let robust = |a: &mut PrefArgs| {
            a.dpo_loss = Some(DpoLoss::Robust);
            a.label_smoothing = Some(0.5);
        };
        assert!(with(robust).check(Some(PairMethod::Dpo)).is_err());
        assert!(with(|a| a.beta = Some(0.0))
            .check(Some(PairMethod::Cpo))
            .is_err());
        assert!(with(|a| a.cpo_alpha = Some(-1.0))
            .check(Some(PairMethod::Simpo))
            .is_err());
        assert!(with(|a| a.label_smoothing = Some(0.2))
            .check(Some(PairMethod::Simpo))
            .is_ok());
    }
}
