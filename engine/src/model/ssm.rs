//! The Mamba-2 mixer (its SSD selective scan), shared by `mamba2` and the hybrids that
//! mix it with attention, as mlx-lm 0.32.2 computes it off Metal (`ssm.py`'s `ssm_attn`,
//! the path every CPU and CUDA step takes; `mamba2.py`'s `Mamba2Block`):
//!
//!   gate, xBC, dt = split(in_proj(h));  x, B, C = split(silu(conv1d([conv_state; xBC])))
//!   dt = clip(softplus(dt + dt_bias), limits) (float32);  A = −exp(A_log)
//!   per chunk of 256 tokens (S: the state [b, heads, head_dim, N], carried between chunks):
//!     decay = exp(segsum(dt·A));  y = tril((C·Bᵀ) ⊙ decay) · (dt·x) + exp(cumsum(dt·A)) ⊙ (S·C)
//!     S = (dt·x ⊙ decay_last)ᵀ · B + exp(Σ dt·A) ⊙ S
//!   y = y + x·D;  out = out_proj(rms_norm(silu(gate) · y))
//!
//! The gated norm is the family's (`GatedNorm`): Mamba-2's over all channels, Nemotron-H's
//! per group, Falcon-H1's before the gate or none at all.
//!
//! B and C have `n_groups` groups shared by the heads (each repeated to heads / groups).
//! The layer's `ArraysCache` holds [conv_state, S].

use std::cell::RefCell;

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::{Ellipsis, IndexOp, NewAxis};
use mlx_rs::ops::{
    arange, clip, concatenate, conv1d, cumsum, exp, flatten, matmul, pad, repeat_axis, select,
    tril, zeros_dtype,
};
use mlx_rs::{fast, Array, Dtype};

use super::decoder::Mixer;
use super::layers::{compiled_shapeless, swiglu, CompiledFn, Linear};
use super::shard::Part;
use crate::cache::{ArraysCache, Cache, Mask};
use crate::load::weights::Weights;
use crate::load::LoadError;

type R<T> = Result<T, Exception>;

/// The chunk `ssm_attn` scans at a time.
const STEP: i32 = 256;

/// One Mamba-2 mixer's sizes.
#[derive(Debug, Clone, Copy)]
pub struct SsmShape {
    pub hidden: i32,
    pub heads: i32,
    pub head_dim: i32,
    pub groups: i32,
    /// N, the state's width per group.
    pub state: i32,
    pub conv_kernel: i32,
    /// in_proj's bias (and out_proj's unless `out_bias` says otherwise).
    pub use_bias: bool,
    /// out_proj's bias (Falcon-H1's `projectors_bias`; the others: `use_bias`).
    pub out_bias: bool,
    pub use_conv_bias: bool,
    pub eps: f32,
    /// dt's clip bounds (`time_step_limit`).
    pub limits: (f32, f32),
    /// How silu(gate) and y meet the norm.
    pub norm: GatedNorm,
    /// Nemotron-H casts D to x's dtype before the skip term (`D.astype(x.dtype)`).
    pub cast_d: bool,
    /// Whether the scan reads a batched prefill's lengths (Mamba-2's does; Nemotron-H's
    /// passes only the mask).
    pub scan_lengths: bool,
}

/// The mixer's gated norm, by family.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum GatedNorm {
    /// Mamba-2's (and Falcon-H1's with `mamba_rms_norm`): rms_norm(silu(gate) · y) over all
    /// channels, weighted.
    AfterGate,
    /// Nemotron-H's: silu(gate) · y normalized per group of `inner / groups` channels (no
    /// weight inside), then scaled by the weight.
    Grouped(i32),
    /// Falcon-H1's `mamba_norm_before_gate`: silu(gate) · rms_norm(y), weighted.
    BeforeGate,
    /// Falcon-H1 without `mamba_rms_norm`: silu(gate) · y, no norm (and no weight).
    Absent,
}

impl SsmShape {
    fn inner(&self) -> i32 {
        self.heads * self.head_dim
    }

