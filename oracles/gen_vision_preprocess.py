"""Goldens of image preprocessing as mlx-vlm runs it (engine::vision).

    /work/vision-venv/bin/python oracles/gen_vision_preprocess.py
    (the venv: oracles/requirements-vision.txt says how to make it)

Writes goldens/vision/:
  images/*            the test images, made here deterministically (numpy RNG seed 41, Pillow's
                      encoders), small: varied sizes, aspect ratios, modes and formats
  hostile/*           inputs that must be refused (truncated, huge header, zip bomb, not an image)
  preprocess.json     per image and per processor config: the pixel tensor's shape, the SHA-256
                      of its exact little-endian f32 bytes, and stats for a diagnosis; the same
                      (with image_grid_thw and the token count) for Qwen3-VL's processor
  small-tensors.bin   the full f32 tensors of the small configs (every value compared)
  provenance          inside preprocess.json

The reference path, step by step, is mlx-vlm 0.7.10's:
  mlx_vlm.utils.load_image(path)     Image.open -> ImageOps.exif_transpose -> .convert("RGB")
  Gemma3Processor.from_pretrained    AutoImageProcessor.from_pretrained(dir, use_fast=False)
                                     -> transformers' Gemma3ImageProcessorPil (the PIL "slow" one)
  image_processor(images)            convert_rgb (no-op), resize (PIL Image.resize, the config's
                                     resample), rescale (f64 multiply, f32 cast), normalize (f32)
  Gemma3Processor.__call__           each "<start_of_image>" in the prompt replaced by the full
                                     image sequence (image_seq_length soft tokens)
The processor configs are written by hand (no hub download): "real" holds google/gemma-3's
preprocessor_config.json values (896x896, resample 2 = bilinear, mean = std = 0.5, rescale 1/255,
pan-and-scan off; image_seq_length 256); "small" is the same with size 32x32 so that every value
of every image's tensor can be committed; "bicubic" is the small one with resample 3 (the filter
Qwen's processors use), so both of Pillow's convolution filters are pinned.

Qwen3-VL / Qwen3.5 (mlx-vlm's own numpy port, `Qwen3VLImageProcessor`, made as
`Qwen3VLProcessor.from_pretrained` makes it from the config): smart_resize to multiples of
patch_size * merge_size within [min_pixels, max_pixels] (size.shortest_edge / longest_edge),
PIL bicubic resize, f32 rescale and normalize, the frame repeated temporal_patch_size times,
patches flattened to [grid_h * grid_w, C * T * P * P]; image_grid_thw; tokens per image =
grid_h * grid_w / merge_size^2. An image smart_resize refuses (aspect ratio over 200) is
stored as its error.

Gemma 4 (mlx-vlm's own `Gemma4ImageProcessor`): the aspect-ratio-preserving size within
max_soft_tokens * pooling^2 patches, sides multiples of pooling * patch; PIL bicubic; f32
rescale; [1, 3, H, W]; tokens = (H/P)(W/P)/pooling^2.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import struct
import sys
import tempfile
import zlib
from pathlib import Path

import numpy as np
from PIL import Image

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
OUT = REPO / "goldens" / "vision"
GENERATOR = "oracles/gen_vision_preprocess.py"

REAL = {
    "image_processor_type": "Gemma3ImageProcessor",
    "processor_class": "Gemma3Processor",
    "do_convert_rgb": None,
    "do_normalize": True,
    "do_pan_and_scan": None,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "image_seq_length": 256,
    "pan_and_scan_max_num_crops": None,
    "pan_and_scan_min_crop_size": None,
    "pan_and_scan_min_ratio_to_activate": None,
    "resample": 2,
    "rescale_factor": 0.00392156862745098,
    "size": {"height": 896, "width": 896},
}
# Qwen3-VL's preprocessor_config.json values (Qwen/Qwen3-VL-*-Instruct; Qwen3.5 has the same
# image settings), and a small one (patch 4, at most 256 pixels) whose tensors are committed whole.
QWEN_REAL = {
    "image_processor_type": "Qwen2VLImageProcessorFast",
    "processor_class": "Qwen3VLProcessor",
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "merge_size": 2,
    "patch_size": 16,
    "rescale_factor": 0.00392156862745098,
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "temporal_patch_size": 2,
}
QWEN_CONFIGS = {
    "real": QWEN_REAL,
    "small": {**QWEN_REAL, "patch_size": 4, "size": {"longest_edge": 256, "shortest_edge": 64}},
}
# Gemma 4: mlx-vlm's own Gemma4ImageProcessor with its defaults (patch 16, 280 soft tokens,
# pooling 3, bicubic, rescale 1/255, no normalize), and a small budget (patch 4, 4 soft
# tokens, pooling 2) whose tensors are committed whole.
GEMMA4_CONFIGS = {
    "real": {},
    "small": {"patch_size": 4, "max_soft_tokens": 4, "pooling_kernel_size": 2},
}
CONFIGS = {
    "real": REAL,
    "small": {**REAL, "size": {"height": 32, "width": 32}},
    "bicubic": {**REAL, "size": {"height": 24, "width": 40}, "resample": 3},
}


# ---------------------------------------------------------------- test images


def rng():
    return np.random.default_rng(41)


def gradient(w, h, seed, jitter=6):
    """A smooth pattern with some texture: compresses well, still exercises every filter tap."""
    r = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    a = (np.sin(x / max(w, 1) * 7.0 + seed) * 0.5 + 0.5) * 255
    b = (np.cos(y / max(h, 1) * 5.0 + seed) * 0.5 + 0.5) * 255
    c = ((x + y) % 37) / 36 * 255
    img = np.stack([a, b, c], axis=-1) + r.integers(-jitter, jitter + 1, size=(h, w, 3))
    return np.clip(img, 0, 255).astype(np.uint8)


def noise(w, h, ch, seed):
    return np.random.default_rng(seed).integers(0, 256, size=(h, w, ch), dtype=np.uint8)


def save(img: Image.Image, name: str, **kw) -> None:
    img.save(OUT / "images" / name, **kw)


def exif_with_orientation(o: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = o
    return exif.tobytes()


def make_images() -> None:
    d = OUT / "images"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    # RGB PNGs of many shapes (upscale, downscale, identity, strips).
    save(Image.fromarray(noise(1, 1, 3, 1)), "rgb_1x1.png")
    save(Image.fromarray(noise(2, 3, 3, 2)), "rgb_2x3.png")
    save(Image.fromarray(noise(17, 11, 3, 3)), "rgb_17x11.png")
    save(Image.fromarray(gradient(64, 64, 4)), "rgb_64x64.png")
    save(Image.fromarray(gradient(300, 7, 5)), "rgb_wide_300x7.png")
    save(Image.fromarray(gradient(5, 240, 6)), "rgb_tall_5x240.png")
    save(Image.fromarray(gradient(1000, 1, 7)), "rgb_strip_1000x1.png")
    save(Image.fromarray(gradient(896, 896, 8, 0)), "rgb_896x896.png")
    save(Image.fromarray(gradient(1203, 947, 9, 0)), "rgb_1203x947.png")
    save(Image.fromarray(gradient(97, 61, 10)), "rgb_97x61.png")
    # An Adam7-interlaced PNG (Pillow writes interlace only through the encoder's own flag).
    Image.fromarray(gradient(31, 23, 11)).save(d / "rgb_adam7_31x23.png", interlace=1)
    # Other modes.
    rgba = np.concatenate([gradient(40, 30, 12), noise(40, 30, 1, 13)], axis=-1)
    save(Image.fromarray(rgba, "RGBA"), "rgba_40x30.png")
    la = np.concatenate([noise(20, 20, 1, 14), noise(20, 20, 1, 15)], axis=-1)
    save(Image.fromarray(la, "LA"), "la_20x20.png")
    save(Image.fromarray(noise(33, 47, 1, 16)[..., 0], "L"), "l_33x47.png")
    save(Image.fromarray(noise(19, 13, 1, 17)[..., 0] > 127), "bilevel_19x13.png")
    four = Image.fromarray((noise(21, 9, 1, 18)[..., 0] // 17 * 17).astype(np.uint8), "L")
    save(four, "l4bit_21x9.png", bits=4)
    pal = Image.fromarray(gradient(50, 40, 19)).quantize(colors=16, dither=Image.Dither.NONE)
    save(pal, "p_palette_50x40.png")
    palt = Image.fromarray(gradient(26, 18, 20)).quantize(colors=8, dither=Image.Dither.NONE)
    save(palt, "p_transparent_26x18.png", transparency=3)
    i16 = Image.frombytes("I;16", (37, 29), np.random.default_rng(21).integers(0, 65536, size=(29, 37)).astype("<u2").tobytes())
    save(i16, "i16_37x29.png")
    i16low = Image.frombytes("I;16", (14, 11), np.random.default_rng(22).integers(0, 300, size=(11, 14)).astype("<u2").tobytes())
    save(i16low, "i16_low_14x11.png")
    (d / "rgb16_25x19.png").write_bytes(png16(noise(25, 19, 3, 23).astype(np.uint16) * 257 + noise(25, 19, 3, 24), 2))
    (d / "rgba16_13x17.png").write_bytes(png16(noise(13, 17, 4, 25).astype(np.uint16) * 251, 6))
    (d / "la16_9x7.png").write_bytes(png16(noise(9, 7, 2, 26).astype(np.uint16) * 256 + 7, 4))
    # PNG with an eXIf orientation (Pillow's exif_transpose reads it too).
    save(Image.fromarray(gradient(30, 20, 27)), "rgb_exif6_30x20.png", exif=exif_with_orientation(6))
    # JPEGs: every EXIF orientation on a non-square image, 4:2:0 and 4:4:4, grayscale, large.
    base = Image.fromarray(gradient(48, 32, 28))
    for o in range(1, 9):
        base.save(d / f"jpeg_orient{o}_48x32.jpg", quality=90, exif=exif_with_orientation(o))
    Image.fromarray(gradient(61, 45, 29)).save(d / "jpeg444_61x45.jpg", quality=95, subsampling=0)
    Image.fromarray(gradient(61, 45, 30)).save(d / "jpeg422_61x45.jpg", quality=85, subsampling=1)
    Image.fromarray(noise(35, 27, 1, 31)[..., 0], "L").save(d / "jpeg_gray_35x27.jpg", quality=90)
    Image.fromarray(gradient(1100, 700, 32, 0)).save(d / "jpeg_1100x700.jpg", quality=80)
    Image.fromarray(gradient(57, 43, 33)).save(d / "jpeg_progressive_57x43.jpg", quality=88, progressive=True)
    # WebP: lossless RGB and RGBA, lossy.
    Image.fromarray(gradient(45, 38, 34)).save(d / "webp_lossless_45x38.webp", lossless=True)
    Image.fromarray(rgba[:25, :33], "RGBA").save(d / "webp_rgba_33x25.webp", lossless=True)
    Image.fromarray(gradient(52, 36, 35)).save(d / "webp_lossy_52x36.webp", quality=80)
    # GIF: two frames (the first one counts), and one with a transparent index.
    f1 = Image.fromarray(gradient(40, 28, 36)).quantize(colors=32, dither=Image.Dither.NONE)
    f2 = Image.fromarray(gradient(40, 28, 37)).quantize(colors=32, dither=Image.Dither.NONE)
    f1.save(d / "gif_2frames_40x28.gif", save_all=True, append_images=[f2], duration=100, loop=0)
    g = Image.fromarray(gradient(23, 31, 38)).quantize(colors=16, dither=Image.Dither.NONE)
    g.save(d / "gif_transparent_23x31.gif", transparency=2)


def chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def png_raw(w: int, h: int, bit_depth: int, color_type: int, rows: bytes, level: int = 9) -> bytes:
    ihdr = struct.pack(">IIBBBBB", w, h, bit_depth, color_type, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(rows, level)) + chunk(b"IEND", b"")


def png16(a: np.ndarray, color_type: int) -> bytes:
    """A 16-bit PNG by hand (Pillow writes 16-bit only for I;16 grayscale)."""
    h, w, _ = a.shape
    rows = b"".join(b"\x00" + a[y].astype(">u2").tobytes() for y in range(h))
    return png_raw(w, h, 16, color_type, rows)


def make_hostile() -> None:
    d = OUT / "hostile"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    good = (OUT / "images" / "rgb_64x64.png").read_bytes()
    (d / "truncated.png").write_bytes(good[: len(good) // 2])
    jpg = (OUT / "images" / "jpeg_1100x700.jpg").read_bytes()
    (d / "truncated.jpg").write_bytes(jpg[: len(jpg) // 3])
    for name in ("webp_lossless_45x38.webp", "webp_lossy_52x36.webp"):
        webp = (OUT / "images" / name).read_bytes()
        (d / f"truncated_{name.split('_')[1]}.webp").write_bytes(webp[: len(webp) * 2 // 3])
    # 1 x 100000: a valid PNG, tiny file, an aspect ratio no vision tower takes.
    (d / "strip_1x100000.png").write_bytes(png_raw(1, 100000, 8, 0, b"\x00\x80" * 100000))
    # A header that claims 30000 x 30000 and then ends (the size must be refused before any
    # allocation for it).
    ihdr = struct.pack(">IIBBBBB", 30000, 30000, 8, 2, 0, 0, 0)
    (d / "header_30000x30000.png").write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr))
    # A zip bomb: a real, complete 1-bit PNG of 20000 x 20000 zero pixels (1.2 GB as RGB)
    # in a small file.
    rows = (b"\x00" + b"\x00" * (20000 // 8)) * 20000
    (d / "zipbomb_20000x20000.png").write_bytes(png_raw(20000, 20000, 1, 0, rows))
    (d / "not_an_image.html").write_bytes(b"<!doctype html><html><body>hello</body></html>\n")
    (d / "empty.bin").write_bytes(b"")
    # A format the reference would open but this engine does not take.
    Image.fromarray(noise(4, 4, 3, 40)).save(d / "bmp_4x4.bmp")


# ---------------------------------------------------------------- the reference


def reference_processor(cfg: dict):
    """The image processor exactly as mlx-vlm's Gemma3Processor.from_pretrained makes it."""
    # The very class `from transformers import AutoImageProcessor` names; imported from its module
    # because without torch installed transformers 5.14's top-level name is a placeholder that
    # demands torch and torchvision (the PIL backend itself needs neither).
    from transformers.models.auto.image_processing_auto import AutoImageProcessor

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "preprocessor_config.json").write_text(json.dumps(cfg))
        proc = AutoImageProcessor.from_pretrained(tmp, use_fast=False)
    assert type(proc).__name__ == "Gemma3ImageProcessorPil", type(proc).__name__
    return proc


