//! `tokenizer.json` into a `tokenizers::Tokenizer` in one pass over the bytes, for the files
//! the loader takes as written. It builds what the crate's own deserializer builds
//! (`TokenizerVisitor::visit_map` in tokenizers 0.22: the pipeline's parts, then the model,
//! then `add_tokens` over the added tokens in file order), but reads a BPE model's
//! vocabulary and merges straight into their tables. The crate's way buffers the whole model
//! twice first (an untagged enum over a JSON tree): on a Gemma 3 file (262 k pieces, 515 k
//! merges) that was 0.6 s of the 1.0 s the load took (issue 43, ready time). What is left
//! is `BpeBuilder::build` itself: the merge table, one lookup per merge.
//!
//! Any other model (WordPiece, WordLevel, Unigram) goes through the crate's deserializer
//! unchanged. The gate `tests/it/tokenize.rs::the_one_pass_loader_builds_what_the_tokenizers_crate_builds`
//! holds both ways equal, serialized back, on every tokenizer.json we have (planted
//! `FastTokenizerNoByteFallback` is caught).

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::value::RawValue;
use tokenizers::models::bpe::BPE;
use tokenizers::{
    AddedToken, DecoderWrapper, ModelWrapper, NormalizerWrapper, PaddingParams,
    PostProcessorWrapper, PreTokenizerWrapper, TokenizerBuilder, TruncationParams,
};

type E = serde_json::Error;

/// An added token as the file lists it: its id (only checked by the crate, with a warning)
/// and the token.
#[derive(Deserialize)]
struct AddedTokenWithId {
    #[allow(dead_code)]
    id: u32,
    #[serde(flatten)]
    token: AddedToken,
}

/// Just the model's type (absent in files older than the `type` tag).
#[derive(Deserialize)]
struct ModelType<'a> {
    #[serde(rename = "type")]
    kind: Option<&'a str>,
}

/// A BPE model's fields, as `BPEVisitor` reads them (a null flag is the builder's default).
#[derive(Deserialize)]
struct BpeFile {
    dropout: Option<f32>,
    unk_token: Option<String>,
    continuing_subword_prefix: Option<String>,
    end_of_word_suffix: Option<String>,
    fuse_unk: Option<bool>,
    byte_fallback: Option<bool>,
    ignore_merges: Option<bool>,
    vocab: Option<ahash::AHashMap<String, u32>>,
    merges: Option<Vec<Merge>>,
}

/// One merge: a pair, or in the legacy form "a b" (read without buffering, where an
/// untagged enum would copy the whole list first).
enum Merge {
    Pair(String, String),
    Legacy(String),
}

impl<'de> Deserialize<'de> for Merge {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Merge;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a merge: [\"a\", \"b\"] or \"a b\"")
            }
            fn visit_str<Er: serde::de::Error>(self, v: &str) -> Result<Merge, Er> {
                Ok(Merge::Legacy(v.to_owned()))
            }
            fn visit_string<Er: serde::de::Error>(self, v: String) -> Result<Merge, Er> {
                Ok(Merge::Legacy(v))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Merge, A::Error> {
                let mut next = |i| {
                    seq.next_element::<String>()?
                        .ok_or_else(|| serde::de::Error::invalid_length(i, &self))
                };
                let (a, b) = (next(0)?, next(1)?);
                if seq.next_element::<serde::de::IgnoredAny>()?.is_some() {
                    return Err(serde::de::Error::invalid_length(3, &self));
                }
                Ok(Merge::Pair(a, b))
            }
        }
        d.deserialize_any(V)
    }
}

