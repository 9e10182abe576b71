//! The one table of model families: for each `model_type` the engine loads, the function
//! that builds it and what it can do beyond generating (LoRA, segmented backward, `engine
//! convert`, tensor and pipeline parallel). Every list of family names the engine prints —
//! the load refusal, LoRA's, segmented training's, convert's, the distributed refusals — is
//! derived from this table; no other list of families is kept.
//!
//! The capabilities state what is gated: LoRA against mlx-lm's trainer, segmented backward
//! against the whole-model backward, convert against `mlx_lm.convert`, tensor and pipeline
//! parallel as mlx-lm 0.32.2 shards (`Model.shard`, `PipelineMixin.pipeline`) — a family
//! mlx-lm does not shard is refused, as mlx-lm refuses it.

use super::LanguageModel;
use crate::dist::Mode;
use crate::load::config::ModelConfig;
use crate::load::weights::Weights;
use crate::load::LoadError;

/// Builds a family's model from its parsed config and weights.
pub type Build = fn(&ModelConfig, Weights) -> Result<Box<dyn LanguageModel>, LoadError>;

/// One `model_type` and what the engine does with it.
pub struct Family {
    pub model_type: &'static str,
    pub build: Build,
    /// LoRA adapters attach to its linears (`engine train`).
    pub lora: bool,
    /// Its blocks run a few at a time (`--segment-size`).
    pub segmented: bool,
    /// `engine convert` lays it out as `mlx_lm.convert` does.
    pub convert: bool,
    /// Tensor parallel (`Model.shard` in mlx-lm 0.32.2).
    pub tensor: bool,
    /// Pipeline parallel (`PipelineMixin` in mlx-lm 0.32.2).
    pub pipeline: bool,
    /// Its bf16 models may decode through the compiled step (`generate::compiled`): measured
    /// bit-exact with eager over 300 steps on its tiny models (engine/tests/it/compiled_decode.rs).
    /// Off elsewhere: smollm3's and quantized qwen3_moe's compiled steps were measured to
    /// diverge (steps 71 and 240 of 300).
    pub compiled_decode: bool,
}

/// A family's row with every capability off; rows below switch theirs on.
const fn row(model_type: &'static str, build: Build) -> Family {
    Family {
        model_type,
        build,
        lora: false,
        segmented: false,
        convert: false,
        tensor: false,
        pipeline: false,
        compiled_decode: false,
    }
}

fn llama(c: &ModelConfig, w: Weights) -> Result<Box<dyn LanguageModel>, LoadError> {
    Ok(Box::new(super::llama::load(c, w)?))
}

fn gemma3_text(c: &ModelConfig, w: Weights) -> Result<Box<dyn LanguageModel>, LoadError> {
    Ok(Box::new(super::gemma::load(c, w)?))
}

fn gemma2(c: &ModelConfig, w: Weights) -> Result<Box<dyn LanguageModel>, LoadError> {
    Ok(Box::new(super::gemma2::load(c, w)?))
}

fn olmo(c: &ModelConfig, w: Weights) -> Result<Box<dyn LanguageModel>, LoadError> {
    Ok(Box::new(super::olmo::load(c, w)?))
}

fn exaone4(c: &ModelConfig, w: Weights) -> Result<Box<dyn LanguageModel>, LoadError> {
    Ok(Box::new(super::exaone4::load(c, w)?))
}

fn hunyuan(c: &ModelConfig, w: Weights) -> Result<Box<dyn LanguageModel>, LoadError> {
    Ok(Box::new(super::hunyuan::load(c, w)?))
}

fn minicpm(c: &ModelConfig, w: Weights) -> Result<Box<dyn LanguageModel>, LoadError> {
    Ok(Box::new(super::minicpm::load(c, w)?))
}

fn cohere2(c: &ModelConfig, w: Weights) -> Result<Box<dyn LanguageModel>, LoadError> {
    Ok(Box::new(super::cohere2::load(c, w)?))
}

fn gemma4_text(c: &ModelConfig, w: Weights) -> Result<Box<dyn LanguageModel>, LoadError> {
    Ok(Box::new(super::gemma4::load(c, w)?))
}

fn phi3(c: &ModelConfig, w: Weights) -> Result<Box<dyn LanguageModel>, LoadError> {
    Ok(Box::new(super::phi3::load(c, w)?))
}

