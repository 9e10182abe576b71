//! LoRA adapters in `engine serve`: `--adapter NAME=DIR` (repeatable) and `POST
//! /v1/adapters` / `DELETE /v1/adapters/NAME` mount adapters (mlx-lm's adapter
//! directories: `train::lora::OwnedAdapter`) beside the one model; a request's `model`
//! picks one — "BASE:NAME" or "NAME" — on every API (`Registry::resolve`, the one
//! resolver). The HTTP side holds names and use counts only; the adapters' arrays live on
//! the model thread (`lane`), which puts a request's adapter on the model before each of its
//! MLX steps and keys the prompt cache by it. With no adapter mounted any name goes to the
//! model, as before (clients send fixed names like "gpt-4o").

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use axum::http::StatusCode;

use serde_json::{json, Value};

use super::error::ApiError;
use super::AppState;

/// Longest adapter name accepted.
pub const MAX_NAME: usize = 64;

/// `--adapter NAME=DIR`, as clap reads it (DIR may be a hub-cache id, as `--model` takes).
#[derive(Debug, Clone)]
pub struct Flag {
    pub name: String,
    pub dir: PathBuf,
}

/// clap's `value_parser` for `--adapter`.
pub fn flag(arg: &str) -> Result<Flag, String> {
    let Some((name, dir)) = arg.split_once('=') else {
        return Err(format!(
            "`{arg}` is not NAME=DIR: name the adapter, e.g. --adapter trained=./adapters"
        ));
    };
    check_name(name)?;
    let dir = crate::load::hub::resolve_model(dir).map_err(|e| e.to_string())?;
    Ok(Flag {
        name: name.to_owned(),
        dir,
    })
}

/// An adapter's name: 1 to 64 of `A-Z a-z 0-9 . _ -` (no `:`, which separates it from the
/// model's name, nor a path separator).
pub fn check_name(name: &str) -> Result<(), String> {
    let ok = (1..=MAX_NAME).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "adapter name {name:?} is not 1 to {MAX_NAME} characters of A-Z, a-z, 0-9, `.`, \
             `_`, `-` (no `:` or `/`): pick a name such as `my-adapter`"
        ))
    }
}

/// A request's `model` as "BASE:NAME": split at its last `:` (an adapter's name has none;
/// a model's may). Whether BASE names a model is the caller's to check (`Registry::resolve`
/// on one model, `fleet::Catalog::route` across them).
pub fn split(model: &str) -> Option<(&str, &str)> {
    model.rsplit_once(':')
}

/// The names the base model answers to: its canonical path (`AppState.model_id`), its
/// directory's name, and for a hub-cache snapshot (`models--org--name/snapshots/<rev>`)
/// the repo id `org/name`.
pub fn base_names(model_id: &str) -> Vec<String> {
    let path = Path::new(model_id);
    let mut names = vec![model_id.to_owned()];
    let repo = path
        .ancestors()
        .filter_map(|p| p.file_name()?.to_str())
        .find_map(|n| n.strip_prefix("models--"))
        .map(|r| r.replacen("--", "/", 1));
    let dir = path.file_name().and_then(|n| n.to_str()).map(str::to_owned);
    for n in [repo, dir].into_iter().flatten() {
        if !names.contains(&n) {
            names.push(n);
        }
    }
    names
}

/// One mounted adapter, as the HTTP side knows it.
pub(super) struct Entry {
    pub(super) dir: PathBuf,
    /// Requests holding it (`Use`), from resolution until the model thread drops them.
    pub(super) uses: Arc<AtomicUsize>,
    /// Being unmounted: new requests no longer find it.
    pub(super) closing: bool,
}

/// A request's hold on its adapter: counted while it exists (queued, running), so that
/// unmounting an adapter in use is refused.
#[derive(Debug)]
pub struct Use {
    name: Arc<str>,
    uses: Arc<AtomicUsize>,
}

impl Use {
    pub fn name(&self) -> &str {
        &self.name
    }

    fn new(name: &str, uses: &Arc<AtomicUsize>) -> Self {
        uses.fetch_add(1, Ordering::AcqRel);
        Use {
            name: name.into(),
            uses: uses.clone(),
        }
    }
}

impl Clone for Use {
    fn clone(&self) -> Self {
        Use::new(&self.name, &self.uses)
    }
}

