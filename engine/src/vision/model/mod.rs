//! A checkpoint with a vision tower this engine runs, behind one type: gemma3 with a
//! `vision_config` ([`super::gemma3_tower::Gemma3Vision`]), gemma4 with a `vision_config`
//! ([`super::gemma4_tower::Gemma4Vision`]), Qwen3-VL ([`super::qwen3vl_lm::Qwen3VlImageModel`])
//! and Qwen3.5 ([`super::qwen35_lm::Qwen35ImageModel`]), each with its image processor.
//!
//! The flow is mlx-vlm 0.7.10's `generate_step` (mlx_vlm/generate/ar.py): the processor turns
//! images into pixels and expands the templated prompt's image markers ([`ImageModel::
//! prepare`]); the prompt with its images runs through fresh caches, all but the last token
//! in chunks of at most `prefill_step_size` (2048), then the last ([`ImageModel::prefill`]:
//! the last position's logits); each later token goes in by id ([`ImageRun::decode`]), for
//! Qwen3-VL and Qwen3.5 at position `offset + rope delta`.
//!
//! gemma4 (see [`gemma4`]) prefills a prompt holding images in ONE forward when its text
//! config's `use_bidirectional_attention` is "vision" (its `chunked_prefill_policy`: the
//! image blocks attend within themselves, which chunks would cut), and its decode steps are
//! the text model's (ids, the caches' own masks).

pub(crate) mod gemma4;

use std::path::Path;

use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;

use super::gemma3::Gemma3Processor;
use super::gemma3_tower::{Gemma3Vision, ImageInputError};
use super::gemma4::{Gemma4ImageMarkers, Gemma4Processor};
use super::gemma4_tower::{Gemma4ImageError, Gemma4Vision};
use super::prompt::ImageLayout;
use super::qwen35_lm::{LayerCache, Qwen35ImageModel};
use super::qwen3vl_lm::{self, Qwen3VlImageModel};
use super::qwen_vit::QwenVitError;
use super::qwen_vl::{self, QwenVlProcessor};
use super::{RgbImage, VisionError};
use crate::cache::{Cache, KvCache};
use crate::load::LoadError;
use crate::model::LanguageModel;

/// Why a vision model could not be loaded or run. Each message names the cause and the fix.
#[derive(Debug, thiserror::Error)]
pub enum ImageModelError {
    #[error(
        "{dir}: model_type `{model_type}` has no vision tower this engine runs (gemma3 or \
         gemma4 with a vision_config, qwen3_vl, qwen3_5): drop the images, or use one of \
         those checkpoints"
    )]
    NoVision { dir: String, model_type: String },
    #[error("{0}")]
    Load(#[from] LoadError),
    #[error("{0}")]
    Image(#[from] VisionError),
    #[error("{0}")]
    Gemma3(#[from] ImageInputError),
    #[error("{0}")]
    Gemma4(#[from] Gemma4ImageError),
    #[error("{0}")]
    Qwen(#[from] QwenVitError),
    #[error("MLX: {0}")]
    Mlx(#[from] mlx_rs::error::Exception),
    #[error("{0}")]
    Io(String),
}

type R<T> = Result<T, ImageModelError>;

/// Which family's image path a checkpoint takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VisionFamily {
    Gemma3,
    Gemma4,
    Qwen3Vl,
    Qwen35,
}

/// A model directory's vision family from its config.json: `Ok(None)` for a model without a
/// tower this engine runs (a text model, or a family whose tower is not here yet); the
/// `model_type` read comes back too, for the refusal.
pub fn detect(dir: &Path) -> R<(Option<VisionFamily>, String)> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path)
        .map_err(|e| ImageModelError::Io(format!("{}: {e}", path.display())))?;
    let cfg: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| ImageModelError::Io(format!("{}: {e}", path.display())))?;
    let model_type = cfg["model_type"].as_str().unwrap_or("").to_owned();
    let tower = cfg.get("vision_config").is_some_and(|v| v.is_object());
    let family = match model_type.as_str() {
        "gemma3" if tower => Some(VisionFamily::Gemma3),
        "gemma4" if tower => Some(VisionFamily::Gemma4),
        "qwen3_vl" if tower => Some(VisionFamily::Qwen3Vl),
        "qwen3_5" if tower => Some(VisionFamily::Qwen35),
        _ => None,
    };
    Ok((family, model_type))
}

fn qwen_vocab(dir: &Path) -> R<usize> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path)
        .map_err(|e| ImageModelError::Io(format!("{}: {e}", path.display())))?;
    let cfg: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| ImageModelError::Io(format!("{}: {e}", path.display())))?;
    cfg["text_config"]["vocab_size"]
        .as_u64()
        .or(cfg["vocab_size"].as_u64())
        .map(|v| v as usize)
        .ok_or_else(|| {
            ImageModelError::Io(format!("{}: no text_config.vocab_size", path.display()))
        })
}

