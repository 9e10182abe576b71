//! LoRA adapters in mlx-lm's form: attached to chosen linear layers of the last
//! `num_layers` blocks, A ~ U(±1/√in) of shape [in, rank] and B = 0 of shape [rank, out],
//! both f32, the update scaled by `scale`; on stacked experts (`SwitchLinear`) one pair per
//! expert, A [experts, rank, in] and B [experts, out, rank] (mlx-lm's `LoRASwitchLinear`). Saved as mlx-lm saves them —
//! `adapters.safetensors` (`<layer path>.lora_a` / `.lora_b`) and `adapter_config.json`
//! (`fine_tune_type`, `num_layers`, `lora_parameters {rank, scale, dropout, keys}`) — so
//! `mlx_lm.generate --adapter-path` loads ours and we load theirs.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::path::Path;

use mlx_rs::{random, Array};
use serde::{Deserialize, Serialize};

use super::TrainError;
use crate::model::layers::{Linear, Lora};
use crate::model::moe::SwitchLinear;
use crate::model::LanguageModel;

pub use crate::model::layers::dora;
mod full;
mod owned;
pub use owned::{apply, OwnedAdapter};

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

impl AdapterConfig {
    /// LoRA of `rank` on every linear of the last `num_layers` blocks, with mlx-lm's
    /// defaults otherwise (scale 20, no dropout).
    pub fn lora(num_layers: usize, rank: i32) -> Self {
        AdapterConfig {
            fine_tune_type: lora_kind(),
            num_layers,
            lora_parameters: LoraParams {
                rank,
                scale: 20.0,
                dropout: 0.0,
                keys: None,
            },
            extra: Default::default(),
        }
    }
}

/// One adapted layer: where its adapter lives and the shapes of A and B — [in, rank] and
/// [rank, out] on a linear (`LoRALinear`), [experts, rank, in] and [experts, out, rank] on
/// stacked experts (`LoRASwitchLinear`).
struct Slot<'m> {
    lora: &'m RefCell<Option<Lora>>,
    /// The linear (None: stacked experts), whose weight DoRA's magnitude starts from.
    linear: Option<&'m Linear>,
    input_dims: i32,
    a_shape: Vec<i32>,
    b_shape: Vec<i32>,
}

impl<'m> Slot<'m> {
    fn linear(l: &'m Linear, rank: i32) -> Self {
        let (i, o) = (l.input_dims(), l.output_dims());
        Slot {
            lora: &l.lora,
            linear: Some(l),
            input_dims: i,
            a_shape: vec![i, rank],
            b_shape: vec![rank, o],
        }
    }

    fn switch(s: &'m SwitchLinear, rank: i32) -> Self {
        let (i, o, e) = (s.input_dims(), s.output_dims(), s.num_experts());
        Slot {
            lora: &s.lora,
            linear: None,
            input_dims: i,
            a_shape: vec![e, rank, i],
            b_shape: vec![e, o, rank],
        }
    }
}

/// The attached adapters of one model, in layer order.
pub struct Adapters<'m> {
    pub config: AdapterConfig,
    slots: Vec<(String, Slot<'m>)>,
    /// Full fine-tuning (`fine_tune_type: "full"`): the blocks' own weights, no slots.
    full: Option<full::Full<'m>>,
}

/// The block a layer path belongs to: `model.layers.{i}.…` (Mamba-2's and Nemotron-H's
/// `backbone.layers.{i}.…`), under a wrapper `language_model.model.layers.{i}.…` (Gemma
/// 3n's `model.language_model.layers.{i}.…`).
fn layer_index(name: &str) -> Option<usize> {
    let name = name.strip_prefix("language_model.").unwrap_or(name);
    [
        "model.layers.",
        "backbone.layers.",
        "model.language_model.layers.",
    ]
    .iter()
    .find_map(|p| name.strip_prefix(p))?
    .split('.')
    .next()?
    .parse()
    .ok()
}

