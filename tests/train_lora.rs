//! The LoRA training gate (harness::parity::train): adapters, SFT loss, gradients and AdamW
//! against mlx-lm (oracles/gen_train.py) bit for bit, and mlx-lm's saved adapters loaded by
//! us. Planted: a weight decay off by 10 % fails from the second step on.

use harness::parity::train::run;

const MODEL: &str = "tiny-llama-trained";

#[test]
fn lora_sft_steps_match_mlx_lm() {
    let r = run(MODEL, |_| {}).unwrap();
    harness::announce(&format!("train {MODEL}: {}", r.summary()));
    assert!(r.passed(), "{}", r.summary());
}

#[test]
fn planted_weight_decay_fails_the_gate() {
    let r = run(MODEL, |opt| opt.weight_decay *= 1.1).unwrap();
    println!("planted weight decay caught: {}", r.summary());
    assert!(!r.passed());
}