/// The loaded model and its processor.
pub enum ImageModel {
    Gemma3 {
        model: Box<Gemma3Vision>,
        processor: Gemma3Processor,
    },
    Gemma4 {
        model: Box<Gemma4Vision>,
        processor: Gemma4Processor,
        /// The tokenizer's image, boi and eoi tokens the processor expands markers with.
        markers: Gemma4ImageMarkers,
    },
    Qwen3Vl {
        model: Box<Qwen3VlImageModel>,
        processor: QwenVlProcessor,
        /// text_config's vocab_size: the logits' width.
        vocab: usize,
    },
    Qwen35 {
        model: Box<Qwen35ImageModel>,
        processor: QwenVlProcessor,
        /// text_config's vocab_size: the logits' width.
        vocab: usize,
    },
}

/// The images of one prompt as the model takes them.
pub enum ImageInputs {
    /// One `[1, 3, S, S]` f32 tensor per image.
    Gemma3(Vec<Array>),
    /// One `[1, 3, H, W]` f32 tensor per image (sizes differ with the aspect ratio).
    Gemma4(Vec<Array>),
    /// The patches `[n, C·T·P·P]` and each image's grid (Qwen3-VL's and Qwen3.5's).
    Qwen3Vl(Array, Vec<[i32; 3]>),
}

/// A generation under way: the caches after the prompt (and the rope delta).
pub enum ImageRun<'m> {
    Gemma3 {
        model: &'m Gemma3Vision,
        caches: Vec<Box<dyn Cache>>,
    },
    Gemma4 {
        model: &'m Gemma4Vision,
        caches: Vec<Box<dyn Cache>>,
    },
    Qwen3Vl {
        model: &'m Qwen3VlImageModel,
        caches: Vec<KvCache>,
        rope_delta: i32,
    },
    Qwen35 {
        model: &'m Qwen35ImageModel,
        /// Attention layers' K/V and delta nets' conv / recurrent states.
        caches: Vec<LayerCache>,
        rope_delta: i32,
    },
}

impl ImageModel {
    /// Loads `dir`'s model with its tower and its preprocessor_config.json; refuses a model
    /// without a tower this engine runs.
    pub fn load(dir: &Path) -> R<Self> {
        let (family, model_type) = detect(dir)?;
        let family = family.ok_or_else(|| ImageModelError::NoVision {
            dir: dir.display().to_string(),
            model_type,
        })?;
        let pre = || -> R<String> {
            let pre = dir.join("preprocessor_config.json");
            std::fs::read_to_string(&pre).map_err(|e| {
                ImageModelError::Io(format!(
                    "{}: {e} (the image processor's config ships with the checkpoint)",
                    pre.display()
                ))
            })
        };
        Ok(match family {
            VisionFamily::Gemma3 => ImageModel::Gemma3 {
                model: Box::new(Gemma3Vision::load(dir)?),
                processor: Gemma3Processor::from_json(&pre()?)?,
            },
            VisionFamily::Gemma4 => ImageModel::Gemma4 {
                model: Box::new(Gemma4Vision::load(dir)?),
                processor: gemma4::processor(dir)?,
                markers: gemma4::markers(dir)?,
            },
            VisionFamily::Qwen3Vl => ImageModel::Qwen3Vl {
                model: Box::new(Qwen3VlImageModel::load(dir)?),
                processor: QwenVlProcessor::from_json(&pre()?)?,
                vocab: qwen_vocab(dir)?,
            },
            VisionFamily::Qwen35 => ImageModel::Qwen35 {
                model: Box::new(Qwen35ImageModel::load(dir)?),
                processor: QwenVlProcessor::from_json(&pre()?)?,
                vocab: qwen_vocab(dir)?,
            },
        })
    }

