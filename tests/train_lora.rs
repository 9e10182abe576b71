//! The LoRA training gate (harness::parity::train): adapters, SFT loss, gradients and AdamW
//! against mlx-lm (oracles/gen_train.py) bit for bit, and mlx-lm's saved adapters loaded by
//! us, on tiny-llama-trained, tiny-gemma3 and tiny-gemma4. Planted: a weight decay off by
//! 10 % fails from the second step on, on each.

use harness::parity::train::run;

const MODEL: &str = "tiny-llama-trained";

#[test]
fn lora_sft_steps_match_mlx_lm() {
    let r = run(MODEL, |_| {}).unwrap();
    harness::announce(&format!("train {MODEL}: {}", r.summary()));
    assert!(r.passed(), "{}", r.summary());
}

/// Gemma 3: gelu-tanh MLP, (1 + w) norms, sliding layers whose window (8) is shorter than
/// the batch (33 tokens), so the cache-less forward uses mlx-lm's windowed array mask there.
#[test]
fn lora_sft_steps_match_mlx_lm_on_gemma3() {
    let r = run("tiny-gemma3", |_| {}).unwrap();
    harness::announce(&format!("train tiny-gemma3: {}", r.summary()));
    assert!(r.passed(), "{}", r.summary());
}

/// Gemma 4 (small): KV-shared layers (their K/V borrowed from earlier layers, so adapters on
/// an earlier layer's k/v projections get gradients through later layers), the per-layer
/// input branch's linears, tied head.
#[test]
fn lora_sft_steps_match_mlx_lm_on_gemma4() {
    let r = run("tiny-gemma4", |_| {}).unwrap();
    harness::announce(&format!("train tiny-gemma4: {}", r.summary()));
    assert!(r.passed(), "{}", r.summary());
}

#[test]
fn planted_weight_decay_fails_the_gate() {
    for model in harness::parity::train::MODELS {
        let r = run(model, |opt| opt.weight_decay *= 1.1).unwrap();
        println!("{model}: planted weight decay caught: {}", r.summary());
        assert!(!r.passed(), "{model}");
    }
}
