//! Image bytes → 8-bit RGB, as `mlx_vlm.utils.load_image` makes it: `PIL.Image.open`,
//! `ImageOps.exif_transpose`, `.convert("RGB")`.
//!
//! Order of work, so that no hostile file costs more than its header:
//! 1. sniff the format from the magic bytes (the declared MIME type is not trusted; Pillow
//!    also opens by content) and refuse anything but PNG, JPEG, WebP and GIF;
//! 2. read the header only, and refuse a zero side, a side over [`Limits::max_side`] or an
//!    area over [`Limits::max_pixels`] before a pixel buffer exists;
//! 3. decode under `image::Limits` (the allocation cap backs up step 2 for any buffer the
//!    decoder makes on its own);
//! 4. apply the EXIF orientation (JPEG APP1, PNG eXIf, WebP EXIF), as `exif_transpose`;
//! 5. convert to RGB with Pillow's rules: alpha dropped (not composited), gray replicated,
//!    palette looked up (transparency ignored), sub-8-bit gray scaled to 0..255, 16-bit gray
//!    (Pillow's "I;16") clamped to 255, 16-bit color and gray+alpha cut to the high byte
//!    (Pillow unpacks them with its ";16B" raw modes).

use std::io::Cursor;

use image::{DynamicImage, ImageDecoder, ImageFormat, ImageReader};

use super::VisionError;

/// Size limits checked on the header before decoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Longest side, in pixels.
    pub max_side: u32,
    /// Width × height.
    pub max_pixels: u64,
}

impl Limits {
    /// 16384 px a side (no camera makes more; a 1×100000 strip is refused), 40 MP in all
    /// (a 120 MB RGB buffer; Pillow warns past 89 MP and refuses past 179 MP).
    pub const DEFAULT: Limits = Limits {
        max_side: 16384,
        max_pixels: 40_000_000,
    };
}

impl Default for Limits {
    fn default() -> Self {
        Limits::DEFAULT
    }
}

/// 8-bit RGB pixels, row-major, interleaved (`data.len() == width * height * 3`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RgbImage {
    pub width: u32,
    pub height: u32,
    pub data: Vec<u8>,
}

fn format_name(f: ImageFormat) -> &'static str {
    match f {
        ImageFormat::Png => "PNG",
        ImageFormat::Jpeg => "JPEG",
        ImageFormat::WebP => "WebP",
        ImageFormat::Gif => "GIF",
        _ => "image",
    }
}

/// Decodes `bytes` (PNG, JPEG, WebP, or a GIF's first frame) into RGB as the reference does.
pub fn decode(bytes: &[u8], limits: &Limits) -> Result<RgbImage, VisionError> {
    if bytes.is_empty() {
        return Err(VisionError::Empty);
    }
    let format = match image::guess_format(bytes) {
        Ok(f @ (ImageFormat::Png | ImageFormat::Jpeg | ImageFormat::WebP | ImageFormat::Gif)) => f,
        Ok(other) => {
            return Err(VisionError::UnsupportedFormat {
                found: format!("{other:?}"),
            })
        }
        Err(_) => {
            return Err(VisionError::UnsupportedFormat {
                found: "unknown bytes".into(),
            })
        }
    };
    let name = format_name(format);
    if format == ImageFormat::Jpeg {
        return decode_jpeg(bytes, limits);
    }
    let header = |e: image::ImageError| VisionError::Header {
        format: name,
        detail: e.to_string(),
    };
    // PNG and GIF state their size at a fixed place: check it before a decoder even reads
    // the header's other chunks (a file that is all header gets the size refusal).
    if let Some((w, h)) = peek_size(format, bytes) {
        check_size(w, h, limits)?;
    }
    let mut reader = ImageReader::new(Cursor::new(bytes));
    reader.set_format(format);
    // The allocation cap: the largest buffer the accepted sizes need (RGBA, 16 bits a
    // channel) plus slack for a decoder's own tables.
    let mut caps = image::Limits::default();
    caps.max_image_width = Some(limits.max_side);
    caps.max_image_height = Some(limits.max_side);
    caps.max_alloc = Some(limits.max_pixels.saturating_mul(8).saturating_add(64 << 20));
    reader.limits(caps);
    let mut decoder = reader.into_decoder().map_err(header)?;
    let (width, height) = decoder.dimensions();
    check_size(width, height, limits)?;
    let orientation = if format == ImageFormat::Gif {
        image::metadata::Orientation::NoTransforms
    } else {
        decoder.orientation().map_err(header)?
    };
    let mut img = DynamicImage::from_decoder(decoder).map_err(|e| VisionError::Decode {
        format: name,
        detail: e.to_string(),
    })?;
    img.apply_orientation(orientation);
    Ok(to_rgb(img))
}

