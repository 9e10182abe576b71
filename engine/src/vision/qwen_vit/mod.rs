//! Qwen3-VL's vision tower (the same class serves Qwen3.5: mlx-vlm's `qwen3_5.VisionModel`
//! subclasses it unchanged), as mlx-vlm 0.7.10 computes it, op for op
//! (mlx_vlm/models/qwen3_vl/vision.py: `VisionModel.__call__`).
//!
//! Input: the processor's patches `[n, C·T·P·P]` ([`super::qwen_vl`]) of the images in order,
//! and each image's grid `(t, gh, gw)`. With D the width, H the heads, d = D / H:
//!
//! - `PatchEmbed`: patches → `[n, T, P, P, C]` (reshape, channels moved last), a Conv3d with
//!   kernel = stride = (T, P, P) plus its bias → `[n, D]`;
//! - `fast_pos_embed_interpolate`: a learned `s × s` table (s² = num_position_embeddings)
//!   bilinearly sampled at `linspace(0, s−1, gh) × linspace(0, s−1, gw)` (f32 linspace,
//!   floor by an int cast, ceil = min(floor+1, s−1), the four corner rows weighted
//!   `(1−dh)(1−dw)`, `(1−dh)dw`, `dh(1−dw)`, `dh·dw` and summed in that order), then put in
//!   merge-block order `(t, gh/m, gw/m, m, m)`; added to the patches;
//! - `rot_pos_emb`: the 2-D rotary angles: a table `outer(arange(max side), inv_freq)` with
//!   `inv_freq = 1 / 10000^(arange(0, d/2, 2) / (d/2))`; each patch's row then column
//!   (merge-block order) looked up and concatenated → `[n, d/2]`;
//! - blocks: `h + attn(LN1(h))`, `h + mlp(LN2(h))` (LayerNorm eps 1e-6); attention: qkv
//!   → `[3, n, H, d]`, `x·cos + rotate_half(x)·sin` with cos/sin of the angles tiled twice,
//!   each image (frame) attending to itself (`cu_seqlens` splits) through the fused SDPA with
//!   the head dim zero-padded to 64, 80 or 128 (`ensure_fused_sdpa`), then `proj`; MLP:
//!   fc1, gelu-tanh (compiled), fc2;
//! - after the blocks listed in `deepstack_visual_indexes`: a deepstack merger (the m² patches
//!   of a merge block concatenated → LayerNorm over m²·D → fc1 → exact gelu → fc2); at the end
//!   the merger (LayerNorm over D, then the same MLP) → `[n / m², out_hidden_size]`.
//!
//! Weights: mlx-vlm's `Model.sanitize` (`model.visual` → `vision_tower`) and
//! `VisionModel.sanitize` (`position_ids` dropped; a Conv3d kernel stored PyTorch-style
//! `[out, C, T, P, P]` moved to MLX's `[out, T, P, P, C]`, recognised by `check_array_shape`), so
//! Hugging Face checkpoints and mlx-community conversions both load.

mod config;
pub(crate) mod ops_fused;

use config::conv_in_mlx_layout;
pub(crate) use config::tower_name;
pub use config::VisionConfig;
use ops_fused::{fused_sdpa, gelu, rotate_half, vision_cos_sin};
use std::collections::HashMap;
use std::path::Path;

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::ops::{self, LinspaceOptions};
use mlx_rs::{Array, Dtype};

use crate::load::weights::Weights;
use crate::load::LoadError;
use crate::model::layers::{gelu_approx, weak, Linear, RmsNorm};
use crate::plant::{self, Defect};

type R<T> = Result<T, Exception>;

/// What the tower could not do, naming the cause and the fix.
#[derive(Debug, thiserror::Error)]
pub enum QwenVitError {
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error("vision tower: {0}")]
    Mlx(#[from] Exception),
    #[error(
        "vision_config: {0} (the config.json of a Qwen3-VL / Qwen3.5 checkpoint has it as \
         written by its converter; do not edit it)"
    )]
    Config(String),
    #[error("vision input: {0}")]
    Input(String),
}

