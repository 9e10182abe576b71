//! Prompts into ids on the HTTP side (chat template, tokenizer, the checks on what the
//! model can read), so the model thread only ever sees ids.

use std::sync::Arc;

use super::error::ApiError;
use super::images::ImageText;
use super::request::{Chat, GenRequest, Prompt};
use super::tools::Markers;
use crate::load::template::{ChatTemplate, RenderArgs};
use crate::load::tokenizer::Tokenizer;
use crate::vision::served::{lay_out, Expander};
use crate::vision::RgbImage;

/// Turns a request's prompt into ids (chat template, tokenizer), off the model thread: the
/// tokenizer and the template hold no MLX state and are safe to share between threads.
pub struct Encoder {
    pub tokenizer: Arc<Tokenizer>,
    pub template: Option<ChatTemplate>,
    /// The model's "tool_use" template, for requests with tools.
    pub tool_template: Option<ChatTemplate>,
    /// Reasoning and tool-call markers (the thinking kwarg's default, the tool format).
    pub markers: Arc<Markers>,
    pub context: usize,
    /// The model's vocabulary: a prompt id past it is refused.
    pub vocab: usize,
    /// The prompt expansion of a model whose images this server reads (`serve::images::
    /// served`).
    pub images: Option<Arc<Expander>>,
}

impl Encoder {
    pub fn encode(&self, prompt: &Prompt) -> Result<Vec<u32>, ApiError> {
        let (ids, field) = match prompt {
            Prompt::Chat(chat) => (
                self.tokenizer.encode(&self.render(chat)?, false),
                "messages",
            ),
            Prompt::Text(text) => (self.tokenizer.encode(text, true), "prompt"),
        };
        self.checked(ids, field)
    }

    /// The request's prompt ids; with images, as mlx_vlm.server makes them: the messages
    /// laid out for the family (`vision::served`), the template rendered, each image
    /// marker expanded by the processor, and the text tokenized WITH the tokenizer's special
    /// tokens (mlx-vlm's `prepare_inputs`, as `engine generate --image`:
    /// `vision::generate`). The texts go with the request (`GenRequest::image_text`).
    pub fn encode_request(&self, req: &mut GenRequest) -> Result<Vec<u32>, ApiError> {
        if req.images.is_empty() {
            return self.encode(&req.prompt);
        }
        let (Some(expander), Prompt::Chat(chat)) = (&self.images, &mut req.prompt) else {
            return Err(ApiError::invalid(
                "images come in chat messages: this server reads no images with a raw prompt",
            ));
        };
        lay_out(expander.layout(), &mut chat.messages, req.images.len())
            .map_err(|e| ApiError::field("messages", e.to_string()))?;
        let templated = self.render(chat)?;
        let pixels: Vec<&RgbImage> = req.images.iter().map(|i| i.pixels.as_ref()).collect();
        let expanded = expander
            .expand(&templated, &pixels)
            .map_err(|e| ApiError::field("messages", e.to_string()))?;
        let ids = self.checked(self.tokenizer.encode(&expanded, true), "messages")?;
        req.image_text = Some(ImageText {
            templated,
            expanded,
        });
        Ok(ids)
    }

    /// Ids the model can take: some, fewer than the context, each within the vocabulary.
    fn checked(
        &self,
        ids: Result<Vec<u32>, crate::load::LoadError>,
        field: &str,
    ) -> Result<Vec<u32>, ApiError> {
        let ids = ids.map_err(|e| ApiError::field(field, e.to_string()))?;
        if ids.is_empty() {
            return Err(ApiError::field(field, "the prompt encodes to no tokens"));
        }
        if ids.len() >= self.context {
            return Err(ApiError::field(
                field,
                format!(
                    "the prompt is {} tokens; this model's context is {} tokens",
                    ids.len(),
                    self.context
                ),
            ));
        }
        super::request::check_ids(&ids, self.vocab, field)?;
        Ok(ids)
    }
}

impl Encoder {
    /// The chat prompt as mlx_lm.server renders it: apply_chat_template with the tools,
    /// add_generation_prompt, the kwargs, and `enable_thinking` defaulting to whether the
    /// model has thinking markers.
    pub(super) fn render(&self, chat: &Chat) -> Result<String, ApiError> {
        if let (Some(_), Some(family)) = (&chat.tools, self.markers.tools) {
            if !family.supported() {
                return Err(ApiError::field(
                    "tools",
                    format!(
                        "this model's tool-call format ({}) is not supported by this engine; \
                         send the request without tools",
                        family.name()
                    ),
                ));
            }
        }
        let template = match (&chat.tools, &self.tool_template) {
            (Some(_), Some(t)) => Some(t),
            _ => self.template.as_ref(),
        };
        let template = template.ok_or_else(|| {
            ApiError::invalid("this model has no chat template; use /v1/completions")
        })?;
        let mut kwargs = chat.kwargs.clone();
        kwargs
            .entry("enable_thinking")
            .or_insert(serde_json::Value::Bool(self.markers.thinking_default()));
        let args = RenderArgs {
            tools: chat.tools.clone(),
            documents: chat.documents.clone(),
            add_generation_prompt: true,
            continue_final_message: chat.continue_final_message,
            kwargs,
        };
        template
            .render_json(&chat.messages, &args)
            .map_err(|e| ApiError::field("messages", e.to_string()))
    }
}

/// Text bytes of a prompt (big prompts take turns being encoded).
pub fn prompt_bytes(prompt: &Prompt) -> usize {
    match prompt {
        Prompt::Text(t) => t.len(),
        Prompt::Chat(chat) => {
            let strings: usize = chat
                .messages
                .iter()
                .filter_map(|m| m.get("content").and_then(serde_json::Value::as_str))
                .map(str::len)
                .sum();
            strings + chat.tools.as_ref().map_or(0, |t| t.to_string().len())
        }
    }
}
