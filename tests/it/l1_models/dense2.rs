//! L1 plants on the dense families of Mistral 3 / Ministral 3 and Qwen3-VL's text model:
//! tiny-ministral3 (Llama 4's position-dependent query scale, yarn RoPE, sliding and full
//! layers); part of the `l1_models` binary.

use super::*;

/// Planted through the config: Llama 4's query scale switched off (β 0) — every case of
/// tiny-ministral3 fails at its prefill (its original max of 3 positions puts a scaled
/// position in even the shortest prompt).
#[test]
fn planted_query_scale_off_fails_l1_on_ministral3() {
    let plant = "rope_parameters.llama_4_scaling_beta=0.0";
    let report = l1("tiny-ministral3", Some(plant));
    assert_fails_at_prefill(&report, &format!("tiny-ministral3 with {plant}"));
}
