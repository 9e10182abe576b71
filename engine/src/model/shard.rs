//! Tensor and pipeline parallelism as mlx-lm 0.32.2 shards its models (`Model.shard`,
//! `PipelineMixin.pipeline`, mlx's `shard_linear` / `shard_inplace`): every parameter is cut
//! into `size` equal contiguous parts and rank r keeps part r. A column-split linear
//! (all-to-sharded) computes this rank's slice of the outputs; a row-split one
//! (sharded-to-all) computes a partial product over this rank's slice of the inputs, sums it
//! over the ranks, then adds its bias once.

use std::cell::RefCell;

use mlx_rs::error::Exception;
use mlx_rs::transforms::compile::compile;
use mlx_rs::{Array, Dtype};

use super::layers::{weak, Attention, CompiledFn, Linear, Mlp, RmsNorm};
use crate::load::LoadError;
use crate::plant::{self, Defect};

/// This rank's place in the group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Part {
    pub rank: usize,
    pub size: usize,
}

impl Part {
    /// The group this process belongs to (rank 0 of 1 outside one).
    pub fn of_group() -> Self {
        crate::dist::group().map_or(Part { rank: 0, size: 1 }, |g| Part {
            rank: g.rank,
            size: g.size,
        })
    }

    /// mlx-lm's `PipelineMixin.pipeline`: the layers split as evenly as they go, the low
    /// ranks taking the extras, and rank 0 holding the *last* layers (the activations flow
    /// from the highest rank down to rank 0, which has the head). Returns `[start, end)`.
    pub fn layer_range(self, layers: usize) -> std::ops::Range<usize> {
        let (n, r) = (self.size, self.rank);
        let split: Vec<usize> = (0..n)
            .map(|i| layers / n + usize::from(i < layers % n))
            .collect();
        let start: usize = split[r + 1..].iter().sum();
        let (start, end) = (start, start + split[r]);
        if plant::is(Defect::DistShardWrongRank) {
            // The stages reversed: rank r runs the layers meant for rank n-1-r.
            let mirror = Part {
                rank: n - 1 - r,
                size: n,
            };
            if mirror != self {
                let s: usize = split[mirror.rank + 1..].iter().sum();
                return s..s + split[mirror.rank];
            }
        }
        start..end
    }
}

/// How a linear is cut (mlx's `shard_linear` kinds).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// all-to-sharded: the outputs (weight axis -2, bias split too).
    Columns,
    /// sharded-to-all: the inputs (weight axis -1, bias kept whole, all_sum after).
    Rows,
}

/// Part `part.rank` of `a` cut into `part.size` equal parts along `axis` (mlx's `_shard`:
/// `split`, keep one, `contiguous`). `what` names the tensor in the error.
pub fn slice(a: &Array, axis: i32, part: Part, what: &str) -> Result<Array, LoadError> {
    slice_segments(a, axis, &[], part, what)
}

/// mlx's `_shard` with `segments` (a fused tensor's parts, e.g. the gated delta net's
/// [q | k | v] rows): `a` cut at `bounds` along `axis`, each piece cut into `part.size` equal
/// parts, this rank's part of every piece kept, the parts concatenated in order and made
/// contiguous. No bounds: one piece, as [`slice`].
pub fn slice_segments(
    a: &Array,
    axis: i32,
    bounds: &[i32],
    part: Part,
    what: &str,
) -> Result<Array, LoadError> {
    let ax = if axis < 0 {
        a.ndim() as i32 + axis
    } else {
        axis
    };
    let mlx = |e: Exception| LoadError::Weights(format!("sharding `{what}`: {e}"));
    let pieces = match bounds {
        [] => vec![a.clone()],
        _ => a.split_at_indices(bounds, ax).map_err(mlx)?,
    };
    let mut kept = Vec::with_capacity(pieces.len());
    for piece in &pieces {
        let len = piece.shape()[ax as usize];
        if len % part.size as i32 != 0 {
            let of = match bounds {
                [] => String::new(),
                _ => format!(
                    " (a segment of {} cut at {bounds:?})",
                    a.shape()[ax as usize]
                ),
            };
            return Err(LoadError::Unsupported(format!(
                "`{what}` has {len} along axis {ax}{of}, which does not split into {} equal \
                 parts (tensor parallel on {} ranks needs it to; try --pipeline or another \
                 rank count)",
                part.size, part.size
            )));
        }
        let parts = piece.split_equal(part.size as i32, ax).map_err(mlx)?;
        kept.push(parts[part.rank].clone());
    }
    let kept = mlx_rs::ops::concatenate(&kept[..], ax).map_err(mlx)?;
    let kept = kept.contiguous().map_err(mlx)?;
    kept.eval().map_err(mlx)?;
    Ok(kept)
}

