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

/// A tokenizer serialized (as tokenizer.json is written).
macro_rules! serialized {
    ($t:expr) => {
        serde_json::to_value($t).unwrap()
    };
}

/// Every tokenizer.json we have — the fetched real ones and every tiny model's — loads
/// through the engine's one-pass loader (`engine::load::tokenizer::fast`) into the tokenizer
/// the tokenizers crate's own deserializer makes: the two serialize to the same JSON
/// (vocabulary, merges in rank order, flags, added tokens, pipeline), the decoder as written
/// is the file's, and the engine's BPE gives the crate's ids, pieces and offsets on every
/// text of [`texts`], with and without special tokens.
#[test]
fn the_one_pass_loader_builds_what_the_tokenizers_crate_builds() {
    let files = tokenizer_files();
    let (mut bpe, mut encoded) = (0, 0);
    for path in &files {
        let (fast, slow, file) = both_ways(path);
        assert!(
            serialized!(&fast) == serialized!(&slow),
            "{}: the one-pass loader differs",
            path.display()
        );
        assert_eq!(
            serialized!(&fast)["decoder"],
            file["decoder"],
            "{}",
            path.display()
        );
        if let Some(text) = first_encoding_difference(&fast, &slow) {
            panic!(
                "{}: the engine's BPE encodes {text:?} otherwise",
                path.display()
            );
        }
        encoded += texts(&slow).len();
        if matches!(
            fast.get_model(),
            engine::load::tokenizer::fast::Model::Bpe(_)
        ) {
            bpe += 1;
        }
    }
    harness::announce(&format!(
        "tokenizer.json one-pass load: {} files as the tokenizers crate loads them ({bpe} on \
         the engine's BPE), {encoded} texts encoded alike",
        files.len()
    ));
    assert!(bpe >= 10, "only {bpe} tokenizers ran on the engine's BPE");
}

/// Planted: the one-pass loader forgets the file's `byte_fallback`; Gemma 3's and Mistral's
/// tokenizers (which fall back to bytes) then differ from the crate's.
#[test]
fn planted_forgotten_byte_fallback_fails_the_one_pass_loader_gate() {
    let _on = engine::plant::on(engine::plant::Defect::FastTokenizerNoByteFallback).unwrap();
    for name in ["gemma3", "mistral-v3"] {
        let path = harness::fixtures::tokenizer(name).join("tokenizer.json");
        let (fast, slow, _) = both_ways(&path);
        assert!(
            serialized!(&fast) != serialized!(&slow),
            "{name}: the planted loader was not caught"
        );
    }
}

/// Planted: the engine's BPE merges the leftmost pair first whatever its rank; the ids
/// differ from the crate's on each real tokenizer tried.
#[test]
fn planted_merges_by_position_fail_the_one_pass_loader_gate() {
    let _on = engine::plant::on(engine::plant::Defect::FastBpeMergesByPosition).unwrap();
    for name in ["gemma3", "llama3.1", "qwen3"] {
        let path = harness::fixtures::tokenizer(name).join("tokenizer.json");
        let (fast, slow, _) = both_ways(&path);
        assert!(
            first_encoding_difference(&fast, &slow).is_some(),
            "{name}: the planted BPE was not caught"
        );
    }
}

