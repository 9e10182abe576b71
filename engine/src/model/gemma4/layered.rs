//! Segmented training on Gemma 4: the cache-less forward in pieces. Besides the hidden
//! state, a segment boundary carries the K/V of every donor layer before it whose K/V a
//! KV-shared layer at or after it borrows (K then V of each, donors in layer order), so
//! the backward carries their cotangents back to the donor's segment. The per-layer inputs
//! are made once from the ids (no adapter gradient flows into them) and read by every
//! segment. Masks and RoPE positions as `model(inputs)` makes them with no cache.

use std::ops::Range;

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;

use super::{Gemma4, SharedKv, R};
use crate::cache::none::PassThrough;
use crate::cache::{Cache, Kv, RopeOffset};
use crate::model::{Carried, Layered};

impl Gemma4 {
    /// The donors whose K/V cross the boundary before block `b`: made before it, borrowed
    /// at or after it.
    fn donors_across(&self, b: usize) -> Vec<usize> {
        let mut donors: Vec<usize> = self.blocks[b.min(self.blocks.len())..]
            .iter()
            .enumerate()
            .map(|(j, block)| (b + j, block.kv_source))
            .filter(|&(j, d)| d != j && d < b)
            .map(|(_, d)| d)
            .collect();
        donors.sort_unstable();
        donors.dedup();
        donors
    }
}

/// The RoPE position a donor layer used, as its attention makes it from a pass-through
/// cache (the array form of the cache's offset).
fn pass_through_offset() -> RopeOffset {
    match PassThrough.rope_offset() {
        RopeOffset::Int(o) => RopeOffset::Array(Array::from_int(o)),
        other => other,
    }
}

impl Layered for Gemma4 {
    fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    fn embed_ids(&self, ids: &Array) -> R<Array> {
        self.embed_scaled(ids)
    }

    /// Gemma 4's blocks read more than the hidden state: they run through `carried`.
    fn run_blocks(&self, _h: &Array, _range: Range<usize>) -> R<Array> {
        Err(Exception::custom(
            "gemma4 blocks read per-layer inputs and borrowed K/V: run them with run_carried",
        ))
    }

    fn head_logits(&self, h: &Array) -> R<Array> {
        self.head.forward(&self.embed, h)
    }

    fn carried(&self) -> Option<&dyn Carried> {
        Some(self)
    }
}

impl Carried for Gemma4 {
    fn side_inputs(&self, ids: &Array, h0: &Array) -> R<Vec<Array>> {
        match &self.per_layer {
            Some(p) => Ok(vec![self.per_layer_inputs(p, ids, h0)?]),
            None => Ok(Vec::new()),
        }
    }

    fn carried_at(&self, b: usize) -> usize {
        2 * self.donors_across(b).len()
    }

    fn run_carried(
        &self,
        h: &Array,
        carried: &[Array],
        side: &[Array],
        range: Range<usize>,
    ) -> R<(Array, Vec<Array>)> {
        let n = h.shape()[1];
        let masks = [
            PassThrough.make_mask(n, Some(self.args.sliding_window))?,
            PassThrough.make_mask(n, None)?,
        ];
        let mut produced: Vec<Option<SharedKv>> = vec![None; self.blocks.len()];
        let donors_in = self.donors_across(range.start);
        if carried.len() != 2 * donors_in.len() {
            return Err(Exception::custom(format!(
                "block {} borrows the K/V of {} donor layers, {} arrays carried in",
                range.start,
                donors_in.len(),
                carried.len()
            )));
        }
        for (d, kv) in donors_in.iter().zip(carried.chunks(2)) {
            produced[*d] = Some(SharedKv {
                kv: Kv::Dense(kv[0].clone(), kv[1].clone()),
                offset: pass_through_offset(),
            });
        }
        let mut h = h.clone();
        for i in range.clone() {
            let block = &self.blocks[i];
            let own = block.kv_source == i;
            let mut pass: Box<dyn Cache> = Box::new(PassThrough);
            let cache = own.then_some(&mut pass);
            let shared = if own {
                None
            } else {
                produced[block.kv_source].as_ref()
            };
            let input = side.first().map(|p| p.index((.., .., i as i32, ..)));
            let mask = &masks[block.full as usize];
            let (next, kv) = block.forward(&h, mask, cache, shared, input.as_ref())?;
            h = next;
            produced[i] = Some(kv);
        }
        let mut out = Vec::new();
        for d in self.donors_across(range.end) {
            match produced[d].as_ref().map(|s| &s.kv) {
                Some(Kv::Dense(k, v)) => out.extend([k.clone(), v.clone()]),
                _ => {
                    return Err(Exception::custom(format!(
                        "layer {d}'s K/V were not made in or carried into blocks {range:?}"
                    )))
                }
            }
        }
        Ok((h, out))
    }
}