impl Linear {
    /// Keeps this rank's part of the layer (`shard_linear`).
    pub fn shard(&mut self, split: Split, part: Part, what: &str) -> Result<(), LoadError> {
        shard_params(
            &mut self.weight,
            &mut self.quantized,
            &mut self.bias,
            (split, part),
            what,
        )?;
        self.reduce = split == Split::Rows;
        Ok(())
    }

    /// mlx-lm's `repeat_kv_layer_inplace` (qwen3_5's shard, when the ranks outnumber the KV
    /// heads): every parameter's `heads` blocks of rows repeated `times` times each in place
    /// (`[h0, h0, h1, h1]` for 2), so that each rank then keeps one whole head.
    pub fn repeat_heads(&mut self, heads: i32, times: i32, what: &str) -> Result<(), LoadError> {
        let mlx = |e: Exception| LoadError::Weights(format!("repeating `{what}`: {e}"));
        let rep = |p: &Array| -> Result<Array, Exception> {
            let s = p.shape();
            let mut blocks = vec![heads, s[0] / heads];
            blocks.extend_from_slice(&s[1..]);
            let r = mlx_rs::ops::repeat_axis::<f32>(p.reshape(&blocks)?, times, 0)?;
            let mut back = vec![-1];
            back.extend_from_slice(&s[1..]);
            r.reshape(&back)
        };
        self.weight = rep(&self.weight).map_err(mlx)?;
        if let Some(q) = &mut self.quantized {
            q.scales = rep(&q.scales).map_err(mlx)?;
            if let Some(b) = &q.biases {
                q.biases = Some(rep(b).map_err(mlx)?);
            }
        }
        if let Some(b) = &self.bias {
            self.bias = Some(rep(b).map_err(mlx)?);
        }
        Ok(())
    }

    /// mlx's `shard_inplace`: this rank's part of the parameters, the layer otherwise as it
    /// was (a row split sums nothing: the module that owns it sums its output, as the gated
    /// delta net after `out_proj` and the sparse block after its experts do).
    pub fn shard_inplace(&mut self, split: Split, part: Part, what: &str) -> Result<(), LoadError> {
        self.shard_segments(split, &[], part, what)
    }

    /// `shard_inplace(.., segments=bounds)`: a fused projection whose outputs are pieces cut
    /// at `bounds` (Qwen 3.5's `in_proj_qkv`, [q | k | v]); each piece is split on its own.
    pub fn shard_segments(
        &mut self,
        split: Split,
        bounds: &[i32],
        part: Part,
        what: &str,
    ) -> Result<(), LoadError> {
        shard_params_segmented(
            &mut self.weight,
            &mut self.quantized,
            &mut self.bias,
            (split, part),
            bounds,
            what,
        )
    }
}

/// Cuts a linear's parameters, of one layer (`[out, in]`) or a stack of experts
/// (`[E, out, in]`): the weight on the outputs (`max(ndim - 2, 0)`) or the inputs (-1),
/// quantized scales and biases as the packed weight, the bias with the outputs only.
pub(crate) fn shard_params(
    weight: &mut Array,
    quantized: &mut Option<super::layers::Quantized>,
    bias: &mut Option<Array>,
    (split, part): (Split, Part),
    what: &str,
) -> Result<(), LoadError> {
    shard_params_segmented(weight, quantized, bias, (split, part), &[], what)
}

