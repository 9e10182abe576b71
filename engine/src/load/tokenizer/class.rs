//! The tokenizer class transformers 5.12.1's `AutoTokenizer` picks for a model dir, as
//! mlx-lm 0.32.2's `load` calls it (no `trust_remote_code`), and what that class rebuilds of
//! `tokenizer.json` (docs/tokenizers.md has the list and what each changes in ids).
//!
//! transformers 5 reads `tokenizer.json` as written only for `TokenizersBackend` (what
//! `PreTrainedTokenizerFast` now names) and for classes without their own constructor.
//! A class with its own constructor takes only the vocabulary and merges (and the
//! post-processor, padding and truncation) from the file and builds the rest itself. Of
//! those, `LlamaTokenizer` (`LlamaTokenizerFast` is an alias), `Qwen2Tokenizer` and
//! `Qwen3_5Tokenizer` are ported here; the other classes are read as written (the docs page
//! says which and what we know of each).

use serde_json::{json, Value};

/// What the loader does with `tokenizer.json`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Class {
    /// Read as written: transformers' `TokenizersBackend`, or a class whose rebuild is not
    /// ported (`name`, as transformers spells it).
    AsIs { name: String },
    /// transformers' `LlamaTokenizer`: the file's BPE vocabulary and merges with
    /// `fuse_unk` and `byte_fallback` on and no unk token, no normalizer, a `Metaspace`
    /// pre-tokenizer (prepend scheme from `add_prefix_space` and `legacy`) and the
    /// SentencePiece decoders.
    Llama {
        legacy: bool,
        add_prefix_space: bool,
    },
    /// transformers' `Qwen2Tokenizer` and `Qwen3_5Tokenizer` (`name`): the file's BPE
    /// vocabulary and merges with no unk token and empty affixes, NFC, the class's split
    /// regex (one digit a piece) then ByteLevel without its regex, the ByteLevel decoder.
    Qwen {
        name: &'static str,
        add_prefix_space: bool,
    },
}

/// Qwen2Tokenizer's pre-tokenizer regex (transformers 5.12.1).
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen3_5Tokenizer's: Qwen2's with combining marks (`\p{M}`) kept in words.
const QWEN3_5_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The class names transformers treats as "read the file as written" when a model type's
/// registered class and the hub's `tokenizer_class` disagree.
const BACKENDS: [&str; 4] = [
    "TokenizersBackend",
    "PythonBackend",
    "PreTrainedTokenizerFast",
    "MistralCommonBackend",
];

/// transformers 5.12.1's `TOKENIZER_MAPPING_NAMES` for the model types mlx-lm 0.32.2 loads
/// (its model files and `MODEL_REMAPPING`'s keys) that have a registered class: the class
/// `AutoTokenizer` registers for config.json's `model_type`. A model type not listed has
/// none (llama, gpt_oss, kimi_k2, gemma4, …).
#[rustfmt::skip]
const REGISTERED: &[(&str, &str)] = &[
    ("cohere", "CohereTokenizer"), ("cohere2", "CohereTokenizer"), ("dbrx", "GPT2Tokenizer"),
    ("deepseek_v2", "TokenizersBackend"), ("deepseek_v3", "TokenizersBackend"),
    ("deepseek_v32", "TokenizersBackend"), ("falcon_mamba", "GPTNeoXTokenizer"),
    ("gemma", "GemmaTokenizer"), ("gemma2", "GemmaTokenizer"), ("gemma3", "GemmaTokenizer"),
    ("gemma3_text", "GemmaTokenizer"), ("gemma3n", "GemmaTokenizer"), ("glm", "TokenizersBackend"),
    ("glm4", "TokenizersBackend"), ("glm4_moe", "TokenizersBackend"),
    ("glm4_moe_lite", "TokenizersBackend"), ("gpt2", "GPT2Tokenizer"),
    ("gpt_bigcode", "GPT2Tokenizer"), ("gpt_neox", "GPTNeoXTokenizer"), ("gptj", "GPT2Tokenizer"),
    ("granite", "TokenizersBackend"), ("granitemoe", "TokenizersBackend"),
    ("granitemoehybrid", "TokenizersBackend"), ("internlm2", "TokenizersBackend"),
    ("jamba", "TokenizersBackend"), ("llava", "TokenizersBackend"), ("mamba", "GPTNeoXTokenizer"),
    ("mamba2", "GPTNeoXTokenizer"), ("minimax_m2", "TokenizersBackend"),
    ("ministral3", "TokenizersBackend"), ("mistral", "TokenizersBackend"),
    ("mistral3", "TokenizersBackend"), ("mixtral", "TokenizersBackend"),
    ("nemotron", "TokenizersBackend"), ("olmo", "GPTNeoXTokenizer"), ("olmo2", "GPTNeoXTokenizer"),
    ("olmo3", "TokenizersBackend"), ("olmo_hybrid", "TokenizersBackend"),
    ("olmoe", "GPTNeoXTokenizer"), ("phi", "GPT2Tokenizer"), ("phi3", "TokenizersBackend"),
    ("phimoe", "TokenizersBackend"), ("pixtral", "TokenizersBackend"), ("qwen2", "Qwen2Tokenizer"),
    ("qwen2_5_vl", "Qwen2Tokenizer"), ("qwen2_moe", "Qwen2Tokenizer"),
    ("qwen2_vl", "Qwen2Tokenizer"), ("qwen3", "Qwen2Tokenizer"), ("qwen3_5", "Qwen3_5Tokenizer"),
    ("qwen3_5_moe", "Qwen3_5Tokenizer"), ("qwen3_moe", "Qwen2Tokenizer"),
    ("qwen3_next", "Qwen2Tokenizer"), ("qwen3_vl", "Qwen2Tokenizer"),
    ("qwen3_vl_moe", "Qwen2Tokenizer"), ("recurrent_gemma", "GemmaTokenizer"),
    ("stablelm", "GPTNeoXTokenizer"), ("starcoder2", "GPT2Tokenizer"),
    ("step3p5", "TokenizersBackend"),
];

