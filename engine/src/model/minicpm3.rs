//! `minicpm3` (MiniCPM 3) as mlx-lm 0.32.2's minicpm3.py computes it: dense layers whose
//! attention is latent (MLA's projections) but not absorbed — `kv_b_proj` expands the latent
//! into per-head keys and values, which a standard cache keeps:
//!
//!   q            = q_b(rms_norm(q_a(x)))  → [B, H, L, nope + rope];  q_nope, q_pe = split(q, [nope])
//!   c, k_pe      = split(kv_a_proj_with_mqa(x), [kv_lora_rank])
//!   k_nope, v    = split(kv_b_proj(rms_norm(c)) → [B, H, L, nope + v], [nope])     (v = hidden / H)
//!   q_pe, k_pe   = rope(q_pe), rope(k_pe)     (SuScaledRoPE: long factors, input scale)
//!   attn         = sdpa([q_nope | q_pe], [k_nope | k_pe broadcast to H heads], v, (nope + rope)^-½, causal)
//!   h            = h + attn · (scale_depth / √layers);  h = h + mlp(...) · (scale_depth / √layers)
//!   h0           = embed(ids) · scale_emb
//!   logits       = lm_head(norm(h) / (hidden / dim_model_base))   (tied: embed.as_linear(norm(h)))
//!
//! The latent norms keep `nn.RMSNorm`'s default eps 1e-5.

use mlx_rs::error::Exception;
use mlx_rs::ops::{broadcast_to, concatenate};
use mlx_rs::Array;
use serde::Deserialize;

use super::decoder::{kv_cache, Decoder, Dims, EmbedScale, Mixer, Residual, Style};
use super::layers::{Glu, Linear, Mlp, RmsNorm, Rope};
use super::shard::Part;
use crate::cache::{kv_of, Cache, Mask};
use crate::load::config::{Factors, ModelConfig, RopeScaling};
use crate::load::weights::Weights;
use crate::load::LoadError;

type R<T> = Result<T, Exception>;

/// `minicpm3.ModelArgs` (its required fields required here too).
#[derive(Debug, Clone, Deserialize)]
struct Args {
    hidden_size: i32,
    dim_model_base: f64,
    num_hidden_layers: i32,
    intermediate_size: i32,
    num_attention_heads: i32,
    rms_norm_eps: f32,
    vocab_size: i32,
    q_lora_rank: i32,
    qk_nope_head_dim: i32,
    qk_rope_head_dim: i32,
    kv_lora_rank: i32,
    scale_depth: f64,
    scale_emb: f64,
    max_position_embeddings: i32,
    #[serde(default)]
    attention_bias: bool,
    #[serde(default = "default_theta")]
    rope_theta: f32,
    rope_scaling: Option<RopeScaling>,
    #[serde(default)]
    tie_word_embeddings: bool,
}

fn default_theta() -> f32 {
    1_000_000.0
}

/// MiniCPM 3's attention (see the module header).
struct Attention {
    q_a_proj: Linear,
    q_a_layernorm: RmsNorm,
    q_b_proj: Linear,
    kv_a_proj_with_mqa: Linear,
    kv_a_layernorm: RmsNorm,
    kv_b_proj: Linear,
    o_proj: Linear,
    heads: i32,
    nope: i32,
    rope_dims: i32,
    kv_lora_rank: i32,
    scale: f32,
    rope: Rope,
}

impl Attention {
    fn load(w: &mut Weights, p: &str, a: &Args, rope: Rope) -> Result<Self, LoadError> {
        let n = |name: &str| format!("{p}.self_attn.{name}");
        let (h, heads, bias) = (a.hidden_size, a.num_attention_heads, a.attention_bias);
        let (nope, rope_dims, r) = (a.qk_nope_head_dim, a.qk_rope_head_dim, a.kv_lora_rank);
        let v = h / heads;
        let q_head = nope + rope_dims;
        Ok(Attention {
            q_a_proj: Linear::load(w, &n("q_a_proj"), bias, [a.q_lora_rank, h])?,
            q_a_layernorm: RmsNorm::load(w, &n("q_a_layernorm"), a.q_lora_rank, 1e-5)?,
            q_b_proj: Linear::load(w, &n("q_b_proj"), false, [heads * q_head, a.q_lora_rank])?,
            kv_a_proj_with_mqa: Linear::load(
                w,
                &n("kv_a_proj_with_mqa"),
                bias,
                [r + rope_dims, h],
            )?,
            kv_a_layernorm: RmsNorm::load(w, &n("kv_a_layernorm"), r, 1e-5)?,
            kv_b_proj: Linear::load(w, &n("kv_b_proj"), false, [heads * (nope + v), r])?,
            o_proj: Linear::load(w, &n("o_proj"), bias, [h, heads * v])?,
            heads,
            nope,
            rope_dims,
            kv_lora_rank: r,
            scale: (q_head as f64).powf(-0.5) as f32,
            rope,
        })
    }
}

