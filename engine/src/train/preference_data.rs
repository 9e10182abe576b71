//! Preference pairs for DPO, CPO and SimPO: reading them (mlx-lm's `{"prompt", "chosen",
//! "rejected"}` lines, plus TRL's `ref_chosen_logps` / `ref_rejected_logps` columns for DPO),
//! the checks that name a bad line before any step (`<file> line N: <what>`), the reference
//! pass that fills in what the data does not give, and a batch's loss for the trainer.

use std::path::Path;

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;
use serde_json::Value;

use super::data::{read_jsonl, Encoder, Pair};
use super::lora::Adapters;
use super::preference::{reference_logps, reference_rows, terms_from_logits, PairObjective};
use super::setup::{Dataset, LossFromLogits, Method};
use super::TrainError;
use crate::model::LanguageModel;

pub use super::data::PairSet;

const REF_KEYS: [&str; 2] = ["ref_chosen_logps", "ref_rejected_logps"];

/// A response's text: the string, or the last assistant message's content.
fn response_text<'v>(v: &'v Value, key: &str) -> Option<&'v str> {
    match v.get(key)? {
        Value::String(s) => Some(s),
        Value::Array(list) => list
            .iter()
            .rev()
            .find(|m| m["role"] == "assistant")
            .and_then(|m| m["content"].as_str()),
        _ => None,
    }
}

/// A line's reference log-probs (both keys or neither): finite numbers ≤ 0, as f32.
fn line_reference(v: &Value) -> Result<Option<[f32; 2]>, String> {
    let [c, r] = REF_KEYS.map(|k| v.get(k));
    let (c, r) = match (c, r) {
        (None, None) => return Ok(None),
        (Some(c), Some(r)) => (c, r),
        _ => {
            return Err(format!(
                "has only one of `{}` and `{}`: give both or neither",
                REF_KEYS[0], REF_KEYS[1]
            ))
        }
    };
    let num = |x: &Value, key: &str| -> Result<f32, String> {
        let f = x.as_f64().map(|f| f as f32).filter(|f| f.is_finite());
        match f {
            Some(f) if f <= 0.0 => Ok(f),
            Some(f) => Err(format!(
                "`{key}` is {f}, above 0: it is a sum of log-probabilities, so ≤ 0"
            )),
            None => Err(format!(
                "`{key}` must be a finite number (a summed log-probability), got {x}"
            )),
        }
    };
    Ok(Some([num(c, REF_KEYS[0])?, num(r, REF_KEYS[1])?]))
}

/// One line as a pair: both responses non-empty, the prompt leaving at least one response
/// token within `max_len` (longer sequences are cut to `max_len`, as TRL's `max_length`).
fn line_pair(encoder: &Encoder, v: &Value, max_len: usize) -> Result<Pair, String> {
    for key in ["chosen", "rejected"] {
        if response_text(v, key).is_some_and(|s| s.trim().is_empty()) {
            return Err(format!(
                "`{key}` is empty: a preference pair needs two non-empty responses"
            ));
        }
    }
    let mut pair = encoder.pair(v)?;
    if pair.prompt_len >= max_len {
        return Err(format!(
            "the prompt is {} tokens, so --max-seq-length {max_len} leaves no response token: \
             raise --max-seq-length or shorten the prompt",
            pair.prompt_len
        ));
    }
    pair.chosen.truncate(max_len);
    pair.rejected.truncate(max_len);
    Ok(pair)
}

/// Reads `file`'s pairs for `obj`. DPO's reference log-probs come from every line or from
/// none (then `fill_reference` computes them); other objectives ignore those keys.
pub fn read_pairs(
    file: &Path,
    encoder: &Encoder,
    obj: &PairObjective,
    max_len: usize,
) -> Result<PairSet, TrainError> {
    let mut first_has: Option<bool> = None;
    let rows = read_jsonl(file, |v| {
        let reference = if obj.needs_reference() {
            let r = line_reference(v)?;
            match first_has {
                None => first_has = Some(r.is_some()),
                Some(has) if has != r.is_some() => {
                    return Err(format!(
                        "`{}` / `{}` are {} here but {} on the first line: give them on every \
                         line or on none (then the base model computes them)",
                        REF_KEYS[0],
                        REF_KEYS[1],
                        if has { "missing" } else { "present" },
                        if has { "present" } else { "absent" },
                    ))
                }
                Some(_) => {}
            }
            r
        } else {
            None
        };
        Ok((line_pair(encoder, v, max_len)?, reference))
    })?;
    let (pairs, refs): (Vec<Pair>, Vec<Option<[f32; 2]>>) = rows.into_iter().unzip();
    Ok(PairSet {
        pairs,
        reference: refs.into_iter().collect(),
    })
}

