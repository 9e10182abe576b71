//! The SigLIP vision tower as mlx-vlm 0.7.10 computes it for gemma3
//! (`mlx_vlm/models/gemma3/vision.py`: `VisionModel` → `SigLipVisionModel`), op for op:
//!
//!   x [B, H, W, C] (channels last, the model's dtype)
//!   h = conv2d(x, W_patch, stride = patch) + b_patch          (`nn.Conv2d`) → [B, H/p, W/p, D]
//!   h = flatten(h, 1, 2) + pos_embedding[0..N]                 N = (image_size / patch)²
//!   each layer (`EncoderLayer`):
//!     h = h + out(sdpa(q(ln1(h)), k(ln1(h)), v(ln1(h)), scale = head_dim^-½, no mask))
//!     h = h + fc2(gelu_approx(fc1(ln2(h))))                    (`GELUMLP`, approx="precise")
//!   out = post_layernorm(h)                                    → [B, N, D]
//!
//! Every LayerNorm is `mx.fast.layer_norm` with weight and bias. The layers' eps is the
//! config's `layer_norm_eps` (default 1e-6); the post-layernorm is built without an eps in
//! mlx-vlm, so it has `nn.LayerNorm`'s default 1e-5 — the reference's choice, kept.
//! The linears are `nn.Linear` with bias (`addmm`); gelu is MLX's compiled `gelu_approx`.
//!
//! Weights: `embeddings.patch_embedding.{weight,bias}`, `embeddings.position_embedding.weight`,
//! `encoder.layers.{i}.{self_attn.{q,k,v,out}_proj, layer_norm1, layer_norm2, mlp.fc1,
//! mlp.fc2}.{weight,bias}`, `post_layernorm.{weight,bias}` (under `vision_tower.vision_model.`
//! in a checkpoint). The patch conv is stored channels-last `[D, p, p, C]` (mlx-community's
//! conversions) or PyTorch's `[D, C, p, p]` (Google's checkpoints); [`sanitize_patch_conv`]
//! is mlx-vlm's `VisionModel.sanitize`, its shape test included.

use mlx_rs::error::Exception;
use mlx_rs::ops::conv2d;
use mlx_rs::{fast, Array};
use serde::Deserialize;

use crate::load::weights::Weights;
use crate::load::LoadError;
use crate::model::layers::{gelu_approx, Linear};
use crate::plant::{self, Defect};

type R<T> = Result<T, Exception>;

/// mlx-vlm's gemma3 `VisionConfig`, defaults included.
#[derive(Debug, Clone, Deserialize)]
pub struct SiglipConfig {
    pub model_type: String,
    pub num_hidden_layers: i32,
    pub hidden_size: i32,
    pub intermediate_size: i32,
    pub num_attention_heads: i32,
    pub patch_size: i32,
    #[serde(default = "default_image_size")]
    pub image_size: i32,
    #[serde(default = "default_channels")]
    pub num_channels: i32,
    #[serde(default = "default_eps")]
    pub layer_norm_eps: f32,
}

fn default_image_size() -> i32 {
    224
}
fn default_channels() -> i32 {
    3
}
fn default_eps() -> f32 {
    1e-6
}

impl SiglipConfig {
    /// Patches along a side of the image.
    pub fn patches_per_side(&self) -> i32 {
        self.image_size / self.patch_size
    }
}

/// `nn.LayerNorm` (affine, with bias): `fast::layer_norm(x, w, b, eps)`.
struct LayerNorm {
    weight: Array,
    bias: Array,
    eps: f32,
}

impl LayerNorm {
    fn load(w: &mut Weights, prefix: &str, dims: i32, eps: f32) -> Result<Self, LoadError> {
        Ok(LayerNorm {
            weight: w.take_shaped(&format!("{prefix}.weight"), &[dims])?,
            bias: w.take_shaped(&format!("{prefix}.bias"), &[dims])?,
            eps,
        })
    }

