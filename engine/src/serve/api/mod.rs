//! Request bodies as typed structs, one module per API (`chat`, `completions`; the
//! Responses API's is `responses::input`), each turned into the one internal
//! `request::GenRequest`. Bodies are deserialized with `serde_path_to_error`, so a bad
//! value is refused with a 400 whose `param` is the field's path (`messages[0].role`);
//! the generation fields the APIs share are `knobs::Knobs`, a message content's text
//! `parts::Parts`. Null reads as absent (every optional field is an `Option`), and unknown
//! fields are ignored, as mlx_lm.server does.

pub mod chat;
pub mod completions;
pub mod knobs;
pub mod parts;

use std::marker::PhantomData;

use serde::de::{self, Deserialize, DeserializeOwned, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::Value;

use super::error::ApiError;
use super::request::{Defaults, GenRequest};

/// Parses and validates a body for `/v1/chat/completions` (`chat`) or `/v1/completions`.
pub fn parse(body: &Value, chat: bool, d: &Defaults) -> Result<GenRequest, ApiError> {
    if chat {
        chat::parse(body, d)
    } else {
        completions::parse(body, d)
    }
}

/// `body` read as a `T`, whose fields must be an object; a bad value is an ApiError naming
/// its path.
pub fn read<T: DeserializeOwned>(body: &Value) -> Result<T, ApiError> {
    if !body.is_object() {
        return Err(ApiError::invalid("the request body must be a JSON object"));
    }
    serde_path_to_error::deserialize::<_, Obj<T>>(body)
        .map(|o| o.0)
        .map_err(|e| refusal(&e.path().to_string(), &e.inner().to_string()))
}

/// `v`, a part of a body found at `at`, read as a `T`; a bad value is an ApiError naming
/// its path from the body's root (`input[2].content[0]`).
pub fn read_at<T: DeserializeOwned>(v: &Value, at: &str) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(v).map_err(|e| {
        let path = match e.path().to_string() {
            p if p == "." => at.to_owned(),
            p if p.starts_with('[') => format!("{at}{p}"),
            p => format!("{at}.{p}"),
        };
        refusal(&path, &e.inner().to_string())
    })
}

/// A field that must be a JSON object. Derived structs also accept a JSON array (their
/// fields by position), which no API here allows: this reads only maps, and the fields'
/// paths are still tracked (the map access is the tracking one).
#[derive(Debug, Clone)]
pub struct Obj<T>(pub T);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Obj<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct ObjVisitor<T>(PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for ObjVisitor<T> {
            type Value = T;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
                T::deserialize(de::value::MapAccessDeserializer::new(map))
            }
        }
        d.deserialize_map(ObjVisitor(PhantomData)).map(Obj)
    }
}

/// A field that is a string or a list of `T` (a Messages content, a Responses input): one
/// visitor, so a bad element keeps its path (`messages[0].content[1].type`).
#[derive(Debug)]
pub enum TextOr<T> {
    Text(String),
    List(Vec<T>),
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for TextOr<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<T>(PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for V<T> {
            type Value = TextOr<T>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a string or a list")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<TextOr<T>, E> {
                Ok(TextOr::Text(s.to_owned()))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<TextOr<T>, A::Error> {
                let mut list = Vec::new();
                while let Some(x) = seq.next_element()? {
                    list.push(x);
                }
                Ok(TextOr::List(list))
            }
        }
        d.deserialize_any(V(PhantomData))
    }
}

/// serde's message for a bad value at `path`, said as this server says it: "`field` must
/// be an integer, not string "ten"", "`field` is required".
fn refusal(path: &str, serde: &str) -> ApiError {
    if path == "." && !serde.starts_with("missing field") && !serde.starts_with("unknown field") {
        return ApiError::invalid(format!("the request body is not valid: {serde}"));
    }
    if let Some(rest) = serde.strip_prefix("missing field `") {
        let name = rest.trim_end_matches('`');
        let field = if path == "." {
            name.to_owned()
        } else {
            format!("{path}.{name}")
        };
        return ApiError::field(&field, format!("{field} is required"));
    }
    let typed = serde
        .strip_prefix("invalid type: ")
        .or_else(|| serde.strip_prefix("invalid value: "));
    if let Some((got, want)) = typed.and_then(|t| t.split_once(", expected ")) {
        // An integer past i64 is an integer of the wrong size, not of the wrong type.
        let want = match expected(want) {
            "an integer" if got.starts_with("integer") => "an integer within ±2^63",
            w => w,
        };
        return ApiError::field(path, format!("{path} must be {want}, not {got}"));
    }
    if let Some(rest) = serde.strip_prefix("unknown field `") {
        // A body that refuses unknown fields (the Responses API's); the path holds the key.
        let name = rest.split('`').next().unwrap_or_default();
        let field = if path == "." { name } else { path };
        return ApiError::field(field, format!("unknown parameter `{field}`"));
    }
    if let Some(rest) = serde.strip_prefix("unknown variant ") {
        return ApiError::field(path, format!("{path}: unknown value {rest}"));
    }
    // Our own checks (`de::Error::custom`) say what is wrong in their own words.
    ApiError::field(path, serde.to_owned())
}

/// serde's name of an expected type in words.
fn expected(want: &str) -> &str {
    match want {
        "i64" | "u64" | "i32" | "u32" | "usize" => "an integer",
        "f64" | "f32" => "a number",
        "a sequence" => "a list",
        "a map" => "an object",
        w if w.starts_with("struct ") => "an object",
        w => w,
    }
}

/// An integer field: `default` when absent, else within `min..=max` (named `key`).
pub fn bounded(
    key: &str,
    v: Option<i64>,
    default: i64,
    min: i64,
    max: i64,
) -> Result<i64, ApiError> {
    let Some(n) = v else {
        return Ok(default);
    };
    if n < min {
        return Err(ApiError::field(
            key,
            format!("{key} must be at least {min}"),
        ));
    }
    if n > max {
        return Err(ApiError::field(key, format!("{key} must be at most {max}")));
    }
    Ok(n)
}

/// A number field: `default` when absent, else within `min..=max` (named `key`).
pub fn bounded_f(
    key: &str,
    v: Option<f64>,
    default: f64,
    min: f64,
    max: f64,
) -> Result<f64, ApiError> {
    let Some(x) = v else {
        return Ok(default);
    };
    if x < min {
        return Err(ApiError::field(
            key,
            format!("{key} must be at least {min}"),
        ));
    }
    if x > max {
        return Err(ApiError::field(key, format!("{key} must be at most {max}")));
    }
    Ok(x)
}

#[cfg(test)]
mod tests;
