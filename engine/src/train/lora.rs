//! LoRA adapters in mlx-lm's form: attached to chosen linear layers of the last
//! `num_layers` blocks, A ~ U(±1/√in) of shape [in, rank] and B = 0 of shape [rank, out],
//! both f32, the update scaled by `scale`. Saved as mlx-lm saves them —
//! `adapters.safetensors` (`<layer path>.lora_a` / `.lora_b`) and `adapter_config.json`
//! (`fine_tune_type`, `num_layers`, `lora_parameters {rank, scale, dropout, keys}`) — so
//! `mlx_lm.generate --adapter-path` loads ours and we load theirs.

use std::collections::BTreeMap;
use std::path::Path;

use mlx_rs::{random, Array};
use serde::{Deserialize, Serialize};

use super::TrainError;
use crate::model::layers::{Linear, Lora};
use crate::model::LanguageModel;

/// mlx-lm's `lora_parameters` (its `scale` is the multiplier itself, not an alpha).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoraParams {
    pub rank: i32,
    pub scale: f32,
    #[serde(default)]
    pub dropout: f32,
    /// Linear names within a block (`self_attn.q_proj`, `mlp.down_proj`, …); none = all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keys: Option<Vec<String>>,
}

/// `adapter_config.json` as mlx-lm reads it (other fields it writes are kept as they are).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AdapterConfig {
    #[serde(default = "lora_kind")]
    pub fine_tune_type: String,
    pub num_layers: usize,
    pub lora_parameters: LoraParams,
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

fn lora_kind() -> String {
    "lora".into()
}

/// The attached adapters of one model, in layer order.
pub struct Adapters<'m> {
    pub config: AdapterConfig,
    slots: Vec<(String, &'m Linear)>,
}

/// Which layers a config selects: the linears of the last `num_layers` blocks whose name
/// ends in one of `keys`.
fn select<'m>(
    model: &'m dyn LanguageModel,
    config: &AdapterConfig,
) -> Result<Vec<(String, &'m Linear)>, TrainError> {
    let all = model.linears();
    if all.is_empty() {
        return Err(TrainError::Unsupported(format!(
            "LoRA is not available for model_type `{}` yet (llama, mistral, qwen2, qwen3, gemma3_text, gemma4_text are)",
            model.model_type()
        )));
    }
    let layer_of = |name: &str| -> Option<usize> {
        name.strip_prefix("model.layers.")?
            .split('.')
            .next()?
            .parse()
            .ok()
    };
    let blocks = all
        .iter()
        .filter_map(|(n, _)| layer_of(n))
        .max()
        .map_or(0, |m| m + 1);
    let first = blocks.saturating_sub(config.num_layers);
    let keys = &config.lora_parameters.keys;
    let chosen: Vec<_> = all
        .into_iter()
        .filter(|(n, _)| layer_of(n).is_some_and(|i| i >= first))
        .filter(|(n, _)| {
            keys.as_ref()
                .is_none_or(|ks| ks.iter().any(|k| n.ends_with(&format!(".{k}"))))
        })
        .collect();
    if chosen.is_empty() {
        return Err(TrainError::Config(format!(
            "lora_parameters.keys {keys:?} match no linear layer of this model"
        )));
    }
    Ok(chosen)
}

impl<'m> Adapters<'m> {
    /// Attaches fresh adapters: A drawn from `seed`'s key sequence (one split per layer,
    /// in layer order), B zero.
    pub fn attach(
        model: &'m dyn LanguageModel,
        config: AdapterConfig,
        seed: u64,
    ) -> Result<Self, TrainError> {
        let slots = select(model, &config)?;
        let r = config.lora_parameters.rank;
        let mut key = random::key(seed)?;
        for (_, linear) in &slots {
            let (next, sub) = random::split(&key, 2)?;
            key = next;
            let bound = 1.0 / (linear.input_dims() as f32).sqrt();
            let a = random::uniform::<_, f32>(-bound, bound, &[linear.input_dims(), r], &sub)?;
            let b = mlx_rs::ops::zeros::<f32>(&[r, linear.output_dims()])?;
            *linear.lora.borrow_mut() = Some(Lora {
                a,
                b,
                scale: config.lora_parameters.scale,
                dropout: None,
            });
        }
        Ok(Adapters { config, slots })
    }

