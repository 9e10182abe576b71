//! Pipeline parallel as mlx-lm 0.32.2's `PipelineMixin` (`models/pipeline.py`, the forward
//! of `qwen2.py` / `qwen3_moe.py`): each rank keeps a contiguous run of layers, rank 0 the
//! last ones ([`Part::layer_range`]). A step goes
//!
//!   h = embed(ids)                          every rank (also the template to receive into)
//!   h = recv_like(h, rank + 1)              all but the last rank
//!   h = local layers(h)                     mask from the first local cache
//!   h = send(h, rank - 1)                   all but rank 0, tied to the last local cache
//!   h = all_gather(h)[..B]                  rank 0's rows, on every rank
//!   logits = head(norm(h))                  every rank
//!
//! The send is tied to the last cache's state so that evaluating the caches alone (the
//! chunked prefill does) still sends, as mlx-lm's `mx.depends(cache[-1].keys, h)` does (a
//! recurrent layer's: `cache[-1][0]`, the hybrids' `ArraysCache`). The hybrids (qwen3_5,
//! qwen3_5_moe, qwen3_next) make the attention and the recurrent mask from the first local
//! layer of each kind, as their `pipeline` override picks `fa_idx` / `ssm_idx`.

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;

use super::shard::Part;
use crate::cache::{
    kv_of, kv_quant_of, ArraysCache, AttentionCache, Cache, Kv, KvQuant, Mask, RopeOffset, Snapshot,
};
use crate::load::LoadError;

/// This rank's stage: its place in the group and the checkpoint layers `[start, end)` it
/// runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stage {
    pub part: Part,
    pub layers: std::ops::Range<usize>,
}

impl Stage {
    /// The stage of `part` in a model of `layers` layers; every rank needs at least one
    /// (mlx-lm: "split … must be positive").
    pub fn new(part: Part, layers: usize, model_type: &str) -> Result<Self, LoadError> {
        if part.size > layers {
            return Err(LoadError::Unsupported(format!(
                "`{model_type}` has {layers} layers, too few for pipeline parallel on {} \
                 ranks (every rank needs at least one layer)",
                part.size
            )));
        }
        Ok(Stage {
            part,
            layers: part.layer_range(layers),
        })
    }

    /// This stage's blocks out of all of them (the others are dropped).
    pub fn keep<B>(&self, blocks: Vec<B>) -> Vec<B> {
        blocks
            .into_iter()
            .skip(self.layers.start)
            .take(self.layers.len())
            .collect()
    }

    /// Names of the local blocks' modules (`model.layers.{i}.…`, `i` counting local blocks)
    /// renumbered to their checkpoint layers.
    pub fn renumber<T>(&self, named: Vec<(String, T)>) -> Vec<(String, T)> {
        const PREFIX: &str = "model.layers.";
        named
            .into_iter()
            .map(|(name, x)| {
                let Some(rest) = name.strip_prefix(PREFIX) else {
                    return (name, x);
                };
                let (i, tail) = rest.split_once('.').unwrap_or((rest, ""));
                match i.parse::<usize>() {
                    Ok(i) => (format!("{PREFIX}{}.{tail}", i + self.layers.start), x),
                    Err(_) => (name, x),
                }
            })
            .collect()
    }

    /// The caches of the local layers, each in a [`StageCache`] (which also keeps the eager
    /// path: the compiled decode step takes plain caches only, and mlx-lm runs eagerly).
    pub fn wrap_caches(&self, caches: Vec<Box<dyn Cache>>) -> Vec<Box<dyn Cache>> {
        caches
            .into_iter()
            .map(|inner| Box::new(StageCache { inner, sent: None }) as Box<dyn Cache>)
            .collect()
    }

    /// Steps 2-5 of the forward around `layers` (the local blocks over their caches): the
    /// hidden state from the next rank, the layers, the send to the previous rank, and rank
    /// 0's result gathered onto every rank.
    pub fn run(
        &self,
        h: Array,
        caches: &mut [Box<dyn Cache>],
        layers: impl FnOnce(Array, &mut [Box<dyn Cache>]) -> Result<Array, Exception>,
    ) -> Result<Array, Exception> {
        let Part { rank, size } = self.part;
        let h = match rank + 1 < size {
            true => crate::dist::recv_like(&h, rank + 1)?,
            false => h,
        };
        let mut h = layers(h, caches)?;
        if rank != 0 {
            h = crate::dist::send(&h, rank - 1)?;
            tie_send(caches, &h)?;
        }
        let batch = h.shape()[0];
        Ok(crate::dist::all_gather(&h)?.index(..batch))
    }
}

