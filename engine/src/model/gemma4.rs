//! Gemma 4 text (`gemma4_text`) as mlx-lm 0.32.2 implements it:
//!
//!   h = embed(ids) · √hidden
//!   per-layer inputs (small Gemma 4s): p = (norm(proj(h) / √hidden) + embed_pl(ids) · √d_pl) / √2,
//!                                      one d_pl-wide slice per layer
//!   each layer:  h = h + post_attn_norm(attn(input_norm(h)))
//!                h = h + post_ffw_norm(mlp(pre_ffw_norm(h)))       mlp = down(gelu_tanh(gate) · up)
//!                    (with `enable_moe_block`, the 26B: post_ffw_norm(post_ffw_norm_1(mlp(…))
//!                     + post_ffw_norm_2(experts(pre_ffw_norm_2(h)))), see moe.rs)
//!                h = h + post_pl_norm(pl_proj(gelu_tanh(pl_gate(h)) · p_layer))
//!                h = h · layer_scalar
//!   logits = softcap(head(norm(h)))                                  softcap(x) = c · tanh(x / c)
//!
//! Attention has scale 1 (q and k are RMS-normalized, v is normalized without a scale).
//! Full-attention layers may use a wider head and a proportional, partial RoPE; with
//! `attention_k_eq_v` they project one tensor that serves as both K and V. The last
//! `num_kv_shared_layers` layers compute no K/V of their own: each reuses the K/V (and RoPE
//! position) of the last earlier layer of its kind, and has no cache; their MLPs are
//! double-wide. Sliding layers keep a rotating cache of `sliding_window`.

mod args;
pub mod assistant;
mod moe;

use mlx_rs::error::Exception;
use mlx_rs::fast;
use mlx_rs::Array;

use super::layers::{
    block_linears, gelu_approx, layer_cache, weak, Embedding, Glu, Linear, Mlp, OutputHead,
    RmsNorm, Rope,
};
use super::LanguageModel;
use crate::cache::{kv_of, Cache, Kv, KvQuant, Mask, QuantSdpa, RopeOffset};
use crate::load::config::ModelConfig;
use crate::load::weights::Weights;
use crate::load::LoadError;
pub use args::Gemma4Args;
use assistant::AssistantTarget;
use moe::MoeBlock;

type R<T> = Result<T, Exception>;

/// K/V of one layer as later layers may borrow them: the cache's full contents after this
/// step, and the RoPE position the step used.
#[derive(Clone)]
struct SharedKv {
    kv: Kv,
    offset: RopeOffset,
}

/// The K/V half of an attention layer that computes its own.
struct KvProj {
    k_proj: Linear,
    /// None: K = V (full-attention layers of the large Gemma 4s).
    v_proj: Option<Linear>,
    k_norm: RmsNorm,
    n_kv_heads: i32,
}

struct Attention {
    q_proj: Linear,
    q_norm: RmsNorm,
    kv: Option<KvProj>,
    o_proj: Linear,
    n_heads: i32,
    eps: f32,
    rope: Rope,
}

