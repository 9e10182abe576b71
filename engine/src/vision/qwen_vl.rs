//! Qwen3-VL's (and Qwen3.5's) image processor, as mlx-vlm runs it: mlx-vlm's own numpy port
//! `Qwen3VLImageProcessor` (mlx_vlm/models/qwen3_vl/processing_qwen3_vl.py), configured by
//! `_qwen_vl_image_kwargs` from the checkpoint's preprocessor_config.json.
//!
//! The math, for one RGB image of H × W:
//! - smart_resize with `factor = patch_size * merge_size`: refuse an aspect ratio over 200;
//!   `h = round(H / factor) * factor` (Python's round: half to even), same for `w`; if
//!   `h * w > max_pixels`: `beta = sqrt(H * W / max_pixels)`,
//!   `h = max(factor, floor(H / beta / factor) * factor)` (same for w); else if
//!   `h * w < min_pixels`: `beta = sqrt(min_pixels / (H * W))`,
//!   `h = ceil(H * beta / factor) * factor` (same for w); all in f64;
//! - Pillow bicubic resize to w × h (a copy at the same size): [`super::resize`];
//! - rescale `f32(p) * f32(rescale_factor)` (numpy keeps f32: the Python float is weak),
//!   normalize `(x - f32(mean[c])) / f32(std[c])`;
//! - the frame repeated `temporal_patch_size` times and cut into patches: row
//!   `((bh * gw/ms + bw) * ms + mh) * ms + mw`, column `((c * T + t) * P + py) * P + px`, for
//!   pixel row `(bh * ms + mh) * P + py`, column `(bw * ms + mw) * P + px`; shape
//!   `[gh * gw, C * T * P * P]`, `image_grid_thw = [1, gh, gw]` (`gh = h / P`);
//! - image tokens in the prompt: `gh * gw / ms²`.
//!
//! Text ([`expand_prompt`], `Qwen3VLProcessor.__call__`): with more `<|image_pad|>` markers
//! than images the surplus ones, first first, are dropped (with their
//! `<|vision_start|>…<|vision_end|>` wrapper when they have one); then the k-th remaining
//! marker becomes k-th image's token count of `<|image_pad|>`. Fewer markers than images is
//! refused.

use serde::Deserialize;

use super::resize::{resize, Filter};
use super::{PixelTensor, RescaleIn, RgbImage, Scaling, VisionError};
use crate::plant::{self, Defect};

/// The fields of preprocessor_config.json this processor reads (mlx-vlm's defaults for the
/// ones a config leaves out).
#[derive(Debug, Clone, Deserialize, Default)]
pub struct QwenVlConfig {
    pub patch_size: Option<usize>,
    pub temporal_patch_size: Option<usize>,
    pub merge_size: Option<usize>,
    pub image_mean: Option<[f64; 3]>,
    pub image_std: Option<[f64; 3]>,
    pub rescale_factor: Option<f64>,
    pub do_rescale: Option<bool>,
    pub do_normalize: Option<bool>,
    pub size: Option<SizeRange>,
    pub min_pixels: Option<u64>,
    pub max_pixels: Option<u64>,
}

#[derive(Debug, Clone, Deserialize, Default)]
pub struct SizeRange {
    pub shortest_edge: Option<u64>,
    pub longest_edge: Option<u64>,
}

/// A checked processor.
#[derive(Debug, Clone, PartialEq)]
pub struct QwenVlProcessor {
    pub patch_size: usize,
    pub temporal_patch_size: usize,
    pub merge_size: usize,
    pub min_pixels: u64,
    pub max_pixels: u64,
    pub scaling: Scaling,
}

/// One image's patches.
#[derive(Debug, Clone, PartialEq)]
pub struct QwenVlPixels {
    /// `[gh * gw, 3 * T * P * P]`.
    pub pixels: PixelTensor,
    /// `[t, gh, gw]` (t = 1 for an image).
    pub grid_thw: [usize; 3],
    /// The image tokens this image takes in the prompt.
    pub tokens: usize,
}

impl QwenVlProcessor {
    pub fn from_json(text: &str) -> Result<Self, VisionError> {
        let cfg: QwenVlConfig = serde_json::from_str(text)
            .map_err(|e| VisionError::Config(format!("preprocessor_config.json: {e}")))?;
        Self::new(&cfg)
    }

    pub fn new(cfg: &QwenVlConfig) -> Result<Self, VisionError> {
        let size = cfg.size.clone().unwrap_or_default();
        let p = QwenVlProcessor {
            patch_size: cfg.patch_size.unwrap_or(16),
            temporal_patch_size: cfg.temporal_patch_size.unwrap_or(2),
            merge_size: cfg.merge_size.unwrap_or(2),
            min_pixels: cfg.min_pixels.or(size.shortest_edge).unwrap_or(56 * 56),
            max_pixels: cfg
                .max_pixels
                .or(size.longest_edge)
                .unwrap_or(14 * 14 * 4 * 1280),
            scaling: Scaling::from_config(
                cfg.do_rescale,
                cfg.rescale_factor,
                (cfg.do_normalize, true),
                (
                    cfg.image_mean.unwrap_or([0.5; 3]),
                    cfg.image_std.unwrap_or([0.5; 3]),
                ),
                RescaleIn::F32,
            ),
        };
        let ok = |v: usize, max: usize| (1..=max).contains(&v);
        if !ok(p.patch_size, 64) || !ok(p.temporal_patch_size, 8) || !ok(p.merge_size, 8) {
            return Err(VisionError::Config(format!(
                "patch_size {} / temporal_patch_size {} / merge_size {}: need 1..=64 / 1..=8 / 1..=8",
                p.patch_size, p.temporal_patch_size, p.merge_size
            )));
        }
        if p.min_pixels == 0 || p.min_pixels > p.max_pixels || p.max_pixels > 1 << 26 {
            return Err(VisionError::Config(format!(
                "min_pixels {} / max_pixels {}: need 1 <= min <= max <= 2^26",
                p.min_pixels, p.max_pixels
            )));
        }
        if let Some((_, std)) = p.scaling.normalize {
            if std.iter().any(|s| !s.is_finite() || *s == 0.0) {
                return Err(VisionError::Config(format!(
                    "image_std {std:?}: need finite nonzero values"
                )));
            }
        }
        Ok(p)
    }