/// `PatchMerger`: `(LN →) reshape to m²·D → fc1 → gelu → fc2`; the norm before the shuffle
/// (the final merger) or after it (the deepstack mergers).
struct Merger {
    norm: RmsNorm,
    fc1: Linear,
    fc2: Linear,
    postshuffle: bool,
    width: i32,
}

impl Merger {
    fn load(
        w: &mut Weights,
        p: &str,
        cfg: &VisionConfig,
        postshuffle: bool,
    ) -> Result<Self, LoadError> {
        let width = cfg.hidden_size * cfg.spatial_merge_size * cfg.spatial_merge_size;
        let norm_dims = if postshuffle { width } else { cfg.hidden_size };
        Ok(Merger {
            norm: RmsNorm::load_layer_norm(w, &format!("{p}.norm"), norm_dims, 1e-6)?,
            fc1: Linear::load(w, &format!("{p}.linear_fc1"), true, [width, width])?,
            fc2: Linear::load(
                w,
                &format!("{p}.linear_fc2"),
                true,
                [cfg.out_hidden_size, width],
            )?,
            postshuffle,
            width,
        })
    }

    fn forward(&self, x: &Array) -> R<Array> {
        let x = match self.postshuffle {
            true => self.norm.forward(&x.reshape(&[-1, self.width])?)?,
            false => self.norm.forward(x)?,
        }
        .reshape(&[-1, self.width])?;
        self.fc2.forward(&gelu(&self.fc1.forward(&x)?)?)
    }
}

struct Block {
    norm1: RmsNorm,
    norm2: RmsNorm,
    qkv: Linear,
    proj: Linear,
    fc1: Linear,
    fc2: Linear,
}

/// The tower, loaded.
pub struct QwenVit {
    pub config: VisionConfig,
    patch_weight: Array,
    patch_bias: Array,
    pos_embed: Array,
    blocks: Vec<Block>,
    merger: Merger,
    deepstack: Vec<Merger>,
}

/// The tower's output for a batch of images: the merged features (one row per image token,
/// the images in order) and one deepstack feature tensor of the same shape per
/// `deepstack_visual_indexes` entry.
pub struct VitOutput {
    pub merged: Array,
    pub deepstack: Vec<Array>,
}

impl QwenVit {
    /// The tower of the checkpoint in `dir` (config.json's `vision_config`, the
    /// safetensors' tower tensors).
    pub fn load(dir: &Path) -> Result<Self, QwenVitError> {
        let raw = crate::load::read_json(&dir.join("config.json"))?;
        let all = Weights::load(dir)?.into_tensors();
        Self::from_checkpoint(&raw, all)
    }

    /// The tower from a checkpoint's config.json and all its tensors (the others are left
    /// alone: they are the language model's).
    pub fn from_checkpoint(
        raw: &serde_json::Value,
        all: HashMap<String, Array>,
    ) -> Result<Self, QwenVitError> {
        let cfg: VisionConfig = match raw.get("vision_config") {
            Some(v) => serde_json::from_value(v.clone())
                .map_err(|e| QwenVitError::Config(e.to_string()))?,
            None => {
                return Err(QwenVitError::Config(
                    "config.json has no `vision_config`: this checkpoint has no vision tower \
                     (a text-only conversion); use the multimodal checkpoint"
                        .into(),
                ))
            }
        };
        if raw.get("quantization").is_some() {
            return Err(QwenVitError::Config(
                "a quantized checkpoint: the image path loads dense (f32 / bf16 / f16) \
                 checkpoints only so far; use the unquantized one"
                    .into(),
            ));
        }
        let tensors: HashMap<String, Array> = all
            .into_iter()
            .filter_map(|(n, a)| tower_name(&n).map(|n| (n, a)))
            .collect();
        Self::from_tensors(cfg, tensors)
    }

