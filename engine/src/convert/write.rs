//! mlx-lm's `save`: weight shards (`make_shards`, `save_model`), the index, the config
//! (`save_config`), the tokenizer as transformers 5's `save_pretrained` writes it, the
//! copied files and the model card.

use std::collections::HashMap;
use std::fs;
use std::path::Path;

use anyhow::{Context, Result};
use mlx_rs::Array;
use serde_json::{json, Map, Value};

use super::pyjson::dumps;

/// `MAX_FILE_SIZE_GB` (5) in bytes.
const MAX_SHARD_BYTES: usize = 5 << 30;

/// The model card `create_model_card` writes for a local source.
const MODEL_CARD: &str =
    "---\nlanguage: en\nlibrary_name: mlx\npipeline_tag: text-generation\ntags:\n- mlx\n---\n";

/// `make_shards`: a new shard when the next tensor would pass the limit.
fn make_shards(params: &[(String, Array)], max_bytes: usize) -> Vec<Vec<(String, Array)>> {
    let mut shards: Vec<Vec<(String, Array)>> = Vec::new();
    let mut size = 0;
    for (k, v) in params {
        if shards.is_empty() || size + v.nbytes() > max_bytes {
            shards.push(Vec::new());
            size = 0;
        }
        shards
            .last_mut()
            .expect("a shard")
            .push((k.clone(), v.clone()));
        size += v.nbytes();
    }
    shards
}

/// `save_model`: the shards (tensors handed to `mx.save_safetensors` in parameter order,
/// metadata `{"format": "mlx"}`) and `model.safetensors.index.json`. `on_shard` is told
/// each shard's tensor count once it is written.
pub fn save_weights(
    dir: &Path,
    params: &[(String, Array)],
    total_parameters: usize,
    mut on_shard: impl FnMut(usize),
) -> Result<()> {
    let shards = make_shards(params, MAX_SHARD_BYTES);
    let count = shards.len();
    let metadata = HashMap::from([("format".to_string(), "mlx".to_string())]);
    let mut weight_map = Vec::new();
    for (i, shard) in shards.iter().enumerate() {
        let name = if count > 1 {
            format!("model-{:05}-of-{:05}.safetensors", i + 1, count)
        } else {
            "model.safetensors".to_string()
        };
        Array::save_safetensors(
            shard.iter().map(|(k, v)| (k.as_str(), v)),
            Some(&metadata),
            dir.join(&name),
        )
        .with_context(|| format!("writing {name}"))?;
        weight_map.extend(shard.iter().map(|(k, _)| (k.clone(), name.clone())));
        on_shard(shard.len());
    }
    weight_map.sort();
    let total_size: usize = params.iter().map(|(_, v)| v.nbytes()).sum();
    let map: Map<String, Value> = weight_map
        .into_iter()
        .map(|(k, f)| (k, Value::String(f)))
        .collect();
    let index = json!({
        "metadata": {"total_size": total_size, "total_parameters": total_parameters},
        "weight_map": map,
    });
    fs::write(
        dir.join("model.safetensors.index.json"),
        dumps(&index, 4, true, false),
    )?;
    Ok(())
}

/// `save_config`: `_name_or_path` and `vision_config` dropped, `quantization_config`
/// mirrors `quantization`, top-level keys sorted, `json.dump(indent=4)`.
pub fn save_config(dir: &Path, config: &Map<String, Value>) -> Result<()> {
    let mut config = config.clone();
    config.remove("_name_or_path");
    config.remove("vision_config");
    if let Some(q) = config.get("quantization").cloned() {
        config.insert("quantization_config".into(), q);
    }
    let mut entries: Vec<(String, Value)> = config
        .into_iter()
        .map(|(k, v)| (k, encode_tagged_floats(v)))
        .collect();
    entries.sort_by(|a, b| a.0.cmp(&b.0));
    let sorted: Map<String, Value> = entries.into_iter().collect();
    fs::write(
        dir.join("config.json"),
        dumps(&Value::Object(sorted), 4, true, false),
    )?;
    Ok(())
}

