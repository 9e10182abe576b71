//! Prompt lookup over a batch (issue 43, item 4, its first part): each row drafts up to γ
//! ids from its own text (`lookup::propose`), one forward of [B, γ+1] feeds every row its
//! next id and its drafts (`Batch::verify`), and each row keeps what plain greedy decoding
//! emits: its drafts up to the first one greedy disagrees with, then greedy's own id there.
//! The rejected positions leave the batch cache row by row (`Batch::trim_rows`: those every
//! row rejects move the write position back, the rest become padding at the row's front, as
//! a batched prefill's right padding does in mlx-lm's `finalize`). γ of a round is the most
//! drafts any row found; a row with fewer is padded with its next id (a pad is never kept:
//! the row emits its picks up to the first draft they disagree with, or past its drafts).
//!
//! `round` is the whole round for greedy rows that do not end (the acceptance an argmax per
//! position, `GreedyPicks`); the batch lane runs its rounds itself
//! (`serve/batch_lane/lookup.rs`: rows may end mid-run there, rows that sample otherwise
//! pick with their own samplers, and rows may draft with a draft model instead,
//! `batch_draft`). Standard K/V caches only (`batch::trims_rows`). The verify's [B, γ+1]
//! forward may round differently from a one-token step, as the serial verify does: its gate
//! allows a divergence only at a near-tie of plain greedy decoding.

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

/// Every row's run for one verify: its next id, then its drafts, shorter runs padded with
/// the next id to the longest (γ + 1 ids each, γ the most drafts any row has).
pub fn runs(next: &[u32], drafts: &[Vec<u32>]) -> Vec<Vec<u32>> {
    let len = 1 + drafts.iter().map(Vec::len).max().unwrap_or(0);
    next.iter()
        .zip(drafts)
        .map(|(&y, d)| {
            let mut run = Vec::with_capacity(len);
            run.push(y);
            run.extend(d);
            run.resize(len, y);
            run
        })
        .collect()
}

/// How many leading drafts the verify's picks agree with (pick j stands where draft j was
/// fed), at most `kept` (a constraint may cut the drafts short).
pub fn agreed(picks: &[u32], drafts: &[u32], kept: usize) -> usize {
    drafts
        .iter()
        .zip(picks)
        .take(kept)
        .take_while(|(d, p)| d == p)
        .count()
}

/// The picks of a verify whose rows all sample plain greedy: one log-softmax and one argmax
/// over every position of every row (`greedy_rows`: each row's are what its own pick gives).
pub struct GreedyPicks {
    picks: Vec<u32>,
    /// [rows × run length, vocab] (lazy).
    logprobs: Array,
    len: usize,
}

impl GreedyPicks {
    /// From a verify's logits [rows, run length, vocab].
    pub fn of(logits: &Array) -> Result<Self, Exception> {
        let (len, vocab) = (logits.shape()[1], logits.shape()[2]);
        let (picks, logprobs) = greedy_rows(&logits.reshape(&[-1, vocab])?)?;
        let picks = picks.as_dtype(mlx_rs::Dtype::Uint32)?;
        picks.eval()?;
        Ok(GreedyPicks {
            picks: picks.as_slice::<u32>().to_vec(),
            logprobs,
            len: len as usize,
        })
    }

    /// Row `r`'s picks, one per position of its run.
    pub fn row(&self, r: usize) -> &[u32] {
        &self.picks[r * self.len..(r + 1) * self.len]
    }

    /// Row `r`'s log-probabilities, [run length, vocab].
    pub fn logprobs(&self, r: usize) -> Array {
        use mlx_rs::ops::indexing::IndexOp;
        let at = (r * self.len) as i32;
        self.logprobs.index(at..at + self.len as i32)
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
    let runs = runs(&next, &drafts);
    let picks = GreedyPicks::of(&batch.verify(&runs)?)?;
    let mut given_back = Vec::with_capacity(texts.len());
    let mut rounds = Vec::with_capacity(texts.len());
    for (r, text) in texts.iter_mut().enumerate() {
        let accepted = agreed(picks.row(r), &drafts[r], drafts[r].len());
        text.extend(&picks.row(r)[..=accepted]);
        given_back.push(runs[r].len() - (accepted + 1));
        rounds.push(RowRound {
            emitted: accepted + 1,
            drafted: drafts[r].len(),
            accepted,
        });
    }
    batch.trim_rows(&given_back)?;
    Ok(rounds)
}
