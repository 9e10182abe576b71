//! The built-in benchmark models: Llama-, Gemma 3-, Gemma 4- and Qwen3-MoE-layout checkpoints
//! with seeded random weights (bf16; the MoE model f32, see `Family::Qwen3Moe`), generated on
//! first use into `<cache>/mlx-engine/bench-models/<name>/` (never committed). A model is its
//! config.json; which tensors it holds, and their shapes, is the engine loader's to say
//! (`engine::model::expected_weights`). Both stacks load the very same directory, so they
//! run the same weights.

use std::collections::HashMap;
use std::path::PathBuf;

use mlx_rs::{random, Array, Dtype};
use serde_json::json;

/// Which architecture a benchmark model uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Llama,
    /// gemma3_text: sliding window 128 on 5 of every 6 layers (rotating caches).
    Gemma3,
    /// gemma4_text, small-checkpoint layout: sliding window 128 on 5 of every 6 layers,
    /// per-layer inputs, the last 4 layers sharing K/V, a 2× wider head on full attention.
    Gemma4,
    /// qwen3_moe: every layer a mixture of `MOE_EXPERTS` experts, top `MOE_TOP_K`, with
    /// `intermediate` as each expert's width. f32: MLX's CPU `gather_mm` (dense experts)
    /// runs float32 only, in mlx-lm as in the engine.
    Qwen3Moe,
    /// qwen3 (dense): q/k norms, tied embeddings; with `QWEN3_VOCAB_TINY`'s real vocabulary.
    Qwen3,
    /// qwen3_5 (dense), the hybrid: three of every four layers a gated delta net (a
    /// recurrent state, no KV cache), the fourth gated full attention with partial RoPE.
    Qwen35,
}

/// MoE bench layout: experts per layer and experts per token.
const MOE_EXPERTS: i32 = 8;
const MOE_TOP_K: i32 = 2;

/// Gemma 4 bench layout: per-layer input width and how many trailing layers share K/V.
const GEMMA4_PER_LAYER: i32 = 64;
const GEMMA4_SHARED: i32 = 4;

/// A benchmark model's shape.
#[derive(Debug, Clone, Copy)]
pub struct BenchModel {
    pub name: &'static str,
    pub family: Family,
    pub hidden: i32,
    pub layers: i32,
    pub heads: i32,
    pub kv_heads: i32,
    pub intermediate: i32,
    pub vocab: i32,
    pub seed: u64,
    /// config.json's max_position_embeddings (what `engine serve` admits).
    pub max_positions: i32,
}

/// The context every built-in bench model's config.json states (`long_context` lifts it).
pub const DEFAULT_POSITIONS: i32 = 4096;

pub const TINY: BenchModel = BenchModel {
    name: "tiny",
    family: Family::Llama,
    hidden: 256,
    layers: 4,
    heads: 4,
    kv_heads: 2,
    intermediate: 704,
    vocab: 4096,
    seed: 1234,
    max_positions: DEFAULT_POSITIONS,
};

/// ~55 M parameters.
pub const SMALL: BenchModel = BenchModel {
    name: "small",
    family: Family::Llama,
    hidden: 640,
    layers: 10,
    heads: 10,
    kv_heads: 5,
    intermediate: 1728,
    vocab: 8192,
    seed: 5678,
    max_positions: DEFAULT_POSITIONS,
};

/// ~7 M parameters, Gemma 3 layout: 12 layers, so 10 slide through a 128-token window.
pub const GEMMA_TINY: BenchModel = BenchModel {
    name: "gemma-tiny",
    family: Family::Gemma3,
    hidden: 256,
    layers: 12,
    heads: 4,
    kv_heads: 1,
    intermediate: 512,
    vocab: 4096,
    seed: 9012,
    max_positions: DEFAULT_POSITIONS,
};

/// ~8 M parameters, Gemma 4 layout (see `Family::Gemma4`).
pub const GEMMA4_TINY: BenchModel = BenchModel {
    name: "gemma4-tiny",
    family: Family::Gemma4,
    hidden: 256,
    layers: 12,
    heads: 4,
    kv_heads: 1,
    intermediate: 512,
    vocab: 4096,
    seed: 3456,
    max_positions: DEFAULT_POSITIONS,
};

