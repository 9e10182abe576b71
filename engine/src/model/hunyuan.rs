//! Hunyuan dense (`hunyuan_v1_dense`) as mlx-lm 0.32.2's `models/hunyuan_v1_dense.py`
//! computes it: Llama's pre-norm layers (SwiGLU MLP) on the shared decoder, with its own
//! attention:
//!
//!   q, k, v = heads(q_proj(x)), heads(k_proj(x)), heads(v_proj(x))
//!   q, k = rope(q), rope(k)                            (DynamicNTKAlphaRoPE, below)
//!   q, k = query_layernorm(q), key_layernorm(k)        (per head, after RoPE: `use_qk_norm`)
//!   out = o_proj(sdpa(q, cache(k, v), head_dim^-½))
//!
//! The RoPE's frequencies are fixed at load: base' = rope_theta · α^(d / (d − 2)) with
//! α = `rope_scaling.alpha` (1 without), freqs = base' ^ (arange(0, d, 2) / d).

use mlx_rs::error::Exception;
use mlx_rs::ops::arange;
use mlx_rs::Array;
use serde::Deserialize;

use super::decoder::{kv_cache, Decoder, Dims, Mixer};
use super::layers::{Attention, Glu, Linear, Mlp, RmsNorm, Rope};
use super::shard::Part;
use crate::cache::{kv_of, Cache, Mask};
use crate::load::config::ModelConfig;
use crate::load::weights::Weights;
use crate::load::LoadError;

fn theta() -> f64 {
    10_000.0
}
fn yes() -> bool {
    true
}

/// mlx-lm's `hunyuan_v1_dense.ModelArgs`.
#[derive(Debug, Clone, Deserialize)]
pub struct HunyuanArgs {
    pub vocab_size: i32,
    pub hidden_size: i32,
    pub num_hidden_layers: i32,
    pub intermediate_size: i32,
    pub num_attention_heads: i32,
    pub num_key_value_heads: i32,
    pub rms_norm_eps: f32,
    #[serde(default = "theta")]
    pub rope_theta: f64,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default = "yes")]
    pub use_qk_norm: bool,
    /// Only `alpha` is read; `__post_init__` requires `alpha`, `factor` and `type`.
    pub rope_scaling: Option<serde_json::Map<String, serde_json::Value>>,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    pub head_dim: Option<i32>,
}

/// Attention with its q/k norms after RoPE.
pub struct HunyuanAttention {
    attn: Attention,
    query_layernorm: Option<RmsNorm>,
    key_layernorm: Option<RmsNorm>,
    head_dim: i32,
}

impl Mixer for HunyuanAttention {
    fn forward(&self, x: &Array, mask: &Mask, cache: &mut dyn Cache) -> Result<Array, Exception> {
        let a = &self.attn;
        let (b, l) = (x.shape()[0], x.shape()[1]);
        let heads = |t: Array, n: i32| {
            t.reshape(&[b, l, n, self.head_dim])?
                .transpose_axes(&[0, 2, 1, 3])
        };
        let q = heads(a.q_proj.forward(x)?, a.n_heads)?;
        let k = heads(a.k_proj.forward(x)?, a.n_kv_heads)?;
        let v = heads(a.v_proj.forward(x)?, a.n_kv_heads)?;
        let cache = kv_of(cache)?;
        let offset = cache.rope_offset();
        let (mut q, mut k) = (a.rope.forward(&q, &offset)?, a.rope.forward(&k, &offset)?);
        if let (Some(qn), Some(kn)) = (&self.query_layernorm, &self.key_layernorm) {
            (q, k) = (qn.forward(&q)?, kn.forward(&k)?);
        }
        let kv = cache.update_and_fetch(k, v)?;
        let out = super::sdpa::attend(&q, &kv, a.scale, mask)?;
        let out = out.transpose_axes(&[0, 2, 1, 3])?.reshape(&[b, l, -1])?;
        a.o_proj.forward(&out)
    }

    fn make_cache(&self) -> Box<dyn Cache> {
        kv_cache(&self.attn.rope)
    }

    fn linears(&self) -> Vec<(&'static str, &Linear)> {
        self.attn.named_linears().into()
    }

