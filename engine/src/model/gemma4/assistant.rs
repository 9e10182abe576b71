//! optiq 0.7.7's Gemma 4 "-assistant" drafter (`optiq/runtime/spec/drafters/
//! gemma_assistant.py`), and the hooks it needs from its Gemma 4 target. The drafter has no
//! K/V of its own: each draft step reads the K/V of the target's last sliding and last full
//! layer that keep a cache, the target's scaled embedding of the token it continues from,
//! and a hidden state — the target's (after its final norm) for the first draft of a pass,
//! the drafter's own projected output for the next ones. Q-only attention, f32-upcast
//! RMSNorms; the head is the one the tensors carry (`assistant/head.rs`: the centroid head
//! of the small E2B/E4B drafters, an own `lm_head`, or the tied embedding).

use std::collections::HashMap;
use std::path::Path;

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::ops::{concatenate, repeat_axis};
use mlx_rs::{fast, Array};
use serde::Deserialize;
use serde_json::Value;

pub mod head;

use self::head::{DrafterHead, HeadFlags};
use crate::cache::RopeOffset;
use crate::load::config::{ModelConfig, RopeScaling};
use crate::load::weights::Weights;
use crate::load::LoadError;
use crate::model::layers::{Embedding, Glu, Linear, Mlp, RmsNorm, Rope};

type R<T> = Result<T, Exception>;

/// The donors' K/V in temporal order (what one draft pass reads).
pub struct DonorKv {
    pub sliding: (Array, Array),
    pub full: (Array, Array),
}

fn default_eps() -> f32 {
    1e-6
}

/// The top level of a drafter's config.json, as optiq's `GemmaAssistantConfig.from_dict`
/// reads it (unknown fields are ignored; the head's flags are read by `HeadFlags`).
#[derive(Debug, Clone, Deserialize)]
pub struct AssistantArgs {
    /// The target's hidden width (`pre_projection` reads two of them, `post_projection`
    /// writes one); else `text_config`'s, else `post_projection`'s output width.
    pub backbone_hidden_size: Option<i32>,
    /// Wins over `text_config`'s (the head itself is chosen by the tensors).
    pub tie_word_embeddings: Option<bool>,
    /// The drafter's layers; a flat config keeps these fields at the top level instead.
    pub text_config: Option<serde_json::Map<String, Value>>,
}

/// The drafter's own layers (`text_config`, or the top level of a flat config).
#[derive(Debug, Clone, Deserialize)]
pub struct AssistantTextArgs {
    pub hidden_size: i32,
    pub intermediate_size: i32,
    pub num_attention_heads: i32,
    /// The target's KV head count: the drafter's queries attend to the target's K/V.
    pub num_key_value_heads: i32,
    /// Sliding layers' head width; full layers use `global_head_dim` (default: the same).
    pub head_dim: i32,
    pub global_head_dim: Option<i32>,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f32,
    /// One entry per layer: `sliding_attention` or `full_attention`.
    pub layer_types: Vec<String>,
    /// Per layer kind: `rope_theta` (defaults 1e4 sliding, 1e6 full) and, on full layers,
    /// `partial_rotary_factor` (default 1).
    pub rope_parameters: Option<HashMap<String, RopeScaling>>,
    pub tie_word_embeddings: Option<bool>,
    pub backbone_hidden_size: Option<i32>,
}

impl AssistantTextArgs {
    fn rope(&self, kind: &str) -> Option<&RopeScaling> {
        self.rope_parameters.as_ref()?.get(kind)
    }
}

/// One drafter layer: Q-only attention over the donor's K/V, then the gelu-tanh MLP.
struct Layer {
    full: bool,
    q_proj: Linear,
    o_proj: Linear,
    q_norm: RmsNorm,
    rope: Rope,
    mlp: Mlp,
    input_norm: RmsNorm,
    post_attn_norm: RmsNorm,
    pre_ffw_norm: RmsNorm,
    post_ffw_norm: RmsNorm,
    layer_scalar: Array,
}

pub struct AssistantDrafter {
    embed: Embedding,
    layers: Vec<Layer>,
    /// `model.norm` (f32-upcast).
    norm: RmsNorm,
    /// The head the tensors carry: centroid, `lm_head` or the tied embedding.
    head: DrafterHead,
    pre_projection: Linear,
    post_projection: Linear,
    n_heads: i32,
    n_kv_heads: i32,
}

