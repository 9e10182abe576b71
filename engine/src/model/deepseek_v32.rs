//! DeepSeek-V3.2's sparse attention as mlx-lm 0.32.2's `deepseek_v32.DeepseekV32Attention`
//! computes it: MLA (`mla.rs`) over only the positions a lightning indexer picks.
//!
//!   qr        = q_a_layernorm(q_a_proj(x))                      (the MLA's low-rank query)
//!   q_i       = rope(wq_b(qr) → [B, n, L, d]);  k_i = rope(layer_norm(wk(x)) → [B, 1, L, d])
//!   k_i       → the layer's second cache (keys; its values unused)
//!   S ≤ index_topk:  no selection (plain MLA)
//!   else:     s = Σ_heads relu(q_i @ k_iᵀ) · weights_proj(x) · n^-½ · d^-½   (heads added one by one
//!                 when L > 1), −inf where the causal mask is false
//!             top = argpartition(s, −index_topk)[..., −index_topk:]
//!             L > 1: the mask becomes "in top" ∧ causal;  L = 1: the cached latent and rope keys
//!             are gathered at `top` (no mask)
//!   out       = MLA's attention over what is left
//!
//! Each layer's cache is mlx-lm's `CacheList(KVCache(), KVCache())`: [the MLA's latent, the
//! indexer's keys]. The indexer's RoPE is traditional only with `indexer_rope_interleave`.

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::{Ellipsis, IndexOp, NewAxis};
use mlx_rs::ops::{argpartition_axis, broadcast_to, maximum, select, zeros_dtype};
use mlx_rs::{Array, Dtype};
use serde::Deserialize;

use super::decoder::Mixer;
use super::layers::{Linear, Rope};
use super::mla::{mask_array, update, Mla, MlaShape};
use super::shard::{Part, Split};
use crate::cache::{kv_of, Cache, CacheList, KvCache, Mask};
use crate::load::config::ModelConfig;
use crate::load::weights::Weights;
use crate::load::LoadError;
use crate::plant::{self, Defect};
use crate::scalar::weak;

type R<T> = Result<T, Exception>;

/// The indexer's fields of `deepseek_v32.ModelArgs`, with its defaults.
#[derive(Debug, Clone, Deserialize)]
pub struct IndexArgs {
    #[serde(default = "default_head_dim")]
    pub index_head_dim: i32,
    #[serde(default = "default_heads")]
    pub index_n_heads: i32,
    #[serde(default = "default_topk")]
    pub index_topk: i32,
    #[serde(default)]
    pub indexer_rope_interleave: bool,
}

fn default_head_dim() -> i32 {
    128
}

fn default_heads() -> i32 {
    64
}

fn default_topk() -> i32 {
    2048
}

impl IndexArgs {
    pub fn parse(config: &ModelConfig) -> Result<Self, LoadError> {
        let a: IndexArgs = config.parse()?;
        if a.index_topk <= 0 {
            return Err(LoadError::Unsupported(format!(
                "deepseek_v32: index_topk must be positive, got {}",
                a.index_topk
            )));
        }
        Ok(a)
    }
}

/// `deepseek_v32.Indexer`.
struct Indexer {
    wq_b: Linear,
    wk: Linear,
    k_norm: (Array, Array),
    weights_proj: Linear,
    heads: i32,
    head_dim: i32,
    topk: i32,
    rope: Rope,
}

impl Indexer {
    fn load(w: &mut Weights, a: &str, s: &MlaShape, i: &IndexArgs) -> Result<Self, LoadError> {
        let n = |name: &str| format!("{a}.indexer.{name}");
        let q_lora = s.q_lora_rank.unwrap_or(0);
        let (heads, d) = (i.index_n_heads, i.index_head_dim);
        Ok(Indexer {
            wq_b: Linear::load(w, &n("wq_b"), false, [heads * d, q_lora])?,
            wk: Linear::load(w, &n("wk"), false, [d, s.hidden])?,
            k_norm: (
                w.take_shaped(&n("k_norm.weight"), &[d])?,
                w.take_shaped(&n("k_norm.bias"), &[d])?,
            ),
            weights_proj: Linear::load(w, &n("weights_proj"), false, [heads, s.hidden])?,
            heads,
            head_dim: d,
            topk: i.index_topk,
            rope: Rope::init(
                s.rope,
                s.rope_theta,
                i.indexer_rope_interleave,
                s.rope_scaling.as_ref(),
                Some(s.max_positions),
            )?,
        })
    }

