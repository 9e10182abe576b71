//! Pillow's `Image.resize` of an 8-bit RGB image, bit for bit (libImaging/Resample.c,
//! `ImagingResample` with the full-image box, no `reducing_gap`), ported from its semantics.
//!
//! The math: a separable convolution, two passes: horizontal first (over only the rows the
//! vertical pass reads), unless the height shrinks by more than twice what the width does,
//! then vertical first (Pillow 13's `ImagingResampleInner` rule; the order matters, each
//! pass rounds to 8 bits). For an axis of `in` samples resized to `out`:
//! `scale = in / out`, `filterscale = max(scale, 1)` (so a downscale widens the kernel:
//! antialiasing), `support = filter.support * filterscale`. Output sample `i` is centered at
//! `c = (i + 0.5) * scale`; it reads inputs `xmin = trunc(c - support + 0.5)` (at least 0) to
//! `trunc(c + support + 0.5)` (at most `in`), weights `filter((x - c + 0.5) / filterscale)`
//! normalized to sum 1 in f64, then turned into fixed point with 22 fraction bits
//! (`trunc(w * 2^22 ± 0.5)`, away from zero). A pixel is `(2^21 + Σ p·w) >> 22` clamped to
//! 0..=255, in i32 arithmetic. Same size in → a copy.
//!
//! Filters: bilinear (triangle, support 1) and bicubic (Keys, a = -0.5, support 2), Pillow's
//! `BILINEAR = 2` and `BICUBIC = 3`. `Nearest` exists for the planted defect only.

use super::RgbImage;
use crate::plant::{self, Defect};

/// A resampling filter (Pillow's numbering in [`Filter::from_pil`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Filter {
    Bilinear,
    Bicubic,
    /// Center sampling, no convolution (not Pillow's NEAREST: the planted defect's filter).
    Nearest,
}

impl Filter {
    /// Pillow's `Image.Resampling` value → a filter this port has.
    pub fn from_pil(resample: u32) -> Option<Filter> {
        match resample {
            2 => Some(Filter::Bilinear),
            3 => Some(Filter::Bicubic),
            _ => None,
        }
    }

    fn support(self) -> f64 {
        match self {
            Filter::Bilinear => 1.0,
            Filter::Bicubic => 2.0,
            Filter::Nearest => 0.5,
        }
    }

    fn weight(self, x: f64) -> f64 {
        let x = x.abs();
        match self {
            Filter::Bilinear => {
                if x < 1.0 {
                    1.0 - x
                } else {
                    0.0
                }
            }
            Filter::Bicubic => {
                const A: f64 = -0.5;
                if x < 1.0 {
                    ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
                } else if x < 2.0 {
                    (((x - 5.0) * x + 8.0) * x - 4.0) * A
                } else {
                    0.0
                }
            }
            Filter::Nearest => 0.0,
        }
    }
}

const PRECISION_BITS: u32 = 32 - 8 - 2;

/// One axis's taps: for each output sample the first input and the fixed-point weights.
struct Taps {
    ksize: usize,
    bounds: Vec<(usize, usize)>,
    weights: Vec<i32>,
}

fn taps(in_size: usize, out_size: usize, filter: Filter) -> Taps {
    if filter == Filter::Nearest {
        // The defect: one tap at the sample nearest the center.
        let scale = in_size as f64 / out_size as f64;
        let bounds = (0..out_size)
            .map(|i| ((((i as f64 + 0.5) * scale) as usize).min(in_size - 1), 1))
            .collect();
        return Taps {
            ksize: 1,
            bounds,
            weights: vec![1 << PRECISION_BITS; out_size],
        };
    }
    // Pillow computes `in1 - in0` of the float box in f32, then widens: exact for any side
    // under 2^24, which the decode limits guarantee.
    let scale = f64::from(in_size as f32) / out_size as f64;
    let filterscale = scale.max(1.0);
    let support = filter.support() * filterscale;
    let ksize = support.ceil() as usize * 2 + 1;
    let mut bounds = Vec::with_capacity(out_size);
    let mut weights = vec![0i32; out_size * ksize];
    let mut k = vec![0f64; ksize];
    for i in 0..out_size {
        let center = (i as f64 + 0.5) * scale;
        let ss = 1.0 / filterscale;
        let xmin = ((center - support + 0.5) as i64).max(0) as usize;
        let xmax = ((center + support + 0.5) as i64).min(in_size as i64) as usize - xmin;
        let mut ww = 0.0;
        for (x, kx) in k.iter_mut().enumerate().take(xmax) {
            let w = filter.weight(((x + xmin) as f64 - center + 0.5) * ss);
            *kx = w;
            ww += w;
        }
        let row = &mut weights[i * ksize..(i + 1) * ksize];
        for (x, out) in row.iter_mut().enumerate().take(xmax) {
            let w = if ww != 0.0 { k[x] / ww } else { k[x] };
            let scaled = w * f64::from(1u32 << PRECISION_BITS);
            *out = if w < 0.0 {
                (-0.5 + scaled) as i32
            } else {
                (0.5 + scaled) as i32
            };
        }
        bounds.push((xmin, xmax));
    }
    Taps {
        ksize,
        bounds,
        weights,
    }
}

