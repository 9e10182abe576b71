//! Rotary embeddings as mlx-lm 0.32.2's `rope_utils.initialize_rope` builds them, one kind per
//! `rope_scaling` / `rope_parameters` type:
//!
//!   default, linear   nn.RoPE(base, scale = 1 / factor)
//!   dynamic           DynamicNTKScalingRoPE: base grows with the sequence past max_position_embeddings
//!   llama3            Llama3RoPE: low / medium / high frequency bands
//!   yarn              YarnRoPE: ramped interpolation and an input scale (mscale)
//!   longrope          SuScaledRoPE: long_factor · base^(i/d) and an input scale
//!   proportional      ProportionalRoPE: a share of the dims rotates (Gemma 4)
//!
//! Python floats are kept in f64 where mlx-lm keeps them in Python, and become f32 (or the
//! activation's dtype) only where they meet an array, as MLX's scalars do.

use crate::cache::attention_views;
use mlx_rs::error::Exception;
use mlx_rs::fast;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::ops::{arange, clip, concatenate, full, select};
use mlx_rs::Array;

use crate::cache::{AttentionCache, Cache, RopeOffset};
use crate::load::config::{RopeParameters, RopeScaling};
use crate::load::LoadError;
use crate::scalar::weak;

type R<T> = Result<T, Exception>;

/// The kinds `Rope::init` builds, as listed in its refusal.
pub const KINDS: &str =
    "default, linear, dynamic, llama3, yarn, deepseek_yarn, telechat3-yarn, longrope, su, proportional, mrope";

/// One attention layer's rotary embedding.
pub enum Rope {
    /// `nn.RoPE` (types "default" and "linear").
    Standard {
        dims: i32,
        traditional: bool,
        base: f32,
        scale: f32,
    },
    /// Precomputed frequencies (llama3, yarn, longrope, proportional); yarn and longrope also
    /// scale the rotated dims of the input first (`x.at[..., :dims].multiply(s)`).
    Freqs {
        dims: i32,
        traditional: bool,
        freqs: Array,
        input_scale: Option<f64>,
    },
    /// `DynamicNTKScalingRoPE`: the base is recomputed at each call from the sequence length.
    Dynamic {
        dims: i32,
        traditional: bool,
        base: f64,
        factor: f64,
        max_positions: i32,
    },
    /// No rotation: mlx-lm's `NoPE` (`x` as it is), for the layers of a family that attend
    /// without positions (SmolLM 3's every fourth layer).
    None,
}

fn need<T>(v: Option<T>, kind: &str, field: &str) -> Result<T, LoadError> {
    v.ok_or_else(|| LoadError::Unsupported(format!("rope_scaling type `{kind}` needs `{field}`")))
}

impl Rope {
    /// `initialize_rope(dims, base, traditional, scaling)` without max_position_embeddings
    /// (the families whose kinds never read it).
    pub fn new(
        dims: i32,
        base: f32,
        traditional: bool,
        scaling: Option<&RopeScaling>,
    ) -> Result<Self, LoadError> {
        Self::init(dims, base, traditional, scaling, None)
    }

