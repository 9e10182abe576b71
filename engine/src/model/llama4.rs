//! `llama4` (Llama 4 Scout / Maverick) loaded for text as mlx-lm 0.32.2's `llama4.py` runs
//! it: the language model's settings are `text_config`, its weights `language_model.…`
//! (vision tower and projector dropped). Per layer i:
//!
//!   attn  = GQA (biases with `attention_bias`); three layers in four ((i + 1) % 4 ≠ 0) chunked:
//!           RoPE (`initialize_rope`, traditional, `rope_scaling`), then with `use_qk_norm` a
//!           weightless `fast.rms_norm(·, eps 1e-6)` of q and k, keys of the query's own chunk
//!           of `attention_chunk_size` positions only (`ChunkedKvCache`, `chunked_mask`);
//!           every fourth global without positions (NoPE), its queries scaled by
//!           log(floor((pos + 1) / floor_scale) + 1) · attn_scale + 1 with
//!           `attn_temperature_tuning` (standard cache, causal mask)
//!   ffn   = on i % step = step − 1 (`interleave_moe_layer_step`) the MoE: the top-1 router
//!           logit, σ of it (float32, back to x's dtype) scaling x *before* its SwitchGLU
//!           expert, plus the shared SwiGLU expert of x; elsewhere a SwiGLU of
//!           `intermediate_size_mlp`
//!   logits = lm_head(rms_norm(h))
//!
//! mlx-lm's sanitize: Hugging Face's fused `experts.gate_up_proj` [E, D, 2I] split on its
//! last axis (gate first) and each half transposed, `experts.down_proj` transposed.

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::{Ellipsis, IndexOp, NewAxis};
use mlx_rs::ops::{arange, argpartition_axis, sigmoid};
use mlx_rs::{fast, Array};
use serde::Deserialize;

use super::decoder::{kv_cache, Decoder, Dims, FeedForward, Mixer};
use super::layers::{Glu, Linear, Mlp, Rope};
use super::moe::{SwitchGlu, SwitchLinear};
use super::shard::Part;
use crate::cache::chunked::ChunkedKvCache;
use crate::cache::{kv_of, Cache, Mask, RopeOffset};
use crate::load::config::{ModelConfig, RopeScaling};
use crate::load::weights::Weights;
use crate::load::LoadError;
use crate::scalar::weak;

type R<T> = Result<T, Exception>;

/// mlx-lm's `llama4.TextArgs`.
#[derive(Debug, Clone, Deserialize)]
pub struct TextArgs {
    pub attention_bias: bool,
    pub attention_chunk_size: i32,
    pub head_dim: Option<i32>,
    pub hidden_size: i32,
    pub interleave_moe_layer_step: i32,
    pub intermediate_size: i32,
    pub intermediate_size_mlp: i32,
    pub max_position_embeddings: i32,
    pub num_attention_heads: i32,
    pub num_experts_per_tok: i32,
    pub num_hidden_layers: i32,
    pub num_key_value_heads: i32,
    pub num_local_experts: i32,
    pub rms_norm_eps: f32,
    pub rope_scaling: Option<RopeScaling>,
    pub rope_theta: f32,
    pub use_qk_norm: bool,
    pub vocab_size: i32,
    /// An int (mlx-lm's default 4) or a bool (transformers' configs): read as Python's truth.
    #[serde(default = "four")]
    pub attn_temperature_tuning: serde_json::Value,
    #[serde(default = "floor_scale")]
    pub floor_scale: i64,
    #[serde(default = "attn_scale")]
    pub attn_scale: f64,
}

fn four() -> serde_json::Value {
    4.into()
}

/// Python's truth of a config value (false, 0, null, "" are false).
fn truthy(v: &serde_json::Value) -> bool {
    match v {
        serde_json::Value::Bool(b) => *b,
        serde_json::Value::Number(n) => n.as_f64() != Some(0.0),
        serde_json::Value::Null => false,
        serde_json::Value::String(s) => !s.is_empty(),
        _ => true,
    }
}
fn floor_scale() -> i64 {
    8192
}
fn attn_scale() -> f64 {
    0.1
}

