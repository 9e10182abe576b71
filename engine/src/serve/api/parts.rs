//! A message content read as text: a string, or a list of text parts joined. The chat and
//! Responses APIs read it alike and differ only in the part `type`s they take (`Kinds`).
//! Image parts are let through here and read by `serve::images` from the body.

use std::marker::PhantomData;

use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::Deserialize;

use super::Obj;
use crate::vision::served::IMAGE_MARK;

/// The parts an API takes: text, and its image part (no files).
pub trait Kinds {
    /// The text part `type`s taken.
    const TYPES: &'static [&'static str];
    /// The image part's `type` (no text of its own: `serve::images` reads it).
    const IMAGE: &'static str;
    /// The refusal of any other part (clients and tests read it as written).
    const REFUSAL: &'static str;
}

/// A content's text: a string, or its `K` parts joined.
#[derive(Debug)]
pub struct Parts<K>(pub String, PhantomData<K>);

impl<K> Default for Parts<K> {
    fn default() -> Self {
        Parts(String::new(), PhantomData)
    }
}

impl<'de, K: Kinds> Deserialize<'de> for Parts<K> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<K>(PhantomData<K>);
        impl<'de, K: Kinds> Visitor<'de> for V<K> {
            type Value = Parts<K>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a string or a list of text parts")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Parts<K>, E> {
                Ok(Parts(s.to_owned(), PhantomData))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Parts<K>, A::Error> {
                let mut text = String::new();
                while let Some(Obj(TextPart(t, _))) = seq.next_element::<Obj<TextPart<K>>>()? {
                    text.push_str(&t);
                }
                Ok(Parts(text, PhantomData))
            }
        }
        d.deserialize_any(V(PhantomData))
    }
}

/// A `{"type": <one of K::TYPES>, "text": …}` part. Checked while the part is read, so a
/// refusal names the part's path (`content[0]`).
struct TextPart<K>(String, PhantomData<K>);

#[derive(Deserialize)]
struct RawPart {
    #[serde(rename = "type")]
    kind: Option<String>,
    text: Option<String>,
}

impl<'de, K: Kinds> Deserialize<'de> for TextPart<K> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let p = RawPart::deserialize(d)?;
        match (p.kind.as_deref(), p.text) {
            (Some(kind), Some(t)) if K::TYPES.contains(&kind) => Ok(TextPart(t, PhantomData)),
            // Where the image stood (`vision::served`); `serve::images` reads the image.
            (Some(kind), _) if kind == K::IMAGE => Ok(TextPart(IMAGE_MARK.to_owned(), PhantomData)),
            _ => Err(de::Error::custom(K::REFUSAL)),
        }
    }
}