/// Which layers a config selects: the linears and stacked experts of the last `num_layers`
/// blocks whose path ends in one of `keys` (no keys: all of them, mlx-lm's default).
fn select<'m>(
    model: &'m dyn LanguageModel,
    config: &AdapterConfig,
) -> Result<Vec<(String, Slot<'m>)>, TrainError> {
    let rank = config.lora_parameters.rank;
    let mut all: Vec<(String, Slot<'m>)> = model
        .linears()
        .into_iter()
        .map(|(n, l)| (n, Slot::linear(l, rank)))
        .chain(
            model
                .switch_linears()
                .into_iter()
                .map(|(n, s)| (n, Slot::switch(s, rank))),
        )
        .collect();
    let gated = crate::model::registry::has(model.model_type(), |f| f.lora);
    if all.is_empty() || !gated {
        return Err(TrainError::Unsupported(refusal(model.model_type())));
    }
    if let Some(why) = read_as_weights(model.model_type(), keys_of(config)) {
        return Err(TrainError::Unsupported(why));
    }
    // Stable: blocks in order, each block's linears before its experts.
    all.sort_by_key(|(n, _)| layer_index(n));
    let blocks = all
        .iter()
        .filter_map(|(n, _)| layer_index(n))
        .max()
        .map_or(0, |m| m + 1);
    let first = blocks.saturating_sub(config.num_layers);
    let keys = &config.lora_parameters.keys;
    let chosen: Vec<_> = all
        .into_iter()
        .filter(|(n, _)| layer_index(n).is_some_and(|i| i >= first))
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
    check_kind(config, &chosen)?;
    Ok(chosen)
}

/// The fine-tune types that attach here (`lora`, `dora`), and DoRA only on linears: mlx-lm
/// 0.32.2 raises "SwitchLinear doesn't support DoRA yet" on stacked experts.
fn check_kind(config: &AdapterConfig, chosen: &[(String, Slot)]) -> Result<(), TrainError> {
    match config.fine_tune_type.as_str() {
        "lora" => Ok(()),
        "dora" => match chosen.iter().find(|(_, s)| s.linear.is_none()) {
            None => Ok(()),
            Some((name, _)) => Err(TrainError::Unsupported(format!(
                "DoRA on stacked experts (`{name}`) is not available: mlx-lm 0.32.2 has no \
                 DoRA for SwitchLinear; use --fine-tune-type lora, or --lora-keys naming \
                 the block's other linears"
            ))),
        },
        other => Err(TrainError::Unsupported(format!(
            "fine_tune_type `{other}` does not attach adapters (lora and dora do)"
        ))),
    }
}

/// Linears of a block that mlx-lm 0.32.2's LoRA cannot wrap, per family: its gemma3n AltUp
/// reads `prediction_coefs.weight` / `correction_coefs.weight` instead of calling the layers,
/// so once its default keys (every Linear of a block) make them LoRA layers its trainer
/// fails on the first forward. They are not listed as linears here either.
const READ_AS_WEIGHTS: &[(&str, &[&str])] = &[(
    "gemma3n",
    &["altup.prediction_coefs", "altup.correction_coefs"],
)];

fn keys_of(config: &AdapterConfig) -> Option<&[String]> {
    config.lora_parameters.keys.as_deref()
}

/// The refusal of a key set that would adapt a linear mlx-lm cannot wrap (no keys: its
/// default, every Linear of a block): the cause and the keys that work.
fn read_as_weights(model_type: &str, keys: Option<&[String]>) -> Option<String> {
    let (_, unwrappable) = READ_AS_WEIGHTS.iter().find(|(t, _)| *t == model_type)?;
    let hit = match keys {
        None => true,
        Some(ks) => ks.iter().any(|k| unwrappable.contains(&k.as_str())),
    };
    hit.then(|| {
        format!(
            "LoRA on {} of `{model_type}` is not available: mlx-lm 0.32.2 reads those layers' \
             weights directly, so its trainer fails when they are adapted (which its default \
             keys, every linear of a block, do); name the layers to adapt without them, e.g. \
             --lora-keys self_attn.q_proj,self_attn.k_proj,self_attn.v_proj,self_attn.o_proj,\
             mlp.gate_proj,mlp.up_proj,mlp.down_proj,altup.modality_router,laurel.linear_left,\
             laurel.linear_right,per_layer_input_gate,per_layer_projection",
            unwrappable.join(" / ")
        )
    })
}

/// Why a model cannot be fine-tuned: its family is not gated against mlx-lm's trainer (the
/// registry's `lora`), or it lists no layers LoRA attaches to.
fn refusal(model_type: &str) -> String {
    crate::model::registry::refusal(model_type, crate::model::registry::Capability::Lora)
}

/// One layer of an adapter directory as `read` checked it: its path, where it sits in the
/// model, its adapter (not yet attached).
type Read<'m> = (String, Slot<'m>, Lora);