/// Small files at the edges of the format load as the crate loads them, or fail where it
/// fails: a decoder written twice (the last counts), `version` or `added_tokens` null
/// (refused), a model without `type`, legacy "a b" merges. Merges whose right piece lacks
/// the continuing-subword prefix are refused with an error, with or without merge dropout
/// (the crate's build panics on them).
#[test]
fn edge_case_files_load_as_the_crate_loads_them_and_never_panic() {
    let file = |top: &str, model: &str| {
        format!(
            r###"{{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": null, "post_processor": null, {top}
            "model": {{"dropout": null, "unk_token": null, "end_of_word_suffix": null,
            "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": {{"a": 0, "b": 1, "ab": 2, "abab": 3, "##b": 4}}, {model}}}}}"###
        )
    };
    let pair =
        r#""type": "BPE", "continuing_subword_prefix": null, "merges": [["a", "b"], ["ab", "ab"]]"#;
    let loads_alike = |json: &str| {
        let fast = engine::load::tokenizer::fast::from_slice(json.as_bytes());
        let slow = serde_json::from_slice::<tokenizers::Tokenizer>(json.as_bytes());
        match (fast, slow) {
            (Ok((fast, decoder)), Ok(slow)) => {
                assert_eq!(serialized!(&fast), serialized!(&slow), "{json}");
                assert_eq!(first_encoding_difference(&fast, &slow), None, "{json}");
                let ids = fast.encode("abab ab b", false).unwrap().get_ids().to_vec();
                assert_eq!(
                    ids,
                    slow.encode("abab ab b", false).unwrap().get_ids(),
                    "{json}"
                );
                Some(decoder)
            }
            (Err(_), Err(_)) => None,
            (fast, slow) => panic!(
                "{json}: the engine {} and the crate {}",
                if fast.is_ok() { "loads it" } else { "fails" },
                if slow.is_ok() { "loads it" } else { "fails" }
            ),
        }
    };
    assert_eq!(
        loads_alike(&file(r#""decoder": null,"#, pair)),
        Some(serde_json::Value::Null)
    );
    let twice = r#""decoder": {"type": "Fuse"}, "decoder": null,"#;
    assert_eq!(
        loads_alike(&file(twice, pair)),
        Some(serde_json::Value::Null)
    );
    let untyped = r#""continuing_subword_prefix": null, "merges": [["a", "b"]]"#;
    assert!(loads_alike(&file(r#""decoder": null,"#, untyped)).is_some());
    let legacy = r#""type": "BPE", "continuing_subword_prefix": null, "merges": ["a b", "ab ab"]"#;
    assert!(loads_alike(&file(r#""decoder": null,"#, legacy)).is_some());
    for null in ["version", "added_tokens"] {
        let json = file(r#""decoder": null,"#, pair).replace(
            &format!(
                r#""{null}": {}"#,
                if null == "version" { r#""1.0""# } else { "[]" }
            ),
            &format!(r#""{null}": null"#),
        );
        assert_eq!(loads_alike(&json), None, "{null}: null");
    }
    // "##" longer than "b": only the engine is asked (the crate's build panics).
    for dropout in ["null", "0.5"] {
        let prefixed =
            r###""type": "BPE", "continuing_subword_prefix": "##", "merges": [["a", "b"]]"###;
        let json = file(r#""decoder": null,"#, prefixed)
            .replace(r#""dropout": null"#, &format!(r#""dropout": {dropout}"#));
        let err = engine::load::tokenizer::fast::from_slice(json.as_bytes()).err();
        let err = err.map(|e| e.to_string()).unwrap_or_default();
        assert!(
            err.contains("continuing-subword prefix"),
            "dropout {dropout}: {err:?}"
        );
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

/// `path` loaded by the one-pass loader and by the crate, and the file.
fn both_ways(
    path: &std::path::Path,
) -> (
    engine::load::tokenizer::fast::Inner,
    tokenizers::Tokenizer,
    serde_json::Value,
) {
    let bytes = std::fs::read(path).unwrap();
    let (fast, decoder) = engine::load::tokenizer::fast::from_slice(&bytes).unwrap();
    let slow: tokenizers::Tokenizer = serde_json::from_slice(&bytes).unwrap();
    let file: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(decoder, file["decoder"], "{}", path.display());
    (fast, slow, file)
}

/// The first of [`texts`] whose encoding (ids, pieces, offsets, with or without special
/// tokens) differs between the two tokenizers, or whose vocabulary size differs.
fn first_encoding_difference(
    fast: &engine::load::tokenizer::fast::Inner,
    slow: &tokenizers::Tokenizer,
) -> Option<String> {
    if engine::load::tokenizer::fast::vocab_size(fast) != slow.get_vocab_size(true) {
        return Some("(the vocabulary size)".into());
    }
    for text in texts(slow) {
        // With special tokens second: the same words then come from the engine's word cache.
        for special in [false, true] {
            let (a, b) = (
                fast.encode(text.as_str(), special).unwrap(),
                slow.encode(text.as_str(), special).unwrap(),
            );
            if a.get_ids() != b.get_ids()
                || a.get_tokens() != b.get_tokens()
                || a.get_offsets() != b.get_offsets()
            {
                return Some(text);
            }
        }
    }
    None
}

/// Texts to encode both ways: fixed ones (scripts, code, emoji, whitespace runs, digits,
/// long words, bytes no vocabulary has) and 40 of pieces drawn from the tokenizer's own
/// vocabulary and glued together, so that merges across piece boundaries are exercised.
fn texts(t: &tokenizers::Tokenizer) -> Vec<String> {
    let mut texts: Vec<String> = [
        "Hello world! How are you doing today?",
        "  leading spaces, trailing spaces   ",
        "Ünïcödé façade naïve café — “quotes” ‘single’ … ellipsis",
        "日本語のテキストと中文文本，还有한국어 텍스트.",
        "Здравствуйте, как дела? Ελληνικά κείμενα. עברית. العربية.",
        "fn main() {\n\tlet x = vec![1, 2, 3];\n    println!(\"{x:?}\");\n}\n",
        "emoji 🤗🚀👩‍👩‍👧‍👦 and flags 🇫🇷🇯🇵",
        "1234567890 3.14159 2026-12-07 0x1F 1e-9 1,000,000",
        "supercalifragilisticexpialidocious antidisestablishmentarianism",
        "\n\n\n\t\t  \r\n mixed\u{a0}whitespace\u{3000}runs",
        "<s> </s> <unk> <|endoftext|> <bos> <start_of_turn>user",
        "\u{1}\u{7f}\u{fffd} rare \u{10ffff} code points \u{e000}",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut pieces: Vec<String> = t.get_vocab(false).into_keys().collect();
    pieces.sort();
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    let mut next = || {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1);
        (state >> 33) as usize
    };
    for _ in 0..40 {
        let ids: Vec<u32> = (0..12)
            .map(|_| t.token_to_id(&pieces[next() % pieces.len()]).unwrap())
            .collect();
        texts.push(t.decode(&ids, true).unwrap());
    }
    texts
}
