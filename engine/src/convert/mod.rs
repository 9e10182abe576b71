//! `engine convert`: a Hugging Face model dir → an MLX model dir, as `mlx_lm.convert`
//! 0.32.2 writes it (the same safetensors and config bytes): the model class's sanitize,
//! the dtype cast, quantization (affine with bits / group size, mlx-lm's mixed recipes,
//! mxfp4 / nvfp4 / mxfp8) through MLX's own `quantize`, and mlx-lm's `save`.
//! The output is written to `OUT.partial` and renamed when complete.

pub mod families;
pub mod family;
pub mod fuse;
pub mod pyjson;
pub mod quant;
pub mod write;

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use mlx_rs::{Array, Dtype};
use serde_json::{Map, Value};

use crate::plant::{self, Defect};

/// `--dtype` choices (`MODEL_CONVERSION_DTYPES`).
pub const DTYPES: &[&str] = &["float16", "bfloat16", "float32"];

/// `engine convert`: mlx_lm.convert's flags (names and defaults).
#[derive(clap::Args, Debug, Clone)]
pub struct ConvertArgs {
    /// The Hugging Face model dir (config.json, model*.safetensors, tokenizer.json).
    #[arg(long, visible_alias = "model")]
    pub hf_path: PathBuf,
    /// Where to write the MLX model (must not exist).
    #[arg(long, default_value = "mlx_model")]
    pub mlx_path: PathBuf,
    /// Generate a quantized model.
    #[arg(short = 'q', long)]
    pub quantize: bool,
    /// Group size for quantization (default: the mode's, 64 for affine).
    #[arg(long)]
    pub q_group_size: Option<i32>,
    /// Bits per weight for quantization (default: the mode's, 4 for affine).
    #[arg(long)]
    pub q_bits: Option<i32>,
    /// The quantization mode.
    #[arg(long, default_value = "affine", value_parser = clap::builder::PossibleValuesParser::new(quant::MODES))]
    pub q_mode: String,
    /// Mixed-bit quantization recipe.
    #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(quant::RECIPES))]
    pub quant_predicate: Option<String>,
    /// Type to save the non-quantized parameters. Defaults to config.json's `torch_dtype`
    /// or the current model weights dtype.
    #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(DTYPES))]
    pub dtype: Option<String>,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
}

impl ConvertArgs {
    /// The defaults for `hf_path` → `mlx_path` (no cast beyond the config's, no quantization).
    pub fn new(hf_path: impl Into<PathBuf>, mlx_path: impl Into<PathBuf>) -> Self {
        ConvertArgs {
            hf_path: hf_path.into(),
            mlx_path: mlx_path.into(),
            quantize: false,
            q_group_size: None,
            q_bits: None,
            q_mode: "affine".into(),
            quant_predicate: None,
            dtype: None,
            quiet: true,
        }
    }
}

/// Converts `args.hf_path` into `args.mlx_path`, atomically.
pub fn convert(args: &ConvertArgs) -> Result<()> {
    let out = &args.mlx_path;
    if out.exists() {
        anyhow::bail!(
            "Cannot save to the path {} as it already exists. Please delete the file/directory or specify a new path to save to.",
            out.display()
        );
    }
    if args.quant_predicate.is_some() && args.q_mode != "affine" {
        anyhow::bail!("Quant predicates only support 'affine' quantization.");
    }
    let mut partial = out.clone().into_os_string();
    partial.push(".partial");
    let partial = PathBuf::from(partial);
    if partial.exists() {
        fs::remove_dir_all(&partial)
            .with_context(|| format!("removing the leftover {}", partial.display()))?;
    }
    fs::create_dir_all(&partial).with_context(|| format!("creating {}", partial.display()))?;
    match convert_into(args, &partial) {
        Ok(()) => fs::rename(&partial, out)
            .with_context(|| format!("renaming {} to {}", partial.display(), out.display())),
        Err(e) => {
            let _ = fs::remove_dir_all(&partial);
            Err(e)
        }
    }
}

/// The model: its config and parameters in `tree_flatten(model.parameters())` order.
struct Model {
    model_type: String,
    config: Map<String, Value>,
    params: Vec<(String, Array)>,
    /// Bits of each quantized module (for `total_parameters`).
    quantized_bits: BTreeMap<String, i32>,
}

fn convert_into(args: &ConvertArgs, dir: &Path) -> Result<()> {
    let src = &args.hf_path;
    let info = |line: String| {
        if !args.quiet {
            eprintln!("[INFO] {line}");
        }
    };
    info("Loading".into());
    let mut model = load(src)?;
    if let Some(dtype) = target_dtype(args, &model.config) {
        info(format!("Using dtype: {}", dtype_name(dtype)));
        cast(&mut model, dtype)?;
    }
    if args.quantize {
        info("Quantizing".into());
        quantize_model(&mut model, args)?;
        let bytes: usize = model.params.iter().map(|(_, v)| v.nbytes()).sum();
        let bpw = bytes as f64 * 8.0 / total_parameters(&model) as f64;
        info(format!("Quantized model with {bpw:.3} bits per weight."));
    }
    let bar = progress_bar(args.quiet, model.params.len());
    bar.set_message("writing");
    let total = total_parameters(&model);
    write::save_weights(dir, &model.params, total, |n| bar.inc(n as u64))?;
    bar.finish_and_clear();
    write::save_config(dir, &model.config)?;
    write::save_tokenizer(src, dir)?;
    write::copy_extras(src, dir)?;
    Ok(())
}