/// transformers 5.12.1's `MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS`: model types whose
/// hub `tokenizer_class` it overrides with the registered class.
#[rustfmt::skip]
const INCORRECT_HUB_CLASS: &[&str] = &[
    "arctic", "chameleon", "chatlm", "cohere_asr", "deepseek_ocr", "deepseek_ocr2", "deepseek_v2",
    "deepseek_v3", "deepseek_v32", "deepseek_v4", "deepseek_vl", "deepseek_vl_hybrid",
    "deepseek_vl_v2", "fuyu", "h2ovl_chat", "hyperclovax_vlm", "internlm2", "jamba", "janus",
    "llava", "llava_next", "minicpmv", "minimax_m2", "modernbert", "molmo", "molmo2", "nemotron",
    "nvfp4", "opencua", "openvla", "phi3", "phi3_v", "phimoe", "qwen2", "step3_vl", "step3p5",
    "vipllava",
];

fn strip_fast(name: &str) -> &str {
    name.strip_suffix("Fast").unwrap_or(name)
}

/// `tokenizer_config.json`'s `auto_map` for AutoTokenizer (a list, or a dict's entry).
pub fn auto_map(tokenizer_config: &Value) -> Option<&Value> {
    match tokenizer_config.get("auto_map")? {
        v @ Value::Array(_) => Some(v),
        Value::Object(o) => o.get("AutoTokenizer").filter(|v| !v.is_null()),
        _ => None,
    }
}

/// The class transformers instantiates for `name`: LlamaTokenizer, Qwen2Tokenizer and
/// Qwen3_5Tokenizer are ported, every other name is read as written.
fn named(name: &str, tokenizer_config: &Value) -> Class {
    let qwen = |name| Class::Qwen {
        name,
        add_prefix_space: tokenizer_config
            .get("add_prefix_space")
            .and_then(Value::as_bool)
            .unwrap_or(false),
    };
    match strip_fast(name) {
        "Qwen2Tokenizer" => qwen("Qwen2Tokenizer"),
        "Qwen3_5Tokenizer" => qwen("Qwen3_5Tokenizer"),
        "LlamaTokenizer" => Class::Llama {
            legacy: tokenizer_config
                .get("legacy")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            add_prefix_space: tokenizer_config
                .get("add_prefix_space")
                .and_then(Value::as_bool)
                .unwrap_or(true),
        },
        "PreTrainedTokenizer" | "TokenizersBackend" | "PythonBackend" => Class::AsIs {
            name: "TokenizersBackend".to_owned(),
        },
        other => Class::AsIs {
            name: other.to_owned(),
        },
    }
}

