//! The two kinds of speculative drafter behind `--draft-model`: a standalone small model
//! sharing the tokenizer (mlx-lm's speculative decoding, `speculative.rs`) or optiq's Gemma
//! 4 assistant, which reads the target's caches and hidden state (`assistant.rs`). The
//! directory's config tells them apart (an assistant's has `backbone_hidden_size`).

use std::path::Path;

use mlx_rs::error::Exception;
use mlx_rs::Array;

use super::assistant::assistant_generate_in;
use super::sampler::Sampler;
use super::speculative::{speculative_generate_in, SpecStats, SPEC_PREFILL_STEP};
use super::{Finish, Flow, Session, SessionOptions, Stats};
use crate::cache::Cache;
use crate::load::tokenizer::Tokenizer;
use crate::load::LoadError;
use crate::model::{AssistantDrafter, LanguageModel};

pub enum Drafter {
    Model(Box<dyn LanguageModel>),
    Assistant(Box<AssistantDrafter>),
}

/// What a speculative run returns: timing, the speculation's numbers, why it stopped, and
/// the drafter's caches afterwards (none for an assistant).
pub type SpecOutcome = (Stats, SpecStats, Finish, Vec<Box<dyn Cache>>);

impl Drafter {
    /// Loads the drafter in `dir` for `target` (whose tokenizer is `tokenizer`).
    pub fn load(
        dir: &Path,
        target: &dyn LanguageModel,
        tokenizer: &Tokenizer,
    ) -> Result<Self, LoadError> {
        if AssistantDrafter::is_assistant(dir) {
            if target.as_assistant_target().is_none() {
                return Err(LoadError::Unsupported(format!(
                    "{} is a Gemma 4 assistant drafter; it drafts for gemma4_text models only \
                     (this model is {})",
                    dir.display(),
                    target.model_type()
                )));
            }
            return Ok(Drafter::Assistant(Box::new(AssistantDrafter::load(dir)?)));
        }
        let model = crate::model::load(dir)?;
        let vocab = Tokenizer::load(dir)?.vocab_size();
        if vocab != tokenizer.vocab_size() {
            return Err(LoadError::Unsupported(format!(
                "the draft model's tokenizer has {vocab} tokens, the model's {}: a drafter must \
                 share the model's tokenizer",
                tokenizer.vocab_size()
            )));
        }
        Ok(Drafter::Model(model))
    }

    /// The drafter's own caches (none for an assistant, which reads the target's).
    pub fn make_caches(&self) -> Vec<Box<dyn Cache>> {
        match self {
            Drafter::Model(m) => m.make_caches(),
            Drafter::Assistant(_) => Vec::new(),
        }
    }

    /// Speculative generation in `target` (holding `prompt[..cached]`, as `draft_caches`
    /// do); returns the drafter's caches afterwards as well.
    #[allow(clippy::too_many_arguments)]
    pub fn generate(
        &self,
        target: &mut Session,
        draft_caches: Vec<Box<dyn Cache>>,
        opts: &SessionOptions,
        prompt: &[u32],
        cached: usize,
        gamma: usize,
        max_tokens: usize,
        eos_ids: &[u32],
        sampler: &mut Sampler,
        on_token: impl FnMut(u32, &Array, bool) -> Result<Flow, Exception>,
    ) -> Result<SpecOutcome, Exception> {
        match self {
            Drafter::Model(m) => {
                let mut draft = Session::with_caches(m.as_ref(), opts, draft_caches);
                draft.prefill_step = target.prefill_step;
                let (stats, spec, finish) = speculative_generate_in(
                    target, &mut draft, prompt, cached, gamma, max_tokens, eos_ids, sampler,
                    on_token,
                )?;
                Ok((stats, spec, finish, std::mem::take(&mut draft.caches)))
            }
            Drafter::Assistant(a) => {
                let model = target.model();
                let hooks = model.as_assistant_target().ok_or_else(|| {
                    Exception::custom("this model cannot host an assistant drafter")
                })?;
                let (stats, spec, finish) = assistant_generate_in(
                    target, hooks, a, prompt, cached, gamma, max_tokens, eos_ids, sampler, None,
                    on_token,
                )?;
                Ok((stats, spec, finish, Vec::new()))
            }
        }
    }

    /// Feeds the drafter's `caches` the tokens of `fed` they do not hold yet (prefill chunks
    /// of `prefill_step`), e.g. after a request decoded without drafting; an assistant has
    /// no caches of its own.
    pub fn catch_up(
        &self,
        caches: Vec<Box<dyn Cache>>,
        opts: &SessionOptions,
        fed: &[u32],
        prefill_step: usize,
    ) -> Result<Vec<Box<dyn Cache>>, Exception> {
        let Drafter::Model(m) = self else {
            return Ok(caches);
        };
        let mut draft = Session::with_caches(m.as_ref(), opts, caches);
        let held = crate::cache::common_len(&draft.caches, fed.len());
        for chunk in fed[held..].chunks(prefill_step.max(1)) {
            draft.prefill_chunk(chunk)?;
        }
        Ok(std::mem::take(&mut draft.caches))
    }

    /// The prefill chunk a target session should use with this drafter (mlx-lm's
    /// speculative loop defaults to 512, optiq's to generate_step's 2048).
    pub fn prefill_step(&self) -> usize {
        match self {
            Drafter::Model(_) => SPEC_PREFILL_STEP,
            Drafter::Assistant(_) => super::PREFILL_STEP,
        }
    }
}
