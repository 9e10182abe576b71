//! `falcon_h1` (Falcon-H1) as mlx-lm 0.32.2 implements it: the pre-norm decoder where every
//! layer runs a Mamba-2 mixer and attention side by side on the same normed input:
//!
//!   each layer:  x = input_layernorm(h)
//!                h = (h + mamba(x)) + self_attn(x)        (summed in that order)
//!                h = h + feed_forward(pre_ff_layernorm(h))  (SwiGLU)
//!   logits = embed.as_linear(final_layernorm(h)) · (lm_head_multiplier / embedding_multiplier)
//!            (tied; untied: lm_head(final_layernorm(h)))
//!
//! The mixer is ssm.rs's (in_proj → gate, xBC, dt; silu(conv1d); the SSD scan with
//! dt clipped to (0, inf); y + x·D) with Falcon-H1's gate: `silu(gate) · y` when
//! `mamba_rms_norm` is off, else the gated RMSNorm over all channels (`n_groups` is stored
//! by mlx-lm's `FalconH1RMSNormGated` but unused), before or after the gate by
//! `mamba_norm_before_gate`. Attention is GQA with RoPE (`initialize_rope`), scale
//! head_dim^-½. Each layer's cache is mlx-lm's `CacheList(ArraysCache(2), KVCache())`; the
//! SSM reads the mask its own state makes (`create_ssm_mask`), attention the one the K/V
//! part makes (`create_attention_mask`).
//!
//! The µP multipliers are folded into the weights by mlx-lm's `sanitize`, which runs only on
//! Hugging Face's layout (layer 0's conv kernel [C, 1, K]): each `*.weight` by its name's
//! multiplier (a Python float: a weak scalar of the weight's dtype), in_proj's rows by
//! `ssm_in_multiplier · mup` (the mup vector in float32, cast to the weight's dtype, then
//! scaled), and the conv kernels moved to MLX's [C, K, 1]. A checkpoint already in MLX's
//! layout is taken as it is (multipliers already in it). `key_multiplier` is read but, as
//! in mlx-lm, never applied (its fold names a `key_proj` the model does not have).

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::{IndexOp, NewAxis};
use mlx_rs::Array;
use serde::Deserialize;

use super::decoder::{dims_of, Decoder, Mixer, NamedAttention, Names, Style};
use super::layers::{Attention, Glu, Linear, Mlp, Rope};
use super::shard::Part;
use super::ssm::{GatedNorm, Mamba2Mixer, SsmShape};
use crate::cache::{Cache, CacheList, Mask};
use crate::load::config::{ModelConfig, RopeScaling};
use crate::load::weights::Weights;
use crate::load::LoadError;
use crate::plant::{self, Defect};
use crate::scalar::weak;

type R<T> = Result<T, Exception>;

macro_rules! default_fn {
    ($name:ident: $t:ty = $v:expr) => {
        fn $name() -> $t {
            $v
        }
    };
}

default_fn!(attention_out: f64 = 0.9375);
default_fn!(embedding: f64 = 5.656854249492381);
default_fn!(head_dim: i32 = 64);
default_fn!(hidden: i32 = 1024);
default_fn!(intermediate: i32 = 2048);
default_fn!(key: f64 = 0.390625);
default_fn!(lm_head: f64 = 0.0390625);
default_fn!(one: f64 = 1.0);
default_fn!(yes: bool = true);
default_fn!(d_conv: i32 = 4);
default_fn!(d_head: i32 = 64);
default_fn!(d_ssm: i32 = 1536);
default_fn!(d_state: i32 = 128);
default_fn!(one_i: i32 = 1);
default_fn!(n_heads: i32 = 24);
default_fn!(max_positions: i32 = 131072);
default_fn!(mlp_multipliers: Vec<f64> = vec![0.8838834764831844, 0.5859375]);
default_fn!(attention_heads: i32 = 8);
default_fn!(layers: i32 = 36);
default_fn!(kv_heads: i32 = 2);
default_fn!(eps: f32 = 1e-5);
default_fn!(theta: f32 = 100_000_000_000.0);
default_fn!(ssm_in: f64 = 1.25);
default_fn!(ssm_multipliers: Vec<f64> = vec![
    0.3535533905932738,
    0.25,
    0.3535533905932738,
    0.5,
    0.3535533905932738,
]);
default_fn!(ssm_out: f64 = 0.23570226039551587);
default_fn!(vocab: i32 = 32784);