/// The class `AutoTokenizer.from_pretrained` picks from `tokenizer_config.json` and the
/// model's `config.json` (`Value::Null` when there is none), as transformers 5.12.1 does
/// without `trust_remote_code`: a model type whose registered class differs from the hub's
/// `tokenizer_class` reads the file as written when the registered class is a backend, else
/// uses the registered class for the model types transformers distrusts and the hub's for
/// the others; otherwise the hub's class, else the registered one.
pub fn resolve(tokenizer_config: &Value, model_config: &Value) -> Class {
    let hub = tokenizer_config
        .get("tokenizer_class")
        .or_else(|| model_config.get("tokenizer_class"))
        .and_then(Value::as_str);
    let model_type = model_config.get("model_type").and_then(Value::as_str);
    let registered = model_type
        .and_then(|t| REGISTERED.iter().find(|(k, _)| *k == t))
        .map(|(_, c)| *c);
    let distrusted = model_type.is_some_and(|t| INCORRECT_HUB_CLASS.contains(&t));
    // Remote code is not run (mlx-lm's default): an `auto_map` skips the model-type check,
    // then the hub's class is used.
    let remote = auto_map(tokenizer_config).is_some();
    match (hub, registered) {
        (Some(hub), Some(reg)) if !remote && strip_fast(reg) != strip_fast(hub) => {
            if BACKENDS.contains(&strip_fast(reg)) {
                return Class::AsIs {
                    name: "TokenizersBackend".to_owned(),
                };
            }
            named(if distrusted { reg } else { hub }, tokenizer_config)
        }
        (Some(hub), _) => named(hub, tokenizer_config),
        (None, Some(reg)) => named(reg, tokenizer_config),
        (None, None) => Class::AsIs {
            name: "TokenizersBackend".to_owned(),
        },
    }
}

impl Class {
    /// transformers' name of the class.
    pub fn name(&self) -> &str {
        match self {
            Class::AsIs { name } => name,
            Class::Llama { .. } => "LlamaTokenizer",
            Class::Qwen { name, .. } => name,
        }
    }

    /// Whether the class rebuilds `tokenizer.json` (and the loader must rewrite it).
    pub fn rebuilds(&self) -> bool {
        !matches!(self, Class::AsIs { .. })
    }

    /// Rewrites `tokenizer.json` (parsed) into what the class builds from it. The added
    /// tokens, post-processor, padding and truncation stay the file's (transformers drops
    /// `add_bos_token` / `add_eos_token` when there is a tokenizer.json, so it keeps the
    /// file's post-processor).
    pub fn rebuild(&self, json: &mut Value) {
        match *self {
            Class::AsIs { .. } => {}
            Class::Llama {
                legacy,
                add_prefix_space,
            } => rebuild_llama(json, legacy, add_prefix_space),
            Class::Qwen {
                name,
                add_prefix_space,
            } => {
                let regex = match name {
                    "Qwen3_5Tokenizer" => QWEN3_5_SPLIT,
                    _ => QWEN2_SPLIT,
                };
                rebuild_qwen(json, regex, add_prefix_space);
            }
        }
    }
}

/// LlamaTokenizer's pipeline over the file's vocabulary and merges.
fn rebuild_llama(json: &mut Value, legacy: bool, add_prefix_space: bool) {
    bpe_model(
        &mut json["model"],
        json!({"unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true}),
    );
    json["normalizer"] = Value::Null;
    // transformers' `_get_prepend_scheme`: "always" (legacy) or "first", or "never".
    let scheme = match (add_prefix_space, legacy) {
        (false, _) => "never",
        (true, true) => "always",
        (true, false) => "first",
    };
    json["pre_tokenizer"] = json!({
        "type": "Metaspace", "replacement": "\u{2581}", "prepend_scheme": scheme, "split": false,
    });
    let mut decoders = vec![
        json!({"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "}),
        json!({"type": "ByteFallback"}),
        json!({"type": "Fuse"}),
    ];
    if add_prefix_space {
        decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
    }
    json["decoder"] = json!({"type": "Sequence", "decoders": decoders});
}

/// Qwen2Tokenizer's (and Qwen3_5Tokenizer's) pipeline over the file's vocabulary and merges.
fn rebuild_qwen(json: &mut Value, regex: &str, add_prefix_space: bool) {
    bpe_model(
        &mut json["model"],
        json!({"unk_token": null, "continuing_subword_prefix": "", "end_of_word_suffix": "",
            "fuse_unk": false, "byte_fallback": false}),
    );
    json["normalizer"] = json!({"type": "NFC"});
    json["pre_tokenizer"] = json!({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false},
        {"type": "ByteLevel", "add_prefix_space": add_prefix_space, "trim_offsets": true,
            "use_regex": false},
    ]});
    json["decoder"] = json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true});
}