#[inline]
fn clip8(ss: i64) -> u8 {
    (ss >> PRECISION_BITS).clamp(0, 255) as u8
}

/// The rounding half every sum starts from.
const HALF: i64 = 1 << (PRECISION_BITS - 1);

// The sums below are Pillow's 32-bit int accumulators, held in i64: the same values (for
// these filters |Σ p·w| ≤ 255 · Σ|w| stays far under 2^31), and no input can overflow them.
// Plain slice loops (no iterator adapters): the debug-build tests run these over 40 images
// at 896×896.

/// The horizontal pass over `rows` of a `w`-wide image.
fn horizontal(src: &[u8], w: usize, rows: std::ops::Range<usize>, t: &Taps) -> Vec<u8> {
    let ow = t.bounds.len();
    let mut out = vec![0u8; rows.len() * ow * 3];
    for (oy, y) in rows.enumerate() {
        let row = &src[y * w * 3..(y + 1) * w * 3];
        let dst = &mut out[oy * ow * 3..(oy + 1) * ow * 3];
        for x in 0..ow {
            let (xmin, n) = t.bounds[x];
            let k = &t.weights[x * t.ksize..x * t.ksize + n];
            let px = &row[xmin * 3..(xmin + n) * 3];
            let (mut s0, mut s1, mut s2) = (HALF, HALF, HALF);
            for j in 0..n {
                s0 += i64::from(px[j * 3]) * i64::from(k[j]);
                s1 += i64::from(px[j * 3 + 1]) * i64::from(k[j]);
                s2 += i64::from(px[j * 3 + 2]) * i64::from(k[j]);
            }
            dst[x * 3] = clip8(s0);
            dst[x * 3 + 1] = clip8(s1);
            dst[x * 3 + 2] = clip8(s2);
        }
    }
    out
}

/// The vertical pass over a `w`-wide image whose first row is source row `row0`.
fn vertical(src: &[u8], w: usize, row0: usize, t: &Taps) -> Vec<u8> {
    let oh = t.bounds.len();
    let stride = w * 3;
    let mut out = vec![0u8; oh * stride];
    let mut acc = vec![0i64; stride];
    for y in 0..oh {
        let (ymin, n) = t.bounds[y];
        let k = &t.weights[y * t.ksize..y * t.ksize + n];
        acc.fill(HALF);
        for (j, &kj) in k.iter().enumerate() {
            let r = ymin - row0 + j;
            let row = &src[r * stride..(r + 1) * stride];
            let kj = i64::from(kj);
            for i in 0..stride {
                acc[i] += i64::from(row[i]) * kj;
            }
        }
        let dst = &mut out[y * stride..(y + 1) * stride];
        for i in 0..stride {
            dst[i] = clip8(acc[i]);
        }
    }
    out
}

/// `img` resized to `width` × `height` with `filter`, as Pillow's `Image.resize`.
pub fn resize(img: &RgbImage, width: u32, height: u32, filter: Filter) -> RgbImage {
    let filter = if plant::is(Defect::VisionResizeNearest) {
        Filter::Nearest
    } else {
        filter
    };
    let (iw, ih) = (img.width as usize, img.height as usize);
    let (ow, oh) = (width as usize, height as usize);
    let (need_h, need_v) = (ow != iw, oh != ih);
    // Pillow 13 runs the vertical pass first when the height shrinks by more than twice
    // what the width does (the order changes the rounding of the intermediate image).
    let (dy, dx) = (ih as i64 - oh as i64, iw as i64 - ow as i64);
    let horizontal_first = !(dy > 0 && dy > dx * 2);
    let data = if horizontal_first {
        let vert = taps(ih, oh, filter);
        let mid = if need_h {
            // Only the rows the vertical pass reads.
            let first = vert.bounds[0].0;
            let last = vert.bounds[oh - 1].0 + vert.bounds[oh - 1].1;
            Some((
                horizontal(&img.data, iw, first..last, &taps(iw, ow, filter)),
                first,
            ))
        } else {
            None
        };
        match (mid, need_v) {
            (Some((mid, first)), true) => vertical(&mid, ow, first, &vert),
            (Some((mid, _)), false) => mid,
            (None, true) => vertical(&img.data, iw, 0, &vert),
            (None, false) => img.data.clone(),
        }
    } else {
        // dy > 0 here: the vertical pass always runs.
        let mid = vertical(&img.data, iw, 0, &taps(ih, oh, filter));
        if need_h {
            horizontal(&mid, iw, 0..oh, &taps(iw, ow, filter))
        } else {
            mid
        }
    };
    RgbImage {
        width,
        height,
        data,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flat_image_stays_flat_through_every_filter_and_size() {
        let img = RgbImage {
            width: 7,
            height: 5,
            data: [10u8, 200, 77].repeat(35),
        };
        for f in [Filter::Bilinear, Filter::Bicubic] {
            for (w, h) in [(1, 1), (3, 9), (20, 2), (7, 11)] {
                let out = resize(&img, w, h, f);
                assert!(
                    out.data.chunks(3).all(|p| p == [10, 200, 77]),
                    "{f:?} {w}x{h}"
                );
            }
        }
    }
}
