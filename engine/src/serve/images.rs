//! Images in requests (issue 41; docs/vision.md, "Images in requests"): where each API puts
//! them, and how they are read into checked pixels.
//!
//!   chat/completions   `{"type": "image_url", "image_url": {"url": URL}}` (or the URL as a
//!                      string) in a user message's content
//!   responses          `{"type": "input_image", "image_url": URL}` in a user message's content
//!   messages           `{"type": "image", "source": {"type": "base64", "media_type", "data"}}`
//!                      in a user message's content
//!
//! URL: `data:<media type>;base64,<data>`, or `file://PATH` (or a bare absolute path) when the
//! server was started with `--allow-local-files DIR` and PATH lies under DIR. The server
//! fetches nothing: an http(s) URL is refused, saying to send the bytes inline. mlx_vlm.server
//! reads images from user messages only and skips the rest silently; here an image anywhere
//! else is refused. Each image is decoded (`vision::decode`, its size checked on the header
//! before any pixel buffer exists) so that a corrupt, unsupported or oversized one is a 400
//! naming it and its path; its SHA-256 (of the pixels, so the same picture sent as PNG or as a
//! re-encoded file with equal pixels is one key) is what caches key it by.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use base64::Engine as _;
use serde_json::Value;
use sha2::{Digest, Sha256};

use super::error::ApiError;
use crate::plant::{self, Defect};
use crate::vision::served::Expander;
use crate::vision::{self, RgbImage};

/// The server's image settings (`--allow-local-files`, `--max-images-per-request`,
/// `--max-image-pixels`, `--max-image-side`) and whether its model reads images at all.
#[derive(Debug, Clone)]
pub struct Rules {
    /// `file://` paths are read only under this directory (canonical).
    pub local_dir: Option<PathBuf>,
    pub max_images: usize,
    pub limits: vision::Limits,
    /// Why this server reads no images (refused after they were checked: a model without a
    /// vision tower this engine runs, `--text-only`, a distributed group); None: it does.
    pub text_only: Option<String>,
}

/// Why a server reads no images: its model has no vision tower this engine runs.
pub const NO_TOWER: &str = "this model reads text only: it has no vision tower this engine \
     runs (gemma3 with a vision_config, gemma4, qwen3_vl, qwen3_5: docs/vision.md); send the \
     request without images, or serve a vision checkpoint";

/// Whether a server of `model` reads images: the model's prompt expansion
/// (`vision::served`), or why it reads none (`--text-only`, no tower, a group). The model
/// thread loads the vision tower exactly when this is Ok.
pub fn served(model: &Path, text_only: bool) -> anyhow::Result<Result<Arc<Expander>, String>> {
    let expander = match Expander::load(model) {
        Ok(Some(expander)) => expander,
        Ok(None) => return Ok(Err(NO_TOWER.into())),
        // Served as a text model (as mlx_lm.server serves it), images refused with the cause.
        Err(e) => {
            return Ok(Err(format!(
                "this model reads text only here: its vision side did not load ({e}); send \
                 the request without images, or serve the checkpoint with its processor config"
            )))
        }
    };
    let why = if text_only {
        "this server reads text only (started with --text-only): restart it without \
         --text-only to send images"
    } else if crate::dist::active() {
        "images are not served under a distributed group yet (the ranks run the text \
         model only); serve the vision model on one machine to send images"
    } else {
        return Ok(Ok(Arc::new(expander)));
    };
    Ok(Err(why.into()))
}

/// A prompt with images as the HTTP side made it: the chat template's output, and the
/// processor's text (each image marker expanded), whose ids the job carries. The model
/// thread makes the pixels from the first and checks its text against the second.
#[derive(Debug, Clone)]
pub struct ImageText {
    pub templated: String,
    pub expanded: String,
}

impl Default for Rules {
    fn default() -> Self {
        Rules {
            local_dir: None,
            max_images: 8,
            limits: vision::Limits::default(),
            text_only: Some(NO_TOWER.into()),
        }
    }
}

/// One image of a request, checked.
#[derive(Debug, Clone)]
pub struct Image {
    pub pixels: Arc<RgbImage>,
    /// SHA-256 of the width, the height and the RGB bytes.
    pub sha256: [u8; 32],
}

/// Where an image came from in the body: its field path and its source.
#[derive(Debug)]
pub struct Found {
    pub at: String,
    pub source: Source,
}

#[derive(Debug)]
pub enum Source {
    /// A URL: `data:`, `file://`, a path, or (refused) anything else.
    Url(String),
    /// Anthropic's base64 source.
    Base64 { data: String },
}

fn bad(at: &str, message: impl Into<String>) -> ApiError {
    ApiError::field(at, message)
}

