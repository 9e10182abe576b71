//! The tokenizer (`tokenizer.json` via the tokenizers crate, with `tokenizer_config.json`'s
//! special tokens); its streaming detokenizer is mlx-lm's (`tokenizer/detok.rs`). The chat
//! templates are read where transformers reads them, and the EOS ids as mlx-lm's `load`
//! gathers them.

pub mod bpe;
pub mod class;
pub mod detok;
pub mod fast;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::{read_json, LoadError};

pub struct Tokenizer {
    inner: fast::Inner,
    path: PathBuf,
    /// The class transformers builds it as (`class::resolve`).
    class: class::Class,
    /// `tokenizer_config.json` (chat template, special token strings), if present.
    pub config: Value,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    /// Every id that ends generation: tokenizer eos plus generation_config's eos ids (or,
    /// without those, config.json's).
    pub eos_token_ids: Vec<u32>,
    /// The chat templates by name ("default" is the one used), see `chat_templates`.
    templates: BTreeMap<String, String>,
    /// Which of mlx-lm's streaming detokenizers this tokenizer gets (from its decoder).
    detok_kind: detok::Kind,
    /// Whether transformers' decode cleans up spaces: `clean_up_tokenization_spaces`, which
    /// transformers 5 ignores for a BPE model (unless
    /// `clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output`).
    clean_up_spaces: bool,
    /// The detokenizers' lookup table, built on first use and shared by every stream.
    detok_table: std::sync::OnceLock<detok::Table>,
    /// `vocab_size`, counted on first use (the crate counts by copying the vocabulary).
    vocab_size: std::sync::OnceLock<usize>,
}

/// A special-token entry is either a string or `{"content": "..."}`.
fn token_string(value: Option<&Value>) -> Option<String> {
    match value? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_owned),
        _ => None,
    }
}

/// An `eos_token_id` entry: one id or a list (mlx-lm ignores a falsy one: 0 or empty).
fn eos_ids_of(value: Option<&Value>) -> Vec<u32> {
    let ids: Vec<u32> = match value {
        Some(Value::Number(n)) => n.as_u64().into_iter().map(|i| i as u32).collect(),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(Value::as_u64)
            .map(|i| i as u32)
            .collect(),
        _ => Vec::new(),
    };
    if ids == [0] {
        return Vec::new();
    }
    ids
}

/// The model's EOS ids as mlx-lm's `load_config` leaves them: generation_config.json's
/// `eos_token_id` when it has one, else config.json's.
fn model_eos_ids(dir: &Path) -> Result<Vec<u32>, LoadError> {
    let generation = dir.join("generation_config.json");
    if generation.is_file() {
        // mlx-lm passes over a generation_config.json that is not valid JSON.
        if let Ok(gen) = read_json(&generation) {
            let ids = eos_ids_of(gen.get("eos_token_id"));
            if !ids.is_empty() {
                return Ok(ids);
            }
        }
    }
    let config = dir.join("config.json");
    if !config.is_file() {
        return Ok(Vec::new());
    }
    Ok(eos_ids_of(read_json(&config)?.get("eos_token_id")))
}

/// tokenizer_config.json's JSON, or null where the model has none.
fn read_config(dir: &Path) -> Result<Value, LoadError> {
    let path = dir.join("tokenizer_config.json");
    match path.is_file() {
        true => read_json(&path),
        false => Ok(Value::Null),
    }
}

/// What a chat template needs of a model's tokenizer files — tokenizer_config.json (its
/// special tokens) and the chat templates — read as [`Tokenizer::load`] reads them, without
/// building the tokenizer from tokenizer.json.
pub struct TemplateFiles {
    /// tokenizer_config.json's JSON, or null.
    pub config: Value,
    /// The chat templates by name ("default" is the one `apply_chat_template` uses).
    pub templates: BTreeMap<String, String>,
}

impl TemplateFiles {
    pub fn read(dir: &Path) -> Result<Self, LoadError> {
        let config = read_config(dir)?;
        let templates = chat_templates(dir, &config)?;
        Ok(TemplateFiles { config, templates })
    }
}

