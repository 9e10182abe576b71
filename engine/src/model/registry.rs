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
    /// `engine serve --batch` may batch it: mlx-lm 0.32.2's `BatchGenerator`, the batch
    /// gate's reference, runs it and the lane matches it. Off for gemma2 (mlx-lm's batched
    /// mask does not broadcast against its softcapped grouped scores) and deepseek_v32 (a row
    /// joining a running batch differs from BatchGenerator by up to 7e-7 after the join, not
    /// explained yet): served one request at a time.
    pub batch: bool,
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
        batch: true,
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

fn ministral3(c: &ModelConfig, w: Weights) -> Result<Box<dyn LanguageModel>, LoadError> {
    Ok(Box::new(super::ministral3::load(c, w)?))
}

fn falcon_h1(c: &ModelConfig, w: Weights) -> Result<Box<dyn LanguageModel>, LoadError> {
    Ok(Box::new(super::falcon_h1::load(c, w)?))
}

fn deepseek_v3(c: &ModelConfig, w: Weights) -> Result<Box<dyn LanguageModel>, LoadError> {
    let variant = super::deepseek_v3::Variant::DeepseekV3;
    Ok(Box::new(super::deepseek_v3::load(c, w, variant)?))
}

fn glm4_moe(c: &ModelConfig, w: Weights) -> Result<Box<dyn LanguageModel>, LoadError> {
    Ok(Box::new(super::glm4_moe::load(c, w)?))
}

fn ernie4_5_moe(c: &ModelConfig, w: Weights) -> Result<Box<dyn LanguageModel>, LoadError> {
    Ok(Box::new(super::ernie4_5_moe::load(c, w)?))
}

fn minimax(c: &ModelConfig, w: Weights) -> Result<Box<dyn LanguageModel>, LoadError> {
    Ok(Box::new(super::minimax::load(c, w)?))
}

fn llama4_text(c: &ModelConfig, w: Weights) -> Result<Box<dyn LanguageModel>, LoadError> {
    Ok(Box::new(super::llama4_text::load(c, w)?))
}

fn phimoe(c: &ModelConfig, w: Weights) -> Result<Box<dyn LanguageModel>, LoadError> {
    Ok(Box::new(super::phimoe::load(c, w)?))
}

fn glm4_moe_lite(c: &ModelConfig, w: Weights) -> Result<Box<dyn LanguageModel>, LoadError> {
    let variant = super::deepseek_v3::Variant::Glm4MoeLite;
    Ok(Box::new(super::deepseek_v3::load(c, w, variant)?))
}

fn minicpm3(c: &ModelConfig, w: Weights) -> Result<Box<dyn LanguageModel>, LoadError> {
    Ok(Box::new(super::minicpm3::load(c, w)?))
}

fn deepseek_v32(c: &ModelConfig, w: Weights) -> Result<Box<dyn LanguageModel>, LoadError> {
    let variant = super::deepseek_v3::Variant::DeepseekV32;
    Ok(Box::new(super::deepseek_v3::load(c, w, variant)?))
}

fn llama4(c: &ModelConfig, w: Weights) -> Result<Box<dyn LanguageModel>, LoadError> {
    Ok(Box::new(super::llama4::load(c, w)?))
}

fn gpt_oss(c: &ModelConfig, w: Weights) -> Result<Box<dyn LanguageModel>, LoadError> {
    Ok(Box::new(super::gpt_oss::load(c, w)?))
}

/// `model_type` as mlx-lm's MODEL_REMAPPING sends it to `target`'s module: the same
/// builder and, since the same code runs, what is gated on `target`'s tiny models holds for
/// it (`REMAPPED` lists them; a test keeps each row equal to its target's).
const fn remapped(model_type: &'static str, target: Family) -> Family {
    Family {
        model_type,
        ..target
    }
}

/// The model_types mlx-lm 0.32.2 remaps onto another's module, with that module's
/// model_type (its MODEL_REMAPPING, for the families the engine loads).
pub const REMAPPED: [(&str, &str); 4] = [
    ("mistral", "llama"),
    ("kimi_k2", "deepseek_v3"),
    ("joyai_llm_flash", "deepseek_v3"),
    ("minimax_m2", "minimax"),
];

/// Whether model_types `a` and `b` run the same module: equal, or one remapped onto the
/// other (`REMAPPED`).
pub fn same_module(a: &str, b: &str) -> bool {
    a == b || REMAPPED.contains(&(a, b)) || REMAPPED.contains(&(b, a))
}