    fn conv_dim(&self) -> i32 {
        self.inner() + 2 * self.groups * self.state
    }
}

pub struct Mamba2Mixer {
    in_proj: Linear,
    /// [conv_dim, K, 1] (MLX's depthwise layout).
    conv: Array,
    conv_bias: Option<Array>,
    dt_bias: Array,
    a_log: Array,
    d: Array,
    /// The gated norm's weight (none when the norm is `Absent`).
    norm: Option<Array>,
    out_proj: Linear,
    shape: SsmShape,
    /// The mixer's name within a layer (`mixer`), for LoRA's names.
    name: &'static str,
}

impl Mamba2Mixer {
    /// `prefix` is the mixer's (`backbone.layers.{i}.mixer`); `name` its last part. The
    /// checkpoint has been sanitized (the conv kernel in MLX's layout).
    pub fn load(
        w: &mut Weights,
        prefix: &str,
        name: &'static str,
        shape: SsmShape,
    ) -> Result<Self, LoadError> {
        if shape.groups <= 0 || shape.heads % shape.groups != 0 {
            return Err(LoadError::Unsupported(format!(
                "mamba2: num_heads ({}) must be a multiple of n_groups ({})",
                shape.heads, shape.groups
            )));
        }
        let lin = |w: &mut Weights, n: &str, bias: bool, out_in: [i32; 2]| {
            Linear::load(w, &format!("{prefix}.{n}"), bias, out_in)
        };
        let take =
            |w: &mut Weights, n: &str, dims: &[i32]| w.take_shaped(&format!("{prefix}.{n}"), dims);
        let (hidden, inner, heads, conv_dim) =
            (shape.hidden, shape.inner(), shape.heads, shape.conv_dim());
        Ok(Mamba2Mixer {
            in_proj: lin(
                w,
                "in_proj",
                shape.use_bias,
                [inner + conv_dim + heads, hidden],
            )?,
            conv: take(w, "conv1d.weight", &[conv_dim, shape.conv_kernel, 1])?,
            conv_bias: match shape.use_conv_bias {
                true => Some(take(w, "conv1d.bias", &[conv_dim])?),
                false => None,
            },
            dt_bias: take(w, "dt_bias", &[heads])?,
            a_log: take(w, "A_log", &[heads])?,
            d: take(w, "D", &[heads])?,
            norm: match shape.norm {
                GatedNorm::Absent => None,
                _ => Some(take(w, "norm.weight", &[inner])?),
            },
            out_proj: lin(w, "out_proj", shape.out_bias, [hidden, inner])?,
            shape,
            name,
        })
    }

    /// `_conv`: silu(conv1d) over the state (or zeros) and the new inputs, the state kept
    /// for the next step; cache-less, zero padding.
    fn conv(
        &self,
        input: Array,
        mask: Option<&Array>,
        state: Option<&mut ArraysCache>,
    ) -> R<Array> {
        let keep = self.shape.conv_kernel - 1;
        let input = match mask {
            Some(m) => {
                let zero = Array::from_int(0).as_dtype(input.dtype())?;
                select(m.index((Ellipsis, NewAxis)), &input, &zero)?
            }
            None => input,
        };
        let padded = match state {
            Some(cache) => {
                let before = match cache.get(0) {
                    Some(s) => s.clone(),
                    None => zeros_dtype(
                        &[input.shape()[0], keep, self.shape.conv_dim()],
                        input.dtype(),
                    )?,
                };
                let padded = concatenate(&[&before, &input], 1)?;
                let kept = match cache.lengths() {
                    Some(lengths) => {
                        let t = padded.shape()[1];
                        let lengths = Array::from_slice(lengths, &[lengths.len() as i32]);
                        let hi = Array::from_int(t - keep);
                        let ends = clip(&lengths, (&Array::from_int(0), &hi))?;
                        let positions = ends
                            .index((.., NewAxis))
                            .add(arange::<_, i32>(0, keep, 1)?)?
                            .index((Ellipsis, NewAxis));
                        padded.take_along_axis(&positions, 1)?
                    }
                    None => padded.index((.., (-keep).., ..)),
                };
                cache.set(0, kept);
                padded
            }
            None => pad(&input, &[(0, 0), (keep, 0), (0, 0)], None, None)?,
        };
        let mut out = conv1d(&padded, &self.conv, 1, 0, 1, self.shape.conv_dim())?;
        if let Some(b) = &self.conv_bias {
            out = out.add(b)?;
        }
        mlx_rs::nn::silu(&out)
    }
}

