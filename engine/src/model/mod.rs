//! Model architectures behind one trait, chosen by `config.model_type`.

pub mod cohere2;
pub mod decoder;
pub mod deepseek_v3;
pub mod deepseek_v32;
pub mod ernie4_5_moe;
pub mod exaone4;
pub mod falcon_h1;
pub mod gated_delta;
pub mod gemma;
pub mod gemma2;
pub mod gemma3n;
pub mod gemma4;
pub mod glm4_moe;
pub mod gpt_oss;
pub mod granitemoehybrid;
pub mod hunyuan;
pub mod layers;
pub mod lfm2;
pub mod llama;
pub mod llama4;
pub mod llama4_text;
pub mod mamba2;
pub mod minicpm;
pub mod minicpm3;
pub mod minimax;
pub mod ministral3;
pub mod mixtral;
pub mod mla;
pub mod moe;
pub mod moe_family;
pub mod nemotron_h;
pub mod olmo;
pub mod phi3;
pub mod phimoe;
pub mod pipeline;
pub mod quantized;
pub mod qwen2_moe;
pub mod qwen3_5;
pub mod qwen3_moe;
pub mod qwen3_next;
pub mod registry;
pub mod rope;
pub mod sdpa;
pub mod shard;
pub mod short_conv;
pub mod smollm3;
pub mod ssm;
pub mod vl_text;
pub mod wrapper;

use std::path::Path;

use mlx_rs::error::Exception;
use mlx_rs::Array;

pub use gemma4::assistant::{AssistantDrafter, DonorKv};

use crate::cache::Cache;
use crate::dist::Mode;
use crate::load::config::ModelConfig;
use crate::load::weights::Weights;
use crate::load::LoadError;

/// A causal language model: token ids in, logits out, state in per-layer caches.
pub trait LanguageModel {
    fn model_type(&self) -> &str;
    /// The dtype activations run in (the embedding's output dtype).
    fn activation_dtype(&self) -> mlx_rs::Dtype;
    /// How many token ids the model reads and scores (the width of its logits): ids at or
    /// past it must never reach the model or a logits processor.
    fn vocab_size(&self) -> usize;
    /// One fresh cache per layer, of the kind each layer needs.
    fn make_caches(&self) -> Vec<Box<dyn Cache>>;
    /// ids [B, L] (int32) → logits [B, L, vocab]; appends this step to the caches.
    fn forward(&self, ids: &Array, caches: &mut [Box<dyn Cache>]) -> Result<Array, Exception>;
    /// ids [B, L] → the final hidden states [B, L, H]: after the model's final norm, before
    /// its output head (what an embedding model pools, `crate::embed`); appends this step to
    /// the caches. Families that do not expose them refuse, naming themselves.
    fn final_hidden(
        &self,
        _ids: &Array,
        _caches: &mut [Box<dyn Cache>],
    ) -> Result<Array, Exception> {
        Err(Exception::custom(format!(
            "{}: this family does not expose its final hidden states, so it cannot compute \
             embeddings; serve a model of a family that does (qwen3, llama and the other \
             decoder families)",
            self.model_type()
        )))
    }
    /// Every linear layer of the blocks, named by its checkpoint path without `.weight`
    /// (e.g. `model.layers.0.self_attn.q_proj`), in layer order — where LoRA attaches.
    /// Empty for families that do not list theirs yet (they cannot be fine-tuned).
    fn linears(&self) -> Vec<(String, &layers::Linear)> {
        Vec::new()
    }
    /// The blocks' pre-mixer and pre-feed-forward norms, named by checkpoint path without
    /// `.weight` as Llama names them (`model.layers.0.input_layernorm`), for full
    /// fine-tuning (`train::lora::full`, which lists the families whose blocks hold nothing
    /// else but these and `linears`). Empty where a family does not list them.
    fn block_norms(&self) -> Vec<(String, &layers::RmsNorm)> {
        Vec::new()
    }
    /// Every stack of experts of the blocks (`SwitchLinear`, e.g.
    /// `model.layers.0.mlp.switch_mlp.gate_proj`), in layer order — where LoRA attaches a
    /// `LoRASwitchLinear`. Empty for dense families.
    fn switch_linears(&self) -> Vec<(String, &moe::SwitchLinear)> {
        Vec::new()
    }
    /// The model as embed → blocks → head, for segmented training; None for families that
    /// do not expose it yet.
    fn as_layered(&self) -> Option<&dyn Layered> {
        None
    }
    /// The hooks optiq's assistant drafter reads, for families that have them (Gemma 4).
    fn as_assistant_target(&self) -> Option<&dyn AssistantTarget> {
        None
    }
    /// Tensor parallel: keep this rank's part of every layer, as mlx-lm's `Model.shard`.
    fn shard(&mut self, _part: shard::Part) -> Result<(), LoadError> {
        Err(registry::parallel_refusal(self.model_type(), Mode::Tensor))
    }
    /// Pipeline parallel: keep this rank's layers, as mlx-lm's `PipelineMixin.pipeline`.
    fn pipeline(&mut self, _part: shard::Part) -> Result<(), LoadError> {
        Err(registry::parallel_refusal(
            self.model_type(),
            Mode::Pipeline,
        ))
    }
}