/// An adapter directory's `adapter_config.json` (a directory without one is refused).
pub(crate) fn read_config(dir: &Path) -> Result<AdapterConfig, TrainError> {
    let path = dir.join("adapter_config.json");
    if !path.is_file() {
        return Err(TrainError::Config(format!(
            "{} is not an adapter directory: it has no adapter_config.json (an adapter \
             directory, as mlx_lm.lora or `engine train` writes it, holds adapter_config.json \
             and adapters.safetensors)",
            dir.display()
        )));
    }
    let text = std::fs::read_to_string(&path).map_err(|e| TrainError::Io(path.clone(), e))?;
    serde_json::from_str(&text).map_err(|e| TrainError::Config(format!("{}: {e}", path.display())))
}

/// Reads an adapter directory mlx-lm (or we) wrote — `adapter_config.json` and
/// `adapters.safetensors` — and checks it against `model`: a LoRA config whose layers this
/// model has, every tensor present with the shape its layer takes. Each selected layer with
/// its adapter, not yet attached. Shared by `Adapters::load` and `OwnedAdapter::load`.
fn read<'m>(
    model: &'m dyn LanguageModel,
    dir: &Path,
) -> Result<(AdapterConfig, Vec<Read<'m>>), TrainError> {
    let config = read_config(dir)?;
    if config.fine_tune_type == "full" {
        return Err(TrainError::Unsupported(format!(
            "{}: fully fine-tuned weights (fine_tune_type full) replace the base model's own \
             and cannot be switched per request; load them with `engine generate \
             --adapter-path`",
            dir.display()
        )));
    }
    let file = dir.join("adapters.safetensors");
    let tensors = Array::load_safetensors(&file)
        .map_err(|e| TrainError::Config(format!("{}: {e}", file.display())))?;
    let scale = config.lora_parameters.scale;
    let mut layers = Vec::new();
    for (name, slot) in select(model, &config)? {
        let get = |part: &str, shape: &[i32]| {
            let key = format!("{name}.{part}");
            let t = tensors.get(&key).cloned().ok_or_else(|| {
                TrainError::Config(format!(
                    "{} has no tensor `{key}`: the adapter was not trained for this model",
                    file.display()
                ))
            })?;
            if t.shape() != shape {
                return Err(TrainError::Config(format!(
                    "{}: `{key}` has shape {:?}, the model's layer takes {shape:?}: the adapter \
                     was trained for another model",
                    file.display(),
                    t.shape()
                )));
            }
            Ok(t)
        };
        let m = match config.fine_tune_type == "dora" {
            true => Some(get("m", &slot.b_shape[1..])?),
            false => None,
        };
        let lora = Lora {
            a: get("lora_a", &slot.a_shape)?,
            b: get("lora_b", &slot.b_shape)?,
            scale,
            dropout: None,
            m,
        };
        layers.push((name, slot, lora));
    }
    Ok((config, layers))
}

