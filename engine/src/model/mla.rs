//! Multi-head latent attention (MLA) as mlx-lm 0.32.2's `deepseek_v3.DeepseekV3Attention`
//! computes it, with `mla.py`'s `MultiLinear` for the absorbed key / value projections:
//!
//!   q          = q_b(rms_norm(q_a(x)))   (or q_proj(x) without q_lora_rank)  → [B, H, L, nope + rope]
//!   q_nope, q_pe = split(q, [nope])
//!   c, k_pe    = split(kv_a_proj_with_mqa(x), [kv_lora_rank]);  latent = rms_norm(c)
//!   q_pe, k_pe = rope(q_pe), rope(k_pe)                (traditional, one K head)
//!   cache      ← (latent [B, 1, L, kv_lora_rank] as keys, k_pe [B, 1, L, rope] as values)
//!   pe         = (q_pe · scale) @ k_peᵀ, masked to finfo.min where the causal mask is false
//!   prefill:   k = latent @ embed_q [H, kv_lora, nope],  v = latent @ unembed_outᵀ
//!              out = sdpa(q_nope, k, v, scale, mask = pe)
//!   decode:    q' = q_nope @ embed_qᵀ;  out = unembed_out(sdpa(q', latent, latent, scale, pe))
//!   o_proj(out)
//!
//! The scale is (nope + rope)^-½, times mscale² under yarn with `mscale_all_dim`. mlx-lm's
//! sanitize splits Hugging Face's `kv_b_proj` [H·(nope + v), kv_lora] into `embed_q` and
//! `unembed_out` ([`split_kv_b_proj`]). The cache is the standard one, keys and values of
//! different widths, so the batch lane and the prompt cache treat it as any K/V cache.

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{fast, Array};

use super::decoder::{kv_cache, Mixer};
use super::layers::{Linear, Quantized, RmsNorm, Rope};
use super::quantized::ops::quantized_matmul;
use super::shard::{slice, Part, Split};
use crate::cache::{causal_mask, kv_of, Cache, Kv, Mask};
use crate::load::config::RopeScaling;
use crate::load::weights::Weights;
use crate::load::LoadError;
use crate::plant::{self, Defect};
use crate::scalar::weak;

type R<T> = Result<T, Exception>;

/// `mla.MultiLinear` / `QuantizedMultiLinear`: one [out, in] matrix per head.
pub struct MultiLinear {
    /// [heads, out, in] (packed along `in` when quantized).
    pub weight: Array,
    pub quantized: Option<Quantized>,
}

impl MultiLinear {
    fn load(w: &mut Weights, prefix: &str, shape: [i32; 3]) -> Result<Self, LoadError> {
        let (weight, quantized) = Quantized::load_weight(w, prefix, &shape)?;
        Ok(MultiLinear { weight, quantized })
    }

    /// mlx-lm's `shard_heads`: this rank's heads (`w[sh:eh]`) of every parameter.
    fn shard_heads(&mut self, part: Part, what: &str) -> Result<(), LoadError> {
        let cut = |a: &Array, name: &str| slice(a, 0, part, &format!("{what}.{name}"));
        self.weight = cut(&self.weight, "weight")?;
        if let Some(q) = &mut self.quantized {
            q.scales = cut(&q.scales, "scales")?;
            if let Some(b) = &q.biases {
                q.biases = Some(cut(b, "biases")?);
            }
        }
        Ok(())
    }

    /// `x @ W.swap_axes(-1, -2)` (`transpose`) or `x @ W`, per head.
    fn forward(&self, x: &Array, transpose: bool) -> R<Array> {
        match &self.quantized {
            Some(q) => quantized_matmul(
                x,
                &self.weight,
                &q.scales,
                q.biases.as_ref(),
                transpose,
                q.params,
            ),
            None if transpose => x.matmul(self.weight.swap_axes(-1, -2)?),
            None => x.matmul(&self.weight),
        }
    }
}

/// The query's projection: one linear, or DeepSeek's low-rank pair with a norm between.
pub enum QueryProj {
    Plain(Linear),
    LowRank { a: Linear, norm: RmsNorm, b: Linear },
}

/// What an MLA layer is built from (a family's args, mapped).
pub struct MlaShape {
    pub hidden: i32,
    pub heads: i32,
    pub q_lora_rank: Option<i32>,
    pub kv_lora_rank: i32,
    pub nope: i32,
    pub rope: i32,
    pub v: i32,
    pub attention_bias: bool,
    /// The eps of `q_a_layernorm` and `kv_a_layernorm` (DeepSeek: 1e-6; GLM: rms_norm_eps).
    pub latent_norm_eps: f32,
    pub rope_theta: f32,
    pub rope_scaling: Option<RopeScaling>,
    pub max_positions: i32,
}