    /// mlx-lm's `initialize_rope(dims, base, traditional, scaling_config,
    /// max_position_embeddings)`.
    pub fn init(
        dims: i32,
        base: f32,
        traditional: bool,
        scaling: Option<&RopeScaling>,
        max_positions: Option<i32>,
    ) -> Result<Self, LoadError> {
        let Some(s) = scaling else {
            return Ok(Rope::Standard {
                dims,
                traditional,
                base,
                scale: 1.0,
            });
        };
        let kind = s.variant();
        let factor = || need(s.factor, kind, "factor");
        Ok(match kind {
            "default" => Rope::Standard {
                dims,
                traditional,
                base,
                scale: 1.0,
            },
            "linear" => Rope::Standard {
                dims,
                traditional,
                base,
                scale: (1.0 / factor()?) as f32,
            },
            "dynamic" => Rope::Dynamic {
                dims,
                traditional,
                base: base as f64,
                factor: factor()?,
                max_positions: need(max_positions, kind, "max_position_embeddings")?,
            },
            "llama3" => Rope::Freqs {
                dims,
                traditional,
                freqs: llama3_freqs(dims, base, s, factor()?)?,
                input_scale: None,
            },
            "yarn" | "deepseek_yarn" | "telechat3-yarn" => {
                yarn(dims, traditional, base, s, factor()?)?
            }
            "longrope" | "su" => {
                let orig = need(
                    s.original_max_position_embeddings,
                    kind,
                    "original_max_position_embeddings",
                )?;
                let max = need(max_positions, kind, "max_position_embeddings")?;
                su_scaled(dims, base, s, max as f64, orig)?
            }
            "mrope" => match s.mrope_section.as_deref().map(<[i64]>::len) {
                Some(3) => Rope::Standard {
                    dims,
                    traditional,
                    base,
                    scale: 1.0,
                },
                n => {
                    return Err(LoadError::Unsupported(format!(
                        "mrope needs 3 sections in mrope_section, got {}",
                        n.unwrap_or(0)
                    )))
                }
            },
            "proportional" => Rope::Freqs {
                dims,
                traditional,
                freqs: proportional_freqs(dims, base, s)?,
                input_scale: None,
            },
            other => {
                return Err(LoadError::Unsupported(format!(
                    "rope_scaling type `{other}` is not supported (supported: {KINDS})"
                )))
            }
        })
    }

    pub fn forward(&self, x: &Array, offset: &RopeOffset) -> R<Array> {
        match self {
            Rope::None => Ok(x.clone()),
            Rope::Standard {
                dims,
                traditional,
                base,
                scale,
            } => apply(x, *dims, *traditional, Some(*base), *scale, offset, None),
            Rope::Freqs {
                dims,
                traditional,
                freqs,
                input_scale,
            } => {
                let x = match input_scale {
                    Some(s) => scale_leading(x, *dims, *s)?,
                    None => x.clone(),
                };
                apply(&x, *dims, *traditional, None, 1.0, offset, Some(freqs))
            }
            Rope::Dynamic {
                dims,
                traditional,
                base,
                factor,
                max_positions,
            } => {
                let RopeOffset::Int(o) = offset else {
                    return Err(Exception::custom(
                        "dynamic RoPE needs one offset for the whole batch (as mlx-lm's DynamicNTKScalingRoPE)",
                    ));
                };
                let len = x.shape()[x.ndim() - 2];
                let base = dynamic_base(*dims, *base, *factor, *max_positions, len + o);
                apply(x, *dims, *traditional, Some(base as f32), 1.0, offset, None)
            }
        }
    }
}

fn apply(
    x: &Array,
    dims: i32,
    traditional: bool,
    base: Option<f32>,
    scale: f32,
    offset: &RopeOffset,
    freqs: Option<&Array>,
) -> R<Array> {
    match offset {
        RopeOffset::Int(o) => fast::rope(x, dims, traditional, base, scale, *o, freqs),
        RopeOffset::Array(o) => fast::rope_dynamic(x, dims, traditional, base, scale, o, freqs),
    }
}

/// `DynamicNTKScalingRoPE`'s base for a sequence ending at `end` (Python floats).
fn dynamic_base(dims: i32, base: f64, factor: f64, max_positions: i32, end: i32) -> f64 {
    let seq_len = end.max(max_positions) as f64;
    let grown = factor * seq_len / max_positions as f64 - (factor - 1.0);
    base * grown.powf(dims as f64 / (dims - 2) as f64)
}

/// `x.at[..., :dims].multiply(s)`: the rotated dims times `s` in x's dtype, the rest as is.
fn scale_leading(x: &Array, dims: i32, s: f64) -> R<Array> {
    let width = x.shape()[x.ndim() - 1];
    let s = weak(s, x)?;
    if width == dims {
        return x.multiply(&s);
    }
    let head = x.index((.., .., .., ..dims)).multiply(&s)?;
    concatenate(&[head, x.index((.., .., .., dims..))], -1)
}

/// `base ** (arange(0, dims, 2, float32) / dims)`.
fn inv_freqs(dims: i32, base: f32) -> R<Array> {
    Array::from_f32(base).power(arange::<_, f32>(0, dims, 2)?.divide(Array::from_f32(dims as f32))?)
}