impl<'m> Adapters<'m> {
    /// Attaches fresh adapters: A ~ U(±1/√in) drawn from `seed`'s key sequence (one split
    /// per layer, in layer order), B zero.
    pub fn attach(
        model: &'m dyn LanguageModel,
        config: AdapterConfig,
        seed: u64,
    ) -> Result<Self, TrainError> {
        if config.fine_tune_type == "full" {
            let full = Some(full::Full::select(model, &config)?);
            return Ok(Adapters {
                config,
                slots: Vec::new(),
                full,
            });
        }
        let slots = select(model, &config)?;
        let mut key = random::key(seed)?;
        for (_, slot) in &slots {
            let (next, sub) = random::split(&key, 2)?;
            key = next;
            let bound = 1.0 / (slot.input_dims as f32).sqrt();
            let a = random::uniform::<_, f32>(-bound, bound, &slot.a_shape[..], &sub)?;
            let b = mlx_rs::ops::zeros::<f32>(&slot.b_shape[..])?;
            let m = match (config.fine_tune_type.as_str(), slot.linear) {
                ("dora", Some(linear)) => Some(dora::magnitude(linear)?),
                _ => None,
            };
            *slot.lora.borrow_mut() = Some(Lora {
                a,
                b,
                scale: config.lora_parameters.scale,
                dropout: None,
                m,
            });
        }
        Ok(Adapters {
            config,
            slots,
            full: None,
        })
    }

    /// Loads adapters from a directory mlx-lm (or we) wrote (`read`) and attaches them;
    /// fully fine-tuned blocks' weights replace the model's (`full::Full::load`).
    pub fn load(model: &'m dyn LanguageModel, dir: &Path) -> Result<Self, TrainError> {
        let config = read_config(dir)?;
        if config.fine_tune_type == "full" {
            let full = Some(full::Full::load(model, &config, dir)?);
            return Ok(Adapters {
                config,
                slots: Vec::new(),
                full,
            });
        }
        let (config, layers) = read(model, dir)?;
        let slots = layers
            .into_iter()
            .map(|(name, slot, lora)| {
                *slot.lora.borrow_mut() = Some(lora);
                (name, slot)
            })
            .collect();
        Ok(Adapters {
            config,
            slots,
            full: None,
        })
    }

    /// The trainable arrays of each layer: A and B, and DoRA's magnitude m.
    fn per_layer(&self) -> usize {
        match self.config.fine_tune_type == "dora" {
            true => 3,
            false => 2,
        }
    }

    /// Parameter names in `params` order: `<layer>.lora_a`, `<layer>.lora_b` (and DoRA's
    /// `<layer>.m`) per layer.
    pub fn names(&self) -> Vec<String> {
        if let Some(full) = &self.full {
            return full.names();
        }
        let parts = &["lora_a", "lora_b", "m"][..self.per_layer()];
        self.slots
            .iter()
            .flat_map(|(n, _)| parts.iter().map(move |p| format!("{n}.{p}")))
            .collect()
    }

    /// The trainable arrays: A then B (then m) of every layer.
    pub fn params(&self) -> Vec<Array> {
        if let Some(full) = &self.full {
            return full.params();
        }
        let per = self.per_layer();
        self.slots
            .iter()
            .flat_map(|(_, slot)| {
                let lora = slot.lora.borrow();
                let lora = lora.as_ref().expect("attached");
                let mut all = vec![lora.a.clone(), lora.b.clone()];
                all.extend(lora.m.iter().cloned());
                all.truncate(per);
                all
            })
            .collect()
    }