/// JPEG through libjpeg-turbo's decoder (mozjpeg's build), as Pillow decodes it: the
/// accurate integer IDCT, fancy (triangle) chroma upsampling, the library's YCbCr → RGB.
/// libjpeg reports a fatal error by unwinding (mozjpeg-sys `unwinding`): caught here.
fn decode_jpeg(bytes: &[u8], limits: &Limits) -> Result<RgbImage, VisionError> {
    // Pillow refuses a JPEG whose data ends before the image does ("image file is
    // truncated"); libjpeg would pad it with gray. The end-of-image marker must follow the
    // last start-of-scan (inside scan data 0xFF is always stuffed, so 0xFFD9 is a marker).
    let last_sos = bytes.windows(2).rposition(|w| w == [0xFF, 0xDA]);
    let complete = last_sos.is_some_and(|i| bytes[i..].windows(2).any(|w| w == [0xFF, 0xD9]));
    let fail = |detail: String| VisionError::Decode {
        format: "JPEG",
        detail,
    };
    let unwound = |p: Box<dyn std::any::Any + Send>| {
        p.downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "libjpeg error".into())
    };
    // Header (and the EXIF orientation) first: nothing the size of the image is allocated
    // before its size passes the limits.
    let (width, height, gray, orientation) = std::panic::catch_unwind(|| {
        let d = mozjpeg::Decompress::with_markers(&[mozjpeg::Marker::APP(1)])
            .from_mem(bytes)
            .map_err(|e| e.to_string())?;
        let (w, h) = d.size();
        let orientation = d
            .markers()
            .filter(|m| m.marker == mozjpeg::Marker::APP(1))
            .find_map(|m| m.data.strip_prefix(b"Exif\0\0"))
            .and_then(image::metadata::Orientation::from_exif_chunk)
            .unwrap_or(image::metadata::Orientation::NoTransforms);
        let cs = d.color_space();
        Ok::<_, String>((w, h, cs, orientation))
    })
    .map_err(|p| VisionError::Header {
        format: "JPEG",
        detail: unwound(p),
    })?
    .map_err(|detail| VisionError::Header {
        format: "JPEG",
        detail,
    })?;
    let (width, height) = (
        u32::try_from(width).unwrap_or(u32::MAX),
        u32::try_from(height).unwrap_or(u32::MAX),
    );
    check_size(width, height, limits)?;
    use mozjpeg_sys::J_COLOR_SPACE::{JCS_YCbCr, JCS_GRAYSCALE, JCS_RGB};
    let gray = match gray {
        JCS_GRAYSCALE => true,
        JCS_YCbCr | JCS_RGB => false,
        other => {
            return Err(fail(format!(
                "color space {other:?} (CMYK/YCCK JPEGs are not supported yet); re-encode it as RGB"
            )))
        }
    };
    if !complete {
        return Err(fail(
            "the data ends before the image does (truncated)".into(),
        ));
    }
    let pixels = std::panic::catch_unwind(|| {
        let d = mozjpeg::Decompress::new_mem(bytes).map_err(|e| e.to_string())?;
        let mut started = if gray { d.grayscale() } else { d.rgb() }.map_err(|e| e.to_string())?;
        let px: Vec<u8> = started.read_scanlines().map_err(|e| e.to_string())?;
        started.finish().map_err(|e| e.to_string())?;
        Ok::<_, String>(px)
    })
    .map_err(|p| fail(unwound(p)))?
    .map_err(fail)?;
    let img = if gray {
        image::GrayImage::from_raw(width, height, pixels).map(DynamicImage::ImageLuma8)
    } else {
        image::RgbImage::from_raw(width, height, pixels).map(DynamicImage::ImageRgb8)
    };
    let mut img = img.ok_or_else(|| fail("fewer pixels than the header states".into()))?;
    img.apply_orientation(orientation);
    Ok(to_rgb(img))
}