/// mlx-lm's `_encode_tagged_floats`: a non-finite float — held as ±f64::MAX since the
/// config was read (`load::read_json`) — written as `{"__float__": "Infinity"}`.
fn encode_tagged_floats(v: Value) -> Value {
    match v {
        Value::Number(n) if n.as_f64().is_some_and(|x| x.abs() == f64::MAX) => {
            let tag = if n.as_f64().unwrap_or(0.0) > 0.0 {
                "Infinity"
            } else {
                "-Infinity"
            };
            let mut m = Map::new();
            m.insert(crate::load::FLOAT_TAG.into(), Value::String(tag.into()));
            Value::Object(m)
        }
        Value::Array(a) => Value::Array(a.into_iter().map(encode_tagged_floats).collect()),
        Value::Object(m) => Value::Object(
            m.into_iter()
                .map(|(k, v)| (k, encode_tagged_floats(v)))
                .collect(),
        ),
        v => v,
    }
}

/// transformers 5's `save_pretrained` of the fast tokenizer the source dir holds:
/// tokenizer.json as it is, the chat template in chat_template.jinja, and
/// tokenizer_config.json without it, with the backend keys transformers adds, sorted.
pub fn save_tokenizer(src: &Path, dir: &Path) -> Result<()> {
    let tok = src.join("tokenizer.json");
    if !tok.is_file() {
        anyhow::bail!(
            "engine convert needs the fast tokenizer: {} has no tokenizer.json",
            src.display()
        );
    }
    fs::copy(&tok, dir.join("tokenizer.json"))?;
    let cfg_path = src.join("tokenizer_config.json");
    let mut cfg: Map<String, Value> = if cfg_path.is_file() {
        serde_json::from_str(&fs::read_to_string(&cfg_path)?)
            .with_context(|| format!("reading {}", cfg_path.display()))?
    } else {
        Map::new()
    };
    let mut template = match cfg.remove("chat_template") {
        Some(Value::String(t)) => Some(t),
        None | Some(Value::Null) => None,
        Some(_) => anyhow::bail!(
            "engine convert: {} has named chat templates (a list); only one template string is supported",
            cfg_path.display()
        ),
    };
    let jinja = src.join("chat_template.jinja");
    if jinja.is_file() {
        template = Some(fs::read_to_string(&jinja)?);
    }
    if let Some(t) = template {
        fs::write(dir.join("chat_template.jinja"), t)?;
    }
    let class = match cfg.get("tokenizer_class").and_then(Value::as_str) {
        None | Some("PreTrainedTokenizerFast" | "PreTrainedTokenizer") => {
            "TokenizersBackend".to_string()
        }
        Some(c) => c.strip_suffix("Fast").unwrap_or(c).to_string(),
    };
    cfg.insert("tokenizer_class".into(), Value::String(class));
    cfg.insert("backend".into(), json!("tokenizers"));
    cfg.insert("is_local".into(), json!(true));
    cfg.insert("local_files_only".into(), json!(false));
    let text = dumps(&Value::Object(cfg), 2, false, true) + "\n";
    fs::write(dir.join("tokenizer_config.json"), text)?;
    Ok(())
}

/// The files `save` copies from the source (`*.py`, generation_config.json) and the
/// model card.
pub fn copy_extras(src: &Path, dir: &Path) -> Result<()> {
    for entry in fs::read_dir(src)? {
        let path = entry?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if path.is_file() && (name.ends_with(".py") || name == "generation_config.json") {
            fs::copy(&path, dir.join(name))?;
        }
    }
    fs::write(dir.join("README.md"), MODEL_CARD)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_split_before_the_tensor_that_passes_the_limit() {
        let t = |n: usize, name: &str| {
            (
                name.to_string(),
                Array::from_slice(&vec![0f32; n], &[n as i32]),
            )
        };
        // 40, 40, 80 (alone: larger than the limit), 8 bytes with a 64-byte limit.
        let params = vec![t(10, "a"), t(10, "b"), t(20, "c"), t(2, "d")];
        let names: Vec<Vec<String>> = make_shards(&params, 64)
            .iter()
            .map(|s| s.iter().map(|(k, _)| k.clone()).collect())
            .collect();
        assert_eq!(names, [vec!["a"], vec!["b"], vec!["c"], vec!["d"]]);
        assert_eq!(make_shards(&params, 1 << 20).len(), 1);
    }
}
