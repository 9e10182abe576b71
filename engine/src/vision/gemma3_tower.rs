//! gemma3 with its vision tower, as mlx-vlm 0.7.10's `mlx_vlm/models/gemma3/gemma3.py`
//! computes it: the SigLIP tower ([`super::siglip`]), `Gemma3MultiModalProjector`, and
//! `Model.get_input_embeddings` / `prepare_inputs_for_multimodal` (the merge); then the
//! language model from the merged embeddings.
//!
//! Projector (`Gemma3MultiModalProjector.__call__`), x = the tower's output [B, N, Dv],
//! p = image_size / patch_size, t = √mm_tokens_per_image, k = p / t:
//!
//!   x → [B, Dv, p, p] → [B, p, p, Dv] → avg pool k×k, stride k (`nn.AvgPool2d`: the
//!   non-overlapping windows [B, t, k, t, k, Dv] → [B, t, t, k, k, Dv], mean over the k, k
//!   axes) → [B, t², Dv] → rms_norm(·, 1 + w, eps = vision layer_norm_eps) → · W [Dv, Dt]
//!   (`einsum("btm,md->btd")`, a matmul) → cast to x's dtype.
//!
//! Merge (`prepare_inputs_for_multimodal`), ids [1, L]:
//!
//!   text positions (id ≠ image_token_index, id ≠ pad_token_id): embed(id)
//!   pad positions (id = pad_token_id, 0 by default): zeros
//!   image positions, in order: the features / √hidden_size, every image's t² rows in turn
//!
//! where hidden_size is the TOP-LEVEL config's (mlx-vlm's `ModelConfig.hidden_size`, 2048
//! when config.json has none, as Google's gemma-3 configs have none — not the text model's
//! width). The division is in the features' dtype (a weak Python scalar); the merge itself
//! only moves values (f32 there, cast back to the embeddings' dtype: exact for bf16), so
//! here it is one gather. The language model then scales the merged embeddings by
//! bf16(√hidden) as it scales token embeddings (`Gemma3Model`, scale_inputs_embeds).
//!
//! Attention stays causal (sliding windows on the local layers) on the image path too: mlx-vlm
//! builds a 4-D mask in `get_input_embeddings`, but its generate_step hands it on as
//! `attention_mask_4d`, which gemma3's `LanguageModel` never reads.
//!
//! The text model is this engine's gemma3_text (`model::gemma`, bit-exact with mlx-lm),
//! from the text config as mlx-vlm reads it ([`vlm_text_config`]): mlx-vlm's `TextConfig`
//! defaults (sliding_window 1024, max_position_embeddings 4096, vocab_size 262208 from
//! `text_config` only) and its RoPE bases (`rope_global_base_freq`, default 1e6, in place
//! of `rope_theta`; `rope_parameters` unread). mlx-vlm's `LanguageModel.sanitize` always
//! ties the head (it tests for a bare `lm_head.weight` key that a checkpoint never has), so
//! a stored `language_model.lm_head.weight` is dropped here as it is overwritten there.

use std::path::Path;

use mlx_rs::error::Exception;
use mlx_rs::ops::{concatenate, zeros_dtype};
use mlx_rs::{fast, Array};
use serde_json::Value;

use super::siglip::{Siglip, SiglipConfig};
use crate::cache::Cache;
use crate::load::config::ModelConfig;
use crate::load::weights::Weights;
use crate::load::LoadError;
use crate::model::decoder::Decoder;
use crate::model::LanguageModel;
use crate::plant::{self, Defect};

const TOWER: &str = "vision_tower.vision_model.";
const PROJECTOR: &str = "multi_modal_projector.";

/// Why images could not be merged into a prompt. Each message names the cause and the fix.
#[derive(Debug, thiserror::Error)]
pub enum ImageInputError {
    #[error(
        "the prompt holds {tokens} image token(s) (id {id}) for {images} image(s) of {per_image} \
         tokens each: expand each image marker to the image sequence \
         (vision::gemma3::Gemma3Processor::expand_prompt) once per image"
    )]
    TokenCount {
        tokens: usize,
        id: u32,
        images: usize,
        per_image: i32,
    },
    #[error(
        "pixel tensor {index} is {shape:?}: this tower takes [1, 3, {size}, {size}]; preprocess \
         the image with the model's preprocessor_config.json (vision::gemma3)"
    )]
    PixelShape {
        index: usize,
        shape: Vec<i32>,
        size: i32,
    },
    #[error("MLX: {0}")]
    Mlx(#[from] Exception),
}

