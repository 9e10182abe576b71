//! The LoRA training gate (`gates::TRAIN`, harness::parity::train): adapters, SFT loss,
//! gradients and AdamW against mlx-lm (oracles/gen_train.py) bit for bit, and mlx-lm's saved
//! adapters loaded by us, on tiny-llama-trained, tiny-gemma3 and tiny-gemma4. Planted: a
//! weight decay off by 10 % fails from the second step on, on each.

use harness::parity::gates::{Plant, Tweak, TRAIN};

const MODEL: &str = "tiny-llama-trained";

fn assert_passes(model: &str) {
    let r = TRAIN.run(model, None).unwrap();
    harness::announce(&r.summary());
    assert!(r.passed(), "{}", r.summary());
}

#[test]
fn lora_sft_steps_match_mlx_lm() {
    assert_passes(MODEL);
}

/// Gemma 3: gelu-tanh MLP, (1 + w) norms, sliding layers whose window (8) is shorter than
/// the batch (33 tokens), so the cache-less forward uses mlx-lm's windowed array mask there.
#[test]
fn lora_sft_steps_match_mlx_lm_on_gemma3() {
    assert_passes("tiny-gemma3");
}

/// Gemma 4 (small): KV-shared layers (their K/V borrowed from earlier layers, so adapters on
/// an earlier layer's k/v projections get gradients through later layers), the per-layer
/// input branch's linears, tied head.
#[test]
fn lora_sft_steps_match_mlx_lm_on_gemma4() {
    assert_passes("tiny-gemma4");
}

#[test]
fn planted_weight_decay_fails_the_gate() {
    for model in TRAIN.models {
        let r = TRAIN
            .run(model, Some(&Plant::Harness(Tweak::WeightDecay)))
            .unwrap();
        println!("{model}: planted weight decay caught: {}", r.summary());
        assert!(!r.passed(), "{model}");
    }
}
