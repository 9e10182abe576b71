//! The streaming detokenizer vs mlx-lm's (`gates::DETOK`, harness::parity::detok): every
//! piece of text, as `mlx_lm.generate` prints it and `mlx_lm.server` streams it.

use harness::parity::gates::{Plant, Tweak, DETOK};

#[test]
fn streamed_text_matches_mlx_lm() {
    for model in DETOK.models {
        let r = DETOK.run(model, None).unwrap();
        harness::announce(&r.summary());
        assert!(r.passed(), "{model}: {}", r.summary());
    }
}

/// Planted: a stream that swallows the first character of its first piece fails.
#[test]
fn planted_lost_character_fails() {
    let plant = Plant::Harness(Tweak::LostCharacter);
    let r = DETOK.run(DETOK.models[0], Some(&plant)).unwrap();
    println!("planted: {}", r.summary());
    assert!(!r.passed());
}