impl AssistantDrafter {
    /// Whether `dir` holds an assistant drafter: its config says so (`backbone_hidden_size`
    /// at the top or in `text_config`, `model_type` `gemma4_assistant`), or its tensors do
    /// (`pre_projection.weight` and `post_projection.weight`, which no other model has).
    pub fn is_assistant(dir: &Path) -> bool {
        let config = std::fs::read_to_string(dir.join("config.json"))
            .ok()
            .and_then(|s| serde_json::from_str::<Value>(&s).ok())
            .unwrap_or(Value::Null);
        let says = !config["backbone_hidden_size"].is_null()
            || !config["text_config"]["backbone_hidden_size"].is_null()
            || config["model_type"] == "gemma4_assistant";
        says || {
            let names = head::tensor_names(dir);
            ["pre_projection.weight", "post_projection.weight"]
                .iter()
                .all(|n| names.iter().any(|t| t == n))
        }
    }

    /// Reads `config.json` and the weights of `dir` and builds the drafter.
    pub fn load(dir: &Path) -> Result<Self, LoadError> {
        let config = ModelConfig::read(dir)?;
        let weights = Weights::load(dir)?;
        Self::build(&config, weights)
    }

    /// The drafter's settings (top level, and its text model's from `text_config` or a flat
    /// config); refuses what it does not support.
    fn read_args(config: &ModelConfig) -> Result<(AssistantArgs, AssistantTextArgs), LoadError> {
        let args: AssistantArgs = config.parse()?;
        if config.quantization.is_some() {
            return Err(LoadError::Unsupported(
                "quantized assistant drafters are not supported (optiq 0.7.7 loads its drafters \
                 dense)"
                    .into(),
            ));
        }
        let text = match &args.text_config {
            Some(tc) => AssistantTextArgs::deserialize(Value::Object(tc.clone())).map_err(|e| {
                LoadError::Config {
                    path: config.path.clone(),
                    message: format!("text_config: {e}"),
                }
            })?,
            None => config.parse()?,
        };
        Ok((args, text))
    }

    /// The drafter for a parsed config and its weights: every tensor must be used (the
    /// head's included: it is the one the tensors carry, `DrafterHead::load`).
    pub fn build(config: &ModelConfig, mut w: Weights) -> Result<Self, LoadError> {
        let (args, text) = Self::read_args(config)?;
        let hidden = text.hidden_size;
        let (n_heads, eps) = (text.num_attention_heads, text.rms_norm_eps);
        let tie = args.tie_word_embeddings.or(text.tie_word_embeddings);
        let flags = HeadFlags::read(&config.raw, tie);
        let theta = |kind: &str, default: f32| {
            text.rope(kind)
                .and_then(|r| r.rope_theta)
                .unwrap_or(default)
        };
        let partial = text
            .rope("full_attention")
            .and_then(|r| r.partial_rotary_factor)
            .unwrap_or(1.0);
        let mut layers = Vec::new();
        for (i, kind) in text.layer_types.iter().enumerate() {
            let p = format!("model.layers.{i}");
            let full = kind == "full_attention";
            let d = match text.global_head_dim {
                Some(g) if full => g,
                _ => text.head_dim,
            };
            let rope = if full {
                let s = RopeScaling {
                    rope_type: Some("proportional".into()),
                    partial_rotary_factor: Some(partial),
                    factor: Some(1.0),
                    ..Default::default()
                };
                Rope::new(d, theta("full_attention", 1e6), false, Some(&s))?
            } else {
                Rope::new(d, theta("sliding_attention", 1e4), false, None)?
            };
            let lin = |w: &mut Weights, name: &str, in_dims: i32| {
                linear_in(w, &format!("{p}.{name}"), in_dims)
            };
            let norm = |w: &mut Weights, name: &str| norm_upcast(w, &format!("{p}.{name}"), eps);
            layers.push(Layer {
                full,
                q_proj: lin(&mut w, "self_attn.q_proj", hidden)?,
                o_proj: lin(&mut w, "self_attn.o_proj", n_heads * d)?,
                q_norm: norm(&mut w, "self_attn.q_norm")?,
                rope,
                mlp: Mlp::load(
                    &mut w,
                    &format!("{p}.mlp"),
                    false,
                    hidden,
                    text.intermediate_size,
                    Glu::GeluApprox,
                )?,
                input_norm: norm(&mut w, "input_layernorm")?,
                post_attn_norm: norm(&mut w, "post_attention_layernorm")?,
                pre_ffw_norm: norm(&mut w, "pre_feedforward_layernorm")?,
                post_ffw_norm: norm(&mut w, "post_feedforward_layernorm")?,
                layer_scalar: w.take(&format!("{p}.layer_scalar"))?,
            });
        }
        let rows = stored_rows(&w, "model.embed_tokens");
        let embed = Embedding::load(&mut w, "model.embed_tokens", [rows, hidden])?;
        let norm = norm_upcast(&mut w, "model.norm", eps)?;
        // optiq defaults a missing backbone_hidden_size to 2560; here the tensors give it:
        // post_projection writes the target's width, pre_projection reads it twice over.
        let post_projection = linear_in(&mut w, "post_projection", hidden)?;
        let backbone = args
            .backbone_hidden_size
            .or(text.backbone_hidden_size)
            .unwrap_or(post_projection.output_dims());
        let pre_projection = linear_in(&mut w, "pre_projection", 2 * backbone)?;
        let head = DrafterHead::load(&mut w, &flags, hidden, embed.rows() as i32)?;
        w.ensure_consumed(&config.model_type, |_| false)?;
        Ok(AssistantDrafter {
            embed,
            layers,
            norm,
            head,
            pre_projection,
            post_projection,
            n_heads,
            n_kv_heads: text.num_key_value_heads,
        })
    }