impl MlaShape {
    /// `q_head_dim^-½`, times `s²` with `s = 0.1 · mscale_all_dim · ln(factor) + 1` when the
    /// RoPE scaling has a nonzero `mscale_all_dim` and a factor above 1 (Python floats).
    pub fn scale(&self) -> f64 {
        let mut scale = ((self.nope + self.rope) as f64).powf(-0.5);
        if let Some(s) = &self.rope_scaling {
            let all_dim = s.mscale_all_dim.unwrap_or(0.0);
            if all_dim != 0.0 {
                let factor = s.factor.unwrap_or(1.0);
                if factor > 1.0 {
                    let m = 0.1 * all_dim * factor.ln() + 1.0;
                    scale = scale * m * m;
                }
            }
        }
        scale
    }
}

/// One MLA layer (see the module header).
pub struct Mla {
    pub q: QueryProj,
    pub kv_a_proj_with_mqa: Linear,
    pub kv_a_layernorm: RmsNorm,
    pub embed_q: MultiLinear,
    pub unembed_out: MultiLinear,
    pub o_proj: Linear,
    pub heads: i32,
    pub nope: i32,
    pub rope_dims: i32,
    pub kv_lora_rank: i32,
    pub scale: f64,
    pub rope: Rope,
}

impl Mla {
    /// Layer `p`'s `self_attn` (after [`split_kv_b_proj`] made its `embed_q` / `unembed_out`).
    pub fn load(w: &mut Weights, p: &str, s: &MlaShape) -> Result<Self, LoadError> {
        let a = format!("{p}.self_attn");
        let q_dims = s.heads * (s.nope + s.rope);
        let q = match s.q_lora_rank {
            None => QueryProj::Plain(Linear::load(
                w,
                &format!("{a}.q_proj"),
                false,
                [q_dims, s.hidden],
            )?),
            Some(r) => QueryProj::LowRank {
                a: Linear::load(w, &format!("{a}.q_a_proj"), s.attention_bias, [r, s.hidden])?,
                norm: RmsNorm::load(w, &format!("{a}.q_a_layernorm"), r, s.latent_norm_eps)?,
                b: Linear::load(w, &format!("{a}.q_b_proj"), false, [q_dims, r])?,
            },
        };
        let kv_a_proj_with_mqa = Linear::load(
            w,
            &format!("{a}.kv_a_proj_with_mqa"),
            s.attention_bias,
            [s.kv_lora_rank + s.rope, s.hidden],
        )?;
        let kv_a_layernorm = RmsNorm::load(
            w,
            &format!("{a}.kv_a_layernorm"),
            s.kv_lora_rank,
            s.latent_norm_eps,
        )?;
        let embed_q = MultiLinear::load(
            w,
            &format!("{a}.embed_q"),
            [s.heads, s.kv_lora_rank, s.nope],
        )?;
        let unembed_out = MultiLinear::load(
            w,
            &format!("{a}.unembed_out"),
            [s.heads, s.v, s.kv_lora_rank],
        )?;
        let o_proj = Linear::load(
            w,
            &format!("{a}.o_proj"),
            s.attention_bias,
            [s.hidden, s.heads * s.v],
        )?;
        let rope = Rope::init(
            s.rope,
            s.rope_theta,
            true,
            s.rope_scaling.as_ref(),
            Some(s.max_positions),
        )?;
        Ok(Mla {
            q,
            kv_a_proj_with_mqa,
            kv_a_layernorm,
            embed_q,
            unembed_out,
            o_proj,
            heads: s.heads,
            nope: s.nope,
            rope_dims: s.rope,
            kv_lora_rank: s.kv_lora_rank,
            scale: s.scale(),
            rope,
        })
    }

    /// The query's two halves [B, H, L, nope] and [B, H, L, rope] (not yet rotated), and
    /// the low-rank query `q_a_layernorm(q_a_proj(x))` where there is one (DeepSeek-V3.2's
    /// indexer reads it).
    pub fn query(&self, x: &Array) -> R<(Array, Array, Option<Array>)> {
        let (b, l) = (x.shape()[0], x.shape()[1]);
        let (q, qr) = match &self.q {
            QueryProj::Plain(p) => (p.forward(x)?, None),
            QueryProj::LowRank { a, norm, b } => {
                let qr = norm.forward(&a.forward(x)?)?;
                (b.forward(&qr)?, Some(qr))
            }
        };
        let q = q
            .reshape(&[b, l, self.heads, self.nope + self.rope_dims])?
            .transpose_axes(&[0, 2, 1, 3])?;
        // Planted: the rotated half taken from the front of each head instead of its end.
        let cut = match plant::is(Defect::MlaRopeOnWrongHalf) {
            true => self.rope_dims,
            false => self.nope,
        };
        let parts = q.split_at_indices(&[cut], -1)?;
        let (front, back) = (parts[0].clone(), parts[1].clone());
        Ok(match plant::is(Defect::MlaRopeOnWrongHalf) {
            true => (back, front, qr),
            false => (front, back, qr),
        })
    }

