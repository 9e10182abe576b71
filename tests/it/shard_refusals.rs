//! Tensor parallel refusals, in one process (no ranks): the MoE families mlx-lm 0.32.2
//! does not shard, and quantized experts whose row split is not a whole number of groups,
//! are refused by name at load. The sharded families' bit-exactness against mlx-lm's own
//! sharded run is the distributed L1 gate (`harness/tests/it/l1_dist.rs`, two ranks).

use engine::dist::Mode;
use engine::model::shard::Part;
use harness::goldens::model_dir;

/// In one process: build `model` and shard it as rank 0 of 2; the refusal's text.
fn shard_error(model: &str) -> String {
    let dir = model_dir(model).unwrap();
    let config = engine::load::config::ModelConfig::read(&dir).unwrap();
    let weights = engine::load::weights::Weights::load(&dir).unwrap();
    let mut built = engine::model::build(&config, weights).unwrap();
    match engine::model::parallelize(built.as_mut(), Mode::Tensor, Part { rank: 0, size: 2 }) {
        Ok(()) => panic!("{model} sharded"),
        Err(e) => e.to_string(),
    }
}

/// mixtral and qwen2_moe: mlx-lm 0.32.2 has no `shard` for them; refused by name.
#[test]
fn unshardable_moe_families_are_refused() {
    for (model, ty) in [("tiny-mixtral", "mixtral"), ("tiny-qwen2-moe", "qwen2_moe")] {
        let e = shard_error(model);
        println!("{model}: {e}");
        assert!(
            e.contains(&format!("`{ty}` cannot run tensor parallel")),
            "{e}"
        );
    }
}

/// Quantized experts whose down projection's input (32) halves below the group size (32):
/// the scales do not split, refused naming the tensor (mlx-lm's split fails too).
#[test]
fn quantized_experts_that_do_not_split_are_refused() {
    for model in ["tiny-qwen3-moe-q4", "tiny-gpt-oss-mxfp4"] {
        let e = shard_error(model);
        println!("{model}: {e}");
        assert!(e.contains("does not split into 2 equal parts"), "{e}");
    }
}
