//! When and how a session's KV caches become quantized: mlx-lm's uniform `kv_bits`, or
//! optiq's mixed per-layer scheme from a `kv_config.json` (`[{layer_idx, bits,
//! group_size}]`, group size 64 when absent, the last entry for a layer wins, caches it does
//! not name stay dense). Both convert where `generate_step` calls its hook: after every
//! prefill chunk and after every step's forward, each cache whose offset has reached
//! `start` (so with start 0 the first prefill chunk attends densely and everything after it
//! reads quantized K/V).

use std::collections::BTreeMap;
use std::path::Path;

use mlx_rs::error::Exception;
use serde::Deserialize;

use super::{Cache, KvQuant, QuantSdpa};

/// Which caches are quantized, and how.
#[derive(Debug, Clone, PartialEq)]
pub enum KvLayers {
    /// Every cache, the same way (mlx-lm's `--kv-bits`).
    Uniform { bits: i32, group_size: i32 },
    /// Per cache index (optiq's kv_config.json).
    PerLayer(BTreeMap<usize, (i32, i32)>),
}

#[derive(Debug, Clone, PartialEq)]
pub struct KvQuantPlan {
    pub layers: KvLayers,
    /// `quantized_kv_start`: a cache converts once its offset reaches this.
    pub start: i32,
    /// Which attention reads the quantized caches.
    pub sdpa: QuantSdpa,
}

#[derive(Debug, thiserror::Error)]
pub enum KvConfigError {
    #[error("cannot read kv config {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("kv config {path} is not a list of {{\"layer_idx\", \"bits\", \"group_size\"}} entries: {message}")]
    Format { path: String, message: String },
    #[error("kv config {path}: {message}")]
    Invalid { path: String, message: String },
}

#[derive(Deserialize)]
struct Entry {
    layer_idx: usize,
    bits: i32,
    #[serde(default = "default_group")]
    group_size: i32,
}

fn default_group() -> i32 {
    64
}

/// MLX affine quantization's supported settings.
pub fn check_quant(bits: i32, group_size: i32) -> Result<(), String> {
    if !matches!(bits, 2 | 3 | 4 | 5 | 6 | 8) {
        return Err(format!("bits {bits} (MLX supports 2, 3, 4, 5, 6, 8)"));
    }
    if !matches!(group_size, 32 | 64 | 128) {
        return Err(format!(
            "group_size {group_size} (MLX supports 32, 64, 128; it must also divide the head dim)"
        ));
    }
    Ok(())
}

impl KvLayers {
    /// Reads optiq's kv_config.json.
    pub fn from_config_file(path: &Path) -> Result<Self, KvConfigError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| KvConfigError::Io {
            path: shown.clone(),
            source,
        })?;
        let entries: Vec<Entry> =
            serde_json::from_str(&text).map_err(|e| KvConfigError::Format {
                path: shown.clone(),
                message: e.to_string(),
            })?;
        let mut layers = BTreeMap::new();
        for e in entries {
            check_quant(e.bits, e.group_size).map_err(|message| KvConfigError::Invalid {
                path: shown.clone(),
                message: format!("layer {}: {message}", e.layer_idx),
            })?;
            layers.insert(e.layer_idx, (e.bits, e.group_size));
        }
        Ok(KvLayers::PerLayer(layers))
    }

    fn for_cache(&self, index: usize) -> Option<(i32, i32)> {
        match self {
            KvLayers::Uniform { bits, group_size } => Some((*bits, *group_size)),
            KvLayers::PerLayer(map) => map.get(&index).copied(),
        }
    }
}

impl KvQuantPlan {
    /// Converts every due cache; returns how many converted now.
    pub fn apply(&self, caches: &mut [Box<dyn Cache>]) -> Result<usize, Exception> {
        let mut converted = 0;
        for (i, cache) in caches.iter_mut().enumerate() {
            let Some((bits, group_size)) = self.layers.for_cache(i) else {
                continue;
            };
            let Some(cache) = cache.as_kv() else {
                continue;
            };
            if cache.kv_quant().is_some() || cache.offset() < self.start || cache.offset() == 0 {
                continue;
            }
            let quant = KvQuant {
                bits,
                group_size,
                sdpa: self.sdpa,
            };
            if cache.quantize(quant)? {
                converted += 1;
            }
        }
        Ok(converted)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(text: &str) -> tempfile::NamedTempFile {
        let f = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(f.path(), text).unwrap();
        f
    }

    #[test]
    fn kv_config_reads_optiq_entries_with_defaults_and_last_wins() {
        let f = write(
            r#"[{"layer_idx": 0, "bits": 8, "group_size": 32},
                {"layer_idx": 2, "bits": 4},
                {"layer_idx": 0, "bits": 4, "group_size": 128, "extra": "ignored"}]"#,
        );
        let KvLayers::PerLayer(map) = KvLayers::from_config_file(f.path()).unwrap() else {
            panic!("per-layer expected");
        };
        assert_eq!(
            map.get(&0),
            Some(&(4, 128)),
            "the last entry for a layer wins"
        );
        assert_eq!(map.get(&2), Some(&(4, 64)), "group size defaults to 64");
        assert_eq!(map.get(&1), None, "layers not named stay dense");
    }

    #[test]
    fn bad_kv_configs_are_clear_errors() {
        let not_a_list = write(r#"{"layer_idx": 0, "bits": 4}"#);
        let err = KvLayers::from_config_file(not_a_list.path()).unwrap_err();
        assert!(err.to_string().contains("is not a list"), "{err}");
        let bad_group = write(r#"[{"layer_idx": 1, "bits": 4, "group_size": 16}]"#);
        let err = KvLayers::from_config_file(bad_group.path()).unwrap_err();
        assert!(err.to_string().contains("layer 1: group_size 16"), "{err}");
        let err = KvLayers::from_config_file(Path::new("/nonexistent/kv_config.json")).unwrap_err();
        assert!(err.to_string().contains("cannot read"), "{err}");
    }
}
