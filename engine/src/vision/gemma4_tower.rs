//! gemma4 with its vision encoder, as mlx-vlm 0.7.10's `mlx_vlm/models/gemma4/gemma4.py`
//! computes it: the encoder ([`super::gemma4_vit`]), `MultimodalEmbedder` (`embed_vision`),
//! `Model.get_input_embeddings` (the merge), then the language model from the merged
//! embeddings and its per-layer inputs.
//!
//! Embedder: features = rms_norm(x, no weight, eps = vision rms_norm_eps) · W_projᵀ [Dt, Dv].
//!
//! Encoding (`_encode_image`): images of one size go through the tower as one batch (the
//! processor stacks them), images of several sizes one by one (the processor hands a list on),
//! the soft tokens concatenated in order; then the embedder over them all.
//!
//! Merge (`get_input_embeddings`), ids [1, L]:
//!
//!   h = embed(ids) · √hidden (a weak scalar, as mlx-lm's gemma4 scales)
//!   image positions (id = image_token_id), in order: the features, cast to h's dtype
//!   (`masked_scatter`: values only move; here one gather)
//!   per-layer inputs: from the ids with every image and audio token id (and the video
//!   token id, when the config names one) replaced by 0, and from the merged h
//!
//! and the language model runs from the merged h unscaled (`inputs_embeds` skips the
//! embedding scale). Later tokens are ids, as in mlx-lm.
//!
//! Masks (`Gemma4TextModel._make_masks`, with the processor's mm_token_type_ids): when
//! text_config.use_bidirectional_attention is "vision" (Google's gemma-4 configs) and the
//! prompt (more than one token) holds image tokens, every attention mask is the boolean
//! causal one (windowed on the sliding layers) OR'd with "same image block" — each maximal
//! run of image tokens attends to all of itself; mlx-vlm then prefills the prompt in one
//! call (`chunked_prefill_policy`). Otherwise, and for every decode step, the caches' own
//! masks.
//!
//! Checkpoint layouts (`Model.sanitize`): Hugging Face's (`model.vision_tower.…`,
//! `model.embed_vision.…`, `model.language_model.…`) and mlx-community's (`vision_tower.…`,
//! `embed_vision.…`, `language_model.model.…`); the tower's clip bounds are dropped unless
//! `use_clipped_linears`. The text model is this engine's gemma4_text (`model::gemma4`,
//! bit-exact with mlx-lm) through the gemma4 wrapper's sanitize.

use std::path::Path;

use mlx_rs::error::Exception;
use mlx_rs::ops::concatenate;
use mlx_rs::{fast, Array};
use serde_json::Value;

use super::gemma4_vit::{Gemma4VisionConfig, Gemma4Vit};
use crate::cache::Cache;
use crate::load::config::ModelConfig;
use crate::load::weights::Weights;
use crate::load::LoadError;
use crate::model::decoder::Decoder;
use crate::model::layers::Linear;
use crate::model::LanguageModel;
use crate::plant::{self, Defect};

const TOWER: &str = "vision_tower.";
const EMBEDDER: &str = "embed_vision.";

/// Why images could not be merged into a prompt. Each message names the cause and the fix.
#[derive(Debug, thiserror::Error)]
pub enum Gemma4ImageError {
    #[error(
        "the prompt holds {tokens} image token(s) (id {id}) where its {images} image(s) take \
         {want} soft tokens: expand each image marker to its image's soft tokens \
         (vision::gemma4::expand_prompt with the processor's token counts)"
    )]
    TokenCount {
        tokens: usize,
        id: u32,
        images: usize,
        want: usize,
    },
    #[error("MLX: {0}")]
    Mlx(#[from] Exception),
}

/// gemma4 with its vision encoder: `embed_with_images` makes a prompt's first hidden state
/// and per-layer ids, `forward_embeddings` runs the text model from them.
pub struct Gemma4Vision {
    pub tower: Gemma4Vit,
    embed_norm_eps: f32,
    embed_proj: Linear,
    pub text: Decoder,
    pub image_token: u32,
    /// Ids the per-layer inputs read as 0 (image, audio, video tokens).
    multimodal_tokens: Vec<u32>,
    /// text_config.use_bidirectional_attention == "vision": image blocks attend within.
    bidirectional_vision: bool,
}

/// A prompt's merged input: the first hidden state [1, L, Dt] and the ids its per-layer
/// inputs are made from.
pub struct MergedPrompt {
    pub embeddings: Array,
    pub per_layer_ids: Array,
    /// "Same image block" [1, 1, L, L] (boolean), for a config with bidirectional vision
    /// attention and a prompt of more than one token holding images.
    pub overlay: Option<Array>,
}