impl Mixer for Mamba2Mixer {
    fn forward(&self, x: &Array, mask: &Mask, cache: &mut dyn Cache) -> R<Array> {
        let sh = self.shape;
        let (b, l) = (x.shape()[0], x.shape()[1]);
        let inner = sh.inner();
        let projected = self.in_proj.forward(x)?;
        let parts = projected.split_at_indices(&[inner, inner + sh.conv_dim()], -1)?;
        let (gate, xbc, dt) = (&parts[0], parts[1].clone(), &parts[2]);
        let mask = match mask {
            Mask::Array(m) => Some(m),
            _ => None,
        };
        let mut state = cache.as_arrays();
        let conv = self.conv(xbc, mask, state.as_deref_mut())?;
        let gn = sh.groups * sh.state;
        let parts = conv.split_at_indices(&[inner, inner + gn], -1)?;
        let hs = parts[0].reshape(&[b, l, sh.heads, sh.head_dim])?;
        let bm = parts[1].reshape(&[b, l, sh.groups, sh.state])?;
        let cm = parts[2].reshape(&[b, l, sh.groups, sh.state])?;
        let (prev, lengths) = match state.as_ref() {
            Some(c) => (
                c.get(1).cloned(),
                c.lengths().filter(|_| sh.scan_lengths).map(<[i32]>::to_vec),
            ),
            None => (None, None),
        };
        let d = match sh.cast_d {
            true => self.d.as_dtype(hs.dtype())?,
            false => self.d.clone(),
        };
        let scan = Scan {
            a_log: &self.a_log,
            d: &d,
            dt_bias: &self.dt_bias,
            limits: sh.limits,
        };
        let (y, next) = scan.run(&hs, &bm, &cm, dt, prev, mask, lengths)?;
        if let Some(c) = state {
            c.set(1, next);
            c.advance(l);
        }
        let y = y.reshape(&[b, l, inner])?;
        let norm = match sh.norm {
            GatedNorm::Grouped(_) if crate::plant::is(crate::plant::Defect::SsmNormUngrouped) => {
                GatedNorm::AfterGate
            }
            n => n,
        };
        let weight = self.norm.as_ref();
        let y = match norm {
            GatedNorm::AfterGate => fast::rms_norm(&swiglu(gate, &y)?, weight, sh.eps)?,
            GatedNorm::Grouped(groups) => {
                let gated = swiglu(gate, &y)?;
                let grouped = gated.reshape(&[b, l, groups, inner / groups])?;
                let normed = fast::rms_norm(&grouped, None, sh.eps)?;
                let weight = weight.ok_or_else(|| Exception::custom("no gated norm weight"))?;
                weight.multiply(normed.reshape(&[b, l, inner])?)?
            }
            GatedNorm::BeforeGate => swiglu(gate, &fast::rms_norm(&y, weight, sh.eps)?)?,
            GatedNorm::Absent => swiglu(gate, &y)?,
        };
        self.out_proj.forward(&y)
    }

    /// [conv state, SSM state].
    fn make_cache(&self) -> Box<dyn Cache> {
        Box::new(ArraysCache::new(2))
    }

    fn recurrent(&self) -> bool {
        true
    }

    fn linears(&self) -> Vec<(&'static str, &Linear)> {
        let names: (&'static str, &'static str) = match self.name {
            "mixer" => ("mixer.in_proj", "mixer.out_proj"),
            _ => ("mamba.in_proj", "mamba.out_proj"),
        };
        vec![(names.0, &self.in_proj), (names.1, &self.out_proj)]
    }

