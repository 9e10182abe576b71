//! The compiled decode step: one MLX-compiled graph for "feed one token, get the logits"
//! over fixed-capacity KV buffers, with the position passed as an array so the same graph
//! serves every step of one layout. It runs when every cache is a standard `KvCache` with
//! room for the token; the L1 gate runs through it.
//!
//! A linear buffer is attended over a static prefix: the offset + 1 rounded up to
//! [`BOUND_STEP`] positions, clamped to the capacity (`cache::fixed::Attend::Prefix`). Each
//! bound is its own traced graph, traced once when the position first needs it and reused
//! for the next `BOUND_STEP` steps; the newest [`MAX_GRAPHS`] graphs are kept, older ones
//! dropped (their MLX compile-cache entries with them). The token's keys and values are
//! still written into the whole buffer. Before, attention read the whole capacity: on
//! `small` (prompt 256, 128 new tokens: 257–384 live positions of 512) ~3 ms of a ~60 ms
//! step, the compiled step then slower than the eager one.
//!
//! With `rings` (only `CompileDecode::Always`: measured, not exact) a full sliding-window
//! ring (`RotatingKvCache`, written at its ring slot, passed as an array too) also enters
//! the graph: 1262 instead of 2602 primitives per step on gemma4-tiny and about 1.4× the
//! tokens per second, but the L1 goldens of tiny-gemma4 and tiny-gemma3 diverge late in one
//! case each (greedy step 58 and 39 of 64), so the default keeps ring models eager.

use std::sync::OnceLock;

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::transforms::compile::compile;
use mlx_rs::Array;

use crate::cache::fixed::{Attend, FixedKv, Form};
use crate::cache::Cache;
use crate::model::LanguageModel;
use crate::plant::{self, Defect};

/// A linear buffer's attention bound is the offset + 1 rounded up to this many positions.
/// `ENGINE_COMPILED_BOUND_STEP` overrides it for measurement (0: the whole capacity, the
/// behaviour before bounds).
pub const BOUND_STEP: i32 = 128;
/// How many traced graphs (layouts × bounds) are kept.
pub const MAX_GRAPHS: usize = 3;

type StepFn = Box<dyn FnMut(&[Array]) -> Result<Vec<Array>, Exception>>;
/// A step's cache layout, its arguments, and each cache's form (a ring's with its slot).
type StepArgs = (Vec<Slot>, Vec<Array>, Vec<Form>);

/// How one cache enters the compiled graph: a linear buffer (keys, values) read over its
/// first `bound` positions, or a full ring (keys, values, slot).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Slot {
    Linear { bound: i32 },
    Ring,
}

fn bound_step() -> i32 {
    static STEP: OnceLock<i32> = OnceLock::new();
    *STEP.get_or_init(|| {
        std::env::var("ENGINE_COMPILED_BOUND_STEP")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .filter(|&s: &i32| s >= 0)
            .unwrap_or(BOUND_STEP)
    })
}

/// The prefix of a `capacity`-position buffer that a one-token step at `offset` attends
/// over: offset + 1 rounded up to `step` (0: the whole buffer), at most the capacity.
pub fn attend_bound(offset: i32, capacity: i32, step: i32) -> i32 {
    if step <= 0 {
        return capacity;
    }
    // Planted: the bound leaves the new token's own position out whenever the offset is a
    // multiple of the step.
    let need = if plant::is(Defect::CompiledBoundShort) {
        offset
    } else {
        offset + 1
    };
    ((need + step - 1) / step * step).min(capacity)
}

pub struct CompiledDecode {
    model: &'static dyn LanguageModel,
    /// Whether full rings enter the graph (see the module note).
    rings: bool,
    /// The traced graphs, one per layout of caches (bounds included), oldest first.
    graphs: Vec<(Vec<Slot>, StepFn)>,
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
            let (write_at, attend) = match *slot {
                Slot::Linear { bound } => (offset.clone(), Attend::Prefix { bound }),
                Slot::Ring => (next(), Attend::Ring),
            };
            caches.push(Box::new(FixedKv {
                keys,
                values,
                write_at,
                offset: offset.clone(),
                attend,
            }));
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
            graphs: Vec::new(),
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
        let Some((layout, args, forms)) = step_args(token, caches, self.rings) else {
            return Ok(None);
        };
        let step = self.graph(layout);
        let mut out = step(&args)?.into_iter();
        let logits = out.next().expect("logits");
        for (cache, form) in caches.iter_mut().zip(forms) {
            let (k, v) = (out.next().expect("keys"), out.next().expect("values"));
            cache
                .as_kv()
                .expect("checked in step_args")
                .advance_compiled(form, k, v)?;
        }
        self.steps += 1;
        Ok(Some(logits))
    }

    /// The graph for `layout`, traced if it is new (the oldest dropped past [`MAX_GRAPHS`]).
    fn graph(&mut self, layout: Vec<Slot>) -> &mut StepFn {
        match self.graphs.iter().position(|(l, _)| *l == layout) {
            Some(i) => {
                let g = self.graphs.remove(i);
                self.graphs.push(g);
            }
            None => {
                if self.graphs.len() >= MAX_GRAPHS {
                    // Dropping a compiled step erases its MLX compile-cache entries.
                    drop(self.graphs.remove(0));
                }
                let step = step_fn(self.model, layout.clone());
                self.graphs.push((layout, step));
            }
        }
        &mut self.graphs.last_mut().expect("pushed above").1
    }
}

/// Whether caches of these kinds can ever take the compiled step (`AttentionCache::compiles`:
/// linear `KvCache`s and, with `rings`, rotating ones; room, quantization and ring state are
/// checked per step, in `step_args`).
pub fn takes_kinds(caches: &mut [Box<dyn Cache>], rings: bool) -> bool {
    caches
        .iter()
        .all(|c| c.as_kv_ref().is_some_and(|kv| kv.compiles(rings)))
}

/// The layout, the compiled step's arguments and each cache's form, or None when some
/// cache cannot take this step compiled (or the positions disagree).
fn step_args(token: &Array, caches: &mut [Box<dyn Cache>], rings: bool) -> Option<StepArgs> {
    let mut args = vec![token.clone(), Array::from_int(0)];
    let (mut layout, mut forms) = (Vec::new(), Vec::new());
    let mut offset = None;
    for cache in caches.iter_mut() {
        let o = cache.offset();
        if *offset.get_or_insert(o) != o {
            return None;
        }
        let c = cache.as_kv_ref()?.compiled(rings)?;
        match c.form {
            Form::Linear => {
                let bound = attend_bound(o, c.keys.shape()[2], bound_step());
                args.extend([c.keys, c.values]);
                layout.push(Slot::Linear { bound });
            }
            Form::Ring { slot } => {
                args.extend([c.keys, c.values, Array::from_int(slot)]);
                layout.push(Slot::Ring);
            }
        }
        forms.push(c.form);
    }
    args[1] = Array::from_int(offset?);
    Some((layout, args, forms))
}
