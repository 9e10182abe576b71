//! The image preprocessing gate: `engine::vision` against mlx-vlm (goldens/vision, made by
//! oracles/gen_vision_preprocess.py with the venv of oracles/requirements-vision.txt).
//!
//! Every committed test image goes through decode → gemma3 preprocess under three processor
//! configs, gemma4's under two (pixels, soft tokens) and Qwen3-VL's under two (pixels,
//! image_grid_thw, tokens per image). The real checkpoint's config (896×896) is checked by the SHA-256 of the tensor's
//! exact little-endian f32 bytes (9.6 MB a tensor: too big to commit 40 of); the two small
//! configs (32×32 bilinear, 40×24 bicubic) by every value against the committed tensors, so a
//! mismatch there says where and by how much; for the 896 one the stored channel sums and
//! samples say which channel and roughly where. The prompt expansion is compared as text.
//! Planted defects (a swapped filter, a shifted mean, one token too many) must fail it, and
//! hostile files must each get a clean refusal.

use std::path::PathBuf;

use engine::plant::{self, Defect};
use engine::vision::gemma3::Gemma3Processor;
use engine::vision::gemma4::Gemma4Processor;
use engine::vision::qwen_vl::QwenVlProcessor;
use engine::vision::{decode, Limits, PixelTensor, VisionError};
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::common::goldens;

fn dir() -> PathBuf {
    goldens().join("vision")
}

struct Golden {
    json: Value,
    bin: Vec<u8>,
}

fn golden() -> Golden {
    let json: Value =
        serde_json::from_slice(&std::fs::read(dir().join("preprocess.json")).unwrap()).unwrap();
    let bin = std::fs::read(dir().join(json["tensors_bin"].as_str().unwrap())).unwrap();
    Golden { json, bin }
}

fn processor(g: &Golden, config: &str) -> Gemma3Processor {
    Gemma3Processor::from_json(&g.json["configs"][config].to_string()).unwrap()
}

/// The images gemma4's and Qwen's real (full-size) configs are checked on: one of each
/// shape and kind (their small configs check every image, value by value; gemma3's real
/// config checks every image too). All 42 at full size would double the gate's time.
const FULL_SIZE_SUBSET: &[&str] = &[
    "rgb_1x1",
    "rgb_strip_1000x1",
    "rgb_tall_5x240",
    "rgb_wide_300x7",
    "rgb_896x896",
    "rgb_1203x947",
    "jpeg_1100x700",
    "jpeg_orient6",
    "p_transparent",
    "i16_37x29",
    "webp_lossy",
    "gif_2frames",
];

/// The difference between `got` and the golden `want` (shape, SHA-256, and where the small
/// configs' committed values differ), if any.
fn compare(g: &Golden, what: &str, got: &PixelTensor, want: &Value) -> Option<String> {
    let shape: Vec<usize> = want["shape"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as usize)
        .collect();
    if got.shape != shape {
        return Some(format!(
            "{what}: shape {:?}, reference {shape:?}",
            got.shape
        ));
    }
    let bytes = got.le_bytes();
    if format!("{:x}", Sha256::digest(&bytes)) == want["sha256"].as_str().unwrap() {
        return None;
    }
    let Some(off) = want.get("bin_offset").and_then(Value::as_u64) else {
        // gemma3's [1, 3, H, W]: per-channel sums against the stored ones say where.
        let parts = if shape.len() == 4 { shape[1] } else { 1 };
        let sums: Vec<f64> = got
            .data
            .chunks(got.data.len() / parts)
            .map(|c| c.iter().map(|&v| f64::from(v)).sum())
            .collect();
        return Some(format!(
            "{what}: hash differs; sums {sums:?}, reference channel sums {}",
            want.get("channel_sums").unwrap_or(&Value::Null)
        ));
    };
    let off = off as usize;
    let reference = &g.bin[off..off + bytes.len()];
    let (mut first, mut count, mut max) = (None, 0usize, 0f32);
    for (i, (a, b)) in bytes.chunks(4).zip(reference.chunks(4)).enumerate() {
        let a = f32::from_le_bytes(a.try_into().unwrap());
        let b = f32::from_le_bytes(b.try_into().unwrap());
        if a.to_bits() != b.to_bits() {
            first.get_or_insert((i, a, b));
            count += 1;
            max = max.max((a - b).abs());
        }
    }
    let (i, a, b) = first.unwrap_or_default();
    Some(format!(
        "{what}: {count} of {} values differ, max |Δ| {max}; first at flat index {i} \
         (shape {shape:?}): {a} vs reference {b}",
        got.data.len()
    ))
}

