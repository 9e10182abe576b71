//! Segmented backward: the blocks run `segment_size` at a time, so the activations the
//! backward keeps are one segment's, not the whole model's. Forward: the embedding, then
//! each segment from its (evaluated, detached) boundary hidden state. The head's
//! value-and-grad gives the loss and dh at the last boundary. Backward: each segment in
//! reverse, replayed under a vjp over (its boundary, its adapters) with the cotangent from
//! the segment after it → (dh at its own boundary, its adapters' gradients). The loss is
//! the unsegmented one, bit for bit (the same ops on the same values); gradients too, up to
//! how MLX sums cotangents (gated against the unsegmented step, see the tests).
//!
//! Models whose blocks read more than the hidden state before them (Gemma 4, through
//! `Layered::carried`) carry it across each boundary: the K/V of earlier donor layers that
//! KV-shared layers at or after it borrow ride along with the hidden state forward, and
//! their cotangents come back with dh, so a donor's segment gets the sharers' part of its
//! K/V's gradient. Inputs made once from the ids (the per-layer inputs) are read by every
//! segment and take no gradient.

use std::ops::Range;

use mlx_rs::error::Exception;
use mlx_rs::Array;

use super::lora::Adapters;
use crate::model::{Carried, Layered};

/// The refusal of `--segment-size` to a model whose family's segmented backward is not
/// gated (or that does not expose its blocks).
pub fn refusal(model_type: &str) -> String {
    crate::model::registry::refusal(model_type, crate::model::registry::Capability::Segmented)
}

/// The model's blocks for segmented training, where its family's segmented backward is
/// gated (the registry's `segmented`) and the model exposes them (not a pipeline stage).
pub fn layered(model: &dyn crate::model::LanguageModel) -> Option<&dyn Layered> {
    let gated = crate::model::registry::has(model.model_type(), |f| f.segmented);
    model.as_layered().filter(|_| gated)
}

/// The block ranges of `segment_size` blocks each (the last may be shorter).
pub fn segments(blocks: usize, segment_size: usize) -> Vec<Range<usize>> {
    let size = segment_size.max(1);
    (0..blocks)
        .step_by(size)
        .map(|s| s..(s + size).min(blocks))
        .collect()
}

/// Per-phase hooks (the memory probe reads MLX's peak after each).
pub trait Phases {
    fn phase(&mut self, _name: &str) {}
}

impl Phases for () {}

/// The model's blocks as `Carried` ones: its own where it has them (Gemma 4), else blocks
/// that carry nothing but the hidden state.
struct Plain<'a>(&'a dyn Layered);

impl Carried for Plain<'_> {
    fn side_inputs(&self, _ids: &Array, _h0: &Array) -> Result<Vec<Array>, Exception> {
        Ok(Vec::new())
    }

    fn carried_at(&self, _b: usize) -> usize {
        0
    }

    fn run_carried(
        &self,
        h: &Array,
        _carried: &[Array],
        _side: &[Array],
        range: Range<usize>,
    ) -> Result<(Array, Vec<Array>), Exception> {
        Ok((self.0.run_blocks(h, range)?, Vec::new()))
    }
}

/// A segment boundary: the hidden state and what crosses with it (borrowed K/V).
struct Boundary {
    h: Array,
    carried: Vec<Array>,
}

/// `loss_from_logits(head(blocks(embed(ids))))` and the gradient of its first output with
/// respect to every adapter parameter, computed segment by segment.
pub fn segmented_value_and_grad(
    model: &dyn Layered,
    adapters: &Adapters,
    ids: &Array,
    segment_size: usize,
    mut loss_from_logits: impl FnMut(&Array) -> Result<Vec<Array>, Exception>,
    phases: &mut dyn Phases,
) -> Result<(Vec<Array>, Vec<Array>), Exception> {
    let mut head = |last: &Array| -> Result<(Vec<Array>, Array), Exception> {
        let f = |x: &[Array]| -> Result<Vec<Array>, Exception> {
            loss_from_logits(&model.head_logits(&x[0])?)
        };
        let mut vg = mlx_rs::transforms::value_and_grad_with_argnums(f, &[0][..]);
        let (o, g) = vg(std::slice::from_ref(last))?;
        Ok((o, g.into_iter().next().expect("one gradient")))
    };
    segmented_value_and_grad_by(model, adapters, ids, segment_size, &mut head, phases)
}

/// The head phase: from the last boundary's hidden state, the loss outputs and the
/// gradient of the first with respect to that hidden state.
pub type HeadPhase<'a> = dyn FnMut(&Array) -> Result<(Vec<Array>, Array), Exception> + 'a;

