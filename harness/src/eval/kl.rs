//! Teacher-forced comparison of the tiers. Every row of held-out ids is run through one
//! session per tier the way generation runs it: the first `prefix` ids prefilled, then one
//! id per step, always the corpus's next id (teacher forcing: the tiers see the same
//! history, so a difference at one position never cascades). At every position from the
//! prefill's last one on, each tier's next-token distribution (log-softmax in f32) is
//! compared with L1's: KL(L1 ‖ tier) in nats, and whether the argmax agrees. The
//! log-probability of the corpus's next id gives each tier's teacher-forced perplexity
//! (the decode path's; `ppl.rs` is mlx_lm.perplexity's no-cache one).

use mlx_rs::{Array, Dtype};

use engine::generate::{Session, SessionOptions};
use engine::model::LanguageModel;

use super::EvalError;

/// One position's log-probabilities over the vocabulary (f32, host).
pub type LogProbs = Vec<f32>;

/// The teacher-forced log-probabilities of one row under `opts`: one vector per position
/// `prefix-1 .. len-2` (each predicting the next id of the row).
pub fn teacher_forced(
    model: &dyn LanguageModel,
    opts: &SessionOptions,
    row: &[u32],
    prefix: usize,
) -> Result<Vec<LogProbs>, EvalError> {
    if prefix == 0 || prefix >= row.len() {
        return Err(EvalError::Data(format!(
            "--prefix must be in 1..{} (the sequence length)",
            row.len()
        )));
    }
    let mut session = Session::with_options(model, opts);
    let mut out = vec![log_softmax(&session.prefill(&row[..prefix])?)?];
    for &id in &row[prefix..row.len() - 1] {
        out.push(log_softmax(&session.step(&[id])?)?);
    }
    Ok(out)
}

fn log_softmax(logits: &Array) -> Result<LogProbs, EvalError> {
    let logits = logits.as_dtype(Dtype::Float32)?;
    let lp = logits.subtract(logits.logsumexp_axis(-1, true)?)?;
    lp.eval()?;
    Ok(lp.as_slice::<f32>().to_vec())
}

/// KL(p ‖ q) = Σ p (log p − log q), in f64 over f32 log-probabilities.
pub fn kl(p: &[f32], q: &[f32]) -> f64 {
    p.iter()
        .zip(q)
        .map(|(&lp, &lq)| {
            let (lp, lq) = (f64::from(lp), f64::from(lq));
            if lp == f64::NEG_INFINITY {
                0.0
            } else {
                lp.exp() * (lp - lq)
            }
        })
        .sum()
}

fn argmax(v: &[f32]) -> usize {
    // First maximum, as MLX's argmax.
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best
}

/// A tier against L1 over every compared position (and its own teacher-forced loss).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct TierStats {
    pub positions: usize,
    pub kl_sum: f64,
    pub kl_max: f64,
    /// Where the largest KL is: (row, position in the row).
    pub kl_max_at: (usize, usize),
    pub top1_agree: usize,
    /// Σ −log p(next id), for the teacher-forced perplexity.
    pub nll_sum: f64,
}

impl TierStats {
    /// Adds one row: `reference` (L1) and `tier` log-probabilities, the row's ids.
    pub fn add_row(
        &mut self,
        row_index: usize,
        row: &[u32],
        prefix: usize,
        reference: &[LogProbs],
        tier: &[LogProbs],
    ) {
        for (i, (p, q)) in reference.iter().zip(tier).enumerate() {
            let d = kl(p, q);
            let pos = prefix - 1 + i;
            if d > self.kl_max || self.positions == 0 {
                self.kl_max = d;
                self.kl_max_at = (row_index, pos);
            }
            self.kl_sum += d;
            self.top1_agree += usize::from(argmax(p) == argmax(q));
            self.nll_sum -= f64::from(q[row[pos + 1] as usize]);
            self.positions += 1;
        }
    }

    pub fn kl_mean(&self) -> f64 {
        self.kl_sum / self.positions.max(1) as f64
    }

    pub fn top1(&self) -> f64 {
        self.top1_agree as f64 / self.positions.max(1) as f64
    }

    /// exp(mean −log p) over the compared positions.
    pub fn teacher_forced_ppl(&self) -> f64 {
        (self.nll_sum / self.positions.max(1) as f64).exp()
    }
}

/// One comparison: KL(`reference` ‖ `tier`), indices into the tiers given to [`compare`].
#[derive(Debug, Clone, serde::Serialize)]
pub struct Pair {
    pub reference: String,
    pub tier: String,
    pub stats: TierStats,
}

/// Runs every row once under each `(name, options)` of `tiers` and compares the pairs
/// `(reference, tier)` (indices into `tiers`; a tier against itself gives KL 0 and its own
/// teacher-forced perplexity).
pub fn compare(
    model: &dyn LanguageModel,
    tiers: &[(String, SessionOptions)],
    pairs: &[(usize, usize)],
    rows: &[Vec<u32>],
    prefix: usize,
) -> Result<Vec<Pair>, EvalError> {
    let mut out: Vec<Pair> = pairs
        .iter()
        .map(|&(r, t)| Pair {
            reference: tiers[r].0.clone(),
            tier: tiers[t].0.clone(),
            stats: TierStats::default(),
        })
        .collect();
    for (r, row) in rows.iter().enumerate() {
        let runs = tiers
            .iter()
            .map(|(_, opts)| teacher_forced(model, opts, row, prefix))
            .collect::<Result<Vec<_>, _>>()?;
        for (&(a, b), pair) in pairs.iter().zip(out.iter_mut()) {
            pair.stats.add_row(r, row, prefix, &runs[a], &runs[b]);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kl_of_a_distribution_with_itself_is_zero_and_positive_otherwise() {
        let p: Vec<f32> = [0.5f32, 0.25, 0.25].iter().map(|x| x.ln()).collect();
        let q: Vec<f32> = [0.25f32, 0.5, 0.25].iter().map(|x| x.ln()).collect();
        assert_eq!(kl(&p, &p), 0.0);
        let want = 0.5 * 2f64.ln() + 0.25 * 0.5f64.ln();
        assert!((kl(&p, &q) - want).abs() < 1e-7);
        assert_eq!(argmax(&[1.0, 3.0, 3.0]), 1);
    }
}
