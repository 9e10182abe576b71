//! Parity tiers as command-line presets. The tier is the guarantee (L1: bit-exact with
//! mlx-lm; L2: bit-exact with optiq 0.7.7; L3: our own perf paths, gated by a measured
//! envelope); each preset turns on the fastest levers that keep its guarantee, and a
//! per-lever flag overrides its preset. docs/parity-tiers.md holds the table.

use std::path::{Path, PathBuf};

use crate::cache::kv_quant::{check_quant, KvConfigError, KvLayers, KvQuantPlan};
use crate::cache::QuantSdpa;
use crate::generate::{CompileDecode, SessionOptions};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Tier {
    L1,
    L2,
    L3,
}

/// `--kv-quant`: what happens to the KV caches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum KvQuantChoice {
    /// Dense caches in the activation dtype.
    Off,
    /// Every cache at 4 bits.
    #[value(name = "4")]
    Four,
    /// Every cache at 8 bits.
    #[value(name = "8")]
    Eight,
    /// optiq's mixed per-layer scheme from kv_config.json.
    Config,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OnOff {
    On,
    Off,
}

/// The tier presets and the per-lever overrides (flattened into commands).
#[derive(Debug, Clone, clap::Args)]
pub struct TierArgs {
    /// L1 preset: bit-exact with mlx-lm (dense KV, mlx-lm attention). The default.
    #[arg(long, conflicts_with_all = ["l2", "l3"])]
    pub l1: bool,
    /// L2 preset: bit-exact with optiq 0.7.7 (kv_config.json quantized KV, fused tiled
    /// quantized attention).
    #[arg(long, conflicts_with = "l3")]
    pub l2: bool,
    /// L3 preset: L2 plus our own perf paths (no oracle; gated by the teacher-forced envelope).
    #[arg(long)]
    pub l3: bool,
    /// KV quantization (overrides the preset).
    #[arg(long, value_enum)]
    pub kv_quant: Option<KvQuantChoice>,
    /// The per-layer KV scheme for `--kv-quant config` (default: <model>/kv_config.json).
    #[arg(long)]
    pub kv_config: Option<PathBuf>,
    /// Group size for `--kv-quant 4|8`.
    #[arg(long, default_value_t = 64)]
    pub kv_group_size: i32,
    /// A cache is quantized once it holds this many tokens (checked after every prefill
    /// chunk and step, as generate_step does; optiq's default 0; mlx-lm's CLI uses 5000).
    #[arg(long, default_value_t = 0)]
    pub quantized_kv_start: i32,
    /// optiq's fused KV-tiled attention over quantized caches (overrides the preset).
    #[arg(long, value_enum)]
    pub fused_sdpa: Option<OnOff>,
    /// Our dequantize-then-dense-SDPA decode step over quantized caches (L3 lever).
    #[arg(long, value_enum)]
    pub perf_decode: Option<OnOff>,
    /// Decode eagerly (by default the compiled decode step is tried where it is bit-exact
    /// and kept where it measured faster over the first steps).
    #[arg(long)]
    pub no_compile: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum TierError {
    #[error(transparent)]
    KvConfig(#[from] KvConfigError),
    #[error(
        "--kv-quant config needs a kv_config.json and {0} does not exist: write one \
         (a list of {{\"layer_idx\", \"bits\", \"group_size\"}}, as `optiq kv-cache` does), \
         pass --kv-config PATH, or choose --kv-quant 4|8|off"
    )]
    NoKvConfig(PathBuf),
    #[error("--kv-group-size: {0}")]
    GroupSize(String),
}

impl TierArgs {
    pub fn tier(&self) -> Tier {
        if self.l3 {
            Tier::L3
        } else if self.l2 {
            Tier::L2
        } else {
            Tier::L1
        }
    }