/// Every difference between the engine's tensors and the goldens, as readable lines;
/// `only` limits the images (by file name part) for the quick planted runs.
fn mismatches(g: &Golden, only: Option<&[&str]>) -> Vec<String> {
    let gemma: Vec<(&str, Gemma3Processor)> = ["real", "small", "bicubic"]
        .into_iter()
        .map(|c| (c, processor(g, c)))
        .collect();
    let qwen: Vec<(&str, QwenVlProcessor)> = ["real", "small"]
        .into_iter()
        .map(|c| {
            let cfg = g.json["qwen3_vl_configs"][c].to_string();
            (c, QwenVlProcessor::from_json(&cfg).unwrap())
        })
        .collect();
    let gemma4: Vec<(&str, Gemma4Processor)> = ["real", "small"]
        .into_iter()
        .map(|c| {
            let cfg = g.json["gemma4_configs"][c].to_string();
            (c, Gemma4Processor::from_json(&cfg).unwrap())
        })
        .collect();
    let cases: Vec<&Value> = g.json["images"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| {
            let file = c["file"].as_str().unwrap();
            only.is_none_or(|o| o.iter().any(|s| file.contains(s)))
        })
        .collect();
    let check = |case: &Value| -> Vec<String> {
        let mut out = Vec::new();
        let file = case["file"].as_str().unwrap();
        let bytes = std::fs::read(dir().join(file)).unwrap();
        let img = match decode(&bytes, &Limits::default()) {
            Ok(img) => img,
            Err(e) => {
                out.push(format!("{file}: refused: {e}"));
                return out;
            }
        };
        let want_size = [
            case["decoded_size"][0].as_u64(),
            case["decoded_size"][1].as_u64(),
        ];
        if want_size != [Some(img.width.into()), Some(img.height.into())] {
            out.push(format!(
                "{file}: decoded {}x{}, reference {want_size:?}",
                img.width, img.height
            ));
            return out;
        }
        for (name, proc) in &gemma {
            let t = proc.preprocess(&img);
            out.extend(compare(
                g,
                &format!("{file} gemma3 [{name}]"),
                &t,
                &case["configs"][*name],
            ));
        }
        for (name, proc) in &gemma4 {
            if *name == "real" && !FULL_SIZE_SUBSET.iter().any(|s| file.contains(s)) {
                continue;
            }
            let want = &case["gemma4"][*name];
            let what = format!("{file} gemma4 [{name}]");
            match proc.preprocess(&img) {
                Err(e) => out.push(format!("{what}: refused ({e})")),
                Ok(p) => {
                    out.extend(compare(g, &what, &p.pixels, want));
                    if Some(p.tokens as u64) != want["tokens"].as_u64() {
                        out.push(format!(
                            "{what}: {} tokens, reference {}",
                            p.tokens, want["tokens"]
                        ));
                    }
                }
            }
        }
        for (name, proc) in &qwen {
            if *name == "real" && !FULL_SIZE_SUBSET.iter().any(|s| file.contains(s)) {
                continue;
            }
            let want = &case["qwen3_vl"][*name];
            let what = format!("{file} qwen3_vl [{name}]");
            match (proc.preprocess(&img), want.get("error")) {
                (Err(e), Some(_)) => {
                    assert!(matches!(e, VisionError::AspectRatio { .. }), "{what}: {e}");
                }
                (Err(e), None) => {
                    out.push(format!("{what}: refused ({e}), the reference takes it"))
                }
                (Ok(_), Some(err)) => {
                    out.push(format!("{what}: taken, the reference refuses: {err}"))
                }
                (Ok(q), None) => {
                    out.extend(compare(g, &what, &q.pixels, want));
                    let thw: Vec<usize> = q.grid_thw.to_vec();
                    let want_thw: Vec<usize> = want["grid_thw"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|v| v.as_u64().unwrap() as usize)
                        .collect();
                    if thw != want_thw || Some(q.tokens as u64) != want["tokens"].as_u64() {
                        out.push(format!(
                            "{what}: grid {thw:?} / {} tokens, reference {want_thw:?} / {}",
                            q.tokens, want["tokens"]
                        ));
                    }
                }
            }
        }
        out
    };
    // Pure CPU work, no MLX: the images are checked on a few threads (the 896-pixel and
    // 280-soft-token tensors dominate the debug-build time).
    let workers = std::thread::available_parallelism().map_or(1, |n| n.get().min(4));
    let per = cases.len().div_ceil(workers).max(1);
    std::thread::scope(|s| {
        let handles: Vec<_> = cases
            .chunks(per)
            .map(|chunk| s.spawn(|| chunk.iter().flat_map(|c| check(c)).collect::<Vec<_>>()))
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect()
    })
}