/// `llama4.Attention` (see the module header).
struct Llama4Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    n_heads: i32,
    n_kv_heads: i32,
    scale: f32,
    /// Chunked layers: their RoPE and chunk size; None on the global NoPE layers.
    chunked: Option<(Rope, i32)>,
    qk_norm: bool,
    /// Global layers with `attn_temperature_tuning`: (floor_scale, attn_scale).
    temperature: Option<(i64, f64)>,
}

impl Llama4Attention {
    /// log(floor(arange(offset + 1, offset + L + 1) / floor_scale) + 1) · attn_scale + 1,
    /// as [L, 1] (float32: the int positions' true division makes it so).
    fn temperature_scales(offset: i32, l: i32, (floor, scale): (i64, f64)) -> R<Array> {
        let pos = arange::<_, i32>(offset + 1, offset + l + 1, 1)?;
        let t = mlx_rs::ops::floor(pos.divide(Array::from_int(floor as i32))?)?;
        let t = mlx_rs::ops::log(t.add(weak(1.0, &t)?)?)?;
        let t = t.multiply(weak(scale, &t)?)?;
        Ok(t.add(weak(1.0, &t)?)?.index((.., NewAxis)))
    }

    fn attend(&self, x: &Array, mask: &Mask, cache: &mut dyn Cache) -> R<Array> {
        let (b, l) = (x.shape()[0], x.shape()[1]);
        let heads = |t: Array, n: i32| t.reshape(&[b, l, n, -1])?.transpose_axes(&[0, 2, 1, 3]);
        let mut q = heads(self.q_proj.forward(x)?, self.n_heads)?;
        let mut k = heads(self.k_proj.forward(x)?, self.n_kv_heads)?;
        let v = heads(self.v_proj.forward(x)?, self.n_kv_heads)?;
        let cache = kv_of(cache)?;
        let offset = cache.offset();
        if let Some((rope, _)) = &self.chunked {
            q = rope.forward(&q, &RopeOffset::Int(offset))?;
            k = rope.forward(&k, &RopeOffset::Int(offset))?;
            if self.qk_norm {
                q = fast::rms_norm(&q, None, 1e-6)?;
                k = fast::rms_norm(&k, None, 1e-6)?;
            }
        }
        if let Some(t) = self.temperature {
            let scales = Self::temperature_scales(offset, l, t)?;
            q = q.multiply(&scales)?.as_dtype(q.dtype())?;
        }
        let kv = cache.update_and_fetch(k, v)?;
        let out = super::sdpa::attend(&q, &kv, self.scale, mask)?;
        let out = out.transpose_axes(&[0, 2, 1, 3])?.reshape(&[b, l, -1])?;
        self.o_proj.forward(&out)
    }
}

impl Mixer for Llama4Attention {
    fn forward(&self, x: &Array, mask: &Mask, cache: &mut dyn Cache) -> R<Array> {
        self.attend(x, mask, cache)
    }

    /// mlx-lm's `make_cache`: a `ChunkedKVCache` on chunked layers, a `KVCache` on the others.
    fn make_cache(&self) -> Box<dyn Cache> {
        match &self.chunked {
            Some((_, chunk)) => Box::new(ChunkedKvCache::new(*chunk)),
            None => kv_cache(&Rope::None),
        }
    }

    fn chunk(&self) -> Option<i32> {
        self.chunked.as_ref().map(|(_, c)| *c)
    }

    fn linears(&self) -> Vec<(&'static str, &Linear)> {
        vec![
            ("self_attn.q_proj", &self.q_proj),
            ("self_attn.k_proj", &self.k_proj),
            ("self_attn.v_proj", &self.v_proj),
            ("self_attn.o_proj", &self.o_proj),
        ]
    }

    fn shard(&mut self, _part: Part, layer: &str) -> Result<(), LoadError> {
        Err(not_sharded(layer))
    }
}

fn not_sharded(at: &str) -> LoadError {
    LoadError::Unsupported(format!("llama4 ({at}): mlx-lm 0.32.2 does not shard it"))
}

