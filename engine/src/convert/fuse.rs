//! `engine fuse`: adapters fused into their base model, as `mlx_lm fuse` 0.32.2 writes it
//! (mlx_lm/fuse.py `main`, the same files byte for byte): each adapted linear replaced by
//! its layer's `fuse()` —
//!
//!   LoRA (`LoRALinear.fuse`):  W' = W + cast_W((scale·Bᵀ)·Aᵀ)
//!   DoRA (`DoRALinear.fuse`):  V = W + cast_W((scale·Bᵀ)·Aᵀ),  W' = (m / ‖V‖₂ per row)[:, None] · V
//!
//! with W dequantized first where the layer is quantized, and W' quantized again with the
//! layer's own group size, bits and mode (`QuantizedLinear.from_linear`) unless
//! `--dequantize`; the bias kept. `--dequantize` then dequantizes every other quantized
//! module (`dequantize_model`) and drops `quantization` / `quantization_config` from the
//! config. The model is saved as mlx-lm's `save` saves it (convert's `write`: shards in
//! parameter order, the index, the sorted config, the tokenizer, the copied files, the card).
//! Fully fine-tuned blocks (`fine_tune_type: "full"`) have no `fuse()`: their saved weights
//! replace the base's, as `load_adapters` loads them.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;

use anyhow::{Context, Result};
use mlx_rs::Array;

use super::{family, load_config, load_weights, quant, total_parameters, write, Model};
use crate::load::config::{ModelConfig, QuantParams};
use crate::model::layers::{weak, Linear, Lora};
use crate::plant::{self, Defect};
use crate::train::lora::{dora, read_config, Adapters, OwnedAdapter};

/// `mlx_lm fuse`'s flags (names and defaults).
#[derive(clap::Args, Debug, Clone)]
pub struct FuseArgs {
    /// The base model dir (MLX layout, as the adapters were trained on).
    #[arg(long, default_value = "mlx_model")]
    pub model: PathBuf,
    /// Where to write the fused model.
    #[arg(long, default_value = "fused_model")]
    pub save_path: PathBuf,
    /// The adapter dir (adapter_config.json, adapters.safetensors).
    #[arg(long, default_value = "adapters")]
    pub adapter_path: PathBuf,
    /// Write a dequantized model.
    #[arg(long, visible_alias = "de-quantize")]
    pub dequantize: bool,
}

/// Fuses `args.adapter_path` into `args.model` and writes `args.save_path`.
pub fn fuse(args: &FuseArgs) -> Result<()> {
    let src = &args.model;
    let mut config = load_config(src)?;
    let model_type = config
        .get("model_type")
        .and_then(|v| v.as_str())
        .unwrap_or("")
        .to_string();
    let model = crate::model::load(src)?;
    let mut weights = load_weights(src)?;
    if read_config(&args.adapter_path)?.fine_tune_type == "full" {
        // Fully fine-tuned blocks: their weights replace the base's (`load_weights`).
        Adapters::load(model.as_ref(), &args.adapter_path)?;
        let file = args.adapter_path.join("adapters.safetensors");
        for (k, v) in Array::load_safetensors(&file)? {
            weights.insert(k, v);
        }
        return save(args, config, model_type, weights, BTreeMap::new());
    }
    let adapter = OwnedAdapter::load(model.as_ref(), &args.adapter_path)?;
    let quantization = ModelConfig::read(src)?.quantization;
    let mut bits: BTreeMap<String, i32> = BTreeMap::new();
    for module in quantized_modules(&weights) {
        if let Some(p) = module_params(quantization.as_ref(), &module) {
            bits.insert(module, p.bits);
        }
    }
    let linears: HashMap<String, &Linear> = model.linears().into_iter().collect();
    for (name, lora) in &adapter.layers {
        let linear = linears.get(name).with_context(|| {
            format!(
                "engine fuse: `{name}` is adapted on stacked experts (LoRASwitchLinear); fusing \
                 those is not supported yet: serve the adapters with --adapter-path instead"
            )
        })?;
        fuse_layer(&mut weights, name, linear, lora, args.dequantize, &mut bits)?;
    }
    if args.dequantize {
        dequantize_rest(&mut weights, quantization.as_ref(), &mut bits)?;
        config.remove("quantization");
        config.remove("quantization_config");
    }
    save(args, config, model_type, weights, bits)
}

