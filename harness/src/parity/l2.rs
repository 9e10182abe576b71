//! L2: the engine vs mlx-optiq 0.7.7 on the tiny models (goldens/l2/<model>, made by
//! oracles/gen_l2.py): optiq's mixed per-layer quantized KV (the golden's kv_config.json),
//! converted where optiq converts, read through optiq's fused KV-tiled attention where its
//! server uses it. Every logit vector bit-identical, greedy ids identical.

use engine::cache::QuantSdpa;
use engine::generate::{CompileDecode, KvLayers, KvQuantPlan, SessionOptions};
use engine::load::template::ChatTemplate;
use engine::load::tokenizer::Tokenizer;

use super::l1::{check_model_opts, ModelReport};
use super::ParityError;
use crate::goldens::{Layer, TensorGolden};

/// The tiny models with committed L2 goldens.
pub const MODELS: [&str; 3] = ["tiny-llama-trained", "tiny-gemma3-kv", "tiny-gemma4"];

/// The L2 session options for a golden: its kv_config.json, optiq's conversion start and
/// the fused kernel.
pub fn options(golden: &TensorGolden) -> Result<SessionOptions, ParityError> {
    let settings = &golden.index["settings"];
    let file = settings["kv_config"].as_str().unwrap_or("kv_config.json");
    let layers = KvLayers::from_config_file(&golden.dir.join(file))
        .map_err(|e| ParityError::Index(e.to_string()))?;
    Ok(SessionOptions {
        compile: CompileDecode::WhereExact,
        kv_quant: Some(KvQuantPlan {
            layers,
            start: settings["quantized_kv_start"].as_i64().unwrap_or(0) as i32,
            sdpa: QuantSdpa::OptiqFused,
        }),
    })
}

/// Runs the L2 gate of `name` (from `live_dir/<name>` when given), with `tweak` applied to
/// the session options first (planted defects).
pub fn check_named(
    name: &str,
    live_dir: Option<&std::path::Path>,
    tweak: impl FnOnce(&mut SessionOptions),
) -> Result<ModelReport, ParityError> {
    let dir = crate::goldens::model_dir(name)?;
    let model = engine::model::load(&dir)?;
    let tokenizer = Tokenizer::load(&dir)?;
    let template = ChatTemplate::from_tokenizer(&tokenizer)?;
    let golden = match live_dir {
        Some(live) => TensorGolden::open_dir(live.join(name), Layer::Reference)?,
        None => TensorGolden::open(&format!("l2/{name}"))?,
    };
    let mut opts = options(&golden)?;
    tweak(&mut opts);
    let step = golden.index["settings"]["prefill_step_size"]
        .as_u64()
        .map_or(engine::generate::PREFILL_STEP, |s| s as usize);
    let mut report = check_model_opts(
        &golden,
        model.as_ref(),
        &tokenizer,
        template.as_ref(),
        step,
        &opts,
    )?;
    report.tier = "L2";
    Ok(report)
}
