//! The compiled decode step: one MLX-compiled graph for "feed one token, get the logits"
//! over fixed-capacity KV buffers, with the position passed as an array so the same graph
//! serves every step until the buffers grow (then it is traced once more). It runs when
//! every cache is a standard `KvCache` with room for the token; the L1 gate runs through it.
//! With `rings` (only `CompileDecode::Always`: measured, not exact) a full sliding-window
//! ring (`RotatingKvCache`, written at its ring slot, passed as an array too) also enters
//! the graph: 1262 instead of 2602 primitives per step on gemma4-tiny and about 1.4× the
//! tokens per second, but the L1 goldens of tiny-gemma4 and tiny-gemma3 diverge late in one
//! case each (greedy step 58 and 39 of 64), so the default keeps ring models eager.

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::transforms::compile::compile;
use mlx_rs::Array;

use crate::cache::fixed::FixedKv;
use crate::cache::rotating::FixedRing;
use crate::cache::{Cache, KvCache, RotatingKvCache};
use crate::model::LanguageModel;

type StepFn = Box<dyn FnMut(&[Array]) -> Result<Vec<Array>, Exception>>;
/// A step's cache layout, its arguments, and each cache's ring slot (None: linear).
type StepArgs = (Vec<Slot>, Vec<Array>, Vec<Option<i32>>);

/// How one cache enters the compiled graph: a linear buffer (keys, values) or a full ring
/// of `max_size` (keys, values, slot).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Slot {
    Linear,
    Ring { max_size: i32 },
}

pub struct CompiledDecode {
    model: &'static dyn LanguageModel,
    /// Whether full rings enter the graph (see the module note).
    rings: bool,
    /// The graph for one layout of caches (traced again when the layout changes).
    step: Option<(Vec<Slot>, StepFn)>,
    /// Steps that ran through the compiled graph.
    pub steps: usize,
}

/// The traced step for `layout`: args are the token, the position, then each cache's arrays.
fn step_fn(model: &'static dyn LanguageModel, layout: Vec<Slot>) -> StepFn {
    let step = move |args: &[Array]| -> Result<Vec<Array>, Exception> {
        let (token, offset) = (&args[0], &args[1]);
        let mut rest = args[2..].iter();
        let mut next = || rest.next().expect("one array per slot part").clone();
        let mut caches: Vec<Box<dyn Cache>> = Vec::with_capacity(layout.len());
        for slot in &layout {
            let (keys, values) = (next(), next());
            caches.push(match *slot {
                Slot::Linear => Box::new(FixedKv {
                    keys,
                    values,
                    offset: offset.clone(),
                }),
                Slot::Ring { max_size } => Box::new(FixedRing {
                    keys,
                    values,
                    slot: next(),
                    offset: offset.clone(),
                    max_size,
                }),
            });
        }
        let logits = model.forward(&token.reshape(&[1, -1])?, &mut caches)?;
        let mut out = vec![logits.index((.., -1, ..))];
        for cache in &caches {
            out.extend(cache.state().into_iter().cloned());
        }
        Ok(out)
    };
    let mut compiled = compile(step, false);
    Box::new(move |args: &[Array]| compiled(args))
}

impl CompiledDecode {
    /// # Safety
    /// The returned value must not outlive `model` (a `Session` holds both and drops this
    /// first): the compiled closure keeps a reference to the model with its lifetime erased,
    /// because compiled closures must be `'static`.
    pub unsafe fn new(model: &dyn LanguageModel, rings: bool) -> Self {
        let model: &'static dyn LanguageModel =
            std::mem::transmute::<&dyn LanguageModel, &'static dyn LanguageModel>(model);
        CompiledDecode {
            model,
            rings,
            step: None,
            steps: 0,
        }
    }

    /// Runs one step if every cache can take the token in the compiled graph; returns the
    /// logits [1, vocab], or None when the caller must take the eager path.
    pub fn try_step(
        &mut self,
        token: &Array,
        caches: &mut [Box<dyn Cache>],
    ) -> Result<Option<Array>, Exception> {
        let Some((layout, args, ring_slots)) = step_args(token, caches, self.rings) else {
            return Ok(None);
        };
        if self.step.as_ref().is_none_or(|(l, _)| *l != layout) {
            self.step = Some((layout.clone(), step_fn(self.model, layout)));
        }
        let (_, step) = self.step.as_mut().expect("set above");
        let mut out = step(&args)?.into_iter();
        let logits = out.next().expect("logits");
        for (cache, ring_slot) in caches.iter_mut().zip(ring_slots) {
            let (k, v) = (out.next().expect("keys"), out.next().expect("values"));
            let any = cache.as_any_mut();
            match ring_slot {
                None => any
                    .downcast_mut::<KvCache>()
                    .expect("checked in step_args")
                    .advance_with(k, v, 1),
                Some(slot) => any
                    .downcast_mut::<RotatingKvCache>()
                    .expect("checked in step_args")
                    .advance_ring(k, v, slot),
            }
        }
        self.steps += 1;
        Ok(Some(logits))
    }
}

/// The layout, the compiled step's arguments and each cache's ring slot (None: linear),
/// or None when some cache cannot take this step compiled (or the positions disagree).
fn step_args(token: &Array, caches: &mut [Box<dyn Cache>], rings: bool) -> Option<StepArgs> {
    let mut args = vec![token.clone(), Array::from_int(0)];
    let (mut layout, mut ring_slots) = (Vec::new(), Vec::new());
    let mut offset = None;
    for cache in caches.iter_mut() {
        let o = cache.offset();
        if *offset.get_or_insert(o) != o {
            return None;
        }
        let any = cache.as_any_mut();
        if let Some(kv) = any.downcast_mut::<KvCache>() {
            let (k, v) = kv.buffers_with_room(1)?;
            args.extend([k.clone(), v.clone()]);
            layout.push(Slot::Linear);
            ring_slots.push(None);
        } else if let Some(ring) = any.downcast_mut::<RotatingKvCache>().filter(|_| rings) {
            let max_size = ring.max_size();
            let (k, v, slot) = ring.full_ring_slot()?;
            args.extend([k.clone(), v.clone(), Array::from_int(slot)]);
            layout.push(Slot::Ring { max_size });
            ring_slots.push(Some(slot));
        } else {
            return None;
        }
    }
    args[1] = Array::from_int(offset?);
    Some((layout, args, ring_slots))
}
