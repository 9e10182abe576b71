//! Segmented backward: the blocks run `segment_size` at a time, so the activations the
//! backward keeps are one segment's, not the whole model's. Forward: the embedding, then
//! each segment from its (evaluated, detached) boundary hidden state. The head's
//! value-and-grad gives the loss and dh at the last boundary. Backward: each segment in
//! reverse, replayed under a vjp over (its boundary, its adapters) with the cotangent from
//! the segment after it → (dh at its own boundary, its adapters' gradients). The loss is
//! the unsegmented one, bit for bit (the same ops on the same values); gradients too, up to
//! how MLX sums cotangents (gated against the unsegmented step, see the tests).

use std::ops::Range;

use mlx_rs::error::Exception;
use mlx_rs::Array;

use super::lora::Adapters;
use crate::model::Layered;

/// The families whose models expose their blocks (`LanguageModel::as_layered`).
pub const SEGMENTED_FAMILIES: &str =
    "llama, mistral, qwen2, qwen3, gemma3_text, gemma3, qwen3_moe, mixtral, qwen2_moe";

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
    let params = adapters.params();
    let segs = segments(model.num_blocks(), segment_size);
    // Forward, keeping only the boundaries.
    let mut boundaries = vec![model.embed_ids(ids)?];
    for r in &segs {
        let h = model.run_blocks(
            &mlx_rs::stop_gradient(boundaries.last().expect("one"))?,
            r.clone(),
        )?;
        h.eval()?;
        boundaries.push(h);
    }
    phases.phase("forward");
    // The head: loss and dh at the last boundary.
    let last = boundaries.last().expect("one").clone();
    let head = |x: &[Array]| -> Result<Vec<Array>, Exception> {
        loss_from_logits(&model.head_logits(&x[0])?)
    };
    let (outputs, mut dh) = {
        let mut vg = mlx_rs::transforms::value_and_grad_with_argnums(head, &[0][..]);
        let (o, g) = vg(std::slice::from_ref(&last))?;
        (o, g.into_iter().next().expect("one gradient"))
    };
    mlx_rs::transforms::eval(outputs.iter().chain(std::iter::once(&dh)))?;
    phases.phase("head");
    // Backward, segment by segment.
    let mut grads: Vec<Option<Array>> = vec![None; params.len()];
    for (s, r) in segs.iter().enumerate().rev() {
        let at = adapters.params_in_layers(r);
        let mut primals = vec![boundaries[s].clone()];
        primals.extend(at.iter().map(|&k| params[k].clone()));
        let replay = |p: &[Array]| -> Result<Vec<Array>, Exception> {
            adapters.set_some(&at, &p[1..]);
            Ok(vec![model.run_blocks(&p[0], r.clone())?])
        };
        let cotangent =
            if crate::plant::is(crate::plant::Defect::DropCotangent) && s + 1 < segs.len() {
                mlx_rs::ops::zeros_like(&dh)?
            } else {
                dh.clone()
            };
        let result = mlx_rs::transforms::fallible_vjp(replay, &primals, &[cotangent]);
        adapters.set_some(
            &at,
            &at.iter().map(|&k| params[k].clone()).collect::<Vec<_>>(),
        );
        let (_, vjps) = result?;
        let mut vjps = vjps.into_iter();
        dh = vjps.next().expect("the boundary's cotangent");
        for (&k, g) in at.iter().zip(vjps) {
            grads[k] = Some(g);
        }
        let pending: Vec<&Array> = std::iter::once(&dh)
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