/// Runs `layers` through this rank's stage when the model is pipelined, as it is otherwise.
pub fn run(
    stage: Option<&Stage>,
    h: Array,
    caches: &mut [Box<dyn Cache>],
    layers: impl FnOnce(Array, &mut [Box<dyn Cache>]) -> Result<Array, Exception>,
) -> Result<Array, Exception> {
    match stage {
        Some(stage) => stage.run(h, caches, layers),
        None => layers(h, caches),
    }
}

/// A model's caches of its local layers: wrapped on a pipeline stage, as they are otherwise.
pub fn local_caches(stage: Option<&Stage>, caches: Vec<Box<dyn Cache>>) -> Vec<Box<dyn Cache>> {
    match stage {
        Some(stage) => stage.wrap_caches(caches),
        None => caches,
    }
}

/// A model's module names (by local block) renumbered to checkpoint layers on a pipeline
/// stage, as they are otherwise.
pub fn checkpoint_names<T>(stage: Option<&Stage>, named: Vec<(String, T)>) -> Vec<(String, T)> {
    match stage {
        Some(stage) => stage.renumber(named),
        None => named,
    }
}

/// Makes the last cache's state carry the send, so that evaluating the caches sends
/// (`cache[-1].keys = mx.depends(cache[-1].keys, h)`). A cache that did not come from
/// [`Stage::wrap_caches`] (e.g. restored from a store) is wrapped here.
fn tie_send(caches: &mut [Box<dyn Cache>], sent: &Array) -> Result<(), Exception> {
    let Some(last) = caches.last_mut() else {
        return Err(Exception::custom(
            "a pipeline stage ran with no caches: it needs one per local layer",
        ));
    };
    if last.carry(sent) {
        return Ok(());
    }
    let inner = std::mem::replace(last, Box::new(crate::cache::none::PassThrough));
    *last = Box::new(StageCache {
        inner,
        sent: Some(sent.clone()),
    });
    Ok(())
}

/// A local layer's cache on a pipeline stage: the layer's own cache, plus (on the last
/// local layer of a rank that sends) the latest send, evaluated with the cache's state.
pub struct StageCache {
    inner: Box<dyn Cache>,
    sent: Option<Array>,
}

// Everything but the send is the inner cache's, the batch protocol included: the batch lane
// merges a stage's row caches by their kind and snapshots, and the batch cache a forward
// wrapped (`tie_send`) goes on taking rows, filters and prepares as an unwrapped one does.
impl Cache for StageCache {
    fn offset(&self) -> i32 {
        self.inner.offset()
    }

