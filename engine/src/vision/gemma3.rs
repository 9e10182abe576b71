//! Gemma 3's image processor and prompt expansion, as mlx-vlm runs them.
//!
//! Pixels: transformers' `Gemma3ImageProcessorPil` (mlx-vlm's `Gemma3Processor.from_pretrained`
//! asks `AutoImageProcessor` for `use_fast=False`, the PIL backend), with pan-and-scan off:
//! - resize the RGB image to exactly `size.height` × `size.width` with Pillow's filter number
//!   `resample` (the checkpoints say 2, bilinear; aspect ratio not kept): [`super::resize`];
//! - rescale: `f32(f64(p) * rescale_factor)` (numpy upcasts to f64, multiplies, casts back);
//! - normalize: `(x - f32(mean[c])) / f32(std[c])` in f32;
//! - lay out channels first: `[1, 3, H, W]`.
//!
//! Text: `Gemma3Processor.__call__` replaces every `<start_of_image>` in the prompt by
//! `"\n\n<start_of_image>" + "<image_soft_token>" × image_seq_length + "<end_of_image>\n\n"`
//! (256 soft tokens for the released checkpoints), after checking that the markers and the
//! images agree in number.

use serde::Deserialize;

use super::resize::{resize, Filter};
use super::{PixelTensor, RescaleIn, RgbImage, Scaling, VisionError};
use crate::plant::{self, Defect};

pub const BOI_TOKEN: &str = "<start_of_image>";
pub const IMAGE_TOKEN: &str = "<image_soft_token>";
pub const EOI_TOKEN: &str = "<end_of_image>";

#[derive(Debug, Clone, Copy, Deserialize, PartialEq)]
pub struct Size {
    pub height: u32,
    pub width: u32,
}

/// A mean or std: one number for every channel, or one per channel (as transformers takes).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum PerChannel {
    One(f64),
    Three([f64; 3]),
}

impl PerChannel {
    fn get(&self) -> [f64; 3] {
        match self {
            PerChannel::One(v) => [*v; 3],
            PerChannel::Three(v) => *v,
        }
    }
}

/// The fields of a checkpoint's `preprocessor_config.json` this processor reads, with
/// `Gemma3ImageProcessorPil`'s class defaults for the ones a config leaves out or sets null.
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct Gemma3Config {
    #[serde(default = "default_size")]
    pub size: Size,
    #[serde(default)]
    pub resample: Option<u32>,
    #[serde(default)]
    pub do_resize: Option<bool>,
    #[serde(default)]
    pub do_rescale: Option<bool>,
    #[serde(default)]
    pub rescale_factor: Option<f64>,
    #[serde(default)]
    pub do_normalize: Option<bool>,
    #[serde(default)]
    pub image_mean: Option<PerChannel>,
    #[serde(default)]
    pub image_std: Option<PerChannel>,
    #[serde(default)]
    pub do_pan_and_scan: Option<bool>,
    /// Soft tokens per image (`image_seq_length`; processor_config.json may carry it too).
    #[serde(default)]
    pub image_seq_length: Option<usize>,
}

fn default_size() -> Size {
    Size {
        height: 224,
        width: 224,
    }
}

/// A checked processor: every value the pixel math uses, resolved.
#[derive(Debug, Clone, PartialEq)]
pub struct Gemma3Processor {
    pub size: Size,
    pub filter: Filter,
    pub do_resize: bool,
    pub scaling: Scaling,
    pub image_seq_length: usize,
}

/// The largest side a config may ask for (the released checkpoints use 896).
const MAX_SIDE: u32 = 4096;

impl Gemma3Processor {
    /// From the JSON of `preprocessor_config.json`.
    pub fn from_json(text: &str) -> Result<Self, VisionError> {
        let cfg: Gemma3Config = serde_json::from_str(text)
            .map_err(|e| VisionError::Config(format!("preprocessor_config.json: {e}")))?;
        Self::new(&cfg)
    }

