//! A loaded adapter that does not borrow its model, so that a server can hold several and
//! switch between them step by step: its config, its (layer path, `Lora`) list as
//! `lora::read` checked it against the model, and its identity (a SHA-256 of the two files
//! mlx-lm's adapter directory holds). `apply` puts one (or none: the base model) on every
//! adaptable layer, as `mlx_lm.generate --adapter-path` would have loaded it.

use std::collections::HashMap;
use std::path::Path;

use sha2::{Digest, Sha256};

use super::{read, AdapterConfig};
use crate::model::layers::Lora;
use crate::model::LanguageModel;
use crate::train::TrainError;

/// One adapter, loaded and checked against a model, detached from it.
pub struct OwnedAdapter {
    pub config: AdapterConfig,
    /// Each adapted layer's path and adapter, in layer order.
    pub layers: Vec<(String, Lora)>,
    /// SHA-256 (hex) of `adapter_config.json`'s bytes then `adapters.safetensors`'.
    pub fingerprint: String,
}

impl OwnedAdapter {
    /// Reads `dir` and checks it against `model` (`lora::read`: a directory that is not an
    /// adapter, or another model's adapter, is refused saying so); the model is left as it
    /// was.
    pub fn load(model: &dyn LanguageModel, dir: &Path) -> Result<Self, TrainError> {
        let (config, layers) = read(model, dir)?;
        let mut sha = Sha256::new();
        for file in ["adapter_config.json", "adapters.safetensors"] {
            let path = dir.join(file);
            let bytes = std::fs::read(&path).map_err(|e| TrainError::Io(path, e))?;
            sha.update(&bytes);
        }
        let fingerprint = sha.finalize().iter().map(|b| format!("{b:02x}")).collect();
        Ok(OwnedAdapter {
            config,
            layers: layers
                .into_iter()
                .map(|(name, _, lora)| (name, lora))
                .collect(),
            fingerprint,
        })
    }
}

/// Sets every adaptable layer of `model` (its linears and stacked experts) to `adapter`'s
/// LoRA, or to none where the adapter has none for it (`None`: the base model throughout).
/// The arrays are shared, not copied.
pub fn apply(model: &dyn LanguageModel, adapter: Option<&OwnedAdapter>) {
    let by_name: HashMap<&str, &Lora> = adapter
        .map(|a| a.layers.iter().map(|(n, l)| (n.as_str(), l)).collect())
        .unwrap_or_default();
    let lora_of = |name: &str| by_name.get(name).map(|l| (*l).clone());
    for (name, l) in model.linears() {
        *l.lora.borrow_mut() = lora_of(&name);
    }
    for (name, s) in model.switch_linears() {
        *s.lora.borrow_mut() = lora_of(&name);
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use mlx_rs::Array;

    use super::{apply, OwnedAdapter};
    use crate::model::LanguageModel;
    use crate::train::lora::Adapters;

    fn logits(model: &dyn LanguageModel) -> Vec<f32> {
        let ids = Array::from_slice(&[1u32, 40, 41, 42], &[1, 4]);
        let out = model.forward(&ids, &mut model.make_caches()).unwrap();
        let out = out.as_dtype(mlx_rs::Dtype::Float32).unwrap();
        out.as_slice::<f32>().to_vec()
    }

    #[test]
    fn an_owned_adapter_switches_on_and_off_as_the_borrowed_one_loads() {
        let goldens = Path::new(env!("CARGO_MANIFEST_DIR")).join("../goldens");
        let model = crate::model::load(&goldens.join("models/tiny-llama-trained")).unwrap();
        let dir = goldens.join("train/tiny-llama-trained/adapters");
        let base = logits(model.as_ref());
        let owned = OwnedAdapter::load(model.as_ref(), &dir).unwrap();
        assert_eq!(
            logits(model.as_ref()),
            base,
            "loading leaves the model as it was"
        );
        assert_eq!(owned.fingerprint.len(), 64);
        apply(model.as_ref(), Some(&owned));
        let adapted = logits(model.as_ref());
        assert_ne!(adapted, base);
        apply(model.as_ref(), None);
        assert_eq!(logits(model.as_ref()), base);
        let borrowed = Adapters::load(model.as_ref(), &dir).unwrap();
        assert_eq!(logits(model.as_ref()), adapted);
        borrowed.detach();
        let other = goldens.join("train/tiny-phi3/adapters");
        let err = OwnedAdapter::load(model.as_ref(), &other)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("not trained for this model"), "{err}");
        let err = OwnedAdapter::load(model.as_ref(), &goldens)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("is not an adapter directory"), "{err}");
    }

    /// mlx-lm's DoRA adapters (with their magnitudes) switch on and off as LoRA's do, and
    /// give the borrowed loader's logits; fully fine-tuned weights are refused (they replace
    /// the base's own).
    #[test]
    fn dora_adapters_switch_and_full_weights_are_refused() {
        let goldens = Path::new(env!("CARGO_MANIFEST_DIR")).join("../goldens");
        let model = crate::model::load(&goldens.join("models/tiny-llama-trained")).unwrap();
        let base = logits(model.as_ref());
        let dir = goldens.join("train/tiny-llama-trained-dora/adapters");
        let owned = OwnedAdapter::load(model.as_ref(), &dir).unwrap();
        assert!(owned.layers.iter().all(|(_, l)| l.m.is_some()));
        apply(model.as_ref(), Some(&owned));
        let adapted = logits(model.as_ref());
        assert_ne!(adapted, base);
        apply(model.as_ref(), None);
        assert_eq!(logits(model.as_ref()), base);
        let borrowed = Adapters::load(model.as_ref(), &dir).unwrap();
        assert_eq!(logits(model.as_ref()), adapted);
        borrowed.detach();
        let full = goldens.join("train/tiny-llama-trained-full/adapters");
        let err = OwnedAdapter::load(model.as_ref(), &full)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("fully fine-tuned weights"), "{err}");
    }
}
