//! `ernie4_5_moe` as mlx-lm 0.32.2 implements it (ERNIE-4.5-21B-A3B / 300B-A47B text,
//! `ernie4_5_moe.py`):
//!
//!   attn  = GQA, q/k/v/o biases with `use_bias`, head_dim = `head_dim` or hidden / heads,
//!           traditional (interleaved) RoPE over the whole head from `rope_theta`
//!   mlp   = the sparse block on layer i when (i + 1) % moe_layer_interval == 0 and
//!           start <= i <= end (`moe_layer_start_index` / `_end_index`, min / max of a list,
//!           the end defaulting to the last layer); a SwiGLU of `intermediate_size` elsewhere:
//!             p = softmax (or sigmoid, `moe_gate_act`) of gate(x) in float32
//!             inds = argpartition(-p, k-1)[..., :k];  w = p[inds] / maximum(Σ p[inds], 1e-12)
//!             y = Σ_k w_k · SwitchGLU_e(x)  (in y's dtype)  + shared_experts(x)
//!           the shared experts a SwiGLU of (moe_intermediate_size or intermediate_size) ·
//!           `moe_num_shared_experts`, when there are any
//!   logits = lm_head(rms_norm(h)), or the tied embedding
//!
//! mlx-lm's `sanitize`: the MTP tensors (`mtp_block.` …) and every `e_score_correction_bias`
//! dropped (the router never reads one), per-expert weights stacked.

use serde::Deserialize;
use serde_json::Value;

use super::decoder::{dims_of, Decoder, Mixer};
use super::layers::{Glu, Linear, Mlp};
use super::moe::{Gate, Router, SwitchGlu, SwitchLinear, EXPERT_NAMES};
use super::moe_family::{check_top_k, load_attention, AttnShape, Ffn, PlusShared};
use crate::load::config::ModelConfig;
use crate::load::weights::Weights;
use crate::load::LoadError;

/// mlx-lm's `ernie4_5_moe.ModelArgs` (the fields it reads; the defaults its dataclass has).
#[derive(Debug, Clone, Deserialize)]
pub struct Ernie45MoeArgs {
    pub hidden_size: i32,
    pub intermediate_size: i32,
    pub num_attention_heads: i32,
    pub num_key_value_heads: i32,
    pub num_hidden_layers: i32,
    pub rms_norm_eps: f32,
    pub vocab_size: i32,
    pub rope_theta: f32,
    pub use_bias: bool,
    pub tie_word_embeddings: bool,
    pub moe_num_experts: i32,
    /// An int, or a list (its minimum counts).
    #[serde(default)]
    pub moe_layer_start_index: Option<Value>,
    #[serde(default)]
    pub moe_intermediate_size: i32,
    #[serde(default = "one")]
    pub moe_k: i32,
    #[serde(default = "one")]
    pub moe_layer_interval: i32,
    #[serde(default)]
    pub moe_num_shared_experts: i32,
    /// An int, a list (its maximum counts) or absent (the last layer).
    #[serde(default)]
    pub moe_layer_end_index: Option<Value>,
    pub head_dim: Option<i32>,
    #[serde(default = "softmax")]
    pub moe_gate_act: String,
}

fn one() -> i32 {
    1
}

fn softmax() -> String {
    "softmax".into()
}

/// An int or the min / max of a list of ints (`pick`), as the decoder layer reads the
/// MoE layer bounds.
fn bound(v: &Value, pick: fn(&[i64]) -> Option<i64>, field: &str) -> Result<i32, LoadError> {
    let bad = || LoadError::Unsupported(format!("ernie4_5_moe: {field} {v} is no int or list"));
    match v {
        Value::Array(items) => {
            let ints = items
                .iter()
                .map(|i| i.as_i64().ok_or_else(bad))
                .collect::<Result<Vec<_>, _>>()?;
            pick(&ints).map(|i| i as i32).ok_or_else(bad)
        }
        v => v.as_i64().map(|i| i as i32).ok_or_else(bad),
    }
}

impl Ernie45MoeArgs {
    /// Layer `i` holds the sparse block (`Ernie4_5_DecoderLayer.__init__`).
    fn sparse(&self, i: i32) -> Result<bool, LoadError> {
        let start = match &self.moe_layer_start_index {
            Some(v) => bound(v, |l| l.iter().copied().min(), "moe_layer_start_index")?,
            None => 0,
        };
        let end = match self.moe_layer_end_index.as_ref().filter(|v| !v.is_null()) {
            Some(v) => bound(v, |l| l.iter().copied().max(), "moe_layer_end_index")?,
            None => self.num_hidden_layers - 1,
        };
        Ok((i + 1) % self.moe_layer_interval == 0 && i >= start && i <= end)
    }