/// The SSD store's geometry probe reads the caches one token leaves in fresh ones.
impl<M: LanguageModel + ?Sized> crate::cache::ssd::CacheSource for M {
    fn probe_caches(&self) -> Result<Vec<Box<dyn Cache>>, Exception> {
        let mut caches = self.make_caches();
        self.forward(&Array::from_slice(&[0i32], &[1, 1]), &mut caches)?;
        Ok(caches)
    }
}

/// A model seen as its three stages, run without caches (training): segmented backward
/// runs the blocks a few at a time.
pub trait Layered {
    fn num_blocks(&self) -> usize;
    /// ids [B, L] → the first hidden state.
    fn embed_ids(&self, ids: &Array) -> Result<Array, Exception>;
    /// Blocks `range` over a hidden state [B, L, H] (causal, no cache).
    fn run_blocks(&self, h: &Array, range: std::ops::Range<usize>) -> Result<Array, Exception>;
    /// Final norm and output head → logits.
    fn head_logits(&self, h: &Array) -> Result<Array, Exception>;
    /// For blocks that read more than the hidden state before them (Gemma 4): what a
    /// segment boundary carries besides it. None: the hidden state alone.
    fn carried(&self) -> Option<&dyn Carried> {
        None
    }
}

/// A `Layered` model whose blocks also read K/V that earlier blocks computed (Gemma 4's
/// KV-shared layers) and inputs made once from the ids (its per-layer inputs).
pub trait Carried {
    /// From the ids and the first hidden state: what every block may read and no adapter
    /// gradient flows into (empty where there is none).
    fn side_inputs(&self, ids: &Array, h0: &Array) -> Result<Vec<Array>, Exception>;
    /// How many arrays cross the boundary before block `b` besides the hidden state.
    fn carried_at(&self, b: usize) -> usize;
    /// Blocks `range` from the hidden state and the arrays carried into `range.start` →
    /// the hidden state and the arrays carried out of `range.end`.
    fn run_carried(
        &self,
        h: &Array,
        carried: &[Array],
        side: &[Array],
        range: std::ops::Range<usize>,
    ) -> Result<(Array, Vec<Array>), Exception>;
}

/// What an assistant drafter needs from its target model.
pub trait AssistantTarget {
    /// The hidden state after the final norm, [1, L, H]; appends the ids to the caches.
    fn hidden(&self, ids: &Array, caches: &mut [Box<dyn Cache>]) -> Result<Array, Exception>;
    /// Logits of a hidden state without the final softcap (optiq verifies with these).
    fn head_uncapped(&self, hidden: &Array) -> Result<Array, Exception>;
    /// The scaled input embedding of ids [1, L] → [1, L, H].
    fn embed_scaled(&self, ids: &Array) -> Result<Array, Exception>;
    /// Cache indices of the last sliding-window and the last full-attention layer that keep
    /// their own K/V (the drafter's donors).
    fn donor_caches(&self) -> Result<(usize, usize), Exception>;
}