    fn shard(&mut self, _part: Part, layer: &str) -> Result<(), LoadError> {
        Err(LoadError::Unsupported(format!(
            "{layer}: Mamba-2 mixers are not split across ranks (mlx-lm has no shard for them)"
        )))
    }
}

/// `ssm_attn`'s parameters.
struct Scan<'a> {
    a_log: &'a Array,
    d: &'a Array,
    dt_bias: &'a Array,
    limits: (f32, f32),
}

impl Scan<'_> {
    /// `ssm_attn`: x [b, l, h, dh], B and C [b, l, g, n], dt [b, l, h] → y [b, l, h, dh] (x's
    /// dtype) and the state [b, h, dh, n].
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        x: &Array,
        bm: &Array,
        cm: &Array,
        dt: &Array,
        mut state: Option<Array>,
        mask: Option<&Array>,
        mut lengths: Option<Vec<i32>>,
    ) -> R<(Array, Array)> {
        let (b, l, h) = (x.shape()[0], x.shape()[1], x.shape()[2]);
        let dt = compute_dt(dt, self.dt_bias, self.limits)?;
        let a = exp(self.a_log)?.as_dtype(dt.dtype())?.negative()?;
        let mut dta = dt.multiply(a.reshape(&[1, 1, -1])?)?;
        if let Some(m) = mask {
            dta = dta.multiply(m.index((Ellipsis, NewAxis)))?;
        }
        let dtx = dt.reshape(&[b, l, h, 1])?.multiply(x)?;
        let mut ys = Vec::new();
        let mut i = 0;
        while i < l {
            let end = (i + STEP).min(l);
            let cut = |t: &Array| t.index((.., i..end));
            let m = mask.map(|m| m.index((Ellipsis, i..end)));
            if i > 0 && crate::plant::is(crate::plant::Defect::SsmChunkStateDropped) {
                state = None;
            }
            let (y, next) = self.chunk(
                (&cut(&dtx), &cut(&dta)),
                (&cut(bm), &cut(cm)),
                state,
                m.as_ref(),
                lengths.as_deref(),
                x.dtype(),
            )?;
            if let Some(ls) = lengths.as_mut() {
                ls.iter_mut().for_each(|v| *v -= STEP);
            }
            ys.push(y);
            state = Some(next);
            i = end;
        }
        let y = concatenate(&ys, 1)?.add(x.multiply(self.d.reshape(&[1, 1, h, 1])?)?)?;
        let state = state.ok_or_else(|| Exception::custom("an empty sequence has no state"))?;
        Ok((y, state))
    }

    /// `_step`: one chunk.
    fn chunk(
        &self,
        (dtx, dta): (&Array, &Array),
        (bm, cm): (&Array, &Array),
        state: Option<Array>,
        mask: Option<&Array>,
        lengths: Option<&[i32]>,
        out_dtype: Dtype,
    ) -> R<(Array, Array)> {
        let (b, s, h, dh) = (
            dtx.shape()[0],
            dtx.shape()[1],
            dtx.shape()[2],
            dtx.shape()[3],
        );
        let (g, n) = (bm.shape()[2], bm.shape()[3]);
        let repeats = h / g;
        let bt = bm.transpose_axes(&[0, 2, 3, 1])?;
        let cb = matmul(cm.swap_axes(1, 2)?, &bt)?;
        let cb = repeat_axis::<f32>(cb, repeats, 1)?;
        let decay = exp(segsum(&dta.swap_axes(1, 2)?, mask)?)?;
        let surrogate = tril(cb.multiply(&decay)?, 0)?;
        let y = matmul(&surrogate, dtx.swap_axes(1, 2)?)?.swap_axes(1, 2)?;
        let decay = match lengths {
            Some(ls) => {
                let pos: Vec<i32> = ls.iter().map(|&v| (v.min(STEP) - 1).max(0)).collect();
                let pos =
                    Array::from_slice(&pos, &[pos.len() as i32]).expand_dims_axes(&[1, 2, 3])?;
                decay.take_along_axis(&pos, 2)?
            }
            None => decay.index((.., .., -1.., ..)),
        };
        let decay = decay.transpose_axes(&[0, 3, 1, 2])?;
        let br = repeat_axis::<f32>(bt, repeats, 1)?.swap_axes(2, 3)?;
        let dtxdecay = dtx.multiply(&decay)?.swap_axes(1, 2)?.swap_axes(2, 3)?;
        let mut next = matmul(&dtxdecay, &br)?;
        let mut y = y;
        if let Some(prev) = &state {
            let total = exp(cumsum(dta, -2, false, true)?)?;
            let last = total.index((.., -1, .., NewAxis, NewAxis));
            next = match crate::plant::is(crate::plant::Defect::SsmStateUndecayed) {
                true => next.add(prev)?,
                false => next.add(last.multiply(prev)?)?,
            };
            let c = cm.reshape(&[b, s, g, 1, n, 1])?;
            let y_prev =
                matmul(prev.reshape(&[b, 1, g, repeats, dh, n])?, &c)?.squeeze_axes(&[-1])?;
            let y_prev = flatten(&y_prev, 2, 3)?;
            y = y.add(total.index((Ellipsis, NewAxis)).multiply(&y_prev)?)?;
        }
        if let (Some(ls), Some(prev)) = (lengths, &state) {
            let gone: Vec<bool> = ls.iter().map(|&v| v < 0).collect();
            let gone =
                Array::from_slice(&gone, &[gone.len() as i32]).expand_dims_axes(&[1, 2, 3])?;
            next = select(&gone, prev, &next)?;
        }
        Ok((y.as_dtype(out_dtype)?, next))
    }
}