    /// Which head the drafter loaded, in words.
    pub fn head_kind(&self) -> &'static str {
        self.head.kind()
    }

    /// One draft step at RoPE `position`: the logits [vocab] and the next step's hidden.
    pub fn forward(
        &self,
        token_emb: &Array,
        target_hidden: &Array,
        kv: &DonorKv,
        position: i32,
    ) -> R<(Array, Array)> {
        let x = concatenate(&[token_emb, target_hidden], -1)?;
        let mut h = self.pre_projection.forward(&x)?;
        let offset = RopeOffset::Int(position);
        let groups = self.n_heads / self.n_kv_heads;
        for layer in &self.layers {
            let (k, v) = if layer.full { &kv.full } else { &kv.sliding };
            let (k, v) = if groups > 1 {
                (
                    repeat_axis::<f32>(k.clone(), groups, 1)?,
                    repeat_axis::<f32>(v.clone(), groups, 1)?,
                )
            } else {
                (k.clone(), v.clone())
            };
            let residual = h.clone();
            let x = layer.input_norm.forward(&h)?;
            let (b, l) = (x.shape()[0], x.shape()[1]);
            let q = layer
                .q_proj
                .forward(&x)?
                .reshape(&[b, l, self.n_heads, -1])?;
            let q = layer.q_norm.forward(&q)?.transpose_axes(&[0, 2, 1, 3])?;
            let q = layer.rope.forward(&q, &offset)?;
            let out = fast::scaled_dot_product_attention(q, k, v, 1.0, None, None)?;
            let out = out.transpose_axes(&[0, 2, 1, 3])?.reshape(&[b, l, -1])?;
            let attn = layer.post_attn_norm.forward(&layer.o_proj.forward(&out)?)?;
            h = residual.add(&attn)?;
            let residual = h.clone();
            let mlp = layer.mlp.forward(&layer.pre_ffw_norm.forward(&h)?)?;
            let mlp = layer.post_ffw_norm.forward(&mlp)?;
            h = residual.add(&mlp)?.multiply(&layer.layer_scalar)?;
        }
        let h = self.norm.forward(&h)?;
        let logits = self.head.logits(&self.embed, &h)?;
        let next = self.post_projection.forward(&h)?;
        Ok((logits.index((0, 0)), next))
    }
}

/// The rows (outputs) `<prefix>.weight` is stored with, 0 when it is missing (its loader
/// then names it). The drafter reads its widths from its tensors, as optiq does; only the
/// inputs are checked against config.json.
pub(crate) fn stored_rows(w: &Weights, prefix: &str) -> i32 {
    let shape = w.stored_shape(&format!("{prefix}.weight"));
    shape.and_then(|s| s.first().copied()).unwrap_or(0)
}

/// A bias-free linear `in_dims` wide, as many outputs as its tensor holds.
pub(crate) fn linear_in(w: &mut Weights, prefix: &str, in_dims: i32) -> Result<Linear, LoadError> {
    let rows = stored_rows(w, prefix);
    Linear::load(w, prefix, false, [rows, in_dims])
}

