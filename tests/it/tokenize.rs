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

/// Every tokenizer.json we have — the fetched real ones and every tiny model's — loads
/// through the engine's one-pass loader (`engine::load::tokenizer::fast`) into the tokenizer
/// the tokenizers crate's own deserializer makes: the two serialize to the same JSON
/// (vocabulary, merges in rank order, flags, added tokens, pipeline), and the decoder as
/// written is the file's.
#[test]
fn the_one_pass_loader_builds_what_the_tokenizers_crate_builds() {
    let files = tokenizer_files();
    let mut bpe = 0;
    for path in &files {
        let (fast, slow, file) = both_ways(path);
        assert!(
            fast == slow,
            "{}: the one-pass loader differs",
            path.display()
        );
        assert_eq!(fast["decoder"], file["decoder"], "{}", path.display());
        bpe += usize::from(file["model"]["type"] == "BPE");
    }
    harness::announce(&format!(
        "tokenizer.json one-pass load: {} files as the tokenizers crate loads them ({bpe} BPE)",
        files.len()
    ));
    assert!(bpe >= 10, "only {bpe} BPE tokenizers were compared");
}

/// Planted: the one-pass loader forgets the file's `byte_fallback`; Gemma 3's and Mistral's
/// tokenizers (which fall back to bytes) then differ from the crate's.
#[test]
fn planted_forgotten_byte_fallback_fails_the_one_pass_loader_gate() {
    let _on = engine::plant::on(engine::plant::Defect::FastTokenizerNoByteFallback).unwrap();
    for name in ["gemma3", "mistral-v3"] {
        let path = harness::fixtures::tokenizer(name).join("tokenizer.json");
        let (fast, slow, _) = both_ways(&path);
        assert!(fast != slow, "{name}: the planted loader was not caught");
    }
}

/// The fetched tokenizers' files and every tiny model's.
fn tokenizer_files() -> Vec<std::path::PathBuf> {
    let mut files: Vec<_> = harness::fixtures::TOKENIZERS
        .iter()
        .map(|name| harness::fixtures::tokenizer(name).join("tokenizer.json"))
        .collect();
    let models = harness::goldens::goldens_root().join("models");
    for entry in std::fs::read_dir(&models).unwrap() {
        let file = entry.unwrap().path().join("tokenizer.json");
        if file.is_file() {
            files.push(file);
        }
    }
    files
}

/// `path` loaded by the one-pass loader and by the crate, each serialized, and the file.
fn both_ways(path: &std::path::Path) -> (serde_json::Value, serde_json::Value, serde_json::Value) {
    let bytes = std::fs::read(path).unwrap();
    let (fast, decoder) = engine::load::tokenizer::fast::from_slice(&bytes).unwrap();
    let slow: tokenizers::Tokenizer = serde_json::from_slice(&bytes).unwrap();
    let file: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(decoder, file["decoder"], "{}", path.display());
    let json = |t: &tokenizers::Tokenizer| serde_json::to_value(t).unwrap();
    (json(&fast), json(&slow), file)
}
