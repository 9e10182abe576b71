//! Prompt lookup over a batch (issue 43, item 4, its first part): each row drafts up to γ
//! ids from its own text (`lookup::propose`), one forward of [B, γ+1] feeds every row its
//! next id and its drafts (`Batch::verify`), and each row keeps what plain greedy decoding
//! emits: its drafts up to the first one greedy disagrees with, then greedy's own id there.
//! The rejected positions leave the batch cache row by row (`Batch::trim_rows`: those every
//! row rejects move the write position back, the rest become padding at the row's front, as
//! a batched prefill's right padding does in mlx-lm's `finalize`). γ of a round is the most
//! drafts any row found; a row with fewer is padded with its next id, and a pad that greedy
//! agrees with is what greedy emits there, so it is kept like a draft.
//!
//! Rows are greedy only (the acceptance is an argmax per position, `greedy_rows`, so each
//! id and its log-probabilities are what a plain step's `greedy_rows` gives); standard K/V
//! caches only (`batch::trims_rows`). The batch lane runs these rounds itself
//! (`serve/batch_lane/lookup.rs`: rows may end mid-run there); `round` is the whole round
//! for rows that do not end. The verify's [B, γ+1] forward may round differently from a
//! one-token step, as the serial verify does: its gate allows a divergence only at a
//! near-tie of plain greedy decoding.

use mlx_rs::error::Exception;
use mlx_rs::Array;

use super::batch::Batch;
use super::decode::greedy_rows;
use super::lookup::propose;

/// What one round did to a row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowRound {
    /// Ids it emitted (one more than the drafts accepted).
    pub emitted: usize,
    /// Drafts copied from its text (pads not counted), and how many of them were accepted.
    pub drafted: usize,
    pub accepted: usize,
}

/// The verify pass of one round: every row's run (its next id, then its drafts, padded with
/// the next id to the longest run) in one forward.
pub struct Verify {
    pub runs: Vec<Vec<u32>>,
    /// Greedy's pick at every position of every row, row-major [B × run length].
    pub picks: Vec<u32>,
    /// Their log-probabilities, [B × run length, vocab] (lazy).
    pub logprobs: Array,
}

impl Verify {
    /// Feeds `next[r]` and `drafts[r]` of every row (the batch holds each row's text but
    /// its next id).
    pub fn run(batch: &mut Batch, next: &[u32], drafts: &[Vec<u32>]) -> Result<Self, Exception> {
        let len = 1 + drafts.iter().map(Vec::len).max().unwrap_or(0);
        let runs: Vec<Vec<u32>> = next
            .iter()
            .zip(drafts)
            .map(|(&y, d)| {
                let mut run = Vec::with_capacity(len);
                run.push(y);
                run.extend(d);
                run.resize(len, y);
                run
            })
            .collect();
        let logits = batch.verify(&runs)?;
        let vocab = *logits.shape().last().expect("logits have a vocab axis");
        let (picks, logprobs) = greedy_rows(&logits.reshape(&[-1, vocab])?)?;
        let picks = picks.as_dtype(mlx_rs::Dtype::Uint32)?;
        picks.eval()?;
        Ok(Verify {
            picks: picks.as_slice::<u32>().to_vec(),
            runs,
            logprobs,
        })
    }

    /// The run length (γ + 1).
    pub fn run_len(&self) -> usize {
        self.runs.first().map_or(0, Vec::len)
    }

    /// Row `r`'s picks, one per position of its run.
    pub fn greedy(&self, r: usize) -> &[u32] {
        &self.picks[r * self.run_len()..(r + 1) * self.run_len()]
    }

    /// Row `r`'s leading positions whose runs greedy agrees with: pick j stands where
    /// run[j + 1] was fed, so the row emits picks 0..=accepted.
    pub fn accepted(&self, r: usize) -> usize {
        let (run, greedy) = (&self.runs[r], self.greedy(r));
        (0..self.run_len() - 1)
            .take_while(|&j| run[j + 1] == greedy[j])
            .count()
    }

    /// The log-probabilities row `r`'s pick `j` was taken from, [1, vocab].
    pub fn logprobs(&self, r: usize, j: usize) -> Array {
        use mlx_rs::ops::indexing::IndexOp;
        let k = (r * self.run_len() + j) as i32;
        self.logprobs.index(k..k + 1)
    }
}

/// One round over every row of `batch`: `texts[r]` is row r's prompt and every id emitted
/// so far, its last id not yet fed (the batch holds all of `texts[r]` but that one). The
/// ids each row emits are appended to its text.
pub fn round(
    batch: &mut Batch,
    texts: &mut [Vec<u32>],
    gamma: usize,
    max_ngram: usize,
) -> Result<Vec<RowRound>, Exception> {
    let next: Vec<u32> = texts
        .iter()
        .map(|t| *t.last().expect("a row's text is never empty"))
        .collect();
    let drafts: Vec<Vec<u32>> = texts.iter().map(|t| propose(t, max_ngram, gamma)).collect();
    let verify = Verify::run(batch, &next, &drafts)?;
    let gamma = verify.run_len() - 1;
    let mut rejected = Vec::with_capacity(texts.len());
    let mut rounds = Vec::with_capacity(texts.len());
    for (r, text) in texts.iter_mut().enumerate() {
        let accepted = verify.accepted(r);
        text.extend(&verify.greedy(r)[..=accepted]);
        rejected.push(gamma - accepted);
        rounds.push(RowRound {
            emitted: accepted + 1,
            drafted: drafts[r].len(),
            accepted: accepted.min(drafts[r].len()),
        });
    }
    batch.trim_rows(&rejected)?;
    Ok(rounds)
}