/// mlx-lm's `falcon_h1.ModelArgs`, with its defaults.
#[derive(Debug, Clone, Deserialize)]
pub struct FalconH1Args {
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default = "one")]
    pub attention_in_multiplier: f64,
    #[serde(default = "attention_out")]
    pub attention_out_multiplier: f64,
    #[serde(default = "embedding")]
    pub embedding_multiplier: f64,
    #[serde(default = "head_dim")]
    pub head_dim: i32,
    #[serde(default = "hidden")]
    pub hidden_size: i32,
    #[serde(default = "intermediate")]
    pub intermediate_size: i32,
    #[serde(default = "key")]
    pub key_multiplier: f64,
    #[serde(default = "lm_head")]
    pub lm_head_multiplier: f64,
    #[serde(default = "yes")]
    pub mamba_conv_bias: bool,
    #[serde(default = "d_conv")]
    pub mamba_d_conv: i32,
    #[serde(default = "d_head")]
    pub mamba_d_head: i32,
    #[serde(default = "d_ssm")]
    pub mamba_d_ssm: i32,
    #[serde(default = "d_state")]
    pub mamba_d_state: i32,
    #[serde(default = "one_i")]
    pub mamba_n_groups: i32,
    #[serde(default = "n_heads")]
    pub mamba_n_heads: i32,
    #[serde(default)]
    pub mamba_norm_before_gate: bool,
    #[serde(default)]
    pub mamba_proj_bias: bool,
    #[serde(default)]
    pub mamba_rms_norm: bool,
    #[serde(default = "max_positions")]
    pub max_position_embeddings: i32,
    #[serde(default)]
    pub mlp_bias: bool,
    #[serde(default = "mlp_multipliers")]
    pub mlp_multipliers: Vec<f64>,
    #[serde(default = "attention_heads")]
    pub num_attention_heads: i32,
    #[serde(default = "layers")]
    pub num_hidden_layers: i32,
    #[serde(default = "kv_heads")]
    pub num_key_value_heads: i32,
    #[serde(default)]
    pub projectors_bias: bool,
    #[serde(default = "eps")]
    pub rms_norm_eps: f32,
    #[serde(default)]
    pub rope_traditional: bool,
    pub rope_scaling: Option<RopeScaling>,
    #[serde(default = "theta")]
    pub rope_theta: f32,
    #[serde(default = "ssm_in")]
    pub ssm_in_multiplier: f64,
    #[serde(default = "ssm_multipliers")]
    pub ssm_multipliers: Vec<f64>,
    #[serde(default = "ssm_out")]
    pub ssm_out_multiplier: f64,
    #[serde(default = "vocab")]
    pub vocab_size: i32,
    #[serde(default = "yes")]
    pub tie_word_embeddings: bool,
}

impl FalconH1Args {
    fn check(&self) -> Result<(), LoadError> {
        let bad = |m: String| Err(LoadError::Unsupported(format!("falcon_h1: {m}")));
        if self.mamba_d_ssm != self.mamba_n_heads * self.mamba_d_head {
            return bad(format!(
                "mamba_d_ssm ({}) must be mamba_n_heads · mamba_d_head ({} · {})",
                self.mamba_d_ssm, self.mamba_n_heads, self.mamba_d_head
            ));
        }
        if self.ssm_multipliers.len() != 5 {
            return bad(format!(
                "ssm_multipliers has {} values (in_proj's five parts need 5)",
                self.ssm_multipliers.len()
            ));
        }
        if self.mlp_multipliers.len() != 2 {
            return bad(format!(
                "mlp_multipliers has {} values (gate and down need 2)",
                self.mlp_multipliers.len()
            ));
        }
        Ok(())
    }

    /// `compute_mup_vector`: one float32 multiplier per in_proj output (gate, x, B, C, dt).
    fn mup_vector(&self) -> Array {
        let gn = self.mamba_n_groups * self.mamba_d_state;
        let sizes = [
            self.mamba_d_ssm,
            self.mamba_d_ssm,
            gn,
            gn,
            self.mamba_n_heads,
        ];
        let values: Vec<f32> = sizes
            .iter()
            .zip(&self.ssm_multipliers)
            .flat_map(|(&s, &m)| std::iter::repeat_n(m as f32, s.max(0) as usize))
            .collect();
        Array::from_slice(&values, &[values.len() as i32])
    }