    fn kind(&self) -> Option<&'static str> {
        self.inner.kind()
    }

    fn snapshot(&self) -> Option<Snapshot> {
        self.inner.snapshot()
    }

    fn nbytes(&self) -> usize {
        self.inner.nbytes()
    }

    fn is_trimmable(&self) -> bool {
        self.inner.is_trimmable()
    }

    fn trim(&mut self, n: i32) -> i32 {
        self.inner.trim(n)
    }

    fn state(&self) -> Vec<&Array> {
        let mut state = self.inner.state();
        state.extend(self.sent.as_ref());
        state
    }

    fn make_mask(&self, n: i32, window: Option<i32>) -> Result<Mask, Exception> {
        self.inner.make_mask(n, window)
    }

    fn rope_offset(&self) -> RopeOffset {
        self.inner.rope_offset()
    }

    // Its own K/V side, not the inner cache's: a staged cache keeps the send in its state,
    // so it does not take the compiled step. A recurrent layer's cache (the hybrids') has
    // no K/V side: its state is the inner `ArraysCache`.
    fn as_kv(&mut self) -> Option<&mut dyn AttentionCache> {
        self.inner.as_kv_ref()?;
        Some(self)
    }

    fn as_kv_ref(&self) -> Option<&dyn AttentionCache> {
        self.inner.as_kv_ref()?;
        Some(self)
    }

    fn as_arrays(&mut self) -> Option<&mut ArraysCache> {
        self.inner.as_arrays()
    }

    // A layer whose cache is a list (deepseek_v32's [MLA latent, indexer keys]) reads its
    // parts through the stage's wrapper; the send stays in the wrapper's state.
    fn sub_caches(&self) -> Option<&[Box<dyn Cache>]> {
        self.inner.sub_caches()
    }

    fn sub_caches_mut(&mut self) -> Option<&mut [Box<dyn Cache>]> {
        self.inner.sub_caches_mut()
    }

    fn carry(&mut self, dep: &Array) -> bool {
        self.sent = Some(dep.clone());
        true
    }

    fn rollback(&mut self, n: i32) -> Result<(), Exception> {
        self.inner.rollback(n)
    }

    fn rollback_room(&self) -> Option<i32> {
        self.inner.rollback_room()
    }

    fn can_checkpoint(&self) -> bool {
        self.inner.can_checkpoint()
    }

    fn checkpoint(&self) -> Option<Snapshot> {
        self.inner.checkpoint()
    }

    fn restore_checkpoint(&mut self, c: Snapshot) -> Result<(), Exception> {
        self.inner.restore_checkpoint(c)
    }

    fn rows(&self) -> Option<usize> {
        self.inner.rows()
    }

    // The merged batch is the inner kind's, unwrapped: the next forward's send wraps it.
    fn merge(&self, rows: &[&dyn Cache]) -> Result<Box<dyn Cache>, Exception> {
        self.inner.merge(rows)
    }

    fn filter(&mut self, keep: &[usize]) -> Result<(), Exception> {
        self.inner.filter(keep)
    }

    fn extend(&mut self, other: &dyn Cache) -> Result<(), Exception> {
        self.inner.extend(other)
    }

    fn extract(&self, row: usize, len: i32) -> Result<Box<dyn Cache>, Exception> {
        self.inner.extract(row, len)
    }

    fn prepare(&mut self, lengths: &[i32]) -> Result<(), Exception> {
        self.inner.prepare(lengths)
    }

    fn finalize(&mut self) -> Result<(), Exception> {
        self.inner.finalize()
    }

    fn trim_rows(&mut self, n: &[i32]) -> Result<(), Exception> {
        self.inner.trim_rows(n)
    }
}

impl AttentionCache for StageCache {
    fn update_and_fetch(&mut self, keys: Array, values: Array) -> Result<Kv, Exception> {
        kv_of(self.inner.as_mut())?.update_and_fetch(keys, values)
    }

    fn quantize(&mut self, quant: KvQuant) -> Result<bool, Exception> {
        match self.inner.as_kv() {
            Some(kv) => kv.quantize(quant),
            None => Ok(false),
        }
    }

    fn kv_quant(&self) -> Option<KvQuant> {
        kv_quant_of(self.inner.as_ref())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stage(rank: usize, size: usize, layers: usize) -> Stage {
        Stage::new(Part { rank, size }, layers, "qwen2").unwrap()
    }

    #[test]
    fn rank_0_holds_the_last_layers_and_low_ranks_the_extras() {
        assert_eq!(stage(0, 2, 4).layers, 2..4);
        assert_eq!(stage(1, 2, 4).layers, 0..2);
        // 5 over 2: split [3, 2], rank 0 runs layers 2..5.
        assert_eq!(stage(0, 2, 5).layers, 2..5);
        assert_eq!(stage(1, 2, 5).layers, 0..2);
        assert_eq!(stage(0, 2, 5).keep(vec![0, 1, 2, 3, 4]), vec![2, 3, 4]);
    }

    #[test]
    fn names_keep_their_checkpoint_layer() {
        let named = vec![
            ("model.layers.0.self_attn.q_proj".to_owned(), 0),
            ("model.layers.1.mlp.gate".to_owned(), 1),
            ("lm_head".to_owned(), 2),
        ];
        let names: Vec<String> = stage(0, 2, 4)
            .renumber(named)
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        assert_eq!(
            names,
            [
                "model.layers.2.self_attn.q_proj",
                "model.layers.3.mlp.gate",
                "lm_head"
            ]
        );
    }

    #[test]
    fn too_few_layers_are_refused() {
        let part = Part { rank: 0, size: 2 };
        let e = Stage::new(part, 1, "qwen2").unwrap_err().to_string();
        assert!(
            e.contains("too few for pipeline parallel on 2 ranks"),
            "{e}"
        );
    }
}
