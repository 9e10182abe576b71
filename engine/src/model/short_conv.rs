//! The gated short convolution (LFM2's `ShortConv`), as mlx-lm 0.32.2 computes it:
//!
//!   B, C, x = split(in_proj(h), 3)        Bx = B · x   (0 where the batch mask hides a token)
//!   with a state s (the last K − 1 inputs, zeros at first):  Bx = [s; Bx],  s = Bx[-(K−1):]
//!   without (a cache-less run):                              Bx = [0_{K−1}; Bx]
//!   y = out_proj(C · conv1d_depthwise(Bx))                   (kernel K, no padding)
//!
//! The state lives in slot 0 of an `ArraysCache` (batched rows keep the K − 1 inputs after
//! their own last real token: `lengths`, as mlx-lm's `take_along_axis` picks them). Hugging
//! Face checkpoints store the depthwise kernel as [channels, 1, K]; mlx-lm's sanitize
//! transposes it to MLX's [channels, K, 1], and so does `sanitize_kernels` (the loader's and
//! `engine convert`'s).

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::{Ellipsis, IndexOp, NewAxis};
use mlx_rs::ops::{arange, clip, concatenate, conv1d, pad, select, split_equal, zeros_dtype};
use mlx_rs::Array;

use super::decoder::Mixer;
use super::layers::Linear;
use super::shard::Part;
use crate::cache::{ArraysCache, Cache, Mask};
use crate::load::weights::Weights;
use crate::load::LoadError;

type R<T> = Result<T, Exception>;

/// mlx-lm's lfm2 `sanitize` (at load and in `engine convert`): a `conv.weight` whose last
/// axis is longer than its second — Hugging Face's [channels, 1, K] — transposed to MLX's
/// [channels, K, 1].
pub(crate) fn sanitize_kernels(w: &mut Weights) -> Result<(), LoadError> {
    w.transform(|n, a| {
        let s = a.shape();
        match n.contains("conv.weight") && s.len() == 3 && s[2] > s[1] {
            true => Ok(Some(a.transpose_axes(&[0, 2, 1])?)),
            false => Ok(None),
        }
    })
}

pub struct ShortConv {
    in_proj: Linear,
    out_proj: Linear,
    /// [channels, K, 1] (MLX's depthwise layout).
    kernel: Array,
    bias: Option<Array>,
    /// K, the kernel's length (`conv_L_cache`).
    width: i32,
    hidden: i32,
}

impl ShortConv {
    /// `prefix` is the mixer's (`model.layers.{i}.conv`); `bias` covers the three
    /// projections and the kernel alike (`conv_bias`).
    pub fn load(
        w: &mut Weights,
        prefix: &str,
        hidden: i32,
        width: i32,
        bias: bool,
    ) -> Result<Self, LoadError> {
        // Sanitized (`sanitize_kernels`): MLX's layout.
        let kernel = w.take_shaped(&format!("{prefix}.conv.weight"), &[hidden, width, 1])?;
        Ok(ShortConv {
            in_proj: Linear::load(w, &format!("{prefix}.in_proj"), bias, [3 * hidden, hidden])?,
            out_proj: Linear::load(w, &format!("{prefix}.out_proj"), bias, [hidden, hidden])?,
            kernel,
            bias: match bias {
                true => Some(w.take_shaped(&format!("{prefix}.conv.bias"), &[hidden])?),
                false => None,
            },
            width,
            hidden,
        })
    }

    /// `Bx` with the state (or zeros) before it; the state becomes the inputs the next
    /// step needs.
    fn with_state(&self, bx: Array, state: &mut ArraysCache) -> R<Array> {
        let keep = self.width - 1;
        let before = match state.get(0) {
            Some(s) => s.clone(),
            None => zeros_dtype(&[bx.shape()[0], keep, self.hidden], bx.dtype())?,
        };
        let t = bx.shape()[1];
        let bx = concatenate(&[&before, &bx], 1)?;
        let kept = match state.lengths() {
            Some(lengths) => {
                let lengths = Array::from_slice(lengths, &[lengths.len() as i32]);
                let ends = clip(&lengths, (&Array::from_int(0), &Array::from_int(t)))?;
                let positions = ends
                    .index((.., NewAxis))
                    .add(arange::<_, i32>(0, keep, 1)?)?
                    .index((Ellipsis, NewAxis));
                bx.take_along_axis(&positions, 1)?
            }
            None if crate::plant::is(crate::plant::Defect::ShortConvStateShifted) => {
                bx.index((.., (-keep - 1)..-1, ..))
            }
            None => bx.index((.., (-keep).., ..)),
        };
        state.set(0, kept);
        state.advance(t);
        Ok(bx)
    }
}

impl Mixer for ShortConv {
    fn forward(&self, x: &Array, mask: &Mask, cache: &mut dyn Cache) -> R<Array> {
        let parts = split_equal(self.in_proj.forward(x)?, 3, -1)?;
        let (b, c, x) = (&parts[0], &parts[1], &parts[2]);
        let mut bx = b.multiply(x)?;
        if let Mask::Array(m) = mask {
            let zero = Array::from_int(0).as_dtype(bx.dtype())?;
            bx = select(m.index((Ellipsis, NewAxis)), &bx, &zero)?;
        }
        let bx = match cache.as_arrays() {
            Some(state) => self.with_state(bx, state)?,
            None => pad(&bx, &[(0, 0), (self.width - 1, 0), (0, 0)], None, None)?,
        };
        let mut y = conv1d(&bx, &self.kernel, 1, 0, 1, self.hidden)?;
        if let Some(bias) = &self.bias {
            y = y.add(bias)?;
        }
        self.out_proj.forward(&c.multiply(&y)?)
    }

    /// One slot: the last K − 1 inputs.
    fn make_cache(&self) -> Box<dyn Cache> {
        Box::new(ArraysCache::new(1))
    }

    fn recurrent(&self) -> bool {
        true
    }

    fn linears(&self) -> Vec<(&'static str, &Linear)> {
        vec![
            ("conv.in_proj", &self.in_proj),
            ("conv.out_proj", &self.out_proj),
        ]
    }

    fn shard(&mut self, _part: Part, layer: &str) -> Result<(), LoadError> {
        Err(LoadError::Unsupported(format!(
            "{layer}: short convolutions are not split across ranks (mlx-lm has no shard for them)"
        )))
    }
}
