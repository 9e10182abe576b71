//! llguidance's view of a tokenizer: each id's bytes in a token trie (EOS ids marked), a
//! parser factory over it, built once per tokenizer and vocabulary and kept.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::ParserFactory;

use crate::load::tokenizer::Tokenizer;

/// A tokenizer as llguidance sees it, with the factory that compiles grammars over it.
pub struct Env {
    pub factory: ParserFactory,
}

/// The trie plus our tokenizer for re-tokenizing text (llguidance's canonical tokenize).
struct Tok {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerEnv for Tok {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    /// `s` tokenized: its valid UTF-8 by the tokenizer, the bytes after that (a character
    /// cut short, as llguidance's forced bytes can end) by the trie's own byte tokens.
    /// A lossy conversion would turn them into U+FFFD, whose ids the grammar then refuses.
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        let valid = match std::str::from_utf8(s) {
            Ok(text) => text,
            Err(e) => std::str::from_utf8(&s[..e.valid_up_to()]).unwrap_or_default(),
        };
        let mut ids = match valid.is_empty() {
            true => Vec::new(),
            false => self.tokenizer.encode(valid, false).unwrap_or_default(),
        };
        ids.extend(self.trie.greedy_tokenize(&s[valid.len()..]));
        ids
    }

    fn tokenize_is_canonical(&self) -> bool {
        true
    }
}

fn factory(env: &TokEnv) -> Result<ParserFactory, String> {
    let mut f = ParserFactory::new_simple(env).map_err(|e| e.to_string())?;
    f.quiet();
    *f.limits_mut() = super::limits::current();
    Ok(f)
}

/// `tokenizer`'s env (made on first use, then shared): the ids of `tokenizer.json` (ids of
/// the model past them are never allowed), EOS the tokenizer's.
pub fn env_for(tokenizer: &Arc<Tokenizer>) -> Result<Arc<Env>, String> {
    type Key = (std::path::PathBuf, Vec<u32>);
    static ENVS: OnceLock<Mutex<HashMap<Key, Arc<Env>>>> = OnceLock::new();
    let path = tokenizer.json_path();
    let key = (path.to_owned(), tokenizer.eos_token_ids.clone());
    let mut envs = ENVS.get_or_init(Default::default).lock().unwrap();
    if let Some(env) = envs.get(&key) {
        return Ok(env.clone());
    }
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| e.to_string())?;
    let mut words =
        llguidance::token_bytes_from_tokenizer_json(&json).map_err(|e| e.to_string())?;
    let mut eos: Vec<u32> = (tokenizer.eos_token_ids.iter().copied())
        .filter(|&i| (i as usize) < words.len())
        .collect();
    if eos.is_empty() {
        // No EOS id: one past the vocabulary stands in (never a model's id, so a finished
        // grammar leaves no id allowed, which the mask reports).
        eos.push(words.len() as u32);
        words.push(Vec::new());
    }
    let info = TokRxInfo::new(words.len() as u32, eos[0]);
    let trie = TokTrie::from(&info, &words).with_eos_tokens(&eos);
    let tok: TokEnv = Arc::new(Tok {
        trie,
        tokenizer: tokenizer.clone(),
    });
    let env = Arc::new(Env {
        factory: factory(&tok)?,
    });
    envs.insert(key, env.clone());
    Ok(env)
}

/// A byte-level env with no model behind it, to check a grammar compiles.
pub(super) fn byte_env() -> &'static Env {
    static BYTES: OnceLock<Env> = OnceLock::new();
    BYTES.get_or_init(|| {
        let env: TokEnv = Arc::new(ApproximateTokEnv::single_byte());
        Env {
            factory: factory(&env).expect("llguidance's byte-level factory"),
        }
    })
}
