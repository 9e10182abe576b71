//! gemma4 behind [`super::ImageModel`]: its processor and markers as mlx-vlm 0.7.10 loads them
//! (mlx_vlm/models/gemma4/processing_gemma4.py `Gemma4Processor.from_pretrained`, `__init__`)
//! and its prefill as `generate_step` runs it (mlx_vlm/generate/ar.py with gemma4's
//! language.py `LanguageModel.chunked_prefill_policy`).
//!
//! - processor: processor_config.json, else preprocessor_config.json; its `image_processor`
//!   object, else the file itself when it is flat (no `image_processor_type`, some of
//!   patch_size / max_soft_tokens / pooling_kernel_size), else the class defaults;
//! - markers: the tokenizer's `image_token`, `boi_token`, `eoi_token` (tokenizer_config.json);
//!   each image marker becomes `boi + image × soft tokens + eoi`;
//! - prefill: the merged prompt ([`Gemma4Vision::embed_with_images`]) in ONE forward when it
//!   carries the image-block overlay (use_bidirectional_attention "vision" and image tokens:
//!   the policy turns chunking off, as chunks would cut the blocks); otherwise in
//!   `generate_step`'s chunks, each chunk's embeddings and per-layer ids cut from the whole
//!   prompt's (mlx-vlm slices its per-layer inputs at the cache offset: the same rows).

use std::path::Path;

use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;
use serde_json::Value;

use super::{ImageModelError, R};
use crate::cache::Cache;
use crate::plant::{self, Defect};
use crate::vision::gemma4::{Gemma4Config, Gemma4ImageMarkers, Gemma4Processor};
use crate::vision::gemma4_tower::{Gemma4Vision, MergedPrompt};
use crate::vision::{RgbImage, VisionError};

fn read_json(path: &Path) -> R<Option<Value>> {
    match std::fs::read_to_string(path) {
        Ok(text) => serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| ImageModelError::Io(format!("{}: {e}", path.display()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(ImageModelError::Io(format!("{}: {e}", path.display()))),
    }
}

/// The image processor of the checkpoint in `dir`, found where `from_pretrained` looks.
pub(crate) fn processor(dir: &Path) -> R<Gemma4Processor> {
    let cfg = match read_json(&dir.join("processor_config.json"))? {
        Some(cfg) => Some(cfg),
        None => read_json(&dir.join("preprocessor_config.json"))?,
    }
    .unwrap_or(Value::Null);
    let keys = ["patch_size", "max_soft_tokens", "pooling_kernel_size"];
    let image = match cfg.get("image_processor") {
        Some(ip) if ip.is_object() => ip.clone(),
        _ if cfg.get("image_processor_type").is_none()
            && keys.iter().any(|k| cfg.get(k).is_some()) =>
        {
            cfg.clone()
        }
        _ => Value::Object(Default::default()),
    };
    let parsed: Gemma4Config = serde_json::from_value(image).map_err(|e| {
        VisionError::Config(format!(
            "{}: gemma4 image_processor config: {e}",
            dir.display()
        ))
    })?;
    Ok(Gemma4Processor::new(&parsed)?)
}

/// The tokenizer's image markers (tokenizer_config.json).
pub(crate) fn markers(dir: &Path) -> R<Gemma4ImageMarkers> {
    let path = dir.join("tokenizer_config.json");
    let cfg = read_json(&path)?.ok_or_else(|| {
        ImageModelError::Io(format!(
            "{}: missing; gemma4's processor reads its image_token, boi_token and eoi_token \
             from it (it ships with the checkpoint)",
            path.display()
        ))
    })?;
    Ok(Gemma4ImageMarkers::from_tokenizer_config(&cfg)?)
}

/// Each image's `[1, 3, H, W]` pixels and soft-token count, in order.
pub(super) fn preprocess(
    processor: &Gemma4Processor,
    images: &[RgbImage],
) -> R<(Vec<Array>, Vec<usize>)> {
    let mut pixels = Vec::with_capacity(images.len());
    let mut tokens = Vec::with_capacity(images.len());
    for img in images {
        let t = processor.preprocess(img)?;
        let shape: Vec<i32> = t.pixels.shape.iter().map(|&s| s as i32).collect();
        pixels.push(Array::from_slice(&t.pixels.data, &shape));
        tokens.push(t.tokens);
    }
    Ok((pixels, tokens))
}

/// The prompt with its images through fresh caches (see the module header): the caches and
/// the last position's logits `[1, vocab]`.
pub(super) fn prefill(
    model: &Gemma4Vision,
    ids: &[u32],
    pixels: &[Array],
    ends: &[usize],
) -> R<(Vec<Box<dyn Cache>>, Array)> {
    let merged = model.embed_with_images(ids, pixels)?;
    let mut caches = model.make_caches();
    // Planted: the policy ignored, the image prompt chunked as a text prompt (mlx-vlm's own
    // chunks would drop the overlay too: its mask no longer spans the token types).
    let chunked = plant::is(Defect::Gemma4ImagePromptChunked);
    let logits = match merged.overlay {
        Some(_) if !chunked => model.forward_embeddings(&merged, &mut caches)?,
        _ => {
            let mut last = None;
            let mut start = 0i32;
            for &end in ends {
                let chunk = MergedPrompt {
                    embeddings: merged.embeddings.index((.., start..end as i32)),
                    per_layer_ids: merged.per_layer_ids.index((.., start..end as i32)),
                    overlay: None,
                };
                last = Some(model.forward_embeddings(&chunk, &mut caches)?);
                start = end as i32;
            }
            last.expect("at least one chunk")
        }
    };
    Ok((caches, logits.index((.., -1, ..))))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn processor_of(files: &[(&str, &str)]) -> Gemma4Processor {
        let dir = tempfile::tempdir().unwrap();
        for (name, text) in files {
            std::fs::write(dir.path().join(name), text).unwrap();
        }
        processor(dir.path()).unwrap()
    }

    #[test]
    fn the_processor_config_is_found_where_gemma4s_from_pretrained_looks() {
        let nested = r#"{"image_processor": {"image_processor_type": "Gemma4ImageProcessor",
                         "patch_size": 4, "max_soft_tokens": 4, "pooling_kernel_size": 2}}"#;
        let flat = r#"{"patch_size": 8, "max_soft_tokens": 9}"#;
        // processor_config.json's image_processor, over preprocessor_config.json.
        let p = processor_of(&[
            ("processor_config.json", nested),
            ("preprocessor_config.json", flat),
        ]);
        assert_eq!((p.patch_size, p.max_soft_tokens), (4, 4));
        // A flat preprocessor_config.json when there is no processor_config.json.
        let p = processor_of(&[("preprocessor_config.json", flat)]);
        assert_eq!(
            (p.patch_size, p.max_soft_tokens, p.pooling_kernel_size),
            (8, 9, 3)
        );
        // A flat one naming its image_processor_type, or none: the class defaults.
        let typed = r#"{"image_processor_type": "Gemma4ImageProcessor", "patch_size": 8}"#;
        let defaults = (16, 280, 3);
        for files in [&[("preprocessor_config.json", typed)][..], &[]] {
            let p = processor_of(files);
            let got = (p.patch_size, p.max_soft_tokens, p.pooling_kernel_size);
            assert_eq!(got, defaults);
        }
    }
}