/// As [`shard_params`], each of the pieces cut at `bounds` (mlx's `segments`, along the
/// split axis) split on its own.
fn shard_params_segmented(
    weight: &mut Array,
    quantized: &mut Option<super::layers::Quantized>,
    bias: &mut Option<Array>,
    (split, part): (Split, Part),
    bounds: &[i32],
    what: &str,
) -> Result<(), LoadError> {
    let axis = match split {
        Split::Columns => (weight.ndim() as i32 - 2).max(0),
        Split::Rows => -1,
    };
    let cut = |a: &Array, axis: i32, name: &str| {
        slice_segments(a, axis, bounds, part, &format!("{what}.{name}"))
    };
    *weight = cut(weight, axis, "weight")?;
    if let Some(q) = quantized {
        q.scales = cut(&q.scales, axis, "scales")?;
        if let Some(b) = &q.biases {
            q.biases = Some(cut(b, axis, "biases")?);
        }
    }
    if split == Split::Columns {
        if let Some(b) = bias {
            *b = cut(b, -1, "bias")?;
        }
    }
    Ok(())
}

impl Attention {
    /// mlx-lm's attention shard: q/k/v by columns (whole heads and their KV groups), o by
    /// rows; each rank runs `heads / size` query heads and `kv_heads / size` KV heads.
    pub fn shard(&mut self, part: Part, prefix: &str) -> Result<(), LoadError> {
        let n = part.size as i32;
        if self.n_heads % n != 0 || self.n_kv_heads % n != 0 {
            return Err(LoadError::Unsupported(format!(
                "{prefix}: {} query and {} KV heads do not split over {n} ranks (tensor \
                 parallel needs both to divide by the rank count; try --pipeline)",
                self.n_heads, self.n_kv_heads
            )));
        }
        let attn = format!("{prefix}.self_attn");
        self.q_proj
            .shard(Split::Columns, part, &format!("{attn}.q_proj"))?;
        self.k_proj
            .shard(Split::Columns, part, &format!("{attn}.k_proj"))?;
        self.v_proj
            .shard(Split::Columns, part, &format!("{attn}.v_proj"))?;
        // The planted defect: o_proj keeps the other rank's slice, so its inputs (this
        // rank's heads) meet the wrong weights — asymmetric, so the sum changes.
        let o_part = if plant::is(Defect::DistShardWrongRank) {
            Part {
                rank: (part.rank + 1) % part.size,
                ..part
            }
        } else {
            part
        };
        self.o_proj
            .shard(Split::Rows, o_part, &format!("{attn}.o_proj"))?;
        self.n_heads /= n;
        self.n_kv_heads /= n;
        Ok(())
    }
}

impl Mlp {
    /// gate and up by columns, down by rows.
    pub fn shard(&mut self, part: Part, prefix: &str) -> Result<(), LoadError> {
        self.gate_proj
            .shard(Split::Columns, part, &format!("{prefix}.gate_proj"))?;
        self.up_proj
            .shard(Split::Columns, part, &format!("{prefix}.up_proj"))?;
        self.down_proj
            .shard(Split::Rows, part, &format!("{prefix}.down_proj"))
    }
}

/// mlx-lm's `ShardedRMSNorm` (minimax.py): an RMSNorm over features that tensor parallel
/// spread over the ranks (minimax's q/k norms, over every head at once, whose heads the
/// ranks split). Each rank keeps its part of the weight and squares its part of the
/// features; the sums of squares are added over the ranks, so that every rank normalizes by
/// the whole row's mean square:
///
///   norm2 = Σ_f float32(x)²                            compiled, this rank's features
///   y = float32(x) · rsqrt(all_sum(norm2) / (F · N) + eps) · w, cast to x's dtype
///                                                       compiled, all_sum inside
///
/// (F this rank's feature count, N the ranks), as mlx-lm's two compiled functions do.
pub struct ShardedRmsNorm {
    weight: Array,
    eps: f32,
    ranks: i32,
}