/// The fused model written as mlx-lm's `save` writes it, its tensors in parameter order.
fn save(
    args: &FuseArgs,
    config: serde_json::Map<String, serde_json::Value>,
    model_type: String,
    weights: BTreeMap<String, Array>,
    bits: BTreeMap<String, i32>,
) -> Result<()> {
    let src = &args.model;
    let mut keyed = Vec::with_capacity(weights.len());
    for (k, v) in weights {
        keyed.push((family::order_key(&model_type, &k)?, k, v));
    }
    keyed.sort_by(|a, b| a.0.cmp(&b.0));
    let fused = Model {
        model_type,
        config,
        params: keyed.into_iter().map(|(_, k, v)| (k, v)).collect(),
        quantized_bits: bits,
    };
    let dir = &args.save_path;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    write::save_weights(dir, &fused.params, total_parameters(&fused), |_| {})?;
    write::save_config(dir, &fused.config)?;
    write::save_tokenizer(src, dir)?;
    write::copy_extras(src, dir)
}

/// The modules stored quantized: those with `<module>.scales`.
fn quantized_modules(weights: &BTreeMap<String, Array>) -> Vec<String> {
    weights
        .keys()
        .filter_map(|k| k.strip_suffix(".scales").map(str::to_string))
        .collect()
}

/// How mlx-lm's loader quantizes `module`: its own entry in `quantization`, else the
/// global one.
fn module_params(
    q: Option<&crate::load::config::QuantConfig>,
    module: &str,
) -> Option<QuantParams> {
    let q = q?;
    match q.per_path.get(module) {
        Some(explicit) => *explicit,
        None => q.default,
    }
}

/// One adapted linear fused (`LoRALinear.fuse` / `DoRALinear.fuse`) into `weights`.
fn fuse_layer(
    weights: &mut BTreeMap<String, Array>,
    name: &str,
    linear: &Linear,
    lora: &Lora,
    dequantize: bool,
    bits: &mut BTreeMap<String, i32>,
) -> Result<()> {
    let key = format!("{name}.weight");
    let stored = weights
        .get(&key)
        .with_context(|| format!("engine fuse: the checkpoint has no `{key}`"))?;
    if !stored.eq_values(&linear.weight)? {
        anyhow::bail!(
            "engine fuse: `{key}` is transformed when this model loads, so the stored weight is \
             not the one the adapter was trained on; fusing this family is not supported"
        );
    }
    let w = dora::dequantized_weight(linear)?;
    let fused = fused_weight(&w, lora)?;
    match (&linear.quantized, dequantize) {
        (Some(q), false) => {
            let p = q.params;
            let (qw, scales, biases) =
                quant::quantize(&fused, Some(p.group_size), p.bits, p.mode.name())?;
            weights.insert(key, qw);
            weights.insert(format!("{name}.scales"), scales);
            if let Some(b) = biases {
                weights.insert(format!("{name}.biases"), b);
            }
        }
        _ => {
            weights.insert(key, fused);
            weights.remove(&format!("{name}.scales"));
            weights.remove(&format!("{name}.biases"));
            bits.remove(name);
        }
    }
    Ok(())
}

/// W' of `LoRALinear.fuse` (no magnitude) or `DoRALinear.fuse` (with it), from the dense W.
pub fn fused_weight(w: &Array, lora: &Lora) -> Result<Array> {
    let bt = lora.b.t();
    let mut scaled = bt.multiply(weak(lora.scale as f64, &bt)?)?;
    if plant::is(Defect::FuseScaleTwice) {
        scaled = scaled.multiply(weak(lora.scale as f64, &scaled)?)?;
    }
    let delta = scaled.matmul(lora.a.t())?.as_dtype(w.dtype())?;
    let v = w.add(&delta)?;
    match &lora.m {
        None => Ok(v),
        Some(m) => {
            let norm = dora::row_norms(&v)?;
            let scale = m.divide(&norm)?.expand_dims(1)?;
            Ok(scale.multiply(&v)?)
        }
    }
}

/// `dequantize_model`: every module still quantized made dense (`mx.dequantize` with its
/// params, the scales' dtype), its bias kept.
fn dequantize_rest(
    weights: &mut BTreeMap<String, Array>,
    q: Option<&crate::load::config::QuantConfig>,
    bits: &mut BTreeMap<String, i32>,
) -> Result<()> {
    for module in quantized_modules(weights) {
        let p = module_params(q, &module).with_context(|| {
            format!("engine fuse: `{module}` is stored quantized but config.json's quantization does not say how")
        })?;
        let get = |part: &str| weights.get(&format!("{module}.{part}")).cloned();
        let w = get("weight").with_context(|| format!("no `{module}.weight`"))?;
        let scales = get("scales").expect("listed by its scales");
        let dense =
            crate::model::quantized::ops::dequantize(&w, &scales, get("biases").as_ref(), p, None)?;
        weights.insert(format!("{module}.weight"), dense);
        weights.remove(&format!("{module}.scales"));
        weights.remove(&format!("{module}.biases"));
        bits.remove(&module);
    }
    Ok(())
}