    /// The tower from its tensors, named as under `vision_tower.` (without that prefix).
    pub fn from_tensors(
        cfg: VisionConfig,
        mut tensors: HashMap<String, Array>,
    ) -> Result<Self, QwenVitError> {
        cfg.check()?;
        let conv = "patch_embed.proj.weight";
        if let Some(k) = tensors.get(conv) {
            if k.ndim() == 5 && !conv_in_mlx_layout(k.shape()) {
                let moved = k.transpose_axes(&[0, 2, 3, 4, 1])?;
                tensors.insert(conv.into(), moved);
            }
        }
        let mut w = Weights::from_tensors(tensors);
        let (d, p, t, c) = (
            cfg.hidden_size,
            cfg.patch_size,
            cfg.temporal_patch_size,
            cfg.in_channels,
        );
        let patch_weight = w.take_shaped(conv, &[d, t, p, p, c])?;
        let patch_bias = w.take_shaped("patch_embed.proj.bias", &[d])?;
        let pos_embed = w.take_shaped("pos_embed.weight", &[cfg.num_position_embeddings, d])?;
        let mut blocks = Vec::with_capacity(cfg.depth);
        for i in 0..cfg.depth {
            let b = format!("blocks.{i}");
            blocks.push(Block {
                norm1: RmsNorm::load_layer_norm(&mut w, &format!("{b}.norm1"), d, 1e-6)?,
                norm2: RmsNorm::load_layer_norm(&mut w, &format!("{b}.norm2"), d, 1e-6)?,
                qkv: Linear::load(&mut w, &format!("{b}.attn.qkv"), true, [3 * d, d])?,
                proj: Linear::load(&mut w, &format!("{b}.attn.proj"), true, [d, d])?,
                fc1: Linear::load(
                    &mut w,
                    &format!("{b}.mlp.linear_fc1"),
                    true,
                    [cfg.intermediate_size, d],
                )?,
                fc2: Linear::load(
                    &mut w,
                    &format!("{b}.mlp.linear_fc2"),
                    true,
                    [d, cfg.intermediate_size],
                )?,
            });
        }
        let merger = Merger::load(&mut w, "merger", &cfg, false)?;
        let deepstack = (0..cfg.deepstack_visual_indexes.len())
            .map(|j| Merger::load(&mut w, &format!("deepstack_merger_list.{j}"), &cfg, true))
            .collect::<Result<Vec<_>, _>>()?;
        w.ensure_consumed("qwen3_vl vision tower", |_| false)?;
        Ok(QwenVit {
            config: cfg,
            patch_weight,
            patch_bias,
            pos_embed,
            blocks,
            merger,
            deepstack,
        })
    }

    /// The dtype the tower computes in (`Model.get_input_embeddings` casts the patches to it).
    pub fn dtype(&self) -> Dtype {
        self.patch_weight.dtype()
    }

    fn check_grids(&self, patches: &Array, grids: &[[i32; 3]]) -> Result<(), QwenVitError> {
        let m = self.config.spatial_merge_size;
        let row = self.config.in_channels
            * self.config.temporal_patch_size
            * self.config.patch_size.pow(2);
        let n: i64 = grids
            .iter()
            .map(|g| g.iter().map(|&v| v as i64).product::<i64>())
            .sum();
        if grids.is_empty()
            || grids
                .iter()
                .any(|g| g[0] < 1 || g[1] < m || g[2] < m || g[1] % m != 0 || g[2] % m != 0)
        {
            return Err(QwenVitError::Input(format!(
                "grids {grids:?}: each needs t >= 1 and sides that are multiples of the merge size {m}"
            )));
        }
        if patches.ndim() != 2 || patches.shape()[1] != row || patches.shape()[0] as i64 != n {
            return Err(QwenVitError::Input(format!(
                "patches of shape {:?} for grids {grids:?}: need [{n}, {row}] (the processor's \
                 pixel_values for these images)",
                patches.shape()
            )));
        }
        Ok(())
    }