/// Computes the reference log-probs of every DPO set that lacks them (TRL's
/// `precompute_ref_log_probs`, the reference being the base model); returns how many pairs
/// it scored.
pub fn fill_reference(
    model: &dyn LanguageModel,
    adapters: &Adapters,
    method: &Method,
    sets: &mut [Option<&mut Dataset>],
    batch_size: usize,
) -> Result<usize, Exception> {
    let Method::Pairs(obj) = method else {
        return Ok(0);
    };
    if !obj.needs_reference() {
        return Ok(0);
    }
    let mut scored = 0;
    for set in sets.iter_mut().flatten() {
        if let Dataset::Pairs(set) = &mut **set {
            if set.reference.is_none() {
                set.reference = Some(reference_logps(model, adapters, &set.pairs, batch_size)?);
                scored += set.pairs.len();
            }
        }
    }
    Ok(scored)
}

/// A batch of pairs as model inputs and its loss function (the objective's terms in
/// `PrefTerms::into_vec` order).
pub fn batch_loss(set: &PairSet, batch: &[usize], method: &Method) -> (Array, LossFromLogits) {
    let pairs: Vec<&Pair> = batch.iter().map(|&i| &set.pairs[i]).collect();
    let (ids, _, rm) = super::orpo::pair_batch(&pairs);
    let t = ids.shape()[1];
    let inputs = ids.index((.., ..t - 1));
    let reference = set.reference.as_ref().map(|r| reference_rows(r, batch));
    let obj = match method {
        Method::Pairs(obj) => Some(*obj),
        _ => None,
    };
    let loss = move |logits: &Array| {
        let Some(obj) = obj else {
            return Err(Exception::custom(
                "preference pairs train with --method dpo, cpo or simpo",
            ));
        };
        if obj.needs_reference() && reference.is_none() {
            return Err(Exception::custom("DPO without reference log-probs"));
        }
        Ok(terms_from_logits(&obj, logits, &ids, &rm, reference.as_ref())?.into_vec())
    };
    (inputs, Box::new(loss))
}

/// A batch's terms by the prefix-shared forward (`orpo_prefix.rs`: the prompt both rows of
/// a pair share runs once, the same per-token log-probs as the joint forward), or by the
/// joint forward where the pairs share no prefix.
pub fn prefix_shared_outputs(
    model: &dyn LanguageModel,
    set: &PairSet,
    batch: &[usize],
    method: &Method,
) -> Result<Vec<Array>, Exception> {
    let Method::Pairs(obj) = method else {
        return Err(Exception::custom(
            "preference pairs train with --method dpo, cpo or simpo",
        ));
    };
    let pairs: Vec<&Pair> = batch.iter().map(|&i| &set.pairs[i]).collect();
    let (ids, _, rm) = super::orpo::pair_batch(&pairs);
    let t = ids.shape()[1];
    let p = super::orpo_prefix::shared_prefix_len(&pairs, t as usize);
    let logps = if p == 0 {
        let logits = model.forward(
            &ids.index((.., ..t - 1)),
            &mut crate::cache::none::none_for(&model.make_caches()),
        )?;
        super::preference::token_logps(&logits, &ids)?
    } else {
        super::orpo_prefix::prefix_shared_logps(
            model,
            &ids,
            p as i32,
            super::orpo_prefix::first_response_step(&pairs),
        )?
    };
    let reference = set.reference.as_ref().map(|r| reference_rows(r, batch));
    if obj.needs_reference() && reference.is_none() {
        return Err(Exception::custom("DPO without reference log-probs"));
    }
    Ok(super::preference::pref_terms(obj, &logps, &rm, reference.as_ref())?.into_vec())
}

/// The progress bar's note for a step's terms: reward accuracy and margin.
pub fn step_note(method: &Method, outputs: &[Array]) -> Option<String> {
    let Method::Pairs(_) = method else {
        return None;
    };
    let get = |k: usize| -> Option<f32> {
        let a = outputs.get(k)?.as_dtype(mlx_rs::Dtype::Float32).ok()?;
        a.eval().ok()?;
        Some(a.as_slice::<f32>()[0])
    };
    Some(format!("acc {:.2} margin {:.3}", get(3)?, get(4)?))
}

/// The names of a pair objective's outputs (None for SFT and ORPO).
pub fn names(method: &Method) -> Option<&'static [&'static str]> {
    match method {
        Method::Pairs(obj) => Some(obj.names()),
        _ => None,
    }
}