/// `segsum(x, mask)`: [.., s] → [.., s, s], entry (i, j) the sum of x over (j, i] (−inf
/// where the mask hides either end).
fn segsum(x: &Array, mask: Option<&Array>) -> R<Array> {
    let l = x.shape()[x.ndim() - 1];
    let x = match mask {
        Some(m) => x.multiply(m.expand_dims_axes(&[1])?)?,
        None => x.clone(),
    };
    let x = repeat_axis::<f32>(x.index((Ellipsis, NewAxis)), l, -1)?;
    let x = tril(&x, -1)?;
    let sums = cumsum(&x, -2, false, true)?;
    match mask {
        Some(m) => {
            let m = m.expand_dims_axes(&[1])?;
            let both = m
                .index((Ellipsis, NewAxis, ..))
                .multiply(m.index((Ellipsis, NewAxis)))?;
            let neg_inf = Array::from_f32(f32::NEG_INFINITY);
            select(&both, &sums, &neg_inf)
        }
        None => Ok(sums),
    }
}

fn compute_dt_graph(args: &[Array]) -> R<Vec<Array>> {
    let (dt, dt_bias, lo, hi) = (&args[0], &args[1], &args[2], &args[3]);
    let x = dt.as_dtype(Dtype::Float32)?.add(dt_bias)?;
    let softplus = mlx_rs::ops::logaddexp(&x, Array::from_int(0).as_dtype(x.dtype())?)?;
    Ok(vec![clip(&softplus, (lo, hi))?])
}

thread_local! {
    static COMPUTE_DT: RefCell<CompiledFn> = RefCell::new(compiled_shapeless(compute_dt_graph));
}

/// mlx-lm's compiled `compute_dt`: softplus(dt + dt_bias) in float32, clipped to the limits
/// (Python floats there: float32 scalars here).
fn compute_dt(dt: &Array, dt_bias: &Array, (lo, hi): (f32, f32)) -> R<Array> {
    let args = [
        dt.clone(),
        dt_bias.clone(),
        Array::from_f32(lo),
        Array::from_f32(hi),
    ];
    COMPUTE_DT.with_borrow_mut(|f| Ok(f(&args)?.remove(0)))
}
