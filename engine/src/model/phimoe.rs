//! `phimoe` as mlx-lm 0.32.2 implements it (Phi-3.5-MoE, Phi-mini-MoE; `phimoe.py`):
//!
//!   norms = `nn.LayerNorm` (weight and bias, eps `rms_norm_eps`) before attention, before
//!           the experts and at the end
//!   attn  = GQA with q/k/v/o biases, head_dim = hidden / heads; `SuScaledRoPE` from
//!           `rope_scaling` (long factors, input scale `long_mscale` or the default), plain
//!           `nn.RoPE` when it is null
//!   block_sparse_moe = SwitchGLU experts weighed by HF's inference-time sparsemixer:
//!           k times: the best remaining expert, and its weight = softmax (precise) over the
//!           experts whose (top − g) / max(|g|, top) ≤ 2·jitter_eps (the others −inf), read at
//!           it; then that expert masked to −inf for the next round
//!   logits = lm_head(layer_norm(h)) with its bias
//!
//! mlx-lm's `sanitize`: per-expert `w1` / `w3` / `w2` (weights, and scales / biases when
//! quantized) stacked into `switch_mlp`'s gate / up / down.

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::argmax_axis;
use mlx_rs::ops::{abs, concatenate, maximum, select, softmax_axis};
use mlx_rs::Array;
use serde::Deserialize;

use super::decoder::{Decoder, Dims, FeedForward, Mixer, Style};
use super::layers::{Linear, RmsNorm};
use super::moe::{combine, SwitchGlu, SwitchLinear, MIXTRAL_EXPERT_NAMES};
use super::moe_family::{check_top_k, load_attention, AttnShape};
use super::rope::su_scaled;
use super::shard::Part;
use crate::load::config::{ModelConfig, RopeScaling};
use crate::load::weights::Weights;
use crate::load::LoadError;

type R<T> = Result<T, Exception>;

/// mlx-lm's `phimoe.ModelArgs`, with its defaults.
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct PhiMoeArgs {
    pub vocab_size: i32,
    pub hidden_size: i32,
    pub intermediate_size: i32,
    pub num_hidden_layers: i32,
    pub num_attention_heads: i32,
    pub num_key_value_heads: i32,
    pub max_position_embeddings: i32,
    pub original_max_position_embeddings: i32,
    pub rms_norm_eps: f32,
    pub rope_scaling: Option<serde_json::Value>,
    pub num_local_experts: i32,
    pub num_experts_per_tok: i32,
    pub rope_theta: f32,
    pub router_jitter_noise: f64,
}

impl Default for PhiMoeArgs {
    fn default() -> Self {
        PhiMoeArgs {
            vocab_size: 32064,
            hidden_size: 4096,
            intermediate_size: 6400,
            num_hidden_layers: 32,
            num_attention_heads: 32,
            num_key_value_heads: 8,
            max_position_embeddings: 131072,
            original_max_position_embeddings: 4096,
            rms_norm_eps: 1e-6,
            rope_scaling: None,
            num_local_experts: 16,
            num_experts_per_tok: 2,
            rope_theta: 10000.0,
            router_jitter_noise: 0.01,
        }
    }
}

/// `sparsemixer(gates, top_k, jitter_eps)` (see the module header): (indices, weights),
/// both [..., k], the weights in the gates' dtype.
fn sparsemixer(gates: &Array, top_k: i32, jitter_eps: f64) -> R<(Array, Array)> {
    let neg_inf = Array::from_f32(f32::NEG_INFINITY).as_dtype(gates.dtype())?;
    let threshold = crate::scalar::weak(2.0 * jitter_eps, gates)?;
    let mut masked = gates.clone();
    let (mut inds, mut scores) = (Vec::new(), Vec::new());
    for _ in 0..top_k {
        let top = masked.max_axis(-1, true)?;
        let ind = mlx_rs::stop_gradient(&argmax_axis(&masked, -1, true)?)?;
        let factor = maximum(abs(gates)?, &top)?;
        let far = top.subtract(gates)?.divide(&factor)?.gt(&threshold)?;
        let band = select(&far, &neg_inf, &masked)?;
        let band = softmax_axis(&band, -1, true)?;
        scores.push(band.take_along_axis(&ind, -1)?);
        masked = masked.put_along_axis(&ind, &neg_inf, -1)?;
        inds.push(ind);
    }
    Ok((concatenate(&inds, -1)?, concatenate(&scores, -1)?))
}