impl Attention {
    fn forward(
        &self,
        x: &Array,
        mask: &Mask,
        cache: Option<&mut Box<dyn Cache>>,
        shared: Option<&SharedKv>,
    ) -> R<(Array, SharedKv)> {
        let (b, l) = (x.shape()[0], x.shape()[1]);
        let heads = [0, 2, 1, 3];
        let q =
            self.q_norm
                .forward(&self.q_proj.forward(x)?.reshape(&[b, l, self.n_heads, -1])?)?;
        let (fresh, offset) = match (shared, &self.kv) {
            (Some(s), _) => (None, s.offset.clone()),
            (None, Some(kv)) => {
                let k = kv.k_proj.forward(x)?.reshape(&[b, l, kv.n_kv_heads, -1])?;
                let v = match &kv.v_proj {
                    Some(v_proj) => v_proj.forward(x)?.reshape(&[b, l, kv.n_kv_heads, -1])?,
                    None => k.clone(),
                };
                // mlx-lm passes `mx.array(cache.offset)`: the array form of the position.
                let offset = match cache.as_ref().map(|c| c.rope_offset()) {
                    Some(RopeOffset::Int(o)) => RopeOffset::Array(Array::from_int(o)),
                    Some(o) => o,
                    None => RopeOffset::Int(0),
                };
                let k = kv.k_norm.forward(&k)?.transpose_axes(&heads)?;
                let k = self.rope.forward(&k, &offset)?;
                let v = fast::rms_norm(&v, None, self.eps)?.transpose_axes(&heads)?;
                (Some((k, v)), offset)
            }
            (None, None) => {
                return Err(Exception::custom(
                    "a KV-shared gemma4 layer ran without the K/V it borrows",
                ))
            }
        };
        let q = self.rope.forward(&q.transpose_axes(&heads)?, &offset)?;
        let kv = match (fresh, cache, shared) {
            (Some((k, v)), Some(c), _) => kv_of(c.as_mut())?.update_and_fetch(k, v)?,
            (Some((k, v)), None, _) => Kv::Dense(k, v),
            // optiq attends borrowed quantized K/V through its unfused quantized SDPA.
            (None, _, Some(s)) => match &s.kv {
                Kv::Quantized {
                    keys,
                    values,
                    quant,
                } => Kv::Quantized {
                    keys: keys.clone(),
                    values: values.clone(),
                    quant: KvQuant {
                        sdpa: QuantSdpa::MlxLm,
                        ..*quant
                    },
                },
                dense => dense.clone(),
            },
            (None, _, None) => unreachable!("a layer without K/V of its own always borrows"),
        };
        let out = super::sdpa::attend(&q, &kv, 1.0, mask)?;
        let out = out.transpose_axes(&heads)?.reshape(&[b, l, -1])?;
        Ok((self.o_proj.forward(&out)?, SharedKv { kv, offset }))
    }
}

/// The per-layer input branch of the small Gemma 4s.
struct PerLayerGate {
    gate: Linear,
    projection: Linear,
    norm: RmsNorm,
}

struct Block {
    attn: Attention,
    /// `down(geglu(gate, up))`, double-wide on the KV-sharing layers.
    mlp: Mlp,
    /// The experts beside the MLP (`enable_moe_block`).
    moe: Option<MoeBlock>,
    input_norm: RmsNorm,
    post_attn_norm: RmsNorm,
    pre_ffw_norm: RmsNorm,
    post_ffw_norm: RmsNorm,
    per_layer: Option<PerLayerGate>,
    layer_scalar: Array,
    full: bool,
    /// The layer whose K/V this one borrows (itself when it computes its own).
    kv_source: usize,
}

/// The model-level half of the per-layer inputs.
struct PerLayerInputs {
    embed: Embedding,
    model_projection: Linear,
    projection_norm: RmsNorm,
    width: i32,
}

pub struct Gemma4 {
    args: Gemma4Args,
    embed: Embedding,
    per_layer: Option<PerLayerInputs>,
    blocks: Vec<Block>,
    /// `model.norm`, the head and the final logit softcap.
    head: OutputHead,
}

/// Checkpoint tensors mlx-lm's `sanitize` drops for this family.
fn sanitized_away(name: &str, first_shared: i32) -> bool {
    const IGNORED: [&str; 5] = [
        "self_attn.rotary_emb",
        "input_max",
        "input_min",
        "output_max",
        "output_min",
    ];
    if IGNORED.iter().any(|s| name.contains(s)) {
        return true;
    }
    let kv = [
        ".self_attn.k_proj",
        ".self_attn.v_proj",
        ".self_attn.k_norm",
    ];
    if kv.iter().any(|s| name.contains(s)) {
        let layer = name
            .split("layers.")
            .nth(1)
            .and_then(|rest| rest.split('.').next())
            .and_then(|i| i.parse::<i32>().ok());
        return layer.is_some_and(|i| i >= first_shared);
    }
    false
}