/// ~10 M parameters, Qwen3-MoE layout: 8 experts, top-2 (see `Family::Qwen3Moe`).
pub const MOE_TINY: BenchModel = BenchModel {
    name: "moe-tiny",
    family: Family::Qwen3Moe,
    hidden: 256,
    layers: 4,
    heads: 4,
    kv_heads: 2,
    intermediate: 352,
    vocab: 4096,
    seed: 7890,
    max_positions: DEFAULT_POSITIONS,
};

/// ~42 M parameters, almost all of them the tied embedding: a small qwen3 (dense) with the
/// real Qwen3 vocabulary of 151 936 ids and the real Qwen3 tokenizer (the `qwen3` fixture,
/// 151 669 ids; the model's ids past them are never produced by the tokenizer), so a
/// constrained-decoding mask spans a real-size vocabulary (`harness bench --suite constrain`).
pub const QWEN3_VOCAB_TINY: BenchModel = BenchModel {
    name: "qwen3-vocab-tiny",
    family: Family::Qwen3,
    hidden: 256,
    layers: 4,
    heads: 4,
    kv_heads: 2,
    intermediate: 704,
    vocab: 151_936,
    seed: 2468,
    max_positions: DEFAULT_POSITIONS,
};

/// ~17 M parameters, nearly all of them the tied embedding: a 6-layer gemma3_text (one
/// window pattern: mlx-lm's gemma3_text takes its global mask from layer 6) of width 64 with
/// the real Gemma 3 vocabulary (262 208 rows) and the real Gemma 3 tokenizer (the `gemma3`
/// fixture, 33 MB of tokenizer.json), so what loading a server costs is what a
/// Gemma-3-sized tokenizer costs (`harness bench --suite ready`).
pub const GEMMA3_VOCAB_TINY: BenchModel = BenchModel {
    name: "gemma3-vocab-tiny",
    family: Family::Gemma3,
    hidden: 64,
    layers: 6,
    heads: 2,
    kv_heads: 1,
    intermediate: 128,
    vocab: 262_208,
    seed: 4680,
    max_positions: DEFAULT_POSITIONS,
};

/// ~33 M parameters, Qwen 3.5 layout (see `Family::Qwen35`): 8 layers, 6 of them gated
/// delta nets (4 key heads, 8 value heads of 64).
pub const QWEN3_5_TINY: BenchModel = BenchModel {
    name: "qwen3-5-tiny",
    family: Family::Qwen35,
    hidden: 512,
    layers: 8,
    heads: 8,
    kv_heads: 2,
    intermediate: 1408,
    vocab: 8192,
    seed: 3579,
    max_positions: DEFAULT_POSITIONS,
};

/// Names of the built-in bench models, for messages.
pub const NAMES: &str = "tiny, small, gemma-tiny, gemma4-tiny, moe-tiny, qwen3-vocab-tiny, \
                         gemma3-vocab-tiny, qwen3-5-tiny";

pub fn by_name(name: &str) -> Option<BenchModel> {
    [
        TINY,
        SMALL,
        GEMMA_TINY,
        GEMMA4_TINY,
        MOE_TINY,
        QWEN3_VOCAB_TINY,
        GEMMA3_VOCAB_TINY,
        QWEN3_5_TINY,
    ]
    .into_iter()
    .find(|m| m.name == name)
}