impl Drop for Use {
    fn drop(&mut self) {
        self.uses.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The adapters mounted, by name, and the base model's names.
pub struct Registry {
    base: Vec<String>,
    mounted: Mutex<BTreeMap<String, Entry>>,
    /// Mounts and unmounts, one at a time.
    pub(super) admin: tokio::sync::Mutex<()>,
}

impl Registry {
    pub fn new(model_id: &str, startup: &[Flag]) -> Self {
        let mounted = startup
            .iter()
            .map(|f| {
                let entry = Entry {
                    dir: f.dir.clone(),
                    uses: Default::default(),
                    closing: false,
                };
                (f.name.clone(), entry)
            })
            .collect();
        Registry {
            base: base_names(model_id),
            mounted: Mutex::new(mounted),
            admin: Default::default(),
        }
    }

    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Entry>> {
        self.mounted.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The mounted adapters' names and directories, in name order.
    pub fn listed(&self) -> Vec<(String, PathBuf)> {
        self.lock()
            .iter()
            .filter(|(_, e)| !e.closing)
            .map(|(n, e)| (n.clone(), e.dir.clone()))
            .collect()
    }

    /// The base model's name as listed (its canonical path).
    pub fn base(&self) -> &str {
        &self.base[0]
    }

    /// What a request's `model` selects: None for the base model (or any name while no
    /// adapter is mounted), the adapter for "BASE:NAME" or "NAME"; an unknown name is
    /// OpenAI's 404 `model_not_found`, listing the names served.
    pub fn resolve(&self, model: Option<&str>) -> Result<Option<Use>, ApiError> {
        let mounted = self.lock();
        let Some(model) = model.filter(|m| !m.is_empty()) else {
            return Ok(None);
        };
        // "BASE:NAME" asks for an adapter even while none is mounted; other names do
        // only while some are (clients send fixed names such as "gpt-4o").
        let asked = match split(model) {
            Some((base, name)) if self.base.iter().any(|b| b == base) => Some(name),
            _ => None,
        };
        if asked.is_none() && (mounted.is_empty() || self.base.iter().any(|b| b == model)) {
            return Ok(None);
        }
        let name = asked.unwrap_or(model);
        match mounted.get(name).filter(|e| !e.closing) {
            Some(e) => Ok(Some(Use::new(name, &e.uses))),
            None => {
                let served: Vec<String> = mounted
                    .iter()
                    .filter(|(_, e)| !e.closing)
                    .map(|(n, _)| format!("{}:{n}", self.base()))
                    .collect();
                Err(ApiError::field(
                    "model",
                    format!(
                        "the model `{model}` does not exist: this server serves `{}` and {}; \
                         name one of them (an adapter also by its name alone)",
                        self.base(),
                        if served.is_empty() {
                            "no adapters (mount one: POST /v1/adapters)".to_owned()
                        } else {
                            format!("its adapters {}", served.join(", "))
                        }
                    ),
                )
                .with_status(StatusCode::NOT_FOUND)
                .with_code("model_not_found"))
            }
        }
    }
}

/// The `/v1/models` entries of the mounted adapters: "BASE:NAME", parent BASE.
pub fn model_entries(s: &AppState) -> Vec<Value> {
    let base = s.adapters.base();
    s.adapters
        .listed()
        .into_iter()
        .map(|(name, _)| {
            json!({
                "id": format!("{base}:{name}"), "object": "model", "created": s.created,
                "owned_by": "engine", "parent": base,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::{base_names, check_name, Flag, Registry};

    #[test]
    fn names_are_short_plain_words() {
        assert!(check_name("trained-v1.2_b").is_ok());
        for bad in ["", "a:b", "a/b", "a\\b", "é", &"x".repeat(65)] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_base_answers_to_its_path_dir_and_repo_id() {
        let names = base_names("/h/models--org--tiny/snapshots/abc");
        assert_eq!(
            names,
            ["/h/models--org--tiny/snapshots/abc", "org/tiny", "abc"]
        );
    }

    #[test]
    fn a_request_picks_an_adapter_by_name_or_base_colon_name() {
        let none = Registry::new("/m/tiny", &[]);
        assert!(none.resolve(Some("gpt-4o")).unwrap().is_none());
        // An adapter asked for by BASE:NAME is refused even while none is mounted.
        let e = none.resolve(Some("tiny:t")).unwrap_err();
        assert_eq!(e.status.as_u16(), 404);
        assert!(e.message.contains("no adapters"), "{}", e.message);
        let flag = Flag {
            name: "t".into(),
            dir: "/a".into(),
        };
        let r = Registry::new("/m/tiny", &[flag]);
        assert!(r.resolve(None).unwrap().is_none());
        assert!(r.resolve(Some("tiny")).unwrap().is_none());
        assert_eq!(r.resolve(Some("t")).unwrap().unwrap().name(), "t");
        assert_eq!(r.resolve(Some("tiny:t")).unwrap().unwrap().name(), "t");
        assert_eq!(r.resolve(Some("/m/tiny:t")).unwrap().unwrap().name(), "t");
        let e = r.resolve(Some("tiny:u")).unwrap_err();
        assert_eq!(e.status.as_u16(), 404);
        assert_eq!(e.body()["error"]["code"], "model_not_found");
        assert!(e.message.contains("/m/tiny:t"), "{}", e.message);
        assert!(r.resolve(Some("gpt-4o")).is_err());
    }
}
