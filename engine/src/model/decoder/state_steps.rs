//! One-token steps of the recurrent mixers as MLX-compiled graphs, for the compiled decode
//! step of a hybrid (`generate::compiled`): a gated delta net's, Mamba-2's or a short
//! conv's step `(x, s_{t−1}) ↦ (y, s_t)` over a single sequence's `ArraysCache` is traced
//! once per layer and reused, its state arrays passed in and their successors taken out.
//! Attention stays eager on the real caches: compiled over a fixed buffer its softmax and
//! the weighted sum run over more positions than mlx-lm's (masked), which was measured to
//! change bf16 logits at long contexts; a recurrent step has the same shapes either way.
//!
//! The graphs belong to the session that decodes (`StateSteps`), lent to the model for the
//! length of one forward (`with_steps`); outside such a forward every mixer runs eagerly.

use std::cell::RefCell;
use std::collections::HashMap;

use mlx_rs::error::Exception;
use mlx_rs::transforms::compile::compile;
use mlx_rs::Array;

use super::layer::Mixer;
use crate::cache::arrays::ArraysCache;
use crate::cache::{Cache, Mask};
use crate::plant::{self, Defect};

type R<T> = Result<T, Exception>;
type StepFn = Box<dyn FnMut(&[Array]) -> R<Vec<Array>>>;

/// The traced steps of one model's recurrent mixers, by mixer. Dropped with the session,
/// which drops it before the model it borrows.
#[derive(Default)]
pub struct StateSteps {
    steps: HashMap<usize, StepFn>,
    /// Mixer steps that ran compiled.
    pub ran: usize,
}

thread_local! {
    /// The steps lent to the forward running on this thread (MLX work stays on one thread).
    static LENT: RefCell<Option<StateSteps>> = const { RefCell::new(None) };
}

/// Runs `forward` with `steps` lent to the recurrent mixers it reaches; they come back
/// (with any new graphs) when it returns, also on an error.
pub fn with_steps<T>(steps: &mut StateSteps, forward: impl FnOnce() -> T) -> T {
    LENT.with_borrow_mut(|lent| *lent = Some(std::mem::take(steps)));
    let out = forward();
    *steps = LENT.with_borrow_mut(|lent| lent.take()).unwrap_or_default();
    out
}

/// The mixer's one-token step through its compiled graph when steps are lent and this is
/// one: a recurrent mixer, one token of one sequence without a mask, every state slot held.
/// None: the caller runs the mixer eagerly.
pub(super) fn try_step(
    mixer: &dyn Mixer,
    x: &Array,
    mask: &Mask,
    cache: &mut dyn Cache,
) -> Option<R<Vec<Array>>> {
    if !mixer.recurrent() || x.shape()[..2] != [1, 1] || !matches!(mask, Mask::None) {
        return None;
    }
    let state = cache.as_arrays()?;
    let arrays = state.compiled()?;
    LENT.with_borrow_mut(|lent| {
        let lent = lent.as_mut()?;
        let key = mixer as *const dyn Mixer as *const () as usize;
        let n = arrays.len();
        let step = lent.steps.entry(key).or_insert_with(|| traced(mixer, n));
        let mut args = vec![x.clone()];
        args.extend(arrays);
        let out = match step(&args) {
            Ok(out) => out,
            Err(e) => return Some(Err(e)),
        };
        lent.ran += 1;
        let mut out = out.into_iter();
        let y = out.next().expect("the mixer's output");
        for (i, next) in out.enumerate() {
            // Planted: the conv window (slot 0) handed back as it was before the step.
            if !(i == 0 && plant::is(Defect::CompiledConvStateStale)) {
                state.set(i, next);
            }
        }
        state.advance(1);
        Some(Ok(vec![y]))
    })
}

/// The traced step of `mixer` over a state of `n` arrays: args [x, s…], outputs [y, s'…].
fn traced(mixer: &dyn Mixer, n: usize) -> StepFn {
    // SAFETY: the graph lives in a `StateSteps` owned by the session that runs this model,
    // which drops it before the model (see `generate::Session`); it is only called during
    // one of that model's forwards (`with_steps`).
    let mixer: &'static dyn Mixer = unsafe { std::mem::transmute::<&dyn Mixer, _>(mixer) };
    let step = move |args: &[Array]| -> R<Vec<Array>> {
        let mut state = ArraysCache::new(n);
        for (i, a) in args[1..].iter().enumerate() {
            state.set(i, a.clone());
        }
        let mut out = mixer.forward_branches(&args[0], &Mask::None, &mut state)?;
        let mut all = vec![out.remove(0)];
        all.extend(state.state().into_iter().cloned());
        Ok(all)
    };
    let mut compiled = compile(step, false);
    Box::new(move |args: &[Array]| compiled(args))
}