const LLAMA: Family = Family {
    compiled_decode: true,
    lora: true,
    segmented: true,
    convert: true,
    tensor: true,
    ..row("llama", llama)
};

// Multi-head latent attention (model/mla.rs). deepseek_v3: LoRA with mlx-lm's default keys
// (every nn.Linear of a block: the query and latent projections, o_proj, the MLPs, the
// stacked experts and the shared expert; never the `MultiLinear` embed_q / unembed_out nor
// the `MoEGate` router) gated against mlx-lm's trainer (tests/it/train_lora.rs); segmented
// backward against the whole-model one (engine/tests/it/train_families.rs); convert
// byte-identical to mlx_lm.convert (engine/tests/it/convert.rs); tensor parallel as mlx-lm
// 0.32.2's `Model.shard` (the query's last projection and o_proj split, embed_q /
// unembed_out cut by heads, the experts and shared expert narrowed in place, one sum per
// block) and pipeline parallel gated on 2 ranks against mlx-lm's sharded runs
// (harness/tests/it/l1_dist.rs).
const DEEPSEEK_V3: Family = Family {
    convert: true,
    lora: true,
    segmented: true,
    tensor: true,
    pipeline: true,
    ..row("deepseek_v3", deepseek_v3)
};

// Tensor parallel as its Model.shard (gated on tiny-minimax, a `minimax_m2` config:
// l1-dist/tp); mlx-lm 0.32.2 has no PipelineMixin for it.
const MINIMAX: Family = Family {
    convert: true,
    lora: true,
    segmented: true,
    tensor: true,
    ..row("minimax", minimax)
};

