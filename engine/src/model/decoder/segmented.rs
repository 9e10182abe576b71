//! Segmented training over the decoder: the cache-less forward a few blocks at a time,
//! with the masks as `model(inputs)` makes them with no cache (windowed ones included).
//! Where layers borrow K/V (Gemma 4's KV sharing), a segment boundary carries besides the
//! hidden state the K/V of every lender before it that a borrower at or after it reads (K
//! then V of each, lenders in layer order), so the backward carries their cotangents back
//! to the lender's segment. Side inputs (Gemma 4's per-layer inputs) are made once from
//! the ids (no adapter gradient flows into them) and read by every segment.

use std::ops::Range;

use mlx_rs::error::Exception;
use mlx_rs::Array;

use super::{Decoder, Lent, Masks, Step, R};
use crate::cache::none::PassThrough;
use crate::cache::{Cache, Kv};
use crate::model::{Carried, Layered};

impl Decoder {
    /// Pass-through caches for the layers of `range` that keep one.
    fn pass_through(&self, range: Range<usize>) -> Vec<Box<dyn Cache>> {
        let keepers = self.layers[range].iter().filter(|l| l.keeps_cache());
        keepers
            .map(|_| Box::new(PassThrough) as Box<dyn Cache>)
            .collect()
    }

    /// The lenders whose K/V cross the boundary before block `b`: before it, borrowed at
    /// or after it.
    fn lenders_across(&self, b: usize) -> Vec<usize> {
        let from = b.min(self.layers.len());
        let mut lenders: Vec<usize> = self.layers[from..]
            .iter()
            .filter_map(|l| l.borrows)
            .filter(|&j| j < b)
            .collect();
        lenders.sort_unstable();
        lenders.dedup();
        lenders
    }
}

impl Layered for Decoder {
    fn num_blocks(&self) -> usize {
        self.layers.len()
    }

    fn embed_ids(&self, ids: &Array) -> R<Array> {
        self.scaled(self.embed(ids)?)
    }

    fn run_blocks(&self, h: &Array, range: Range<usize>) -> R<Array> {
        if self.carried().is_some() {
            return Err(Exception::custom(format!(
                "{} blocks read side inputs or borrowed K/V: run them with run_carried",
                self.model_type
            )));
        }
        let mut caches = self.pass_through(range.clone());
        let masks = Masks::cacheless(&self.layers[range.clone()], h.shape()[1])?;
        self.blocks(h.clone(), &masks, range, &mut caches)
    }

    fn head_logits(&self, h: &Array) -> R<Array> {
        self.head(h)
    }

    fn carried(&self) -> Option<&dyn Carried> {
        let reads_more = self.side.is_some() || self.layers.iter().any(|l| l.borrows.is_some());
        reads_more.then_some(self as &dyn Carried)
    }
}

impl Carried for Decoder {
    fn side_inputs(&self, ids: &Array, h0: &Array) -> R<Vec<Array>> {
        Ok(Decoder::side_inputs(self, ids, h0)?.unwrap_or_default())
    }

    fn carried_at(&self, b: usize) -> usize {
        2 * self.lenders_across(b).len()
    }

    fn run_carried(
        &self,
        h: &Array,
        carried: &[Array],
        side: &[Array],
        range: Range<usize>,
    ) -> R<(Array, Vec<Array>)> {
        let lenders_in = self.lenders_across(range.start);
        if carried.len() != 2 * lenders_in.len() {
            return Err(Exception::custom(format!(
                "block {} borrows the K/V of {} lender layers, {} arrays carried in",
                range.start,
                lenders_in.len(),
                carried.len()
            )));
        }
        let mut step = Step {
            lent: vec![None; self.layers.len()],
            side: (!side.is_empty()).then(|| side.to_vec()),
        };
        for (&j, kv) in lenders_in.iter().zip(carried.chunks(2)) {
            step.lent[j] = Some(Lent {
                kv: Kv::Dense(kv[0].clone(), kv[1].clone()),
                offset: self.layers[j].mixer.lent_offset(&PassThrough),
            });
        }
        let mut caches = self.pass_through(range.clone());
        let masks = Masks::cacheless(&self.layers[range.clone()], h.shape()[1])?;
        let h = self.run(h.clone(), &masks, range.clone(), &mut caches, &mut step)?;
        let mut out = Vec::new();
        for j in self.lenders_across(range.end) {
            match step.lent[j].as_ref().map(|l| &l.kv) {
                Some(Kv::Dense(k, v)) => out.extend([k.clone(), v.clone()]),
                _ => {
                    return Err(Exception::custom(format!(
                        "layer {j}'s K/V were not made in or carried into blocks {range:?}"
                    )))
                }
            }
        }
        Ok((h, out))
    }
}
