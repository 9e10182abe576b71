//! The decoder's building blocks: a layer `{norm_in, mixer, norm_post, ffn, tail}`, the
//! traits a family implements for its parts (`Mixer`, `FeedForward`, `Tail`, `SideInputs`),
//! the residual sums, KV sharing's loans, and the masks of one forward. The plain
//! attention and gated MLP are mixer and feed-forward here.

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype};

use crate::cache::chunked::chunked_mask;
use crate::cache::none::PassThrough;
use crate::cache::{kv_of, Cache, Kv, KvCache, Mask, RopeOffset, RotatingKvCache};
use crate::load::LoadError;
use crate::model::layers::{Attention, Linear, Mlp, RmsNorm};
use crate::model::moe::SwitchLinear;
use crate::model::rope;
use crate::model::shard::Part;

type R<T> = Result<T, Exception>;

/// A layer's token mixer: reads the normed hidden state, keeps its state in its cache.
pub trait Mixer {
    fn forward(&self, x: &Array, mask: &Mask, cache: &mut dyn Cache) -> R<Array>;
    /// The branches the layer adds to the residual stream one after the other
    /// (`(h + r₀) + r₁ …`): the one output (the default), or a parallel mixer's (Falcon-H1's
    /// SSM branch, then its attention, as `residual + mamba_h + attn_h` sums them).
    fn forward_branches(&self, x: &Array, mask: &Mask, cache: &mut dyn Cache) -> R<Vec<Array>> {
        Ok(vec![self.forward(x, mask, cache)?])
    }
    /// A fresh cache of the kind this mixer keeps.
    fn make_cache(&self) -> Box<dyn Cache>;
    /// The attention window it reads within (its mask's); None: every position before.
    fn window(&self) -> Option<i32> {
        None
    }
    /// The chunk it attends within (Llama 4's chunked layers: keys of the query's own chunk
    /// of positions only), read through its cache's mask (`ChunkedKvCache`); None: none.
    fn chunk(&self) -> Option<i32> {
        None
    }
    /// A recurrent mixer (a state, not K/V) reads mlx-lm's `create_ssm_mask` (the batch's
    /// padding, or none) instead of an attention mask.
    fn recurrent(&self) -> bool {
        false
    }
    /// A position-wise block in the mixer's place (Nemotron-H's MLP layers): no state, no
    /// cache, no mask.
    fn stateless(&self) -> bool {
        false
    }
    /// Its linears under mlx-lm's names within the layer (`self_attn.q_proj`), in the
    /// order LoRA attaches to them.
    fn linears(&self) -> Vec<(&'static str, &Linear)>;
    /// Its stacks of experts under mlx-lm's names within the layer, after its linears in
    /// LoRA's order (Nemotron 3's `E` blocks, a mixture of experts in the mixer's place:
    /// `mixer.switch_mlp.fc1`); none for a mixer without experts.
    fn switches(&self) -> Vec<(&'static str, &SwitchLinear)> {
        Vec::new()
    }
    /// Keeps this rank's part (tensor parallel); `layer` is the layer's checkpoint prefix.
    fn shard(&mut self, part: Part, layer: &str) -> Result<(), LoadError>;
    /// KV sharing, the lender's side: the forward, and the K/V it attended over with the
    /// RoPE position it used (for the later layers that borrow them).
    fn forward_lending(
        &self,
        _x: &Array,
        _mask: &Mask,
        _cache: &mut dyn Cache,
    ) -> R<(Array, Lent)> {
        Err(Exception::custom("this layer's mixer lends no K/V"))
    }
    /// KV sharing, the borrower's side: the forward over the lender's K/V (no cache).
    fn forward_borrowing(&self, _x: &Array, _mask: &Mask, _lent: &Lent) -> R<Array> {
        Err(Exception::custom("this layer's mixer borrows no K/V"))
    }
    /// The RoPE position a lender lends after a step over `cache` (a segment boundary
    /// rebuilds a cache-less lender's loan with it).
    fn lent_offset(&self, cache: &dyn Cache) -> RopeOffset {
        cache.rope_offset()
    }
}

/// K/V one layer attended over, as a later layer borrows them, with the RoPE position the
/// step used.
#[derive(Clone)]
pub struct Lent {
    pub kv: Kv,
    pub offset: RopeOffset,
}

/// A layer's feed-forward; `module` is its name within the layer (`mlp`, Mixtral's
/// `block_sparse_moe`).
pub trait FeedForward {
    fn forward(&self, x: &Array) -> R<Array>;
    /// The forward given also the residual stream `h` that `x` was normed from (Gemma 4's
    /// experts beside its MLP read it through their own norm).
    fn forward_with_residual(&self, x: &Array, _h: &Array) -> R<Array> {
        self.forward(x)
    }
    /// Its linears named `<module>.…`, in the order LoRA attaches to them.
    fn linears(&self, module: &str) -> Vec<(String, &Linear)>;
    /// Its stacks of experts named `<module>.switch_mlp.…` (gpt-oss: `<module>.experts.…`;
    /// none for a dense MLP).
    fn switches(&self, _module: &str) -> Vec<(String, &SwitchLinear)> {
        Vec::new()
    }
    /// Keeps this rank's part; `prefix` is the module's checkpoint path.
    fn shard(&mut self, part: Part, prefix: &str) -> Result<(), LoadError>;
}

/// A mixer of a sliding-window layer (Gemma 3's local layers, gpt-oss's
/// `sliding_attention`): it reads the windowed mask, and keeps a rotating cache of `window`
/// entries, as mlx-lm's `make_cache` gives such a layer.
pub struct Windowed<M> {
    pub mixer: M,
    pub window: i32,
}

impl<M: Mixer> Mixer for Windowed<M> {
    fn forward(&self, x: &Array, mask: &Mask, cache: &mut dyn Cache) -> R<Array> {
        self.mixer.forward(x, mask, cache)
    }