impl Gemma4 {
    pub fn load(config: &ModelConfig, mut w: Weights) -> Result<Self, LoadError> {
        let a: Gemma4Args = config.parse()?;
        w.set_quantization(config.quantization.clone());
        let full = a.full_attention()?;
        let n = a.num_hidden_layers;
        let first_shared = n - a.num_kv_shared_layers;
        let pl_width = a.hidden_size_per_layer_input.unwrap_or(0);
        let eps = a.rms_norm_eps;
        let blocks = (0..n)
            .map(|i| load_block(&mut w, &a, &full, i, first_shared))
            .collect::<Result<Vec<_>, _>>()?;
        let embed = Embedding::load(&mut w, "model.embed_tokens", a.hidden_size)?;
        let per_layer = if pl_width > 0 {
            Some(PerLayerInputs {
                embed: Embedding::load(&mut w, "model.embed_tokens_per_layer", n * pl_width)?,
                model_projection: Linear::load(
                    &mut w,
                    "model.per_layer_model_projection",
                    false,
                    a.hidden_size,
                )?,
                projection_norm: RmsNorm::load(&mut w, "model.per_layer_projection_norm", eps)?,
                width: pl_width,
            })
        } else {
            None
        };
        let norm = RmsNorm::load(&mut w, "model.norm", eps)?;
        let head = OutputHead::load(
            &mut w,
            norm,
            a.tie_word_embeddings,
            a.hidden_size,
            a.final_logit_softcapping,
        )?;
        w.ensure_consumed("gemma4_text", |name| sanitized_away(name, first_shared))?;
        Ok(Gemma4 {
            args: a,
            embed,
            per_layer,
            blocks,
            head,
        })
    }

    /// Per-layer inputs [B, L, layers, width] from the ids and the scaled embeddings.
    fn per_layer_inputs(&self, p: &PerLayerInputs, ids: &Array, h: &Array) -> R<Array> {
        let (b, l) = (ids.shape()[0], ids.shape()[1]);
        let shape = [b, l, self.args.num_hidden_layers, p.width];
        let from_ids = p.embed.forward(ids)?;
        let from_ids = from_ids
            .multiply(weak((p.width as f64).sqrt(), &from_ids)?)?
            .reshape(&shape)?;
        let projected = p.model_projection.forward(h)?;
        let projected = projected
            .multiply(weak((self.args.hidden_size as f64).powf(-0.5), &projected)?)?
            .reshape(&shape)?;
        let projected = p.projection_norm.forward(&projected)?;
        let sum = projected.add(&from_ids)?;
        sum.multiply(weak(2f64.powf(-0.5), &sum)?)
    }
}

impl Block {
    fn forward(
        &self,
        h: &Array,
        mask: &Mask,
        cache: Option<&mut Box<dyn Cache>>,
        shared: Option<&SharedKv>,
        per_layer_input: Option<&Array>,
    ) -> R<(Array, SharedKv)> {
        let (r, kv) = self
            .attn
            .forward(&self.input_norm.forward(h)?, mask, cache, shared)?;
        let h = h.add(&self.post_attn_norm.forward(&r)?)?;
        let r = self.mlp.forward(&self.pre_ffw_norm.forward(&h)?)?;
        let r = match &self.moe {
            Some(moe) => moe.forward(&h, &r)?,
            None => r,
        };
        let mut h = h.add(&self.post_ffw_norm.forward(&r)?)?;
        if let (Some(g), Some(input)) = (&self.per_layer, per_layer_input) {
            let gate = gelu_approx(&g.gate.forward(&h)?)?.multiply(input)?;
            let gate = g.norm.forward(&g.projection.forward(&gate)?)?;
            h = h.add(&gate)?;
        }
        Ok((h.multiply(&self.layer_scalar)?, kv))
    }
}

impl LanguageModel for Gemma4 {
    fn model_type(&self) -> &str {
        "gemma4_text"
    }

    fn vocab_size(&self) -> usize {
        self.head.width(&self.embed)
    }

    fn activation_dtype(&self) -> mlx_rs::Dtype {
        self.embed.output_dtype()
    }