/// Every family, in the order the engine lists them.
pub static FAMILIES: &[Family] = &[
    LLAMA,
    remapped("mistral", LLAMA),
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
        convert: true,
        lora: true,
        segmented: true,
        ..row("gemma3", super::wrapper::build)
    },
    Family {
        convert: true,
        lora: true,
        segmented: true,
        ..row("gemma4", super::wrapper::build)
    },
    Family {
        convert: true,
        compiled_decode: true,
        lora: true,
        segmented: true,
        ..row("phi3", phi3)
    },
    Family {
        convert: true,
        lora: true,
        segmented: true,
        tensor: true,
        pipeline: true,
        ..row("qwen3_moe", qwen3_moe)
    },
    Family {
        convert: true,
        lora: true,
        segmented: true,
        ..row("mixtral", mixtral)
    },
    Family {
        convert: true,
        lora: true,
        segmented: true,
        ..row("qwen2_moe", qwen2_moe)
    },
    // LoRA with mlx-lm's default keys (sink attention, router, biased expert stacks) gated
    // against mlx-lm's trainer, segmented backward against the whole step.
    Family {
        convert: true,
        lora: true,
        segmented: true,
        tensor: true,
        ..row("gpt_oss", gpt_oss)
    },
    // LoRA gated against mlx-lm's trainer (its NoPE layer among the adapted ones), segmented
    // backward against the whole step, convert against mlx_lm.convert; mlx-lm 0.32.2's
    // smollm3 has no shard().
    Family {
        lora: true,
        segmented: true,
        convert: true,
        ..row("smollm3", smollm3)
    },
    // LoRA with mlx-lm's default keys gated against mlx-lm's trainer (tests/it/train_lora.rs),
    // segmented backward against the whole step (engine/tests/it/train_families.rs); tensor
    // and pipeline parallel as its Model.shard / PipelineMixin (harness/tests/it/l1_dist.rs,
    // l1-dist/tp and l1-dist/pp); convert not gated here.
    Family {
        convert: true,
        lora: true,
        segmented: true,
        tensor: true,
        pipeline: true,
        ..row("ministral3", ministral3)
    },
    // Multimodal checkpoints read for text (model/vl_text.rs): LoRA (adapters under
    // `language_model.`, as mlx-lm's wrapper names them) and segmented backward gated as
    // ministral3's.
    Family {
        convert: true,
        lora: true,
        segmented: true,
        ..row("mistral3", super::vl_text::build_mistral3)
    },
    Family {
        convert: true,
        lora: true,
        segmented: true,
        ..row("qwen3_vl", super::vl_text::build_qwen3_vl)
    },
    // LoRA with mlx-lm's default keys and segmented backward gated (tests/it/train_lora.rs,
    // engine/tests/it/train_families.rs), convert byte-identical; the rest of batch one L1
    // only. gemma2 is off the batch lane: mlx-lm's BatchGenerator raises on it.
    Family {
        lora: true,
        segmented: true,
        convert: true,
        batch: false,
        ..row("gemma2", gemma2)
    },
    Family {
        lora: true,
        segmented: true,
        convert: true,
        ..row("olmo2", olmo)
    },
    Family {
        convert: true,
        lora: true,
        segmented: true,
        ..row("olmo3", olmo)
    },
    Family {
        convert: true,
        lora: true,
        segmented: true,
        ..row("seed_oss", llama)
    },
    Family {
        convert: true,
        lora: true,
        segmented: true,
        ..row("exaone4", exaone4)
    },
    Family {
        convert: true,
        lora: true,
        segmented: true,
        ..row("hunyuan_v1_dense", hunyuan)
    },
    Family {
        convert: true,
        lora: true,
        segmented: true,
        ..row("minicpm", minicpm)
    },
    Family {
        convert: true,
        lora: true,
        segmented: true,
        ..row("cohere2", cohere2)
    },
    // Gemma 3n's text model (AltUp, Laurel, per-layer inputs, KV sharing): LoRA gated against
    // mlx-lm's trainer with every linear of a block but AltUp's coefficients (mlx-lm reads
    // their weights, so its default keys fail there; ours refuse them by name), segmented
    // backward against the whole step.
    Family {
        convert: true,
        lora: true,
        segmented: true,
        ..row("gemma3n", super::gemma3n::load)
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
    DEEPSEEK_V3,
    // Converting them is refused: mlx_lm.convert cannot load their tokenizers without the
    // checkpoint's remote code (transformers 5.12.1 has no config class for these
    // model_types), so there is no reference to gate against.
    Family {
        convert: false,
        ..remapped("kimi_k2", DEEPSEEK_V3)
    },
    Family {
        convert: false,
        ..remapped("joyai_llm_flash", DEEPSEEK_V3)
    },
    // Added since (oracles/make_moe2.py): LoRA gated against mlx-lm's trainer on the
    // families flagged (tests/it/train_lora.rs), segmented backward against the whole step
    // (engine/tests/it/train_moe2.rs); convert and the splits not flagged refused until gated.
    // Tensor and pipeline parallel as glm4_moe's Model.shard / PipelineMixin
    // (harness/tests/it/l1_dist.rs, l1-dist/tp and l1-dist/pp).
    Family {
        convert: true,
        lora: true,
        segmented: true,
        tensor: true,
        pipeline: true,
        ..row("glm4_moe", glm4_moe)
    },
    Family {
        convert: true,
        lora: true,
        segmented: true,
        ..row("ernie4_5_moe", ernie4_5_moe)
    },
    MINIMAX,
    remapped("minimax_m2", MINIMAX),
    Family {
        convert: true,
        lora: true,
        segmented: true,
        ..row("llama4_text", llama4_text)
    },
    Family {
        convert: true,
        lora: true,
        segmented: true,
        ..row("llama4", llama4)
    },
    Family {
        convert: true,
        lora: true,
        segmented: true,
        ..row("phimoe", phimoe)
    },
    // The MLA variants below split as deepseek_v3 does (the same code, as mlx-lm's copies
    // of its `Model.shard` and `PipelineMixin`), each gated on 2 ranks against mlx-lm's
    // sharded runs of its tiny model (harness/tests/it/l1_dist.rs, l1-dist/tp and
    // l1-dist/pp); LoRA and segmented backward gated as deepseek_v3's. glm4_moe_lite: its
    // shared expert optional, as mlx-lm's shard checks.
    Family {
        convert: true,
        lora: true,
        segmented: true,
        tensor: true,
        pipeline: true,
        ..row("glm4_moe_lite", glm4_moe_lite)
    },
    // deepseek_v32: the indexer (wq_b, wk, weights_proj, its norm) whole on every rank, as
    // mlx-lm's shard leaves it; only the MLA half splits.
    Family {
        convert: true,
        lora: true,
        segmented: true,
        batch: false,
        tensor: true,
        pipeline: true,
        ..row("deepseek_v32", deepseek_v32)
    },
    // Kimi K2.5's multimodal wrapper, loaded for text (its `text_config` is deepseek_v3's).
    // mlx-lm's wrapper delegates `shard` to deepseek_v3's and exposes the text model's
    // `model` (a `PipelineMixin`), so both splits are deepseek_v3's.
    Family {
        convert: true,
        lora: true,
        segmented: true,
        tensor: true,
        pipeline: true,
        ..row("kimi_k25", super::deepseek_v3::load_kimi_k25)
    },
    // MLA's projections without absorption (a standard per-head cache); mlx-lm does not
    // shard it.
    Family {
        convert: true,
        lora: true,
        segmented: true,
        ..row("minicpm3", minicpm3)
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

/// The `model_type`s mlx-lm 0.32.2 splits by tensor parallel (`Model.shard` in its
/// models/<type>.py, the type taken before `MODEL_REMAPPING` so that aliases count too) and
/// by pipeline parallel (`PipelineMixin`, which `sharded_load` looks for at `model.model`:
/// kimi_k25 too, its wrapper's `model` being the text model), restricted to the families it
/// has and the engine lists. A family runs a split here only where mlx-lm has it (the test
/// `parallel_modes_are_mlx_lm_s`); where mlx-lm has one the engine has not gated, the refusal
/// says so instead of blaming mlx-lm.
const MLX_LM_TENSOR: &[&str] = &[
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "gpt_oss",
    "qwen3_5",
    "qwen3_5_moe",
    "deepseek_v3",
    "kimi_k2",
    "joyai_llm_flash",
    "deepseek_v32",
    "kimi_k25",
    "glm4_moe",
    "glm4_moe_lite",
    "minimax",
    "minimax_m2",
    "ministral3",
];
const MLX_LM_PIPELINE: &[&str] = &[
    "qwen2",
    "qwen3_moe",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_next",
    "deepseek_v3",
    "kimi_k2",
    "joyai_llm_flash",
    "deepseek_v32",
    "kimi_k25",
    "glm4_moe",
    "glm4_moe_lite",
    "ministral3",
];

/// Whether mlx-lm 0.32.2 runs `model_type` under a parallel `mode`.
pub fn mlx_lm_splits(model_type: &str, mode: Mode) -> bool {
    match mode {
        Mode::Tensor => MLX_LM_TENSOR.contains(&model_type),
        Mode::Pipeline => MLX_LM_PIPELINE.contains(&model_type),
    }
}

/// The refusal for a family that does not run under `mode`: either mlx-lm 0.32.2 does not
/// shard it that way either, or it does and the engine's split is not gated yet.
pub fn parallel_refusal(model_type: &str, mode: Mode) -> LoadError {
    LoadError::Unsupported(refusal(model_type, parallel_capability(mode)))
}

fn parallel_capability(mode: Mode) -> Capability {
    match mode {
        Mode::Tensor => Capability::Tensor,
        Mode::Pipeline => Capability::Pipeline,
    }
}

/// What a family can do beyond generating, each a column of the registry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Capability {
    Lora,
    Segmented,
    Convert,
    Tensor,
    Pipeline,
}

impl Capability {
    pub const ALL: [Capability; 5] = [
        Capability::Lora,
        Capability::Segmented,
        Capability::Convert,
        Capability::Tensor,
        Capability::Pipeline,
    ];

    /// Whether family `f` has it.
    pub fn of(self, f: &Family) -> bool {
        match self {
            Capability::Lora => f.lora,
            Capability::Segmented => f.segmented,
            Capability::Convert => f.convert,
            Capability::Tensor => f.tensor,
            Capability::Pipeline => f.pipeline,
        }
    }

    /// Its column heading in docs/models.md.
    pub fn heading(self) -> &'static str {
        match self {
            Capability::Lora => "LoRA (`engine train`)",
            Capability::Segmented => "`--segment-size`",
            Capability::Convert => "`engine convert`",
            Capability::Tensor => "tensor parallel",
            Capability::Pipeline => "pipeline parallel",
        }
    }
}

