//! Image input: bytes → the pixel tensor a vision tower takes, computed exactly as mlx-vlm
//! (pinned in oracles/requirements-vision.txt) computes it, bit for bit.
//!
//! The reference path, for every family, starts in `mlx_vlm.utils.load_image`:
//! `PIL.Image.open` → `ImageOps.exif_transpose` → `.convert("RGB")`; then the checkpoint's
//! image processor. The steps here:
//!
//! - [`decode`]: PNG, JPEG, WebP or GIF (first frame) bytes → 8-bit RGB, with the size
//!   checked from the header BEFORE any pixel is decoded ([`Limits`]: no decompression
//!   bombs), the EXIF orientation applied as `exif_transpose` does, and every mode converted
//!   to RGB as Pillow's `convert("RGB")` does (alpha dropped, gray replicated, palette looked
//!   up, 16-bit gray clamped to 255, 16-bit color cut to its high byte).
//! - [`resize`]: Pillow's `Image.resize` (libImaging/Resample.c: separable convolution,
//!   support scaled on downscale, 22-bit fixed-point coefficients), bilinear and bicubic.
//! - [`gemma3`]: transformers' `Gemma3ImageProcessorPil` (the PIL backend mlx-vlm asks for
//!   with `use_fast=False`): resize to the config's size, rescale, normalize → [1, 3, H, W]
//!   f32; and `Gemma3Processor`'s prompt expansion (one soft token per image position).
//!
//! - [`gemma4`]: mlx-vlm's own `Gemma4ImageProcessor`: the aspect-ratio-preserving size
//!   within the soft-token budget, bicubic resize, rescale → [1, 3, H, W]; soft tokens.
//! - [`qwen_vl`]: mlx-vlm's own `Qwen3VLImageProcessor` (Qwen3-VL, Qwen3.5): smart_resize,
//!   bicubic resize, rescale, normalize, the patches `[n, C*T*P*P]` and `image_grid_thw`;
//!   `Qwen3VLProcessor`'s prompt expansion.
//!
//! - [`siglip`], [`gemma3_tower`]: gemma3's SigLIP tower, its multimodal projector and the
//!   merge of image features into the prompt's embeddings, as mlx-vlm's gemma3 `Model`.
//! - [`qwen_vit`]: Qwen3-VL's (and Qwen3.5's) vision tower; [`qwen3vl_lm`]: Qwen3-VL's
//!   language model on a prompt with images (M-RoPE, deepstack), bit-exact with mlx-vlm.
//! - [`qwen35_lm`], [`qwen35_gdn`]: Qwen3.5's hybrid language model on a prompt with images
//!   (gated delta nets with mlx-vlm's chunked prefill, gated M-RoPE attention), bit-exact
//!   with mlx-vlm.
//! - [`prompt`], [`model`], [`generate`]: `engine generate --image` as `mlx_vlm.generate`
//!   runs it: the messages with images, the four families behind [`model::ImageModel`], the
//!   loop.
//! - [`gemma4_vit`], [`gemma4_tower`]: gemma4's vision encoder, its embedder and the merge
//!   (with the per-layer inputs' ids), as mlx-vlm's gemma4 `Model`.
//!
//! Not here yet: serving images (docs/vision.md).

pub mod decode;
pub mod gemma3;
pub mod gemma3_tower;
pub mod gemma4;
pub mod gemma4_tower;
pub mod gemma4_vit;
pub mod generate;
pub mod model;
pub mod prompt;
pub mod qwen35_gdn;
pub mod qwen35_lm;
pub mod qwen3vl_lm;
pub mod qwen_lm;
pub mod qwen_vit;
pub mod qwen_vl;
pub mod resize;
pub mod served;
pub mod siglip;

pub use decode::{decode, Limits, RgbImage};