    fn forward(&self, x: &Array) -> R<Array> {
        fast::layer_norm(x, &self.weight, &self.bias, self.eps)
    }
}

/// One `EncoderLayer`: pre-norm attention and MLP, each added to the residual.
struct EncoderLayer {
    ln1: LayerNorm,
    ln2: LayerNorm,
    q: Linear,
    k: Linear,
    v: Linear,
    out: Linear,
    fc1: Linear,
    fc2: Linear,
    heads: i32,
    scale: f32,
}

impl EncoderLayer {
    fn load(w: &mut Weights, p: &str, c: &SiglipConfig) -> Result<Self, LoadError> {
        let (d, f) = (c.hidden_size, c.intermediate_size);
        let lin = |w: &mut Weights, name: &str, shape| {
            Linear::load(w, &format!("{p}.{name}"), true, shape)
        };
        if d % c.num_attention_heads != 0 {
            return Err(LoadError::Unsupported(format!(
                "vision_config: hidden_size {d} is not a multiple of num_attention_heads {} \
                 (mlx-vlm's VisionAttention refuses it too)",
                c.num_attention_heads
            )));
        }
        let head_dim = d / c.num_attention_heads;
        Ok(EncoderLayer {
            ln1: LayerNorm::load(w, &format!("{p}.layer_norm1"), d, c.layer_norm_eps)?,
            ln2: LayerNorm::load(w, &format!("{p}.layer_norm2"), d, c.layer_norm_eps)?,
            q: lin(w, "self_attn.q_proj", [d, d])?,
            k: lin(w, "self_attn.k_proj", [d, d])?,
            v: lin(w, "self_attn.v_proj", [d, d])?,
            out: lin(w, "self_attn.out_proj", [d, d])?,
            fc1: lin(w, "mlp.fc1", [f, d])?,
            fc2: lin(w, "mlp.fc2", [d, f])?,
            heads: c.num_attention_heads,
            // `head_dim ** (-0.5)`: a Python float, handed to the kernel as f32.
            scale: (head_dim as f64).powf(-0.5) as f32,
        })
    }

    /// `VisionAttention.__call__`: [B, L, D] → heads [B, n, L, D/n] → sdpa → back.
    fn attention(&self, x: &Array) -> R<Array> {
        let (q, k, v) = (self.q.forward(x)?, self.k.forward(x)?, self.v.forward(x)?);
        let s = q.shape();
        let (b, l) = (s[0], s[1]);
        let heads = |t: Array| {
            t.reshape(&[b, l, self.heads, -1])?
                .transpose_axes(&[0, 2, 1, 3])
        };
        let o = fast::scaled_dot_product_attention(
            heads(q)?,
            heads(k)?,
            heads(v)?,
            self.scale,
            None,
            None,
        )?;
        let o = o.transpose_axes(&[0, 2, 1, 3])?.reshape(&[b, l, -1])?;
        self.out.forward(&o)
    }

    fn forward(&self, x: &Array) -> R<Array> {
        let h = x.add(self.attention(&self.ln1.forward(x)?)?)?;
        let r = self
            .fc2
            .forward(&gelu_approx(&self.fc1.forward(&self.ln2.forward(&h)?)?)?)?;
        h.add(r)
    }
}

/// The tower: patch embedding, position embedding, the encoder, the post-layernorm.
pub struct Siglip {
    pub config: SiglipConfig,
    patch_weight: Array,
    patch_bias: Array,
    positions: Array,
    layers: Vec<EncoderLayer>,
    post: LayerNorm,
}

/// mlx-vlm's `check_array_shape` on a 4-D conv weight: channels-last (MLX's `[O, kH, kW, I]`)
/// when O is at least kH and kW and kH == kW.
fn is_channels_last(shape: &[i32]) -> bool {
    let [o, kh, kw, _] = shape else { return false };
    o >= kh && o >= kw && kh == kw
}