fn qwen3_moe(c: &ModelConfig, w: Weights) -> Result<Box<dyn LanguageModel>, LoadError> {
    Ok(Box::new(super::qwen3_moe::load(c, w)?))
}

fn mixtral(c: &ModelConfig, w: Weights) -> Result<Box<dyn LanguageModel>, LoadError> {
    Ok(Box::new(super::mixtral::load(c, w)?))
}

fn qwen2_moe(c: &ModelConfig, w: Weights) -> Result<Box<dyn LanguageModel>, LoadError> {
    Ok(Box::new(super::qwen2_moe::load(c, w)?))
}

fn lfm2(c: &ModelConfig, w: Weights) -> Result<Box<dyn LanguageModel>, LoadError> {
    Ok(Box::new(super::lfm2::load(c, w)?))
}

fn qwen3_5(c: &ModelConfig, w: Weights) -> Result<Box<dyn LanguageModel>, LoadError> {
    Ok(Box::new(super::qwen3_5::load(c, w)?))
}

fn mamba2(c: &ModelConfig, w: Weights) -> Result<Box<dyn LanguageModel>, LoadError> {
    Ok(Box::new(super::mamba2::load(c, w)?))
}

fn nemotron_h(c: &ModelConfig, w: Weights) -> Result<Box<dyn LanguageModel>, LoadError> {
    Ok(Box::new(super::nemotron_h::load(c, w)?))
}

fn qwen3_next(c: &ModelConfig, w: Weights) -> Result<Box<dyn LanguageModel>, LoadError> {
    Ok(Box::new(super::qwen3_next::load(c, w)?))
}

fn granitemoehybrid(c: &ModelConfig, w: Weights) -> Result<Box<dyn LanguageModel>, LoadError> {
    Ok(Box::new(super::granitemoehybrid::load(c, w)?))
}

fn smollm3(c: &ModelConfig, w: Weights) -> Result<Box<dyn LanguageModel>, LoadError> {
    Ok(Box::new(super::smollm3::load(c, w)?))
}

fn falcon_h1(c: &ModelConfig, w: Weights) -> Result<Box<dyn LanguageModel>, LoadError> {
    Ok(Box::new(super::falcon_h1::load(c, w)?))
}

fn gpt_oss(c: &ModelConfig, w: Weights) -> Result<Box<dyn LanguageModel>, LoadError> {
    Ok(Box::new(super::gpt_oss::load(c, w)?))
}

