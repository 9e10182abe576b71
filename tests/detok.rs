//! The streaming detokenizer vs mlx-lm's (harness::parity::detok): every piece of text, as
//! `mlx_lm.generate` prints it and `mlx_lm.server` streams it.

use harness::parity::detok::{run, MODELS};

#[test]
fn streamed_text_matches_mlx_lm() {
    for model in MODELS {
        let r = run(model, |_| {}).unwrap();
        harness::announce(&format!("detok {model}: {}", r.summary()));
        assert!(r.passed(), "{model}: {}", r.summary());
    }
}

/// Planted: a stream that swallows the first character of its first piece fails.
#[test]
fn planted_lost_character_fails() {
    let r = run(MODELS[0], |pieces| {
        if let Some(p) = pieces.iter_mut().find(|p| !p.is_empty()) {
            p.remove(0);
        }
    })
    .unwrap();
    println!("planted: {}", r.summary());
    assert!(!r.passed());
}
