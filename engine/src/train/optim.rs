//! AdamW and learning-rate schedules as mlx.optimizers 0.32.2 computes them, op for op:
//! the step counter is a uint64 array, the rate an f32 array from the schedule at the step
//! before the increment, decoupled weight decay `p·(1 − lr·wd)` applied before Adam's
//! `p − lr·m/(√v + eps)` (no bias correction, as MLX's default).

use mlx_rs::error::Exception;
use mlx_rs::ops::{cos, minimum, zeros_like};
use mlx_rs::{Array, Dtype};

use crate::model::layers::weak;

/// mlx.optimizers' schedules (`build_schedule`'s cosine with linear warm-up).
#[derive(Debug, Clone, PartialEq)]
pub enum Schedule {
    Constant(f64),
    /// `linear_schedule(init, peak, warmup)` joined at warmup + 1 with
    /// `cosine_decay(peak, decay_steps, end)`; warmup 0 = cosine alone.
    WarmupCosine {
        warmup: u64,
        warmup_init: f64,
        peak: f64,
        decay_steps: u64,
        end: f64,
    },
}

fn scalar_u64(v: u64) -> Array {
    Array::from_slice(&[v], &[])
}

impl Schedule {
    /// The rate at `step` (an f32 array).
    pub fn at(&self, step: u64) -> Result<Array, Exception> {
        match *self {
            Schedule::Constant(lr) => Ok(Array::from_f32(lr as f32)),
            Schedule::WarmupCosine {
                warmup,
                warmup_init,
                peak,
                decay_steps,
                end,
            } => {
                let cosine = |s: u64| -> Result<Array, Exception> {
                    let s = minimum(scalar_u64(s), scalar_u64(decay_steps))?;
                    let arg = s.multiply(weak(
                        std::f64::consts::PI / decay_steps as f64,
                        &Array::from_f32(0.0),
                    )?)?;
                    let decay = cos(&arg)?
                        .add(weak(1.0, &arg)?)?
                        .multiply(weak(0.5, &arg)?)?;
                    decay
                        .multiply(weak(peak - end, &decay)?)?
                        .add(weak(end, &decay)?)
                };
                if warmup == 0 {
                    return cosine(step);
                }
                if step < warmup + 1 {
                    let s = minimum(scalar_u64(step), scalar_u64(warmup))?;
                    let slope = (peak - warmup_init) / warmup as f64;
                    let x = s.multiply(weak(slope, &Array::from_f32(0.0))?)?;
                    return x.add(weak(warmup_init, &x)?);
                }
                cosine(step - (warmup + 1))
            }
        }
    }
}

pub struct AdamW {
    pub schedule: Schedule,
    pub betas: (f64, f64),
    pub eps: f64,
    pub weight_decay: f64,
    /// Updates applied so far.
    pub step: u64,
    m: Vec<Array>,
    v: Vec<Array>,
}

impl AdamW {
    pub fn new(schedule: Schedule, weight_decay: f64) -> Self {
        AdamW {
            schedule,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay,
            step: 0,
            m: Vec::new(),
            v: Vec::new(),
        }
    }

    /// The rate the next update uses.
    pub fn learning_rate(&self) -> Result<f32, Exception> {
        let lr = self.schedule.at(self.step)?.as_dtype(Dtype::Float32)?;
        lr.eval()?;
        Ok(lr.as_slice::<f32>()[0])
    }

    /// One update: new parameters from `params` and their `grads`.
    pub fn update(&mut self, params: &[Array], grads: &[Array]) -> Result<Vec<Array>, Exception> {
        if self.m.is_empty() {
            self.m = grads.iter().map(zeros_like).collect::<Result<_, _>>()?;
            self.v = grads.iter().map(zeros_like).collect::<Result<_, _>>()?;
        }
        let rate = self.schedule.at(self.step)?;
        self.step += 1;
        let (b1, b2) = self.betas;
        let mut out = Vec::with_capacity(params.len());
        for (i, (p, g)) in params.iter().zip(grads).enumerate() {
            let lr = rate.as_dtype(g.dtype())?;
            let decay = weak(1.0, &lr)?.subtract(lr.multiply(weak(self.weight_decay, &lr)?)?)?;
            let p = p.multiply(&decay)?;
            let m = self.m[i]
                .multiply(weak(b1, g)?)?
                .add(g.multiply(weak(1.0 - b1, g)?)?)?;
            let v = self.v[i]
                .multiply(weak(b2, g)?)?
                .add(g.square()?.multiply(weak(1.0 - b2, g)?)?)?;
            let step = lr
                .multiply(&m)?
                .divide(v.sqrt()?.add(weak(self.eps, &v)?)?)?;
            out.push(p.subtract(&step)?);
            self.m[i] = m;
            self.v[i] = v;
        }
        Ok(out)
    }

    /// The optimizer state to evaluate with the parameters.
    pub fn state(&self) -> Vec<&Array> {
        self.m.iter().chain(self.v.iter()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// mlx-lm's `build_schedule({"name": "cosine_decay", "arguments": [1e-3, 90, 1e-5],
    /// "warmup": 10})` at these steps, as MLX 0.32.2 computed them (f32).
    #[test]
    fn warmup_cosine_matches_mlx() {
        let s = Schedule::WarmupCosine {
            warmup: 10,
            warmup_init: 0.0,
            peak: 1e-3,
            decay_steps: 90,
            end: 1e-5,
        };
        let mlx: [(u64, f64); 10] = [
            (0, 0.0),
            (1, 9.999999747378752e-05),
            (5, 0.0004999999655410647),
            (10, 0.0009999999310821295),
            (11, 0.0009999999310821295),
            (12, 0.0009996984153985977),
            (50, 0.0006079162703827024),
            (100, 1.0301533620804548e-05),
            (101, 9.999999747378752e-06),
            (150, 9.999999747378752e-06),
        ];
        for (step, want) in mlx {
            let got = s.at(step).unwrap().as_dtype(Dtype::Float32).unwrap();
            got.eval().unwrap();
            assert_eq!(got.as_slice::<f32>()[0], want as f32, "step {step}");
        }
    }
}