/// `VisionModel.sanitize`: a patch conv weight stored as PyTorch's `[O, I, kH, kW]` becomes
/// `[O, kH, kW, I]`; one that already passes `check_array_shape` is kept.
pub fn sanitize_patch_conv(w: Array) -> R<Array> {
    match is_channels_last(w.shape()) {
        true => Ok(w),
        false => w.transpose_axes(&[0, 2, 3, 1]),
    }
}

impl Siglip {
    /// From the tower's tensors without their checkpoint prefix (`embeddings.…`,
    /// `encoder.…`, `post_layernorm.…`).
    pub fn load(config: SiglipConfig, w: &mut Weights) -> Result<Self, LoadError> {
        let c = &config;
        if !["siglip_vision_model", "gemma3", "gemma3_vision"].contains(&c.model_type.as_str()) {
            return Err(LoadError::Unsupported(format!(
                "vision_config.model_type `{}`: gemma3's tower is SigLIP (`siglip_vision_model`)",
                c.model_type
            )));
        }
        let (d, p, ch) = (c.hidden_size, c.patch_size, c.num_channels);
        let conv = w.take("embeddings.patch_embedding.weight")?;
        let patch_weight = sanitize_patch_conv(conv)?;
        if patch_weight.shape() != [d, p, p, ch] {
            return Err(LoadError::Weights(format!(
                "`embeddings.patch_embedding.weight` is {:?} after mlx-vlm's sanitize; \
                 vision_config makes it [{d}, {p}, {p}, {ch}] (or PyTorch's [{d}, {ch}, {p}, {p}])",
                patch_weight.shape()
            )));
        }
        let n = c.patches_per_side() * c.patches_per_side();
        let layers = (0..c.num_hidden_layers)
            .map(|i| EncoderLayer::load(w, &format!("encoder.layers.{i}"), c))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Siglip {
            patch_bias: w.take_shaped("embeddings.patch_embedding.bias", &[d])?,
            positions: w.take_shaped("embeddings.position_embedding.weight", &[n, d])?,
            patch_weight,
            layers,
            // `nn.LayerNorm(hidden_size)`: the default eps, not the config's.
            post: LayerNorm::load(w, "post_layernorm", d, 1e-5)?,
            config,
        })
    }

    /// Pixels [B, H, W, C] (channels last, already in the model's dtype) → the
    /// post-layernorm hidden states [B, N, D] (what gemma3 hands its projector).
    pub fn forward(&self, x: &Array) -> R<Array> {
        let h = conv2d(
            x,
            &self.patch_weight,
            (self.config.patch_size, self.config.patch_size),
            None,
            None,
            None,
        )?
        .add(&self.patch_bias)?;
        let s = h.shape();
        let h = h.reshape(&[s[0], s[1] * s[2], s[3]])?;
        // `position_embedding(arange(N)[None])`: all N rows in order, [1, N, D].
        let mut h = h.add(self.positions.expand_dims(0)?)?;
        for layer in &self.layers {
            h = layer.forward(&h)?;
        }
        match plant::is(Defect::VisionTowerNormOff) {
            // Planted: the layers' eps on the post-layernorm.
            true => fast::layer_norm(
                &h,
                &self.post.weight,
                &self.post.bias,
                self.config.layer_norm_eps,
            ),
            false => self.post.forward(&h),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_patch_conv_is_transposed_only_when_its_shape_says_pytorch() {
        // Google's SigLIP: [1152, 3, 14, 14] → [1152, 14, 14, 3]; MLX's is kept.
        assert!(!is_channels_last(&[1152, 3, 14, 14]));
        assert!(is_channels_last(&[1152, 14, 14, 3]));
        assert!(is_channels_last(&[32, 8, 8, 3]));
        assert!(!is_channels_last(&[32, 3, 8, 8]));
        let w = Array::zeros::<f32>(&[32, 3, 8, 8]).unwrap();
        assert_eq!(sanitize_patch_conv(w).unwrap().shape(), &[32, 8, 8, 3]);
    }
}