    fn make_cache(&self) -> Box<dyn Cache> {
        Box::new(RotatingKvCache::new(self.window))
    }

    fn window(&self) -> Option<i32> {
        Some(self.window)
    }

    fn linears(&self) -> Vec<(&'static str, &Linear)> {
        self.mixer.linears()
    }

    fn shard(&mut self, part: Part, layer: &str) -> Result<(), LoadError> {
        self.mixer.shard(part, layer)
    }
}

/// How a layer adds a branch back into the residual stream.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub enum Residual {
    /// `h + r`.
    #[default]
    Add,
    /// mlx-lm's gemma3 `clip_residual`: `h + r`, except in float16, where the sum is formed
    /// in float32, clipped to ±65504 and cast back.
    ClipF16,
    /// Granite's `h + r · residual_multiplier` (a Python float: weak).
    Scaled(f32),
}

impl Residual {
    pub(super) fn add(self, h: &Array, r: &Array) -> R<Array> {
        if let Residual::Scaled(m) = self {
            return h.add(r.multiply(crate::scalar::weak(m as f64, r)?)?);
        }
        if self == Residual::Add || h.dtype() != Dtype::Float16 {
            return h.add(r);
        }
        let bound = Array::from_f32(65504.0);
        let sum = h
            .as_dtype(Dtype::Float32)?
            .add(r.as_dtype(Dtype::Float32)?)?;
        mlx_rs::ops::clip(&sum, (&bound.negative()?, &bound))?.as_dtype(Dtype::Float16)
    }
}