    fn factor(&self) -> usize {
        self.patch_size * self.merge_size
    }

    /// The size an H × W image is resized to (mlx-vlm's `_smart_resize_image`).
    pub fn smart_resize(&self, height: u32, width: u32) -> Result<(u32, u32), VisionError> {
        let (h, w) = (f64::from(height), f64::from(width));
        let ratio = h.max(w) / h.min(w);
        if ratio > 200.0 {
            return Err(VisionError::AspectRatio {
                width,
                height,
                limit: 200,
            });
        }
        let f = self.factor() as f64;
        let mut hb = (h / f).round_ties_even() * f;
        let mut wb = (w / f).round_ties_even() * f;
        if hb * wb > self.max_pixels as f64 {
            let beta = (h * w / self.max_pixels as f64).sqrt();
            hb = f.max((h / beta / f).floor() * f);
            wb = f.max((w / beta / f).floor() * f);
        } else if hb * wb < self.min_pixels as f64 {
            let beta = (self.min_pixels as f64 / (h * w)).sqrt();
            hb = (h * beta / f).ceil() * f;
            wb = (w * beta / f).ceil() * f;
        }
        Ok((hb as u32, wb as u32))
    }

    /// The tokens an H × W image takes in the prompt (its merged patches).
    pub fn image_tokens(&self, height: u32, width: u32) -> Result<usize, VisionError> {
        let (h, w) = self.smart_resize(height, width)?;
        let (gh, gw) = (h as usize / self.patch_size, w as usize / self.patch_size);
        let ms = self.merge_size;
        Ok(gh * gw / (ms * ms) + usize::from(plant::is(Defect::VisionTokenCountOffByOne)))
    }

    /// The patches of one decoded image.
    pub fn preprocess(&self, img: &RgbImage) -> Result<QwenVlPixels, VisionError> {
        let tokens = self.image_tokens(img.height, img.width)?;
        let (h, w) = self.smart_resize(img.height, img.width)?;
        let img = resize(img, w, h, Filter::Bicubic);
        let (ps, tps, ms) = (self.patch_size, self.temporal_patch_size, self.merge_size);
        let (h, w) = (h as usize, w as usize);
        let (gh, gw) = (h / ps, w / ps);
        let lut = self.scaling.table();
        let cols = 3 * tps * ps * ps;
        let mut data = vec![0f32; gh * gw * cols];
        let mut row = 0;
        for bh in 0..gh / ms {
            for bw in 0..gw / ms {
                for mh in 0..ms {
                    for mw in 0..ms {
                        let out = &mut data[row * cols..(row + 1) * cols];
                        let (y0, x0) = ((bh * ms + mh) * ps, (bw * ms + mw) * ps);
                        for (c, table) in lut.iter().enumerate() {
                            for t in 0..tps {
                                for py in 0..ps {
                                    let src = ((y0 + py) * w + x0) * 3 + c;
                                    let dst = ((c * tps + t) * ps + py) * ps;
                                    for px in 0..ps {
                                        out[dst + px] = table[usize::from(img.data[src + px * 3])];
                                    }
                                }
                            }
                        }
                        row += 1;
                    }
                }
            }
        }
        Ok(QwenVlPixels {
            pixels: PixelTensor {
                shape: vec![gh * gw, cols],
                data,
            },
            grid_thw: [1, gh, gw],
            tokens,
        })
    }
}

pub const IMAGE_PAD: &str = "<|image_pad|>";
pub const VISION_START: &str = "<|vision_start|>";
pub const VISION_END: &str = "<|vision_end|>";

/// `prompt` with its image markers expanded for images taking `tokens[i]` tokens each.
pub fn expand_prompt(prompt: &str, tokens: &[usize]) -> Result<String, VisionError> {
    let markers = prompt.matches(IMAGE_PAD).count();
    if markers < tokens.len() {
        return Err(VisionError::MarkerCount {
            markers,
            images: tokens.len(),
            marker: IMAGE_PAD.into(),
        });
    }
    let mut text = prompt.to_string();
    for _ in 0..markers - tokens.len() {
        let Some(at) = text.find(IMAGE_PAD) else {
            break;
        };
        let end = at + IMAGE_PAD.len();
        let wrapped = text[..at].ends_with(VISION_START) && text[end..].starts_with(VISION_END);
        let range = if wrapped {
            at - VISION_START.len()..end + VISION_END.len()
        } else {
            at..end
        };
        text.replace_range(range, "");
    }
    // Each marker in turn takes its image's run (a stand-in keeps the runs already written
    // from being taken as markers), as the reference does.
    const HOLD: &str = "<|placeholder|>";
    for &n in tokens {
        text = text.replacen(IMAGE_PAD, &HOLD.repeat(n), 1);
    }
    Ok(text.replace(HOLD, IMAGE_PAD))
}