    /// The width of the logits.
    pub fn vocab_size(&self) -> usize {
        match self {
            ImageModel::Gemma3 { model, .. } => model.text.vocab_size(),
            ImageModel::Gemma4 { model, .. } => model.text.vocab_size(),
            ImageModel::Qwen3Vl { vocab, .. } | ImageModel::Qwen35 { vocab, .. } => *vocab,
        }
    }

    /// How this family's messages hold their images ([`super::prompt`]).
    pub fn layout(&self) -> ImageLayout {
        match self {
            ImageModel::Gemma3 { .. } => ImageLayout::of("gemma3"),
            ImageModel::Gemma4 { .. } => ImageLayout::of("gemma4"),
            ImageModel::Qwen3Vl { .. } => ImageLayout::of("qwen3_vl"),
            ImageModel::Qwen35 { .. } => ImageLayout::of("qwen3_5"),
        }
        .expect("every family has a layout")
    }

    /// The processor's work on a templated prompt and its images (in prompt order): the
    /// prompt text with each image marker expanded, and the pixel inputs.
    pub fn prepare(&self, templated: &str, images: &[RgbImage]) -> R<(String, ImageInputs)> {
        match self {
            ImageModel::Gemma3 { processor, .. } => {
                let text = processor.expand_prompt(templated, images.len())?;
                let pixels = images
                    .iter()
                    .map(|img| {
                        let t = processor.preprocess(img);
                        let shape: Vec<i32> = t.shape.iter().map(|&s| s as i32).collect();
                        Array::from_slice(&t.data, &shape)
                    })
                    .collect();
                Ok((text, ImageInputs::Gemma3(pixels)))
            }
            ImageModel::Gemma4 {
                processor, markers, ..
            } => {
                let (pixels, tokens) = gemma4::preprocess(processor, images)?;
                let text = markers.expand_prompt(templated, &tokens)?;
                Ok((text, ImageInputs::Gemma4(pixels)))
            }
            ImageModel::Qwen3Vl { processor, .. } | ImageModel::Qwen35 { processor, .. } => {
                let pixels = images
                    .iter()
                    .map(|img| processor.preprocess(img))
                    .collect::<Result<Vec<_>, _>>()?;
                let tokens: Vec<usize> = pixels.iter().map(|p| p.tokens).collect();
                let text = qwen_vl::expand_prompt(templated, &tokens)?;
                let (patches, grids) = qwen3vl_lm::patches_of(&pixels)?;
                Ok((text, ImageInputs::Qwen3Vl(patches, grids)))
            }
        }
    }