def expanded_prompt(prompt: str, image_seq_length: int, n_images: int) -> str:
    """Gemma3Processor.__call__'s prompt expansion, run on the real class with a stand-in
    tokenizer that hands the text back (the expansion is string work before tokenizing)."""
    from mlx_vlm.models.gemma3.processing_gemma3 import Gemma3Processor

    class Tok:
        image_token_id = 262144
        boi_token = "<start_of_image>"
        image_token = "<image_soft_token>"
        eoi_token = "<end_of_image>"

        def __call__(self, text, **kw):
            return {"text": text}

    class Ip:
        def fetch_images(self, images):
            return images

        def __call__(self, images, **kw):
            return {}

    p = Gemma3Processor.__new__(Gemma3Processor)
    tok = Tok()
    p.image_seq_length = image_seq_length
    p.image_token_id = tok.image_token_id
    p.boi_token = tok.boi_token
    p.image_token = tok.image_token
    p.full_image_sequence = f"\n\n{tok.boi_token}{''.join([tok.image_token] * image_seq_length)}{tok.eoi_token}\n\n"
    p.tokenizer = tok
    p.image_processor = Ip()
    img = Image.new("RGB", (2, 2))
    import mlx_vlm.models.gemma3.processing_gemma3 as mod

    captured = {}
    real_bf = mod.BatchFeature

    def bf(data=None, **kw):
        captured.update(data or {})
        return data

    mod.BatchFeature = bf
    mod.to_mlx = lambda x: x
    try:
        p(images=[img] * n_images, text=prompt)
    finally:
        mod.BatchFeature = real_bf
    return captured["text"][0]