/// The tokenizer `tokenizers::Tokenizer`'s deserializer makes of `bytes`, and the file's
/// decoder as written (mlx-lm picks its detokenizer by it), in one parse.
pub fn from_slice(bytes: &[u8]) -> Result<(tokenizers::Tokenizer, serde_json::Value), E> {
    // The top level, each part left unparsed until its type is known.
    let file: BTreeMap<String, &RawValue> = serde_json::from_slice(bytes)?;
    let raw = |key: &str| file.get(key).copied();
    let decoder_as_written = match raw("decoder") {
        Some(r) => serde_json::from_str(r.get())?,
        None => serde_json::Value::Null,
    };
    if let Some(v) = part::<String>(raw("version"))? {
        if v != "1.0" {
            return Err(serde::de::Error::custom(format!(
                "Unknown tokenizer version '{v}'"
            )));
        }
    }
    let model_raw = raw("model").ok_or_else(|| <E as serde::de::Error>::missing_field("model"))?;
    let kind: ModelType = serde_json::from_str(model_raw.get())?;
    if kind.kind != Some("BPE") {
        return Ok((serde_json::from_slice(bytes)?, decoder_as_written));
    }
    let normalizer: Option<NormalizerWrapper> = part(raw("normalizer"))?;
    let pre_tokenizer: Option<PreTokenizerWrapper> = part(raw("pre_tokenizer"))?;
    let decoder: Option<DecoderWrapper> = part(raw("decoder"))?;
    let post_processor: Option<PostProcessorWrapper> = part(raw("post_processor"))?;
    let truncation: Option<TruncationParams> = part(raw("truncation"))?;
    let padding: Option<PaddingParams> = part(raw("padding"))?;
    let added: Vec<AddedTokenWithId> = part(raw("added_tokens"))?.unwrap_or_default();
    let model = bpe(serde_json::from_str(model_raw.get())?)?;
    let built = TokenizerBuilder::<ModelWrapper, _, _, _, _>::new()
        .with_model(model.into())
        .with_normalizer(normalizer)
        .with_pre_tokenizer(pre_tokenizer)
        .with_decoder(decoder)
        .with_post_processor(post_processor)
        .with_truncation(truncation)
        .with_padding(padding)
        .build()
        .map_err(|e| <E as serde::de::Error>::custom(e.to_string()))?;
    let mut tokenizer = tokenizers::Tokenizer::from(built);
    let tokens: Vec<AddedToken> = added.into_iter().map(|t| t.token).collect();
    tokenizer.add_tokens(&tokens);
    Ok((tokenizer, decoder_as_written))
}

/// A part of the file, None where it is absent or null.
fn part<T: serde::de::DeserializeOwned>(raw: Option<&RawValue>) -> Result<Option<T>, E> {
    raw.map_or(Ok(None), |r| serde_json::from_str::<Option<T>>(r.get()))
}

/// `BPEVisitor`'s model: the builder with the file's flags, vocabulary and merges.
fn bpe(file: BpeFile) -> Result<BPE, E> {
    let custom = |e: String| <E as serde::de::Error>::custom(e);
    let mut b = BPE::builder();
    if let Some(p) = file.dropout {
        b = b.dropout(p);
    }
    if let Some(t) = file.unk_token {
        b = b.unk_token(t);
    }
    if let Some(p) = file.continuing_subword_prefix {
        b = b.continuing_subword_prefix(p);
    }
    if let Some(s) = file.end_of_word_suffix {
        b = b.end_of_word_suffix(s);
    }
    if let Some(f) = file.fuse_unk {
        b = b.fuse_unk(f);
    }
    // Planted: the byte fallback is forgotten (the loaded tokenizer differs from the file's).
    if let Some(f) = file.byte_fallback {
        b = b.byte_fallback(
            f && !crate::plant::is(crate::plant::Defect::FastTokenizerNoByteFallback),
        );
    }
    if let Some(i) = file.ignore_merges {
        b = b.ignore_merges(i);
    }
    let (Some(vocab), Some(merges)) = (file.vocab, file.merges) else {
        return Err(custom("Missing vocab/merges".into()));
    };
    // As the crate's untagged list: all pairs, or all legacy lines (its
    // `convert_merges_to_hashmap`: "#version" lines skipped, then exactly two parts split at
    // spaces); a list of both is no merges list.
    let merges: Vec<(String, String)> = if merges.iter().all(|m| matches!(m, Merge::Pair(..))) {
        merges
            .into_iter()
            .filter_map(|m| match m {
                Merge::Pair(a, b) => Some((a, b)),
                Merge::Legacy(_) => None,
            })
            .collect()
    } else if merges.iter().all(|m| matches!(m, Merge::Legacy(_))) {
        merges
            .iter()
            .filter_map(|m| match m {
                Merge::Legacy(line) => Some(line),
                Merge::Pair(..) => None,
            })
            .filter(|l| !l.starts_with("#version"))
            .enumerate()
            .map(
                |(rank, line)| match line.split(' ').collect::<Vec<_>>()[..] {
                    [a, b] => Ok((a.to_owned(), b.to_owned())),
                    _ => Err(custom(format!(
                        "Merges text file invalid at line {}",
                        rank + 1
                    ))),
                },
            )
            .collect::<Result<_, _>>()?
    } else {
        return Err(custom("merges: pairs and \"a b\" lines mixed".into()));
    };
    b.vocab_and_merges(vocab, merges)
        .build()
        .map_err(|e| custom(e.to_string()))
}
