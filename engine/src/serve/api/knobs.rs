//! The generation fields the chat and completions APIs share (mlx_lm.server 0.32.2's
//! names, defaults from the server's flags and bounds), and their turning into a
//! `GenRequest` once an API has made its prompt. The Responses API fills the same struct
//! from its own field names.

use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::{Map, Value};

use super::{bounded, bounded_f, Obj};
use crate::generate::lookup::LookupParams;
use crate::generate::sampler::SamplingParams;
use crate::serve::error::ApiError;
use crate::serve::request::{Defaults, GenRequest, Prompt};

/// The shared fields; every one optional (null reads as absent).
#[derive(Debug, Default, Deserialize)]
pub struct Knobs {
    pub max_tokens: Option<i64>,
    /// OpenAI's newer name; when given, max_tokens is not read.
    pub max_completion_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub seed: Option<i64>,
    /// Token id (a string, as JSON keys are) to bias.
    pub logit_bias: Option<Map<String, Value>>,
    pub repetition_penalty: Option<f64>,
    pub repetition_context_size: Option<i64>,
    pub presence_penalty: Option<f64>,
    pub presence_context_size: Option<i64>,
    pub frequency_penalty: Option<f64>,
    pub frequency_context_size: Option<i64>,
    pub n: Option<i64>,
    pub stream: Option<bool>,
    pub stream_options: Option<Obj<StreamOptions>>,
    /// The base model or an adapter (`adapters::Registry::resolve`); with no adapter
    /// mounted, any name goes to the model.
    pub model: Option<String>,
    pub top_logprobs: Option<i64>,
    pub num_draft_tokens: Option<i64>,
    pub prompt_lookup_num_tokens: Option<i64>,
    pub max_matching_ngram_size: Option<i64>,
    /// Read by `constrain::openai::response_format`, which names its own fields.
    pub response_format: Option<Value>,
    pub stop: Option<Stop>,
    /// llama.cpp's `return_progress`: streamed prompt_progress chunks while the prompt
    /// prefills (`serve::progress`).
    pub return_progress: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
}

/// `stop`: a string or a list of strings.
#[derive(Debug, Default)]
pub struct Stop(pub Vec<String>);

impl<'de> Deserialize<'de> for Stop {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Stop;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a string or a list of strings")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Stop, E> {
                Ok(Stop(vec![s.to_owned()]))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Stop, A::Error> {
                let mut words = Vec::new();
                while let Some(w) = seq.next_element::<String>()? {
                    words.push(w);
                }
                Ok(Stop(words))
            }
        }
        d.deserialize_any(V)
    }
}

/// `logprobs`: the chat API's flag, or the completions API's count of alternatives.
#[derive(Debug, Clone, Copy)]
pub enum Logprobs {
    Flag(bool),
    Count(usize),
}

impl Knobs {
    /// The request for `prompt`, checked against the server's `d`efaults and the model.
    pub fn into_request(
        self,
        prompt: Prompt,
        logprobs: Option<Logprobs>,
        d: &Defaults,
    ) -> Result<GenRequest, ApiError> {
        let ctx = d.context as i64;
        let (max_key, max) = match self.max_completion_tokens {
            Some(n) => ("max_completion_tokens", Some(n)),
            None => ("max_tokens", self.max_tokens),
        };
        let max_tokens = bounded(max_key, max, d.max_tokens as i64, 1, ctx)? as usize;
        let sampling = self.sampling(d)?;
        // One choice per request, as mlx_lm.server answers; more would be silently dropped.
        if bounded("n", self.n, 1, 1, i64::MAX)? != 1 {
            return Err(ApiError::field(
                "n",
                "only n = 1 is supported: send one request per completion",
            ));
        }
        let include_usage = self
            .stream_options
            .as_ref()
            .and_then(|o| o.0.include_usage)
            .unwrap_or(false);
        // OpenAI's chat API takes `logprobs: bool` + `top_logprobs: 0..=20`; its completions
        // API takes `logprobs: int`. Both map onto (per-token logprob, alternatives).
        let (logprobs, top_logprobs) = match logprobs {
            Some(Logprobs::Count(k)) => (true, k),
            flag => (
                matches!(flag, Some(Logprobs::Flag(true))),
                bounded("top_logprobs", self.top_logprobs, 0, 0, 10)? as usize,
            ),
        };
        if top_logprobs > d.vocab {
            return Err(ApiError::field(
                "top_logprobs",
                format!("at most the vocabulary size, {}", d.vocab),
            ));
        }
        let num_draft_tokens = match self.num_draft_tokens {
            None => None,
            n => Some(bounded("num_draft_tokens", n, 0, 0, 64)? as usize),
        };
        let prompt_lookup = self.prompt_lookup(&sampling, num_draft_tokens)?;
        let constraint = crate::constrain::openai::response_format(self.response_format.as_ref())
            .map_err(|(f, m)| ApiError::field(f, m))?;
        Ok(GenRequest {
            prompt,
            max_tokens,
            sampling,
            stop: self.stop.map(|s| s.0).unwrap_or_default(),
            stream: self.stream.unwrap_or(false),
            include_usage,
            logprobs: logprobs || top_logprobs > 0,
            top_logprobs,
            num_draft_tokens,
            prompt_lookup,
            constraint,
            return_progress: self.return_progress.unwrap_or(false),
            think_budget: None,
            model: self.model.clone(),
            images: Vec::new(),
            image_text: None,
            strip: false,
        })
    }

