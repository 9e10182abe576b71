//! Tokenization vs transformers on the real tokenizers (`gates::TOKENIZE`,
//! harness::parity::tokenize): for each fetched tokenizer (scripts/fetch_fixtures.sh; a
//! missing one fails with that command), ≥ 300 texts — scripts and languages, code, emoji,
//! whitespace runs, special-token strings inside text, long words, leading spaces, digit
//! runs, tabs, byte fallback — give the same ids with and without special tokens, and decode
//! to the same text. Llama 2's and DeepSeek V3's (no config.json) are the tokenizers
//! transformers rebuilds as LlamaTokenizer; deepseek-v3-model is DeepSeek V3's beside a
//! config.json with `model_type: deepseek_v3`, which transformers reads as written;
//! deepseek-v3-qwen2 the same beside `model_type: qwen2`, rebuilt as Qwen2Tokenizer.

use harness::parity::gates::{Plant, TOKENIZE};
use harness::parity::tokenize::TokenizeReport;

#[test]
fn ids_and_text_match_transformers() {
    for fixture in TOKENIZE.models() {
        let r = TOKENIZE.run(fixture, None).unwrap();
        harness::announce(&r.summary());
        assert!(r.passed(), "{fixture}: {}", r.summary());
        let r: TokenizeReport = r.downcast().unwrap();
        assert!(r.cases >= 300, "{fixture}: only {} texts", r.cases);
    }
}

/// Planted: `encode` forgets the post-processor, so Llama 3.1's `<|begin_of_text|>` (and
/// the other tokenizers' bos) is missing with special tokens on.
#[test]
fn planted_missing_post_processor_fails() {
    let plant = Plant::parse("no-post-processor").unwrap();
    for fixture in ["llama3.1", "gemma3", "mistral-v3", "llama2"] {
        let r = TOKENIZE.run(fixture, Some(&plant)).unwrap();
        println!("planted: {}", r.summary());
        assert!(!r.passed(), "{fixture}: {}", r.summary());
    }
}

/// Planted: tokenizer.json is read as written where transformers rebuilds it from
/// `tokenizer_class` (LlamaTokenizer): Llama 2's leading spaces (its file prepends `▁` to
/// every text, Metaspace `always` does not prepend a second) and DeepSeek V3's byte-level
/// pieces (its file's own pre-tokenizer and ByteLevel, not Metaspace and byte fallback)
/// differ; so do DeepSeek V3's digit runs in a qwen2 model dir, which transformers rebuilds
/// as Qwen2Tokenizer (one digit a piece).
#[test]
fn planted_tokenizer_class_ignored_fails() {
    let plant = Plant::parse("tokenizer-class-ignored").unwrap();
    for fixture in ["llama2", "deepseek-v3", "deepseek-v3-qwen2"] {
        let r = TOKENIZE.run(fixture, Some(&plant)).unwrap();
        println!("planted: {}", r.summary());
        assert!(!r.passed(), "{fixture}: {}", r.summary());
    }
}

/// Planted: every tokenizer is rebuilt as LlamaTokenizer, whatever its class: gpt-oss's
/// PreTrainedTokenizerFast (and DeepSeek V3's, in a model dir whose config.json says
/// deepseek_v3, where transformers reads the file as written) lose their pre-tokenizers.
#[test]
fn planted_every_class_llama_fails() {
    let plant = Plant::parse("every-class-llama").unwrap();
    for fixture in ["gpt-oss", "deepseek-v3-model", "qwen3"] {
        let r = TOKENIZE.run(fixture, Some(&plant)).unwrap();
        println!("planted: {}", r.summary());
        assert!(!r.passed(), "{fixture}: {}", r.summary());
    }
}