/// mlx-lm's `Llama3RoPE` frequencies, op for op.
fn llama3_freqs(dims: i32, base: f32, s: &RopeScaling, factor: f64) -> Result<Array, LoadError> {
    let low = s.low_freq_factor.unwrap_or(1.0);
    let high = s.high_freq_factor.unwrap_or(4.0);
    let old_context = s.original_max_position_embeddings.unwrap_or(8192.0);
    let low_wavelen = old_context / low;
    let high_wavelen = old_context / high;
    let f = |v: f64| Array::from_f32(v as f32);
    let freqs = Array::from_f32(base)
        .power(arange::<_, i32>(0, dims, 2)?.divide(Array::from_int(dims))?)?;
    let wavelens = f(2.0 * std::f64::consts::PI).multiply(&freqs)?;
    let freqs = select(
        &wavelens.gt(f(low_wavelen))?,
        freqs.multiply(f(factor))?,
        &freqs,
    )?;
    let medium = wavelens
        .gt(f(high_wavelen))?
        .logical_and(wavelens.lt(f(low_wavelen))?)?;
    let smooth = f(old_context)
        .divide(&wavelens)?
        .subtract(f(low))?
        .divide(f(high - low))?;
    let smooth_freqs = freqs.divide(f(1.0).subtract(&smooth)?.divide(f(factor))?.add(&smooth)?)?;
    Ok(select(&medium, smooth_freqs, freqs)?)
}

/// mlx-lm's `YarnRoPE`: the ramped blend of interpolated and extrapolated frequencies and
/// the `mscale / mscale_all_dim` input scale.
fn yarn(
    dims: i32,
    traditional: bool,
    base: f32,
    s: &RopeScaling,
    factor: f64,
) -> Result<Rope, LoadError> {
    let orig = s.original_max_position_embeddings.unwrap_or(4096.0);
    let beta_fast = s.beta_fast.unwrap_or(32.0);
    let beta_slow = s.beta_slow.unwrap_or(1.0);
    let b = base as f64;
    let correction_dim = |rotations: f64| {
        (dims as f64 * (orig / (rotations * 2.0 * std::f64::consts::PI)).ln()) / (2.0 * b.ln())
    };
    let low = (correction_dim(beta_fast).floor() as i64).max(0);
    let high = (correction_dim(beta_slow).ceil() as i64).min(dims as i64 - 1);
    let get_mscale = |scale: f64, m: f64| {
        if scale <= 1.0 {
            1.0
        } else {
            0.1 * m * scale.ln() + 1.0
        }
    };
    let mscale = get_mscale(factor, s.mscale.unwrap_or(1.0))
        / get_mscale(factor, s.mscale_all_dim.unwrap_or(0.0));
    let f = |v: f64| Array::from_f32(v as f32);
    let extra = inv_freqs(dims, base)?;
    let inter = f(factor).multiply(&extra)?;
    let span = if low == high {
        high as f64 + 0.001 - low as f64
    } else {
        (high - low) as f64
    };
    let ramp = clip(
        arange::<_, f32>(0, dims / 2, 1)?
            .subtract(f(low as f64))?
            .divide(f(span))?,
        (f(0.0), f(1.0)),
    )?;
    let mask = f(1.0).subtract(&ramp)?;
    let freqs = inter.multiply(&extra)?.divide(
        inter
            .multiply(&mask)?
            .add(extra.multiply(f(1.0).subtract(&mask)?)?)?,
    )?;
    Ok(Rope::Freqs {
        dims,
        traditional,
        freqs,
        input_scale: (mscale != 1.0).then_some(mscale),
    })
}