/// `Gemma3MultiModalProjector`.
struct Projector {
    /// `mm_input_projection_weight` [Dv, Dt].
    weight: Array,
    /// `1.0 + mm_soft_emb_norm.weight`, formed as mlx-vlm forms it on each call (in w's dtype).
    norm: Array,
    eps: f32,
    patches: i32,
    tokens_per_side: i32,
    kernel: i32,
}

impl Projector {
    fn forward(&self, x: &Array) -> Result<Array, Exception> {
        let s = x.shape();
        let (b, l) = (s[0], s[2]);
        let (p, t, k) = (self.patches, self.tokens_per_side, self.kernel);
        let v = x
            .transpose_axes(&[0, 2, 1])?
            .reshape(&[b, l, p, p])?
            .transpose_axes(&[0, 2, 3, 1])?;
        // nn.AvgPool2d's non-overlapping windows, then the mean over the window axes.
        let pooled = v
            .reshape(&[b, t, k, t, k, l])?
            .transpose_axes(&[0, 1, 3, 2, 4, 5])?
            .mean_axes(&[-3, -2], None)?;
        let pooled = pooled
            .transpose_axes(&[0, 3, 1, 2])?
            .reshape(&[b, l, t * t])?
            .transpose_axes(&[0, 2, 1])?;
        let normed = fast::rms_norm(&pooled, Some(&self.norm), self.eps)?;
        normed.matmul(&self.weight)?.as_dtype(x.dtype())
    }
}

/// gemma3 with its vision tower: `embed_with_images` makes a prompt's input embeddings, the
/// text decoder runs them (`forward_embeddings`).
pub struct Gemma3Vision {
    pub tower: Siglip,
    projector: Projector,
    pub text: Decoder,
    pub image_token: u32,
    pad_token: u32,
    /// `ModelConfig.hidden_size ** 0.5` (top-level hidden_size, default 2048).
    merge_divisor: f64,
}

fn int(raw: &Value, key: &str, default: i64) -> i64 {
    raw.get(key).and_then(Value::as_i64).unwrap_or(default)
}

/// The config as mlx-vlm's gemma3 reads its language model's settings, for this engine's
/// gemma3 wrapper: `text_config` with mlx-vlm's `TextConfig` defaults where they differ from
/// mlx-lm's, its RoPE bases, and its vocabulary (text_config's, else 262208) also at the top
/// (where the wrapper reads it).
pub fn vlm_text_config(config: &ModelConfig) -> Result<ModelConfig, LoadError> {
    let mut raw = config.raw.clone();
    let Some(Value::Object(text)) = raw.get_mut("text_config") else {
        return Err(LoadError::Config {
            path: config.path.clone(),
            message: "a gemma3 vision model keeps its language model's settings in \
                      `text_config`, which this config lacks"
                .into(),
        });
    };
    text.entry("sliding_window").or_insert(1024.into());
    text.entry("max_position_embeddings").or_insert(4096.into());
    let vocab = text.entry("vocab_size").or_insert(262_208.into()).clone();
    let global = text
        .get("rope_global_base_freq")
        .cloned()
        .unwrap_or(1_000_000.0.into());
    text.insert("rope_theta".into(), global);
    text.remove("rope_parameters");
    raw["vocab_size"] = vocab;
    ModelConfig::from_value(config.path.clone(), raw)
}

impl Gemma3Vision {
    /// Loads a gemma3 checkpoint with its vision tower (mlx-community's layout or Google's:
    /// the same names, the patch conv channels-last or PyTorch's).
    pub fn load(dir: &Path) -> Result<Self, LoadError> {
        let config = ModelConfig::read(dir)?;
        let w = Weights::load(dir)?;
        Self::from_parts(&config, w)
    }

