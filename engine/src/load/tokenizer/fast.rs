//! `tokenizer.json` into a tokenizer in one pass over the bytes, for the files the loader
//! takes as written. It builds what the crate's own deserializer builds
//! (`TokenizerVisitor::visit_map` in tokenizers 0.22: the pipeline's parts, then the model,
//! then `add_tokens` over the added tokens in file order), with a BPE model read straight
//! into the engine's own [`Bpe`] (`bpe.rs`): its merges as text borrowed from the file,
//! resolved to ids once, where the crate's way buffers the whole model twice (an untagged
//! enum over a JSON tree) and then builds its merge table from owned strings. On a Gemma 3
//! file (262 k pieces, 515 k merges) the crate's way took 1.0 s, most of a server's ready
//! time (issue 43).
//!
//! Any other model (WordPiece, WordLevel, Unigram, and BPE with merge dropout) is the
//! crate's, read by its own deserializer. The gates in `tests/it/tokenize.rs` hold both ways
//! equal on every tokenizer.json we have: serialized back (planted
//! `FastTokenizerNoByteFallback` is caught), and in the ids and offsets they give (planted
//! `FastBpeMergesByPosition` is caught).

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};

use serde::Deserialize;
use serde_json::value::RawValue;
use tokenizers::models::bpe::BpeTrainer;
use tokenizers::models::TrainerWrapper;
use tokenizers::{
    AddedToken, DecoderWrapper, ModelWrapper, NormalizerWrapper, PaddingParams,
    PostProcessorWrapper, PreTokenizerWrapper, Token, TokenizerBuilder, TokenizerImpl,
    TruncationParams,
};

use super::bpe::{self, Bpe, Flags};

type E = serde_json::Error;

/// The tokenizer the engine runs: the crate's pipeline around a [`Model`].
pub type Inner = TokenizerImpl<
    Model,
    NormalizerWrapper,
    PreTokenizerWrapper,
    PostProcessorWrapper,
    DecoderWrapper,
>;

/// A tokenizer's model: the engine's BPE, or any model of the crate's.
pub enum Model {
    Bpe(Bpe),
    Crate(ModelWrapper),
}

impl Model {
    /// Whether it is a BPE model (either way built).
    pub fn is_bpe(&self) -> bool {
        matches!(self, Model::Bpe(_) | Model::Crate(ModelWrapper::BPE(_)))
    }
}

/// `tokenizer`'s vocabulary size, added tokens included (HF's `len(tokenizer)`, the crate's
/// `get_vocab_size(true)`): the model's pieces and the added tokens, each string once. The
/// crate counts them by copying the whole vocabulary into a map (70 ms on 262 k pieces); on
/// the engine's BPE the added strings it lacks are counted instead.
pub fn vocab_size(tokenizer: &Inner) -> usize {
    use tokenizers::Model as _;
    match tokenizer.get_model() {
        Model::Bpe(model) => {
            let added = tokenizer.get_added_vocabulary().get_vocab();
            let missing = added.keys().filter(|t| model.token_to_id(t).is_none());
            model.get_vocab_size() + missing.count()
        }
        Model::Crate(_) => tokenizer.get_vocab_size(true),
    }
}

impl tokenizers::Model for Model {
    type Trainer = TrainerWrapper;