fn cast_square_sum_graph(args: &[Array]) -> Result<Vec<Array>, Exception> {
    let x = args[0].as_dtype(Dtype::Float32)?;
    Ok(vec![x.square()?.sum_axis(-1, true)?])
}

/// `_normalize(x, norm2, w, eps)` with the divisor `F · N` and `eps` passed in as float32
/// scalars (mlx-lm's Python numbers, weak, take norm2's float32).
fn sharded_normalize_graph(args: &[Array]) -> Result<Vec<Array>, Exception> {
    let (x, norm2, w, count, eps) = (&args[0], &args[1], &args[2], &args[3], &args[4]);
    let norm2 = crate::dist::all_sum(norm2)?;
    let norm = mlx_rs::ops::rsqrt(norm2.divide(count)?.add(eps)?)?;
    let y = x.as_dtype(Dtype::Float32)?.multiply(&norm)?.multiply(w)?;
    Ok(vec![y.as_dtype(x.dtype())?])
}

/// Compiled as mlx-lm's `@mx.compile` (not shapeless: one trace per shape).
fn compiled(f: fn(&[Array]) -> Result<Vec<Array>, Exception>) -> CompiledFn {
    let mut c = compile(f, false);
    Box::new(move |args: &[Array]| c(args))
}

thread_local! {
    static CAST_SQUARE_SUM: RefCell<CompiledFn> = RefCell::new(compiled(cast_square_sum_graph));
    static SHARDED_NORMALIZE: RefCell<CompiledFn> = RefCell::new(compiled(sharded_normalize_graph));
}

impl ShardedRmsNorm {
    /// `ShardedRMSNorm.from_rms_norm`: this rank's part of `norm`'s weight (`what` names it).
    pub fn from_rms_norm(norm: &RmsNorm, part: Part, what: &str) -> Result<Self, LoadError> {
        Ok(ShardedRmsNorm {
            weight: slice(&norm.weight, -1, part, &format!("{what}.weight"))?,
            eps: norm.eps,
            ranks: part.size as i32,
        })
    }

    /// `ShardedRMSNorm.__call__` over this rank's features of `x`.
    pub fn forward(&self, x: &Array) -> Result<Array, Exception> {
        if plant::is(Defect::ShardedNormPerRank) {
            // Planted: each rank normalizes its own features only (no cross-rank sum).
            return mlx_rs::fast::rms_norm(x, Some(&self.weight), self.eps);
        }
        let norm2 = CAST_SQUARE_SUM
            .with_borrow_mut(|f| f(std::slice::from_ref(x)))?
            .remove(0);
        let features = x.shape()[x.ndim() - 1];
        let count = weak(f64::from(features * self.ranks), &norm2)?;
        let eps = weak(f64::from(self.eps), &norm2)?;
        let args = [x.clone(), norm2, self.weight.clone(), count, eps];
        Ok(SHARDED_NORMALIZE.with_borrow_mut(|f| f(&args))?.remove(0))
    }
}

// The output head's split lives here, not in layers.rs: layers.rs must not reach back into
// this module (which builds on it).
impl super::layers::OutputHead {
    /// Keeps this rank's part of an untied `lm_head`'s vocabulary (`shard_linear(lm_head,
    /// "all-to-sharded")`); the logits are gathered after it. A tied head stays whole.
    pub fn shard_vocab(&mut self, part: Part) -> Result<(), LoadError> {
        let Some(head) = self.lm_head.as_mut() else {
            return Ok(());
        };
        let vocab = head.output_dims();
        if vocab % part.size as i32 != 0 {
            return Err(LoadError::Unsupported(format!(
                "lm_head: a vocabulary of {vocab} does not split over {} ranks (tensor \
                 parallel splits the untied head by the vocabulary; try --pipeline)",
                part.size
            )));
        }
        head.shard(Split::Columns, part, "lm_head")?;
        self.vocab_parts = part.size;
        Ok(())
    }
}
