//! Model architectures behind one trait, chosen by `config.model_type`.

pub mod decoder;
pub mod gated_delta;
pub mod gemma;
pub mod gemma4;
pub mod gpt_oss;
pub mod granitemoehybrid;
pub mod layers;
pub mod lfm2;
pub mod llama;
pub mod mamba2;
pub mod mixtral;
pub mod moe;
pub mod moe_family;
pub mod nemotron_h;
pub mod phi3;
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
    /// Every linear layer of the blocks, named by its checkpoint path without `.weight`
    /// (e.g. `model.layers.0.self_attn.q_proj`), in layer order — where LoRA attaches.
    /// Empty for families that do not list theirs yet (they cannot be fine-tuned).
    fn linears(&self) -> Vec<(String, &layers::Linear)> {
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

/// One token through fresh caches: weights whose shapes disagree with config.json (a head
/// count, a norm width) fail here, at load, instead of on every request after a healthy
/// start. The logits must be [1, 1, vocab_size].
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