    fn tokenize(&self, sequence: &str) -> tokenizers::Result<Vec<Token>> {
        match self {
            Model::Bpe(m) => m.tokenize(sequence),
            Model::Crate(m) => m.tokenize(sequence),
        }
    }
    fn token_to_id(&self, token: &str) -> Option<u32> {
        match self {
            Model::Bpe(m) => m.token_to_id(token),
            Model::Crate(m) => m.token_to_id(token),
        }
    }
    fn id_to_token(&self, id: u32) -> Option<String> {
        match self {
            Model::Bpe(m) => m.id_to_token(id),
            Model::Crate(m) => m.id_to_token(id),
        }
    }
    fn get_vocab(&self) -> HashMap<String, u32> {
        match self {
            Model::Bpe(m) => m.get_vocab(),
            Model::Crate(m) => m.get_vocab(),
        }
    }
    fn get_vocab_size(&self) -> usize {
        match self {
            Model::Bpe(m) => m.get_vocab_size(),
            Model::Crate(m) => m.get_vocab_size(),
        }
    }
    fn save(
        &self,
        folder: &std::path::Path,
        prefix: Option<&str>,
    ) -> tokenizers::Result<Vec<std::path::PathBuf>> {
        match self {
            Model::Bpe(m) => m.save(folder, prefix),
            Model::Crate(m) => m.save(folder, prefix),
        }
    }
    fn get_trainer(&self) -> TrainerWrapper {
        match self {
            Model::Bpe(_) => BpeTrainer::default().into(),
            Model::Crate(m) => m.get_trainer(),
        }
    }
}

impl serde::Serialize for Model {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Model::Bpe(m) => m.serialize(s),
            Model::Crate(m) => m.serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for Model {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        ModelWrapper::deserialize(d).map(Model::Crate)
    }
}

/// An added token as the file lists it: its id (only checked by the crate, with a warning)
/// and the token.
#[derive(Deserialize)]
struct AddedTokenWithId {
    #[allow(dead_code)]
    id: u32,
    #[serde(flatten)]
    token: AddedToken,
}

/// The file's top level, the model read as BPE (a file whose model is not is read again
/// by the crate) and the rest left unparsed until its type is known; a part written as
/// null is kept (`Some("null")`), apart from an absent one, as the crate tells them apart.
#[derive(Deserialize)]
struct File<'a> {
    #[serde(borrow, default, deserialize_with = "present")]
    version: Option<&'a RawValue>,
    #[serde(borrow, default, deserialize_with = "present")]
    truncation: Option<&'a RawValue>,
    #[serde(borrow, default, deserialize_with = "present")]
    padding: Option<&'a RawValue>,
    #[serde(borrow, default, deserialize_with = "present")]
    added_tokens: Option<&'a RawValue>,
    #[serde(borrow, default, deserialize_with = "present")]
    normalizer: Option<&'a RawValue>,
    #[serde(borrow, default, deserialize_with = "present")]
    pre_tokenizer: Option<&'a RawValue>,
    #[serde(borrow, default, deserialize_with = "present")]
    post_processor: Option<&'a RawValue>,
    #[serde(borrow, default, deserialize_with = "present")]
    decoder: Option<&'a RawValue>,
    #[serde(borrow)]
    model: BpeFile<'a>,
}

/// A part as written, null included.
fn present<'de: 'a, 'a, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<&'a RawValue>, D::Error> {
    <&RawValue>::deserialize(d).map(Some)
}

/// A BPE model's fields, as `BPEVisitor` reads them (a null flag is the builder's default).
#[derive(Deserialize)]
struct BpeFile<'a> {
    #[serde(rename = "type", borrow)]
    kind: Option<Cow<'a, str>>,
    dropout: Option<f32>,
    unk_token: Option<String>,
    continuing_subword_prefix: Option<String>,
    end_of_word_suffix: Option<String>,
    fuse_unk: Option<bool>,
    byte_fallback: Option<bool>,
    ignore_merges: Option<bool>,
    vocab: Option<ahash::AHashMap<String, u32>>,
    #[serde(borrow)]
    merges: Option<Vec<Merge<'a>>>,
}

/// A string of the file, borrowed where it has no escapes.
struct Text<'a>(Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for Text<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_str(TextVisitor(std::marker::PhantomData))
            .map(Text)
    }
}

struct TextVisitor<'a>(std::marker::PhantomData<&'a ()>);

