//! The streaming detokenizer vs mlx-lm's (`gates::DETOK` on the tiny model, `DETOK_REAL` on
//! the real tokenizers — byte-level BPE for Qwen3, Llama 3.x, DeepSeek V3 and gpt-oss,
//! SentencePiece for Gemma 3, Mistral and Llama 2; harness::parity::detok): every piece of text, as `mlx_lm.generate` prints it
//! and `mlx_lm.server` streams it. deepseek-v3's golden adds the byte-level ids of its
//! tokenizer.json as written for the texts its transformers encoding loses (spaces, tabs,
//! emoji): what a DeepSeek V3 model emits.

use harness::parity::gates::{Plant, Tweak, DETOK, DETOK_REAL};

#[test]
fn streamed_text_matches_mlx_lm() {
    for model in DETOK.models() {
        let r = DETOK.run(model, None).unwrap();
        harness::announce(&r.summary());
        assert!(r.passed(), "{model}: {}", r.summary());
    }
}

#[test]
fn streamed_text_matches_mlx_lm_on_real_tokenizers() {
    for fixture in DETOK_REAL.models() {
        let r = DETOK_REAL.run(fixture, None).unwrap();
        harness::announce(&r.summary());
        assert!(r.passed(), "{fixture}: {}", r.summary());
    }
}

/// Planted: a stream that swallows the first character of its first piece fails, on the
/// tiny model and on every real tokenizer.
#[test]
fn planted_lost_character_fails() {
    let plant = Plant::Harness(Tweak::LostCharacter);
    let r = DETOK.run(DETOK.models()[0], Some(&plant)).unwrap();
    println!("planted: {}", r.summary());
    assert!(!r.passed());
    for fixture in DETOK_REAL.models() {
        let r = DETOK_REAL.run(fixture, Some(&plant)).unwrap();
        println!("planted: {}", r.summary());
        assert!(!r.passed(), "{fixture}: {}", r.summary());
    }
}

/// Planted: the SentencePiece stream keeps the leading space mlx-lm trims (Mistral's and
/// Llama 2's decoders strip it; Gemma 3's keeps it, so there it changes nothing).
#[test]
fn planted_spm_leading_space_fails() {
    let plant = Plant::parse("spm-leading-space").unwrap();
    for fixture in ["mistral-v1", "mistral-v3", "llama2"] {
        let r = DETOK_REAL.run(fixture, Some(&plant)).unwrap();
        println!("planted: {}", r.summary());
        assert!(!r.passed(), "{fixture}: {}", r.summary());
    }
}
