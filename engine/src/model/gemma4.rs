//! Gemma 4 text (`gemma4_text`) as mlx-lm 0.32.2 implements it, on the shared decoder
//! (`decoder.rs`: the per-layer inputs are its side inputs, the gate and scalar its tail,
//! the KV-shared layers borrowers):
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

use super::decoder::{
    Built, Decoder, Dims, EmbedScale, FeedForward, Lent, Mixer, Residual, SideInputs, SideLoader,
    Style, Tail,
};
use super::layers::{
    gelu_approx, layer_cache, weak, Embedding, Glu, Linear, Mlp, RmsNorm, Rope, Softcap,
};
use super::shard::Part;
use crate::cache::{kv_of, Cache, Kv, KvQuant, Mask, QuantSdpa, RopeOffset};
use crate::load::config::ModelConfig;
use crate::load::weights::Weights;
use crate::load::LoadError;
pub use args::Gemma4Args;
use moe::MoeBlock;

type R<T> = Result<T, Exception>;

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
    /// None on a KV-shared layer: it borrows its lender's.
    kv: Option<KvProj>,
    o_proj: Linear,
    n_heads: i32,
    eps: f32,
    rope: Rope,
    /// Sliding layers' window (None: full attention).
    window: Option<i32>,
}

impl Attention {
    /// Attention over this layer's own K/V (`cache`) or a lender's (`lent`); gives the K/V
    /// it attended over and the RoPE position it used.
    fn attend(
        &self,
        x: &Array,
        mask: &Mask,
        cache: Option<&mut dyn Cache>,
        lent: Option<&Lent>,
    ) -> R<(Array, Lent)> {
        let (b, l) = (x.shape()[0], x.shape()[1]);
        let heads = [0, 2, 1, 3];
        let q =
            self.q_norm
                .forward(&self.q_proj.forward(x)?.reshape(&[b, l, self.n_heads, -1])?)?;
        let (kv, offset) = match (cache, lent, &self.kv) {
            (Some(cache), None, Some(kv)) => {
                let offset = self.lent_offset(cache);
                let k = kv.k_proj.forward(x)?.reshape(&[b, l, kv.n_kv_heads, -1])?;
                let v = match &kv.v_proj {
                    Some(v_proj) => v_proj.forward(x)?.reshape(&[b, l, kv.n_kv_heads, -1])?,
                    None => k.clone(),
                };
                let k = kv.k_norm.forward(&k)?.transpose_axes(&heads)?;
                let k = self.rope.forward(&k, &offset)?;
                let v = fast::rms_norm(&v, None, self.eps)?.transpose_axes(&heads)?;
                (kv_of(cache)?.update_and_fetch(k, v)?, offset)
            }
            // optiq attends borrowed quantized K/V through its unfused quantized SDPA.
            (None, Some(lent), None) => (borrowed(&lent.kv), lent.offset.clone()),
            _ => {
                return Err(Exception::custom(
                    "a gemma4 layer attends over its own K/V (with a cache) or, KV-shared, \
                     over its lender's",
                ))
            }
        };
        let q = self.rope.forward(&q.transpose_axes(&heads)?, &offset)?;
        let out = super::sdpa::attend(&q, &kv, 1.0, mask)?;
        let out = out.transpose_axes(&heads)?.reshape(&[b, l, -1])?;
        Ok((self.o_proj.forward(&out)?, Lent { kv, offset }))
    }
}

/// A lender's K/V as a borrower attends over them (quantized ones through mlx-lm's SDPA).
fn borrowed(kv: &Kv) -> Kv {
    match kv {
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
    }
}

impl Mixer for Attention {
    fn forward(&self, x: &Array, mask: &Mask, cache: &mut dyn Cache) -> R<Array> {
        Ok(self.attend(x, mask, Some(cache), None)?.0)
    }

    fn forward_lending(&self, x: &Array, mask: &Mask, cache: &mut dyn Cache) -> R<(Array, Lent)> {
        self.attend(x, mask, Some(cache), None)
    }