/// Builds the model for a parsed config and its weights (the registry's row for its
/// `model_type`).
pub fn build(config: &ModelConfig, weights: Weights) -> Result<Box<dyn LanguageModel>, LoadError> {
    (registry::family(&config.model_type)?.build)(config, weights)
}

/// The tensors a checkpoint of `config` must hold, as (name, shape) in the order the loader
/// takes them: the family is built over a probe (`Weights::probe`), which records what each
/// layer asks for and the shape it states, and gives lazy zeros (nothing is evaluated, no
/// forward runs). The probe holds no tensors, so layout branches take the MLX layout and a
/// gemma3_text head is tied; the shapes are the dense ones, also for a quantized config
/// (`Weights::probe`). A wrapper's (gemma3, gemma4) are under `language_model.`.
pub fn expected_weights(config: &ModelConfig) -> Result<Vec<(String, Vec<i32>)>, LoadError> {
    let probe = Weights::probe();
    let record = probe.probe_record();
    drop(build(config, probe)?);
    Ok(record.map(|r| r.tensors()).unwrap_or_default())
}

/// Loads config and weights of a model directory and builds the model. A rank of a
/// distributed group (`dist::init`) first checks that every rank loads the same model, then
/// keeps its part of it (tensor or pipeline parallel, as the group's mode says).
pub fn load(dir: &Path) -> Result<Box<dyn LanguageModel>, LoadError> {
    let lazy = crate::dist::active();
    if lazy {
        crate::dist::agree_on_model(dir, &crate::load::weights::weight_files(dir)?)?;
    }
    let config = ModelConfig::read(dir)?;
    let weights = match lazy {
        true => Weights::load_lazy(dir)?,
        false => Weights::load(dir)?,
    };
    let mut model = build(&config, weights)?;
    if let Some(g) = crate::dist::group() {
        let part = shard::Part::of_group();
        parallelize(model.as_mut(), g.mode, part)?;
    }
    if crate::dist::active() {
        // The check is the ranks' first step together: bounded (a peer that stalls while it
        // loads), and a failure there is a lost peer as much as a misfit checkpoint.
        let _bound = crate::dist::bound("the one-token check after every rank has loaded");
        if let Err(e) = check_forward(model.as_ref()) {
            crate::dist::fatal(&e);
        }
        return Ok(model);
    }
    check_forward(model.as_ref())?;
    Ok(model)
}

/// Keeps this rank's part of `model` (tensor parallel) or its stage's layers (pipeline),
/// where the registry says its family runs that way; mlx-lm's refusal otherwise.
pub fn parallelize(
    model: &mut dyn LanguageModel,
    mode: Mode,
    part: shard::Part,
) -> Result<(), LoadError> {
    if !registry::has(model.model_type(), |f| registry::parallel(f, mode)) {
        return Err(registry::parallel_refusal(model.model_type(), mode));
    }
    match mode {
        Mode::Tensor => model.shard(part),
        Mode::Pipeline => model.pipeline(part),
    }
}