    /// Positions in `params` of the adapters on blocks `layers`.
    pub fn params_in_layers(&self, layers: &std::ops::Range<usize>) -> Vec<usize> {
        if let Some(full) = &self.full {
            return full.params_in_layers(layers);
        }
        let per = self.per_layer();
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, (n, _))| layer_index(n).is_some_and(|i| layers.contains(&i)))
            .flat_map(|(i, _)| (per * i)..(per * i + per))
            .collect()
    }

    /// Replaces some trainable arrays: `values[k]` goes to position `at[k]` of `params`.
    pub fn set_some(&self, at: &[usize], values: &[Array]) {
        if let Some(full) = &self.full {
            return full.set_some(at, values);
        }
        let per = self.per_layer();
        for (&k, v) in at.iter().zip(values) {
            let (_, slot) = &self.slots[k / per];
            if let Some(lora) = slot.lora.borrow_mut().as_mut() {
                match k % per {
                    0 => lora.a = v.clone(),
                    1 => lora.b = v.clone(),
                    _ => lora.m = Some(v.clone()),
                }
            }
        }
    }

    /// Replaces the trainable arrays (same order as `params`).
    pub fn set(&self, params: &[Array]) {
        let at: Vec<usize> = (0..params.len()).collect();
        self.set_some(&at, params);
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
        for (_, slot) in &self.slots {
            let (next, sub) = random::split(&key, 2)?;
            key = next;
            if let Some(lora) = slot.lora.borrow_mut().as_mut() {
                lora.dropout = Some((p, sub));
            }
        }
        Ok(())
    }

    /// Runs `f` on the base model: every adapter is taken off for the call (fully
    /// fine-tuned blocks get their original weights) and put back after it (the reference
    /// log-probabilities of DPO and GRPO).
    pub fn without<T>(&self, f: impl FnOnce() -> T) -> T {
        if let Some(full) = &self.full {
            let trained = full.params();
            full.restore();
            let out = f();
            let at: Vec<usize> = (0..trained.len()).collect();
            full.set_some(&at, &trained);
            return out;
        }
        let taken: Vec<_> = self
            .slots
            .iter()
            .map(|(_, slot)| slot.lora.borrow_mut().take())
            .collect();
        let out = f();
        for ((_, slot), lora) in self.slots.iter().zip(taken) {
            *slot.lora.borrow_mut() = lora;
        }
        out
    }

    /// Removes the adapters from the model (fully fine-tuned blocks get their weights back).
    pub fn detach(self) {
        if let Some(full) = &self.full {
            full.restore();
        }
        for (_, slot) in &self.slots {
            *slot.lora.borrow_mut() = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{layer_index, refusal, AdapterConfig, Adapters};
    use crate::cache::Cache;
    use mlx_rs::{error::Exception, Array};

    /// A model that lists no adaptable layers.
    struct Bare;

    impl crate::model::LanguageModel for Bare {
        fn model_type(&self) -> &str {
            "gpt_oss"
        }
        fn activation_dtype(&self) -> mlx_rs::Dtype {
            mlx_rs::Dtype::Float32
        }
        fn vocab_size(&self) -> usize {
            1
        }
        fn make_caches(&self) -> Vec<Box<dyn Cache>> {
            Vec::new()
        }
        fn forward(&self, ids: &Array, _: &mut [Box<dyn Cache>]) -> Result<Array, Exception> {
            Ok(ids.clone())
        }
    }

    #[test]
    fn a_model_without_adaptable_layers_is_refused_by_name() {
        let config = AdapterConfig::lora(16, 8);
        let err = Adapters::attach(&Bare, config, 0)
            .err()
            .unwrap()
            .to_string();
        assert_eq!(err, refusal("gpt_oss"));
        assert!(err.starts_with("LoRA is not available for this `gpt_oss` model yet"));
        assert!(err.contains("phi3, qwen3_moe, mixtral, qwen2_moe"), "{err}");
    }

    #[test]
    fn gemma3n_altup_coefficients_are_refused_as_mlx_lm_fails_on_them() {
        let why = super::read_as_weights("gemma3n", None).unwrap();
        assert!(
            why.contains("altup.prediction_coefs / altup.correction_coefs"),
            "{why}"
        );
        assert!(why.contains("--lora-keys self_attn.q_proj"), "{why}");
        let named = ["altup.correction_coefs".to_owned()];
        assert!(super::read_as_weights("gemma3n", Some(&named)).is_some());
        let fine = ["laurel.linear_left".to_owned()];
        assert_eq!(super::read_as_weights("gemma3n", Some(&fine)), None);
        assert_eq!(super::read_as_weights("llama", None), None);
    }

    #[test]
    fn layer_paths_with_and_without_the_wrapper_prefix() {
        assert_eq!(layer_index("model.layers.3.self_attn.q_proj"), Some(3));
        let wrapped = "language_model.model.layers.12.mlp.switch_mlp.up_proj";
        assert_eq!(layer_index(wrapped), Some(12));
        assert_eq!(layer_index("backbone.layers.4.mixer.in_proj"), Some(4));
        let gemma3n = "model.language_model.layers.2.laurel.linear_left";
        assert_eq!(layer_index(gemma3n), Some(2));
        assert_eq!(layer_index("lm_head"), None);
        assert_eq!(layer_index("vision_tower.model.layers.0.fc"), None);
    }
}
