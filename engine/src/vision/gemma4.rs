//! Gemma 4's image processor, as mlx-vlm runs it: mlx-vlm's own `Gemma4ImageProcessor`
//! (mlx_vlm/models/gemma4/processing_gemma4.py; patchifying is the model's job, not this one's).
//!
//! The math, for one RGB image of H × W, with `max_patches = max_soft_tokens * k²` (k the
//! pooling kernel) and `side = k * patch_size`:
//! - size (`get_aspect_ratio_preserving_size`, f64): `f = sqrt(max_patches * P² / (H * W))`,
//!   `h = floor(f * H / side) * side`, same for `w`; both 0 → refused; one 0 → that side is
//!   `side` and the other `min(floor(W / H) * side, (max_patches / k²) * side)` (or H / W);
//! - Pillow bicubic resize to w × h (none at the same size; the config's `resample` is not
//!   read: the reference always uses bicubic);
//! - rescale `f32(p) * f32(rescale_factor)` (numpy keeps f32); normalize only if the config
//!   asks (`do_normalize` defaults to false): `(x - f32(mean[c])) / f32(std[c])`;
//! - `[1, 3, h, w]` channels first; soft tokens `(h / P) * (w / P) / k²`.

use serde::Deserialize;

use super::resize::{resize, Filter};
use super::{PixelTensor, RescaleIn, RgbImage, Scaling, VisionError};
use crate::plant::{self, Defect};

/// The image processor's fields (processor_config.json's `image_processor`), with
/// mlx-vlm's class defaults.
#[derive(Debug, Clone, Deserialize, Default)]
pub struct Gemma4Config {
    pub patch_size: Option<usize>,
    pub max_soft_tokens: Option<usize>,
    pub pooling_kernel_size: Option<usize>,
    pub do_resize: Option<bool>,
    pub do_rescale: Option<bool>,
    pub rescale_factor: Option<f64>,
    pub do_normalize: Option<bool>,
    pub image_mean: Option<[f64; 3]>,
    pub image_std: Option<[f64; 3]>,
}

/// A checked processor.
#[derive(Debug, Clone, PartialEq)]
pub struct Gemma4Processor {
    pub patch_size: usize,
    pub max_soft_tokens: usize,
    pub pooling_kernel_size: usize,
    pub do_resize: bool,
    pub scaling: Scaling,
}

/// One image's tensor and the soft tokens it takes in the prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct Gemma4Pixels {
    pub pixels: PixelTensor,
    pub tokens: usize,
}

impl Gemma4Processor {
    pub fn from_json(text: &str) -> Result<Self, VisionError> {
        let cfg: Gemma4Config = serde_json::from_str(text)
            .map_err(|e| VisionError::Config(format!("gemma4 image_processor config: {e}")))?;
        Self::new(&cfg)
    }

    pub fn new(cfg: &Gemma4Config) -> Result<Self, VisionError> {
        let p = Gemma4Processor {
            patch_size: cfg.patch_size.unwrap_or(16),
            max_soft_tokens: cfg.max_soft_tokens.unwrap_or(280),
            pooling_kernel_size: cfg.pooling_kernel_size.unwrap_or(3),
            do_resize: cfg.do_resize.unwrap_or(true),
            scaling: Scaling::from_config(
                cfg.do_rescale,
                cfg.rescale_factor,
                (cfg.do_normalize, false),
                (
                    cfg.image_mean.unwrap_or([0.5; 3]),
                    cfg.image_std.unwrap_or([0.5; 3]),
                ),
                RescaleIn::F32,
            ),
        };
        let ok = |v: usize, max: usize| (1..=max).contains(&v);
        if !ok(p.patch_size, 64) || !ok(p.max_soft_tokens, 16384) || !ok(p.pooling_kernel_size, 8) {
            return Err(VisionError::Config(format!(
                "patch_size {} / max_soft_tokens {} / pooling_kernel_size {}: need 1..=64 / \
                 1..=16384 / 1..=8",
                p.patch_size, p.max_soft_tokens, p.pooling_kernel_size
            )));
        }
        Ok(p)
    }

    /// The size an H × W image is resized to (`get_aspect_ratio_preserving_size`).
    pub fn target_size(&self, height: u32, width: u32) -> Result<(u32, u32), VisionError> {
        let (ps, k) = (self.patch_size, self.pooling_kernel_size);
        let max_patches = self.max_soft_tokens * k * k;
        let (h, w) = (f64::from(height), f64::from(width));
        let factor = ((max_patches * ps * ps) as f64 / (h * w)).sqrt();
        let side = (k * ps) as f64;
        let mut th = (factor * h / side).floor() * side;
        let mut tw = (factor * w / side).floor() * side;
        if th == 0.0 && tw == 0.0 {
            return Err(VisionError::Config(format!(
                "a {width}x{height} image resizes to 0x0 under max_soft_tokens {}: raise it",
                self.max_soft_tokens
            )));
        }
        let max_side = ((max_patches / (k * k)) as f64) * side;
        if th == 0.0 {
            th = side;
            tw = ((w / h).floor() * side).min(max_side);
        } else if tw == 0.0 {
            tw = side;
            th = ((h / w).floor() * side).min(max_side);
        }
        Ok((th as u32, tw as u32))
    }