    /// As `load`, from a config and tensors already read.
    pub fn from_parts(config: &ModelConfig, mut w: Weights) -> Result<Self, LoadError> {
        if config.model_type != "gemma3" {
            return Err(LoadError::Unsupported(format!(
                "model_type `{}`: this loader is gemma3's (Gemma3ForConditionalGeneration)",
                config.model_type
            )));
        }
        let raw = &config.raw;
        let vision_raw = raw.get("vision_config").cloned().unwrap_or(Value::Null);
        let vc: SiglipConfig =
            serde_json::from_value(vision_raw).map_err(|e| LoadError::Config {
                path: config.path.clone(),
                message: format!("vision_config: {e}"),
            })?;
        let ours = |n: &str| n.starts_with("vision_tower.") || n.starts_with(PROJECTOR);
        let names: Vec<String> = w.remaining().into_iter().filter(|n| ours(n)).collect();
        if let Some(q) = names.iter().find(|n| n.ends_with(".scales")) {
            return Err(LoadError::Unsupported(format!(
                "`{q}`: a quantized vision tower is not supported yet; use a checkpoint whose \
                 vision tower is unquantized (e.g. Google's bf16 weights)"
            )));
        }
        let mut tower_w = Weights::from_tensors(Vec::new());
        let mut proj_w = Weights::from_tensors(Vec::new());
        for n in &names {
            let a = w.take(n)?;
            match (n.strip_prefix(TOWER), n.strip_prefix(PROJECTOR)) {
                (Some(rest), _) => tower_w.insert(rest.to_owned(), a),
                (_, Some(rest)) => proj_w.insert(rest.to_owned(), a),
                // mlx-vlm's strict load rejects a tensor its tower does not have.
                _ => {
                    return Err(LoadError::Weights(format!(
                        "`{n}`: not a tensor of gemma3's SigLIP tower (mlx-vlm names them \
                         `{TOWER}…`)"
                    )))
                }
            }
        }
        let tower = Siglip::load(vc.clone(), &mut tower_w)?;
        tower_w.ensure_consumed("gemma3 vision tower", |_| false)?;

        let text_raw = raw.get("text_config").cloned().unwrap_or(Value::Null);
        let mm_tokens = int(&text_raw, "mm_tokens_per_image", 256);
        let dt = int(&text_raw, "hidden_size", 0) as i32;
        let p = vc.patches_per_side();
        let t = (mm_tokens as f64).sqrt() as i32;
        if t <= 0 || p % t != 0 || vc.image_size % vc.patch_size != 0 {
            return Err(LoadError::Unsupported(format!(
                "mm_tokens_per_image {mm_tokens} with {p}x{p} patches: gemma3's projector pools \
                 the patches in non-overlapping square windows, so √mm_tokens_per_image must \
                 divide image_size / patch_size"
            )));
        }
        let weight = proj_w.take_shaped("mm_input_projection_weight", &[vc.hidden_size, dt])?;
        let norm_w = proj_w.take_shaped("mm_soft_emb_norm.weight", &[vc.hidden_size])?;
        proj_w.ensure_consumed("gemma3 multimodal projector", |_| false)?;
        let one = Array::from_f32(1.0).as_dtype(norm_w.dtype())?;
        let projector = Projector {
            weight,
            norm: one.add(&norm_w)?,
            eps: vc.layer_norm_eps,
            patches: p,
            tokens_per_side: t,
            kernel: p / t,
        };

        // mlx-vlm ties gemma3's head whatever the checkpoint stores.
        w.discard(|n| n == "language_model.lm_head.weight");
        let text = crate::model::wrapper::gemma3_decoder(&vlm_text_config(config)?, w)?;
        Ok(Gemma3Vision {
            tower,
            projector,
            text,
            image_token: int(raw, "image_token_index", 262_144) as u32,
            pad_token: int(raw, "pad_token_id", 0) as u32,
            merge_divisor: (int(raw, "hidden_size", 2048) as f64).sqrt(),
        })
    }

    /// Image tokens per image (mm_tokens_per_image).
    pub fn tokens_per_image(&self) -> i32 {
        self.projector.tokens_per_side * self.projector.tokens_per_side
    }

    /// Pixels [n, 3, H, W] f32 (the processor's tensors, stacked) → the tower's output
    /// [n, N, Dv] in the model's dtype (`vision_tower(pixel_values.transpose(0, 2, 3, 1)
    /// .astype(embeds.dtype))`).
    pub fn tower_output(&self, pixels: &Array) -> Result<Array, Exception> {
        let x = pixels
            .transpose_axes(&[0, 2, 3, 1])?
            .as_dtype(self.text.activation_dtype())?;
        self.tower.forward(&x)
    }

    /// The projected image features [n, t², Dt] of the tower's output.
    pub fn project(&self, tower_out: &Array) -> Result<Array, Exception> {
        self.projector.forward(tower_out)
    }