    fn forward_borrowing(&self, x: &Array, mask: &Mask, lent: &Lent) -> R<Array> {
        Ok(self.attend(x, mask, None, Some(lent))?.0)
    }

    /// mlx-lm passes `mx.array(cache.offset)`: the array form of the position.
    fn lent_offset(&self, cache: &dyn Cache) -> RopeOffset {
        match cache.rope_offset() {
            RopeOffset::Int(o) => RopeOffset::Array(Array::from_int(o)),
            o => o,
        }
    }

    fn make_cache(&self) -> Box<dyn Cache> {
        layer_cache(self.window.is_none(), self.window.unwrap_or(0))
    }

    fn window(&self) -> Option<i32> {
        self.window
    }

    /// KV-shared layers have no k/v projections, K = V layers no v_proj.
    fn linears(&self) -> Vec<(&'static str, &Linear)> {
        let mut named = vec![("self_attn.q_proj", &self.q_proj)];
        if let Some(kv) = &self.kv {
            named.push(("self_attn.k_proj", &kv.k_proj));
            if let Some(v) = &kv.v_proj {
                named.push(("self_attn.v_proj", v));
            }
        }
        named.push(("self_attn.o_proj", &self.o_proj));
        named
    }

    fn shard(&mut self, _part: Part, _layer: &str) -> Result<(), LoadError> {
        Err(not_sharded())
    }
}

fn not_sharded() -> LoadError {
    LoadError::Unsupported("gemma4_text is not split across ranks (mlx-lm has no shard)".into())
}

/// `down(geglu(gate, up))` (double-wide on the KV-sharing layers), with the experts beside
/// it (`enable_moe_block`), which read the residual stream through their own norm.
struct Ffn {
    mlp: Mlp,
    moe: Option<MoeBlock>,
}

impl FeedForward for Ffn {
    fn forward(&self, x: &Array) -> R<Array> {
        match &self.moe {
            None => self.mlp.forward(x),
            Some(_) => Err(Exception::custom(
                "gemma4's experts read the residual stream: forward_with_residual",
            )),
        }
    }

    fn forward_with_residual(&self, x: &Array, h: &Array) -> R<Array> {
        let r = self.mlp.forward(x)?;
        match &self.moe {
            Some(moe) => moe.forward(h, &r),
            None => Ok(r),
        }
    }

    fn linears(&self, _module: &str) -> Vec<(String, &Linear)> {
        let named = self.mlp.named_linears().map(|(n, l)| (n.to_owned(), l));
        named.into()
    }

    fn shard(&mut self, _part: Part, _prefix: &str) -> Result<(), LoadError> {
        Err(not_sharded())
    }
}

/// After the feed-forward: the small Gemma 4s' per-layer input gate
/// (`h + norm(proj(gelu_tanh(gate(h)) · p_layer))`), then `h · layer_scalar`.
struct LayerTail {
    per_layer: Option<PerLayerGate>,
    layer_scalar: Array,
}

struct PerLayerGate {
    gate: Linear,
    projection: Linear,
    norm: RmsNorm,
}

impl Tail for LayerTail {
    fn forward(&self, mut h: Array, side: Option<&Array>) -> R<Array> {
        if let (Some(g), Some(input)) = (&self.per_layer, side) {
            let gate = gelu_approx(&g.gate.forward(&h)?)?.multiply(input)?;
            let gate = g.norm.forward(&g.projection.forward(&gate)?)?;
            h = h.add(&gate)?;
        }
        h.multiply(&self.layer_scalar)
    }

    fn linears(&self) -> Vec<(&'static str, &Linear)> {
        match &self.per_layer {
            Some(pl) => vec![
                ("per_layer_input_gate", &pl.gate),
                ("per_layer_projection", &pl.projection),
            ],
            None => Vec::new(),
        }
    }
}

/// The model-level half of the per-layer inputs.
struct PerLayerInputs {
    embed: Embedding,
    model_projection: Linear,
    projection_norm: RmsNorm,
    width: i32,
    layers: i32,
    hidden: i32,
}