/// One token through fresh caches: a model that cannot run fails here, at load, instead of
/// on every request after a healthy start (a tensor whose shape disagrees with config.json
/// is refused earlier, as its layer takes it: `Weights::take_shaped`). The logits must be
/// [1, 1, vocab_size].
fn check_forward(model: &dyn LanguageModel) -> Result<(), LoadError> {
    let mismatch = |e: String| {
        LoadError::Weights(format!(
            "a one-token forward failed ({e}): the weights do not fit config.json"
        ))
    };
    let mut caches = model.make_caches();
    let logits = model
        .forward(&Array::from_slice(&[0i32], &[1, 1]), &mut caches)
        .map_err(|e| mismatch(e.what().to_owned()))?;
    logits.eval().map_err(|e| mismatch(e.what().to_owned()))?;
    let want = [1, 1, model.vocab_size() as i32];
    if logits.shape() != want {
        return Err(mismatch(format!(
            "logits {:?}, expected {want:?}",
            logits.shape()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    use super::*;
    use crate::load::config::QuantMode;

    fn golden(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../goldens/models")
            .join(name)
    }

    /// A copy of golden `name` whose tensor `tensor` keeps only its first `rows` rows.
    fn with_cut_tensor(name: &str, tensor: &str, rows: i32) -> tempfile::TempDir {
        use mlx_rs::ops::indexing::IndexOp;
        let src = golden(name);
        let dir = tempfile::tempdir().unwrap();
        std::fs::copy(src.join("config.json"), dir.path().join("config.json")).unwrap();
        let mut tensors = Array::load_safetensors(src.join("model.safetensors")).unwrap();
        let cut = tensors[tensor].index(..rows);
        tensors.insert(tensor.to_owned(), cut);
        Array::save_safetensors(tensors.iter(), None, dir.path().join("model.safetensors"))
            .unwrap();
        dir
    }

    fn build_error(dir: &Path) -> String {
        let config = ModelConfig::read(dir).unwrap();
        match build(&config, Weights::load(dir).unwrap()) {
            Ok(_) => panic!("{} built", dir.display()),
            Err(e) => e.to_string(),
        }
    }

    /// A tensor whose shape is not the one config.json makes it is refused as its layer
    /// takes it, naming it, the expected and the found shape; a quantized weight is checked
    /// as the packing of its dense shape.
    #[test]
    fn a_tensor_of_another_shape_is_refused_naming_it() {
        let k = "model.layers.1.self_attn.k_proj.weight";
        let e = build_error(with_cut_tensor("tiny-llama", k, 16).path());
        assert!(
            e.contains(&format!("`{k}` has shape [16, 64]"))
                && e.contains("config.json makes it [32, 64]")
                && e.contains("does not fit its config.json"),
            "{e}"
        );
        let norm = "model.layers.0.input_layernorm.weight";
        let e = build_error(with_cut_tensor("tiny-qwen3", norm, 8).path());
        assert!(e.contains(&format!("`{norm}` has shape [8]")), "{e}");
        // Quantized: 4-bit affine in groups of 64, the packed weight and its scales.
        let q = "model.layers.0.mlp.up_proj.weight";
        let e = build_error(with_cut_tensor("tiny-llama-trained-q4", q, 100).path());
        assert!(
            e.contains(&format!("`{q}` has shape [100, 16]"))
                && e.contains("makes it [320, 16] (dense [320, 128], quantized affine with 4")
                && e.contains("group size 64)"),
            "{e}"
        );
        let s = "model.layers.0.mlp.up_proj.scales";
        let e = build_error(with_cut_tensor("tiny-llama-trained-q4", s, 100).path());
        assert!(e.contains(&format!("`{s}` has shape [100, 2]")), "{e}");
    }

    /// Names and shapes of the tensors a model directory stores, sorted.
    fn stored(dir: &Path) -> Vec<(String, Vec<i32>)> {
        let mut out = Vec::new();
        for file in crate::load::weights::weight_files(dir).unwrap() {
            let bytes = std::fs::read(&file).unwrap();
            let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            for (name, view) in st.tensors() {
                let mut shape: Vec<i32> = view.shape().iter().map(|&d| d as i32).collect();
                // A depthwise conv kernel in Hugging Face's [C, 1, K]: the sanitize of every
                // family that has one swaps its last two axes, to MLX's [C, K, 1].
                if name.ends_with("conv1d.weight") || name.ends_with("conv.conv.weight") {
                    if let [_, 1, k] = shape[..] {
                        if k > 1 {
                            shape.swap(1, 2);
                        }
                    }
                }
                out.push((name, shape));
            }
        }
        out.sort();
        out
    }

    /// What `expected` (dense shapes) is stored as in a checkpoint of `config`: a weight with
    /// `.scales` in `stored` is packed as its config entry (per module, else the default)
    /// says, with scales (and affine's biases) beside it.
    fn as_stored(
        config: &ModelConfig,
        expected: &[(String, Vec<i32>)],
        stored: &[(String, Vec<i32>)],
    ) -> Vec<(String, Vec<i32>)> {
        let has = |n: &str| stored.iter().any(|(s, _)| s == n);
        let mut out = Vec::new();
        for (name, shape) in expected {
            let prefix = name.strip_suffix(".weight").unwrap_or(name);
            if !has(&format!("{prefix}.scales")) {
                out.push((name.clone(), shape.clone()));
                continue;
            }
            let q = config.quantization.as_ref().unwrap();
            let p = match q.per_path.get(prefix) {
                Some(entry) => entry.unwrap(),
                None => q.default.unwrap(),
            };
            let with_last = |last: i32| {
                let mut s = shape.clone();
                *s.last_mut().unwrap() = last;
                s
            };
            let in_dims = *shape.last().unwrap();
            out.push((name.clone(), with_last(in_dims * p.bits / 32)));
            let groups = with_last(in_dims / p.group_size);
            out.push((format!("{prefix}.scales"), groups.clone()));
            if p.mode == QuantMode::Affine {
                out.push((format!("{prefix}.biases"), groups));
            }
        }
        out.sort();
        out
    }

    /// The loader's list of a committed tiny model's tensors (`expected_weights`, from its
    /// config.json alone) is exactly what its safetensors hold, name for name and shape for
    /// shape — quantized ones as the packing of the dense shapes the probe lists. Left out:
    /// checkpoints in Hugging Face's layout, which the loader rewrites as it takes them (the
    /// probe lists MLX's layout; depthwise conv kernels and Qwen 3.5's prefix are mapped
    /// here), and the assistant drafters (no family of the registry).
    #[test]
    fn expected_weights_are_what_the_tiny_checkpoints_hold() {
        let skipped = [
            (
                "tiny-gemma4-mm",
                "Hugging Face's `model.language_model.` layout",
            ),
            (
                "tiny-gemma3n",
                "its text model keeps `model.language_model.` (folded to `model.` below) beside \
                 towers under `model.`",
            ),
            (
                "tiny-gemma4-moe",
                "Hugging Face's fused `experts.gate_up_proj`",
            ),
            ("tiny-qwen3-5-moe", "fused `experts.gate_up_proj`"),
            ("tiny-qwen3-next", "per-expert `mlp.experts.{e}` tensors"),
            ("tiny-lfm2-moe", "per-expert `w1`/`w2`/`w3` tensors"),
            (
                "tiny-granite-h",
                "fused `input_linear`/`output_linear` experts",
            ),
            (
                "tiny-granite-h-dense",
                "the dense `shared_mlp.input_linear` (gate and up fused)",
            ),
            (
                "tiny-nemotron-h-moe",
                "per-expert `experts.{e}.up_proj`/`down_proj` tensors",
            ),
            (
                "tiny-nemotron-h-moe-grouped",
                "per-expert `experts.{e}.up_proj`/`down_proj` tensors",
            ),
            (
                "tiny-deepseek-v3",
                "`kv_b_proj` (split into embed_q / unembed_out) and per-expert tensors",
            ),
            (
                "tiny-glm4-moe",
                "per-expert tensors and an MTP layer its sanitize drops",
            ),
            (
                "tiny-ernie4-5-moe",
                "per-expert tensors and MTP / correction-bias tensors its sanitize drops",
            ),
            ("tiny-minimax", "per-expert `w1`/`w2`/`w3` tensors"),
            ("tiny-phimoe", "per-expert `w1`/`w2`/`w3` tensors"),
            ("tiny-llama4-text", "the head stored as `output`"),
            (
                "tiny-deepseek-v32",
                "`kv_b_proj`, per-expert tensors and an MTP layer sanitize drops",
            ),
            (
                "tiny-glm4-moe-lite",
                "`kv_b_proj`, per-expert tensors and an MTP layer sanitize drops",
            ),
            (
                "tiny-kimi-k25",
                "`kv_b_proj`, per-expert tensors and the vision tensors sanitize drops",
            ),
            (
                "tiny-minicpm",
                "no `lm_head` (its sanitize makes the embedding the head)",
            ),
            (
                "tiny-llama4",
                "Hugging Face's `language_model.` names and fused experts",
            ),
        ];
        let mut compared = 0;
        for entry in std::fs::read_dir(golden("")).unwrap() {
            let dir = entry.unwrap().path();
            let name = dir.file_name().unwrap().to_string_lossy().into_owned();
            if !dir.is_dir() {
                continue;
            }
            let config = ModelConfig::read(&dir).unwrap();
            if config.model_type == "gemma4_assistant" {
                continue;
            }
            // Every family's loader runs under a probe, the skipped ones too.
            let expected = expected_weights(&config).unwrap_or_else(|e| panic!("{name}: {e}"));
            if skipped.iter().any(|(s, _)| *s == name) {
                continue;
            }
            let wrapper = wrapper::WRAPPERS.contains(&config.model_type.as_str());
            // A wrapper's towers are dropped as it loads; its language model is what counts.
            // Qwen 3.5's checkpoints keep the text model under `model.language_model.` beside
            // a vision tower its sanitize drops, mlx-community's under `language_model.`.
            let stored: Vec<_> = stored(&dir)
                .into_iter()
                // A wrapper in Hugging Face's layout (tiny-gemma4-vl): `model.language_model.X`
                // is mlx-community's `language_model.model.X`.
                .map(|(n, s)| match n.strip_prefix("model.language_model.") {
                    Some(rest) if wrapper => (format!("language_model.model.{rest}"), s),
                    _ => (n, s),
                })
                .filter(|(n, _)| !wrapper || n.starts_with("language_model."))
                .filter(|(n, _)| !n.starts_with("model.visual."))
                // mistral3's Hugging Face layout keeps its tower and projector under `model.`.
                .filter(|(n, _)| {
                    !n.starts_with("model.vision_tower.")
                        && !n.starts_with("model.multi_modal_projector.")
                })
                .map(|(n, s)| {
                    let n = n.replace("model.language_model.", "model.");
                    match n.strip_prefix("language_model.") {
                        Some(text) if !wrapper => (text.to_owned(), s),
                        _ => (n, s),
                    }
                })
                .collect();
            assert_eq!(as_stored(&config, &expected, &stored), stored, "{name}");
            compared += 1;
        }
        assert!(compared >= 30, "{compared} checkpoints compared");
    }

    /// A probe evaluates nothing and runs no forward: a config of a large model lists its
    /// tensors at once (mlx-lm's gemma4_text defaults: Gemma 4 E2B's shapes, 35 layers, a
    /// 262 144-row embedding, tied). A plain `take` is refused, `contains` is false.
    #[test]
    fn a_probe_lists_the_tensors_of_a_config_without_weights() {
        let raw = serde_json::json!({"model_type": "gemma4_text"});
        let config = ModelConfig::from_value(PathBuf::from("config.json"), raw).unwrap();
        let expected = expected_weights(&config).unwrap();
        assert_eq!(
            expected[0],
            ("model.embed_tokens.weight".to_owned(), vec![262_144, 1536])
        );
        let names: Vec<&str> = expected.iter().map(|(n, _)| n.as_str()).collect();
        assert!(names.contains(&"model.layers.34.layer_scalar"));
        assert!(!names.iter().any(|n| n.contains("lm_head")));
        let mut w = Weights::probe();
        assert!(w.take("model.norm.weight").is_err(), "an unstated shape");
        assert!(!w.contains("lm_head.weight"));
        let z = w.take_shaped("x", &[2, 3]).unwrap();
        assert_eq!(z.shape(), &[2, 3]);
        assert!(w.take_shaped("x", &[2, 3]).is_err(), "taken twice");
        assert_eq!(
            w.probe_record().unwrap().tensors(),
            vec![("x".to_owned(), vec![2, 3])]
        );
    }
}
