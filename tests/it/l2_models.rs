//! L2 (`gates::L2`): the engine vs mlx-optiq 0.7.7 (goldens/l2/<model>, oracles/gen_l2.py):
//! optiq's mixed per-layer quantized KV from kv_config.json (plain caches, rotating caches
//! that wrap, Gemma 4 layers borrowing quantized K/V), converted after the first prefill
//! chunk as optiq converts, read through optiq's fused KV-tiled attention (two 512-position
//! tiles on the long prompt) — every logit vector bit-identical, greedy ids identical.
//! Planted defects prove the gate can fail. Run single-threaded: `bash scripts/test.sh`.

use harness::parity::gates::{Plant, L2};
use harness::parity::Report;

fn l2(name: &str, plant: Option<&str>) -> Box<dyn Report> {
    let plant = plant.map(|p| Plant::parse(p).unwrap());
    L2.run(name, plant.as_ref()).unwrap()
}

fn assert_bit_exact(name: &str) {
    let report = l2(name, None);
    harness::announce(&report.summary());
    assert!(
        report.passed(),
        "L2 {name} failed:\n{}",
        report.details().join("\n")
    );
}

#[test]
fn l2_tiny_llama_mixed_kv() {
    assert_bit_exact("tiny-llama-trained");
}

#[test]
fn l2_tiny_gemma3_quantized_rotating_caches() {
    assert_bit_exact("tiny-gemma3-kv");
}

#[test]
fn l2_tiny_gemma4_shared_quantized_kv() {
    assert_bit_exact("tiny-gemma4");
}

/// Planted defects: mlx-lm's quantized attention in place of optiq's fused kernel, and
/// converting too late (mlx-lm's CLI default start of 5000), must both break the gate.
#[test]
fn planted_l2_defects_fail() {
    let unfused = l2("tiny-llama-trained", Some("sdpa=mlx-lm"));
    assert!(!unfused.passed());
    let late = l2("tiny-gemma3-kv", Some("kv_start=5000"));
    assert!(!late.passed());
    for r in [unfused, late] {
        println!("planted L2 defect caught: {}", r.summary());
    }
}