impl Mixer for Attention {
    fn forward(&self, x: &Array, mask: &Mask, cache: &mut dyn Cache) -> R<Array> {
        let (b, l) = (x.shape()[0], x.shape()[1]);
        let q = self
            .q_b_proj
            .forward(&self.q_a_layernorm.forward(&self.q_a_proj.forward(x)?)?)?;
        let q = q
            .reshape(&[b, l, self.heads, -1])?
            .transpose_axes(&[0, 2, 1, 3])?;
        let q = q.split_at_indices(&[self.nope], -1)?;
        // Planted (as in mla.rs): the rotated half taken from the front of each head.
        let q = match crate::plant::is(crate::plant::Defect::MlaRopeOnWrongHalf) {
            true => {
                let whole = concatenate(&[&q[0], &q[1]], -1)?;
                let parts = whole.split_at_indices(&[self.rope_dims], -1)?;
                vec![parts[1].clone(), parts[0].clone()]
            }
            false => q,
        };
        let kv = self.kv_a_proj_with_mqa.forward(x)?;
        let kv = kv.split_at_indices(&[self.kv_lora_rank], -1)?;
        let k_pe = kv[1]
            .reshape(&[b, l, 1, self.rope_dims])?
            .transpose_axes(&[0, 2, 1, 3])?;
        let expanded = self
            .kv_b_proj
            .forward(&self.kv_a_layernorm.forward(&kv[0])?)?;
        let expanded = expanded
            .reshape(&[b, l, self.heads, -1])?
            .transpose_axes(&[0, 2, 1, 3])?;
        let kv = expanded.split_at_indices(&[self.nope], -1)?;
        let offset = cache.rope_offset();
        let q_pe = self.rope.forward(&q[1], &offset)?;
        let k_pe = self.rope.forward(&k_pe, &offset)?;
        let k_pe = broadcast_to(&k_pe, &[b, self.heads, l, self.rope_dims])?;
        let queries = concatenate(&[&q[0], &q_pe], -1)?;
        let keys = concatenate(&[&kv[0], &k_pe], -1)?;
        let cache = kv_of(cache)?;
        let fetched = cache.update_and_fetch(keys, kv[1].clone())?;
        let out = super::sdpa::attend(&queries, &fetched, self.scale, mask)?;
        let out = out.transpose_axes(&[0, 2, 1, 3])?.reshape(&[b, l, -1])?;
        self.o_proj.forward(&out)
    }

    fn make_cache(&self) -> Box<dyn Cache> {
        kv_cache(&self.rope)
    }

    /// mlx-lm's default keys: every nn.Linear of the block, `kv_b_proj` included (not
    /// absorbed here, so not a `MultiLinear` as in deepseek_v3).
    fn linears(&self) -> Vec<(&'static str, &Linear)> {
        let mut named = vec![
            ("self_attn.q_a_proj", &self.q_a_proj),
            ("self_attn.q_b_proj", &self.q_b_proj),
        ];
        if !crate::plant::is(crate::plant::Defect::MlaLatentProjLoraDropped) {
            named.push(("self_attn.kv_a_proj_with_mqa", &self.kv_a_proj_with_mqa));
        }
        named.push(("self_attn.kv_b_proj", &self.kv_b_proj));
        named.push(("self_attn.o_proj", &self.o_proj));
        named
    }

    fn shard(&mut self, _part: Part, layer: &str) -> Result<(), LoadError> {
        Err(LoadError::Unsupported(format!(
            "{layer}: minicpm3 is not split across ranks (mlx-lm 0.32.2 does not shard it)"
        )))
    }
}

/// minicpm3's `SuScaledRoPE`, built from `rope_scaling` as its attention reads it (an
/// absent `original_max_position_embeddings` is 4096, absent factors 1.0).
fn rope(a: &Args) -> Result<Rope, LoadError> {
    let Some(s) = a.rope_scaling.as_ref() else {
        return Err(LoadError::Unsupported(
            "minicpm3 needs `rope_scaling` (mlx-lm's minicpm3 reads its longrope settings)".into(),
        ));
    };
    let orig = s.original_max_position_embeddings.unwrap_or(4096.0);
    let mut s = s.clone();
    s.long_factor.get_or_insert(Factors::One(1.0));
    super::rope::su_scaled(
        a.qk_rope_head_dim,
        a.rope_theta,
        &s,
        a.max_position_embeddings as f64,
        orig,
    )
}

pub fn load(config: &ModelConfig, w: Weights) -> Result<Decoder, LoadError> {
    let a: Args = config.parse()?;
    let depth = a.scale_depth / (a.num_hidden_layers as f64).powf(0.5);
    let style = Style {
        residual: Residual::Scaled(depth as f32),
        embed_scale: Some(EmbedScale {
            scale: a.scale_emb as f32,
            through: None,
        }),
        ..Style::default()
    };
    let dims = Dims {
        layers: a.num_hidden_layers,
        hidden: a.hidden_size,
        vocab: a.vocab_size,
        rms_norm_eps: a.rms_norm_eps,
        tie_word_embeddings: a.tie_word_embeddings,
        ffn_module: "mlp",
    };
    let decoder = Decoder::load_styled(config, w, dims, style, |w, p, _| {
        let mixer: Box<dyn Mixer> = Box::new(Attention::load(w, p, &a, rope(&a)?)?);
        let mlp = Mlp::load(
            w,
            &format!("{p}.mlp"),
            false,
            a.hidden_size,
            a.intermediate_size,
            Glu::Swiglu,
        )?;
        Ok((mixer, Box::new(mlp)))
    })?;
    Ok(decoder.with_untied_head_input_divisor(a.hidden_size as f64 / a.dim_model_base))
}