impl SideInputs for PerLayerInputs {
    /// One view per layer [B, L, width]: a Slice and a Squeeze each, as mlx-lm's
    /// `inputs[:, :, i, :]` builds it (an integer index in mlx-rs reshapes instead).
    fn make(&self, ids: &Array, h0: &Array) -> R<Vec<Array>> {
        let all = self.all(ids, h0)?;
        let cuts: Vec<i32> = (1..self.layers).collect();
        let views = all.split_at_indices(&cuts, 2)?;
        views.iter().map(|v| v.squeeze_axes(&[2])).collect()
    }
}

impl PerLayerInputs {
    /// Per-layer inputs [B, L, layers, width] from the ids and the scaled embeddings.
    fn all(&self, ids: &Array, h: &Array) -> R<Array> {
        let p = self;
        let (b, l) = (ids.shape()[0], ids.shape()[1]);
        let shape = [b, l, self.layers, p.width];
        let from_ids = p.embed.forward(ids)?;
        let from_ids = from_ids
            .multiply(weak((p.width as f64).sqrt(), &from_ids)?)?
            .reshape(&shape)?;
        let projected = p.model_projection.forward(h)?;
        let projected = projected
            .multiply(weak((self.hidden as f64).powf(-0.5), &projected)?)?
            .reshape(&shape)?;
        let projected = p.projection_norm.forward(&projected)?;
        let sum = projected.add(&from_ids)?;
        sum.multiply(weak(2f64.powf(-0.5), &sum)?)
    }
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

/// The model: the decoder with Gemma 4's style — four norms per layer, the embedding
/// scale, per-layer inputs, the logit softcap — and its layers.
pub fn load(config: &ModelConfig, mut w: Weights) -> Result<Decoder, LoadError> {
    let a: Gemma4Args = config.parse()?;
    w.set_quantization(config.quantization.clone());
    let full = a.full_attention()?;
    let n = a.num_hidden_layers;
    let first_shared = n - a.num_kv_shared_layers;
    w.discard(|name| sanitized_away(name, first_shared));
    let dims = Dims {
        layers: n,
        hidden: a.hidden_size,
        vocab: a.vocab_size,
        rms_norm_eps: a.rms_norm_eps,
        tie_word_embeddings: a.tie_word_embeddings,
        ffn_module: "mlp",
    };
    let style = Style {
        norm: RmsNorm::load,
        sandwich: true,
        residual: Residual::Add,
        embed_scale: Some(EmbedScale {
            scale: (a.hidden_size as f64).sqrt() as f32,
            through: None,
        }),
        side: per_layer_inputs(&a),
        logit_softcap: a.final_logit_softcapping.map(Softcap::Compiled),
        // LoRA is not available on the mixture-of-experts Gemma 4.
        lora: !a.enable_moe_block,
        assistant_target: true,
        ..Style::default()
    };
    Decoder::load_styled(config, w, dims, style, |w, _p, i| {
        layer(w, &a, &full, i, first_shared)
    })
}

/// The loader of the per-layer inputs' model-level half (small Gemma 4s), None without
/// them: the per-layer embedding [vocab_size_per_layer_input, layers · width], the
/// projection [layers · width, hidden] and its norm [width].
fn per_layer_inputs(a: &Gemma4Args) -> Option<SideLoader> {
    let width = a.hidden_size_per_layer_input.filter(|&w| w > 0)?;
    let (layers, hidden, eps) = (a.num_hidden_layers, a.hidden_size, a.rms_norm_eps);
    let rows = a.vocab_size_per_layer_input;
    Some(Box::new(move |w: &mut Weights| {
        let all = layers * width;
        let side: Box<dyn SideInputs> = Box::new(PerLayerInputs {
            embed: Embedding::load(w, "model.embed_tokens_per_layer", [rows, all])?,
            model_projection: Linear::load(
                w,
                "model.per_layer_model_projection",
                false,
                [all, hidden],
            )?,
            projection_norm: RmsNorm::load(w, "model.per_layer_projection_norm", width, eps)?,
            width,
            layers,
            hidden,
        });
        Ok(side)
    }))
}

/// Layer `i`'s attention: q (and, unless it borrows an earlier layer's, its K/V
/// projections), o, the q/k norms, its RoPE and window.
fn attention(
    w: &mut Weights,
    a: &Gemma4Args,
    i: i32,
    is_full: bool,
    has_kv: bool,
) -> Result<Attention, LoadError> {
    let p = format!("model.layers.{i}");
    let (h, eps) = (a.hidden_size, a.rms_norm_eps);
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
    let linear = |w: &mut Weights, name: &str, out_in: [i32; 2]| {
        Linear::load(w, &format!("{p}.self_attn.{name}"), false, out_in)
    };
    let norm = |w: &mut Weights, name: &str| {
        RmsNorm::load(w, &format!("{p}.self_attn.{name}"), head_dim, eps)
    };
    let (q_dims, kv_dims) = (a.num_attention_heads * head_dim, n_kv_heads * head_dim);
    let q_proj = linear(w, "q_proj", [q_dims, h])?;
    let q_norm = norm(w, "q_norm")?;
    let o_proj = linear(w, "o_proj", [h, q_dims])?;
    let kv = if has_kv {
        Some(KvProj {
            k_proj: linear(w, "k_proj", [kv_dims, h])?,
            v_proj: match k_eq_v {
                true => None,
                false => Some(linear(w, "v_proj", [kv_dims, h])?),
            },
            k_norm: norm(w, "k_norm")?,
            n_kv_heads,
        })
    } else {
        None
    };
    Ok(Attention {
        q_proj,
        q_norm,
        kv,
        o_proj,
        n_heads: a.num_attention_heads,
        eps,
        rope,
        window: (!is_full).then_some(a.sliding_window),
    })
}

/// Layer `i` of a Gemma 4 model: its per-layer input norm and scalar, attention, GeGLU MLP
/// (and experts), per-layer input gate, and the layer that lends it K/V.
fn layer(
    w: &mut Weights,
    a: &Gemma4Args,
    full: &[bool],
    i: i32,
    first_shared: i32,
) -> Result<Built, LoadError> {
    let pl_width = a.hidden_size_per_layer_input.unwrap_or(0);
    let (h, eps) = (a.hidden_size, a.rms_norm_eps);
    let p = format!("model.layers.{i}");
    let is_full = full[i as usize];
    let pl_norm = (pl_width > 0)
        .then(|| RmsNorm::load(w, &format!("{p}.post_per_layer_input_norm"), h, eps))
        .transpose()?;
    let layer_scalar = w.take_shaped(&format!("{p}.layer_scalar"), &[1])?;
    let has_kv = i < first_shared;
    let attn = attention(w, a, i, is_full, has_kv)?;
    let double_wide = a.use_double_wide_mlp && i >= first_shared && first_shared > 0;
    let inter = a.intermediate_size * if double_wide { 2 } else { 1 };
    let ffn = Ffn {
        mlp: Mlp::load(w, &format!("{p}.mlp"), false, h, inter, Glu::Geglu)?,
        moe: MoeBlock::load(w, &p, a)?,
    };
    let per_layer = match pl_norm {
        Some(norm) => Some(PerLayerGate {
            gate: Linear::load(
                w,
                &format!("{p}.per_layer_input_gate"),
                false,
                [pl_width, h],
            )?,
            projection: Linear::load(
                w,
                &format!("{p}.per_layer_projection"),
                false,
                [h, pl_width],
            )?,
            norm,
        }),
        None => None,
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
    let tail = LayerTail {
        per_layer,
        layer_scalar,
    };
    Ok(Built {
        mixer: Box::new(attn),
        ffn: Some(Box::new(ffn)),
        tail: Some(Box::new(tail)),
        borrows: (kv_source != i as usize).then_some(kv_source),
    })
}
