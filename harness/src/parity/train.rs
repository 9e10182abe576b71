//! The LoRA training gate: our adapters, SFT loss, autodiff gradients and AdamW against
//! mlx-lm's (oracles/gen_train.py: `linear_to_lora_layers`, `default_loss`,
//! `nn.value_and_grad`, `optim.AdamW`, eager) on each of its models — from the golden's
//! initial adapters, every step's loss, token count and every gradient, and the adapters
//! after the last update, bit for bit; then mlx-lm's saved adapters loaded by us give the
//! logits `mlx_lm.utils.load_adapters` gave, bit for bit (of the batch and, in goldens that
//! have it, of a short input: the MoE experts' unsorted path).

use std::path::Path;

use engine::model::LanguageModel;
use engine::train::lora::{AdapterConfig, Adapters, LoraParams};
use engine::train::optim::{AdamW, Schedule};
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;
use serde_json::{json, Value};

use super::{ParityError, Report};
use crate::compare::compare;
use crate::goldens::{TensorEntry, TensorGolden};

#[derive(Debug, Clone, Default)]
pub struct TrainReport {
    /// The fine-tune type (`lora`, `dora`).
    pub kind: String,
    pub model: String,
    pub tensors: usize,
    pub exact: usize,
    pub max_abs_diff: f64,
    pub steps: usize,
    pub first_failure: Option<String>,
}

impl Report for TrainReport {
    fn passed(&self) -> bool {
        self.tensors > 0 && self.exact == self.tensors
    }