/// `PhiMoESparseMoeBlock`: the router `gate`, sparsemixer, SwitchGLU experts.
struct SparseMixerMoe {
    gate: Linear,
    top_k: i32,
    jitter_eps: f64,
    experts: SwitchGlu,
}

impl FeedForward for SparseMixerMoe {
    fn forward(&self, x: &Array) -> R<Array> {
        let gates = self.gate.forward(x)?;
        let (inds, scores) = sparsemixer(&gates, self.top_k, self.jitter_eps)?;
        // `(y * scores[..., None]).sum(-2)`: y and the weights share x's dtype, so the
        // cast `combine` ends with changes nothing.
        combine(&self.experts.forward(x, &inds)?, &scores)
    }

    fn linears(&self, module: &str) -> Vec<(String, &Linear)> {
        vec![(format!("{module}.gate"), &self.gate)]
    }

    fn switches(&self, module: &str) -> Vec<(String, &SwitchLinear)> {
        self.experts.named(&format!("{module}.switch_mlp"))
    }

    fn shard(&mut self, _part: Part, prefix: &str) -> Result<(), LoadError> {
        Err(LoadError::Unsupported(format!(
            "phimoe ({prefix}): mlx-lm 0.32.2 does not shard it"
        )))
    }
}

/// The attention's RoPE: plain when `rope_scaling` is null, else mlx-lm's `SuScaledRoPE`
/// with `long_mscale` (when set and non-zero) as the input scale.
fn rope(a: &PhiMoeArgs, head_dim: i32) -> Result<Option<super::layers::Rope>, LoadError> {
    let Some(v) = a.rope_scaling.as_ref().filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let s: RopeScaling = serde_json::from_value(v.clone())
        .map_err(|e| LoadError::Unsupported(format!("phimoe rope_scaling {v}: {e}")))?;
    let mut rope = su_scaled(
        head_dim,
        a.rope_theta,
        &s,
        a.max_position_embeddings as f64,
        a.original_max_position_embeddings as f64,
    )?;
    let long_mscale = v.get("long_mscale").and_then(|m| m.as_f64());
    if let (Some(m), super::layers::Rope::Freqs { input_scale, .. }) =
        (long_mscale.filter(|m| *m != 0.0), &mut rope)
    {
        *input_scale = Some(m);
    }
    Ok(Some(rope))
}

pub fn load(config: &ModelConfig, w: Weights) -> Result<Decoder, LoadError> {
    let a: PhiMoeArgs = config.parse()?;
    check_top_k(
        "phimoe",
        a.num_experts_per_tok,
        a.num_local_experts,
        "num_local_experts",
    )?;
    let head_dim = a.hidden_size / a.num_attention_heads;
    // Refused before any weight is read; each layer builds its own below.
    rope(&a, head_dim)?;
    let attn = AttnShape {
        hidden: a.hidden_size,
        heads: a.num_attention_heads,
        kv_heads: a.num_key_value_heads,
        head_dim,
        qkv_bias: true,
        qk_norm_eps: None,
        rope_traditional: false,
        rope_base: a.rope_theta,
    };
    let dims = Dims {
        layers: a.num_hidden_layers,
        hidden: a.hidden_size,
        vocab: a.vocab_size,
        rms_norm_eps: a.rms_norm_eps,
        tie_word_embeddings: false,
        ffn_module: "block_sparse_moe",
    };
    let style = Style {
        norm: RmsNorm::load_layer_norm,
        head_bias: true,
        ..Style::default()
    };
    Decoder::load_styled(config, w, dims, style, |w, p, _| {
        let mut attention = load_attention(w, p, &attn)?;
        let o_bias = format!("{p}.self_attn.o_proj.bias");
        attention.o_proj.bias = Some(w.take_shaped(&o_bias, &[a.hidden_size])?);
        if let Some(r) = rope(&a, head_dim)? {
            attention.rope = r;
        }
        let m = format!("{p}.block_sparse_moe");
        let (h, e) = (a.hidden_size, a.num_local_experts);
        let moe = SparseMixerMoe {
            gate: Linear::load(w, &format!("{m}.gate"), false, [e, h])?,
            top_k: a.num_experts_per_tok,
            jitter_eps: a.router_jitter_noise,
            experts: SwitchGlu::load(w, &m, (h, a.intermediate_size), e, MIXTRAL_EXPERT_NAMES)?,
        };
        let mixer: Box<dyn Mixer> = Box::new(attention);
        Ok((mixer, Box::new(moe)))
    })
}