/// The chat templates by name, read as transformers 5 reads them: `chat_template.jinja`
/// (the default) and `additional_chat_templates/*.jinja` (by file name) take priority over
/// tokenizer_config.json's `chat_template`, which is one template or a list of
/// `{"name", "template"}`.
fn chat_templates(dir: &Path, config: &Value) -> Result<BTreeMap<String, String>, LoadError> {
    let read = |path: &Path| {
        std::fs::read_to_string(path).map_err(|source| LoadError::Io {
            path: path.to_owned(),
            source,
        })
    };
    let mut templates = BTreeMap::new();
    let file = dir.join("chat_template.jinja");
    if file.is_file() {
        templates.insert("default".to_owned(), read(&file)?);
    }
    let extra = dir.join("additional_chat_templates");
    if extra.is_dir() {
        let entries = std::fs::read_dir(&extra).map_err(|source| LoadError::Io {
            path: extra.clone(),
            source,
        })?;
        for path in entries.filter_map(|e| e.ok().map(|e| e.path())) {
            if let Some(name) = path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_suffix(".jinja"))
            {
                templates.insert(name.to_owned(), read(&path)?);
            }
        }
    }
    if !templates.is_empty() {
        return Ok(templates);
    }
    match config.get("chat_template") {
        Some(Value::String(t)) => {
            templates.insert("default".to_owned(), t.clone());
        }
        Some(Value::Array(list)) => {
            for entry in list {
                let (Some(name), Some(t)) = (
                    entry.get("name").and_then(Value::as_str),
                    entry.get("template").and_then(Value::as_str),
                ) else {
                    return Err(LoadError::Template(format!(
                        "{}: a chat_template list entry needs a \"name\" and a \"template\"",
                        dir.join("tokenizer_config.json").display()
                    )));
                };
                templates.insert(name.to_owned(), t.to_owned());
            }
        }
        _ => {}
    }
    Ok(templates)
}

/// The class transformers 5.12.1 picks (`class::resolve`, from tokenizer_config.json and
/// the model's config.json).
fn tokenizer_class(dir: &Path, config: &Value) -> Result<class::Class, LoadError> {
    let model_config = dir.join("config.json");
    let model_config = if model_config.is_file() {
        read_json(&model_config)?
    } else {
        Value::Null
    };
    let class = class::resolve(config, &model_config);
    // Planted: the file is read as written whatever the class (no rebuild).
    if crate::plant::is(crate::plant::Defect::TokenizerClassIgnored) {
        return Ok(class::Class::AsIs {
            name: class.name().to_owned(),
        });
    }
    // Planted: every tokenizer is rebuilt as LlamaTokenizer, whatever its class.
    if crate::plant::is(crate::plant::Defect::TokenizerEveryClassLlama) {
        return Ok(class::Class::Llama {
            legacy: true,
            add_prefix_space: true,
        });
    }
    Ok(class)
}

/// Why a model dir without tokenizer.json cannot be loaded. A tokenizer that only
/// transformers' remote code builds (Kimi K2's tiktoken.model and tokenization_kimi.py,
/// which mlx-lm loads with `trust_remote_code`) is refused by name: the engine runs no code
/// from a model and reads tokenizers only from tokenizer.json.
fn no_tokenizer_json(dir: &Path, config: &Value) -> LoadError {
    let path = dir.join("tokenizer.json");
    let remote = class::auto_map(config).map(|m| match m {
        Value::Array(list) => list
            .iter()
            .filter_map(Value::as_str)
            .collect::<Vec<_>>()
            .join(", "),
        other => other.to_string(),
    });
    let tiktoken = ["tiktoken.model", "tekken.json", "tokenizer.model"]
        .into_iter()
        .find(|f| dir.join(f).is_file());
    let message = match (remote, tiktoken) {
        (Some(code), file) => format!(
            "no tokenizer.json: this model's tokenizer is built by its own Python code \
             ({code}{}), which mlx-lm runs with --trust-remote-code; this engine runs no \
             code from a model and reads tokenizers only from tokenizer.json. Save the \
             tokenizer as tokenizer.json (transformers' save_pretrained of a fast \
             tokenizer) to use it here",
            file.map_or(String::new(), |f| format!(" over {f}"))
        ),
        (None, Some(file)) => format!(
            "no tokenizer.json, only {file}: this engine reads tokenizers only from \
             tokenizer.json (convert it with transformers' save_pretrained)"
        ),
        (None, None) => "no tokenizer.json in the model dir".to_owned(),
    };
    LoadError::Tokenizer { path, message }
}