/// mlx-lm's `SuScaledRoPE` (longrope): `long_factor · base^(i/d)` — mlx-lm uses the long
/// factors at every length — and `sqrt(1 + ln(max/orig) / ln(orig))` on the input when the
/// context was extended. Never traditional.
pub fn su_scaled(
    dims: i32,
    base: f32,
    s: &RopeScaling,
    max: f64,
    orig: f64,
) -> Result<Rope, LoadError> {
    let long = need(s.long_factor.as_ref(), "longrope", "long_factor")?;
    let long = Array::from_slice(&long.values(), &[long.len()]);
    if long.shape()[0] != 1 && long.shape()[0] != dims / 2 {
        return Err(LoadError::Unsupported(format!(
            "longrope long_factor has {} values, the rotated dims need {}",
            long.shape()[0],
            dims / 2
        )));
    }
    let freqs = long.multiply(inv_freqs(dims, base)?)?;
    let factor = max / orig;
    let scale = if factor <= 1.0 {
        1.0
    } else {
        (1.0 + factor.ln() / orig.ln()).sqrt()
    };
    Ok(Rope::Freqs {
        dims,
        traditional: false,
        freqs,
        input_scale: Some(scale),
    })
}

/// mlx-lm's `ProportionalRoPE` frequencies: the first `dims · partial_rotary_factor` dims
/// rotate with `factor · base^(i/dims)`, the rest get an infinite period (they stay put).
fn proportional_freqs(dims: i32, base: f32, s: &RopeScaling) -> Result<Array, LoadError> {
    let rotated = (dims as f64 * s.partial_rotary_factor.unwrap_or(1.0)) as i32;
    if rotated > dims {
        return Err(LoadError::Unsupported(format!(
            "partial_rotary_factor {:?} rotates more than the head's {dims} dims",
            s.partial_rotary_factor
        )));
    }
    let exponents = arange::<_, f32>(0, rotated, 2)?.divide(Array::from_f32(dims as f32))?;
    let rotating = Array::from_f32(s.factor.unwrap_or(1.0) as f32)
        .multiply(Array::from_f32(base).power(&exponents)?)?;
    let still = full::<f32>(&[(dims - rotated) / 2], Array::from_f32(f32::INFINITY))?;
    Ok(concatenate(&[rotating, still], 0)?)
}

/// A family's RoPE settings for layers of `kind`: the top level's `rope_theta` and
/// `rope_scaling` as mlx-lm reads them; each one missing there comes from transformers 5's
/// `rope_parameters` (as transformers reads it), and only then from the family's default
/// theta.
pub fn settings(
    theta: Option<f32>,
    scaling: Option<&RopeScaling>,
    params: Option<&RopeParameters>,
    kind: &str,
    default_theta: f32,
) -> (f32, Option<RopeScaling>) {
    let nested = params.and_then(|p| p.for_layer(kind));
    let theta = theta
        .or(nested.and_then(|p| p.rope_theta))
        .unwrap_or(default_theta);
    (theta, scaling.or(nested).cloned())
}

/// The cache of a layer whose RoPE reads the sequence length as a Python int (dynamic NTK):
/// a standard cache under another type, so that the paths which pass positions as arrays
/// (the compiled decode step, the batch lane) and the kv-store (no snapshot) leave it alone,
/// as they leave any cache that is not a plain `KvCache`.
pub struct IntOffsetKv(pub crate::cache::KvCache);

impl Cache for IntOffsetKv {
    fn offset(&self) -> i32 {
        self.0.offset()
    }
    fn is_trimmable(&self) -> bool {
        self.0.is_trimmable()
    }
    fn trim(&mut self, n: i32) -> i32 {
        self.0.trim(n)
    }
    fn state(&self) -> Vec<&Array> {
        self.0.state()
    }
    fn make_mask(&self, n: i32, window: Option<i32>) -> R<crate::cache::Mask> {
        self.0.make_mask(n, window)
    }

    attention_views!();
}

impl AttentionCache for IntOffsetKv {
    fn update_and_fetch(&mut self, keys: Array, values: Array) -> R<crate::cache::Kv> {
        self.0.update_and_fetch(keys, values)
    }

    fn quantize(&mut self, quant: crate::cache::KvQuant) -> R<bool> {
        self.0.quantize(quant)
    }

    fn kv_quant(&self) -> Option<crate::cache::KvQuant> {
        self.0.kv_quant()
    }
}