/// The images of a chat/completions body (`messages[i].content[j]` of type `image_url`).
pub fn in_chat(body: &Value) -> Result<Vec<Found>, ApiError> {
    walk(body, "messages", "image_url", |part, at| {
        match &part["image_url"] {
            Value::String(url) => Ok(Source::Url(url.clone())),
            Value::Object(o) => match o.get("url") {
                Some(Value::String(url)) => Ok(Source::Url(url.clone())),
                _ => Err(bad(
                    &format!("{at}.image_url.url"),
                    "image_url.url is required (a data: URL with the image's bytes in base64)",
                )),
            },
            _ => Err(bad(
                &format!("{at}.image_url"),
                "image_url is required: {\"url\": \"data:image/png;base64,…\"}",
            )),
        }
    })
}

/// The images of a Responses body (`input[i].content[j]` of type `input_image`).
pub fn in_responses(body: &Value) -> Result<Vec<Found>, ApiError> {
    walk(body, "input", "input_image", |part, at| {
        match (&part["image_url"], &part["file_id"]) {
            (Value::String(url), _) => Ok(Source::Url(url.clone())),
            (_, Value::String(_)) => Err(bad(
                &format!("{at}.file_id"),
                "file_id is not supported: this server stores no files; send image_url with \
                 a data: URL (data:image/png;base64,…)",
            )),
            _ => Err(bad(
                &format!("{at}.image_url"),
                "image_url is required (a data: URL with the image's bytes in base64)",
            )),
        }
    })
}

/// The images of a Messages body (`messages[i].content[j]` of type `image`).
pub fn in_messages(body: &Value) -> Result<Vec<Found>, ApiError> {
    walk(body, "messages", "image", |part, at| {
        let source = &part["source"];
        let at = format!("{at}.source");
        match source["type"].as_str() {
            Some("base64") => match source["data"].as_str() {
                Some(data) => Ok(Source::Base64 {
                    data: data.to_owned(),
                }),
                None => Err(bad(
                    &format!("{at}.data"),
                    format!("{at}.data: Field required"),
                )),
            },
            Some("url") => Err(bad(
                &format!("{at}.type"),
                "url image sources are not supported: this server fetches nothing; send the \
                 image as a base64 source",
            )),
            Some(other) => Err(bad(
                &format!("{at}.type"),
                format!("image source type `{other}` is not supported here; send a base64 source"),
            )),
            None => Err(bad(
                &format!("{at}.type"),
                format!("{at}.type: Field required (\"base64\")"),
            )),
        }
    })
}

/// Every part of type `kind` in `body[list][i].content[j]`, read by `source`; an image part
/// outside a user message is refused.
fn walk(
    body: &Value,
    list: &str,
    kind: &str,
    source: impl Fn(&Value, &str) -> Result<Source, ApiError>,
) -> Result<Vec<Found>, ApiError> {
    let mut found = Vec::new();
    let Some(items) = body[list].as_array() else {
        return Ok(found);
    };
    for (i, item) in items.iter().enumerate() {
        let Some(parts) = item["content"].as_array() else {
            continue;
        };
        for (j, part) in parts.iter().enumerate() {
            if part["type"].as_str() != Some(kind) {
                continue;
            }
            let at = format!("{list}[{i}].content[{j}]");
            if item["role"].as_str() != Some("user") {
                return Err(bad(
                    &at,
                    format!(
                        "images are read from user messages only; move this {kind} part to \
                         a user message"
                    ),
                ));
            }
            let source = source(part, &at)?;
            found.push(Found { at, source });
        }
    }
    Ok(found)
}

/// Reads and checks every image found, in order: their number, each one's bytes and pixels;
/// then refuses them all if the model reads no images.
pub fn read(found: Vec<Found>, rules: &Rules) -> Result<Vec<Image>, ApiError> {
    if found.is_empty() {
        return Ok(Vec::new());
    }
    if found.len() > rules.max_images {
        return Err(bad(
            &found[rules.max_images].at,
            format!(
                "{} images in one request, over this server's limit of {} \
                 (--max-images-per-request): send fewer",
                found.len(),
                rules.max_images
            ),
        ));
    }
    let first = found[0].at.clone();
    let images = found
        .into_iter()
        .map(|f| read_one(&f, rules))
        .collect::<Result<Vec<_>, _>>()?;
    if let Some(why) = &rules.text_only {
        return Err(ApiError::field(&first, why.clone()));
    }
    Ok(images)
}

fn read_one(f: &Found, rules: &Rules) -> Result<Image, ApiError> {
    let bytes = match &f.source {
        Source::Base64 { data } => base64(data, &format!("{}.source.data", f.at))?,
        Source::Url(url) => from_url(url, &f.at, rules.local_dir.as_deref())?,
    };
    let pixels =
        vision::decode(&bytes, &rules.limits).map_err(|e| bad(&f.at, format!("{}: {e}", f.at)))?;
    let mut h = Sha256::new();
    h.update(pixels.width.to_le_bytes());
    h.update(pixels.height.to_le_bytes());
    h.update(&pixels.data);
    Ok(Image {
        pixels: Arc::new(pixels),
        sha256: h.finalize().into(),
    })
}

