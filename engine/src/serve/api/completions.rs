//! `/v1/completions` bodies: a text prompt (rendered by no template) and the completions
//! API's `logprobs` (a count of alternatives, or the chat API's flag); the generation
//! fields are `knobs::Knobs`.

use serde::de::{self, Deserializer, Visitor};
use serde::Deserialize;
use serde_json::Value;

use super::knobs::{Knobs, Logprobs};
use super::read;
use crate::serve::error::ApiError;
use crate::serve::request::{Defaults, GenRequest, Prompt};

#[derive(Debug, Deserialize)]
struct Body {
    prompt: Option<String>,
    logprobs: Option<CountOrFlag>,
}

/// `logprobs`: an integer 0–10 (alternatives per token) or a boolean.
#[derive(Debug)]
struct CountOrFlag(Logprobs);

impl<'de> Deserialize<'de> for CountOrFlag {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = CountOrFlag;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an integer 0–10 or a boolean")
            }
            fn visit_bool<E: de::Error>(self, b: bool) -> Result<CountOrFlag, E> {
                Ok(CountOrFlag(Logprobs::Flag(b)))
            }
            fn visit_u64<E: de::Error>(self, k: u64) -> Result<CountOrFlag, E> {
                match k {
                    0..=10 => Ok(CountOrFlag(Logprobs::Count(k as usize))),
                    _ => Err(E::custom("logprobs must be an integer 0–10")),
                }
            }
            fn visit_i64<E: de::Error>(self, k: i64) -> Result<CountOrFlag, E> {
                match u64::try_from(k) {
                    Ok(k) => self.visit_u64(k),
                    Err(_) => Err(E::custom("logprobs must be an integer 0–10")),
                }
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<CountOrFlag, E> {
                Err(E::custom("logprobs must be an integer 0–10"))
            }
        }
        d.deserialize_any(V)
    }
}

/// Parses and validates a completions body.
pub fn parse(body: &Value, d: &Defaults) -> Result<GenRequest, ApiError> {
    let b: Body = read(body)?;
    let knobs: Knobs = read(body)?;
    let prompt = b
        .prompt
        .ok_or_else(|| ApiError::field("prompt", "prompt must be a string"))?;
    knobs.into_request(Prompt::Text(prompt), b.logprobs.map(|l| l.0), d)
}