impl Tokenizer {
    pub fn load(dir: &Path) -> Result<Self, LoadError> {
        let path = dir.join("tokenizer.json");
        let config = read_config(dir)?;
        if !path.is_file() {
            return Err(no_tokenizer_json(dir, &config));
        }
        // One read, and one parse into the tokenizer: a Gemma 3 tokenizer.json is 33 MB,
        // and parsing it into a JSON tree first (then again from the text) took most of a
        // server's start. Only a class that rewrites the file parses the tree (issue 43).
        let bytes = std::fs::read(&path).map_err(|source| LoadError::Io {
            path: path.clone(),
            source,
        })?;
        let bad = |e: serde_json::Error| LoadError::Tokenizer {
            path: path.clone(),
            message: e.to_string(),
        };
        // mlx-lm picks its detokenizer by matching the decoder as written in the file.
        let class = tokenizer_class(dir, &config)?;
        let (inner, decoder): (fast::Inner, Value) = if class.rebuilds() {
            let mut file: Value = serde_json::from_slice(&bytes).map_err(bad)?;
            let decoder = file.get("decoder").cloned().unwrap_or(Value::Null);
            class.rebuild(&mut file);
            let rebuilt = serde_json::to_vec(&file).map_err(bad)?;
            (fast::from_slice(&rebuilt).map_err(bad)?.0, decoder)
        } else {
            fast::from_slice(&bytes).map_err(bad)?
        };
        let detok_kind = detok::Kind::of_decoder(&decoder);
        let flag = |key: &str| config.get(key).and_then(Value::as_bool).unwrap_or(false);
        // transformers 5 skips the clean-up for a BPE model unless told to anyway.
        let bpe = inner.get_model().is_bpe();
        let clean_up_spaces = flag("clean_up_tokenization_spaces")
            && (!bpe
                || flag("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"));
        let bos_token = token_string(config.get("bos_token"));
        let eos_token = token_string(config.get("eos_token"));
        let mut eos_token_ids = Vec::new();
        if let Some(id) = eos_token.as_deref().and_then(|t| inner.token_to_id(t)) {
            eos_token_ids.push(id);
        }
        for id in model_eos_ids(dir)? {
            if !eos_token_ids.contains(&id) {
                eos_token_ids.push(id);
            }
        }
        let templates = chat_templates(dir, &config)?;
        Ok(Tokenizer {
            inner,
            path,
            class,
            config,
            bos_token,
            eos_token,
            eos_token_ids,
            templates,
            detok_kind,
            clean_up_spaces,
            detok_table: std::sync::OnceLock::new(),
            vocab_size: std::sync::OnceLock::new(),
        })
    }

    fn error(&self, e: impl std::fmt::Display) -> LoadError {
        LoadError::Tokenizer {
            path: self.path.clone(),
            message: e.to_string(),
        }
    }