def qwen_processor(cfg: dict):
    """mlx-vlm's own Qwen3VLImageProcessor, built as Qwen3VLProcessor.from_pretrained builds it."""
    from mlx_vlm.models.qwen3_vl.processing_qwen3_vl import Qwen3VLImageProcessor, _qwen_vl_image_kwargs

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "preprocessor_config.json").write_text(json.dumps(cfg))
        (Path(tmp) / "processor_config.json").write_text("{}")
        return Qwen3VLImageProcessor(**_qwen_vl_image_kwargs(tmp, default_patch_size=16))


def qwen_expanded(prompt: str, grids: list[list[int]], merge_size: int = 2) -> str:
    """Qwen3VLProcessor.__call__'s prompt expansion, run on the real class with stand-ins for
    the tokenizer (hands the text back) and the image processor (hands back the grids)."""
    import mlx_vlm.models.qwen3_vl.processing_qwen3_vl as mod

    class Ip:
        def __init__(self):
            self.merge_size = merge_size

        def __call__(self, images, **kw):
            return {"image_grid_thw": np.array(grids, dtype=np.int64)}

    p = mod.Qwen3VLProcessor.__new__(mod.Qwen3VLProcessor)
    p.image_processor = Ip()
    p.video_processor = None
    p.image_token = "<|image_pad|>"
    p.video_token = "<|video_pad|>"
    p.vision_start_token = "<|vision_start|>"
    p.vision_end_token = "<|vision_end|>"
    p.tokenizer = lambda text, **kw: {"text": text}
    captured = {}
    real_bf, real_to_mlx = mod.BatchFeature, mod.to_mlx
    mod.BatchFeature = lambda data=None, **kw: captured.update(data or {})
    mod.to_mlx = lambda x: x
    try:
        p(images=[Image.new("RGB", (2, 2))] * len(grids), text=prompt)
    finally:
        mod.BatchFeature, mod.to_mlx = real_bf, real_to_mlx
    return captured["text"][0]