/// `segmented_value_and_grad` with the head phase given (the chunked loss's, `chunked`).
pub fn segmented_value_and_grad_by(
    model: &dyn Layered,
    adapters: &Adapters,
    ids: &Array,
    segment_size: usize,
    head: &mut HeadPhase<'_>,
    phases: &mut dyn Phases,
) -> Result<(Vec<Array>, Vec<Array>), Exception> {
    let plain = Plain(model);
    let blocks: &dyn Carried = model.carried().unwrap_or(&plain);
    let params = adapters.params();
    let segs = segments(model.num_blocks(), segment_size);
    // Forward, keeping only the boundaries.
    let h0 = model.embed_ids(ids)?;
    let side = blocks.side_inputs(ids, &h0)?;
    mlx_rs::transforms::eval(&side)?;
    let mut boundaries = vec![Boundary {
        h: h0,
        carried: Vec::new(),
    }];
    for r in &segs {
        let at = boundaries.last().expect("one");
        let carried = at
            .carried
            .iter()
            .map(mlx_rs::stop_gradient)
            .collect::<Result<Vec<_>, _>>()?;
        let (h, carried) =
            blocks.run_carried(&mlx_rs::stop_gradient(&at.h)?, &carried, &side, r.clone())?;
        mlx_rs::transforms::eval(std::iter::once(&h).chain(&carried))?;
        boundaries.push(Boundary { h, carried });
    }
    phases.phase("forward");
    // The head: loss and dh at the last boundary.
    let last = boundaries.last().expect("one").h.clone();
    let (outputs, dh) = head(&last)?;
    mlx_rs::transforms::eval(outputs.iter().chain(std::iter::once(&dh)))?;
    phases.phase("head");
    // Backward, segment by segment: the cotangents of the boundary after each (its hidden
    // state's, then its carried arrays') give those of the boundary before it.
    let mut grads: Vec<Option<Array>> = vec![None; params.len()];
    let mut cotangents = vec![dh];
    for (s, r) in segs.iter().enumerate().rev() {
        let at = adapters.params_in_layers(r);
        let before = &boundaries[s];
        let mut primals = vec![before.h.clone()];
        primals.extend(before.carried.iter().cloned());
        let n_in = primals.len();
        primals.extend(at.iter().map(|&k| params[k].clone()));
        let replay = |p: &[Array]| -> Result<Vec<Array>, Exception> {
            adapters.set_some(&at, &p[n_in..]);
            let (h, carried) = blocks.run_carried(&p[0], &p[1..n_in], &side, r.clone())?;
            Ok(std::iter::once(h).chain(carried).collect())
        };
        planted_drops(&mut cotangents, s + 1 < segs.len())?;
        let result = mlx_rs::transforms::fallible_vjp(replay, &primals, &cotangents);
        adapters.set_some(
            &at,
            &at.iter().map(|&k| params[k].clone()).collect::<Vec<_>>(),
        );
        let (_, mut vjps) = result?;
        let adapter_grads = vjps.split_off(n_in);
        cotangents = vjps;
        for (&k, g) in at.iter().zip(adapter_grads) {
            grads[k] = Some(g);
        }
        let pending: Vec<&Array> = cotangents
            .iter()
            .chain(at.iter().filter_map(|&k| grads[k].as_ref()))
            .collect();
        mlx_rs::transforms::eval(pending)?;
        phases.phase(&format!("backward segment {s}"));
    }
    let grads = grads
        .into_iter()
        .map(|g| g.ok_or_else(|| Exception::custom("an adapter outside every segment")))
        .collect::<Result<_, _>>()?;
    Ok((outputs, grads))
}

/// The planted defects of the boundary after a segment (`inner`: one that another segment
/// follows): the hidden state's cotangent dropped (`DropCotangent`), the carried K/V's
/// dropped (`DropCarriedKvCotangent`: the donor's segment never learns what the sharers
/// needed of its K/V).
fn planted_drops(cotangents: &mut [Array], inner: bool) -> Result<(), Exception> {
    use crate::plant::{is, Defect};
    if !inner {
        return Ok(());
    }
    for (i, c) in cotangents.iter_mut().enumerate() {
        let drop = if i == 0 {
            is(Defect::DropCotangent)
        } else {
            is(Defect::DropCarriedKvCotangent)
        };
        if drop {
            *c = mlx_rs::ops::zeros_like(&*c)?;
        }
    }
    Ok(())
}
