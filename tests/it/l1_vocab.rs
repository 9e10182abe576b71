//! L1 at real vocabulary sizes (`gates::L1_VOCAB`, harness::parity::vocab): tiny models
//! resized to the fetched real tokenizers (Qwen3 151 936 — also under the hybrids
//! tiny-qwen3-5 and tiny-qwen3-next —, Gemma 3 262 208, Llama 3.1 128 256, Mistral v3
//! 32 768 ids), against mlx-lm: tokenizer ids, chat template, full-vocabulary logits
//! bit-exact (by sha256), greedy ids.

use engine::plant::Defect;
use harness::parity::gates::{Plant, L1_VOCAB};

#[test]
fn real_vocabulary_models_match_mlx_lm() {
    for model in L1_VOCAB.models() {
        let r = L1_VOCAB.run(model, None).unwrap();
        harness::announce(&r.summary());
        assert!(r.passed(), "{model}: {}", r.summary());
    }
}

/// Planted: greedy decoding that only looks at the first 65 536 ids (invisible at the tiny
/// models' 1 024) fails at Qwen3's vocabulary, under Qwen3 and under the hybrids.
#[test]
fn planted_argmax_over_the_first_64k_ids_fails() {
    let plant = Plant::Engine(Defect::GreedyFirst64k);
    for model in ["vocab-qwen3", "vocab-qwen3-5", "vocab-qwen3-next"] {
        let r = L1_VOCAB.run(model, Some(&plant)).unwrap();
        println!("planted: {}", r.summary());
        assert!(!r.passed(), "{model}");
    }
}