/// The size a PNG's IHDR or a GIF's logical screen states, read from the bytes.
fn peek_size(format: ImageFormat, b: &[u8]) -> Option<(u32, u32)> {
    match format {
        ImageFormat::Png if b.len() >= 24 && &b[12..16] == b"IHDR" => Some((
            u32::from_be_bytes([b[16], b[17], b[18], b[19]]),
            u32::from_be_bytes([b[20], b[21], b[22], b[23]]),
        )),
        ImageFormat::Gif if b.len() >= 10 => Some((
            u32::from(u16::from_le_bytes([b[6], b[7]])),
            u32::from(u16::from_le_bytes([b[8], b[9]])),
        )),
        _ => None,
    }
}

/// Refuses a size before anything of that size is allocated.
pub fn check_size(width: u32, height: u32, limits: &Limits) -> Result<(), VisionError> {
    if width == 0 || height == 0 {
        return Err(VisionError::ZeroSize { width, height });
    }
    let side = width.max(height);
    if side > limits.max_side {
        return Err(VisionError::SideTooLong {
            width,
            height,
            side,
            limit: limits.max_side,
        });
    }
    let pixels = u64::from(width) * u64::from(height);
    if pixels > limits.max_pixels {
        return Err(VisionError::TooManyPixels {
            width,
            height,
            pixels,
            limit: limits.max_pixels,
        });
    }
    Ok(())
}

/// Pillow's `convert("RGB")` of the mode Pillow would have opened the file in.
fn to_rgb(img: DynamicImage) -> RgbImage {
    let (width, height) = (img.width(), img.height());
    let n = width as usize * height as usize;
    let mut data = Vec::with_capacity(n * 3);
    let gray = |data: &mut Vec<u8>, v: u8| data.extend_from_slice(&[v, v, v]);
    match img {
        DynamicImage::ImageRgb8(b) => data = b.into_raw(),
        DynamicImage::ImageRgba8(b) => b
            .as_raw()
            .chunks_exact(4)
            .for_each(|p| data.extend_from_slice(&p[..3])),
        DynamicImage::ImageLuma8(b) => b.as_raw().iter().for_each(|&v| gray(&mut data, v)),
        DynamicImage::ImageLumaA8(b) => b
            .as_raw()
            .chunks_exact(2)
            .for_each(|p| gray(&mut data, p[0])),
        // Pillow opens 16-bit gray as "I;16"; its conversion to 8 bits clamps.
        DynamicImage::ImageLuma16(b) => b
            .as_raw()
            .iter()
            .for_each(|&v| gray(&mut data, v.min(255) as u8)),
        // 16-bit gray+alpha opens as "RGBA" through "LA;16B": the high byte.
        DynamicImage::ImageLumaA16(b) => b
            .as_raw()
            .chunks_exact(2)
            .for_each(|p| gray(&mut data, (p[0] >> 8) as u8)),
        DynamicImage::ImageRgb16(b) => data.extend(b.as_raw().iter().map(|&v| (v >> 8) as u8)),
        DynamicImage::ImageRgba16(b) => b
            .as_raw()
            .chunks_exact(4)
            .for_each(|p| data.extend(p[..3].iter().map(|&v| (v >> 8) as u8))),
        // No decoder taken here yields float pixels; convert the way `image` does.
        other => data = other.to_rgb8().into_raw(),
    }
    RgbImage {
        width,
        height,
        data,
    }
}