/// The one text that refuses `capability` to a `model_type` lacking it: what is missing,
/// why, and which families have it.
pub fn refusal(model_type: &str, capability: Capability) -> String {
    let can = names(|f| capability.of(f));
    match capability {
        Capability::Lora => format!(
            "LoRA is not available for this `{model_type}` model yet (LoRA is available for \
             {can}; not yet for Gemma 4's mixture-of-experts block)"
        ),
        Capability::Segmented => {
            format!(
                "--segment-size is not available for model_type `{model_type}` yet ({can} have it)"
            )
        }
        Capability::Convert => {
            format!("engine convert does not support model_type `{model_type}` (supported: {can})")
        }
        Capability::Tensor | Capability::Pipeline => {
            let mode = if capability == Capability::Tensor {
                Mode::Tensor
            } else {
                Mode::Pipeline
            };
            parallel_text(model_type, mode, mlx_lm_splits(model_type, mode), &can)
        }
    }
}

fn parallel_text(model_type: &str, mode: Mode, mlx_lm_has: bool, can: &str) -> String {
    let why = if mlx_lm_has {
        "mlx-lm 0.32.2 shards it; the engine's split is not gated against it yet"
    } else {
        "mlx-lm 0.32.2 does not shard it that way either"
    };
    format!(
        "`{model_type}` cannot run {} parallel ({why}); families that can: {can}",
        mode.name()
    )
}