    /// The stacked pixel tensors [n, 3, S, S] of `pixels` (each [1, 3, S, S]).
    fn stack(&self, pixels: &[Array]) -> Result<Array, ImageInputError> {
        let size = self.tower.config.image_size;
        let want = [1, self.tower.config.num_channels, size, size];
        if let Some((index, p)) = pixels.iter().enumerate().find(|(_, p)| p.shape() != want) {
            return Err(ImageInputError::PixelShape {
                index,
                shape: p.shape().to_vec(),
                size,
            });
        }
        Ok(concatenate(pixels, 0)?)
    }

    /// A prompt's input embeddings [1, L, Dt] (not yet scaled by √hidden: the decoder does
    /// that), the images' features at its image tokens, in order. `pixels`: one [1, 3, S, S]
    /// f32 tensor per image, as `vision::gemma3` makes them.
    pub fn embed_with_images(
        &self,
        ids: &[u32],
        pixels: &[Array],
    ) -> Result<Array, ImageInputError> {
        let per_image = self.tokens_per_image();
        let tokens = ids.iter().filter(|&&id| id == self.image_token).count();
        if tokens != pixels.len() * per_image as usize {
            return Err(ImageInputError::TokenCount {
                tokens,
                id: self.image_token,
                images: pixels.len(),
                per_image,
            });
        }
        let ids_arr = Array::from_slice(ids, &[1, ids.len() as i32]);
        let embeds = self.text.embed(&ids_arr)?;
        let d = embeds.shape()[2];
        let l = ids.len() as i32;
        let mut rows = vec![embeds.reshape(&[l, d])?];
        let n_feat = tokens as i32;
        if n_feat > 0 {
            let feats = self.project(&self.tower_output(&self.stack(pixels)?)?)?;
            let divisor = crate::scalar::weak(self.merge_divisor, &feats)?;
            let scaled = feats.divide(&divisor)?;
            rows.push(scaled.reshape(&[n_feat, d])?.as_dtype(embeds.dtype())?);
        }
        rows.push(zeros_dtype(&[1, d], embeds.dtype())?);
        let table = concatenate(&rows, 0)?;
        // Each position's row of the table: its own embedding, the next image feature, or
        // the zero row (pad).
        let mut next = l;
        let mut index: Vec<i32> = Vec::with_capacity(ids.len());
        for (i, &id) in ids.iter().enumerate() {
            index.push(if id == self.image_token {
                next += 1;
                next - 1
            } else if id == self.pad_token {
                l + n_feat
            } else {
                i as i32
            });
        }
        if plant::is(Defect::ImageFeaturesOffByOne) {
            // Planted: every image position takes the feature meant for the one before it
            // (the first image position keeps its token's own embedding).
            let img: Vec<usize> = (0..ids.len())
                .filter(|&i| ids[i] == self.image_token)
                .collect();
            for w in img.windows(2).rev() {
                index[w[1]] = index[w[0]];
            }
            if let Some(&first) = img.first() {
                index[first] = first as i32;
            }
        }
        let index = Array::from_slice(&index, &[l]);
        Ok(table.take_axis(&index, 0)?.expand_dims(0)?)
    }

    /// Fresh caches for the text model.
    pub fn make_caches(&self) -> Vec<Box<dyn Cache>> {
        self.text.make_caches()
    }

    /// Logits [1, L, vocab] of merged input embeddings (`embed_with_images`), through
    /// `caches`; later tokens go through `self.text.forward` as ids.
    pub fn forward_embeddings(
        &self,
        embeddings: Array,
        caches: &mut [Box<dyn Cache>],
    ) -> Result<Array, Exception> {
        self.text.forward_embeddings(embeddings, caches)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_text_config_is_read_as_mlx_vlm_reads_it() {
        let raw = serde_json::json!({"model_type": "gemma3", "vocab_size": 5,
            "text_config": {"model_type": "gemma3_text", "rope_theta": 7.0,
                            "rope_parameters": {"x": 1}, "sliding_window": 8}});
        let c = ModelConfig::from_value("config.json".into(), raw).unwrap();
        let t = vlm_text_config(&c).unwrap();
        let text = &t.raw["text_config"];
        assert_eq!(t.raw["vocab_size"], 262_208);
        assert_eq!(text["rope_theta"], 1_000_000.0);
        assert_eq!(text["sliding_window"], 8);
        assert_eq!(text["max_position_embeddings"], 4096);
        assert!(text.get("rope_parameters").is_none());
    }
}