    /// The new positions' latent [B, 1, L, kv_lora] (normed) and rope keys [B, 1, L, rope]
    /// (not yet rotated).
    pub fn latent(&self, x: &Array) -> R<(Array, Array)> {
        let (b, l) = (x.shape()[0], x.shape()[1]);
        let kv = self.kv_a_proj_with_mqa.forward(x)?;
        let parts = kv.split_at_indices(&[self.kv_lora_rank], -1)?;
        let k_pe = parts[1]
            .reshape(&[b, l, 1, self.rope_dims])?
            .transpose_axes(&[0, 2, 1, 3])?;
        let latent = self.kv_a_layernorm.forward(&parts[0])?.expand_dims(1)?;
        Ok((latent, k_pe))
    }

    /// Attention of the rotated query halves over the cached latent and rope keys; `mask`
    /// a boolean array (true = attend) or None. [B, L, H·v] before `o_proj`.
    pub fn attend(
        &self,
        q_nope: &Array,
        q_pe: &Array,
        latent: &Array,
        k_pe: &Array,
        mask: Option<&Array>,
    ) -> R<Array> {
        let (b, l) = (q_nope.shape()[0], q_nope.shape()[2]);
        let scaled = q_pe.multiply(weak(self.scale, q_pe)?)?;
        let mut pe_scores = scaled.matmul(k_pe.swap_axes(-1, -2)?)?;
        if let Some(m) = mask {
            let lowest = super::sdpa::lowest(&pe_scores)?;
            pe_scores = mlx_rs::ops::select(m, &pe_scores, &lowest)?;
        }
        let scale = self.scale as f32;
        let pe = fast::ScaledDotProductAttentionMask::Array(&pe_scores);
        let out = if l == 1 {
            let q = self.embed_q.forward(q_nope, true)?;
            let out =
                fast::scaled_dot_product_attention(&q, latent, latent, scale, Some(pe), None)?;
            self.unembed_out.forward(&out, true)?
        } else {
            let k = self.embed_q.forward(latent, false)?;
            let v = self.unembed_out.forward(latent, true)?;
            fast::scaled_dot_product_attention(q_nope, &k, &v, scale, Some(pe), None)?
        };
        out.transpose_axes(&[0, 2, 1, 3])?.reshape(&[b, l, -1])
    }
}

/// mlx-lm's mask for `n` new tokens after `offset` cached ones, as `create_attention_mask(…,
/// return_array=True)` gives it: the causal mode becomes its boolean array.
pub fn mask_array(mask: &Mask, n: i32, offset: i32) -> R<Option<Array>> {
    Ok(match mask {
        Mask::None => None,
        Mask::Causal => Some(causal_mask(n, offset, None)?),
        Mask::Array(m) => Some(m.clone()),
    })
}

/// The cached latent and rope keys after this step's are appended (dense only: mlx-lm's MLA
/// reads them as arrays, so a quantized cache fails there too).
pub fn update(cache: &mut dyn Cache, latent: Array, k_pe: Array) -> R<(Array, Array)> {
    match kv_of(cache)?.update_and_fetch(latent, k_pe)? {
        Kv::Dense(l, k) => Ok((l, k)),
        Kv::Quantized { .. } => Err(Exception::custom(
            "multi-head latent attention keeps its latent cache dense: mlx-lm's deepseek_v3 \
             attention reads it as arrays, so a quantized KV cache is refused",
        )),
    }
}

impl Mixer for Mla {
    fn forward(&self, x: &Array, mask: &Mask, cache: &mut dyn Cache) -> R<Array> {
        let (q_nope, q_pe, _) = self.query(x)?;
        let (latent, k_pe) = self.latent(x)?;
        let offset = cache.rope_offset();
        let before = cache.offset();
        let q_pe = self.rope.forward(&q_pe, &offset)?;
        let k_pe = self.rope.forward(&k_pe, &offset)?;
        let (latent, k_pe) = update(cache, latent, k_pe)?;
        let mask = mask_array(mask, x.shape()[1], before)?;
        let out = self.attend(&q_nope, &q_pe, &latent, &k_pe, mask.as_ref())?;
        self.o_proj.forward(&out)
    }