/// docs/models.md's model_type × capability table, rendered from the rows: "gated" where
/// the family has the capability, else "refused" (with "mlx-lm lacks it" for the parallel
/// splits mlx-lm 0.32.2 does not have). The refusals' texts follow the table in the docs.
pub fn capability_table() -> String {
    let mut out = String::from("| `model_type` |");
    for c in Capability::ALL {
        out.push_str(&format!(" {} |", c.heading()));
    }
    out.push_str("\n|---|");
    out.push_str(&"---|".repeat(Capability::ALL.len()));
    out.push('\n');
    for f in FAMILIES {
        out.push_str(&format!("| `{}` |", f.model_type));
        for c in Capability::ALL {
            let lacks = match c {
                Capability::Tensor => !mlx_lm_splits(f.model_type, Mode::Tensor),
                Capability::Pipeline => !mlx_lm_splits(f.model_type, Mode::Pipeline),
                _ => false,
            };
            let cell = match (c.of(f), lacks) {
                (true, _) => "gated",
                (false, true) => "refused (mlx-lm lacks it)",
                (false, false) => "refused (not gated yet)",
            };
            out.push_str(&format!(" {cell} |"));
        }
        out.push('\n');
    }
    out
}

/// The refusals' texts as docs/models.md quotes them, for a placeholder type (the parallel
/// ones in their two forms: mlx-lm lacks the split, or has it and the engine has not gated it).
pub fn refusal_texts() -> String {
    let t = "<model_type>";
    let load = family(t).err().map(|e| e.to_string()).unwrap_or_default();
    let mut lines = vec![format!("- loading: {load}")];
    for c in [Capability::Lora, Capability::Segmented, Capability::Convert] {
        lines.push(format!("- {}: {}", c.heading(), refusal(t, c)));
    }
    for (c, mode) in [
        (Capability::Tensor, Mode::Tensor),
        (Capability::Pipeline, Mode::Pipeline),
    ] {
        let can = names(|f| c.of(f));
        for mlx_lm_has in [false, true] {
            let text = parallel_text(t, mode, mlx_lm_has, &can);
            lines.push(format!("- {}: {text}", c.heading()));
        }
    }
    lines.join("\n") + "\n"
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every split the engine runs is one mlx-lm 0.32.2 has (so no family claims a split
    /// the reference cannot check), and the families it refuses get the true reason.
    /// A remapped model_type runs its target's code (the same builder), so its row claims
    /// what the target's does — convert aside where mlx_lm.convert has no reference.
    #[test]
    fn remapped_model_types_claim_what_their_targets_do() {
        let caps = |f: &Family| {
            (
                f.lora,
                f.segmented,
                f.tensor,
                f.pipeline,
                f.compiled_decode,
                f.batch,
            )
        };
        for (alias, target) in REMAPPED {
            let (a, t) = (family(alias).unwrap(), family(target).unwrap());
            assert_eq!(caps(a), caps(t), "{alias} vs {target}");
            assert_eq!(
                a.build as usize, t.build as usize,
                "{alias} builds as {target}"
            );
            let convert_refused = ["kimi_k2", "joyai_llm_flash"].contains(&alias);
            assert_eq!(a.convert, t.convert && !convert_refused, "{alias}: convert");
        }
        assert_ne!(
            caps(family("llama").unwrap()),
            caps(family("minimax").unwrap())
        );
    }

    #[test]
    fn parallel_modes_are_mlx_lm_s() {
        for f in FAMILIES {
            for m in [Mode::Tensor, Mode::Pipeline] {
                assert!(
                    !parallel(f, m) || mlx_lm_splits(f.model_type, m),
                    "{} runs {} parallel, which mlx-lm 0.32.2 does not have",
                    f.model_type,
                    m.name()
                );
            }
        }
        let says = parallel_refusal("lfm2", Mode::Tensor).to_string();
        assert!(says.contains("does not shard it that way either"), "{says}");
        let says = parallel_refusal("deepseek_v3", Mode::Pipeline).to_string();
        assert!(
            says.contains("mlx-lm 0.32.2 shards it; the engine's split is not gated"),
            "{says}"
        );
    }

    /// The table names every family once with a cell per capability, and a flipped flag
    /// shows in it (the docs test compares this rendering with docs/models.md).
    #[test]
    fn the_capability_table_follows_the_rows() {
        let table = capability_table();
        assert_eq!(table.lines().count(), FAMILIES.len() + 2);
        assert!(
            table.contains(
                "| `llama` | gated | gated | gated | gated | refused (mlx-lm lacks it) |"
            ),
            "{table}"
        );
        assert!(
            table.contains(
                "| `gpt_oss` | gated | gated | gated | gated | refused (mlx-lm lacks it) |"
            ),
            "{table}"
        );
        assert!(table.contains("| `lfm2` | gated | gated | gated | refused (mlx-lm lacks it) | refused (mlx-lm lacks it) |"), "{table}");
    }

    /// docs/models.md carries the table and the refusals as the rows render them
    /// (`ENGINE_WRITE_DOCS=1` rewrites that part of the page). It fails on any drift: a page
    /// with one cell changed is refused below.
    #[test]
    fn docs_models_md_carries_the_capability_table() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/models.md");
        let page = std::fs::read_to_string(&path).unwrap();
        let rendered = format!("{BEGIN}\n{}\n{}{END}", capability_table(), refusal_texts());
        let (Some(a), Some(b)) = (page.find(BEGIN), page.find(END)) else {
            panic!("docs/models.md lacks the markers {BEGIN} … {END}");
        };
        let current = &page[a..b + END.len()];
        if std::env::var_os("ENGINE_WRITE_DOCS").is_some() && current != rendered {
            std::fs::write(&path, page.replace(current, &rendered)).unwrap();
            return;
        }
        assert_eq!(
            current, rendered,
            "docs/models.md's capability table is stale: rerun with ENGINE_WRITE_DOCS=1"
        );
        let planted = current.replacen("| gated |", "| refused (not gated yet) |", 1);
        assert_ne!(planted, rendered, "a changed cell must show");
    }

    const BEGIN: &str = "<!-- capability table: rendered by engine::model::registry -->";
    const END: &str = "<!-- end of capability table -->";

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
            "llama, mistral, qwen2, qwen3, gemma3_text, gemma4_text, gemma3, gemma4, phi3, \
             qwen3_moe, mixtral, qwen2_moe, gpt_oss, smollm3, ministral3, mistral3, qwen3_vl, \
             gemma2, olmo2, olmo3, seed_oss, exaone4, hunyuan_v1_dense, minicpm, cohere2, \
             gemma3n, lfm2, lfm2_moe, qwen3_5, qwen3_5_moe, qwen3_next, mamba2, nemotron_h, \
             granitemoehybrid, falcon_h1, deepseek_v3, glm4_moe, ernie4_5_moe, minimax, \
             minimax_m2, llama4_text, llama4, phimoe, glm4_moe_lite, deepseek_v32, kimi_k25, \
             minicpm3"
        );
        let e = parallel_refusal("phi3", Mode::Pipeline).to_string();
        assert!(
            e.ends_with(
                "families that can: qwen2, qwen3_moe, ministral3, qwen3_5, qwen3_5_moe, \
                 qwen3_next, deepseek_v3, kimi_k2, joyai_llm_flash, glm4_moe, glm4_moe_lite, \
                 deepseek_v32, kimi_k25"
            ),
            "{e}"
        );
        let e = parallel_refusal("phi3", Mode::Tensor).to_string();
        assert!(
            e.ends_with(
                "families that can: llama, mistral, qwen2, qwen3, qwen3_moe, gpt_oss, ministral3, \
                 qwen3_5, qwen3_5_moe, deepseek_v3, kimi_k2, joyai_llm_flash, glm4_moe, minimax, \
                 minimax_m2, glm4_moe_lite, deepseek_v32, kimi_k25"
            ),
            "{e}"
        );
    }
}