/// `llama4.MoE`: top-1 routing, the expert fed σ(logit)·x, plus the shared expert.
struct TopOneMoe {
    router: Linear,
    experts: SwitchGlu,
    shared_expert: Mlp,
}

impl FeedForward for TopOneMoe {
    fn forward(&self, x: &Array) -> R<Array> {
        let logits = self.router.forward(x)?;
        let part = argpartition_axis(logits.negative()?, 0, -1)?;
        let indices = mlx_rs::stop_gradient(part.index((Ellipsis, ..1)))?;
        let scores = logits.take_along_axis(&indices, -1)?;
        let scores = sigmoid(scores.as_dtype(mlx_rs::Dtype::Float32)?)?.as_dtype(x.dtype())?;
        let out = self.experts.forward(&x.multiply(&scores)?, &indices)?;
        out.squeeze_axes(&[2])?.add(self.shared_expert.forward(x)?)
    }

    fn linears(&self, module: &str) -> Vec<(String, &Linear)> {
        let shared = &self.shared_expert;
        std::iter::once(("router", &self.router))
            .chain([
                ("shared_expert.gate_proj", &shared.gate_proj),
                ("shared_expert.up_proj", &shared.up_proj),
                ("shared_expert.down_proj", &shared.down_proj),
            ])
            .map(|(n, l)| (format!("{module}.{n}"), l))
            .collect()
    }

    fn switches(&self, module: &str) -> Vec<(String, &SwitchLinear)> {
        self.experts.named(&format!("{module}.experts"))
    }

    fn shard(&mut self, _part: Part, prefix: &str) -> Result<(), LoadError> {
        Err(not_sharded(prefix))
    }
}

/// mlx-lm's sanitize, on the names with `language_model.` already stripped: the fused
/// experts of layer `l` split and transposed as `llama4.Model.sanitize` does.
fn sanitize_experts(w: &mut Weights, l: i32) -> Result<(), LoadError> {
    let prefix = format!("model.layers.{l}.feed_forward.experts");
    let err = |e: Exception| LoadError::Weights(format!("`{prefix}`: {e}"));
    if w.contains(&format!("{prefix}.gate_up_proj")) {
        let fused = w.take(&format!("{prefix}.gate_up_proj"))?;
        let halves = fused.split_equal(2, -1).map_err(err)?;
        for (name, half) in ["gate_proj", "up_proj"].iter().zip(halves) {
            let t = half.swap_axes(1, 2).map_err(err)?;
            w.insert(format!("{prefix}.{name}.weight"), t);
        }
    }
    if w.contains(&format!("{prefix}.down_proj")) {
        let down = w.take(&format!("{prefix}.down_proj"))?;
        let t = down.swap_axes(1, 2).map_err(err)?;
        w.insert(format!("{prefix}.down_proj.weight"), t);
    }
    Ok(())
}

/// The checkpoint's names as the text model reads them: `language_model.` stripped, the
/// vision tower and projector dropped, the experts sanitized.
fn sanitize(a: &TextArgs, w: &mut Weights) -> Result<(), LoadError> {
    w.discard(|n| n.contains("vision_model") || n.contains("multi_modal_projector"));
    w.rename(|n| Some(n.strip_prefix("language_model.").unwrap_or(n).to_owned()));
    (0..a.num_hidden_layers).try_for_each(|l| sanitize_experts(w, l))
}