/// optiq's upcast RMSNorm, as wide as its tensor.
fn norm_upcast(w: &mut Weights, prefix: &str, eps: f32) -> Result<RmsNorm, LoadError> {
    let dims = stored_rows(w, prefix);
    RmsNorm::load_upcast(w, prefix, dims, eps)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A copy of the committed tiny drafter with its config edited by `edit` (and, with
    /// `extra`, one more tensor in its weights).
    fn drafter_dir(edit: impl FnOnce(&mut Value), extra: Option<&str>) -> tempfile::TempDir {
        let golden =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../goldens/models/tiny-gemma4-assistant");
        let dir = tempfile::tempdir().unwrap();
        let mut config: Value =
            serde_json::from_str(&std::fs::read_to_string(golden.join("config.json")).unwrap())
                .unwrap();
        edit(&mut config);
        std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
        let weights = golden.join("model.safetensors");
        match extra {
            None => {
                std::fs::copy(&weights, dir.path().join("model.safetensors")).unwrap();
            }
            Some(name) => {
                let mut tensors = Array::load_safetensors(&weights).unwrap();
                tensors.insert(name.to_owned(), Array::from_slice(&[1f32], &[1]));
                Array::save_safetensors(tensors.iter(), None, dir.path().join("model.safetensors"))
                    .unwrap();
            }
        }
        dir
    }

    fn load_error(dir: &tempfile::TempDir) -> String {
        match AssistantDrafter::load(dir.path()) {
            Ok(_) => panic!("loaded"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn the_committed_drafter_loads() {
        AssistantDrafter::load(drafter_dir(|_| {}, None).path()).unwrap();
    }

    #[test]
    fn a_missing_or_mistyped_key_is_named() {
        let missing = drafter_dir(
            |c| drop(c["text_config"].as_object_mut().unwrap().remove("head_dim")),
            None,
        );
        let e = load_error(&missing);
        assert!(
            e.contains("config.json") && e.contains("text_config: missing field `head_dim`"),
            "{e}"
        );
        // optiq defaults it (to 2560); the tensors carry it, and they say an assistant's.
        let missing = drafter_dir(
            |c| {
                let c = c.as_object_mut().unwrap();
                c.remove("backbone_hidden_size");
                c.insert("model_type".into(), Value::from("gemma4_text"));
            },
            None,
        );
        assert!(AssistantDrafter::is_assistant(missing.path()));
        AssistantDrafter::load(missing.path()).unwrap();
        let wrong = drafter_dir(|c| c["tie_word_embeddings"] = Value::from("yes"), None);
        let e = load_error(&wrong);
        assert!(
            e.contains("invalid type") && e.contains("expected a boolean"),
            "{e}"
        );
        let wrong = drafter_dir(|c| c["text_config"]["layer_types"] = Value::from(4), None);
        let e = load_error(&wrong);
        assert!(e.contains("text_config: invalid type"), "{e}");
    }

    #[test]
    fn tensors_the_drafter_does_not_use_are_refused() {
        let dir = drafter_dir(|_| {}, Some("model.layers.0.self_attn.k_proj.weight"));
        let e = load_error(&dir);
        assert!(
            e.contains("1 tensors") && e.contains("self_attn.k_proj"),
            "{e}"
        );
        // Half a centroid head is named, not passed over.
        let dir = drafter_dir(|_| {}, Some("masked_embedding.token_ordering"));
        let e = load_error(&dir);
        assert!(
            e.contains("`masked_embedding.centroids.weight` is missing"),
            "{e}"
        );
    }

    #[test]
    fn the_head_is_the_one_the_tensors_carry() {
        let head = |dir: &tempfile::TempDir| {
            AssistantDrafter::load(dir.path())
                .map(|d| d.head_kind())
                .unwrap()
        };
        let untied_flag = |c: &mut Value| {
            c["tie_word_embeddings"] = Value::from(false);
            c["text_config"]["tie_word_embeddings"] = Value::from(false);
        };
        assert_eq!(head(&drafter_dir(|_| {}, None)), "tied embedding");
        assert_eq!(head(&drafter_dir(untied_flag, None)), "tied embedding");
        let golden = Path::new(env!("CARGO_MANIFEST_DIR")).join("../goldens/models");
        let own = AssistantDrafter::load(&golden.join("tiny-gemma4-assistant-lm-head")).unwrap();
        assert_eq!(own.head_kind(), "lm_head");
        let centroid =
            AssistantDrafter::load(&golden.join("tiny-gemma4-assistant-centroid")).unwrap();
        assert_eq!(centroid.head_kind(), "centroid");
    }

    #[test]
    fn the_centroid_head_needs_its_top_k() {
        let golden = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../goldens/models/tiny-gemma4-assistant-centroid");
        let dir = tempfile::tempdir().unwrap();
        let mut config: Value =
            serde_json::from_str(&std::fs::read_to_string(golden.join("config.json")).unwrap())
                .unwrap();
        config["centroid_intermediate_top_k"] = Value::from(0);
        std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
        std::fs::copy(
            golden.join("model.safetensors"),
            dir.path().join("model.safetensors"),
        )
        .unwrap();
        let e = load_error(&dir);
        assert!(e.contains("centroid_intermediate_top_k"), "{e}");
    }
}