    /// The tensor of one decoded image.
    pub fn preprocess(&self, img: &RgbImage) -> Result<Gemma4Pixels, VisionError> {
        let resized;
        let img = if self.do_resize {
            let (h, w) = self.target_size(img.height, img.width)?;
            resized = resize(img, w, h, Filter::Bicubic);
            &resized
        } else {
            img
        };
        let lut = self.scaling.table();
        let (h, w) = (img.height as usize, img.width as usize);
        let n = h * w;
        let mut data = vec![0f32; 3 * n];
        for (c, (plane, table)) in data.chunks_mut(n).zip(&lut).enumerate() {
            for (i, out) in plane.iter_mut().enumerate() {
                *out = table[usize::from(img.data[i * 3 + c])];
            }
        }
        let (ps, k) = (self.patch_size, self.pooling_kernel_size);
        let tokens = (h / ps) * (w / ps) / (k * k)
            + usize::from(plant::is(Defect::VisionTokenCountOffByOne));
        Ok(Gemma4Pixels {
            pixels: PixelTensor {
                shape: vec![1, 3, h, w],
                data,
            },
            tokens,
        })
    }
}

/// The strings Gemma4Processor expands an image with: the tokenizer's `image_token` (the
/// marker in the prompt, and each soft token), `boi_token` and `eoi_token`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gemma4ImageMarkers {
    pub image: String,
    pub boi: String,
    pub eoi: String,
}

impl Gemma4ImageMarkers {
    /// From tokenizer_config.json: the three names at its top level or under
    /// `extra_special_tokens`, where the processor's tokenizer finds them.
    pub fn from_tokenizer_config(cfg: &serde_json::Value) -> Result<Self, VisionError> {
        let get = |key: &str| {
            cfg.get(key)
                .or_else(|| cfg.get("extra_special_tokens").and_then(|e| e.get(key)))
                .and_then(serde_json::Value::as_str)
                .map(str::to_owned)
                .ok_or_else(|| {
                    VisionError::Config(format!(
                        "tokenizer_config.json names no `{key}`: gemma4's processor expands \
                         images with the tokenizer's image_token, boi_token and eoi_token"
                    ))
                })
        };
        Ok(Gemma4ImageMarkers {
            image: get("image_token")?,
            boi: get("boi_token")?,
            eoi: get("eoi_token")?,
        })
    }

    /// `prompt` with its i-th image marker replaced by `boi + image × tokens[i] + eoi`
    /// (Gemma4Processor's `re.sub` over the image token: the replacements are not rescanned).
    /// One marker per image, or refused.
    pub fn expand_prompt(&self, prompt: &str, tokens: &[usize]) -> Result<String, VisionError> {
        let markers = prompt.matches(self.image.as_str()).count();
        if markers != tokens.len() {
            return Err(VisionError::MarkerCount {
                markers,
                images: tokens.len(),
                marker: self.image.clone(),
            });
        }
        let mut out = String::with_capacity(prompt.len());
        let mut parts = prompt.split(self.image.as_str());
        out.push_str(parts.next().unwrap_or(""));
        // Planted: the soft tokens without their boi / eoi.
        let bracket = !plant::is(Defect::Gemma4ImageUnbracketed);
        for (part, &n) in parts.zip(tokens) {
            if bracket {
                out.push_str(&self.boi);
            }
            out.push_str(&self.image.repeat(n));
            if bracket {
                out.push_str(&self.eoi);
            }
            out.push_str(part);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_image_marker_expands_to_its_own_soft_token_count() {
        let cfg = serde_json::json!({"image_token": "<|image|>",
            "extra_special_tokens": {"boi_token": "<|image>", "eoi_token": "<image|>"}});
        let m = Gemma4ImageMarkers::from_tokenizer_config(&cfg).unwrap();
        let got = m.expand_prompt("a<|image|>b <|image|>", &[2, 1]).unwrap();
        assert_eq!(
            got,
            "a<|image><|image|><|image|><image|>b <|image><|image|><image|>"
        );
        assert!(matches!(
            m.expand_prompt("a<|image|>b", &[2, 1]),
            Err(VisionError::MarkerCount {
                markers: 1,
                images: 2,
                ..
            })
        ));
        let missing = Gemma4ImageMarkers::from_tokenizer_config(&serde_json::json!({}));
        assert!(missing.unwrap_err().to_string().contains("image_token"));
    }
}