    /// mlx-lm's module names; KV-shared layers have no k/v projections, K = V layers no
    /// v_proj, and the small models add the per-layer input gate and projection. None with
    /// the experts: LoRA is not available on the mixture-of-experts Gemma 4.
    fn linears(&self) -> Vec<(String, &Linear)> {
        if self.args.enable_moe_block {
            return Vec::new();
        }
        block_linears(&self.blocks, |b| {
            let a = &b.attn;
            let mut named = vec![("self_attn.q_proj", &a.q_proj)];
            if let Some(kv) = &a.kv {
                named.push(("self_attn.k_proj", &kv.k_proj));
                if let Some(v) = &kv.v_proj {
                    named.push(("self_attn.v_proj", v));
                }
            }
            named.push(("self_attn.o_proj", &a.o_proj));
            named.extend(b.mlp.named_linears());
            if let Some(pl) = &b.per_layer {
                named.push(("per_layer_input_gate", &pl.gate));
                named.push(("per_layer_projection", &pl.projection));
            }
            named
        })
    }

    /// Caches only for the layers that compute K/V (as mlx-lm's `make_cache`).
    fn make_caches(&self) -> Vec<Box<dyn Cache>> {
        self.blocks
            .iter()
            .enumerate()
            .filter(|(i, b)| b.kv_source == *i)
            .map(|(_, b)| layer_cache(b.full, self.args.sliding_window))
            .collect()
    }

    fn forward(&self, ids: &Array, caches: &mut [Box<dyn Cache>]) -> R<Array> {
        self.head.forward(&self.embed, &self.run(ids, caches)?)
    }

    fn as_assistant_target(&self) -> Option<&dyn AssistantTarget> {
        Some(self)
    }

    fn as_layered(&self) -> Option<&dyn super::Layered> {
        Some(self)
    }
}

/// Segmented training's hooks (embed → blocks with the borrowed K/V carried → head).
mod layered;

impl Gemma4 {
    /// The scaled input embedding (`embed_tokens(ids) * embed_scale`).
    fn embed_scaled(&self, ids: &Array) -> R<Array> {
        let h = self.embed.forward(ids)?;
        h.multiply(weak((self.args.hidden_size as f64).sqrt(), &h)?)
    }

    /// mlx-lm's inner `Gemma4TextModel`: the hidden state after the final norm.
    fn hidden(&self, ids: &Array, caches: &mut [Box<dyn Cache>]) -> R<Array> {
        self.head.norm.forward(&self.run(ids, caches)?)
    }

    /// Embedding and blocks: the hidden state before the final norm.
    fn run(&self, ids: &Array, caches: &mut [Box<dyn Cache>]) -> R<Array> {
        let mut h = self.embed_scaled(ids)?;
        // One view per layer [B, L, width]: a Slice and a Squeeze each, as mlx-lm's
        // `inputs[:, :, i, :]` builds it (an integer index in mlx-rs reshapes instead).
        let per_layer = match &self.per_layer {
            Some(p) => {
                let all = self.per_layer_inputs(p, ids, &h)?;
                let cuts: Vec<i32> = (1..self.args.num_hidden_layers).collect();
                let views = all.split_at_indices(&cuts, 2)?;
                Some(
                    views
                        .iter()
                        .map(|v| v.squeeze_axes(&[2]))
                        .collect::<R<Vec<_>>>()?,
                )
            }
            None => None,
        };
        let n = ids.shape()[1];
        // One mask per attention kind, from the first cache of that kind.
        let mut masks: [Option<Mask>; 2] = [None, None];
        for (block, cache) in self.blocks.iter().zip(caches.iter()) {
            let slot = &mut masks[block.full as usize];
            if slot.is_none() {
                let window = (!block.full).then_some(self.args.sliding_window);
                *slot = Some(cache.make_mask(n, window)?);
            }
        }
        let mut produced: Vec<Option<SharedKv>> = vec![None; self.blocks.len()];
        let mut caches = caches.iter_mut();
        for (i, block) in self.blocks.iter().enumerate() {
            let own = block.kv_source == i;
            let cache = if own { caches.next() } else { None };
            let shared = if own {
                None
            } else {
                produced[block.kv_source].as_ref()
            };
            let mask = masks[block.full as usize]
                .as_ref()
                .ok_or_else(|| Exception::custom("no mask for this attention kind"))?;
            let input = per_layer.as_ref().map(|p| &p[i]);
            let (next, kv) = block.forward(&h, mask, cache, shared, input)?;
            h = next;
            produced[i] = Some(kv);
        }
        Ok(h)
    }
}