    /// The positions each query keeps [B, 1, L, topk], or None while the cache holds no more
    /// than `topk` of them; `mask` the causal boolean mask (None for one token).
    fn select(
        &self,
        x: &Array,
        qr: &Array,
        mask: Option<&Array>,
        cache: &mut dyn Cache,
    ) -> R<Option<Array>> {
        let (b, s) = (x.shape()[0], x.shape()[1]);
        let q = self.wq_b.forward(qr)?;
        let q = q
            .reshape(&[b, s, self.heads, self.head_dim])?
            .swap_axes(1, 2)?;
        let k = self.wk.forward(x)?;
        let k = mlx_rs::fast::layer_norm(&k, &self.k_norm.0, &self.k_norm.1, 1e-5)?;
        let k = k.reshape(&[b, 1, s, self.head_dim])?;
        let offset = cache.rope_offset();
        let q = self.rope.forward(&q, &offset)?;
        let k = self.rope.forward(&k, &offset)?;
        let k =
            match kv_of(cache)?.update_and_fetch(k.clone(), k)? {
                crate::cache::Kv::Dense(k, _) => k,
                crate::cache::Kv::Quantized { .. } => return Err(Exception::custom(
                    "deepseek_v32's indexer keeps its keys dense (a quantized KV cache is refused)",
                )),
            };
        if k.shape()[2] <= self.topk {
            return Ok(None);
        }
        let mut scores = q.matmul(k.swap_axes(-1, -2)?)?;
        if !plant::is(Defect::IndexerReluDropped) {
            scores = maximum(&scores, weak(0.0, &scores)?)?;
        }
        let scale = (self.heads as f64).powf(-0.5) * (self.head_dim as f64).powf(-0.5);
        let weights = self.weights_proj.forward(x)?;
        let weights = weights.multiply(weak(scale, &weights)?)?;
        let weights = weights.swap_axes(-1, -2)?.index((Ellipsis, NewAxis));
        let scores = scores.multiply(&weights)?;
        // mlx-lm adds the heads one by one for more than one query (Python's `sum`, from 0).
        let mut scores = match s > 1 {
            true => {
                let mut total = weak(0.0, &scores)?;
                for h in 0..self.heads {
                    total = total.add(scores.index((.., h..h + 1)))?;
                }
                total
            }
            false => scores.sum_axis(1, true)?,
        };
        if let Some(m) = mask {
            scores = select(m, &scores, weak(f64::NEG_INFINITY, &scores)?)?;
        }
        let top = argpartition_axis(&scores, -self.topk, -1)?;
        Ok(Some(top.index((Ellipsis, -self.topk..))))
    }
}

/// One DeepSeek-V3.2 attention layer: MLA with its indexer.
pub struct SparseMla {
    mla: Mla,
    indexer: Indexer,
}

impl SparseMla {
    pub fn load(w: &mut Weights, p: &str, s: &MlaShape, i: &IndexArgs) -> Result<Self, LoadError> {
        if s.q_lora_rank.is_none() {
            return Err(LoadError::Unsupported(
                "deepseek_v32 needs q_lora_rank (its indexer reads the low-rank query)".into(),
            ));
        }
        let mla = Mla::load(w, p, s)?;
        let indexer = Indexer::load(w, &format!("{p}.self_attn"), s, i)?;
        Ok(SparseMla { mla, indexer })
    }