impl<'de: 'a, 'a> serde::de::Visitor<'de> for TextVisitor<'a> {
    type Value = Cow<'a, str>;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a string")
    }
    fn visit_borrowed_str<Er: serde::de::Error>(self, v: &'de str) -> Result<Self::Value, Er> {
        Ok(Cow::Borrowed(v))
    }
    fn visit_str<Er: serde::de::Error>(self, v: &str) -> Result<Self::Value, Er> {
        Ok(Cow::Owned(v.to_owned()))
    }
    fn visit_string<Er: serde::de::Error>(self, v: String) -> Result<Self::Value, Er> {
        Ok(Cow::Owned(v))
    }
}

/// One merge: a pair, or in the legacy form "a b" (read without buffering, where an
/// untagged enum would copy the whole list first).
enum Merge<'a> {
    Pair(Cow<'a, str>, Cow<'a, str>),
    Legacy(Cow<'a, str>),
}

impl<'de: 'a, 'a> Deserialize<'de> for Merge<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> serde::de::Visitor<'de> for V<'a> {
            type Value = Merge<'a>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a merge: [\"a\", \"b\"] or \"a b\"")
            }
            fn visit_borrowed_str<Er: serde::de::Error>(
                self,
                v: &'de str,
            ) -> Result<Merge<'a>, Er> {
                Ok(Merge::Legacy(Cow::Borrowed(v)))
            }
            fn visit_str<Er: serde::de::Error>(self, v: &str) -> Result<Merge<'a>, Er> {
                Ok(Merge::Legacy(Cow::Owned(v.to_owned())))
            }
            fn visit_string<Er: serde::de::Error>(self, v: String) -> Result<Merge<'a>, Er> {
                Ok(Merge::Legacy(Cow::Owned(v)))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Merge<'a>, A::Error> {
                let mut next = |i| {
                    seq.next_element::<Text<'a>>()?
                        .map(|t| t.0)
                        .ok_or_else(|| serde::de::Error::invalid_length(i, &self))
                };
                let (a, b) = (next(0)?, next(1)?);
                if seq.next_element::<serde::de::IgnoredAny>()?.is_some() {
                    return Err(serde::de::Error::invalid_length(3, &self));
                }
                Ok(Merge::Pair(a, b))
            }
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

/// The tokenizer `tokenizers::Tokenizer`'s deserializer makes of `bytes` (the engine's BPE
/// in place of the crate's), and the file's decoder as written (mlx-lm picks its
/// detokenizer by it), in one parse.
pub fn from_slice(bytes: &[u8]) -> Result<(Inner, serde_json::Value), E> {
    let Ok(file) = serde_json::from_slice::<File>(bytes) else {
        return by_the_crate(bytes);
    };
    let decoder_as_written = match file.decoder {
        Some(r) => serde_json::from_str(r.get())?,
        None => serde_json::Value::Null,
    };
    if let Some(v) = strict::<String>(file.version)? {
        if v != "1.0" {
            return Err(serde::de::Error::custom(format!(
                "Unknown tokenizer version '{v}'"
            )));
        }
    }
    let normalizer: Option<NormalizerWrapper> = part(file.normalizer)?;
    let pre_tokenizer: Option<PreTokenizerWrapper> = part(file.pre_tokenizer)?;
    let decoder: Option<DecoderWrapper> = part(file.decoder)?;
    let post_processor: Option<PostProcessorWrapper> = part(file.post_processor)?;
    let truncation: Option<TruncationParams> = part(file.truncation)?;
    let padding: Option<PaddingParams> = part(file.padding)?;
    let added: Vec<AddedTokenWithId> = strict(file.added_tokens)?.unwrap_or_default();
    let Some(model) = bpe(file.model)? else {
        return by_the_crate(bytes);
    };
    let built = TokenizerBuilder::<Model, _, _, _, _>::new()
        .with_model(Model::Bpe(model))
        .with_normalizer(normalizer)
        .with_pre_tokenizer(pre_tokenizer)
        .with_decoder(decoder)
        .with_post_processor(post_processor)
        .with_truncation(truncation)
        .with_padding(padding)
        .build()
        .map_err(|e| <E as serde::de::Error>::custom(e.to_string()))?;
    let mut tokenizer = Inner::from(built);
    let tokens: Vec<AddedToken> = added.into_iter().map(|t| t.token).collect();
    tokenizer.add_tokens(&tokens);
    Ok((tokenizer, decoder_as_written))
}