fn progress_bar(quiet: bool, len: usize) -> indicatif::ProgressBar {
    let bar = if quiet {
        indicatif::ProgressBar::hidden()
    } else {
        indicatif::ProgressBar::new(len as u64)
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} tensors {msg} ({elapsed})")
            .expect("valid template"),
    );
    bar
}

/// `load_config` (generation_config.json's `eos_token_id` into the config) and the
/// weights, sanitized and in parameter order.
fn load(src: &Path) -> Result<Model> {
    let mut config = load_config(src)?;
    let model_type = config
        .get("model_type")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    family::check_supported(&model_type, &Value::Object(config.clone()))?;
    family::fix_config(&model_type, &mut config);
    for key in ["quantization", "quantization_config"] {
        if config.contains_key(key) {
            anyhow::bail!(
                "engine convert: {} is already quantized (config.json has `{key}`); convert from the unquantized checkpoint",
                src.display()
            );
        }
    }
    let mut weights = load_weights(src)?;
    family::sanitize(&model_type, &Value::Object(config.clone()), &mut weights)?;
    let mut keyed = Vec::with_capacity(weights.len());
    for (k, v) in weights {
        keyed.push((family::order_key(&model_type, &k)?, k, v));
    }
    keyed.sort_by(|a, b| a.0.cmp(&b.0));
    if plant::is(Defect::ConvertParamsSortedByName) {
        keyed.sort_by(|a, b| a.1.cmp(&b.1));
    }
    let params = keyed.into_iter().map(|(_, k, v)| (k, v)).collect();
    Ok(Model {
        model_type,
        config,
        params,
        quantized_bits: BTreeMap::new(),
    })
}

/// mlx-lm's `load_config`: config.json, and generation_config.json's `eos_token_id` (when
/// truthy) over the config's.
fn load_config(src: &Path) -> Result<Map<String, Value>> {
    let cfg_path = src.join("config.json");
    // Python's `Infinity` (bare or tagged) read as f64::MAX, tagged again by `save_config`.
    let mut config: Map<String, Value> = match crate::load::read_json(&cfg_path)? {
        Value::Object(m) => m,
        _ => anyhow::bail!("{}: not a JSON object", cfg_path.display()),
    };
    if let Ok(gen) = fs::read_to_string(src.join("generation_config.json")) {
        if let Ok(Value::Object(gen)) = serde_json::from_str::<Value>(&gen) {
            if let Some(eos) = gen.get("eos_token_id").filter(|v| truthy(v)) {
                config.insert("eos_token_id".into(), eos.clone());
            }
        }
    }
    Ok(config)
}

/// Python's truthiness of a JSON value (`if eos := gen.get(..., False)`).
fn truthy(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64() != Some(0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
    }
}

/// Every `model*.safetensors` of the dir.
fn load_weights(src: &Path) -> Result<BTreeMap<String, Array>> {
    let mut weights = BTreeMap::new();
    let entries = fs::read_dir(src).with_context(|| format!("reading {}", src.display()))?;
    for entry in entries {
        let path = entry?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name.starts_with("model") && name.ends_with(".safetensors") {
            let loaded = Array::load_safetensors(&path)
                .with_context(|| format!("loading {}", path.display()))?;
            weights.extend(loaded);
        }
    }
    if weights.is_empty() {
        anyhow::bail!("No safetensors found in {}", src.display());
    }
    Ok(weights)
}

/// `--dtype`, else config.json's `torch_dtype`, else `text_config.dtype`, when one of
/// [`DTYPES`].
fn target_dtype(args: &ConvertArgs, config: &Map<String, Value>) -> Option<Dtype> {
    let from_config = || {
        match config.get("torch_dtype") {
            Some(Value::Null) | None => config
                .get("text_config")
                .and_then(|t| t.get("dtype"))
                .and_then(Value::as_str),
            Some(v) => v.as_str(),
        }
        .map(str::to_string)
    };
    match args.dtype.clone().or_else(from_config)?.as_str() {
        "float16" => Some(Dtype::Float16),
        "bfloat16" => Some(Dtype::Bfloat16),
        "float32" => Some(Dtype::Float32),
        _ => None,
    }
}

fn dtype_name(dtype: Dtype) -> &'static str {
    match dtype {
        Dtype::Float16 => "float16",
        Dtype::Bfloat16 => "bfloat16",
        _ => "float32",
    }
}