/// Base64 with its padding; whitespace (line breaks in pasted data) is skipped.
fn base64(data: &str, at: &str) -> Result<Vec<u8>, ApiError> {
    let clean: String = data.chars().filter(|c| !c.is_ascii_whitespace()).collect();
    base64::engine::general_purpose::STANDARD
        .decode(clean.as_bytes())
        .map_err(|e| bad(at, format!("the image data is not valid base64 ({e})")))
}

fn from_url(url: &str, at: &str, local_dir: Option<&Path>) -> Result<Vec<u8>, ApiError> {
    if let Some(rest) = url.strip_prefix("data:") {
        let Some((meta, data)) = rest.split_once(',') else {
            return Err(bad(at, "a data: URL needs a comma before its data"));
        };
        if !meta.ends_with(";base64") {
            return Err(bad(
                at,
                "only base64 data: URLs are read (data:image/png;base64,…)",
            ));
        }
        return base64(data, at);
    }
    let lower = url.get(..8).unwrap_or(url).to_ascii_lowercase();
    if lower.starts_with("http://") || lower.starts_with("https://") {
        return Err(bad(
            at,
            "this server fetches no URLs: send the image's bytes inline as a data: URL \
             (data:image/png;base64,…)",
        ));
    }
    let path = url.strip_prefix("file://").unwrap_or(url);
    if !path.starts_with('/') {
        return Err(bad(
            at,
            "not an image URL this server reads: send a data: URL (data:image/png;base64,…)",
        ));
    }
    local_file(Path::new(path), at, local_dir)
}