    pub fn new(cfg: &Gemma3Config) -> Result<Self, VisionError> {
        if cfg.do_pan_and_scan == Some(true) {
            return Err(VisionError::Config(
                "do_pan_and_scan is true: pan-and-scan crops are not supported yet; set it to \
                 false (the released checkpoints have it off)"
                    .into(),
            ));
        }
        let Size { height, width } = cfg.size;
        if !(1..=MAX_SIDE).contains(&height) || !(1..=MAX_SIDE).contains(&width) {
            return Err(VisionError::Config(format!(
                "size {width}x{height}: each side must be 1..={MAX_SIDE}"
            )));
        }
        let resample = cfg.resample.unwrap_or(2);
        let filter = Filter::from_pil(resample).ok_or_else(|| {
            VisionError::Config(format!(
                "resample {resample}: only Pillow's bilinear (2) and bicubic (3) are supported"
            ))
        })?;
        let mean = cfg.image_mean.as_ref().map_or([0.5; 3], PerChannel::get);
        let std = cfg.image_std.as_ref().map_or([0.5; 3], PerChannel::get);
        if std.iter().any(|s| !s.is_finite() || *s == 0.0) || mean.iter().any(|m| !m.is_finite()) {
            return Err(VisionError::Config(format!(
                "image_mean {mean:?} / image_std {std:?}: need finite values and a nonzero std"
            )));
        }
        let image_seq_length = cfg.image_seq_length.unwrap_or(256);
        if !(1..=65536).contains(&image_seq_length) {
            return Err(VisionError::Config(format!(
                "image_seq_length {image_seq_length}: must be 1..=65536"
            )));
        }
        Ok(Gemma3Processor {
            size: cfg.size,
            filter,
            do_resize: cfg.do_resize.unwrap_or(true),
            scaling: Scaling::from_config(
                cfg.do_rescale,
                cfg.rescale_factor,
                (cfg.do_normalize, true),
                (mean, std),
                RescaleIn::F64,
            ),
            image_seq_length,
        })
    }

    /// The pixel tensor `[1, 3, H, W]` of one decoded image.
    pub fn preprocess(&self, img: &RgbImage) -> PixelTensor {
        let resized;
        let img = if self.do_resize {
            resized = resize(img, self.size.width, self.size.height, self.filter);
            &resized
        } else {
            img
        };
        let (w, h) = (img.width as usize, img.height as usize);
        let lut = self.scaling.table();
        let n = h * w;
        let mut data = vec![0f32; 3 * n];
        let (r, rest) = data.split_at_mut(n);
        let (g, b) = rest.split_at_mut(n);
        for i in 0..n {
            r[i] = lut[0][usize::from(img.data[i * 3])];
            g[i] = lut[1][usize::from(img.data[i * 3 + 1])];
            b[i] = lut[2][usize::from(img.data[i * 3 + 2])];
        }
        PixelTensor {
            shape: vec![1, 3, h, w],
            data,
        }
    }

    /// The image tokens one image takes in the prompt.
    pub fn tokens_per_image(&self) -> usize {
        if plant::is(Defect::VisionTokenCountOffByOne) {
            self.image_seq_length + 1
        } else {
            self.image_seq_length
        }
    }

    /// The text one image marker becomes.
    pub fn image_sequence(&self) -> String {
        format!(
            "\n\n{BOI_TOKEN}{}{EOI_TOKEN}\n\n",
            IMAGE_TOKEN.repeat(self.tokens_per_image())
        )
    }

    /// `prompt` with each `<start_of_image>` expanded, for `n_images` images.
    pub fn expand_prompt(&self, prompt: &str, n_images: usize) -> Result<String, VisionError> {
        let markers = prompt.matches(BOI_TOKEN).count();
        if markers != n_images {
            return Err(VisionError::MarkerCount {
                markers,
                images: n_images,
                marker: BOI_TOKEN.into(),
            });
        }
        Ok(prompt.replace(BOI_TOKEN, &self.image_sequence()))
    }
}
