//! A served chat's messages with images → the messages the chat template renders, as
//! mlx_vlm.server 0.7.10 builds them for `/chat/completions`, `/responses` and `/messages`
//! (mlx_vlm/server/request_normalization.py `_chat_message_to_prompt` →
//! prompt_utils.py `normalize_image_content`, then `apply_chat_template` →
//! `MessageFormatter.format_message` with the message's explicit parts).
//!
//! Unlike the CLI ([`super::prompt`]: one user message, its text and N images), a served
//! message keeps its parts in the order the client sent them: text, image, text… mlx-vlm
//! keeps each non-empty text part and one `{"type": "image"}` per image, and the family's
//! formatter renders them in that order:
//!
//! - gemma3 (`_format_with_token`): the parts joined into one string, each image as its
//!   `<start_of_image>` marker where it stood;
//! - qwen3_vl (`_format_list_with_image`): a list, `{"type": "text", "text": t, "content":
//!   t}` per text part and `{"type": "image"}` per image, in order.
//!
//! The request parsers join a message's text parts into one string and leave
//! [`IMAGE_MARK`] where each image part was (`serve::api::parts`, the Messages API's
//! blocks); [`lay_out`] turns the marked messages into the family's form. Two adjacent text
//! parts become one text entry here where mlx-vlm keeps two: the templates write a message's
//! text entries one after the other, so the rendered prompt is the same.

use std::path::Path;

use serde_json::{json, Value};

use super::gemma3::Gemma3Processor;
use super::gemma4::{Gemma4ImageMarkers, Gemma4Processor};
use super::model::{detect, gemma4, ImageModelError, VisionFamily};
use super::prompt::ImageLayout;
use super::qwen_vl::{self, QwenVlProcessor};
use super::{RgbImage, VisionError};
use crate::plant::{self, Defect};

/// Where an image part stood in a message's joined text. Private-use code points: a client
/// that types them gets a count that does not match its images, refused by [`lay_out`].
pub const IMAGE_MARK: &str = "\u{F8FE}image\u{F8FF}";

/// Why marked messages could not be laid out.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum LayoutError {
    #[error(
        "the messages mark {marks} image position(s) for {images} image(s): the text holds \
         the private-use characters U+F8FE/U+F8FF that stand for images here; remove them"
    )]
    Count { marks: usize, images: usize },
    #[error(
        "a {role} message has images: images go on user messages only; move them to a user \
         message"
    )]
    OffUserTurn { role: String },
}

/// Rewrites each message whose text holds [`IMAGE_MARK`]s into `layout`'s form; `images`
/// is how many images the request carries (every one must be marked once).
pub fn lay_out(
    layout: ImageLayout,
    messages: &mut [Value],
    images: usize,
) -> Result<(), LayoutError> {
    let marks: usize = messages
        .iter()
        .filter_map(|m| m["content"].as_str())
        .map(|t| t.matches(IMAGE_MARK).count())
        .sum();
    if marks != images {
        return Err(LayoutError::Count { marks, images });
    }
    for m in messages.iter_mut() {
        let Some(text) = m["content"].as_str().filter(|t| t.contains(IMAGE_MARK)) else {
            continue;
        };
        let role = m["role"].as_str().unwrap_or("").to_owned();
        if role != "user" {
            return Err(LayoutError::OffUserTurn { role });
        }
        let content = content(layout, text);
        m["content"] = content;
    }
    Ok(())
}

