//! Training data in mlx-lm's jsonl shapes: `train.jsonl` / `valid.jsonl` in a directory,
//! one example per line — `{"text"}`, `{"prompt", "completion"}` or `{"messages"}` for
//! SFT, `{"prompt", "chosen", "rejected"}` for ORPO (each a string, or `chosen`/`rejected`
//! an assistant message list). Chat-shaped examples go through the model's chat template
//! as mlx-lm's datasets do; a bad line is reported with its file and line number.

use std::path::Path;

use serde_json::Value;

use super::TrainError;
use crate::load::template::{ChatTemplate, Message};
use crate::load::tokenizer::Tokenizer;

/// One SFT sequence and how many of its first tokens are prompt (masked with
/// `--mask-prompt`; 0 otherwise).
#[derive(Debug, Clone, PartialEq)]
pub struct Example {
    pub tokens: Vec<u32>,
    pub offset: usize,
}

/// One preference pair: the prompt and the two full sequences (prompt + response).
#[derive(Debug, Clone, PartialEq)]
pub struct Pair {
    pub prompt_len: usize,
    pub chosen: Vec<u32>,
    pub rejected: Vec<u32>,
}

/// The pairs of one file and, for DPO, the reference's summed response log-probs of each
/// ([chosen, rejected]): read from the data, or computed before training.
#[derive(Debug, Clone, PartialEq)]
pub struct PairSet {
    pub pairs: Vec<Pair>,
    pub reference: Option<Vec<[f32; 2]>>,
}

pub struct Encoder<'t> {
    pub tokenizer: &'t Tokenizer,
    pub template: Option<&'t ChatTemplate>,
}

fn bad(file: &Path, line: usize, what: impl std::fmt::Display) -> TrainError {
    TrainError::Config(format!("{} line {line}: {what}", file.display()))
}

impl Encoder<'_> {
    fn template(&self) -> Result<&ChatTemplate, String> {
        self.template.ok_or_else(|| {
            "this model has no chat template, so only {\"text\": …} examples can be used".into()
        })
    }

    fn chat(&self, messages: &[Message], generation_prompt: bool) -> Result<Vec<u32>, String> {
        let rendered = self
            .template()?
            .render(messages, generation_prompt)
            .map_err(|e| e.to_string())?;
        self.tokenizer
            .encode(&rendered, false)
            .map_err(|e| e.to_string())
    }

    fn text(&self, text: &str) -> Result<Vec<u32>, String> {
        let mut ids = self
            .tokenizer
            .encode(text, true)
            .map_err(|e| e.to_string())?;
        // mlx-lm's TextDataset ends every sequence with EOS.
        if let Some(&eos) = self.tokenizer.eos_token_ids.first() {
            if ids.last() != Some(&eos) {
                ids.push(eos);
            }
        }
        Ok(ids)
    }

    fn messages(v: &Value) -> Result<Vec<Message>, String> {
        let list = v.as_array().ok_or("`messages` must be a list")?;
        list.iter()
            .map(|m| {
                let role = m["role"]
                    .as_str()
                    .ok_or("every message needs a string `role`")?;
                let content = m["content"]
                    .as_str()
                    .ok_or("every message needs a string `content`")?;
                Ok(Message::new(role, content))
            })
            .collect()
    }

    /// One SFT example from a parsed line.
    pub fn sft(&self, v: &Value, mask_prompt: bool) -> Result<Example, String> {
        if let Some(text) = v.get("text") {
            let text = text.as_str().ok_or("`text` must be a string")?;
            return Ok(Example {
                tokens: self.text(text)?,
                offset: 0,
            });
        }
        let (messages, prompt_part) = if let Some(m) = v.get("messages") {
            let messages = Self::messages(m)?;
            if messages.len() < 2 {
                return Err("`messages` needs at least a prompt and a reply".into());
            }
            let prompt = messages[..messages.len() - 1].to_vec();
            (messages, prompt)
        } else if let (Some(p), Some(c)) = (v.get("prompt"), v.get("completion")) {
            let p = p.as_str().ok_or("`prompt` must be a string")?;
            let c = c.as_str().ok_or("`completion` must be a string")?;
            let user = Message::new("user", p);
            (vec![user.clone(), Message::new("assistant", c)], vec![user])
        } else {
            return Err(
                "expected {\"text\"}, {\"prompt\", \"completion\"} or {\"messages\"}".into(),
            );
        };
        let tokens = self.chat(&messages, false)?;
        let offset = if mask_prompt {
            self.chat(&prompt_part, true)?.len()
        } else {
            0
        };
        Ok(Example { tokens, offset })
    }

    fn response(v: &Value, key: &str) -> Result<String, String> {
        match v.get(key) {
            Some(Value::String(s)) => Ok(s.clone()),
            Some(Value::Array(list)) => list
                .iter()
                .rev()
                .find(|m| m["role"] == "assistant")
                .and_then(|m| m["content"].as_str())
                .map(str::to_owned)
                .ok_or_else(|| format!("`{key}` has no assistant message")),
            _ => Err(format!("`{key}` must be a string or a message list")),
        }
    }

    /// One preference pair from a parsed line.
    pub fn pair(&self, v: &Value) -> Result<Pair, String> {
        let prompt = v
            .get("prompt")
            .and_then(Value::as_str)
            .ok_or("expected {\"prompt\", \"chosen\", \"rejected\"} with a string prompt")?;
        let chosen = Self::response(v, "chosen")?;
        let rejected = Self::response(v, "rejected")?;
        let user = Message::new("user", prompt);
        let prompt_ids = self.chat(std::slice::from_ref(&user), true)?;
        let full =
            |answer: &str| self.chat(&[user.clone(), Message::new("assistant", answer)], false);
        let (chosen, rejected) = (full(&chosen)?, full(&rejected)?);
        for seq in [&chosen, &rejected] {
            if !seq.starts_with(&prompt_ids) || seq.len() <= prompt_ids.len() {
                return Err("the chat template does not render the answer after the prompt".into());
            }
        }
        Ok(Pair {
            prompt_len: prompt_ids.len(),
            chosen,
            rejected,
        })
    }
}