    fn ssm_shape(&self) -> SsmShape {
        SsmShape {
            hidden: self.hidden_size,
            heads: self.mamba_n_heads,
            head_dim: self.mamba_d_head,
            groups: self.mamba_n_groups,
            state: self.mamba_d_state,
            conv_kernel: self.mamba_d_conv,
            use_bias: self.mamba_proj_bias,
            out_bias: self.projectors_bias,
            use_conv_bias: self.mamba_conv_bias,
            eps: self.rms_norm_eps,
            limits: (0.0, f32::INFINITY),
            norm: match (self.mamba_rms_norm, self.mamba_norm_before_gate) {
                (false, _) => GatedNorm::Absent,
                (true, false) => GatedNorm::AfterGate,
                (true, true) => GatedNorm::BeforeGate,
            },
            cast_d: false,
            scan_lengths: true,
        }
    }
}

/// mlx-lm's `sanitize`, for `engine convert` (the multipliers folded as the loader folds
/// them).
pub(crate) fn convert_sanitize(config: &ModelConfig, w: &mut Weights) -> Result<(), LoadError> {
    sanitize(w, &config.parse()?)
}

/// mlx-lm's `sanitize`: on Hugging Face's layout only (layer 0's conv kernel longer than
/// it is wide), every multiplier folded into its weight and the conv kernels moved.
fn sanitize(w: &mut Weights, a: &FalconH1Args) -> Result<(), LoadError> {
    let hf = w
        .shape_of("model.layers.0.mamba.conv1d.weight")
        .is_some_and(|s| s.len() == 3 && s[2] > s[1]);
    if !hf {
        return Ok(());
    }
    let mup = a.mup_vector();
    w.transform(|n, p| {
        let by = |m: f64| p.multiply(weak(m, p)?).map(Some);
        if n.ends_with("embed_tokens.weight") {
            by(a.embedding_multiplier)
        } else if n.ends_with("lm_head.weight") {
            by(a.lm_head_multiplier)
        } else if n.ends_with("q_proj.weight") || n.ends_with("k_proj.weight") {
            by(a.attention_in_multiplier)
        } else if n.ends_with("key_proj.weight") {
            by(a.attention_in_multiplier * a.key_multiplier)
        } else if n.ends_with("o_proj.weight") {
            by(a.attention_out_multiplier)
        } else if n.ends_with("out_proj.weight") {
            by(a.ssm_out_multiplier)
        } else if n.ends_with("gate_proj.weight") {
            by(a.mlp_multipliers[0])
        } else if n.ends_with("down_proj.weight") {
            by(a.mlp_multipliers[1])
        } else if n.ends_with("in_proj.weight") {
            if plant::is(Defect::FalconInProjMupSkipped) {
                return by(a.ssm_in_multiplier);
            }
            let rows = mup.as_dtype(p.dtype())?.index((.., NewAxis));
            let scale = rows.multiply(weak(a.ssm_in_multiplier, &rows)?)?;
            p.multiply(&scale).map(Some)
        } else if n.contains("conv1d.weight") {
            p.transpose_axes(&[0, 2, 1]).map(Some)
        } else {
            Ok(None)
        }
    })
}

/// Falcon-H1's mixer: the Mamba-2 mixer and attention on the same input, each with its part
/// of the layer's `CacheList` [ArraysCache, K/V]; the decoder adds the SSM's output to the
/// residual stream first, then attention's.
pub struct Parallel {
    ssm: Mamba2Mixer,
    attn: NamedAttention,
}

impl Mixer for Parallel {
    /// Both branches summed (the decoder adds them one by one: `forward_branches`).
    fn forward(&self, x: &Array, mask: &Mask, cache: &mut dyn Cache) -> R<Array> {
        let b = self.forward_branches(x, mask, cache)?;
        b[0].add(&b[1])
    }

