//! Chunked cross-entropy (`--loss-chunk N`): the loss over the vocabulary without the full
//! [tokens × vocab] logits. The blocks' output h [B, T, H] is cut into chunks of N token
//! rows (flattened over the batch); per chunk, logits = head(h_chunk) (`Layered::
//! head_logits`: the final norm, the output head or tied embedding, any soft-capping) and
//! ce_chunk = `loss::cross_entropy(logits, targets_chunk)` — the same ops, row by row, as
//! MLX 0.32.2's `nn.losses.cross_entropy` on the whole logits. The per-token CE [B, T] is
//! put back together and the loss (`loss::sft_loss_from_ce`, or ORPO's `orpo_terms` of −CE)
//! reduces it exactly as the plain path does, so no sum is reordered.
//!
//! Backward, a hand-made VJP of h ↦ CE: the loss's value-and-grad over the per-token CE
//! gives dCE [B, T] (tiny); then per chunk, the chunk's head and CE run under a vjp with
//! cotangent dCE_chunk → dh_chunk, evaluated before the next chunk starts, so one chunk's
//! [N × vocab] logits (and their gradient) live at a time. ORPO's loss needs the CE before
//! dCE, so its chunks run twice (the CE pass, then the vjp: recomputation); SFT's is linear
//! in the CE, so its dCE is taken at zeros and one vjp per chunk gives both. The
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
use super::setup::{Dataset, TrainConfig};
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

/// The loss outputs at `ce` and the gradient of the first with respect to `ce`.
fn loss_and_dce(
    loss_from_ce: &mut dyn FnMut(&Array) -> R<Vec<Array>>,
    ce: &Array,
) -> R<(Vec<Array>, Array)> {
    let f = |x: &[Array]| loss_from_ce(&x[0]);
    let mut vg = mlx_rs::transforms::value_and_grad_with_argnums(f, &[0][..]);
    let (o, g) = vg(std::slice::from_ref(ce))?;
    Ok((o, g.into_iter().next().expect("one gradient")))
}

/// The loss outputs of `loss_from_ce(cross_entropy(head(h), targets))` and the gradient of
/// the first with respect to h, chunk by chunk (see the module doc). `linear`: the loss is
/// linear in the CE (SFT's masked sum over a count), so dCE does not depend on the CE's
/// values: it is taken at zeros and each chunk's CE and dh come from one vjp (the head
/// runs once per chunk, not twice). Otherwise (ORPO) the CE comes first, then dCE, then
/// each chunk is replayed under a vjp.
pub fn value_and_dh(
    head: &dyn Fn(&Array) -> R<Array>,
    h: &Array,
    targets: &Array,
    chunk: usize,
    loss_from_ce: &mut dyn FnMut(&Array) -> R<Vec<Array>>,
    linear: bool,
) -> R<(Vec<Array>, Array)> {
    let (b, t, d) = (h.shape()[0], h.shape()[1], h.shape()[2]);
    let flat = h.reshape(&[b * t, d])?;
    let tflat = targets.reshape(&[b * t])?;
    let (outputs, dce) = if linear {
        // The CE's dtype, from a graph that is never evaluated.
        let dtype = chunk_ce(head, &flat.index(0..1), &tflat.index(0..1))?.dtype();
        let zeros = mlx_rs::ops::zeros::<f32>(&[b, t])?.as_dtype(dtype)?;
        (None, loss_and_dce(loss_from_ce, &zeros)?.1)
    } else {
        let (o, g) = loss_and_dce(loss_from_ce, &token_ce(head, h, targets, chunk)?)?;
        (Some(o), g)
    };
    dce.eval()?;
    let dflat = dce.reshape(&[b * t])?;
    let (mut ce, mut dh) = (Vec::new(), Vec::new());
    for (k, r) in chunks(b * t, chunk).into_iter().enumerate() {
        let tc = tflat.index(r.clone());
        let replay = |p: &[Array]| -> R<Vec<Array>> { Ok(vec![chunk_ce(head, &p[0], &tc)?]) };
        let primal = rows(&flat, &r)?;
        let (out, g) = mlx_rs::transforms::fallible_vjp(replay, &[primal], &[dflat.index(r)])?;
        let mut g = g.into_iter().next().expect("one cotangent");
        if k > 0 && crate::plant::is(crate::plant::Defect::LossChunkHeadNoGrad) {
            g = mlx_rs::ops::zeros_like(&g)?;
        }
        let out = out.into_iter().next().expect("one output");
        mlx_rs::transforms::eval([&out, &g])?;
        ce.push(out);
        dh.push(g);
    }
    let outputs = match outputs {
        Some(o) => o,
        None => {
            let o = loss_from_ce(&concatenate(&ce, 0)?.reshape(&[b, t])?)?;
            mlx_rs::transforms::eval(&o)?;
            o
        }
    };
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
            let (ids, lengths) = super::setup::sft_batch(&ex, cfg.max_seq_length);
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
        Dataset::Pairs(set) => {
            let pairs: Vec<&Pair> = batch.iter().map(|&i| &set.pairs[i]).collect();
            let (ids, _, rm) = super::orpo::pair_batch(&pairs);
            let reference = set
                .reference
                .as_ref()
                .map(|r| super::preference::reference_rows(r, batch));
            let objective = match cfg.method {
                super::setup::Method::Pairs(obj) => Some(obj),
                _ => None,
            };
            // The pair objectives' log-probs: −CE in f32, as `preference::token_logps`.
            let loss = move |ce: &Array| {
                let Some(obj) = objective else {
                    return Err(Exception::custom(
                        "preference pairs train with --method dpo, cpo or simpo",
                    ));
                };
                if obj.needs_reference() && reference.is_none() {
                    return Err(Exception::custom("DPO without reference log-probs"));
                }
                let logps = ce.as_dtype(Dtype::Float32)?.negative()?;
                let terms = super::preference::pref_terms(&obj, &logps, &rm, reference.as_ref())?;
                Ok(terms.into_vec())
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
    // SFT's loss (`sft_loss_from_ce`: Σ mask·CE / count) is linear in the CE; ORPO's is not.
    let linear = matches!(data, Dataset::Sft(_));
    let size = cfg.segment_size.unwrap_or(layered.num_blocks());
    let mut head = |last: &Array| {
        value_and_dh(
            &|x| layered.head_logits(x),
            last,
            &targets,
            chunk,
            &mut loss,
            linear,
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
