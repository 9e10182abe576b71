//! Tensor and pipeline parallelism as mlx-lm 0.32.2 shards its models (`Model.shard`,
//! `PipelineMixin.pipeline`, mlx's `shard_linear` / `shard_inplace`): every parameter is cut
//! into `size` equal contiguous parts and rank r keeps part r. A column-split linear
//! (all-to-sharded) computes this rank's slice of the outputs; a row-split one
//! (sharded-to-all) computes a partial product over this rank's slice of the inputs, sums it
//! over the ranks, then adds its bias once.

use mlx_rs::error::Exception;
use mlx_rs::Array;

use super::layers::{Attention, Linear, Mlp};
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
    let ax = if axis < 0 {
        a.ndim() as i32 + axis
    } else {
        axis
    };
    let len = a.shape()[ax as usize];
    if len % part.size as i32 != 0 {
        return Err(LoadError::Unsupported(format!(
            "`{what}` has {len} along axis {ax}, which does not split into {} equal parts \
             (tensor parallel on {} ranks needs it to; try --pipeline or another rank count)",
            part.size, part.size
        )));
    }
    let mlx = |e: Exception| LoadError::Weights(format!("sharding `{what}`: {e}"));
    let parts = a.split_equal(part.size as i32, ax).map_err(mlx)?;
    let kept = &parts[part.rank];
    let kept = mlx_rs::ops::concatenate(&[kept], ax).map_err(mlx)?;
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
    let axis = match split {
        Split::Columns => (weight.ndim() as i32 - 2).max(0),
        Split::Rows => -1,
    };
    *weight = slice(weight, axis, part, &format!("{what}.weight"))?;
    if let Some(q) = quantized {
        q.scales = slice(&q.scales, axis, part, &format!("{what}.scales"))?;
        if let Some(b) = &q.biases {
            q.biases = Some(slice(b, axis, part, &format!("{what}.biases"))?);
        }
    }
    if split == Split::Columns {
        if let Some(b) = bias {
            *b = slice(b, -1, part, &format!("{what}.bias"))?;
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
