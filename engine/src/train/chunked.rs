//! Chunked cross-entropy (`--loss-chunk N`): the loss over the vocabulary without the full
//! [tokens × vocab] logits. The blocks' output h [B, T, H] is cut into chunks of N token
//! rows (flattened over the batch); per chunk, logits = head(h_chunk) (`Layered::
//! head_logits`: the final norm, the output head or tied embedding, any soft-capping) and
//! ce_chunk = `loss::cross_entropy(logits, targets_chunk)` — the same ops, row by row, as
//! MLX 0.32.2's `nn.losses.cross_entropy` on the whole logits. The per-token CE [B, T] is
//! put back together and the loss (`loss::sft_loss_from_ce`, or ORPO's `orpo_terms` of −CE)
//! reduces it exactly as the plain path does, so no sum is reordered.
//!
//! Backward, by recomputation (a hand-made VJP of h ↦ CE): the loss's value-and-grad over
//! the per-token CE gives dCE [B, T] (tiny); then per chunk, the chunk's head and CE are
//! replayed under a vjp with cotangent dCE_chunk → dh_chunk, evaluated before the next
//! chunk starts, so one chunk's [N × vocab] logits (and their gradient) live at a time. The
//! adapters' gradients come from the segmented backward (`segmented::
//! segmented_value_and_grad_by`) with dh at the last boundary; without `--segment-size` the
//! blocks run as one segment (one extra forward of the blocks: the price of not holding the
//! whole step's graph).

use std::ops::Range;

use mlx_rs::error::Exception;
use mlx_rs::ops::concatenate;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{Array, Dtype};

use super::data::{Example, Pair};
use super::lora::Adapters;
use super::segmented::Phases;
use super::trainer::{Dataset, TrainConfig};
use crate::model::{LanguageModel, Layered};

type R<T> = Result<T, Exception>;

/// The loss outputs (SFT: [loss, ntoks]; ORPO: `OrpoTerms::into_vec`) from the per-token
/// cross-entropy [B, T].
pub type LossFromCe = Box<dyn FnMut(&Array) -> R<Vec<Array>>>;

/// The row ranges of `chunk` tokens each over `n` rows (the last may be shorter).
pub fn chunks(n: i32, chunk: usize) -> Vec<Range<i32>> {
    let size = chunk.max(1) as i32;
    (0..n)
        .step_by(size as usize)
        .map(|s| s..(s + size).min(n))
        .collect()
}

/// Rows `r` of `flat` [N, H]; the planted `LossChunkOffByOne` reads every chunk after the
/// first one row early.
fn rows(flat: &Array, r: &Range<i32>) -> R<Array> {
    let shift = i32::from(r.start > 0 && crate::plant::is(crate::plant::Defect::LossChunkOffByOne));
    Ok(flat.index((r.start - shift)..(r.end - shift)))
}

/// The cross-entropy [n] of rows h [n, H] against targets [n]: head, then `cross_entropy`.
fn chunk_ce(head: &dyn Fn(&Array) -> R<Array>, h: &Array, targets: &Array) -> R<Array> {
    let logits = head(&h.expand_dims(0)?)?;
    super::loss::cross_entropy(&logits, &targets.expand_dims(0)?)?.squeeze_axes(&[0])
}

/// `cross_entropy(head(h), targets)` [B, T] for h [B, T, H], `chunk` token rows at a time,
/// each chunk evaluated before the next (no gradient flows through the result).
pub fn token_ce(
    head: &dyn Fn(&Array) -> R<Array>,
    h: &Array,
    targets: &Array,
    chunk: usize,
) -> R<Array> {
    let (b, t, d) = (h.shape()[0], h.shape()[1], h.shape()[2]);
    let flat = h.reshape(&[b * t, d])?;
    let tflat = targets.reshape(&[b * t])?;
    let mut parts = Vec::new();
    for r in chunks(b * t, chunk) {
        let ce = chunk_ce(head, &rows(&flat, &r)?, &tflat.index(r.clone()))?;
        ce.eval()?;
        parts.push(ce);
    }
    concatenate(&parts, 0)?.reshape(&[b, t])
}

/// The loss outputs of `loss_from_ce(cross_entropy(head(h), targets))` and the gradient of
/// the first with respect to h, chunk by chunk (see the module doc).
pub fn value_and_dh(
    head: &dyn Fn(&Array) -> R<Array>,
    h: &Array,
    targets: &Array,
    chunk: usize,
    loss_from_ce: &mut dyn FnMut(&Array) -> R<Vec<Array>>,
) -> R<(Vec<Array>, Array)> {
    let ce = token_ce(head, h, targets, chunk)?;
    let (outputs, dce) = {
        let f = |x: &[Array]| loss_from_ce(&x[0]);
        let mut vg = mlx_rs::transforms::value_and_grad_with_argnums(f, &[0][..]);
        let (o, g) = vg(std::slice::from_ref(&ce))?;
        (o, g.into_iter().next().expect("one gradient"))
    };
    mlx_rs::transforms::eval(outputs.iter().chain(std::iter::once(&dce)))?;
    let (b, t, d) = (h.shape()[0], h.shape()[1], h.shape()[2]);
    let flat = h.reshape(&[b * t, d])?;
    let (tflat, dflat) = (targets.reshape(&[b * t])?, dce.reshape(&[b * t])?);
    let mut dh = Vec::new();
    for (k, r) in chunks(b * t, chunk).into_iter().enumerate() {
        let tc = tflat.index(r.clone());
        let replay = |p: &[Array]| -> R<Vec<Array>> { Ok(vec![chunk_ce(head, &p[0], &tc)?]) };
        let primal = rows(&flat, &r)?;
        let (_, g) = mlx_rs::transforms::fallible_vjp(replay, &[primal], &[dflat.index(r)])?;
        let mut g = g.into_iter().next().expect("one cotangent");
        if k > 0 && crate::plant::is(crate::plant::Defect::LossChunkHeadNoGrad) {
            g = mlx_rs::ops::zeros_like(&g)?;
        }
        g.eval()?;
        dh.push(g);
    }
    Ok((outputs, concatenate(&dh, 0)?.reshape(&[b, t, d])?))
}