/// A local file, only under `--allow-local-files DIR` (after resolving links and `..`).
fn local_file(path: &Path, at: &str, local_dir: Option<&Path>) -> Result<Vec<u8>, ApiError> {
    let Some(dir) = local_dir else {
        return Err(bad(
            at,
            "local files are read only when the server is started with \
             --allow-local-files DIR; send the image inline as a data: URL instead",
        ));
    };
    let outside = || {
        bad(
            at,
            format!(
                "{} is not a readable file under {} (--allow-local-files)",
                path.display(),
                dir.display()
            ),
        )
    };
    let real = path.canonicalize().map_err(|_| outside())?;
    let outside_dir = !real.starts_with(dir) && !plant::is(Defect::ImageOutsideAllowedDir);
    if outside_dir || !real.is_file() {
        return Err(outside());
    }
    std::fs::read(&real).map_err(|_| outside())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn png(w: u32, h: u32) -> Vec<u8> {
        let img = image::RgbImage::from_fn(w, h, |x, y| image::Rgb([x as u8, y as u8, 7]));
        let mut out = std::io::Cursor::new(Vec::new());
        img.write_to(&mut out, image::ImageFormat::Png).unwrap();
        out.into_inner()
    }

    fn data_url(bytes: &[u8]) -> String {
        format!(
            "data:image/png;base64,{}",
            base64::engine::general_purpose::STANDARD.encode(bytes)
        )
    }

    fn vision_rules() -> Rules {
        Rules {
            text_only: None,
            ..Rules::default()
        }
    }

    fn chat_with(parts: Value) -> Value {
        json!({"messages": [{"role": "user", "content": parts}]})
    }

    fn refusal(r: Result<Vec<Image>, ApiError>) -> String {
        format!("{:?}", r.expect_err("refused"))
    }

    #[test]
    fn each_api_reads_its_image_parts_in_order() {
        let (a, b) = (png(3, 2), png(2, 5));
        let chat = chat_with(json!([
            {"type": "text", "text": "compare"},
            {"type": "image_url", "image_url": {"url": data_url(&a)}},
            {"type": "image_url", "image_url": data_url(&b)},
        ]));
        let responses = json!({"input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": data_url(&a)},
            {"type": "input_text", "text": "and"},
            {"type": "input_image", "image_url": data_url(&b)}]}]});
        let b64 = |x: &[u8]| base64::engine::general_purpose::STANDARD.encode(x);
        let messages = json!({"messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(&a)}},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(&b)}}]}]});
        for found in [
            in_chat(&chat).unwrap(),
            in_responses(&responses).unwrap(),
            in_messages(&messages).unwrap(),
        ] {
            let images = read(found, &vision_rules()).unwrap();
            let sizes: Vec<_> = images
                .iter()
                .map(|i| (i.pixels.width, i.pixels.height))
                .collect();
            assert_eq!(sizes, [(3, 2), (2, 5)]);
            assert_ne!(images[0].sha256, images[1].sha256);
        }
    }

    #[test]
    fn the_same_pixels_hash_alike_and_other_pixels_do_not() {
        let one = |b: &[u8]| {
            let f = in_chat(&chat_with(
                json!([{"type": "image_url", "image_url": {"url": data_url(b)}}]),
            ))
            .unwrap();
            read(f, &vision_rules()).unwrap()[0].sha256
        };
        assert_eq!(one(&png(4, 4)), one(&png(4, 4)));
        assert_ne!(one(&png(4, 4)), one(&png(4, 5)));
    }

    #[test]
    fn bad_images_are_refused_naming_the_part_and_the_fix() {
        let chat = |url: &str| {
            in_chat(&chat_with(
                json!([{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": url}}]),
            ))
            .and_then(|f| read(f, &vision_rules()))
        };
        let cases = [
            (chat("https://example.com/cat.png"), "fetches no URLs"),
            (chat("file:///etc/passwd"), "--allow-local-files"),
            (chat("data:image/png;base64,@@@"), "not valid base64"),
            (chat("data:image/png,abc"), "only base64"),
            (chat(&data_url(b"<html></html>")), "not an image"),
            (chat(&data_url(&png(3, 3)[..40])), "truncated"),
        ];
        for (r, want) in cases {
            let msg = refusal(r);
            assert!(msg.contains(want), "{want}: {msg}");
            assert!(msg.contains("messages[0].content[1]"), "{msg}");
        }
        let system = json!({"messages": [{"role": "system", "content": [
            {"type": "image_url", "image_url": {"url": data_url(&png(2, 2))}}]}]});
        assert!(format!("{:?}", in_chat(&system).unwrap_err()).contains("user messages only"));
        let file_id = json!({"input": [{"role": "user", "content": [
            {"type": "input_image", "file_id": "file-1"}]}]});
        assert!(format!("{:?}", in_responses(&file_id).unwrap_err()).contains("file_id"));
        let url = json!({"messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}]}]});
        assert!(format!("{:?}", in_messages(&url).unwrap_err()).contains("fetches nothing"));
    }

    #[test]
    fn limits_hold_before_decoding_and_a_text_model_refuses_checked_images() {
        let part = json!({"type": "image_url", "image_url": {"url": data_url(&png(30, 20))}});
        let many = chat_with(Value::Array(vec![part.clone(); 3]));
        let few = Rules {
            max_images: 2,
            ..vision_rules()
        };
        let msg = refusal(read(in_chat(&many).unwrap(), &few));
        assert!(
            msg.contains("--max-images-per-request") && msg.contains("content[2]"),
            "{msg}"
        );
        let small = Rules {
            limits: vision::Limits {
                max_side: 16384,
                max_pixels: 500,
            },
            ..vision_rules()
        };
        let msg = refusal(read(in_chat(&many).unwrap(), &small));
        assert!(msg.contains("600 pixels"), "{msg}");
        let text = Rules::default();
        let msg = refusal(read(in_chat(&many).unwrap(), &text));
        assert!(msg.contains("reads text only"), "{msg}");
    }

    #[test]
    fn local_files_are_read_under_the_allowed_dir_only() {
        let dir = tempfile::tempdir().unwrap();
        let inside = dir.path().join("a.png");
        std::fs::write(&inside, png(2, 3)).unwrap();
        let other = tempfile::tempdir().unwrap();
        let outside = other.path().join("b.png");
        std::fs::write(&outside, png(2, 3)).unwrap();
        let rules = Rules {
            local_dir: Some(dir.path().canonicalize().unwrap()),
            ..vision_rules()
        };
        let chat = |url: String| {
            in_chat(&chat_with(
                json!([{"type": "image_url", "image_url": {"url": url}}]),
            ))
            .and_then(|f| read(f, &rules))
        };
        let ok = chat(format!("file://{}", inside.display())).unwrap();
        assert_eq!((ok[0].pixels.width, ok[0].pixels.height), (2, 3));
        assert!(chat(inside.display().to_string()).is_ok());
        let sneaky = format!(
            "file://{}/../{}",
            dir.path().display(),
            outside
                .strip_prefix(other.path().parent().unwrap())
                .unwrap()
                .display()
        );
        for url in [format!("file://{}", outside.display()), sneaky.clone()] {
            let msg = refusal(chat(url));
            assert!(msg.contains("not a readable file under"), "{msg}");
        }
        let planted = plant::on(Defect::ImageOutsideAllowedDir).unwrap();
        let read_anyway = chat(sneaky).is_ok();
        drop(planted);
        assert!(
            read_anyway,
            "planted ImageOutsideAllowedDir: the file was still refused"
        );
    }
}