    fn make_cache(&self) -> Box<dyn Cache> {
        kv_cache(&self.rope)
    }

    fn linears(&self) -> Vec<(&'static str, &Linear)> {
        let mut named = match &self.q {
            QueryProj::Plain(p) => vec![("self_attn.q_proj", p)],
            QueryProj::LowRank { a, b, .. } => {
                vec![("self_attn.q_a_proj", a), ("self_attn.q_b_proj", b)]
            }
        };
        // mlx-lm's default keys: every nn.Linear of the block. `embed_q` / `unembed_out`
        // are `MultiLinear`s (no `to_lora`, not a Linear), so they get no adapter.
        if !plant::is(Defect::MlaLatentProjLoraDropped) {
            named.push(("self_attn.kv_a_proj_with_mqa", &self.kv_a_proj_with_mqa));
        }
        named.push(("self_attn.o_proj", &self.o_proj));
        named
    }

    /// `deepseek_v3.Model.shard` on the attention: the query's last projection (`q_b_proj`,
    /// or `q_proj`) by columns (whole heads), `embed_q` / `unembed_out` cut to this rank's
    /// heads, `o_proj` by rows (one `all_sum`); the latent path (`q_a_proj`,
    /// `kv_a_proj_with_mqa`, their norms) stays whole on every rank.
    fn shard(&mut self, part: Part, layer: &str) -> Result<(), LoadError> {
        let attn = format!("{layer}.self_attn");
        let n = part.size as i32;
        if self.heads % n != 0 {
            return Err(LoadError::Unsupported(format!(
                "{attn}: {} heads do not split over {n} ranks (tensor parallel needs them to \
                 divide by the rank count; try --pipeline)",
                self.heads
            )));
        }
        match &mut self.q {
            QueryProj::Plain(p) => p.shard(Split::Columns, part, &format!("{attn}.q_proj"))?,
            QueryProj::LowRank { b, .. } => {
                b.shard(Split::Columns, part, &format!("{attn}.q_b_proj"))?
            }
        }
        // Planted: the absorbed projections keep the next rank's heads.
        let heads_part = match plant::is(Defect::MlaHeadsOfOtherRank) {
            true => Part {
                rank: (part.rank + 1) % part.size,
                ..part
            },
            false => part,
        };
        self.embed_q
            .shard_heads(heads_part, &format!("{attn}.embed_q"))?;
        self.unembed_out
            .shard_heads(heads_part, &format!("{attn}.unembed_out"))?;
        self.o_proj
            .shard(Split::Rows, part, &format!("{attn}.o_proj"))?;
        self.heads /= n;
        Ok(())
    }
}

/// mlx-lm's sanitize of Hugging Face's `kv_b_proj` [H·(nope + v), kv_lora] under `attn`:
/// viewed [H, nope + v, kv_lora], its first `nope` rows per head transposed into
/// `embed_q` [H, kv_lora, nope], the rest `unembed_out` [H, v, kv_lora]. A quantized
/// `kv_b_proj` (mlx-lm dequantizes, splits and quantizes again) is refused.
pub fn split_kv_b_proj(
    w: &mut Weights,
    attn: &str,
    heads: i32,
    nope: i32,
    v: i32,
) -> Result<(), LoadError> {
    let name = format!("{attn}.kv_b_proj.weight");
    if !w.contains(&name) {
        return Ok(());
    }
    if w.contains(&format!("{attn}.kv_b_proj.scales")) {
        return Err(LoadError::Unsupported(format!(
            "`{name}` is quantized: mlx-lm dequantizes, splits and re-quantizes it, which is not \
             gated here; convert the checkpoint with mlx_lm.convert (it stores embed_q / unembed_out)"
        )));
    }
    let kv_b = w.take(&name)?;
    let err = |e: Exception| LoadError::Weights(format!("`{name}`: {}", e.what()));
    let kv_b = kv_b.reshape(&[heads, nope + v, -1]).map_err(err)?;
    let wk = kv_b
        .index((.., ..nope, ..))
        .swap_axes(-1, -2)
        .and_then(|t| t.contiguous())
        .map_err(err)?;
    let wv = kv_b.index((.., nope.., ..)).contiguous().map_err(err)?;
    w.insert(format!("{attn}.embed_q.weight"), wk);
    w.insert(format!("{attn}.unembed_out.weight"), wv);
    Ok(())
}
