//! Prompt lookup over a batch (issue 43, item 4, its first part): each row drafts up to γ
//! ids from its own text (`lookup::propose`), one forward of [B, γ+1] feeds every row its
//! next id and its drafts (`Batch::verify`), and each row keeps what plain greedy decoding
//! emits: its drafts up to the first one greedy disagrees with, then greedy's own id there.
//! The rejected positions leave the batch cache row by row (`Batch::trim_rows`: they become
//! padding at the row's front, as a batched prefill's right padding does in mlx-lm's
//! `finalize`). A row with fewer drafts than γ is padded with its next id; a pad that greedy
//! agrees with is what greedy emits there, so it is kept like a draft.
//!
//! Rows are greedy only (the acceptance is an argmax per position); full-attention K/V
//! caches only (`trim_rows`). The verify's [B, γ+1] forward may round differently from a
//! one-token step, as the serial verify does: its gate allows a divergence only at a
//! near-tie of plain greedy decoding.

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::argmax_axis;

use super::batch::Batch;
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

/// One round over every row of `batch`: `texts[r]` is row r's prompt and every id emitted
/// so far, its last id not yet fed (the batch holds all of `texts[r]` but that one). The
/// ids each row emits are appended to its text.
pub fn round(
    batch: &mut Batch,
    texts: &mut [Vec<u32>],
    gamma: usize,
    max_ngram: usize,
) -> Result<Vec<RowRound>, Exception> {
    let mut drafted = Vec::with_capacity(texts.len());
    let runs: Vec<Vec<u32>> = texts
        .iter()
        .map(|text| {
            let next = *text.last().expect("a row's text is never empty");
            let drafts = propose(text, max_ngram, gamma);
            drafted.push(drafts.len());
            let mut run = Vec::with_capacity(gamma + 1);
            run.push(next);
            run.extend(&drafts);
            run.resize(gamma + 1, next);
            run
        })
        .collect();
    let logits = batch.verify(&runs)?;
    let picks = argmax_axis(&logits, -1, None)?.as_dtype(mlx_rs::Dtype::Uint32)?;
    picks.eval()?;
    let picks = picks.as_slice::<u32>();
    let mut rejected = Vec::with_capacity(texts.len());
    let mut rounds = Vec::with_capacity(texts.len());
    for (r, (text, run)) in texts.iter_mut().zip(&runs).enumerate() {
        let greedy = &picks[r * (gamma + 1)..(r + 1) * (gamma + 1)];
        // Draft j (run[j + 1]) stands where greedy picked greedy[j].
        let accepted = (0..gamma).take_while(|&j| run[j + 1] == greedy[j]).count();
        text.extend(&greedy[..=accepted]);
        rejected.push(gamma - accepted);
        rounds.push(RowRound {
            emitted: accepted + 1,
            drafted: drafted[r],
            accepted: accepted.min(drafted[r]),
        });
    }
    batch.trim_rows(&rejected)?;
    Ok(rounds)
}