    fn shard(&mut self, _part: Part, layer: &str) -> Result<(), LoadError> {
        Err(LoadError::Unsupported(format!(
            "{layer}: hunyuan_v1_dense is not split across ranks"
        )))
    }
}

/// The model: Llama's decoder with Hunyuan's attention; a tied head drops `lm_head`.
pub fn load(config: &ModelConfig, mut w: Weights) -> Result<Decoder, LoadError> {
    let a: HunyuanArgs = config.parse()?;
    let alpha = alpha(&a)?;
    // mlx-lm's sanitize.
    if a.tie_word_embeddings {
        w.discard(|n| n == "lm_head.weight");
    }
    let dims = Dims {
        layers: a.num_hidden_layers,
        hidden: a.hidden_size,
        vocab: a.vocab_size,
        rms_norm_eps: a.rms_norm_eps,
        tie_word_embeddings: a.tie_word_embeddings,
        ffn_module: "mlp",
    };
    Decoder::load(config, w, dims, |w, p, _| {
        let mixer: Box<dyn Mixer> = Box::new(attention(&a, alpha, w, p)?);
        let (h, inter) = (a.hidden_size, a.intermediate_size);
        let mlp = Mlp::load(w, &format!("{p}.mlp"), false, h, inter, Glu::Swiglu)?;
        Ok((mixer, Box::new(mlp)))
    })
}

/// `rope_scaling["alpha"]` (1 without a scaling); a scaling needs alpha, factor and type.
fn alpha(a: &HunyuanArgs) -> Result<f64, LoadError> {
    let Some(s) = a.rope_scaling.as_ref().filter(|s| !s.is_empty()) else {
        return Ok(1.0);
    };
    if !["alpha", "factor", "type"]
        .iter()
        .all(|k| s.contains_key(*k))
    {
        return Err(LoadError::Unsupported(
            "hunyuan_v1_dense: rope_scaling must contain keys alpha, factor and type".into(),
        ));
    }
    s["alpha"].as_f64().ok_or_else(|| {
        LoadError::Unsupported("hunyuan_v1_dense: rope_scaling.alpha is not a number".into())
    })
}

/// One layer's attention: biases on all four projections where `attention_bias`, the
/// q/k norms where `use_qk_norm`, DynamicNTKAlphaRoPE.
fn attention(
    a: &HunyuanArgs,
    alpha: f64,
    w: &mut Weights,
    p: &str,
) -> Result<HunyuanAttention, LoadError> {
    let h = a.hidden_size;
    let hd = a.head_dim.unwrap_or(h / a.num_attention_heads);
    let norm = |w: &mut Weights, name: &str| {
        let prefix = format!("{p}.self_attn.{name}");
        (a.use_qk_norm)
            .then(|| RmsNorm::load(w, &prefix, hd, a.rms_norm_eps))
            .transpose()
    };
    let attn = Attention {
        rope: alpha_rope(hd, a.rope_theta, alpha).map_err(|e| {
            LoadError::Unsupported(format!("hunyuan_v1_dense RoPE frequencies: {e}"))
        })?,
        norm_after_transpose: true,
        ..Attention::load_projections(
            w,
            &format!("{p}.self_attn"),
            a.attention_bias,
            h,
            a.num_attention_heads,
            a.num_key_value_heads,
            hd,
        )?
    };
    Ok(HunyuanAttention {
        query_layernorm: norm(w, "query_layernorm")?,
        key_layernorm: norm(w, "key_layernorm")?,
        attn,
        head_dim: hd,
    })
}

/// `DynamicNTKAlphaRoPE`: the base scaled in double precision (Python), then
/// `base ** (arange(0, d, 2) / d)` in float32 (int32 range divided by an int).
fn alpha_rope(dims: i32, theta: f64, alpha: f64) -> Result<Rope, Exception> {
    let base = theta * alpha.powf(dims as f64 / (dims - 2) as f64);
    let exponents = arange::<_, i32>(0, dims, 2)?.divide(Array::from_int(dims))?;
    let freqs = Array::from_f32(base as f32).power(&exponents)?;
    Ok(Rope::Freqs {
        dims,
        traditional: false,
        freqs,
        input_scale: None,
    })
}