    /// Loads adapters from a directory mlx-lm (or we) wrote.
    pub fn load(model: &'m dyn LanguageModel, dir: &Path) -> Result<Self, TrainError> {
        let path = dir.join("adapter_config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| TrainError::Io(path.clone(), e))?;
        let config: AdapterConfig = serde_json::from_str(&text)
            .map_err(|e| TrainError::Config(format!("{}: {e}", path.display())))?;
        if config.fine_tune_type != "lora" {
            return Err(TrainError::Unsupported(format!(
                "fine_tune_type `{}` (only lora adapters load)",
                config.fine_tune_type
            )));
        }
        let file = dir.join("adapters.safetensors");
        let tensors = Array::load_safetensors(&file)
            .map_err(|e| TrainError::Config(format!("{}: {e}", file.display())))?;
        let adapters = Adapters {
            slots: select(model, &config)?,
            config,
        };
        let scale = adapters.config.lora_parameters.scale;
        for (name, linear) in &adapters.slots {
            let get = |part: &str| {
                let key = format!("{name}.{part}");
                tensors.get(&key).cloned().ok_or_else(|| {
                    TrainError::Config(format!("{} has no tensor `{key}`", file.display()))
                })
            };
            *linear.lora.borrow_mut() = Some(Lora {
                a: get("lora_a")?,
                b: get("lora_b")?,
                scale,
                dropout: None,
            });
        }
        Ok(adapters)
    }

    /// Parameter names in `params` order: `<layer>.lora_a`, `<layer>.lora_b` per layer.
    pub fn names(&self) -> Vec<String> {
        self.slots
            .iter()
            .flat_map(|(n, _)| [format!("{n}.lora_a"), format!("{n}.lora_b")])
            .collect()
    }

    /// The trainable arrays: A then B of every layer.
    pub fn params(&self) -> Vec<Array> {
        self.slots
            .iter()
            .flat_map(|(_, l)| {
                let lora = l.lora.borrow();
                let lora = lora.as_ref().expect("attached");
                [lora.a.clone(), lora.b.clone()]
            })
            .collect()
    }

    /// Positions in `params` of the adapters on blocks `layers`.
    pub fn params_in_layers(&self, layers: &std::ops::Range<usize>) -> Vec<usize> {
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, (n, _))| {
                n.strip_prefix("model.layers.")
                    .and_then(|r| r.split('.').next())
                    .and_then(|i| i.parse::<usize>().ok())
                    .is_some_and(|i| layers.contains(&i))
            })
            .flat_map(|(i, _)| [2 * i, 2 * i + 1])
            .collect()
    }

    /// Replaces some trainable arrays: `values[k]` goes to position `at[k]` of `params`.
    pub fn set_some(&self, at: &[usize], values: &[Array]) {
        for (&k, v) in at.iter().zip(values) {
            let (_, l) = &self.slots[k / 2];
            if let Some(lora) = l.lora.borrow_mut().as_mut() {
                if k % 2 == 0 {
                    lora.a = v.clone();
                } else {
                    lora.b = v.clone();
                }
            }
        }
    }

    /// Replaces the trainable arrays (same order as `params`).
    pub fn set(&self, params: &[Array]) {
        for ((_, l), ab) in self.slots.iter().zip(params.chunks(2)) {
            if let Some(lora) = l.lora.borrow_mut().as_mut() {
                lora.a = ab[0].clone();
                lora.b = ab[1].clone();
            }
        }
    }

    /// Writes `adapters.safetensors` and `adapter_config.json` into `dir` (each atomically).
    pub fn save(&self, dir: &Path) -> Result<(), TrainError> {
        std::fs::create_dir_all(dir).map_err(|e| TrainError::Io(dir.to_path_buf(), e))?;
        // Sorted, so the same adapters always make the same file.
        let tensors: BTreeMap<String, Array> =
            self.names().into_iter().zip(self.params()).collect();
        let tmp = dir.join(".adapters.tmp.safetensors");
        Array::save_safetensors(tensors.iter(), None, &tmp)
            .map_err(|e| TrainError::Config(format!("{}: {e}", tmp.display())))?;
        let file = dir.join("adapters.safetensors");
        std::fs::rename(&tmp, &file).map_err(|e| TrainError::Io(file, e))?;
        let config = serde_json::to_string_pretty(&self.config).expect("serializable");
        crate::train::write_atomic(&dir.join("adapter_config.json"), config.as_bytes())
    }

    /// Gives every adapter this step's dropout key (derived from `seed`, the step and the
    /// layer), so a run's masks are reproducible; nothing to do without dropout.
    pub fn seed_dropout(&self, seed: u64, step: u64) -> Result<(), TrainError> {
        let p = self.config.lora_parameters.dropout;
        if p <= 0.0 {
            return Ok(());
        }
        let mut key = random::key(seed.wrapping_mul(0x9E37_79B9).wrapping_add(step))?;
        for (_, l) in &self.slots {
            let (next, sub) = random::split(&key, 2)?;
            key = next;
            if let Some(lora) = l.lora.borrow_mut().as_mut() {
                lora.dropout = Some((p, sub));
            }
        }
        Ok(())
    }

    /// Removes the adapters from the model.
    pub fn detach(self) {
        for (_, l) in &self.slots {
            *l.lora.borrow_mut() = None;
        }
    }
}
