//! mlx-lm's SFT loss (`tuner.trainer.default_loss`), op for op: next-token cross-entropy
//! over the positions `lengths` marks as supervised, summed in f32 and divided by their
//! count. `lengths[i] = [offset, length]`: targets at 1-based steps offset..=length count
//! (a prompt of `offset` tokens is masked; mlx-lm's range also takes the one position past
//! the sequence end, a padding target — mirrored, since the gate is bit-exactness).

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::ops::{arange, logical_and};
use mlx_rs::{Array, Dtype};

use crate::model::LanguageModel;

/// `nn.losses.cross_entropy(logits, targets)` with class indices, no reduction, as MLX
/// 0.32.2 computes it off CUDA: the logits shifted by their (gradient-stopped) maximum,
/// then logsumexp − the target's score, in the logits' dtype.
pub fn cross_entropy(logits: &Array, targets: &Array) -> Result<Array, Exception> {
    let max = mlx_rs::stop_gradient(logits.max_axis(-1, true)?)?;
    let logits = logits.subtract(&max)?;
    let score = logits
        .take_along_axis(&targets.expand_dims(-1)?, -1)?
        .squeeze_axes(&[-1])?;
    logits.logsumexp_axis(-1, false)?.subtract(&score)
}

/// (loss, ntoks) for a batch [B, T] of ids with `lengths` [B, 2].
pub fn default_loss(
    model: &dyn LanguageModel,
    batch: &Array,
    lengths: &Array,
) -> Result<(Array, Array), Exception> {
    let t = batch.shape()[1];
    let inputs = batch.index((.., ..t - 1));
    let logits = model.forward(
        &inputs,
        &mut crate::cache::none::none_for(&model.make_caches()),
    )?;
    sft_loss(&logits, batch, lengths)
}

/// `default_loss` from the logits of `batch[:, :-1]`.
pub fn sft_loss(
    logits: &Array,
    batch: &Array,
    lengths: &Array,
) -> Result<(Array, Array), Exception> {
    let targets = batch.index((.., 1..));
    sft_loss_from_ce(&cross_entropy(logits, &targets)?, batch, lengths)
}

/// `default_loss` from the per-token cross-entropy [B, T − 1] of `batch[:, :-1]` against
/// `batch[:, 1:]` (what `cross_entropy` gives; the chunked loss makes it chunk by chunk).
pub fn sft_loss_from_ce(
    ce: &Array,
    batch: &Array,
    lengths: &Array,
) -> Result<(Array, Array), Exception> {
    let t = batch.shape()[1];
    let steps = arange::<_, i32>(1, t, 1)?;
    let mask = logical_and(
        steps.ge(lengths.index((.., 0..1)))?,
        steps.le(lengths.index((.., 1..)))?,
    )?;
    let ce = ce.multiply(&mask)?;
    let ntoks = mask.sum(None)?;
    let loss = ce.as_dtype(Dtype::Float32)?.sum(None)?.divide(&ntoks)?;
    Ok((loss, ntoks))
}