fn id(raw: &Value, key: &str, default: i64) -> i64 {
    raw.get(key).and_then(Value::as_i64).unwrap_or(default)
}

impl Gemma4Vision {
    /// Loads a gemma4 checkpoint with its vision encoder (Hugging Face's layout or
    /// mlx-community's).
    pub fn load(dir: &Path) -> Result<Self, LoadError> {
        let config = ModelConfig::read(dir)?;
        let w = Weights::load(dir)?;
        Self::from_parts(&config, w)
    }

    /// As `load`, from a config and tensors already read.
    pub fn from_parts(config: &ModelConfig, mut w: Weights) -> Result<Self, LoadError> {
        if config.model_type != "gemma4" {
            return Err(LoadError::Unsupported(format!(
                "model_type `{}`: this loader is gemma4's (Gemma4ForConditionalGeneration)",
                config.model_type
            )));
        }
        let raw = &config.raw;
        let bad = |message: String| LoadError::Config {
            path: config.path.clone(),
            message,
        };
        let text_raw = raw.get("text_config").cloned().unwrap_or(Value::Null);
        let bidirectional_vision = text_raw
            .get("use_bidirectional_attention")
            .and_then(Value::as_str)
            == Some("vision");
        let vision_raw = raw.get("vision_config").cloned().unwrap_or(Value::Null);
        let vc: Gemma4VisionConfig =
            serde_json::from_value(vision_raw).map_err(|e| bad(format!("vision_config: {e}")))?;
        let dt = id(&text_raw, "hidden_size", 1536) as i32;

        // `Model.sanitize`: `model.` stripped; the tower's clip bounds dropped unless used.
        let mut tower_w = Weights::from_tensors(Vec::new());
        let mut embed_w = Weights::from_tensors(Vec::new());
        for n in w.remaining() {
            let bare = n.strip_prefix("model.").unwrap_or(&n);
            let Some(rest) = bare
                .strip_prefix(TOWER)
                .or_else(|| bare.strip_prefix(EMBEDDER))
            else {
                continue;
            };
            let rest = rest.to_owned();
            let is_tower = bare.starts_with(TOWER);
            let a = w.take(&n)?;
            if n.ends_with(".scales") {
                return Err(LoadError::Unsupported(format!(
                    "`{n}`: a quantized vision tower is not supported yet; use a checkpoint whose \
                     vision tower is unquantized (e.g. Google's bf16 weights)"
                )));
            }
            let clip_bound = ["input_min", "input_max", "output_min", "output_max"]
                .iter()
                .any(|s| rest.contains(s));
            match (is_tower, clip_bound && !vc.use_clipped_linears) {
                (true, true) => {}
                (true, false) => tower_w.insert(rest, a),
                (false, _) => embed_w.insert(rest, a),
            }
        }
        let tower = Gemma4Vit::load(vc.clone(), &mut tower_w)?;
        tower_w.ensure_consumed("gemma4 vision tower", |_| false)?;
        let embed_proj = Linear::load(
            &mut embed_w,
            "embedding_projection",
            false,
            [dt, vc.hidden_size],
        )?;
        embed_w.ensure_consumed("gemma4 vision embedder", |_| false)?;

        let text = crate::model::wrapper::gemma4_decoder(config, w)?;
        let image_token = id(raw, "image_token_id", 258_880) as u32;
        let mut multimodal_tokens = vec![image_token, id(raw, "audio_token_id", 258_881) as u32];
        if let Some(v) = raw.get("video_token_id").and_then(Value::as_i64) {
            multimodal_tokens.push(v as u32);
        }
        Ok(Gemma4Vision {
            tower,
            embed_norm_eps: vc.rms_norm_eps,
            embed_proj,
            text,
            image_token,
            multimodal_tokens,
            bidirectional_vision,
        })
    }

    /// Soft tokens per image of [1, 3, H, W] pixels: (H/p)·(W/p) / k².
    pub fn tokens_of(&self, pixels: &Array) -> usize {
        let c = &self.tower.config;
        let s = pixels.shape();
        let n = (s[2] / c.patch_size) * (s[3] / c.patch_size);
        (n / (c.pooling_kernel_size * c.pooling_kernel_size)) as usize
    }

    /// The tower's soft tokens [1, Σn, Dv] of the images (`pixels`: one [1, 3, H, W] f32
    /// tensor each, as `vision::gemma4` makes them), batched when they share a size.
    pub fn tower_output(&self, pixels: &[Array]) -> Result<Array, Exception> {
        let same = pixels.windows(2).all(|p| p[0].shape() == p[1].shape());
        if same {
            return self.tower.forward(&concatenate(pixels, 0)?);
        }
        let each = pixels
            .iter()
            .map(|p| self.tower.forward(p))
            .collect::<Result<Vec<_>, _>>()?;
        concatenate(&each, 1)
    }

