//! The LoRA training gate: our adapters, SFT loss, autodiff gradients and AdamW against
//! mlx-lm's (oracles/gen_train.py: `linear_to_lora_layers`, `default_loss`,
//! `nn.value_and_grad`, `optim.AdamW`, eager) on each of MODELS — from the golden's
//! initial adapters, every step's loss, token count and every gradient, and the adapters
//! after the last update, bit for bit; then mlx-lm's saved adapters loaded by us give the
//! logits `mlx_lm.utils.load_adapters` gave, bit for bit.

use engine::train::lora::{AdapterConfig, Adapters, LoraParams};
use engine::train::optim::{AdamW, Schedule};
use mlx_rs::Array;
use serde_json::{json, Value};

use super::ParityError;
use crate::compare::compare;
use crate::goldens::{TensorEntry, TensorGolden};

/// The models with LoRA training goldens (`oracles/gen_train.py MODEL`).
pub const MODELS: [&str; 3] = ["tiny-llama-trained", "tiny-gemma3", "tiny-gemma4"];

#[derive(Debug, Clone, Default)]
pub struct TrainReport {
    pub tensors: usize,
    pub exact: usize,
    pub max_abs_diff: f64,
    pub steps: usize,
    pub first_failure: Option<String>,
}

impl TrainReport {
    pub fn passed(&self) -> bool {
        self.tensors > 0 && self.exact == self.tensors
    }

    pub fn summary(&self) -> String {
        format!(
            "{} steps: {}/{} tensors bit-exact (losses, gradients, adapters, adapted logits; max |Δ| {:e}){}",
            self.steps,
            self.exact,
            self.tensors,
            self.max_abs_diff,
            self.first_failure
                .as_ref()
                .map_or(String::new(), |f| format!(", first failure: {f}"))
        )
    }
}

fn field<T: serde::de::DeserializeOwned>(v: &Value, key: &str) -> Result<T, ParityError> {
    serde_json::from_value(v[key].clone()).map_err(|e| ParityError::Index(format!("{key}: {e}")))
}

fn f32_array(golden: &TensorGolden, e: &TensorEntry) -> Result<Array, ParityError> {
    let (e, bytes) = golden.tensor_at(e)?;
    let v: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    Ok(Array::from_slice(&v, &e.shape))
}

