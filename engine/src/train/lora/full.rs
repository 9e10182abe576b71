//! Full fine-tuning of chosen blocks, as mlx_lm.lora's `--fine-tune-type full` does it
//! (lora.py `train_model`: `model.freeze()`, then `layer.unfreeze()` for each of the last
//! `num_layers` blocks): every parameter of those blocks trainable, nothing else; saved as
//! mlx-lm saves them (`adapters.safetensors` holding the blocks' full weights under their
//! checkpoint names, `fine_tune_type: "full"`), loaded as `load_adapters` loads them
//! (`model.load_weights(..., strict=False)`: the stored weights replace the model's).
//!
//! The model's weights are MLX arrays the layers hold; training swaps what each array
//! refers to in place (`mlx_array_set` on the layer's own handle), so the forward the
//! engine decodes with runs on the traced or updated weights unchanged. Only families
//! whose blocks hold nothing but their `linears` (weights, biases) and the two norms
//! `block_norms` lists are accepted (checked by family): there the trainable set is
//! exactly mlx-lm's.

use std::ops::Range;
use std::path::Path;

use mlx_rs::Array;

use super::{layer_index, AdapterConfig};
use crate::model::LanguageModel;
use crate::plant::{self, Defect};
use crate::train::TrainError;

/// Families whose blocks' parameters are exactly their linears and the two Llama-named
/// norms (no q/k norms, no post norms, no experts, no recurrent state).
const FAMILIES: &[&str] = &["llama", "mistral", "qwen2"];

/// The trainable weights of the chosen blocks, and what they held before training.
pub struct Full<'m> {
    params: Vec<(String, &'m Array)>,
    originals: Vec<Array>,
}

/// Makes `dst` (a layer's own array) refer to `src`'s data, in place.
fn set_in_place(dst: &Array, src: &Array) {
    let mut handle = dst.as_ptr();
    // SAFETY: both handles are live; mlx-c assigns the C++ array behind `dst`'s context
    // (the layer's own handle keeps its context, which now refers to `src`'s data).
    unsafe {
        mlx_sys::mlx_array_set(&mut handle, src.as_ptr());
    }
}