/// Why an image or a processor config was refused. Each message names the cause and the fix.
#[derive(Debug, thiserror::Error)]
pub enum VisionError {
    #[error("the image is empty (0 bytes): send the bytes of a PNG, JPEG, WebP or GIF image")]
    Empty,
    #[error(
        "not an image this engine reads ({found}): send PNG, JPEG, WebP or GIF bytes \
         (convert other formats first)"
    )]
    UnsupportedFormat { found: String },
    #[error(
        "the {format} header is unreadable ({detail}): the file is truncated or not a {format}"
    )]
    Header {
        format: &'static str,
        detail: String,
    },
    #[error(
        "the image is {width}x{height}: a side of {side} pixels is over the limit of {limit}; \
         crop or downscale it before sending"
    )]
    SideTooLong {
        width: u32,
        height: u32,
        side: u32,
        limit: u32,
    },
    #[error(
        "the image is {width}x{height} = {pixels} pixels, over the limit of {limit}; \
         downscale it before sending"
    )]
    TooManyPixels {
        width: u32,
        height: u32,
        pixels: u64,
        limit: u64,
    },
    #[error("the image has a zero side ({width}x{height}): send an image with pixels in it")]
    ZeroSize { width: u32, height: u32 },
    #[error(
        "the {format} image data is unreadable ({detail}): the file is truncated or corrupt; \
         re-encode it"
    )]
    Decode {
        format: &'static str,
        detail: String,
    },
    #[error(
        "the image is {width}x{height}: its aspect ratio is over {limit}, which this model's \
         processor refuses; crop or pad it closer to square"
    )]
    AspectRatio { width: u32, height: u32, limit: u32 },
    #[error("image processor config: {0}")]
    Config(String),
    #[error(
        "the prompt has {markers} image marker(s) `{marker}` for {images} image(s): put one \
         marker where each image goes"
    )]
    MarkerCount {
        markers: usize,
        images: usize,
        marker: String,
    },
}

/// A pixel tensor as the vision tower takes it: row-major `data` of `shape` (for gemma3
/// `[1, 3, H, W]`, channels first).
#[derive(Debug, Clone, PartialEq)]
pub struct PixelTensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

impl PixelTensor {
    /// The exact little-endian bytes of `data` (what the goldens hash).
    pub fn le_bytes(&self) -> Vec<u8> {
        if cfg!(target_endian = "little") {
            bytemuck::cast_slice(&self.data).to_vec()
        } else {
            self.data.iter().flat_map(|v| v.to_le_bytes()).collect()
        }
    }
}

/// Where a processor multiplies a byte by its rescale factor: transformers' PIL processors
/// in f64 (numpy upcasts, then the result is cast to f32), mlx-vlm's numpy ports in f32
/// (the Python float is weak, so the product stays f32).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RescaleIn {
    F64,
    F32,
}

/// A processor's rescale (`do_rescale`, `rescale_factor`) and normalize (`do_normalize`,
/// `image_mean`, `image_std`), resolved from its config.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scaling {
    pub rescale: Option<f64>,
    pub normalize: Option<([f64; 3], [f64; 3])>,
    pub rescale_in: RescaleIn,
}

impl Scaling {
    /// From a config's fields; `normalize_by_default` is the family's `do_normalize`
    /// default, the rescale factor's is 1/255.
    pub fn from_config(
        do_rescale: Option<bool>,
        rescale_factor: Option<f64>,
        (do_normalize, normalize_by_default): (Option<bool>, bool),
        (mean, std): ([f64; 3], [f64; 3]),
        rescale_in: RescaleIn,
    ) -> Self {
        Scaling {
            rescale: do_rescale
                .unwrap_or(true)
                .then(|| rescale_factor.unwrap_or(1.0 / 255.0)),
            normalize: do_normalize
                .unwrap_or(normalize_by_default)
                .then_some((mean, std)),
            rescale_in,
        }
    }

    /// Every output value as a function of (channel, byte): a 3×256 table, each entry
    /// computed as the reference computes it: rescale, then `(x − f32(mean[c])) /
    /// f32(std[c])` in f32.
    pub fn table(&self) -> [[f32; 256]; 3] {
        // Planted: the mean is off by 1/255 (without normalization, the values shift).
        let mean_off = match crate::plant::is(crate::plant::Defect::VisionMeanOff) {
            true => 1.0 / 255.0,
            false => 0.0,
        };
        let mut lut = [[0f32; 256]; 3];
        for (c, table) in lut.iter_mut().enumerate() {
            for (p, out) in table.iter_mut().enumerate() {
                let v = match (self.rescale, self.rescale_in) {
                    (Some(s), RescaleIn::F64) => (p as f64 * s) as f32,
                    (Some(s), RescaleIn::F32) => p as f32 * s as f32,
                    (None, _) => p as f32,
                };
                *out = match self.normalize {
                    Some((mean, std)) => (v - (mean[c] as f32 + mean_off)) / std[c] as f32,
                    None => v - mean_off,
                };
            }
        }
        lut
    }
}