/// Every family, in the order the engine lists them.
pub static FAMILIES: &[Family] = &[
    // mlx-lm maps `mistral` onto its llama module (MODEL_REMAPPING); so do we.
    Family {
        compiled_decode: true,
        lora: true,
        segmented: true,
        convert: true,
        tensor: true,
        ..row("llama", llama)
    },
    Family {
        compiled_decode: true,
        lora: true,
        segmented: true,
        convert: true,
        tensor: true,
        ..row("mistral", llama)
    },
    Family {
        lora: true,
        segmented: true,
        convert: true,
        tensor: true,
        pipeline: true,
        ..row("qwen2", llama)
    },
    Family {
        compiled_decode: true,
        lora: true,
        segmented: true,
        convert: true,
        tensor: true,
        ..row("qwen3", llama)
    },
    Family {
        lora: true,
        segmented: true,
        convert: true,
        ..row("gemma3_text", gemma3_text)
    },
    Family {
        lora: true,
        segmented: true,
        convert: true,
        ..row("gemma4_text", gemma4_text)
    },
    // The multimodal wrappers, loaded for text as mlx-lm loads them.
    Family {
        lora: true,
        segmented: true,
        ..row("gemma3", super::wrapper::build)
    },
    Family {
        lora: true,
        segmented: true,
        ..row("gemma4", super::wrapper::build)
    },
    Family {
        compiled_decode: true,
        lora: true,
        segmented: true,
        ..row("phi3", phi3)
    },
    Family {
        lora: true,
        segmented: true,
        tensor: true,
        pipeline: true,
        ..row("qwen3_moe", qwen3_moe)
    },
    Family {
        lora: true,
        segmented: true,
        ..row("mixtral", mixtral)
    },
    Family {
        lora: true,
        segmented: true,
        ..row("qwen2_moe", qwen2_moe)
    },
    Family {
        tensor: true,
        ..row("gpt_oss", gpt_oss)
    },
    // L1 only so far: LoRA (and so segmented training) is not gated against mlx-lm's trainer.
    row("smollm3", smollm3),
    // Batch one's dense families: LoRA with mlx-lm's default keys and segmented backward
    // gated (tests/it/train_lora.rs, engine/tests/it/train_families.rs); convert on gemma2
    // and olmo2 (engine/tests/it/convert.rs).
    Family {
        lora: true,
        segmented: true,
        convert: true,
        ..row("gemma2", gemma2)
    },
    Family {
        lora: true,
        segmented: true,
        convert: true,
        ..row("olmo2", olmo)
    },
    Family {
        lora: true,
        segmented: true,
        ..row("olmo3", olmo)
    },
    Family {
        lora: true,
        segmented: true,
        ..row("seed_oss", llama)
    },
    Family {
        lora: true,
        segmented: true,
        ..row("exaone4", exaone4)
    },
    Family {
        lora: true,
        segmented: true,
        ..row("hunyuan_v1_dense", hunyuan)
    },
    Family {
        lora: true,
        segmented: true,
        ..row("minicpm", minicpm)
    },
    Family {
        lora: true,
        segmented: true,
        ..row("cohere2", cohere2)
    },
    // The hybrids: LoRA with mlx-lm's default keys (every Linear and SwitchLinear of a block:
    // the recurrent mixers' projections, never their conv1d; nemotron_h's `E` blocks' expert
    // stacks, latent projections and shared expert, not their router) gated against mlx-lm's
    // trainer (tests/it/train_lora.rs, bit-exact on every one), segmented backward against
    // the whole-model one (engine/tests/it/segmented.rs, train_families.rs). Convert gated
    // against mlx_lm.convert (engine/tests/it/convert.rs) for every one of them (nemotron_h
    // with its `E` blocks too). Tensor and pipeline parallel where mlx-lm 0.32.2
    // has them (qwen3_5 and qwen3_5_moe both, qwen3_next pipeline only), gated against
    // mlx-lm's sharded runs (harness/tests/it/l1_dist.rs); mlx-lm shards none of the others.
    Family {
        lora: true,
        convert: true,
        segmented: true,
        ..row("lfm2", lfm2)
    },
    Family {
        lora: true,
        convert: true,
        segmented: true,
        ..row("lfm2_moe", lfm2)
    },
    Family {
        lora: true,
        convert: true,
        segmented: true,
        tensor: true,
        pipeline: true,
        ..row("qwen3_5", qwen3_5)
    },
    Family {
        lora: true,
        convert: true,
        segmented: true,
        tensor: true,
        pipeline: true,
        ..row("qwen3_5_moe", qwen3_5)
    },
    Family {
        lora: true,
        convert: true,
        segmented: true,
        pipeline: true,
        ..row("qwen3_next", qwen3_next)
    },
    Family {
        lora: true,
        convert: true,
        segmented: true,
        ..row("mamba2", mamba2)
    },
    Family {
        lora: true,
        convert: true,
        segmented: true,
        ..row("nemotron_h", nemotron_h)
    },
    Family {
        lora: true,
        convert: true,
        segmented: true,
        ..row("granitemoehybrid", granitemoehybrid)
    },
    // Its parallel Mamba-2 + attention layers take LoRA on both branches' projections and
    // the SwiGLU's (the µP multipliers already folded into the frozen weights, as mlx-lm's
    // sanitize folds them), gated like the hybrids above; mlx-lm does not shard it.
    Family {
        lora: true,
        convert: true,
        segmented: true,
        ..row("falcon_h1", falcon_h1)
    },
];

/// The row of `model_type`, or the refusal that lists the supported ones.
pub fn family(model_type: &str) -> Result<&'static Family, LoadError> {
    FAMILIES
        .iter()
        .find(|f| f.model_type == model_type)
        .ok_or_else(|| {
            LoadError::Unsupported(format!(
                "model_type `{model_type}` is not supported yet (supported: {})",
                names(|_| true)
            ))
        })
}

