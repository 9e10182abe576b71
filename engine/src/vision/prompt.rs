//! Chat messages with images → the messages a chat template renders, as mlx-vlm 0.7.10 builds
//! them (mlx_vlm/prompt_utils.py: `apply_chat_template` → `get_message_json` →
//! `MessageFormatter.format_message`), for the families whose image path this engine runs.
//!
//! Each message carries its text and the number of images attached to it. mlx-vlm's formats:
//!
//! - gemma3 (`MessageFormat.START_IMAGE_TOKEN`, `_format_with_token(token="<start_of_image>",
//!   image_first=False)`): the content stays a string, the text followed by one
//!   `<start_of_image>` per image; `Gemma3Processor` later expands each marker;
//! - qwen3_vl (`MessageFormat.LIST_WITH_IMAGE_FIRST`, `_format_list_with_image(image_first=
//!   True)`): the content becomes a list, one `{"type": "image"}` per image FIRST, then
//!   `{"type": "text", "text": t, "content": t}`; the template writes each image entry as
//!   `<|vision_start|><|image_pad|><|vision_end|>` and `Qwen3VLProcessor` expands the pads;
//!   qwen3_5 the same;
//! - gemma4 (`MessageFormat.LIST_WITH_IMAGE_TYPE_TEXT`, `_format_list_with_image_type(
//!   message_type="text")`): a list as qwen3_vl's, image entries first, then the text entry;
//!   but an assistant message's content is its text as a string. The template writes each
//!   image entry as the image token and `Gemma4Processor` expands it.
//!
//! Images go on user messages only (mlx-vlm skips the image tokens of system and assistant
//! turns); a message of another role with images is refused here rather than dropped. The
//! CLI (mlx_vlm/generate/dispatch.py `main`) makes one user message of the prompt, after a
//! system message when `--system` is given, and gives it all the images.

use serde_json::{json, Value};

use crate::plant::{self, Defect};

/// How a family puts a message's images into the template's messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageLayout {
    /// gemma3: a string content, the text then one marker per image.
    TextThenMarkers { marker: &'static str },
    /// qwen3_vl, qwen3_5: a list content, the image entries first, then the text entry.
    ImageEntriesFirst,
    /// gemma4: as `ImageEntriesFirst`, an assistant message's content a string.
    TypedEntriesFirst,
}

impl ImageLayout {
    /// The layout of a config's `model_type` (mlx-vlm's `MODEL_CONFIG`), for the families
    /// this engine runs with images.
    pub fn of(model_type: &str) -> Option<Self> {
        match model_type.to_ascii_lowercase().as_str() {
            "gemma3" => Some(ImageLayout::TextThenMarkers {
                marker: super::gemma3::BOI_TOKEN,
            }),
            "qwen3_vl" | "qwen3_5" => Some(ImageLayout::ImageEntriesFirst),
            "gemma4" => Some(ImageLayout::TypedEntriesFirst),
            _ => None,
        }
    }
}

/// One chat message: its role, its text and how many images come with it.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatTurn {
    pub role: String,
    pub text: String,
    pub images: usize,
}

impl ChatTurn {
    pub fn new(role: &str, text: &str, images: usize) -> Self {
        ChatTurn {
            role: role.to_owned(),
            text: text.to_owned(),
            images,
        }
    }
}

/// Why messages could not be laid out.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PromptError {
    #[error(
        "a {role} message has {images} image(s): images go on user messages only; move them \
         to a user message"
    )]
    ImagesOffUserTurn { role: String, images: usize },
}

/// The messages the chat template renders (`messages` of `apply_chat_template`).
pub fn template_messages(
    layout: ImageLayout,
    turns: &[ChatTurn],
) -> Result<Vec<Value>, PromptError> {
    turns.iter().map(|t| message(layout, t)).collect()
}

fn message(layout: ImageLayout, turn: &ChatTurn) -> Result<Value, PromptError> {
    let user = turn.role == "user";
    if !user && turn.images > 0 {
        return Err(PromptError::ImagesOffUserTurn {
            role: turn.role.clone(),
            images: turn.images,
        });
    }
    Ok(match layout {
        ImageLayout::TextThenMarkers { marker } => {
            let markers = marker.repeat(turn.images);
            let content = match plant::is(Defect::ImageMarkerBeforeText) {
                // Planted: the markers before the text (the other families' order).
                true => format!("{markers}{}", turn.text),
                false => format!("{}{markers}", turn.text),
            };
            json!({"role": turn.role, "content": content})
        }
        // `_format_list_with_image_type`: an assistant's content is its first entry's text.
        ImageLayout::TypedEntriesFirst if turn.role == "assistant" => {
            json!({"role": turn.role, "content": turn.text})
        }
        ImageLayout::ImageEntriesFirst | ImageLayout::TypedEntriesFirst => {
            let text = json!({"type": "text", "text": turn.text, "content": turn.text});
            let mut content: Vec<Value> = vec![json!({"type": "image"}); turn.images];
            match plant::is(Defect::ImageMarkerBeforeText) {
                // Planted: the image entries after the text.
                true => content.insert(0, text),
                false => content.push(text),
            }
            json!({"role": turn.role, "content": content})
        }
    })
}

/// The CLI's turns (dispatch.py `main`): a system message when given, then the prompt as a
/// user message holding every image.
pub fn cli_turns(system: Option<&str>, prompt: &str, images: usize) -> Vec<ChatTurn> {
    let mut turns = Vec::new();
    if let Some(s) = system {
        turns.push(ChatTurn::new("system", s, 0));
    }
    turns.push(ChatTurn::new("user", prompt, images));
    turns
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemma3_puts_its_markers_after_the_text_and_qwen3_vl_its_image_entries_first() {
        let g = ImageLayout::of("gemma3").unwrap();
        let m = template_messages(g, &cli_turns(Some("be brief"), "Hi", 2)).unwrap();
        assert_eq!(m[0], json!({"role": "system", "content": "be brief"}));
        assert_eq!(
            m[1],
            json!({"role": "user", "content": "Hi<start_of_image><start_of_image>"})
        );
        let q = ImageLayout::of("qwen3_vl").unwrap();
        let m = template_messages(q, &cli_turns(None, "Hi", 1)).unwrap();
        assert_eq!(
            m[0]["content"],
            json!([{"type": "image"}, {"type": "text", "text": "Hi", "content": "Hi"}])
        );
        assert_eq!(ImageLayout::of("llama"), None);
        assert_eq!(
            ImageLayout::of("qwen3_5"),
            Some(ImageLayout::ImageEntriesFirst)
        );
    }

    #[test]
    fn gemma4_lists_its_image_entries_first_and_gives_an_assistant_a_string() {
        let g = ImageLayout::of("gemma4").unwrap();
        let turns = [
            ChatTurn::new("system", "be brief", 0),
            ChatTurn::new("user", "Hi", 2),
            ChatTurn::new("assistant", "Hello", 0),
        ];
        let m = template_messages(g, &turns).unwrap();
        let text = |t: &str| json!({"type": "text", "text": t, "content": t});
        assert_eq!(m[0]["content"], json!([text("be brief")]));
        assert_eq!(
            m[1]["content"],
            json!([{"type": "image"}, {"type": "image"}, text("Hi")])
        );
        assert_eq!(m[2], json!({"role": "assistant", "content": "Hello"}));
    }

    #[test]
    fn images_on_an_assistant_message_are_refused() {
        let q = ImageLayout::ImageEntriesFirst;
        let err = template_messages(q, &[ChatTurn::new("assistant", "x", 1)]).unwrap_err();
        assert!(err.to_string().contains("user messages only"), "{err}");
    }
}