    /// The prompt's ids with its images through fresh caches, as generate_step prefills
    /// (chunks of at most `step`, then the last token): the run to decode from and the last
    /// position's logits `[1, vocab]`.
    pub fn prefill(
        &self,
        ids: &[u32],
        inputs: &ImageInputs,
        step: usize,
    ) -> R<(ImageRun<'_>, Array)> {
        if ids.is_empty() {
            return Err(ImageModelError::Io(
                "the prompt encodes to no tokens; give some text".into(),
            ));
        }
        let ends = qwen3vl_lm::generate_chunks(ids.len(), step.max(1));
        match (self, inputs) {
            (ImageModel::Gemma3 { model, .. }, ImageInputs::Gemma3(pixels)) => {
                let mut caches = model.make_caches();
                let last = gemma3_prefill(model, ids, pixels, (&mut caches, 0), step)?;
                let model = model.as_ref();
                Ok((ImageRun::Gemma3 { model, caches }, last))
            }
            (ImageModel::Gemma4 { model, .. }, ImageInputs::Gemma4(pixels)) => {
                let (caches, last) = gemma4::prefill(model, ids, pixels, &ends)?;
                let model = model.as_ref();
                Ok((ImageRun::Gemma4 { model, caches }, last))
            }
            (ImageModel::Qwen3Vl { model, .. }, ImageInputs::Qwen3Vl(patches, grids)) => {
                let mut caches = model.make_caches();
                let p = model.prefill_in_chunks(ids, patches, grids, &mut caches, &ends)?;
                let last = p.logits.index((.., -1, ..));
                Ok((
                    ImageRun::Qwen3Vl {
                        model: model.as_ref(),
                        caches,
                        rope_delta: p.rope_delta,
                    },
                    last,
                ))
            }
            (ImageModel::Qwen35 { model, .. }, ImageInputs::Qwen3Vl(patches, grids)) => {
                let mut caches = model.make_caches();
                let p = model.prefill_in_chunks(ids, patches, grids, &mut caches, &ends)?;
                let last = p.logits.index((.., -1, ..));
                Ok((
                    ImageRun::Qwen35 {
                        model: model.as_ref(),
                        caches,
                        rope_delta: p.rope_delta,
                    },
                    last,
                ))
            }
            _ => Err(ImageModelError::Io(
                "image inputs of another family: prepare them with this model".into(),
            )),
        }
    }
}

/// gemma3's prompt with its images through `caches`, which hold its first `start` positions
/// (0: fresh; a cached prefix otherwise: `serve::worker::image`): the merged embeddings of
/// the whole prompt, the rest in generate_step's chunks (all but the last token in chunks of
/// at most `step`, then the last). The last position's logits `[1, vocab]`.
pub(crate) fn gemma3_prefill(
    model: &Gemma3Vision,
    ids: &[u32],
    pixels: &[Array],
    (caches, start): (&mut [Box<dyn Cache>], usize),
    step: usize,
) -> R<Array> {
    let embeds = model.embed_with_images(ids, pixels)?;
    let ends = qwen3vl_lm::generate_chunks(ids.len() - start, step.max(1));
    let (mut at, mut logits) = (start as i32, None);
    for end in ends {
        let end = (start + end) as i32;
        logits = Some(model.forward_embeddings(embeds.index((.., at..end)), caches)?);
        at = end;
    }
    Ok(logits
        .expect("a prompt has a last token")
        .index((.., -1, ..)))
}

impl ImageRun<'_> {
    /// The next token by id: its logits `[1, vocab]`.
    pub fn decode(&mut self, id: u32) -> R<Array> {
        let logits = match self {
            ImageRun::Gemma3 { model, caches } => {
                let ids = Array::from_slice(&[id as i32], &[1, 1]);
                model.text.forward(&ids, caches)?
            }
            // mlx-vlm's decode step: `language_model(y, cache)`, the per-layer inputs from
            // the id, the caches' own masks (no image tokens to overlay).
            ImageRun::Gemma4 { model, caches } => {
                let ids = Array::from_slice(&[id as i32], &[1, 1]);
                model.text.forward(&ids, caches)?
            }
            ImageRun::Qwen3Vl {
                model,
                caches,
                rope_delta,
            } => model.decode(&[id], *rope_delta, caches)?,
            ImageRun::Qwen35 {
                model,
                caches,
                rope_delta,
            } => model.decode(&[id], *rope_delta, caches)?,
        };
        Ok(logits.index((.., -1, ..)))
    }
}