    /// [mamba(x), self_attn(x)]: the SSM under the mask its state makes, attention under the
    /// layer's (made by the list's K/V part); cache-less (a pass-through), the SSM unmasked.
    fn forward_branches(&self, x: &Array, mask: &Mask, cache: &mut dyn Cache) -> R<Vec<Array>> {
        match cache.sub_caches_mut() {
            Some([state, kv]) => {
                let ssm_mask = state.make_mask(x.shape()[1], None)?;
                let s = self.ssm.forward(x, &ssm_mask, state.as_mut())?;
                Ok(vec![s, self.attn.forward(x, mask, kv.as_mut())?])
            }
            Some(parts) => Err(Exception::custom(format!(
                "falcon_h1: a layer's cache list has {} parts (the SSM state and K/V expected)",
                parts.len()
            ))),
            None => {
                let s = self.ssm.forward(x, &Mask::None, cache)?;
                Ok(vec![s, self.attn.forward(x, mask, cache)?])
            }
        }
    }

    /// mlx-lm's `CacheList(ArraysCache(size=2), KVCache())`.
    fn make_cache(&self) -> Box<dyn Cache> {
        Box::new(CacheList::new(vec![
            self.ssm.make_cache(),
            self.attn.make_cache(),
        ]))
    }

    /// LoRA's targets, as mlx-lm's default keys take them: the SSM branch's `mamba.in_proj`
    /// and `mamba.out_proj` (not its conv1d), then attention's four projections. (Not
    /// `recurrent()`: the layer reads the attention mask; so the decoder's planted
    /// `RecurrentInProjLoraDropped` is applied here, to the SSM branch's in_proj.)
    fn linears(&self) -> Vec<(&'static str, &Linear)> {
        let planted = plant::is(Defect::RecurrentInProjLoraDropped);
        let mut all = self.ssm.linears();
        all.retain(|(n, _)| !(planted && n.contains(".in_proj")));
        all.extend(self.attn.linears());
        all
    }

    fn shard(&mut self, _part: Part, layer: &str) -> Result<(), LoadError> {
        Err(LoadError::Unsupported(format!(
            "{layer}: falcon_h1 is not split across ranks"
        )))
    }
}

pub fn load(config: &ModelConfig, mut w: Weights) -> Result<Decoder, LoadError> {
    let a: FalconH1Args = config.parse()?;
    a.check()?;
    sanitize(&mut w, &a)?;
    let ssm = a.ssm_shape();
    let dims = dims_of!(a, "feed_forward");
    let style = Style {
        names: Names {
            post: "pre_ff_layernorm",
            last: "model.final_layernorm",
            ..Names::default()
        },
        logits_multiplier: match a.tie_word_embeddings {
            true => Some(a.lm_head_multiplier / a.embedding_multiplier),
            false => None,
        },
        ..Style::default()
    };
    let (h, hd) = (a.hidden_size, a.head_dim);
    let (q_dims, kv_dims) = (a.num_attention_heads * hd, a.num_key_value_heads * hd);
    Decoder::load_styled(config, w, dims, style, |w, p, _| {
        let mamba = Mamba2Mixer::load(w, &format!("{p}.mamba"), "mamba", ssm)?;
        let lin = |w: &mut Weights, n: &str, out_in: [i32; 2]| {
            Linear::load(w, &format!("{p}.self_attn.{n}"), a.attention_bias, out_in)
        };
        let attn = Attention {
            q_proj: lin(w, "q_proj", [q_dims, h])?,
            k_proj: lin(w, "k_proj", [kv_dims, h])?,
            v_proj: lin(w, "v_proj", [kv_dims, h])?,
            o_proj: lin(w, "o_proj", [h, q_dims])?,
            q_norm: None,
            k_norm: None,
            n_heads: a.num_attention_heads,
            n_kv_heads: a.num_key_value_heads,
            scale: (hd as f32).powf(-0.5),
            norm_after_transpose: false,
            rope: Rope::init(
                hd,
                a.rope_theta,
                a.rope_traditional,
                a.rope_scaling.as_ref(),
                Some(a.max_position_embeddings),
            )?,
        };
        let names = attn.named_linears().map(|(n, _)| n);
        let mixer = Parallel {
            ssm: mamba,
            attn: NamedAttention {
                attn,
                names,
                family: "falcon_h1",
            },
        };
        let ffn = Mlp::load(
            w,
            &format!("{p}.feed_forward"),
            a.mlp_bias,
            h,
            a.intermediate_size,
            Glu::Swiglu,
        )?;
        Ok((Box::new(mixer) as Box<dyn Mixer>, Box::new(ffn)))
    })
}