    fn attend(&self, x: &Array, mask: &Mask, mla: &mut dyn Cache, idx: &mut dyn Cache) -> R<Array> {
        let (q_nope, q_pe, qr) = self.mla.query(x)?;
        let qr = qr.ok_or_else(|| Exception::custom("deepseek_v32 without a low-rank query"))?;
        let (latent, k_pe) = self.mla.latent(x)?;
        let offset = mla.rope_offset();
        let before = mla.offset();
        let q_pe = self.mla.rope.forward(&q_pe, &offset)?;
        let k_pe = self.mla.rope.forward(&k_pe, &offset)?;
        let (mut latent, mut k_pe) = update(mla, latent, k_pe)?;
        let l = x.shape()[1];
        let mut mask = mask_array(mask, l, before)?;
        if let Some(top) = self.indexer.select(x, &qr, mask.as_ref(), idx)? {
            let top = mlx_rs::stop_gradient(&top)?;
            if l == 1 {
                let idx = top.index((.., .., 0, .., NewAxis));
                let gather = |t: &Array| {
                    let mut shape = idx.shape().to_vec();
                    *shape.last_mut().expect("4 axes") = *t.shape().last().expect("4 axes");
                    t.take_along_axis(broadcast_to(&idx, &shape)?, 2)
                };
                latent = gather(&latent)?;
                k_pe = gather(&k_pe)?;
                mask = mask.map(|m| m.take_along_axis(&top, -1)).transpose()?;
            } else {
                let mut shape = top.shape().to_vec();
                *shape.last_mut().expect("4 axes") = latent.shape()[2];
                let sparse = zeros_dtype(&shape, Dtype::Bool)?;
                let sparse = sparse.put_along_axis(&top, Array::from_bool(true), -1)?;
                mask = Some(match mask {
                    Some(m) => sparse.logical_and(&m)?,
                    None => sparse,
                });
            }
        }
        let out = self
            .mla
            .attend(&q_nope, &q_pe, &latent, &k_pe, mask.as_ref())?;
        self.mla.o_proj.forward(&out)
    }
}

impl Mixer for SparseMla {
    /// The layer's [MLA, indexer] caches; a cache-less run (one pass-through) serves both.
    fn forward(&self, x: &Array, mask: &Mask, cache: &mut dyn Cache) -> R<Array> {
        match cache.sub_caches_mut() {
            Some([mla, idx]) => self.attend(x, mask, mla.as_mut(), idx.as_mut()),
            Some(parts) => Err(Exception::custom(format!(
                "deepseek_v32: a layer's cache list has {} parts (MLA and indexer expected)",
                parts.len()
            ))),
            None => {
                let mut other = crate::cache::none::PassThrough;
                self.attend(x, mask, cache, &mut other)
            }
        }
    }

    /// mlx-lm's `CacheList(KVCache(), KVCache())`.
    fn make_cache(&self) -> Box<dyn Cache> {
        Box::new(CacheList::new(vec![
            Box::new(KvCache::new()),
            Box::new(KvCache::new()),
        ]))
    }

    fn linears(&self) -> Vec<(&'static str, &Linear)> {
        let mut named = self.mla.linears();
        named.extend([
            ("self_attn.indexer.wq_b", &self.indexer.wq_b),
            ("self_attn.indexer.wk", &self.indexer.wk),
            ("self_attn.indexer.weights_proj", &self.indexer.weights_proj),
        ]);
        named
    }

    /// mlx-lm's `deepseek_v32.Model.shard`: the MLA half as deepseek_v3's; the indexer
    /// (`wq_b`, `wk`, `k_norm`, `weights_proj`) stays whole on every rank, so each rank picks
    /// the same positions for its heads.
    fn shard(&mut self, part: Part, layer: &str) -> Result<(), LoadError> {
        if plant::is(Defect::IndexerShardedByHeads) {
            let ix = &mut self.indexer;
            let what = |n: &str| format!("{layer}.self_attn.indexer.{n}");
            ix.wq_b.shard(Split::Columns, part, &what("wq_b"))?;
            ix.weights_proj
                .shard(Split::Columns, part, &what("weights_proj"))?;
            ix.heads /= part.size as i32;
        }
        self.mla.shard(part, layer)
    }
}