fn prompt_mismatches(g: &Golden) -> Vec<String> {
    let proc = processor(g, "real");
    let mut out = Vec::new();
    for case in g.json["qwen3_vl_prompt_expansion"].as_array().unwrap() {
        let prompt = case["prompt"].as_str().unwrap();
        let proc =
            QwenVlProcessor::from_json(&g.json["qwen3_vl_configs"]["real"].to_string()).unwrap();
        // The token count of each grid as the processor computes it (planted defects show).
        let tokens: Vec<usize> = case["grid_thw"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| {
                let (h, w) = (t[1].as_u64().unwrap() as u32, t[2].as_u64().unwrap() as u32);
                let p = proc.patch_size as u32;
                let img = engine::vision::RgbImage {
                    width: w * p,
                    height: h * p,
                    data: vec![0; (w * p * h * p * 3) as usize],
                };
                let q = proc.preprocess(&img).unwrap();
                assert_eq!(
                    q.grid_thw,
                    [1, h as usize, w as usize],
                    "the grid's own size"
                );
                q.tokens
            })
            .collect();
        let got = engine::vision::qwen_vl::expand_prompt(prompt, &tokens).unwrap();
        if got != case["expanded"].as_str().unwrap() {
            out.push(format!("qwen3_vl {prompt:?}: expands to {got:?}"));
        }
    }
    for case in g.json["prompt_expansion"].as_array().unwrap() {
        let prompt = case["prompt"].as_str().unwrap();
        let n = prompt.matches(engine::vision::gemma3::BOI_TOKEN).count();
        let got = proc.expand_prompt(prompt, n).unwrap();
        let want = case["expanded"].as_str().unwrap();
        if got != want {
            let count = |s: &str| s.matches(engine::vision::gemma3::IMAGE_TOKEN).count();
            out.push(format!(
                "{prompt:?}: {} image tokens, reference {}",
                count(&got),
                count(want)
            ));
        }
    }
    out
}