/// Runs the gate on `goldens/train/<model>`; `perturb` may change the optimizer before
/// the run (the planted-defect check).
pub fn run(model: &str, perturb: impl FnOnce(&mut AdamW)) -> Result<TrainReport, ParityError> {
    let golden = TensorGolden::open(&format!("train/{model}"))?;
    let settings = &golden.index["settings"];
    let dir = crate::goldens::model_dir(model)?;
    let m = engine::model::load(&dir)?;
    let config = AdapterConfig {
        fine_tune_type: "lora".into(),
        num_layers: field(settings, "num_layers")?,
        lora_parameters: field::<LoraParams>(settings, "lora_parameters")?,
        extra: Default::default(),
    };
    let adapters =
        Adapters::attach(m.as_ref(), config, 0).map_err(|e| ParityError::Index(e.to_string()))?;
    let names = adapters.names();
    let by_name = |list: &[Value], prefix: &str| -> Result<Vec<TensorEntry>, ParityError> {
        names
            .iter()
            .map(|n| {
                let want = format!("{prefix}{n}");
                list.iter()
                    .find(|e| e["name"] == want.as_str())
                    .ok_or_else(|| ParityError::Index(format!("no tensor `{want}`")))
                    .and_then(|e| {
                        serde_json::from_value(e.clone())
                            .map_err(|e| ParityError::Index(e.to_string()))
                    })
            })
            .collect()
    };
    let initial: Vec<Value> = field(&golden.index, "initial")?;
    let init: Vec<Array> = by_name(&initial, "init/")?
        .iter()
        .map(|e| f32_array(&golden, e))
        .collect::<Result<_, _>>()?;
    adapters.set(&init);
    let batch: Vec<Vec<i32>> = field(&golden.index, "batch")?;
    let lengths: Vec<Vec<i32>> = field(&golden.index, "lengths")?;
    let flat = |rows: &[Vec<i32>]| {
        let shape = [rows.len() as i32, rows[0].len() as i32];
        Array::from_slice(&rows.concat(), &shape)
    };
    let (batch, lengths) = (flat(&batch), flat(&lengths));
    let opt_cfg = &settings["optimizer"];
    let mut opt = AdamW::new(
        Schedule::Constant(field(opt_cfg, "learning_rate")?),
        field(opt_cfg, "weight_decay")?,
    );
    perturb(&mut opt);
    let mut report = TrainReport::default();
    let check = |report: &mut TrainReport,
                 ours: &Array,
                 e: &TensorEntry,
                 what: String|
     -> Result<(), ParityError> {
        let (e, bytes) = golden.tensor_at(e)?;
        let cmp = compare(ours, &e, bytes)?;
        report.tensors += 1;
        report.max_abs_diff = report.max_abs_diff.max(cmp.max_abs_diff);
        if cmp.bit_exact {
            report.exact += 1;
        } else if report.first_failure.is_none() {
            report.first_failure = Some(what);
        }
        Ok(())
    };
    let steps: Vec<Value> = field(&golden.index, "steps")?;
    for (k, step) in steps.iter().enumerate() {
        let (loss, ntoks, grads) =
            engine::train::loss_and_grad(m.as_ref(), &adapters, &batch, &lengths)?;
        check(
            &mut report,
            &loss,
            &field(step, "loss")?,
            format!("step {k} loss"),
        )?;
        let want_ntoks: i64 = field(step, "ntoks")?;
        ntoks.eval()?;
        report.tensors += 1;
        if i64::from(ntoks.as_slice::<i32>()[0]) == want_ntoks {
            report.exact += 1;
        } else if report.first_failure.is_none() {
            report.first_failure = Some(format!("step {k} ntoks"));
        }
        let grad_list: Vec<Value> = field(step, "grads")?;
        for ((g, e), n) in grads
            .iter()
            .zip(by_name(&grad_list, &format!("step{k}/grad/"))?)
            .zip(&names)
        {
            check(&mut report, g, &e, format!("step {k} grad {n}"))?;
        }
        engine::train::apply_update(&mut opt, &adapters, &grads, &[])?;
        report.steps += 1;
    }
    let final_list: Vec<Value> = field(&golden.index, "final")?;
    for ((p, e), n) in adapters
        .params()
        .iter()
        .zip(by_name(&final_list, "final/")?)
        .zip(&names)
    {
        check(&mut report, p, &e, format!("final {n}"))?;
    }
    // Our adapter files hold what mlx-lm's hold: the same tensors under the same names and
    // the config fields its loader reads.
    let tmp = tempfile::tempdir().map_err(|e| ParityError::Index(e.to_string()))?;
    adapters
        .save(tmp.path())
        .map_err(|e| ParityError::Index(e.to_string()))?;
    let load = |dir: &std::path::Path| {
        Array::load_safetensors(dir.join("adapters.safetensors"))
            .map_err(|e| ParityError::Index(e.to_string()))
    };
    let (ours, theirs) = (load(tmp.path())?, load(&golden.dir.join("adapters"))?);
    let config = |dir: &std::path::Path| -> Result<Value, ParityError> {
        let v: Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join("adapter_config.json"))
                .map_err(|e| ParityError::Index(e.to_string()))?,
        )
        .map_err(|e| ParityError::Index(e.to_string()))?;
        Ok(json!([
            v["fine_tune_type"],
            v["num_layers"],
            v["lora_parameters"]
        ]))
    };
    let bytes = |a: &Array| crate::compare::values_and_bytes(a).ok().map(|x| x.1);
    report.tensors += 1;
    let same_files = ours.len() == theirs.len()
        && ours
            .iter()
            .all(|(k, a)| theirs.get(k).is_some_and(|b| bytes(a) == bytes(b)))
        && config(tmp.path())? == config(&golden.dir.join("adapters"))?;
    if same_files {
        report.exact += 1;
    } else if report.first_failure.is_none() {
        report.first_failure = Some("saved adapter files differ from mlx-lm's".into());
    }
    adapters.detach();
    // mlx-lm's saved adapters, loaded by us: the logits its loader gave.
    let fresh = engine::model::load(&dir)?;
    let loaded = Adapters::load(fresh.as_ref(), &golden.dir.join("adapters"))
        .map_err(|e| ParityError::Index(e.to_string()))?;
    let t = batch.shape()[1];
    let inputs = mlx_rs::ops::indexing::IndexOp::index(&batch, (.., ..t - 1));
    let logits = fresh.forward(&inputs, &mut fresh.make_caches())?;
    check(
        &mut report,
        &logits.as_dtype(mlx_rs::Dtype::Float32)?,
        &field(&golden.index, "adapted_logits")?,
        "logits with mlx-lm's saved adapters".into(),
    )?;
    loaded.detach();
    Ok(report)
}
