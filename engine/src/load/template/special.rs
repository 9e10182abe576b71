//! The special-token context `apply_chat_template` passes a template: the tokenizer's
//! `special_tokens_map` (transformers 5): bos, eos, unk, sep, pad, cls and mask tokens that
//! are set, then the model-specific ones of `extra_special_tokens` (a dict), each from
//! tokenizer_config.json or, where the key is absent, the tokenizer class's default.

use serde_json::Value;

/// transformers' `SPECIAL_TOKENS_ATTRIBUTES`, in its order.
const NAMED: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// The defaults of the tokenizer classes' `__init__` for a token tokenizer_config.json does
/// not name (an explicit null there means none).
fn class_default(class: &str, name: &str) -> Option<&'static str> {
    let class = class.strip_suffix("Fast").unwrap_or(class);
    match (class, name) {
        ("GemmaTokenizer", "unk_token") => Some("<unk>"),
        ("GemmaTokenizer", "bos_token") => Some("<bos>"),
        ("GemmaTokenizer", "eos_token") => Some("<eos>"),
        ("GemmaTokenizer", "pad_token") => Some("<pad>"),
        ("GemmaTokenizer", "mask_token") => Some("<mask>"),
        ("Qwen2Tokenizer", "unk_token" | "eos_token" | "pad_token") => Some("<|endoftext|>"),
        ("LlamaTokenizer", "unk_token") => Some("<unk>"),
        ("LlamaTokenizer", "bos_token") => Some("<s>"),
        ("LlamaTokenizer", "eos_token") => Some("</s>"),
        _ => None,
    }
}

/// A token entry: a string or an AddedToken dict (`{"content": ...}`).
fn token_text(value: &Value) -> Option<String> {
    match value {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_owned),
        _ => None,
    }
}

/// The special-token names and strings a template sees, in transformers' order.
pub fn special_tokens_map(config: &Value) -> Vec<(String, String)> {
    let class = config
        .get("tokenizer_class")
        .and_then(Value::as_str)
        .unwrap_or("");
    let mut map: Vec<(String, String)> = Vec::new();
    for name in NAMED {
        let text = match config.get(name) {
            Some(value) => token_text(value),
            None => class_default(class, name).map(str::to_owned),
        };
        if let Some(text) = text {
            map.push((name.to_owned(), text));
        }
    }
    if let Some(Value::Object(extra)) = config.get("extra_special_tokens") {
        for (name, value) in extra {
            if let Some(text) = token_text(value) {
                match map.iter_mut().find(|(n, _)| n == name) {
                    Some(entry) => entry.1 = text,
                    None => map.push((name.clone(), text)),
                }
            }
        }
    }
    map
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn class_defaults_fill_absent_keys_and_null_means_none() {
        let config = serde_json::json!({
            "tokenizer_class": "GemmaTokenizer",
            "bos_token": "<bos>",
            "eos_token": {"content": "<end_of_turn>", "special": true},
            "unk_token": null,
            "extra_special_tokens": {"image_token": "<img>"},
        });
        let map = special_tokens_map(&config);
        let names: Vec<_> = map.iter().map(|(n, t)| format!("{n}={t}")).collect();
        assert_eq!(
            names,
            [
                "bos_token=<bos>",
                "eos_token=<end_of_turn>",
                "pad_token=<pad>",
                "mask_token=<mask>",
                "image_token=<img>"
            ]
        );
    }
}