    fn check(&self) -> Result<(), LoadError> {
        let refuse = |m: String| Err(LoadError::Unsupported(format!("ernie4_5_moe: {m}")));
        if !matches!(self.moe_gate_act.as_str(), "softmax" | "sigmoid") {
            return refuse(format!(
                "moe_gate_act `{}` is not supported (mlx-lm raises too)",
                self.moe_gate_act
            ));
        }
        if self.moe_layer_interval <= 0 {
            return refuse(format!(
                "moe_layer_interval must be positive, got {}",
                self.moe_layer_interval
            ));
        }
        check_top_k(
            "ernie4_5_moe",
            self.moe_k,
            self.moe_num_experts,
            "moe_num_experts",
        )
    }

    /// The experts' width (`moe_intermediate_size`, or `intermediate_size` when 0).
    fn expert_width(&self) -> i32 {
        match self.moe_intermediate_size {
            0 => self.intermediate_size,
            w => w,
        }
    }
}

/// What mlx-lm's sanitize drops (at load, and in convert): the MTP tensors and the unused
/// correction bias.
pub(crate) const DROPPED: [&str; 5] = [
    "mtp_block.",
    "mtp_linear_proj.",
    "mtp_hidden_norm.",
    "mtp_emb_norm.",
    "e_score_correction_bias",
];

/// mlx-lm's sanitize, less the stacking (each block stacks its experts as it loads).
fn sanitize(w: &mut Weights) {
    w.discard(|n| DROPPED.iter().any(|p| n.contains(p)));
}

/// The experts: per-expert or stacked, with biases (`SwitchGLU(bias=use_bias)`) read from
/// the stacked layout only, as mlx-lm's sanitize stacks only the weights.
fn load_experts(w: &mut Weights, mlp: &str, a: &Ernie45MoeArgs) -> Result<SwitchGlu, LoadError> {
    let (h, ff, e) = (a.hidden_size, a.expert_width(), a.moe_num_experts);
    if !a.use_bias {
        return SwitchGlu::load(w, mlp, (h, ff), e, EXPERT_NAMES);
    }
    let mut proj = |n: &str, shape: [i32; 3]| {
        SwitchLinear::load(w, &format!("{mlp}.switch_mlp.{n}"), true, shape)
    };
    Ok(SwitchGlu {
        gate_proj: proj("gate_proj", [e, ff, h])?,
        up_proj: proj("up_proj", [e, ff, h])?,
        down_proj: proj("down_proj", [e, h, ff])?,
    })
}

fn load_ffn(w: &mut Weights, p: &str, a: &Ernie45MoeArgs, i: i32) -> Result<Ffn, LoadError> {
    let mlp = format!("{p}.mlp");
    let h = a.hidden_size;
    if !a.sparse(i)? {
        let dense = Mlp::load(w, &mlp, a.use_bias, h, a.intermediate_size, Glu::Swiglu)?;
        return Ok(Ffn::Dense(dense));
    }
    let router = Gate {
        gate: Linear::load(w, &format!("{mlp}.gate"), false, [a.moe_num_experts, h])?,
        top_k: a.moe_k,
        kind: Router::ActTopKRenormalized {
            sigmoid: a.moe_gate_act == "sigmoid",
        },
    };
    let experts = load_experts(w, &mlp, a)?;
    let shared = match a.moe_num_shared_experts {
        n if n > 0 => Some(Mlp::load(
            w,
            &format!("{mlp}.shared_experts"),
            a.use_bias,
            h,
            a.expert_width() * n,
            Glu::Swiglu,
        )?),
        _ => None,
    };
    Ok(Ffn::PlusShared(Box::new(PlusShared {
        router,
        experts,
        shared,
        linear_router: true,
    })))
}

pub fn load(config: &ModelConfig, mut w: Weights) -> Result<Decoder, LoadError> {
    let a: Ernie45MoeArgs = config.parse()?;
    a.check()?;
    sanitize(&mut w);
    let head_dim = a.head_dim.unwrap_or(a.hidden_size / a.num_attention_heads);
    let attn = AttnShape {
        hidden: a.hidden_size,
        heads: a.num_attention_heads,
        kv_heads: a.num_key_value_heads,
        head_dim,
        qkv_bias: a.use_bias,
        qk_norm_eps: None,
        rope_traditional: true,
        rope_base: a.rope_theta,
    };
    if a.tie_word_embeddings {
        w.discard(|n| n == "lm_head.weight");
    }
    let dims = dims_of!(a);
    Decoder::load(config, w, dims, |w, p, i| {
        let mut attention = load_attention(w, p, &attn)?;
        if a.use_bias {
            let o_bias = format!("{p}.self_attn.o_proj.bias");
            attention.o_proj.bias = Some(w.take_shaped(&o_bias, &[a.hidden_size])?);
        }
        let mixer: Box<dyn Mixer> = Box::new(attention);
        Ok((mixer, Box::new(load_ffn(w, p, &a, i)?)))
    })
}