/// The families with a capability, comma-separated, in table order.
pub fn names(has: impl Fn(&Family) -> bool) -> String {
    FAMILIES
        .iter()
        .filter(|f| has(f))
        .map(|f| f.model_type)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Whether `model_type` has a capability (false for a type outside the table).
pub fn has(model_type: &str, capability: impl Fn(&Family) -> bool) -> bool {
    FAMILIES
        .iter()
        .any(|f| f.model_type == model_type && capability(f))
}

/// Whether a family runs under a parallel `mode`.
pub fn parallel(f: &Family, mode: Mode) -> bool {
    match mode {
        Mode::Tensor => f.tensor,
        Mode::Pipeline => f.pipeline,
    }
}

/// The refusal for a family that does not run under `mode`: mlx-lm 0.32.2 does not shard
/// it that way either (the engine runs every split mlx-lm has for its families; the test
/// `parallel_modes_are_mlx_lm_s` holds the table to mlx-lm's).
pub fn parallel_refusal(model_type: &str, mode: Mode) -> LoadError {
    LoadError::Unsupported(format!(
        "`{model_type}` cannot run {} parallel (mlx-lm 0.32.2 does not shard it that way \
         either); families that can: {}",
        mode.name(),
        names(|f| parallel(f, mode))
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The families mlx-lm 0.32.2 shards, by `model_type` after its `MODEL_REMAPPING`
    /// (mistral → llama): `Model.shard` in models/{llama, qwen2, qwen3, qwen3_moe, gpt_oss,
    /// qwen3_5}.py (qwen3_5_moe's `Model` subclasses qwen3_5's), `PipelineMixin` in
    /// models/{qwen2, qwen3_moe, qwen3_5, qwen3_next}.py. Of the other files that shard,
    /// none is a family of this table.
    const MLX_LM_SHARDS: [(&str, Mode); 13] = [
        ("llama", Mode::Tensor),
        ("mistral", Mode::Tensor),
        ("qwen2", Mode::Tensor),
        ("qwen3", Mode::Tensor),
        ("qwen3_moe", Mode::Tensor),
        ("gpt_oss", Mode::Tensor),
        ("qwen3_5", Mode::Tensor),
        ("qwen3_5_moe", Mode::Tensor),
        ("qwen2", Mode::Pipeline),
        ("qwen3_moe", Mode::Pipeline),
        ("qwen3_5", Mode::Pipeline),
        ("qwen3_5_moe", Mode::Pipeline),
        ("qwen3_next", Mode::Pipeline),
    ];

    /// Every family runs exactly the parallel modes mlx-lm 0.32.2 has for it: so the
    /// refusal's "does not shard it that way either" is true of every family it names.
    #[test]
    fn parallel_modes_are_mlx_lm_s() {
        let mlx_lm = |t: &str, m: Mode| MLX_LM_SHARDS.contains(&(t, m));
        for f in FAMILIES {
            for m in [Mode::Tensor, Mode::Pipeline] {
                assert_eq!(
                    parallel(f, m),
                    mlx_lm(f.model_type, m),
                    "{}: {} parallel here and in mlx-lm 0.32.2 differ",
                    f.model_type,
                    m.name()
                );
            }
        }
        let says = parallel_refusal("lfm2", Mode::Tensor).to_string();
        assert!(says.contains("does not shard it that way either"), "{says}");
    }

    #[test]
    fn every_model_type_has_one_row() {
        let mut seen = std::collections::BTreeSet::new();
        for f in FAMILIES {
            assert!(seen.insert(f.model_type), "{} twice", f.model_type);
        }
    }

    #[test]
    fn refusals_list_the_families_that_can() {
        let e = family("nope").err().unwrap().to_string();
        assert!(e.contains("`nope` is not supported yet"), "{e}");
        assert!(
            e.contains("llama, mistral, qwen2, qwen3, gemma3_text"),
            "{e}"
        );
        assert_eq!(
            names(|f| f.convert),
            "llama, mistral, qwen2, qwen3, gemma3_text, gemma4_text, gemma2, olmo2, lfm2, \
             lfm2_moe, qwen3_5, qwen3_5_moe, qwen3_next, mamba2, nemotron_h, granitemoehybrid, \
             falcon_h1"
        );
        let e = parallel_refusal("phi3", Mode::Pipeline).to_string();
        assert!(
            e.ends_with("families that can: qwen2, qwen3_moe, qwen3_5, qwen3_5_moe, qwen3_next"),
            "{e}"
        );
        let e = parallel_refusal("phi3", Mode::Tensor).to_string();
        assert!(
            e.ends_with(
                "families that can: llama, mistral, qwen2, qwen3, qwen3_moe, gpt_oss, qwen3_5, \
                 qwen3_5_moe"
            ),
            "{e}"
        );
    }
}