    fn summary(&self) -> String {
        format!(
            "L1 train ({}) {}: {} steps: {}/{} tensors bit-exact (losses, gradients, adapters, \
             adapted logits; max |Δ| {:e}){}",
            self.kind,
            self.model,
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

impl TrainReport {
    /// Counts one tensor (or value) that is `exact` or not; `what` names a first failure.
    fn count(&mut self, exact: bool, what: impl FnOnce() -> String) {
        self.tensors += 1;
        if exact {
            self.exact += 1;
        } else if self.first_failure.is_none() {
            self.first_failure = Some(what());
        }
    }
}

fn field<T: serde::de::DeserializeOwned>(v: &Value, key: &str) -> Result<T, ParityError> {
    serde_json::from_value(v[key].clone()).map_err(|e| ParityError::Index(format!("{key}: {e}")))
}

fn index_err(e: impl std::fmt::Display) -> ParityError {
    ParityError::Index(e.to_string())
}

/// The golden and what the run found so far.
struct Check<'g> {
    golden: &'g TensorGolden,
    report: TrainReport,
}

impl Check<'_> {
    fn tensor(&mut self, ours: &Array, e: &TensorEntry, what: String) -> Result<(), ParityError> {
        let (e, bytes) = self.golden.tensor_at(e)?;
        let cmp = compare(ours, &e, bytes)?;
        self.report.max_abs_diff = self.report.max_abs_diff.max(cmp.max_abs_diff);
        self.report.count(cmp.bit_exact, || what);
        Ok(())
    }

    fn f32_array(&self, e: &TensorEntry) -> Result<Array, ParityError> {
        let (e, bytes) = self.golden.tensor_at(e)?;
        let v: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        Ok(Array::from_slice(&v, &e.shape))
    }

    /// The golden's tensors `<prefix><adapter name>` from `list`, in `names` order.
    fn by_name(
        list: &[Value],
        names: &[String],
        prefix: &str,
    ) -> Result<Vec<TensorEntry>, ParityError> {
        names
            .iter()
            .map(|n| {
                let want = format!("{prefix}{n}");
                let e = list
                    .iter()
                    .find(|e| e["name"] == want.as_str())
                    .ok_or_else(|| ParityError::Index(format!("no tensor `{want}`")))?;
                serde_json::from_value(e.clone()).map_err(index_err)
            })
            .collect()
    }

    /// DoRA's magnitudes as we start them (from the weights' row norms) against mlx-lm's
    /// initial `m` (A is drawn from another RNG and B is zero: only m can be compared).
    fn initial_magnitudes(
        &mut self,
        adapters: &Adapters,
        initial: &[Value],
    ) -> Result<(), ParityError> {
        let names = adapters.names();
        let entries = Self::by_name(initial, &names, "init/")?;
        for ((p, e), n) in adapters.params().iter().zip(entries).zip(&names) {
            if n.ends_with(".m") {
                self.tensor(p, &e, format!("initial magnitude {n}"))?;
            }
        }
        Ok(())
    }

    /// Every step: loss, token count and gradients, then the AdamW update.
    fn steps(
        &mut self,
        m: &dyn LanguageModel,
        adapters: &Adapters,
        opt: &mut AdamW,
    ) -> Result<(), ParityError> {
        let index = &self.golden.index;
        let rows = |key: &str| -> Result<Array, ParityError> {
            let rows: Vec<Vec<i32>> = field(index, key)?;
            let shape = [rows.len() as i32, rows[0].len() as i32];
            Ok(Array::from_slice(&rows.concat(), &shape))
        };
        let (batch, lengths) = (rows("batch")?, rows("lengths")?);
        let names = adapters.names();
        let steps: Vec<Value> = field(index, "steps")?;
        for (k, step) in steps.iter().enumerate() {
            let (loss, ntoks, grads) = engine::train::loss_and_grad(m, adapters, &batch, &lengths)?;
            self.tensor(&loss, &field(step, "loss")?, format!("step {k} loss"))?;
            let want_ntoks: i64 = field(step, "ntoks")?;
            ntoks.eval()?;
            let same = i64::from(ntoks.as_slice::<i32>()[0]) == want_ntoks;
            self.report.count(same, || format!("step {k} ntoks"));
            let grad_list: Vec<Value> = field(step, "grads")?;
            let entries = Self::by_name(&grad_list, &names, &format!("step{k}/grad/"))?;
            for ((g, e), n) in grads.iter().zip(entries).zip(&names) {
                self.tensor(g, &e, format!("step {k} grad {n}"))?;
            }
            engine::train::apply_update(opt, adapters, &grads, &[])?;
            self.report.steps += 1;
        }
        Ok(())
    }

    /// The adapters after the last update, and the files we save from them against the ones
    /// mlx-lm saved: the same tensors under the same names and the config fields its loader
    /// reads.
    fn final_adapters(&mut self, adapters: &Adapters) -> Result<(), ParityError> {
        let names = adapters.names();
        let final_list: Vec<Value> = field(&self.golden.index, "final")?;
        let entries = Self::by_name(&final_list, &names, "final/")?;
        for ((p, e), n) in adapters.params().iter().zip(entries).zip(&names) {
            self.tensor(p, &e, format!("final {n}"))?;
        }
        let tmp = tempfile::tempdir().map_err(index_err)?;
        adapters.save(tmp.path()).map_err(index_err)?;
        let load = |dir: &Path| {
            Array::load_safetensors(dir.join("adapters.safetensors")).map_err(index_err)
        };
        let config = |dir: &Path| -> Result<Value, ParityError> {
            let text =
                std::fs::read_to_string(dir.join("adapter_config.json")).map_err(index_err)?;
            let v: Value = serde_json::from_str(&text).map_err(index_err)?;
            Ok(json!([
                v["fine_tune_type"],
                v["num_layers"],
                v["lora_parameters"]
            ]))
        };
        let theirs_dir = self.golden.dir.join("adapters");
        let (ours, theirs) = (load(tmp.path())?, load(&theirs_dir)?);
        let bytes = |a: &Array| crate::compare::values_and_bytes(a).ok().map(|x| x.1);
        let same_files = ours.len() == theirs.len()
            && ours
                .iter()
                .all(|(k, a)| theirs.get(k).is_some_and(|b| bytes(a) == bytes(b)))
            && config(tmp.path())? == config(&theirs_dir)?;
        self.report.count(same_files, || {
            "saved adapter files differ from mlx-lm's".into()
        });
        Ok(())
    }

    /// mlx-lm's saved adapters, loaded by us: the logits its loader gave.
    fn adapted_logits(&mut self, dir: &Path) -> Result<(), ParityError> {
        let fresh = engine::model::load(dir)?;
        let loaded =
            Adapters::load(fresh.as_ref(), &self.golden.dir.join("adapters")).map_err(index_err)?;
        let rows: Vec<Vec<i32>> = field(&self.golden.index, "batch")?;
        let shape = [rows.len() as i32, rows[0].len() as i32];
        let batch = Array::from_slice(&rows.concat(), &shape);
        let inputs = batch.index((.., ..shape[1] - 1));
        let logits = fresh.forward(&inputs, &mut fresh.make_caches())?;
        let want = field(&self.golden.index, "adapted_logits")?;
        let what = "logits with mlx-lm's saved adapters".into();
        self.tensor(&logits.as_dtype(mlx_rs::Dtype::Float32)?, &want, what)?;
        // Goldens since the MoE rows add a short input (the experts' unsorted path).
        if let Some(want) = self.golden.index.get("adapted_logits_short") {
            let [rows, cols]: [i32; 2] = field(&self.golden.index, "short_input")?;
            let short = batch.index((..rows, ..cols));
            let logits = fresh.forward(&short, &mut fresh.make_caches())?;
            let want = serde_json::from_value(want.clone()).map_err(index_err)?;
            let what = "short-input logits with mlx-lm's saved adapters".into();
            self.tensor(&logits.as_dtype(mlx_rs::Dtype::Float32)?, &want, what)?;
        }
        loaded.detach();
        Ok(())
    }
}

/// Runs the gate on `golden`, the training golden of `model`: from its initial adapters,
/// every step, the final adapters and their files, then mlx-lm's adapters loaded by us.
/// `perturb` may change the optimizer before the run (the planted-defect check).
pub fn run(
    model: &str,
    golden: &TensorGolden,
    perturb: impl FnOnce(&mut AdamW),
) -> Result<TrainReport, ParityError> {
    let settings = &golden.index["settings"];
    let dir = crate::goldens::model_dir(model)?;
    let m = engine::model::load(&dir)?;
    let kind: Option<String> = field(settings, "fine_tune_type")?;
    let config = AdapterConfig {
        fine_tune_type: kind.unwrap_or_else(|| "lora".into()),
        num_layers: field(settings, "num_layers")?,
        lora_parameters: field::<LoraParams>(settings, "lora_parameters")?,
        extra: Default::default(),
    };
    let adapters = Adapters::attach(m.as_ref(), config, 0).map_err(index_err)?;
    let mut check = Check {
        golden,
        report: TrainReport {
            kind: adapters.config.fine_tune_type.clone(),
            model: model.to_owned(),
            ..Default::default()
        },
    };
    let initial: Vec<Value> = field(&golden.index, "initial")?;
    // Full fine-tuning starts from the model's own weights (no initial tensors stored).
    if adapters.config.fine_tune_type != "full" {
        let init: Vec<Array> = Check::by_name(&initial, &adapters.names(), "init/")?
            .iter()
            .map(|e| check.f32_array(e))
            .collect::<Result<_, _>>()?;
        check.initial_magnitudes(&adapters, &initial)?;
        adapters.set(&init);
    }
    let opt_cfg = &settings["optimizer"];
    let mut opt = AdamW::new(
        Schedule::Constant(field(opt_cfg, "learning_rate")?),
        field(opt_cfg, "weight_decay")?,
    );
    perturb(&mut opt);
    check.steps(m.as_ref(), &adapters, &mut opt)?;
    check.final_adapters(&adapters)?;
    adapters.detach();
    check.adapted_logits(&dir)?;
    Ok(check.report)
}