/// A family's prompt expansion, off the model thread (no MLX state): the server turns a
/// templated prompt into the processor's text — each image marker expanded to its image's
/// tokens — on the HTTP side, so the prompt's ids (and its length, for the limits and the
/// memory budget) are known before the model thread takes the request.
pub enum Expander {
    Gemma3(Gemma3Processor),
    Gemma4(Gemma4Processor, Gemma4ImageMarkers),
    /// Qwen3-VL's and Qwen3.5's processor, and which of the two (its `model_type`).
    QwenVl(QwenVlProcessor, &'static str),
}

impl Expander {
    /// The expansion of `dir`'s checkpoint: None when it has no vision tower this engine
    /// runs ([`detect`]).
    pub fn load(dir: &Path) -> Result<Option<Self>, String> {
        let (family, _) = detect(dir).map_err(|e| e.to_string())?;
        let Some(family) = family else {
            return Ok(None);
        };
        let path = dir.join("preprocessor_config.json");
        let pre = || std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()));
        let why = |e: VisionError| format!("{}: {e}", path.display());
        let why4 = |e: ImageModelError| e.to_string();
        Ok(Some(match family {
            VisionFamily::Gemma3 => {
                Expander::Gemma3(Gemma3Processor::from_json(&pre()?).map_err(why)?)
            }
            VisionFamily::Gemma4 => Expander::Gemma4(
                gemma4::processor(dir).map_err(why4)?,
                gemma4::markers(dir).map_err(why4)?,
            ),
            VisionFamily::Qwen3Vl => Expander::QwenVl(
                QwenVlProcessor::from_json(&pre()?).map_err(why)?,
                "qwen3_vl",
            ),
            VisionFamily::Qwen35 => {
                Expander::QwenVl(QwenVlProcessor::from_json(&pre()?).map_err(why)?, "qwen3_5")
            }
        }))
    }

    /// How this family's messages hold their images.
    pub fn layout(&self) -> ImageLayout {
        let model_type = match self {
            Expander::Gemma3(_) => "gemma3",
            Expander::Gemma4(..) => "gemma4",
            Expander::QwenVl(_, model_type) => model_type,
        };
        ImageLayout::of(model_type).expect("every expander's family has a layout")
    }

    /// `templated` with each image marker expanded for `images` (in prompt order): the text
    /// the model thread's processor makes too (`ImageModel::prepare`).
    pub fn expand(&self, templated: &str, images: &[&RgbImage]) -> Result<String, VisionError> {
        match self {
            Expander::Gemma3(p) => p.expand_prompt(templated, images.len()),
            // The soft tokens come with the resize (its aspect-preserving size).
            Expander::Gemma4(p, markers) => {
                let tokens = images
                    .iter()
                    .map(|img| p.preprocess(img).map(|t| t.tokens))
                    .collect::<Result<Vec<_>, _>>()?;
                markers.expand_prompt(templated, &tokens)
            }
            Expander::QwenVl(p, _) => {
                let tokens = images
                    .iter()
                    .map(|img| p.image_tokens(img.height, img.width))
                    .collect::<Result<Vec<_>, _>>()?;
                qwen_vl::expand_prompt(templated, &tokens)
            }
        }
    }
}

/// One marked text in `layout`'s form.
fn content(layout: ImageLayout, text: &str) -> Value {
    match layout {
        ImageLayout::TextThenMarkers { marker } => Value::String(text.replace(IMAGE_MARK, marker)),
        // gemma4's typed entries differ only on assistant messages, which hold no images.
        ImageLayout::ImageEntriesFirst | ImageLayout::TypedEntriesFirst => {
            let mut parts = Vec::new();
            for (i, piece) in text.split(IMAGE_MARK).enumerate() {
                if i > 0 {
                    parts.push(json!({"type": "image"}));
                }
                if !piece.is_empty() {
                    parts.push(json!({"type": "text", "text": piece, "content": piece}));
                }
            }
            if plant::is(Defect::ServedImageEntriesFirst) {
                // Planted: the CLI's order (images first) instead of the client's.
                parts.sort_by_key(|p| p["type"] != "image");
            }
            Value::Array(parts)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn user(text: &str) -> Value {
        json!({"role": "user", "content": text})
    }

    #[test]
    fn gemma3_puts_each_marker_where_its_image_stood_and_qwen_keeps_the_parts_in_order() {
        let text = format!("Look:{IMAGE_MARK}and{IMAGE_MARK}");
        let mut m = vec![
            json!({"role": "system", "content": "be brief"}),
            user(&text),
        ];
        lay_out(ImageLayout::of("gemma3").unwrap(), &mut m, 2).unwrap();
        assert_eq!(m[0]["content"], "be brief");
        assert_eq!(m[1]["content"], "Look:<start_of_image>and<start_of_image>");
        let mut m = vec![user(&format!("{IMAGE_MARK}What is it?"))];
        lay_out(ImageLayout::of("qwen3_vl").unwrap(), &mut m, 1).unwrap();
        assert_eq!(
            m[0]["content"],
            json!([{"type": "image"},
                   {"type": "text", "text": "What is it?", "content": "What is it?"}])
        );
        let mut m = vec![user(&format!("A{IMAGE_MARK}B"))];
        lay_out(ImageLayout::ImageEntriesFirst, &mut m, 1).unwrap();
        assert_eq!(m[0]["content"][1], json!({"type": "image"}));
    }

    #[test]
    fn a_typed_mark_or_an_image_off_a_user_turn_is_refused() {
        let mut m = vec![user(&format!("{IMAGE_MARK}{IMAGE_MARK}"))];
        let err = lay_out(ImageLayout::ImageEntriesFirst, &mut m, 1).unwrap_err();
        assert_eq!(
            err,
            LayoutError::Count {
                marks: 2,
                images: 1
            }
        );
        let mut m = vec![json!({"role": "assistant", "content": IMAGE_MARK})];
        let err = lay_out(ImageLayout::ImageEntriesFirst, &mut m, 1).unwrap_err();
        assert!(err.to_string().contains("user messages only"), "{err}");
    }
}