    /// Token ids of `text`, as transformers' `tokenizer(text, add_special_tokens=…)` gives
    /// them; `add_special_tokens` applies the post-processor (e.g. bos).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, LoadError> {
        // Planted: the post-processor is forgotten (no bos, no template tokens).
        let add_special_tokens =
            add_special_tokens && !crate::plant::is(crate::plant::Defect::EncodeSkipsPostProcessor);
        let enc = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| self.error(e))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids`, special tokens skipped.
    pub fn decode(&self, ids: &[u32]) -> Result<String, LoadError> {
        self.inner.decode(ids, true).map_err(|e| self.error(e))
    }

    /// Text of `ids` as transformers' `tokenizer.decode(ids)` gives it: special tokens
    /// kept, spaces cleaned up where the tokenizer asks for it.
    pub fn decode_with_special(&self, ids: &[u32]) -> Result<String, LoadError> {
        let text = self.inner.decode(ids, false).map_err(|e| self.error(e))?;
        Ok(if self.clean_up_spaces {
            clean_up_tokenization(&text)
        } else {
            text
        })
    }

    /// The token string of `id` (HF's `convert_ids_to_tokens`).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The class transformers 5.12.1 builds this tokenizer as, and so do we.
    pub fn class(&self) -> &class::Class {
        &self.class
    }

    /// The `tokenizer.json` this tokenizer was read from.
    pub fn json_path(&self) -> &Path {
        &self.path
    }

    pub fn detokenizer_kind(&self) -> detok::Kind {
        self.detok_kind
    }

    pub fn cleans_up_spaces(&self) -> bool {
        self.clean_up_spaces
    }

    pub fn detok_table(&self) -> &detok::Table {
        self.detok_table.get_or_init(|| detok::Table::build(self))
    }

    /// The vocabulary size, added tokens included (HF's `len(tokenizer)`; `fast::vocab_size`).
    pub fn vocab_size(&self) -> usize {
        *self
            .vocab_size
            .get_or_init(|| fast::vocab_size(&self.inner))
    }

    /// Builds the detokenizers' table on a thread of its own, while the caller goes on to
    /// load the model (a first stream that comes sooner waits for it): on a 262 k vocabulary
    /// it is ~0.1 s of a server's ready time (issue 43).
    pub fn prepare_in_background(self: &std::sync::Arc<Self>) {
        let tokenizer = self.clone();
        std::thread::spawn(move || {
            tokenizer.detok_table();
        });
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The chat template `apply_chat_template` uses without a name: the only one, or the
    /// one named "default".
    pub fn chat_template(&self) -> Option<&str> {
        self.templates.get("default").map(String::as_str)
    }

    /// The chat template named `name` ("default", "tool_use", …), if the model ships it.
    pub fn chat_template_named(&self, name: &str) -> Option<&str> {
        self.templates.get(name).map(String::as_str)
    }

    /// The names of every chat template the model ships.
    pub fn chat_template_names(&self) -> impl Iterator<Item = &str> {
        self.templates.keys().map(String::as_str)
    }

    /// A streaming detokenizer: the pieces of text mlx-lm streams for the same ids.
    pub fn detokenizer(&self) -> detok::StreamingDetokenizer<'_> {
        detok::StreamingDetokenizer::new(self)
    }
}

/// transformers' `clean_up_tokenization`: spaces before punctuation and contractions.
fn clean_up_tokenization(text: &str) -> String {
    [
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ]
    .iter()
    .fold(text.to_owned(), |t, (from, to)| t.replace(from, to))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load_error(files: &[(&str, &str)]) -> String {
        let dir = tempfile::tempdir().unwrap();
        for (name, text) in files {
            std::fs::write(dir.path().join(name), text).unwrap();
        }
        match Tokenizer::load(dir.path()) {
            Ok(_) => panic!("loaded a dir without tokenizer.json"),
            Err(e) => e.to_string(),
        }
    }

    /// Kimi K2's tokenizer (tiktoken.model read by its tokenization_kimi.py, which mlx-lm
    /// runs with --trust-remote-code) is refused, naming why and what works.
    #[test]
    fn a_remote_code_tokenizer_is_refused_by_name() {
        let config = r#"{"tokenizer_class": "TikTokenTokenizer",
            "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", null]}}"#;
        let text = load_error(&[
            ("tokenizer_config.json", config),
            ("tiktoken.model", "IQ== 0\n"),
            ("tokenization_kimi.py", "# remote code\n"),
        ]);
        for part in [
            "no tokenizer.json",
            "(tokenization_kimi.TikTokenTokenizer over tiktoken.model)",
            "mlx-lm runs with --trust-remote-code",
            "this engine runs no code from a model",
            "Save the tokenizer as tokenizer.json",
        ] {
            assert!(text.contains(part), "{part:?} not in {text}");
        }
        let text = load_error(&[("tokenizer.model", "")]);
        assert!(
            text.contains("no tokenizer.json, only tokenizer.model"),
            "{text}"
        );
        assert!(load_error(&[]).contains("no tokenizer.json in the model dir"));
    }
}