impl Rope {
    /// Whether positions must reach this RoPE as an int (see [`IntOffsetKv`]).
    pub fn needs_int_offset(&self) -> bool {
        matches!(self, Rope::Dynamic { .. })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kind(k: &str) -> RopeScaling {
        RopeScaling {
            rope_type: Some(k.into()),
            factor: Some(2.0),
            ..Default::default()
        }
    }

    fn refusal(r: Result<Rope, LoadError>) -> String {
        r.err().expect("must be refused").to_string()
    }

    #[test]
    fn unknown_kinds_and_missing_fields_are_refused_by_name() {
        let e = refusal(Rope::new(16, 1e4, false, Some(&kind("ntk-by-parts"))));
        assert!(e.contains("rope_scaling type `ntk-by-parts` is not supported (supported: default, linear, dynamic"), "{e}");
        let e = refusal(Rope::new(16, 1e4, false, Some(&kind("dynamic"))));
        assert!(
            e.contains("rope_scaling type `dynamic` needs `max_position_embeddings`"),
            "{e}"
        );
        let e = refusal(Rope::init(
            16,
            1e4,
            false,
            Some(&kind("longrope")),
            Some(64),
        ));
        assert!(
            e.contains("needs `original_max_position_embeddings`"),
            "{e}"
        );
        let e = refusal(Rope::new(16, 1e4, false, Some(&kind("mrope"))));
        assert!(e.contains("mrope needs 3 sections"), "{e}");
        let linear = RopeScaling {
            factor: None,
            ..kind("linear")
        };
        let e = refusal(Rope::new(16, 1e4, false, Some(&linear)));
        assert!(
            e.contains("rope_scaling type `linear` needs `factor`"),
            "{e}"
        );
    }

    #[test]
    fn every_kind_builds() {
        for k in ["default", "linear", "llama3", "yarn", "proportional"] {
            Rope::new(16, 1e4, false, Some(&kind(k))).unwrap();
        }
        let mut su = kind("su");
        su.original_max_position_embeddings = Some(32.0);
        su.long_factor = Some(crate::load::config::Factors::Many(vec![1.0; 8]));
        assert!(matches!(
            Rope::init(16, 1e4, false, Some(&su), Some(256)).unwrap(),
            Rope::Freqs { input_scale: Some(s), .. } if s > 1.0
        ));
        let dynamic = Rope::init(16, 1e4, false, Some(&kind("dynamic")), Some(32)).unwrap();
        assert!(dynamic.needs_int_offset());
    }

    /// The base DynamicNTKScalingRoPE computes: unchanged up to max_position_embeddings,
    /// then `base · (factor·len/max − (factor−1))^(d/(d−2))`.
    #[test]
    fn dynamic_base_grows_past_the_window() {
        assert_eq!(dynamic_base(16, 1e4, 2.0, 32, 20), 1e4);
        assert_eq!(dynamic_base(16, 1e4, 2.0, 32, 32), 1e4);
        let grown = 1e4 * (2.0f64 * 64.0 / 32.0 - 1.0).powf(16.0 / 14.0);
        assert_eq!(dynamic_base(16, 1e4, 2.0, 32, 64), grown);
    }

    /// rope_parameters fills only what the top level lacks; per layer type when split.
    #[test]
    fn settings_prefer_the_top_level_then_rope_parameters() {
        let nested = RopeScaling {
            rope_theta: Some(5e4),
            ..kind("yarn")
        };
        let flat = RopeParameters::One(Box::new(nested.clone()));
        let (theta, s) = settings(None, None, Some(&flat), "full_attention", 1e4);
        assert_eq!(
            (theta, s.unwrap().variant().to_owned()),
            (5e4, "yarn".into())
        );
        let top = kind("linear");
        let (theta, s) = settings(Some(2e4), Some(&top), Some(&flat), "full_attention", 1e4);
        assert_eq!(
            (theta, s.unwrap().variant().to_owned()),
            (2e4, "linear".into())
        );
        let split = RopeParameters::PerLayer([("sliding_attention".to_owned(), nested)].into());
        let (theta, s) = settings(None, None, Some(&split), "full_attention", 1e4);
        assert_eq!((theta, s.is_none()), (1e4, true));
        let (theta, _) = settings(None, None, Some(&split), "sliding_attention", 1e4);
        assert_eq!(theta, 5e4);
    }
}