/// Layer `i` of a Gemma 4 model: its attention (K/V projections unless it shares an earlier
/// layer's), GeGLU MLP, norms, per-layer input gate and the layer that lends it K/V.
fn load_block(
    w: &mut Weights,
    a: &Gemma4Args,
    full: &[bool],
    i: i32,
    first_shared: i32,
) -> Result<Block, LoadError> {
    let pl_width = a.hidden_size_per_layer_input.unwrap_or(0);
    let eps = a.rms_norm_eps;
    let p = format!("model.layers.{i}");
    let is_full = full[i as usize];
    let head_dim = match a.global_head_dim {
        Some(g) if is_full && g > 0 => g,
        _ => a.head_dim,
    };
    let k_eq_v = a.attention_k_eq_v && is_full;
    let n_kv_heads = match a.num_global_key_value_heads {
        Some(h) if k_eq_v => h,
        _ => a.num_key_value_heads,
    };
    let rope_params = a.rope_for(is_full);
    let base = rope_params.rope_theta.unwrap_or(10_000.0);
    let max = Some(a.max_position_embeddings);
    let rope = Rope::init(head_dim, base, a.rope_traditional, Some(&rope_params), max)?;
    let linear = |w: &mut Weights, name: &str, in_dims: i32| {
        Linear::load(w, &format!("{p}.{name}"), false, in_dims)
    };
    let norm = |w: &mut Weights, name: &str| RmsNorm::load(w, &format!("{p}.{name}"), eps);
    let has_kv = i < first_shared;
    let kv = if has_kv {
        Some(KvProj {
            k_proj: linear(w, "self_attn.k_proj", a.hidden_size)?,
            v_proj: if k_eq_v {
                None
            } else {
                Some(linear(w, "self_attn.v_proj", a.hidden_size)?)
            },
            k_norm: norm(w, "self_attn.k_norm")?,
            n_kv_heads,
        })
    } else {
        None
    };
    let q_dims = a.num_attention_heads * head_dim;
    let attn = Attention {
        q_proj: linear(w, "self_attn.q_proj", a.hidden_size)?,
        q_norm: norm(w, "self_attn.q_norm")?,
        kv,
        o_proj: linear(w, "self_attn.o_proj", q_dims)?,
        n_heads: a.num_attention_heads,
        eps,
        rope,
    };
    let double_wide = a.use_double_wide_mlp && i >= first_shared && first_shared > 0;
    let inter = a.intermediate_size * if double_wide { 2 } else { 1 };
    let per_layer = if pl_width > 0 {
        Some(PerLayerGate {
            gate: linear(w, "per_layer_input_gate", a.hidden_size)?,
            projection: linear(w, "per_layer_projection", pl_width)?,
            norm: norm(w, "post_per_layer_input_norm")?,
        })
    } else {
        None
    };
    // The last earlier layer of the same kind lends a shared layer its K/V.
    let kv_source = if has_kv {
        i as usize
    } else {
        (0..first_shared as usize)
            .rev()
            .find(|&j| full[j] == is_full)
            .ok_or_else(|| {
                LoadError::Unsupported(format!(
                    "layer {i} shares K/V but no earlier layer has its attention kind"
                ))
            })?
    };
    Ok(Block {
        attn,
        mlp: Mlp::load(
            w,
            &format!("{p}.mlp"),
            false,
            a.hidden_size,
            inter,
            Glu::Geglu,
        )?,
        moe: MoeBlock::load(w, &p, a)?,
        input_norm: norm(w, "input_layernorm")?,
        post_attn_norm: norm(w, "post_attention_layernorm")?,
        pre_ffw_norm: norm(w, "pre_feedforward_layernorm")?,
        post_ffw_norm: norm(w, "post_feedforward_layernorm")?,
        per_layer,
        layer_scalar: w.take(&format!("{p}.layer_scalar"))?,
        full: is_full,
        kv_source,
    })
}
