//! The compiled decode step: one MLX-compiled graph for "feed one token, get the logits"
//! over fixed-capacity KV buffers, with the position passed as an array so the same graph
//! serves every step until the buffers grow (then it is traced once more). Only models
//! whose caches are all standard `KvCache`s use it; the L1 gate runs through it.

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::transforms::compile::compile;
use mlx_rs::Array;

use crate::cache::fixed::FixedKv;
use crate::cache::{Cache, KvCache};
use crate::model::LanguageModel;

type StepFn = Box<dyn FnMut(&[Array]) -> Result<Vec<Array>, Exception>>;

pub struct CompiledDecode {
    step: StepFn,
    /// Steps that ran through the compiled graph.
    pub steps: usize,
}

impl CompiledDecode {
    /// # Safety
    /// The returned value must not outlive `model` (a `Session` holds both and drops this
    /// first): the compiled closure keeps a reference to the model with its lifetime erased,
    /// because compiled closures must be `'static`.
    pub unsafe fn new(model: &dyn LanguageModel) -> Self {
        let model: &'static dyn LanguageModel =
            std::mem::transmute::<&dyn LanguageModel, &'static dyn LanguageModel>(model);
        let step = move |args: &[Array]| -> Result<Vec<Array>, Exception> {
            let (token, offset) = (&args[0], &args[1]);
            let mut caches: Vec<Box<dyn Cache>> = args[2..]
                .chunks(2)
                .map(|kv| {
                    Box::new(FixedKv {
                        keys: kv[0].clone(),
                        values: kv[1].clone(),
                        offset: offset.clone(),
                    }) as Box<dyn Cache>
                })
                .collect();
            let logits = model.forward(&token.reshape(&[1, -1])?, &mut caches)?;
            let mut out = vec![logits.index((.., -1, ..))];
            for mut cache in caches {
                let fixed = cache
                    .as_any_mut()
                    .downcast_mut::<FixedKv>()
                    .expect("built above as FixedKv");
                out.push(fixed.keys.clone());
                out.push(fixed.values.clone());
            }
            Ok(out)
        };
        let mut compiled = compile(step, false);
        CompiledDecode {
            step: Box::new(move |args: &[Array]| compiled(args)),
            steps: 0,
        }
    }

    /// Runs one step if every cache is a `KvCache` with room for the token; returns the
    /// logits [1, vocab], or None when the caller must take the eager path.
    pub fn try_step(
        &mut self,
        token: &Array,
        caches: &mut [Box<dyn Cache>],
    ) -> Result<Option<Array>, Exception> {
        let mut args = vec![token.clone(), Array::from_int(0)];
        let mut offset = None;
        for cache in caches.iter_mut() {
            let Some(kv) = cache.as_any_mut().downcast_mut::<KvCache>() else {
                return Ok(None);
            };
            let o = kv.offset();
            let Some((k, v)) = kv.buffers_with_room(1) else {
                return Ok(None);
            };
            if *offset.get_or_insert(o) != o {
                return Ok(None);
            }
            args.push(k.clone());
            args.push(v.clone());
        }
        let Some(offset) = offset else {
            return Ok(None);
        };
        args[1] = Array::from_int(offset);
        let mut out = (self.step)(&args)?.into_iter();
        let logits = out.next().expect("logits");
        for cache in caches.iter_mut() {
            let kv = cache
                .as_any_mut()
                .downcast_mut::<KvCache>()
                .expect("checked above");
            let (k, v) = (out.next().expect("keys"), out.next().expect("values"));
            kv.advance_with(k, v, 1);
        }
        self.steps += 1;
        Ok(Some(logits))
    }
}