    /// `embed_vision`: the soft tokens in the text model's width [1, n, Dt].
    pub fn embed(&self, tower_out: &Array) -> Result<Array, Exception> {
        let normed = fast::rms_norm(tower_out, None, self.embed_norm_eps)?;
        self.embed_proj.forward(&normed)
    }

    /// A prompt's first hidden state (already scaled) with the images' features at its
    /// image tokens, in order, and the ids its per-layer inputs read.
    pub fn embed_with_images(
        &self,
        ids: &[u32],
        pixels: &[Array],
    ) -> Result<MergedPrompt, Gemma4ImageError> {
        let want: usize = pixels.iter().map(|p| self.tokens_of(p)).sum();
        let tokens = ids.iter().filter(|&&t| t == self.image_token).count();
        if tokens != want {
            return Err(Gemma4ImageError::TokenCount {
                tokens,
                id: self.image_token,
                images: pixels.len(),
                want,
            });
        }
        let l = ids.len() as i32;
        let ids_arr = Array::from_slice(ids, &[1, l]);
        let h = self.text.scale_embeddings(self.text.embed(&ids_arr)?)?;
        let side: Vec<u32> = ids
            .iter()
            .map(|t| match self.multimodal_tokens.contains(t) {
                true => 0,
                false => *t,
            })
            .collect();
        let per_layer_ids = Array::from_slice(&side, &[1, l]);
        let overlay = self.block_overlay(ids);
        if tokens == 0 {
            return Ok(MergedPrompt {
                embeddings: h,
                per_layer_ids,
                overlay,
            });
        }
        let d = h.shape()[2];
        let feats = self
            .embed(&self.tower_output(pixels)?)?
            .as_dtype(h.dtype())?;
        let table = concatenate(
            &[h.reshape(&[l, d])?, feats.reshape(&[tokens as i32, d])?],
            0,
        )?;
        let mut next = l;
        let mut index: Vec<i32> = (0..l).collect();
        for (i, &t) in ids.iter().enumerate() {
            if t == self.image_token {
                index[i] = next;
                next += 1;
            }
        }
        if plant::is(Defect::Gemma4ImageTokensReversed) {
            // Planted: the image rows taken in reverse order.
            let img: Vec<usize> = (0..ids.len())
                .filter(|&i| ids[i] == self.image_token)
                .collect();
            let rows: Vec<i32> = img.iter().rev().map(|&i| index[i]).collect();
            for (&i, r) in img.iter().zip(rows) {
                index[i] = r;
            }
        }
        let index = Array::from_slice(&index, &[l]);
        Ok(MergedPrompt {
            embeddings: table.take_axis(&index, 0)?.expand_dims(0)?,
            per_layer_ids,
            overlay,
        })
    }

    /// `_apply_blockwise_bidirectional_overlay`'s "same block" for `ids`: q and k in one
    /// maximal run of image tokens. None where mlx-vlm applies no overlay.
    fn block_overlay(&self, ids: &[u32]) -> Option<Array> {
        let is_image: Vec<bool> = ids.iter().map(|&t| t == self.image_token).collect();
        if !self.bidirectional_vision || ids.len() < 2 || !is_image.contains(&true) {
            return None;
        }
        if plant::is(Defect::Gemma4ImageBlocksCausal) {
            // Planted: no overlay (image tokens attend causally, as in mlx-lm).
            return None;
        }
        let mut block = vec![-1i32; ids.len()];
        let mut next = -1;
        for i in 0..ids.len() {
            if is_image[i] {
                if i == 0 || !is_image[i - 1] {
                    next += 1;
                }
                block[i] = next;
            }
        }
        let l = ids.len();
        let same: Vec<bool> = (0..l * l)
            .map(|i| {
                let (q, k) = (block[i / l], block[i % l]);
                q != -1 && q == k
            })
            .collect();
        Some(Array::from_slice(&same, &[1, 1, l as i32, l as i32]))
    }

    /// Fresh caches for the text model.
    pub fn make_caches(&self) -> Vec<Box<dyn Cache>> {
        self.text.make_caches()
    }

    /// Logits [1, L, vocab] of a merged prompt (`embed_with_images`), through `caches`;
    /// later tokens go through `self.text.forward` as ids.
    pub fn forward_embeddings(
        &self,
        prompt: &MergedPrompt,
        caches: &mut [Box<dyn Cache>],
    ) -> Result<Array, Exception> {
        self.text.forward_first_hidden(
            prompt.embeddings.clone(),
            &prompt.per_layer_ids,
            prompt.overlay.as_ref(),
            caches,
        )
    }
}