fn load_attention(
    w: &mut Weights,
    p: &str,
    a: &TextArgs,
    i: i32,
) -> Result<Llama4Attention, LoadError> {
    let head_dim = a.head_dim.unwrap_or(a.hidden_size / a.num_attention_heads);
    let (h, q_dims, kv_dims) = (
        a.hidden_size,
        a.num_attention_heads * head_dim,
        a.num_key_value_heads * head_dim,
    );
    let bias = a.attention_bias;
    let proj = |w: &mut Weights, n: &str, out_in: [i32; 2]| {
        Linear::load(w, &format!("{p}.self_attn.{n}"), bias, out_in)
    };
    let chunked_layer = (i + 1) % 4 != 0;
    let chunked = match chunked_layer {
        true => {
            let max = Some(a.max_position_embeddings);
            let rope = Rope::init(head_dim, a.rope_theta, true, a.rope_scaling.as_ref(), max)?;
            Some((rope, a.attention_chunk_size))
        }
        false => None,
    };
    Ok(Llama4Attention {
        q_proj: proj(w, "q_proj", [q_dims, h])?,
        k_proj: proj(w, "k_proj", [kv_dims, h])?,
        v_proj: proj(w, "v_proj", [kv_dims, h])?,
        o_proj: proj(w, "o_proj", [h, q_dims])?,
        n_heads: a.num_attention_heads,
        n_kv_heads: a.num_key_value_heads,
        scale: (head_dim as f32).powf(-0.5),
        chunked,
        qk_norm: a.use_qk_norm,
        temperature: (!chunked_layer && truthy(&a.attn_temperature_tuning))
            .then_some((a.floor_scale, a.attn_scale)),
    })
}

fn load_ffn(
    w: &mut Weights,
    p: &str,
    a: &TextArgs,
    i: i32,
) -> Result<Box<dyn FeedForward>, LoadError> {
    let ff = format!("{p}.feed_forward");
    let (h, step) = (a.hidden_size, a.interleave_moe_layer_step);
    if i % step != step - 1 {
        let mlp = Mlp::load(w, &ff, false, h, a.intermediate_size_mlp, Glu::Swiglu)?;
        return Ok(Box::new(mlp));
    }
    let (e, inter) = (a.num_local_experts, a.intermediate_size);
    let expert = |w: &mut Weights, n: &str, shape: [i32; 3]| {
        SwitchLinear::load(w, &format!("{ff}.experts.{n}"), false, shape)
    };
    Ok(Box::new(TopOneMoe {
        router: Linear::load(w, &format!("{ff}.router"), false, [e, h])?,
        experts: SwitchGlu {
            gate_proj: expert(w, "gate_proj", [e, inter, h])?,
            up_proj: expert(w, "up_proj", [e, inter, h])?,
            down_proj: expert(w, "down_proj", [e, h, inter])?,
        },
        shared_expert: Mlp::load(
            w,
            &format!("{ff}.shared_expert"),
            false,
            h,
            inter,
            Glu::Swiglu,
        )?,
    }))
}

pub fn load(config: &ModelConfig, mut w: Weights) -> Result<Decoder, LoadError> {
    let text = config.raw.get("text_config").cloned().unwrap_or_default();
    let a = TextArgs::deserialize(&text).map_err(|e| LoadError::Config {
        path: config.path.clone(),
        message: format!("llama4 text_config: {e}"),
    })?;
    let refuse = |m: String| Err(LoadError::Unsupported(format!("llama4: {m}")));
    if a.num_experts_per_tok != 1 {
        return refuse(format!(
            "num_experts_per_tok {}: mlx-lm's MoE supports one expert per token only",
            a.num_experts_per_tok
        ));
    }
    if a.interleave_moe_layer_step <= 0 || a.attention_chunk_size <= 0 {
        return refuse(
            "interleave_moe_layer_step and attention_chunk_size must be positive".into(),
        );
    }
    sanitize(&a, &mut w)?;
    let dims = Dims {
        layers: a.num_hidden_layers,
        hidden: a.hidden_size,
        vocab: a.vocab_size,
        rms_norm_eps: a.rms_norm_eps,
        tie_word_embeddings: false,
        ffn_module: "feed_forward",
    };
    let decoder = Decoder::load(config, w, dims, |w, p, i| {
        let mixer: Box<dyn Mixer> = Box::new(load_attention(w, p, &a, i)?);
        Ok(super::decoder::Built {
            mixer,
            ffn: Some(load_ffn(w, p, &a, i)?),
            tail: None,
            borrows: None,
        })
    })?;
    // mlx-lm's llama4 `Model` holds the text model as `language_model`: adapters are named
    // under it.
    Ok(decoder.under_language_model())
}