/// A class's `BPE(vocab, merges, …flags)` from the file's vocabulary (a list of pieces
/// becomes piece → index) and merges (none when the file has none): no dropout, merges not
/// ignored, and `flags` (unk token, affixes, fuse_unk, byte_fallback) as the class sets them.
fn bpe_model(model: &mut Value, flags: Value) {
    let vocab = match model.get("vocab") {
        Some(Value::Array(list)) => Value::Object(
            list.iter()
                .enumerate()
                .filter_map(|(i, entry)| {
                    let piece = match entry {
                        Value::Array(pair) => pair.first()?.as_str()?,
                        other => other.as_str()?,
                    };
                    Some((piece.to_owned(), json!(i)))
                })
                .collect(),
        ),
        Some(v) => v.clone(),
        None => json!({}),
    };
    let merges = model.get("merges").cloned().unwrap_or_else(|| json!([]));
    let mut built = json!({
        "type": "BPE", "dropout": null, "ignore_merges": false, "vocab": vocab, "merges": merges,
    });
    if let (Some(built), Value::Object(flags)) = (built.as_object_mut(), flags) {
        built.extend(flags);
    }
    *model = built;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama(legacy: bool, add_prefix_space: bool) -> Class {
        Class::Llama {
            legacy,
            add_prefix_space,
        }
    }

    #[test]
    fn the_class_is_picked_as_transformers_picks_it() {
        let fast = json!({"tokenizer_class": "LlamaTokenizerFast", "legacy": true});
        // No config.json: the hub's class.
        assert_eq!(resolve(&fast, &Value::Null), llama(true, true));
        // Llama has no registered class: the hub's.
        assert_eq!(
            resolve(&fast, &json!({"model_type": "llama"})),
            llama(true, true)
        );
        // DeepSeek V3 and Mistral register TokenizersBackend: the file as written.
        for t in ["deepseek_v3", "mistral"] {
            let c = resolve(&fast, &json!({"model_type": t}));
            assert_eq!(c.name(), "TokenizersBackend", "{t}");
            assert!(!c.rebuilds());
        }
        // Qwen 2 is distrusted: its registered class wins over the hub's.
        let c = resolve(&fast, &json!({"model_type": "qwen2"}));
        assert_eq!(c.name(), "Qwen2Tokenizer");
        assert!(c.rebuilds());
        // Gemma 3 is not: the hub's class.
        assert_eq!(
            resolve(&fast, &json!({"model_type": "gemma3"})).name(),
            "LlamaTokenizer"
        );
        // No hub class: the registered one.
        let bare = json!({"legacy": false, "add_prefix_space": false});
        assert_eq!(
            resolve(&bare, &json!({"model_type": "qwen3"})).name(),
            "Qwen2Tokenizer"
        );
        let pretrained = json!({"tokenizer_class": "PreTrainedTokenizerFast"});
        let c = resolve(&pretrained, &json!({"model_type": "gemma3"}));
        assert_eq!(c.name(), "TokenizersBackend");
        assert!(!c.rebuilds());
        // legacy defaults to false, add_prefix_space to true.
        let plain = json!({"tokenizer_class": "LlamaTokenizer"});
        assert_eq!(resolve(&plain, &Value::Null), llama(false, true));
    }

    #[test]
    fn an_auto_map_skips_the_model_type_check() {
        let remote = json!({
            "tokenizer_class": "LlamaTokenizer",
            "auto_map": {"AutoTokenizer": ["x.Tok", null]},
        });
        for t in ["mistral", "deepseek_v3"] {
            let c = resolve(&remote, &json!({"model_type": t}));
            assert_eq!(c.name(), "LlamaTokenizer", "{t}");
        }
    }

    #[test]
    fn the_llama_rebuild_keeps_the_vocabulary_and_replaces_the_pipeline() {
        let mut file = json!({
            "normalizer": {"type": "Sequence", "normalizers": []},
            "pre_tokenizer": {"type": "ByteLevel"},
            "post_processor": {"type": "ByteLevel"},
            "decoder": {"type": "ByteLevel"},
            "model": {"type": "BPE", "unk_token": "<unk>", "vocab": {"a": 0}, "merges": []},
        });
        llama(false, true).rebuild(&mut file);
        assert_eq!(file["normalizer"], Value::Null);
        assert_eq!(file["pre_tokenizer"]["prepend_scheme"], "first");
        assert_eq!(file["post_processor"]["type"], "ByteLevel");
        assert_eq!(file["model"]["unk_token"], Value::Null);
        assert_eq!(file["model"]["vocab"], json!({"a": 0}));
        assert_eq!(file["decoder"]["decoders"].as_array().unwrap().len(), 4);
        llama(true, false).rebuild(&mut file);
        assert_eq!(file["pre_tokenizer"]["prepend_scheme"], "never");
        assert_eq!(file["decoder"]["decoders"].as_array().unwrap().len(), 3);
        let qwen = resolve(
            &json!({"tokenizer_class": "Qwen3_5Tokenizer"}),
            &Value::Null,
        );
        qwen.rebuild(&mut file);
        assert_eq!(file["normalizer"]["type"], "NFC");
        let split = &file["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"];
        assert_eq!(split, QWEN3_5_SPLIT);
        assert_eq!(file["model"]["continuing_subword_prefix"], "");
        assert_eq!(file["model"]["byte_fallback"], false);
    }
}