    /// The session options these flags select for the model in `model_dir`.
    pub fn resolve(&self, model_dir: &Path) -> Result<SessionOptions, TierError> {
        let tier = self.tier();
        let kv = self.kv_quant.unwrap_or(match tier {
            Tier::L1 => KvQuantChoice::Off,
            Tier::L2 | Tier::L3 => KvQuantChoice::Config,
        });
        let fused = match self.fused_sdpa {
            Some(v) => v == OnOff::On,
            None => tier != Tier::L1,
        };
        let perf = match self.perf_decode {
            Some(v) => v == OnOff::On,
            None => tier == Tier::L3,
        };
        let sdpa = match (fused, perf) {
            (_, true) => QuantSdpa::DequantDecode,
            (true, false) => QuantSdpa::OptiqFused,
            (false, false) => QuantSdpa::MlxLm,
        };
        let uniform = |bits| -> Result<KvLayers, TierError> {
            check_quant(bits, self.kv_group_size).map_err(TierError::GroupSize)?;
            Ok(KvLayers::Uniform {
                bits,
                group_size: self.kv_group_size,
            })
        };
        let layers = match kv {
            KvQuantChoice::Off => None,
            KvQuantChoice::Four => Some(uniform(4)?),
            KvQuantChoice::Eight => Some(uniform(8)?),
            KvQuantChoice::Config => {
                let path = self
                    .kv_config
                    .clone()
                    .unwrap_or_else(|| model_dir.join("kv_config.json"));
                if !path.is_file() {
                    return Err(TierError::NoKvConfig(path));
                }
                Some(KvLayers::from_config_file(&path)?)
            }
        };
        Ok(SessionOptions {
            compile: if self.no_compile {
                CompileDecode::Off
            } else {
                CompileDecode::WherePays
            },
            kv_quant: layers.map(|layers| KvQuantPlan {
                layers,
                start: self.quantized_kv_start,
                sdpa,
            }),
            probe_memo: Default::default(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        tier: TierArgs,
    }

    fn resolve(args: &[&str], dir: &Path) -> Result<SessionOptions, TierError> {
        let cli = Cli::try_parse_from(std::iter::once("t").chain(args.iter().copied())).unwrap();
        cli.tier.resolve(dir)
    }

    #[test]
    fn presets_and_overrides() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("kv_config.json"),
            r#"[{"layer_idx": 0, "bits": 8, "group_size": 32}]"#,
        )
        .unwrap();
        let l1 = resolve(&[], dir.path()).unwrap();
        assert!(l1.kv_quant.is_none());
        let l2 = resolve(&["--l2"], dir.path()).unwrap().kv_quant.unwrap();
        assert_eq!(l2.sdpa, QuantSdpa::OptiqFused);
        assert_eq!(l2.start, 0);
        assert!(matches!(l2.layers, KvLayers::PerLayer(_)));
        let l3 = resolve(&["--l3"], dir.path()).unwrap().kv_quant.unwrap();
        assert_eq!(l3.sdpa, QuantSdpa::DequantDecode);
        let unfused = resolve(&["--l2", "--fused-sdpa", "off"], dir.path()).unwrap();
        assert_eq!(unfused.kv_quant.unwrap().sdpa, QuantSdpa::MlxLm);
        let off = resolve(&["--l2", "--kv-quant", "off"], dir.path()).unwrap();
        assert!(off.kv_quant.is_none());
        let uniform = resolve(&["--kv-quant", "8", "--kv-group-size", "32"], dir.path())
            .unwrap()
            .kv_quant
            .unwrap();
        assert_eq!(
            uniform.layers,
            KvLayers::Uniform {
                bits: 8,
                group_size: 32
            }
        );
        assert_eq!(uniform.sdpa, QuantSdpa::MlxLm);
    }

    #[test]
    fn l2_without_a_kv_config_says_what_to_do() {
        let dir = tempfile::tempdir().unwrap();
        let err = resolve(&["--l2"], dir.path()).unwrap_err().to_string();
        assert!(
            err.contains("kv_config.json") && err.contains("--kv-config"),
            "{err}"
        );
        let err = resolve(&["--kv-quant", "4", "--kv-group-size", "48"], dir.path())
            .unwrap_err()
            .to_string();
        assert!(err.contains("group_size 48"), "{err}");
    }
}