    /// `VisionModel.__call__` on the patches of the images whose grids are `grids`
    /// (`(t, gh, gw)` each), in the tower's dtype.
    pub fn forward(&self, patches: &Array, grids: &[[i32; 3]]) -> Result<VitOutput, QwenVitError> {
        self.check_grids(patches, grids)?;
        let cfg = &self.config;
        let x = patches.as_dtype(self.dtype())?;
        // PatchEmbed.
        let x = x
            .reshape(&[
                -1,
                cfg.in_channels,
                cfg.temporal_patch_size,
                cfg.patch_size,
                cfg.patch_size,
            ])?
            .transpose_axes(&[0, 2, 3, 4, 1])?;
        let stride = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size);
        let x =
            ops::conv3d(&x, &self.patch_weight, stride, None, None, None)?.add(&self.patch_bias)?;
        let mut h = x
            .reshape(&[-1, cfg.hidden_size])?
            .add(&self.pos_embeds(grids)?)?;
        let rotary = self.rot_pos_emb(grids)?;
        let seq = h.shape()[0];
        h = h.reshape(&[seq, -1])?;
        let rotary = rotary.reshape(&[seq, -1])?;
        // cu_seqlens: one span per frame.
        let mut bounds = Vec::new();
        let mut at = 0;
        for g in grids {
            for _ in 0..g[0] {
                at += g[1] * g[2];
                bounds.push(at);
            }
        }
        bounds.pop();
        let (cos, sin) = vision_cos_sin(&rotary)?;
        let mut deepstack = Vec::new();
        for (i, blk) in self.blocks.iter().enumerate() {
            h = self.block(blk, &h, &bounds, &cos, &sin)?;
            if let Some(j) = cfg.deepstack_visual_indexes.iter().position(|&k| k == i) {
                deepstack.push(self.deepstack[j].forward(&h)?);
            }
        }
        Ok(VitOutput {
            merged: self.merger.forward(&h)?,
            deepstack,
        })
    }

    fn block(&self, b: &Block, h: &Array, bounds: &[i32], cos: &Array, sin: &Array) -> R<Array> {
        let h = h.add(&self.attention(b, &b.norm1.forward(h)?, bounds, cos, sin)?)?;
        let m = b
            .fc2
            .forward(&gelu_approx(&b.fc1.forward(&b.norm2.forward(&h)?)?)?)?;
        h.add(&m)
    }

    fn attention(
        &self,
        b: &Block,
        x: &Array,
        bounds: &[i32],
        cos: &Array,
        sin: &Array,
    ) -> R<Array> {
        let n = x.shape()[0];
        let heads = self.config.num_heads;
        let d = self.config.hidden_size / heads;
        let qkv = b
            .qkv
            .forward(x)?
            .reshape(&[n, 3, heads, -1])?
            .transpose_axes(&[1, 0, 2, 3])?;
        let parts = qkv.split_equal(3, 0)?;
        let rot = |t: &Array| -> R<Array> {
            let t = t.expand_dims(0)?;
            let out = t
                .multiply(cos)?
                .add(&rotate_half(&t)?.multiply(sin)?)?
                .as_dtype(t.dtype())?;
            out.index(0).transpose_axes(&[0, 2, 1, 3])
        };
        let q = rot(&parts[0])?;
        let k = rot(&parts[1])?;
        let v = parts[2].transpose_axes(&[0, 2, 1, 3])?;
        let scale = (d as f64).powf(-0.5) as f32;
        let (qs, ks, vs) = (
            q.split_at_indices(bounds, 2)?,
            k.split_at_indices(bounds, 2)?,
            v.split_at_indices(bounds, 2)?,
        );
        let mut outs = Vec::with_capacity(qs.len());
        for ((q, k), v) in qs.iter().zip(&ks).zip(&vs) {
            outs.push(fused_sdpa(q, k, v, scale)?);
        }
        let out = ops::concatenate(&outs, 2)?
            .transpose_axes(&[0, 2, 1, 3])?
            .reshape(&[n, -1])?;
        b.proj.forward(&out)
    }

    /// `fast_pos_embed_interpolate`.
    fn pos_embeds(&self, grids: &[[i32; 3]]) -> R<Array> {
        let s = (self.config.num_position_embeddings as f64).sqrt() as i32;
        let m = self.config.spatial_merge_size;
        let mut per_image = Vec::with_capacity(grids.len());
        for &[t, gh, gw] in grids {
            let lin = |n: i32| {
                ops::linspace::<f32, f32>(
                    0.0,
                    (s - 1) as f32,
                    LinspaceOptions {
                        count: n,
                        endpoint: true,
                    },
                )
            };
            let (hi, wi) = (lin(gh)?, lin(gw)?);
            let (hf, wf) = (hi.as_dtype(Dtype::Int32)?, wi.as_dtype(Dtype::Int32)?);
            let top = Array::from_int(s - 1);
            let one_i = Array::from_int(1);
            let hc = ops::minimum(&hf.add(&one_i)?, &top)?;
            let wc = ops::minimum(&wf.add(&one_i)?, &top)?;
            let dh = hi.subtract(&hf.as_dtype(Dtype::Float32)?)?;
            let dw = wi.subtract(&wf.as_dtype(Dtype::Float32)?)?;
            let side = Array::from_int(s);
            let (bh, bhc) = (hf.multiply(&side)?, hc.multiply(&side)?);
            let col = |a: &Array| a.expand_dims(1);
            let row = |a: &Array| a.expand_dims(0);
            let idx = [
                col(&bh)?.add(&row(&wf)?)?,
                col(&bh)?.add(&row(&wc)?)?,
                col(&bhc)?.add(&row(&wf)?)?,
                col(&bhc)?.add(&row(&wc)?)?,
            ];
            let one = Array::from_f32(1.0);
            let (ndh, ndw) = (one.subtract(&dh)?, one.subtract(&dw)?);
            let wts = [
                col(&ndh)?.multiply(&row(&ndw)?)?,
                col(&ndh)?.multiply(&row(&dw)?)?,
                col(&dh)?.multiply(&row(&ndw)?)?,
                col(&dh)?.multiply(&row(&dw)?)?,
            ];
            let idx = ops::stack(
                &idx.iter()
                    .map(|a| a.flatten(None, None))
                    .collect::<R<Vec<_>>>()?,
                0,
            )?;
            let wts = ops::stack(
                &wts.iter()
                    .map(|a| a.flatten(None, None))
                    .collect::<R<Vec<_>>>()?,
                0,
            )?;
            let rows = self.pos_embed.take_axis(&idx, 0)?;
            let rows = rows.multiply(&wts.as_dtype(rows.dtype())?.expand_dims(2)?)?;
            let e = rows
                .index(0)
                .add(rows.index(1))?
                .add(rows.index(2))?
                .add(rows.index(3))?;
            let dim = e.shape()[1];
            let e = ops::tile(&e, &[t, 1])?
                .reshape(&[t, gh, gw, dim])?
                .reshape(&[t, gh / m, m, gw / m, m, dim])?
                .transpose_axes(&[0, 1, 3, 2, 4, 5])?
                .reshape(&[-1, dim])?;
            per_image.push(e);
        }
        ops::concatenate(&per_image, 0)
    }

    /// `rot_pos_emb`: each patch's (row, column) angles, merge-block order.
    fn rot_pos_emb(&self, grids: &[[i32; 3]]) -> R<Array> {
        let m = self.config.spatial_merge_size;
        let dim = self.config.hidden_size / self.config.num_heads / 2;
        let max_hw = grids.iter().map(|g| g[1].max(g[2])).max().unwrap_or(1);
        // VisionRotaryEmbedding(dim)(max_hw).
        let exps = Array::arange::<_, f32>(0.0, dim as f32, 2.0)?
            .divide(weak(dim as f64, &Array::from_f32(0.0))?)?;
        let theta = Array::from_f32(10000.0);
        let inv_freq = Array::from_f32(1.0).divide(&theta.power(&exps)?)?;
        let seq = Array::arange::<_, f32>(0.0, max_hw as f32, 1.0)?;
        let table = ops::outer(&seq, &inv_freq)?;
        let (mut rows, mut cols) = (Vec::new(), Vec::new());
        for &[t, gh, gw] in grids {
            let mut r = Vec::new();
            let mut c = Vec::new();
            for bh in 0..gh / m {
                for bw in 0..gw / m {
                    for ih in 0..m {
                        for iw in 0..m {
                            r.push(bh * m + ih);
                            c.push(bw * m + iw);
                        }
                    }
                }
            }
            for _ in 0..t {
                rows.extend_from_slice(&r);
                cols.extend_from_slice(&c);
            }
        }
        if plant::is(Defect::VisionRopeAxesSwapped) {
            std::mem::swap(&mut rows, &mut cols);
        }
        let n = rows.len() as i32;
        let h = table.take_axis(Array::from_slice(&rows, &[n]), 0)?;
        let w = table.take_axis(Array::from_slice(&cols, &[n]), 0)?;
        ops::concatenate(&[h, w], -1)
    }
}