    fn sampling(&self, d: &Defaults) -> Result<SamplingParams, ApiError> {
        let ctx = d.context as i64;
        // A penalty of 0 is no penalty (mlx_lm.server makes no processor for it).
        let penalty = |key: &str, v: Option<f64>, min: f64| -> Result<Option<f64>, ApiError> {
            let x = bounded_f(key, v, 0.0, min, f64::MAX)?;
            Ok((x != 0.0).then_some(x))
        };
        let size =
            |key: &str, v: Option<i64>| Ok::<_, ApiError>(bounded(key, v, 20, 0, ctx)? as usize);
        let sampling = SamplingParams {
            temp: bounded_f("temperature", self.temperature, d.temp, 0.0, f64::MAX)?,
            top_p: bounded_f("top_p", self.top_p, d.top_p, 0.0, 1.0)?,
            top_k: bounded("top_k", self.top_k, d.top_k as i64, 0, i32::MAX as i64)? as i32,
            min_p: bounded_f("min_p", self.min_p, d.min_p, 0.0, 1.0)?,
            seed: bounded("seed", self.seed, 0, 0, i64::MAX)? as u64,
            logit_bias: logit_bias(self.logit_bias.as_ref())?,
            repetition_penalty: penalty("repetition_penalty", self.repetition_penalty, 0.0)?,
            repetition_context_size: size("repetition_context_size", self.repetition_context_size)?,
            presence_penalty: penalty("presence_penalty", self.presence_penalty, f64::MIN)?,
            presence_context_size: size("presence_context_size", self.presence_context_size)?,
            frequency_penalty: penalty("frequency_penalty", self.frequency_penalty, f64::MIN)?,
            frequency_context_size: size("frequency_context_size", self.frequency_context_size)?,
            ..SamplingParams::default()
        };
        sampling
            .check(d.vocab)
            .map_err(|e| ApiError::field(e.field, e.message))?;
        Ok(sampling)
    }

    /// `prompt_lookup_num_tokens` (0 or absent: off) and `max_matching_ngram_size`, checked:
    /// not with logits processors (the verify pass samples every position at once) nor with
    /// `num_draft_tokens` above 0 (one drafter per request).
    fn prompt_lookup(
        &self,
        sampling: &SamplingParams,
        num_draft_tokens: Option<usize>,
    ) -> Result<Option<LookupParams>, ApiError> {
        use crate::generate::lookup::{MAX_NGRAM, MAX_NUM_TOKENS};
        const KEY: &str = "prompt_lookup_num_tokens";
        const NGRAM: &str = "max_matching_ngram_size";
        let n = bounded(
            KEY,
            self.prompt_lookup_num_tokens,
            0,
            0,
            MAX_NUM_TOKENS as i64,
        )? as usize;
        let ngram = match self.max_matching_ngram_size {
            None => None,
            g => Some(bounded(NGRAM, g, 0, 1, MAX_NGRAM as i64)? as usize),
        };
        if n == 0 {
            return match ngram {
                Some(_) => Err(ApiError::field(
                    NGRAM,
                    format!(
                        "{NGRAM} applies to prompt-lookup decoding: set {KEY} too (1–{MAX_NUM_TOKENS})"
                    ),
                )),
                None => Ok(None),
            };
        }
        let processors = !sampling.logit_bias.is_empty()
            || sampling.repetition_penalty.is_some()
            || sampling.presence_penalty.is_some()
            || sampling.frequency_penalty.is_some();
        if processors {
            return Err(ApiError::field(
                KEY,
                format!(
                    "{KEY}: prompt-lookup decoding does not run logits processors (logit_bias, \
                     repetition, presence or frequency penalties); drop them or {KEY}"
                ),
            ));
        }
        if num_draft_tokens.is_some_and(|g| g > 0) {
            return Err(ApiError::field(
                KEY,
                format!(
                    "{KEY} and num_draft_tokens both ask for drafting: set one of them (0 turns \
                     the draft model off)"
                ),
            ));
        }
        LookupParams::new(n, ngram)
            .map(Some)
            .map_err(|e| ApiError::field(KEY, e.message))
    }
}

/// `logit_bias`: token ids (JSON keys, so strings) to finite biases.
fn logit_bias(v: Option<&Map<String, Value>>) -> Result<Vec<(u32, f32)>, ApiError> {
    let Some(map) = v else {
        return Ok(Vec::new());
    };
    map.iter()
        .map(|(k, b)| {
            let id = k.parse::<u32>().ok();
            let bias = b.as_f64().filter(|x| x.is_finite());
            match (id, bias) {
                (Some(id), Some(bias)) => Ok((id, bias as f32)),
                _ => Err(ApiError::field(
                    "logit_bias",
                    "logit_bias must be a dict of int to float",
                )),
            }
        })
        .collect()
}