/// `ids` as the text `ensure_tokenizer`'s tokenizer encodes back to exactly them.
pub fn prompt_text(ids: &[u32]) -> String {
    ids.iter()
        .map(|i| format!("t{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

impl BenchModel {
    pub fn config(&self) -> serde_json::Value {
        match self.family {
            Family::Llama => self.llama_config(),
            Family::Gemma3 => self.gemma3_config(),
            Family::Gemma4 => self.gemma4_config(),
            Family::Qwen3Moe => self.qwen3_moe_config(),
            Family::Qwen3 => self.qwen3_config(),
            Family::Qwen35 => self.qwen3_5_config(),
        }
    }

    /// llama: untied, bf16.
    fn llama_config(&self) -> serde_json::Value {
        json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden,
            "num_hidden_layers": self.layers,
            "intermediate_size": self.intermediate,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "rms_norm_eps": 1e-5,
            "vocab_size": self.vocab,
            "max_position_embeddings": self.max_positions,
            "rope_theta": 10000.0,
            "tie_word_embeddings": false,
            "torch_dtype": "bfloat16",
            "bench_seed": self.seed,
        })
    }

    /// gemma3_text: sliding window 128 on 5 of every 6 layers.
    fn gemma3_config(&self) -> serde_json::Value {
        json!({
            "architectures": ["Gemma3ForCausalLM"],
            "model_type": "gemma3_text",
            "hidden_size": self.hidden,
            "num_hidden_layers": self.layers,
            "intermediate_size": self.intermediate,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.hidden / self.heads,
            "query_pre_attn_scalar": self.hidden / self.heads,
            "rms_norm_eps": 1e-6,
            "vocab_size": self.vocab,
            "sliding_window": 128,
            "sliding_window_pattern": 6,
            "max_position_embeddings": self.max_positions,
            "bench_seed": self.seed,
        })
    }

    /// gemma4_text, small-checkpoint layout (see `Family::Gemma4`).
    fn gemma4_config(&self) -> serde_json::Value {
        let types: Vec<&str> = (0..self.layers)
            .map(|i| match i % 6 {
                5 => "full_attention",
                _ => "sliding_attention",
            })
            .collect();
        json!({
            "architectures": ["Gemma4ForCausalLM"],
            "model_type": "gemma4_text",
            "hidden_size": self.hidden,
            "num_hidden_layers": self.layers,
            "intermediate_size": self.intermediate,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.hidden / self.heads,
            "global_head_dim": 2 * self.hidden / self.heads,
            "rms_norm_eps": 1e-6,
            "vocab_size": self.vocab,
            "vocab_size_per_layer_input": self.vocab,
            "hidden_size_per_layer_input": GEMMA4_PER_LAYER,
            "num_kv_shared_layers": GEMMA4_SHARED,
            "use_double_wide_mlp": true,
            "sliding_window": 128,
            "sliding_window_pattern": 6,
            "layer_types": types,
            "max_position_embeddings": self.max_positions,
            "final_logit_softcapping": 30.0,
            "tie_word_embeddings": true,
            "bench_seed": self.seed,
        })
    }

    /// qwen3_moe: every layer sparse, f32.
    fn qwen3_moe_config(&self) -> serde_json::Value {
        json!({
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "hidden_size": self.hidden,
            "num_hidden_layers": self.layers,
            "intermediate_size": self.intermediate,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.hidden / self.heads,
            "num_experts": MOE_EXPERTS,
            "num_experts_per_tok": MOE_TOP_K,
            "moe_intermediate_size": self.intermediate,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": true,
            "rms_norm_eps": 1e-6,
            "vocab_size": self.vocab,
            "max_position_embeddings": self.max_positions,
            "rope_theta": 1000000.0,
            "tie_word_embeddings": false,
            "torch_dtype": "float32",
            "bench_seed": self.seed,
        })
    }

    /// qwen3 (dense): tied, bf16.
    fn qwen3_config(&self) -> serde_json::Value {
        json!({
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "hidden_size": self.hidden,
            "num_hidden_layers": self.layers,
            "intermediate_size": self.intermediate,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.hidden / self.heads,
            "rms_norm_eps": 1e-6,
            "vocab_size": self.vocab,
            "max_position_embeddings": self.max_positions,
            "rope_theta": 1000000.0,
            "tie_word_embeddings": true,
            "torch_dtype": "bfloat16",
            "bench_seed": self.seed,
        })
    }

    /// qwen3_5 (see `Family::Qwen35`): three gated delta nets, then one gated full
    /// attention, in every four layers.
    fn qwen3_5_config(&self) -> serde_json::Value {
        let head_dim = self.hidden / self.heads;
        json!({
            "architectures": ["Qwen3_5ForConditionalGeneration"],
            "model_type": "qwen3_5",
            "hidden_size": self.hidden,
            "num_hidden_layers": self.layers,
            "intermediate_size": self.intermediate,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": head_dim,
            "linear_num_key_heads": self.kv_heads * 2,
            "linear_num_value_heads": self.heads,
            "linear_key_head_dim": head_dim,
            "linear_value_head_dim": head_dim,
            "linear_conv_kernel_dim": 4,
            "full_attention_interval": 4,
            "rms_norm_eps": 1e-6,
            "vocab_size": self.vocab,
            "max_position_embeddings": self.max_positions,
            "rope_parameters": {
                "rope_theta": 10000000.0,
                "partial_rotary_factor": 0.25,
                "type": "default",
            },
            "tie_word_embeddings": false,
            "torch_dtype": "bfloat16",
            "bench_seed": self.seed,
        })
    }

    /// (name, shape) of every weight, as the engine's loader takes them from a checkpoint
    /// of `config()` (`engine::model::expected_weights`), in its load order: the seed of
    /// weight i is seed + i.
    fn weight_shapes(&self) -> anyhow::Result<Vec<(String, Vec<i32>)>> {
        let path = self.dir().join("config.json");
        let config = engine::load::config::ModelConfig::from_value(path, self.config())?;
        Ok(engine::model::expected_weights(&config)?)
    }

    /// The mixed KV scheme the L2/L3 legs use (optiq's kv_config.json shape): the first
    /// layer at 8 bits, the rest at 4, group 64.
    fn ensure_kv_config(&self, dir: &std::path::Path) -> anyhow::Result<()> {
        let path = dir.join("kv_config.json");
        if path.is_file() {
            return Ok(());
        }
        let entries: Vec<serde_json::Value> = (0..self.layers)
            .map(|i| json!({"layer_idx": i, "bits": if i == 0 { 8 } else { 4 }, "group_size": 64}))
            .collect();
        let tmp = dir.join("kv_config.json.tmp");
        std::fs::write(&tmp, serde_json::to_string_pretty(&entries)?)?;
        std::fs::rename(&tmp, &path)?;
        Ok(())
    }

    pub fn parameter_count(&self) -> anyhow::Result<i64> {
        let shapes = self.weight_shapes()?;
        Ok(shapes
            .iter()
            .map(|(_, s)| s.iter().map(|&d| d as i64).product::<i64>())
            .sum())
    }

    pub fn dir(&self) -> PathBuf {
        let ctx = if self.max_positions == DEFAULT_POSITIONS {
            String::new()
        } else {
            format!("-ctx{}", self.max_positions)
        };
        crate::cache_dir()
            .join("bench-models")
            .join(format!("{}-seed{}{ctx}", self.name, self.seed))
    }

    /// The same model (same weights: same shapes and seed) with a config.json that admits
    /// `positions` tokens (at least 8192), in a directory of its own: the built-in ones
    /// state 4096, which `engine serve` enforces.
    pub fn long_context(self, positions: usize) -> BenchModel {
        // A power of two: prompts a little longer reuse the same directory.
        let positions = positions
            .max(DEFAULT_POSITIONS as usize + 1)
            .next_power_of_two();
        BenchModel {
            max_positions: positions as i32,
            ..self
        }
    }

    /// A word-level tokenizer over the whole vocabulary for the model in `dir` (id i is the
    /// word `t<i>`, words split on whitespace, no special tokens, no end-of-sequence), so a
    /// server can be sent exactly the bench's prompt ids as text (`prompt_text`) and every
    /// generated id streams as a text chunk. Written atomically, once.
    ///
    /// A model with a real tokenizer (`real_tokenizer`) gets that one instead.
    pub fn ensure_tokenizer(&self, dir: &std::path::Path) -> anyhow::Result<()> {
        let path = dir.join("tokenizer.json");
        if path.is_file() {
            return Ok(());
        }
        if let Some(name) = self.real_tokenizer() {
            return copy_fixture_tokenizer(name, dir);
        }
        let vocab: serde_json::Map<String, serde_json::Value> = (0..self.vocab)
            .map(|i| (format!("t{i}"), json!(i)))
            .collect();
        let tokenizer = json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": {"type": "WhitespaceSplit"},
            "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "t0"},
        });
        for (name, value) in [
            (
                "tokenizer_config.json",
                json!({"tokenizer_class": "PreTrainedTokenizerFast"}),
            ),
            ("tokenizer.json", tokenizer),
        ] {
            let tmp = dir.join(format!("{name}.tmp-{}", std::process::id()));
            std::fs::write(&tmp, serde_json::to_string(&value)?)?;
            std::fs::rename(&tmp, dir.join(name))?;
        }
        Ok(())
    }

    /// The tokenizer fixture (`harness::fixtures`) a bench model ships with, if it has a
    /// real tokenizer rather than `ensure_tokenizer`'s word-level one.
    pub fn real_tokenizer(&self) -> Option<&'static str> {
        match self.name {
            "qwen3-vocab-tiny" => Some("qwen3"),
            "gemma3-vocab-tiny" => Some("gemma3"),
            _ => None,
        }
    }

    /// The model dir, generated first if missing. Written to a temporary sibling and
    /// renamed, so an interrupted generation never leaves a half model behind. A model with
    /// a real tokenizer gets it copied in (from the fetched fixture).
    pub fn ensure(&self) -> anyhow::Result<PathBuf> {
        let dir = self.dir();
        if dir.join("model.safetensors").is_file() && dir.join("config.json").is_file() {
            self.ensure_kv_config(&dir)?;
            if self.real_tokenizer().is_some() {
                self.ensure_tokenizer(&dir)?;
            }
            return Ok(dir);
        }
        let tmp = dir.with_extension(format!("partial-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp)?;
        let mut weights: HashMap<String, Array> = HashMap::new();
        for (i, (name, shape)) in self.weight_shapes()?.into_iter().enumerate() {
            let w = if name.ends_with("layer_scalar") {
                mlx_rs::ops::ones::<f32>(&shape)?
            } else if name.ends_with("norm.weight") {
                // Gemma norms scale by (1 + w): zeros there are the same unit scale.
                if self.family == Family::Gemma3 {
                    mlx_rs::ops::zeros::<f32>(&shape)?
                } else {
                    mlx_rs::ops::ones::<f32>(&shape)?
                }
            } else {
                let key = random::key(self.seed + i as u64)?;
                random::normal::<f32>(&shape[..], None, 0.02, &key)?
            };
            let dtype = match self.family {
                Family::Qwen3Moe => Dtype::Float32,
                _ => Dtype::Bfloat16,
            };
            let w = w.as_dtype(dtype)?;
            w.eval()?;
            weights.insert(name, w);
        }
        let meta = HashMap::from([("format".to_owned(), "mlx".to_owned())]);
        Array::save_safetensors(weights.iter(), &meta, tmp.join("model.safetensors"))?;
        std::fs::write(
            tmp.join("config.json"),
            serde_json::to_string_pretty(&self.config())?,
        )?;
        if let Some(parent) = dir.parent() {
            std::fs::create_dir_all(parent)?;
        }
        self.ensure_kv_config(&tmp)?;
        if self.real_tokenizer().is_some() {
            self.ensure_tokenizer(&tmp)?;
        }
        match std::fs::rename(&tmp, &dir) {
            Ok(()) => Ok(dir),
            Err(_) if dir.join("model.safetensors").is_file() => {
                let _ = std::fs::remove_dir_all(&tmp);
                Ok(dir)
            }
            Err(e) => Err(e.into()),
        }
    }
}

/// Copies the fetched tokenizer fixture `name` (tokenizer.json, tokenizer_config.json)
/// into `dir`, each file written to a temporary name and renamed.
fn copy_fixture_tokenizer(name: &str, dir: &std::path::Path) -> anyhow::Result<()> {
    let src = crate::fixtures::tokenizer_dir(name)?;
    // tokenizer.json last: its presence is what marks the copy done.
    for file in ["tokenizer_config.json", "tokenizer.json"] {
        let tmp = dir.join(format!("{file}.tmp-{}", std::process::id()));
        std::fs::copy(src.join(file), &tmp)?;
        std::fs::rename(&tmp, dir.join(file))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_long_context_variant_keeps_the_weights_and_admits_the_prompt() {
        let long = TINY.long_context(16_384 + 128 + 16);
        assert_eq!(long.max_positions, 32_768);
        assert_eq!(long.config()["max_position_embeddings"], 32_768);
        assert_eq!(
            (long.seed, long.weight_shapes().unwrap()),
            (TINY.seed, TINY.weight_shapes().unwrap())
        );
        assert_ne!(long.dir(), TINY.dir());
        assert!(long.dir().ends_with("tiny-seed1234-ctx32768"));
        // Never the built-in directory, even for a short prompt.
        assert_eq!(TINY.long_context(100).max_positions, 8192);
        assert_eq!(
            TINY.dir(),
            crate::cache_dir().join("bench-models/tiny-seed1234")
        );
    }

    #[test]
    fn qwen3_vocab_tiny_has_the_real_vocabulary_and_tied_embeddings() {
        let m = by_name("qwen3-vocab-tiny").unwrap();
        assert_eq!(m.vocab, 151_936);
        assert_eq!(m.config()["model_type"], "qwen3");
        assert_eq!(m.config()["tie_word_embeddings"], true);
        let shapes = m.weight_shapes().unwrap();
        assert!(shapes.iter().all(|(n, _)| n != "lm_head.weight"));
        assert!(shapes
            .iter()
            .any(|(n, s)| n == "model.layers.0.self_attn.q_norm.weight" && s == &[64]));
        assert_eq!(m.real_tokenizer(), Some("qwen3"));
        assert_eq!(TINY.real_tokenizer(), None);
        // ~42 M parameters, 39 M of them the embedding.
        assert!((40_000_000..45_000_000).contains(&m.parameter_count().unwrap()));
    }

    /// The ready suite's model: the Gemma 3 vocabulary and tokenizer on 6 small layers, so
    /// the tokenizer is most of what a server loads (and gemma-tiny keeps its own).
    #[test]
    fn gemma3_vocab_tiny_has_the_gemma3_vocabulary_and_tokenizer() {
        let m = by_name("gemma3-vocab-tiny").unwrap();
        assert_eq!((m.vocab, m.real_tokenizer()), (262_208, Some("gemma3")));
        assert_eq!(m.config()["model_type"], "gemma3_text");
        assert_eq!(GEMMA_TINY.real_tokenizer(), None);
        // ~17 M parameters, 16.8 M of them the tied embedding.
        assert!((16_000_000..18_000_000).contains(&m.parameter_count().unwrap()));
    }

    /// The loader's order seeds the bench weights (weight i gets seed + i), so a change of
    /// the order a family takes its tensors in, or of their names or shapes, changes every
    /// bench model of it. Pinned here (FNV-1a of each `name:shape;` in order) to the lists
    /// the models were generated from when they were written by hand: if this fails on
    /// purpose, say in the commit that the bench weights change, and update the pin.
    #[test]
    fn bench_weights_keep_their_order() {
        fn fnv(list: &[(String, Vec<i32>)]) -> u64 {
            let text: String = list.iter().map(|(n, s)| format!("{n}:{s:?};")).collect();
            text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
                (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
            })
        }
        let pinned = [
            (TINY, 39, 0x9041_04c8_6584_a7cf),
            (SMALL, 93, 0xb094_7ff4_0c5f_0c15),
            (GEMMA_TINY, 158, 0x09f0_5c1f_9e14_eadc),
            (GEMMA4_TINY, 197, 0xf4f3_678c_72a3_3356),
            (MOE_TINY, 51, 0x1137_fd20_c9fc_5d23),
            (QWEN3_VOCAB_TINY, 46, 0x054d_0dc3_fefe_aa34),
            (QWEN3_5_TINY, 109, 0x0365_bb1b_f4ce_a37c),
        ];
        for (m, count, hash) in pinned {
            let shapes = m.weight_shapes().unwrap();
            assert_eq!((shapes.len(), fnv(&shapes)), (count, hash), "{}", m.name);
        }
    }

    #[test]
    fn the_word_level_tokenizer_round_trips_the_prompt_ids() {
        let dir = tempfile::tempdir().unwrap();
        TINY.ensure_tokenizer(dir.path()).unwrap();
        let tok = engine::load::tokenizer::Tokenizer::load(dir.path()).unwrap();
        let ids = crate::bench::prompt_ids(300, TINY.vocab, TINY.seed);
        let text = prompt_text(&ids);
        assert_eq!(tok.encode(&text, true).unwrap(), ids);
        assert_eq!(tok.vocab_size(), TINY.vocab as usize);
        assert_eq!(
            tok.decode(&ids[..3]).unwrap(),
            text.split(' ').take(3).collect::<Vec<_>>().join(" ")
        );
    }
}