def stats(t: np.ndarray) -> dict:
    flat = t.reshape(-1)
    step = max(1, flat.size // 32)
    return {
        "channel_sums": [float(np.sum(t[0, c].astype(np.float64))) for c in range(t.shape[1])],
        "min": float(flat.min()),
        "max": float(flat.max()),
        "sample_stride": step,
        "sample": [float(v) for v in flat[::step][:32]],
    }


def main() -> None:
    import importlib.metadata as md

    from mlx_vlm.utils import load_image

    sys.path.insert(0, str(HERE))
    from provenance import provenance

    for pkg, want in (("mlx-vlm", "0.7.10"), ("mlx", "0.32.2"), ("pillow", "13.0.0")):
        if md.version(pkg) != want:
            sys.exit(f"{pkg} {md.version(pkg)} here, the goldens pin {want}: see oracles/requirements-vision.txt")
    make_images()
    make_hostile()
    procs = {k: reference_processor(v) for k, v in CONFIGS.items()}
    qprocs = {k: qwen_processor(v) for k, v in QWEN_CONFIGS.items()}
    from mlx_vlm.models.gemma4.processing_gemma4 import Gemma4ImageProcessor

    # As Gemma4Processor.from_pretrained makes it: Gemma4ImageProcessor(**image_processor config).
    g4procs = {k: Gemma4ImageProcessor(**v) for k, v in GEMMA4_CONFIGS.items()}
    bin_chunks = []

    def keep(entry, raw_bytes, name):
        """Every config's tensor but the real one's goes whole into small-tensors.bin."""
        if name != "real":
            entry["bin_offset"] = sum(map(len, bin_chunks))
            entry["bin_len"] = len(raw_bytes)
            bin_chunks.append(raw_bytes)
    cases = []
    for path in sorted((OUT / "images").iterdir()):
        with Image.open(path) as raw:
            mode, fmt = raw.mode, raw.format
        img = load_image(str(path))
        case = {"file": f"images/{path.name}", "format": fmt, "pil_mode": mode,
                "decoded_size": [img.width, img.height], "configs": {}}
        for name, proc in procs.items():
            out = proc(images=[img])["pixel_values"]
            t = np.stack(out)[None] if isinstance(out, list) else np.asarray(out)
            t = t.reshape(1, *t.shape[-3:]).astype(np.float32)
            raw_bytes = t.astype("<f4").tobytes()
            entry = {"shape": list(t.shape), "sha256": hashlib.sha256(raw_bytes).hexdigest(), **stats(t)}
            keep(entry, raw_bytes, name)
            case["configs"][name] = entry
        case["gemma4"] = {}
        for name, proc in g4procs.items():
            try:
                data, tokens = proc(images=[img])
            except ValueError as e:
                case["gemma4"][name] = {"error": str(e)}
                continue
            pv = data["pixel_values"]
            t = (np.stack(pv) if isinstance(pv, list) else np.asarray(pv)).astype(np.float32)
            raw_bytes = t.astype("<f4").tobytes()
            entry = {"shape": list(t.shape), "tokens": int(tokens[0]),
                     "sha256": hashlib.sha256(raw_bytes).hexdigest()}
            keep(entry, raw_bytes, name)
            case["gemma4"][name] = entry
        case["qwen3_vl"] = {}
        for name, proc in qprocs.items():
            try:
                out = proc(images=[img])
            except ValueError as e:
                case["qwen3_vl"][name] = {"error": str(e)}
                continue
            t = np.asarray(out["pixel_values"], dtype=np.float32)
            raw_bytes = t.astype("<f4").tobytes()
            entry = {
                "shape": list(t.shape),
                "grid_thw": [int(v) for v in out["image_grid_thw"][0]],
                "tokens": int(proc.num_image_tokens(img.height, img.width)),
                "sha256": hashlib.sha256(raw_bytes).hexdigest(),
            }
            keep(entry, raw_bytes, name)
            case["qwen3_vl"][name] = entry
        cases.append(case)
    prompts = {
        p: expanded_prompt(p, 256, p.count("<start_of_image>"))
        for p in ["Describe <start_of_image> please.", "<start_of_image><start_of_image>Compare."]
    }
    wrapped = "<|vision_start|><|image_pad|><|vision_end|>"
    qwen_prompts = [
        (f"Look: {wrapped} What is it?", [[1, 14, 20]]),
        (f"{wrapped}{wrapped}Compare them.", [[1, 16, 16], [1, 4, 106]]),
        # More markers than images: the surplus ones (the first) are dropped.
        (f"{wrapped} and <|image_pad|> then {wrapped}", [[1, 20, 14]]),
    ]
    qwen_expansion = [
        {"prompt": t, "grid_thw": gr, "expanded": qwen_expanded(t, gr)} for t, gr in qwen_prompts
    ]
    prov = provenance("mlx-vlm", "mlx-vlm")
    prov["generator"] = GENERATOR
    prov["versions"].update({k: md.version(k) for k in ("mlx-vlm", "transformers", "pillow", "numpy")})
    prov["reference"] = ("mlx_vlm.utils.load_image + transformers Gemma3ImageProcessorPil "
                         "(AutoImageProcessor use_fast=False, as mlx_vlm Gemma3Processor.from_pretrained)")
    golden = {
        "provenance": prov,
        "configs": CONFIGS,
        "qwen3_vl_configs": QWEN_CONFIGS,
        "gemma4_configs": GEMMA4_CONFIGS,
        "tensors_bin": "small-tensors.bin",
        "prompt_expansion": [{"prompt": k, "expanded": v} for k, v in prompts.items()],
        "qwen3_vl_prompt_expansion": qwen_expansion,
        "images": cases,
    }
    (OUT / "small-tensors.bin").write_bytes(b"".join(bin_chunks))
    (OUT / "preprocess.json").write_text(json.dumps(golden, indent=1) + "\n")
    total = sum(p.stat().st_size for p in (OUT / "images").iterdir())
    print(f"{len(cases)} images ({total} bytes), bin {sum(map(len, bin_chunks))} bytes")


if __name__ == "__main__":
    main()