/// Every floating-point parameter to `dtype`, but those the model's `cast_predicate` keeps.
fn cast(model: &mut Model, dtype: Dtype) -> Result<()> {
    for (name, v) in model.params.iter_mut() {
        let norm = name.ends_with("norm.weight");
        if plant::is(Defect::ConvertNormsKeepDtype) && norm {
            continue;
        }
        if family::keeps_dtype(&model.model_type, name) {
            continue;
        }
        if v.dtype().is_float() {
            *v = v.as_dtype(dtype)?;
        }
    }
    Ok(())
}

/// `quantize_model`: each `nn.Linear` / `SwitchLinear` / `nn.Embedding` whose input size
/// the group size divides, with the recipe's per-module parameters — or, without a recipe,
/// the model's `quant_predicate`'s — recorded in the config.
fn quantize_model(model: &mut Model, args: &ConvertArgs) -> Result<()> {
    let (dg, db) = quant::mode_defaults(&args.q_mode);
    let group_size = args.q_group_size.unwrap_or(dg);
    let bits = args.q_bits.unwrap_or(db);
    let top = quant::Params {
        group_size: Some(group_size),
        bits,
        mode: args.q_mode.clone(),
    };
    let modules: Vec<String> = model
        .params
        .iter()
        .filter_map(|(k, _)| k.strip_suffix(".weight").map(str::to_string))
        .collect();
    let recipe = match &args.quant_predicate {
        Some(name) => {
            let layers = layer_count(&model.params);
            Some(quant::Recipe::new(
                name,
                args.q_group_size,
                &modules,
                layers,
            )?)
        }
        None => None,
    };
    let mut quantization = match top.to_json() {
        Value::Object(m) => m,
        _ => unreachable!("params are an object"),
    };
    let config = Value::Object(model.config.clone());
    let bar = progress_bar(args.quiet, modules.len());
    bar.set_message("quantizing");
    let mut params = Vec::with_capacity(model.params.len());
    for (name, v) in std::mem::take(&mut model.params) {
        let Some(module) = name.strip_suffix(".weight").map(str::to_string) else {
            params.push((name, v));
            continue;
        };
        let module = module.as_str();
        bar.inc(1);
        let in_dims = v.shape().last().copied().unwrap_or(0);
        if !family::quantizable(&model.model_type, module) || in_dims % group_size != 0 {
            params.push((name, v));
            continue;
        }
        let p = match &recipe {
            Some(r) => {
                let p = r.params(module);
                quantization.insert(module.to_string(), p.to_json());
                p
            }
            None => match family::model_quant_params(&model.model_type, &config, module) {
                Some((p, entry)) => {
                    quantization.insert(module.to_string(), entry);
                    p
                }
                None => top.clone(),
            },
        };
        let (w, scales, biases) = quant::quantize(&v, p.group_size, p.bits, &p.mode)
            .with_context(|| format!("quantizing {module}"))?;
        params.push((name, w));
        params.push((format!("{module}.scales"), scales));
        if let Some(b) = biases {
            params.push((format!("{module}.biases"), b));
        }
        model.quantized_bits.insert(module.to_string(), p.bits);
    }
    bar.finish_and_clear();
    params.sort_by_cached_key(|(k, _)| family::order_key(&model.model_type, k).unwrap_or_default());
    if plant::is(Defect::ConvertParamsSortedByName) {
        params.sort_by(|a, b| a.0.cmp(&b.0));
    }
    model.params = params;
    model
        .config
        .insert("quantization".into(), Value::Object(quantization.clone()));
    model
        .config
        .insert("quantization_config".into(), Value::Object(quantization));
    Ok(())
}

/// `len(model.layers)`: one past the largest index after a `layers` segment.
fn layer_count(params: &[(String, Array)]) -> usize {
    params
        .iter()
        .filter_map(|(k, _)| {
            let segs: Vec<&str> = k.split('.').collect();
            let at = segs.iter().position(|s| *s == "layers")?;
            segs.get(at + 1)?.parse::<usize>().ok()
        })
        .max()
        .map_or(0, |i| i + 1)
}

/// `get_total_parameters`: over the leaf modules (modules without submodules), a
/// quantized layer counts its unpacked weight (and bias), others their arrays.
fn total_parameters(model: &Model) -> usize {
    let module_of = |k: &str| {
        k.rsplit_once('.')
            .map_or(String::new(), |(m, _)| m.to_string())
    };
    let modules: Vec<String> = model.params.iter().map(|(k, _)| module_of(k)).collect();
    let is_leaf = |m: &str| {
        let prefix = format!("{m}.");
        !modules.iter().any(|o| o.starts_with(&prefix))
    };
    let mut total = 0;
    for (k, v) in &model.params {
        let m = module_of(k);
        if !is_leaf(&m) {
            continue;
        }
        match model.quantized_bits.get(&m) {
            Some(bits) if k.ends_with(".weight") => total += v.size() * 32 / *bits as usize,
            Some(_) if !k.ends_with(".bias") => {}
            _ => total += v.size(),
        }
    }
    total
}