/// The refusal of `--loss-chunk` to a model that does not expose its head apart from its
/// blocks.
pub fn refusal(model_type: &str) -> String {
    format!(
        "--loss-chunk is not available for model_type `{model_type}`: it applies the head \
         apart from the blocks, through the hooks segmented backward uses (the families \
         --segment-size takes); train this model without it"
    )
}

fn layered_or_refuse(model: &dyn LanguageModel) -> R<&dyn Layered> {
    super::segmented::layered(model).ok_or_else(|| Exception::custom(refusal(model.model_type())))
}

/// One batch's inputs (ids without their last position), targets (ids without their first)
/// and loss from the per-token CE — `trainer::batch_loss`'s batches, read from the CE.
pub fn batch_loss_from_ce(
    data: &Dataset,
    batch: &[usize],
    cfg: &TrainConfig,
) -> (Array, Array, LossFromCe) {
    let (ids, loss): (Array, LossFromCe) = match data {
        Dataset::Sft(v) => {
            let ex: Vec<&Example> = batch.iter().map(|&i| &v[i]).collect();
            let (ids, lengths) = super::trainer::sft_batch(&ex, cfg.max_seq_length);
            let batch_ids = ids.clone();
            let loss = move |ce: &Array| {
                let (l, n) = super::loss::sft_loss_from_ce(ce, &batch_ids, &lengths)?;
                Ok(vec![l, n])
            };
            (ids, Box::new(loss))
        }
        Dataset::Orpo(v) => {
            let pairs: Vec<&Pair> = batch.iter().map(|&i| &v[i]).collect();
            let (ids, pm, rm) = super::orpo::pair_batch(&pairs);
            let (lambda, scope) = (cfg.orpo_lambda, cfg.sft_scope);
            // `orpo_from_logits`'s log-probs: −CE in f32.
            let loss = move |ce: &Array| {
                let logps = ce.as_dtype(Dtype::Float32)?.negative()?;
                Ok(super::orpo::orpo_terms(&logps, &pm, &rm, lambda, scope)?.into_vec())
            };
            (ids, Box::new(loss))
        }
    };
    let t = ids.shape()[1];
    (ids.index((.., ..t - 1)), ids.index((.., 1..)), loss)
}

/// The blocks' output for `inputs` (cache-less, as the training forward), no head.
fn hidden(model: &dyn Layered, inputs: &Array) -> R<Array> {
    let h0 = model.embed_ids(inputs)?;
    let all = 0..model.num_blocks();
    match model.carried() {
        Some(c) => {
            let side = c.side_inputs(inputs, &h0)?;
            Ok(c.run_carried(&h0, &[], &side, all)?.0)
        }
        None => model.run_blocks(&h0, all),
    }
}

/// The loss outputs of one batch with the chunked loss (no gradients).
pub fn batch_outputs(
    model: &dyn LanguageModel,
    data: &Dataset,
    batch: &[usize],
    cfg: &TrainConfig,
    chunk: usize,
) -> R<Vec<Array>> {
    let layered = layered_or_refuse(model)?;
    let (inputs, targets, mut loss) = batch_loss_from_ce(data, batch, cfg);
    let h = hidden(layered, &inputs)?;
    h.eval()?;
    loss(&token_ce(&|x| layered.head_logits(x), &h, &targets, chunk)?)
}

/// The loss outputs and the adapters' gradients of one batch with the chunked loss: the
/// segmented backward (`cfg.segment_size` blocks a segment, else all blocks in one) whose
/// head phase is `value_and_dh`.
pub fn batch_grads(
    model: &dyn LanguageModel,
    adapters: &Adapters,
    data: &Dataset,
    batch: &[usize],
    cfg: &TrainConfig,
    chunk: usize,
    phases: &mut dyn Phases,
) -> R<(Vec<Array>, Vec<Array>)> {
    let layered = layered_or_refuse(model)?;
    let (inputs, targets, mut loss) = batch_loss_from_ce(data, batch, cfg);
    let size = cfg.segment_size.unwrap_or(layered.num_blocks());
    let mut head = |last: &Array| {
        value_and_dh(
            &|x| layered.head_logits(x),
            last,
            &targets,
            chunk,
            &mut loss,
        )
    };
    super::segmented::segmented_value_and_grad_by(
        layered, adapters, &inputs, size, &mut head, phases,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_every_row_once_in_order() {
        assert_eq!(chunks(7, 3), vec![0..3, 3..6, 6..7]);
        assert_eq!(chunks(6, 3), vec![0..3, 3..6]);
        assert_eq!(chunks(2, 8), vec![0..2]);
        assert_eq!(chunks(3, 0), vec![0..1, 1..2, 2..3]);
    }
}