impl Encoder<'_> {
    /// One GRPO prompt from a parsed line: `prompt` a string (one user turn) or a message
    /// list, rendered with the generation prompt (without a chat template: the string's
    /// tokens, BOS included) — its ids and the text reward functions see.
    pub fn grpo_prompt(&self, v: &Value) -> Result<(Vec<u32>, String), String> {
        let messages = match v.get("prompt") {
            Some(Value::String(p)) if self.template.is_none() => {
                let ids = self.tokenizer.encode(p, true).map_err(|e| e.to_string())?;
                return Ok((ids, p.clone()));
            }
            Some(Value::String(p)) => vec![Message::new("user", p)],
            Some(list @ Value::Array(_)) => Self::messages(list)?,
            _ => return Err("expected {\"prompt\": a string or a message list, …}".into()),
        };
        let text = messages
            .last()
            .map(|m| m.content.clone())
            .unwrap_or_default();
        Ok((self.chat(&messages, true)?, text))
    }
}

/// Reads a jsonl file line by line through `parse`; empty lines are skipped, a bad one is
/// an error naming the file and line.
pub fn read_jsonl<T>(
    file: &Path,
    mut parse: impl FnMut(&Value) -> Result<T, String>,
) -> Result<Vec<T>, TrainError> {
    let bytes = std::fs::read(file).map_err(|e| TrainError::Io(file.to_path_buf(), e))?;
    let mut out = Vec::new();
    // Line by line, so bytes that are not UTF-8 are named with their line.
    for (i, line) in bytes.split(|&b| b == b'\n').enumerate() {
        let line = std::str::from_utf8(line).map_err(|e| {
            let at = e.valid_up_to() + 1;
            bad(file, i + 1, format!("not UTF-8 (byte {at} of the line)"))
        })?;
        if line.trim().is_empty() {
            continue;
        }
        let v: Value = serde_json::from_str(line).map_err(|e| bad(file, i + 1, e))?;
        out.push(parse(&v).map_err(|e| bad(file, i + 1, e))?);
    }
    if out.is_empty() {
        return Err(TrainError::Config(format!(
            "{} has no examples",
            file.display()
        )));
    }
    Ok(out)
}