#[test]
fn every_test_image_preprocesses_bit_identical_to_mlx_vlm() {
    let g = golden();
    let n = g.json["images"].as_array().unwrap().len();
    assert!(
        n >= 30,
        "the gate needs at least 30 images, the goldens have {n}"
    );
    let bad = mismatches(&g, None);
    assert!(
        bad.is_empty(),
        "{} mismatches:\n{}",
        bad.len(),
        bad.join("\n")
    );
    let bad = prompt_mismatches(&g);
    assert!(
        bad.is_empty(),
        "prompt expansion differs:\n{}",
        bad.join("\n")
    );
    // The markers and the images must agree in number, as the reference checks.
    let err = processor(&g, "real")
        .expand_prompt("<start_of_image> and <start_of_image>", 1)
        .unwrap_err();
    assert!(
        matches!(
            err,
            VisionError::MarkerCount {
                markers: 2,
                images: 1,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn planted_preprocessing_defects_are_caught() {
    let g = golden();
    // A few images of different kinds are enough to show each defect fails the gate.
    let some: &[&str] = &["rgb_17x11", "jpeg_orient6", "p_palette"];
    for defect in [Defect::VisionResizeNearest, Defect::VisionMeanOff] {
        let _on = plant::on(defect).unwrap();
        let bad = mismatches(&g, Some(some));
        assert!(
            !bad.is_empty(),
            "{defect:?} planted, the preprocessing gate still passes"
        );
    }
    let _on = plant::on(Defect::VisionTokenCountOffByOne).unwrap();
    assert!(
        !prompt_mismatches(&g).is_empty(),
        "VisionTokenCountOffByOne planted, the prompt expansions still match"
    );
    let bad = mismatches(&g, Some(some));
    assert!(
        bad.iter()
            .any(|m| m.contains("qwen3_vl") && m.contains("tokens")),
        "VisionTokenCountOffByOne planted, Qwen's token counts still match: {bad:?}"
    );
}

/// Whether a refusal is the one a hostile file must get.
type IsExpected = fn(&VisionError) -> bool;

#[test]
fn hostile_images_are_refused_with_a_clear_error() {
    let limits = Limits::default();
    let read = |f: &str| std::fs::read(dir().join("hostile").join(f)).unwrap();
    let cases: [(&str, IsExpected, &str); 10] = [
        (
            "truncated.png",
            |e| matches!(e, VisionError::Decode { format: "PNG", .. }),
            "truncated",
        ),
        (
            "truncated.jpg",
            |e| matches!(e, VisionError::Decode { format: "JPEG", .. }),
            "truncated",
        ),
        (
            "truncated_lossless.webp",
            |e| {
                matches!(
                    e,
                    VisionError::Header { format: "WebP", .. }
                        | VisionError::Decode { format: "WebP", .. }
                )
            },
            "WebP",
        ),
        (
            "truncated_lossy.webp",
            |e| {
                matches!(
                    e,
                    VisionError::Header { format: "WebP", .. }
                        | VisionError::Decode { format: "WebP", .. }
                )
            },
            "WebP",
        ),
        (
            "strip_1x100000.png",
            |e| matches!(e, VisionError::SideTooLong { side: 100000, .. }),
            "over the limit",
        ),
        (
            "header_30000x30000.png",
            |e| matches!(e, VisionError::SideTooLong { side: 30000, .. }),
            "over the limit",
        ),
        (
            "zipbomb_20000x20000.png",
            |e| matches!(e, VisionError::SideTooLong { side: 20000, .. }),
            "over the limit",
        ),
        (
            "not_an_image.html",
            |e| matches!(e, VisionError::UnsupportedFormat { .. }),
            "PNG, JPEG",
        ),
        ("empty.bin", |e| matches!(e, VisionError::Empty), "empty"),
        (
            "bmp_4x4.bmp",
            |e| matches!(e, VisionError::UnsupportedFormat { .. }),
            "Bmp",
        ),
    ];
    for (file, is_expected, says) in cases {
        let Err(err) = decode(&read(file), &limits) else {
            panic!("{file}: decoded, not refused");
        };
        let msg = err.to_string();
        assert!(is_expected(&err), "{file}: unexpected refusal {err:?}");
        assert!(
            msg.contains(says),
            "{file}: the message {msg:?} does not say {says:?}"
        );
    }
    // Under a side limit that lets it through, the bomb is still refused on its area, before
    // its 400 M pixels are decoded.
    let wide = Limits {
        max_side: 1 << 20,
        ..limits
    };
    let err = decode(&read("zipbomb_20000x20000.png"), &wide).unwrap_err();
    assert!(
        matches!(
            err,
            VisionError::TooManyPixels {
                pixels: 400_000_000,
                ..
            }
        ),
        "{err:?}"
    );
    let err = decode(&read("header_30000x30000.png"), &wide).unwrap_err();
    assert!(matches!(err, VisionError::TooManyPixels { .. }), "{err:?}");
}
