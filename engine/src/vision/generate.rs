//! Generation with images, as `mlx_vlm.generate --image` runs it (mlx_vlm/generate/dispatch.py
//! `main` → `stream_generate` → ar.py `generate_step`), for `engine generate --image`:
//!
//! 1. each image file read and decoded with the size limits checked from its header
//!    ([`super::decode`]; a refusal names the file);
//! 2. the messages built as mlx-vlm's `prompt_utils.apply_chat_template` builds them
//!    ([`super::prompt`]) and rendered with the model's chat template, `enable_thinking`
//!    false unless the template kwargs say otherwise (the CLI's default);
//! 3. the processor: pixels, and each image marker expanded ([`ImageModel::prepare`]);
//!    the text tokenized WITH the tokenizer's special tokens: `prepare_inputs` passes
//!    `add_special_tokens=False` only to a processor whose `__call__` names it, and neither
//!    `Gemma3Processor` nor `Qwen3VLProcessor` does, so the tokenizer's default applies (for
//!    gemma3 a second BOS after the template's, as mlx-vlm has it);
//! 4. the prompt prefilled with its images, then one token at a time, each picked by the
//!    sampler from the log-probabilities (greedy: their argmax), until an EOS id or
//!    `max_tokens`.

use std::path::{Path, PathBuf};

use mlx_rs::Array;

use super::model::{ImageInputs, ImageModel, ImageModelError};
use super::prompt::{cli_turns, template_messages};
use super::{decode, Limits, RgbImage, VisionError};
use crate::generate::sampler::Sampler;
use crate::generate::{Finish, Flow};
use crate::load::template::{ChatTemplate, RenderArgs};
use crate::load::tokenizer::Tokenizer;

/// Why a generation with images could not run. Each message names the cause and the fix.
#[derive(Debug, thiserror::Error)]
pub enum ImageGenError {
    #[error("--image {path}: {source}")]
    Image { path: PathBuf, source: VisionError },
    #[error("--image {path}: cannot read it ({source}); give the path of an image file")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Model(#[from] ImageModelError),
    #[error(
        "{0} has no chat template (chat_template.jinja, or chat_template in \
         tokenizer_config.json): a prompt with images is built from the template; use a \
         checkpoint that ships one"
    )]
    NoTemplate(String),
    #[error("{0}")]
    Prompt(#[from] super::prompt::PromptError),
    #[error("{0}")]
    Load(#[from] crate::load::LoadError),
    #[error("MLX: {0}")]
    Mlx(#[from] mlx_rs::error::Exception),
}

type R<T> = Result<T, ImageGenError>;

/// Reads and decodes each image file, in order.
pub fn read_images(paths: &[PathBuf], limits: &Limits) -> R<Vec<RgbImage>> {
    paths
        .iter()
        .map(|path| {
            let bytes = std::fs::read(path).map_err(|source| ImageGenError::Read {
                path: path.clone(),
                source,
            })?;
            decode(&bytes, limits).map_err(|source| ImageGenError::Image {
                path: path.clone(),
                source,
            })
        })
        .collect()
}

/// A prompt with images as the model takes it.
pub struct ImagePrompt {
    /// The chat template's output (the image markers not yet expanded).
    pub templated: String,
    /// The processor's text: each marker expanded to its image's tokens.
    pub expanded: String,
    pub ids: Vec<u32>,
    pub inputs: ImageInputs,
}

/// The CLI's prompt (`--system`, `--prompt`, every image on the user message) with `images`.
pub fn cli_prompt(
    model: &ImageModel,
    tokenizer: &Tokenizer,
    dir: &Path,
    system: Option<&str>,
    prompt: &str,
    images: &[RgbImage],
    mut kwargs: serde_json::Map<String, serde_json::Value>,
) -> R<ImagePrompt> {
    let template = ChatTemplate::from_tokenizer(tokenizer)?
        .ok_or_else(|| ImageGenError::NoTemplate(dir.display().to_string()))?;
    let messages = template_messages(model.layout(), &cli_turns(system, prompt, images.len()))?;
    kwargs.entry("enable_thinking").or_insert(false.into());
    let render = RenderArgs {
        tools: kwargs.remove("tools"),
        documents: kwargs.remove("documents"),
        add_generation_prompt: true,
        continue_final_message: false,
        kwargs,
    };
    let templated = template.render_json(&messages, &render)?;
    let (expanded, inputs) = model.prepare(&templated, images)?;
    let ids = tokenizer.encode(&expanded, true)?;
    Ok(ImagePrompt {
        templated,
        expanded,
        ids,
        inputs,
    })
}

/// Generates after `prompt` (prefill in chunks of `prefill_step`): each id goes to
/// `on_token` as it comes (an EOS id ends it without being passed on). The ids and why it
/// ended.
pub fn generate(
    model: &ImageModel,
    prompt: &ImagePrompt,
    sampler: &mut Sampler,
    max_tokens: usize,
    eos_ids: &[u32],
    prefill_step: usize,
    on_token: &mut dyn FnMut(u32) -> R<Flow>,
) -> R<(Vec<u32>, Finish)> {
    let mut history = prompt.ids.clone();
    let mut out = Vec::new();
    if max_tokens == 0 {
        return Ok((out, Finish::Length));
    }
    let (mut run, mut logits) = model.prefill(&prompt.ids, &prompt.inputs, prefill_step)?;
    loop {
        let id = pick(sampler, &logits, &history)?;
        if eos_ids.contains(&id) {
            return Ok((out, Finish::Eos));
        }
        out.push(id);
        history.push(id);
        if on_token(id)? == Flow::Stop {
            return Ok((out, Finish::Stop));
        }
        if out.len() == max_tokens {
            return Ok((out, Finish::Length));
        }
        logits = run.decode(id)?;
    }
}

fn pick(sampler: &mut Sampler, logits: &Array, history: &[u32]) -> R<u32> {
    let (id, _) = sampler.pick(logits, history)?;
    id.eval()?;
    Ok(id.as_slice::<u32>()[0])
}
