//! The two kinds of speculative drafter behind `--draft-model`: a standalone small model
//! sharing the tokenizer (mlx-lm's speculative decoding, `speculative.rs`) or optiq's Gemma
//! 4 assistant, which reads the target's caches and hidden state (`assistant.rs`). The
//! directory tells them apart: an assistant's config has `backbone_hidden_size` (at the top
//! or in `text_config`) or `model_type` `gemma4_assistant`, or its tensors include
//! `pre_projection` and `post_projection` (`AssistantDrafter::is_assistant`).

use std::path::Path;

use mlx_rs::error::Exception;
use mlx_rs::Array;

use std::borrow::BorrowMut;

use super::assistant::AssistPass;
use super::decode::{Decoder, Plain};
use super::lookup::{LookupParams, LookupRound};
use super::sampler::Sampler;
use super::speculative::{SpecRound, SpecStats, SPEC_PREFILL_STEP};
use super::{Finish, Flow, Session, SessionOptions};
use crate::cache::Cache;
use crate::load::tokenizer::Tokenizer;
use crate::load::LoadError;
use crate::model::{AssistantDrafter, AssistantTarget, LanguageModel};

pub enum Drafter {
    Model(Box<dyn LanguageModel>),
    Assistant(Box<AssistantDrafter>),
}

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
                    "{} is a Gemma 4 assistant drafter; it drafts for Gemma 4 models only \
                     (gemma4_text, or the gemma4 wrapper; this model is {})",
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

/// A drafted request's drafter, its γ and its own caches.
pub type Drafting<'m> = (&'m Drafter, usize, Vec<Box<dyn Cache>>);

/// A finished request's target session, and the drafter's caches after a drafted run.
pub type Ended<'m> = (Session<'m>, Option<Vec<Box<dyn Cache>>>);

/// A request's decoding: its target session and the policy that finds the next ids — one
/// plain step, a draft model's round, an assistant's pass or a prompt-lookup round
/// (`decode` has the core they share). The one dispatch between them, for the CLI and the server alike.
pub struct Decode<'m> {
    pub session: Session<'m>,
    policy: Policy<'m>,
}

enum Policy<'m> {
    Plain(Plain),
    Drafted {
        draft: Session<'m>,
        round: SpecRound,
    },
    Assisted {
        hooks: &'m dyn AssistantTarget,
        drafter: &'m AssistantDrafter,
        pass: AssistPass<'static>,
    },
    Lookup(LookupRound),
}

impl<'m> Decode<'m> {
    /// Starts decoding `prompt` in `session` (which holds `prompt[..cached]`): with
    /// `draft` — the drafter, its γ and its own caches (holding the same prefix) — by
    /// speculation, else plainly.
    pub fn start<S: BorrowMut<Sampler>>(
        session: Session<'m>,
        draft: Option<Drafting<'m>>,
        opts: &SessionOptions,
        dec: &mut Decoder<'_, S>,
        prompt: &[u32],
        cached: usize,
    ) -> Result<Self, Exception> {
        Self::start_with(session, draft, None, opts, dec, prompt, cached)
    }

    /// `start`, or with `lookup` and no `draft`, by prompt lookup (drafts copied from the
    /// prompt and the text so far; a draft model, when given, drafts instead).
    pub fn start_with<S: BorrowMut<Sampler>>(
        mut session: Session<'m>,
        draft: Option<Drafting<'m>>,
        lookup: Option<LookupParams>,
        opts: &SessionOptions,
        dec: &mut Decoder<'_, S>,
        prompt: &[u32],
        cached: usize,
    ) -> Result<Self, Exception> {
        assert!(
            cached < prompt.len(),
            "at least one prompt token must be fed"
        );
        let policy = match draft {
            None => match lookup {
                Some(params) => Policy::Lookup(LookupRound::start(
                    &mut session,
                    dec,
                    prompt,
                    cached,
                    params,
                )?),
                None => Policy::Plain(Plain::start(&mut session, dec, &prompt[cached..])?),
            },
            Some((Drafter::Model(m), gamma, caches)) => {
                let mut draft = Session::with_caches(m.as_ref(), opts, caches);
                draft.prefill_step = session.prefill_step;
                let round = SpecRound::start(&mut session, &mut draft, dec, prompt, cached, gamma)?;
                Policy::Drafted { draft, round }
            }
            Some((Drafter::Assistant(drafter), gamma, _)) => {
                let hooks = session.model().as_assistant_target().ok_or_else(|| {
                    Exception::custom("this model cannot host an assistant drafter")
                })?;
                let pass =
                    AssistPass::start(&mut session, hooks, dec, prompt, cached, gamma, None)?;
                Policy::Assisted {
                    hooks,
                    drafter,
                    pass,
                }
            }
        };
        Ok(Decode { session, policy })
    }

    /// The next ids (one step, round or pass) through `dec`. Some(finish) when the request
    /// is over.
    pub fn advance<S: BorrowMut<Sampler>, E: From<Exception>>(
        &mut self,
        dec: &mut Decoder<'_, S>,
        on_token: &mut impl FnMut(u32, &Array, bool) -> Result<Flow, E>,
    ) -> Result<Option<Finish>, E> {
        let session = &mut self.session;
        match &mut self.policy {
            Policy::Plain(plain) => plain.advance(session, dec, on_token),
            Policy::Drafted { draft, round } => round.advance(session, draft, dec, on_token),
            Policy::Assisted {
                hooks,
                drafter,
                pass,
            } => pass.advance(session, *hooks, drafter, dec, on_token),
            Policy::Lookup(round) => round.advance(session, dec, on_token),
        }
    }

    /// Runs the request to its end.
    pub fn run<S: BorrowMut<Sampler>, E: From<Exception>>(
        &mut self,
        dec: &mut Decoder<'_, S>,
        on_token: &mut impl FnMut(u32, &Array, bool) -> Result<Flow, E>,
    ) -> Result<Finish, E> {
        loop {
            if let Some(finish) = self.advance(dec, on_token)? {
                return Ok(finish);
            }
        }
    }

    /// What the speculation did (None for a plain request).
    pub fn spec_stats(&self) -> Option<&SpecStats> {
        match &self.policy {
            Policy::Plain(_) => None,
            Policy::Drafted { round, .. } => Some(&round.spec),
            Policy::Assisted { pass, .. } => Some(&pass.spec),
            Policy::Lookup(round) => Some(&round.spec),
        }
    }

    /// Ends the request (no MLX work left in flight): the target session, and the
    /// drafter's caches after a drafted run (empty for an assistant; None when plain).
    pub fn end(self) -> Result<Ended<'m>, Exception> {
        match self.policy {
            Policy::Plain(plain) => {
                plain.end()?;
                Ok((self.session, None))
            }
            Policy::Drafted { mut draft, .. } => {
                Ok((self.session, Some(std::mem::take(&mut draft.caches))))
            }
            Policy::Assisted { .. } => Ok((self.session, Some(Vec::new()))),
            // No drafter ran: a drafter's caches (if any) are behind, as after plain decoding.
            Policy::Lookup(_) => Ok((self.session, None)),
        }
    }
}

/// Whether a request with `sampler` can be drafted by `drafter` (else it decodes plainly).
pub fn can_draft(sampler: &super::sampler::Sampler, drafter: &Drafter) -> bool {
    match drafter {
        Drafter::Model(_) => !sampler.has_penalties(),
        Drafter::Assistant(_) => !sampler.has_processors(),
    }
}