/// `bytes` read whole by the crate's deserializer.
fn by_the_crate(bytes: &[u8]) -> Result<(Inner, serde_json::Value), E> {
    // A key written twice keeps its last value, as the crate's visitor keeps it.
    let top: BTreeMap<String, &RawValue> = serde_json::from_slice(bytes)?;
    let decoder = match top.get("decoder") {
        Some(raw) => serde_json::from_str(raw.get())?,
        None => serde_json::Value::Null,
    };
    let tokenizer: Inner = serde_json::from_slice(bytes)?;
    Ok((tokenizer, decoder))
}

/// A part the crate reads as a plain value (null is an error, as there), if present.
fn strict<T: serde::de::DeserializeOwned>(raw: Option<&RawValue>) -> Result<Option<T>, E> {
    raw.map(|r| serde_json::from_str::<T>(r.get())).transpose()
}

/// A part of the file, None where it is absent or null.
fn part<T: serde::de::DeserializeOwned>(raw: Option<&RawValue>) -> Result<Option<T>, E> {
    raw.map_or(Ok(None), |r| serde_json::from_str::<Option<T>>(r.get()))
}

/// `BPEVisitor`'s model, built as the engine's [`Bpe`]; `None` for a model the crate reads
/// (not BPE, with merge dropout, or with ids far past its size).
fn bpe(file: BpeFile) -> Result<Option<Bpe>, E> {
    let custom = |e: String| <E as serde::de::Error>::custom(e);
    if file.kind.as_deref() != Some("BPE") {
        return Ok(None);
    }
    let dropout = file.dropout.is_some_and(|p| p != 0.0);
    let flags = Flags {
        dropout: file.dropout,
        unk_token: file.unk_token,
        continuing_subword_prefix: file.continuing_subword_prefix,
        end_of_word_suffix: file.end_of_word_suffix,
        fuse_unk: file.fuse_unk.unwrap_or(false),
        // Planted: the byte fallback is forgotten (the loaded tokenizer differs from the file's).
        byte_fallback: file.byte_fallback.unwrap_or(false)
            && !crate::plant::is(crate::plant::Defect::FastTokenizerNoByteFallback),
        ignore_merges: file.ignore_merges.unwrap_or(false),
    };
    let (Some(vocab), Some(merges)) = (file.vocab, file.merges) else {
        return Err(custom("Missing vocab/merges".into()));
    };
    // As the crate's untagged list: all pairs, or all legacy lines (its
    // `convert_merges_to_hashmap`: "#version" lines skipped, then exactly two parts split at
    // spaces); a list of both is no merges list.
    let pairs: Vec<(&str, &str)> = if merges.iter().all(|m| matches!(m, Merge::Pair(..))) {
        merges
            .iter()
            .filter_map(|m| match m {
                Merge::Pair(a, b) => Some((a.as_ref(), b.as_ref())),
                Merge::Legacy(_) => None,
            })
            .collect()
    } else if merges.iter().all(|m| matches!(m, Merge::Legacy(_))) {
        merges
            .iter()
            .filter_map(|m| match m {
                Merge::Legacy(line) => Some(line.as_ref()),
                Merge::Pair(..) => None,
            })
            .filter(|l| !l.starts_with("#version"))
            .enumerate()
            .map(
                |(rank, line)| match line.split(' ').collect::<Vec<_>>()[..] {
                    [a, b] => Ok((a, b)),
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
    let built = match dropout {
        true => None,
        false => Bpe::build(flags.clone(), vocab, &pairs),
    };
    match built {
        // The crate reads it; a merge its build would panic on is refused first.
        None => match bpe::check_tails(&flags, &pairs) {
            Ok(()) => Ok(None),
            Err(e) => Err(custom(e.to_string())),
        },
        Some(built) => built.map(Some).map_err(|e| custom(e.to_string())),
    }
}