impl<'m> Full<'m> {
    /// Every parameter of the last `num_layers` blocks, in block order.
    pub fn select(
        model: &'m dyn LanguageModel,
        config: &AdapterConfig,
    ) -> Result<Self, TrainError> {
        let t = model.model_type();
        if !FAMILIES.contains(&t) {
            return Err(TrainError::Unsupported(format!(
                "full fine-tuning of `{t}` is not available: it is built for the families \
                 whose blocks hold only linears and two norms ({}); use --fine-tune-type \
                 lora or dora",
                FAMILIES.join(", ")
            )));
        }
        let mut all: Vec<(String, &'m Array)> = Vec::new();
        for (n, l) in model.linears() {
            if l.quantized.is_some() {
                return Err(TrainError::Unsupported(format!(
                    "full fine-tuning of a quantized layer (`{n}`) is not available: train \
                     a dense base, or adapters (lora, dora) on this one"
                )));
            }
            all.push((format!("{n}.weight"), &l.weight));
            if let Some(b) = &l.bias {
                all.push((format!("{n}.bias"), b));
            }
        }
        if all.is_empty() {
            return Err(TrainError::Unsupported(format!(
                "full fine-tuning of `{t}`: this model lists no linear layers to train"
            )));
        }
        for (n, norm) in model.block_norms() {
            all.push((format!("{n}.weight"), &norm.weight));
        }
        all.sort_by_key(|(n, _)| layer_index(n));
        let blocks = all
            .iter()
            .filter_map(|(n, _)| layer_index(n))
            .max()
            .map_or(0, |m| m + 1);
        let mut first = blocks.saturating_sub(config.num_layers);
        if plant::is(Defect::FullOneLayerTooMany) {
            first = first.saturating_sub(1);
        }
        let params: Vec<_> = all
            .into_iter()
            .filter(|(n, _)| layer_index(n).is_some_and(|i| i >= first))
            .collect();
        let originals = params.iter().map(|(_, a)| (*a).clone()).collect();
        Ok(Full { params, originals })
    }

    /// The chosen blocks with the weights of an adapter directory mlx-lm (or we) wrote
    /// (`adapters.safetensors`), each checked against its layer's shape and dtype.
    pub fn load(
        model: &'m dyn LanguageModel,
        config: &AdapterConfig,
        dir: &Path,
    ) -> Result<Self, TrainError> {
        let full = Self::select(model, config)?;
        let file = dir.join("adapters.safetensors");
        let tensors = Array::load_safetensors(&file)
            .map_err(|e| TrainError::Config(format!("{}: {e}", file.display())))?;
        let mut values = Vec::with_capacity(full.params.len());
        for (name, a) in &full.params {
            let t = tensors.get(name).ok_or_else(|| {
                TrainError::Config(format!(
                    "{} has no tensor `{name}`: the weights were not trained for this model",
                    file.display()
                ))
            })?;
            if t.shape() != a.shape() || t.dtype() != a.dtype() {
                return Err(TrainError::Config(format!(
                    "{}: `{name}` is {:?} {:?}, the model's is {:?} {:?}: trained for another \
                     model",
                    file.display(),
                    t.dtype(),
                    t.shape(),
                    a.dtype(),
                    a.shape()
                )));
            }
            values.push(t.clone());
        }
        full.set_all(&values);
        Ok(full)
    }

    pub fn names(&self) -> Vec<String> {
        self.params.iter().map(|(n, _)| n.clone()).collect()
    }

    /// The current values (new handles: swapping the layers' arrays leaves them as they are).
    pub fn params(&self) -> Vec<Array> {
        self.params.iter().map(|(_, a)| (*a).clone()).collect()
    }

    pub fn params_in_layers(&self, layers: &Range<usize>) -> Vec<usize> {
        let in_range = |n: &str| layer_index(n).is_some_and(|i| layers.contains(&i));
        (0..self.params.len())
            .filter(|&k| in_range(&self.params[k].0))
            .collect()
    }

    pub fn set_some(&self, at: &[usize], values: &[Array]) {
        for (&k, v) in at.iter().zip(values) {
            set_in_place(self.params[k].1, v);
        }
    }

    fn set_all(&self, values: &[Array]) {
        let at: Vec<usize> = (0..values.len()).collect();
        self.set_some(&at, values);
    }

    /// Puts the weights back as they were before `select`.
    pub fn restore(&self) {
        self.set_all(&self.originals);
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use crate::train::lora::{AdapterConfig, Adapters, LoraParams};

    fn config(kind: &str) -> AdapterConfig {
        AdapterConfig {
            fine_tune_type: kind.into(),
            num_layers: 1,
            lora_parameters: LoraParams {
                rank: 4,
                scale: 20.0,
                dropout: 0.0,
                keys: None,
            },
            extra: Default::default(),
        }
    }

    /// What each fine-tune type refuses, and why: full on a family whose blocks hold more
    /// than linears and two norms, full on quantized layers, DoRA on stacked experts.
    #[test]
    fn refusals_name_the_cause_and_the_way_out() {
        let goldens = Path::new(env!("CARGO_MANIFEST_DIR")).join("../goldens/models");
        let refusal = |model: &str, kind: &str| {
            let m = crate::model::load(&goldens.join(model)).unwrap();
            let err = Adapters::attach(m.as_ref(), config(kind), 0).err();
            err.map(|e| e.to_string()).unwrap_or_default()
        };
        let gemma = refusal("tiny-gemma3", "full");
        assert!(
            gemma.contains("full fine-tuning of `gemma3_text` is not available"),
            "{gemma}"
        );
        assert!(gemma.contains("llama, mistral, qwen2"), "{gemma}");
        let q4 = refusal("tiny-llama-trained-q4", "full");
        assert!(q4.contains("full fine-tuning of a quantized layer"), "{q4}");
        let moe = refusal("tiny-qwen3-moe", "dora");
        assert!(moe.contains("DoRA on stacked experts"), "{moe}");
        assert!(moe.contains("--fine-tune-type lora"), "{moe}");
        assert_eq!(refusal("tiny-llama-trained", "full"), "");
    }
}