/// What a layer adds after its feed-forward (Gemma 4: the per-layer input gate, then the
/// layer scalar); `side` is the layer's side input, if the model makes them.
pub trait Tail {
    fn forward(&self, h: Array, side: Option<&Array>) -> R<Array>;
    /// Its linears under mlx-lm's names within the layer, in the order LoRA attaches to them.
    fn linears(&self) -> Vec<(&'static str, &Linear)>;
}

/// Inputs every layer reads besides the hidden state, made once per forward from the ids
/// and the first hidden state (Gemma 4's per-layer inputs): one array per layer.
pub trait SideInputs {
    fn make(&self, ids: &Array, h0: &Array) -> R<Vec<Array>>;
}

/// One block: `h + post_mixer(mixer(norm_in(h)))`, then `+ post_ffn(ffn(norm_post(·)))`,
/// then the tail; the post norms are Gemma's sandwich norms or OLMo 2's post-norms (which
/// come without `norm_in` / `norm_post`), absent elsewhere. A layer
/// without a feed-forward (Mamba-2's) is its mixer's residual branch alone.
pub struct Layer {
    /// None: a post-norm layer (OLMo 2's), whose mixer reads the residual stream itself.
    pub norm_in: Option<RmsNorm>,
    pub mixer: Box<dyn Mixer>,
    pub post_mixer_norm: Option<RmsNorm>,
    pub norm_post: Option<RmsNorm>,
    pub ffn: Option<Box<dyn FeedForward>>,
    pub post_ffn_norm: Option<RmsNorm>,
    pub tail: Option<Box<dyn Tail>>,
    /// KV sharing: the earlier layer whose K/V this one reads (it keeps no cache).
    pub borrows: Option<usize>,
}

/// How a layer's mixer meets its state in one forward.
pub(super) enum Io<'a> {
    /// Its own cache.
    Own(&'a mut dyn Cache),
    /// Its own cache, and a later layer borrows what it attends over.
    Lend(&'a mut dyn Cache),
    /// No cache: an earlier layer's K/V.
    Borrow(&'a Lent),
    /// No cache at all (a stateless block).
    Stateless,
}

impl Layer {
    pub(super) fn forward(
        &self,
        h: Array,
        mask: &Mask,
        io: Io<'_>,
        sum: Residual,
        side: Option<&Array>,
    ) -> R<(Array, Option<Lent>)> {
        let post = |norm: &Option<RmsNorm>, r: Array| match norm {
            Some(norm) => norm.forward(&r),
            None => Ok(r),
        };
        let x = match &self.norm_in {
            Some(norm) => norm.forward(&h)?,
            None => h.clone(),
        };
        let (branches, lent) = match io {
            Io::Own(cache) => (self.mixer.forward_branches(&x, mask, cache)?, None),
            Io::Lend(cache) => {
                let (r, lent) = self.mixer.forward_lending(&x, mask, cache)?;
                (vec![r], Some(lent))
            }
            Io::Borrow(lent) => (vec![self.mixer.forward_borrowing(&x, mask, lent)?], None),
            Io::Stateless => (
                self.mixer.forward_branches(&x, mask, &mut PassThrough)?,
                None,
            ),
        };
        let mut h = h;
        for r in branches {
            h = sum.add(&h, &post(&self.post_mixer_norm, r)?)?;
        }
        let h = match (&self.norm_post, &self.ffn) {
            (norm, Some(ffn)) => {
                let x = match norm {
                    Some(norm) => norm.forward(&h)?,
                    None => h.clone(),
                };
                let r = ffn.forward_with_residual(&x, &h)?;
                sum.add(&h, &post(&self.post_ffn_norm, r)?)?
            }
            (_, None) => h,
        };
        let h = match &self.tail {
            Some(tail) => tail.forward(h, side)?,
            None => h,
        };
        Ok((h, lent))
    }

    /// Whether it keeps a cache of its own (a borrower and a stateless block do not).
    pub(super) fn keeps_cache(&self) -> bool {
        self.borrows.is_none() && !self.mixer.stateless()
    }
}

/// The masks of one forward: one per kind among the layers run — attention within each
/// window (None = full attention, full attention's first), and the recurrent mixers' — each
/// made by the cache of the first layer of that kind, as mlx-lm's gemma3, gpt_oss and the
/// hybrids make theirs, and as the other families make their one mask from the first cache.
pub struct Masks(Vec<(MaskKind, Mask)>);

/// Which mask a layer reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MaskKind {
    /// Attention within a window (None: full attention).
    Attention(Option<i32>),
    /// Attention within chunks of positions (`chunked_mask`).
    Chunked(i32),
    /// A recurrent state's (`create_ssm_mask`).
    Recurrent,
}

impl MaskKind {
    fn of(mixer: &dyn Mixer) -> Self {
        match (mixer.recurrent(), mixer.chunk()) {
            (true, _) => MaskKind::Recurrent,
            (false, Some(chunk)) => MaskKind::Chunked(chunk),
            (false, None) => MaskKind::Attention(mixer.window()),
        }
    }
}

impl Masks {
    /// For `n` new tokens through `layers`, `caches[k]` the k-th of the layers that keep one
    /// (a borrower's window is its lender's: a kind only borrowers read has no cache to ask).
    pub fn make(layers: &[Layer], caches: &[Box<dyn Cache>], n: i32) -> R<Self> {
        let keepers: Vec<MaskKind> = layers
            .iter()
            .filter(|l| l.keeps_cache())
            .map(|l| MaskKind::of(l.mixer.as_ref()))
            .collect();
        let masks = Self::kinds(layers).into_iter().map(|kind| {
            let first = keepers.iter().position(|k| *k == kind);
            let cache = first.and_then(|k| caches.get(k)).ok_or_else(|| {
                Exception::custom(format!("no layer with a cache reads the {kind:?} mask"))
            })?;
            let mask = match kind {
                MaskKind::Attention(window) => cache.make_mask(n, window)?,
                MaskKind::Chunked(chunk) => match cache.make_mask(n, None)? {
                    chunked @ Mask::Array(_) => chunked,
                    other
                        if crate::plant::is(
                            crate::plant::Defect::ChunkedMaskCausalWithoutCache,
                        ) =>
                    {
                        other
                    }
                    // A cache that knows no chunks (training's pass-through, mlx-lm's
                    // `model(inputs)` with cache None): chunks from position 0, nothing cut.
                    _ => Mask::Array(chunked_mask(0, cache.offset(), n, chunk)?),
                },
                MaskKind::Recurrent => cache.make_mask(n, None)?,
            };
            Ok((kind, mask))
        });
        Ok(Masks(masks.collect::<R<_>>()?))
    }

    /// Each attention mask OR'd with `overlay` (boolean, broadcasting to [.., n, n]): a
    /// causal mode becomes its array first, as mlx-vlm's gemma4 `_make_masks` builds it for
    /// an image prompt. For a first forward only (every cache empty): the overlay is square.
    pub fn or_overlay(self, overlay: &Array, n: i32, caches: &[Box<dyn Cache>]) -> R<Self> {
        if let Some(c) = caches.iter().find(|c| c.offset() != 0) {
            return Err(Exception::custom(format!(
                "an attention overlay needs fresh caches (one is at offset {}): run the \
                 image prompt first",
                c.offset()
            )));
        }
        let masks = self.0.into_iter().map(|(kind, mask)| {
            let MaskKind::Attention(window) = kind else {
                return Ok((kind, mask));
            };
            let base = match mask {
                Mask::None => return Ok((kind, Mask::None)),
                Mask::Causal => crate::cache::causal_mask(n, 0, window)?,
                Mask::Array(a) => a,
            };
            Ok((kind, Mask::Array(base.logical_or(overlay)?)))
        });
        Ok(Masks(masks.collect::<R<_>>()?))
    }

    /// The masks of a cache-less forward through `layers` (as `model(inputs)` makes them:
    /// a recurrent mixer reads none).
    pub fn cacheless(layers: &[Layer], n: i32) -> R<Self> {
        let masks = Self::kinds(layers).into_iter().map(|kind| {
            let mask = match kind {
                MaskKind::Attention(window) => PassThrough.make_mask(n, window)?,
                MaskKind::Chunked(chunk) => Mask::Array(chunked_mask(0, 0, n, chunk)?),
                MaskKind::Recurrent => Mask::None,
            };
            Ok((kind, mask))
        });
        Ok(Masks(masks.collect::<R<_>>()?))
    }

    /// The kinds `layers` read, full attention's first, then windows and the recurrent
    /// kind in the order they first appear.
    fn kinds(layers: &[Layer]) -> Vec<MaskKind> {
        let all: Vec<MaskKind> = layers
            .iter()
            .map(|l| MaskKind::of(l.mixer.as_ref()))
            .collect();
        let mut kinds: Vec<MaskKind> = Vec::new();
        if all.contains(&MaskKind::Attention(None)) {
            kinds.push(MaskKind::Attention(None));
        }
        for k in all {
            if !kinds.contains(&k) {
                kinds.push(k);
            }
        }
        kinds
    }

    /// The mask `mixer` reads.
    pub(super) fn of(&self, mixer: &dyn Mixer) -> &Mask {
        let kind = MaskKind::of(mixer);
        let found = self.0.iter().find(|(k, _)| *k == kind);
        found.map_or(&Mask::None, |(_, m)| m)
    }
}

/// Multi-head attention as a mixer (llama, qwen2/3, the MoE families).
impl Mixer for Attention {
    fn forward(&self, x: &Array, mask: &Mask, cache: &mut dyn Cache) -> R<Array> {
        Attention::forward(self, x, mask, kv_of(cache)?)
    }

    /// A standard KV cache; under dynamic NTK RoPE one whose offset stays an integer (the
    /// scaled base is computed from it).
    fn make_cache(&self) -> Box<dyn Cache> {
        kv_cache(&self.rope)
    }

    fn linears(&self) -> Vec<(&'static str, &Linear)> {
        self.named_linears().into()
    }

    fn shard(&mut self, part: Part, layer: &str) -> Result<(), LoadError> {
        Attention::shard(self, part, layer)
    }
}

/// Multi-head attention whose linears a family names its own way (LFM2's `out_proj`,
/// Nemotron-H's `mixer.*`): the same computation, other LoRA names, no tensor parallel.
pub struct NamedAttention {
    pub attn: Attention,
    /// q, k, v, o within the layer.
    pub names: [&'static str; 4],
    pub family: &'static str,
}

impl Mixer for NamedAttention {
    fn forward(&self, x: &Array, mask: &Mask, cache: &mut dyn Cache) -> R<Array> {
        self.attn.forward(x, mask, kv_of(cache)?)
    }

    fn make_cache(&self) -> Box<dyn Cache> {
        kv_cache(&self.attn.rope)
    }

    fn linears(&self) -> Vec<(&'static str, &Linear)> {
        let a = &self.attn;
        let n = self.names;
        vec![
            (n[0], &a.q_proj),
            (n[1], &a.k_proj),
            (n[2], &a.v_proj),
            (n[3], &a.o_proj),
        ]
    }

    fn shard(&mut self, _part: Part, layer: &str) -> Result<(), LoadError> {
        Err(LoadError::Unsupported(format!(
            "{layer}: {} is not split across ranks",
            self.family
        )))
    }
}

/// Attention whose scores are capped, `cap · tanh(s / cap)`, before the mask and softmax
/// (mlx-lm's gemma2): the projections, norms, RoPE and cache of [`Attention`], the scores
/// formed eagerly by `sdpa::attend_softcapped` instead of the fused kernel.
pub struct SoftcappedAttention {
    pub attn: Attention,
    pub cap: f32,
}

impl Mixer for SoftcappedAttention {
    fn forward(&self, x: &Array, mask: &Mask, cache: &mut dyn Cache) -> R<Array> {
        let a = &self.attn;
        a.forward_with(x, kv_of(cache)?, |q, _, kv| {
            crate::model::sdpa::attend_softcapped(&q, kv, a.scale, self.cap, mask)
        })
    }

    fn make_cache(&self) -> Box<dyn Cache> {
        kv_cache(&self.attn.rope)
    }

    fn linears(&self) -> Vec<(&'static str, &Linear)> {
        self.attn.named_linears().into()
    }

    fn shard(&mut self, part: Part, layer: &str) -> Result<(), LoadError> {
        self.attn.shard(part, layer)
    }
}

/// The KV cache an attention with `rope` keeps.
pub fn kv_cache(rope: &rope::Rope) -> Box<dyn Cache> {
    match rope.needs_int_offset() {
        true => Box::new(rope::IntOffsetKv(KvCache::new())),
        false => Box::new(KvCache::new()),
    }
}

/// The gated MLP as a feed-forward.
impl FeedForward for Mlp {
    fn forward(&self, x: &Array) -> R<Array> {
        Mlp::forward(self, x)
    }

    fn linears(&self, module: &str) -> Vec<(String, &Linear)> {
        [
            ("gate_proj", &self.gate_proj),
            ("up_proj", &self.up_proj),
            ("down_proj", &self.down_proj),
        ]
        .map(|(n, l)| (format!("{module}.{n}"), l))
        .into()
    }

    fn shard(&mut self, part: Part, prefix: &str) -> Result<(), LoadError> {
        Mlp::shard(self, part, prefix)
    }
}
