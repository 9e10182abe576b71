//! Tokenization vs transformers on the real tokenizers (`gates::TOKENIZE`,
//! harness::parity::tokenize): for each fetched tokenizer (scripts/fetch_fixtures.sh; a
//! missing one fails with that command), ≥ 300 texts — scripts and languages, code, emoji,
//! whitespace runs, special-token strings inside text, long words — give the same ids with
//! and without special tokens, and decode to the same text.

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
    for fixture in ["llama3.1", "gemma3", "mistral-v3"] {
        let r = TOKENIZE.run(fixture, Some(&plant)).unwrap();
        println!("planted: {}", r.summary());
        assert!(!r.passed(), "{fixture}: {}", r.summary());
    }
}
