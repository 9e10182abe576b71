//! L2: the engine vs mlx-optiq 0.7.7 on the tiny models (goldens/l2/<model>, made by
//! oracles/gen_l2.py): optiq's mixed per-layer quantized KV (the golden's kv_config.json),
//! converted where optiq converts, read through optiq's fused KV-tiled attention where its
//! server uses it. Every logit vector bit-identical, greedy ids identical.

use engine::cache::QuantSdpa;
use engine::generate::{CompileDecode, KvLayers, KvQuantPlan, SessionOptions};

use super::l1::{check_in_dir, ModelReport, Stop};
use super::ParityError;
use crate::goldens::TensorGolden;

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
        ..SessionOptions::default()
    })
}

/// Runs the L2 gate of `model` on `golden`, with `tweak` applied to the session options
/// first (planted defects), each case until `stop`.
pub fn run(
    model: &str,
    golden: &TensorGolden,
    tweak: impl FnOnce(&mut SessionOptions),
    stop: Stop,
) -> Result<ModelReport, ParityError> {
    let dir = crate::goldens::model_dir(model)?;
    let built = engine::model::load(&dir)?;
    let mut opts = options(golden)?;
    tweak(&mut opts);
    let mut report = check_in_dir(golden, &dir, built.as_ref(), &opts, stop)?;
    report.tier = "L2";
    Ok(report)
}
