//! The tokenizer (`tokenizer.json` via the tokenizers crate, with `tokenizer_config.json`'s
//! special tokens) and a streaming detokenizer that never emits half a UTF-8 character.

use std::path::{Path, PathBuf};

use serde_json::Value;

use super::{read_json, LoadError};

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
    /// `tokenizer_config.json` (chat template, special token strings), if present.
    pub config: Value,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    /// Every id that ends generation: tokenizer eos plus generation_config's eos ids.
    pub eos_token_ids: Vec<u32>,
}

/// A special-token entry is either a string or `{"content": "..."}`.
fn token_string(value: Option<&Value>) -> Option<String> {
    match value? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_owned),
        _ => None,
    }
}

impl Tokenizer {
    pub fn load(dir: &Path) -> Result<Self, LoadError> {
        let path = dir.join("tokenizer.json");
        let inner = tokenizers::Tokenizer::from_file(&path).map_err(|e| LoadError::Tokenizer {
            path: path.clone(),
            message: e.to_string(),
        })?;
        let config_path = dir.join("tokenizer_config.json");
        let config = if config_path.is_file() {
            read_json(&config_path)?
        } else {
            Value::Null
        };
        let bos_token = token_string(config.get("bos_token"));
        let eos_token = token_string(config.get("eos_token"));
        let mut eos_token_ids = Vec::new();
        if let Some(id) = eos_token.as_deref().and_then(|t| inner.token_to_id(t)) {
            eos_token_ids.push(id);
        }
        let generation = dir.join("generation_config.json");
        if generation.is_file() {
            let gen = read_json(&generation)?;
            let ids = match gen.get("eos_token_id") {
                Some(Value::Number(n)) => n.as_u64().into_iter().collect(),
                Some(Value::Array(a)) => a.iter().filter_map(Value::as_u64).collect(),
                _ => Vec::new(),
            };
            for id in ids {
                if !eos_token_ids.contains(&(id as u32)) {
                    eos_token_ids.push(id as u32);
                }
            }
        }
        Ok(Tokenizer {
            inner,
            path,
            config,
            bos_token,
            eos_token,
            eos_token_ids,
        })
    }

    fn error(&self, e: impl std::fmt::Display) -> LoadError {
        LoadError::Tokenizer {
            path: self.path.clone(),
            message: e.to_string(),
        }
    }

    /// Token ids of `text`; `add_special_tokens` applies the post-processor (e.g. bos).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, LoadError> {
        let enc = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| self.error(e))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids`, special tokens skipped (as mlx-lm's detokenizers do).
    pub fn decode(&self, ids: &[u32]) -> Result<String, LoadError> {
        self.inner.decode(ids, true).map_err(|e| self.error(e))
    }

    /// The vocabulary size, added tokens included (HF's `len(tokenizer)`).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn chat_template(&self) -> Option<&str> {
        self.config.get("chat_template").and_then(Value::as_str)
    }

    pub fn detokenizer(&self) -> StreamingDetokenizer<'_> {
        StreamingDetokenizer {
            tokenizer: self,
            ids: Vec::new(),
            prefix: 0,
            read: 0,
        }
    }
}

/// Turns a stream of ids into text pieces without ever emitting half a character.
///
/// Incremental decoding over a short window: `ids[prefix..read]` were already emitted and
/// give the decoder its left context (so decoders that strip a leading space at the start of
/// a sequence behave as they would mid-text); the new piece is
/// `decode(ids[prefix..]) − decode(ids[prefix..read])`, held back while it ends in U+FFFD
/// (a UTF-8 sequence split across byte-level tokens). Each push decodes only the window.
pub struct StreamingDetokenizer<'t> {
    tokenizer: &'t Tokenizer,
    ids: Vec<u32>,
    prefix: usize,
    read: usize,
}

impl StreamingDetokenizer<'_> {
    fn pending(&self) -> Result<String, LoadError> {
        let before = self.tokenizer.decode(&self.ids[self.prefix..self.read])?;
        let now = self.tokenizer.decode(&self.ids[self.prefix..])?;
        Ok(match now.strip_prefix(before.as_str()) {
            Some(new) => new.to_owned(),
            // The decoder rewrote its left context (rare); fall back to the long way.
            None => {
                let all_before = self.tokenizer.decode(&self.ids[..self.read])?;
                let all_now = self.tokenizer.decode(&self.ids)?;
                all_now
                    .get(all_before.len()..)
                    .unwrap_or_default()
                    .to_owned()
            }
        })
    }

    /// Adds one id; returns the newly completed text (possibly empty).
    pub fn push(&mut self, id: u32) -> Result<String, LoadError> {
        self.ids.push(id);
        let new = self.pending()?;
        if new.is_empty() || new.ends_with('\u{FFFD}') {
            return Ok(String::new());
        }
        self.prefix = self.read;
        self.read = self.ids.len();
        Ok(new)
    }

    /// Whatever is still held back (an incomplete character at the very end).
    pub fn finish(&mut self) -> Result<String, LoadError> {
        let rest = self.pending()?;
        self.prefix = self.read;
        self.read = self.ids.len();
        Ok(rest)
    }
}
