//! The configured models and their names (docs/serve.md, "Many models"): every `--model`
//! and every model under `--models-dir`, found once at startup. A request's `model` string
//! is matched against these names only, as strings: nothing a client sends reaches the
//! filesystem.
//!
//! Names: a directory's basename; a hub-cache snapshot's repo id (`org/name`, as the hub's
//! `models--org--name` folder spells it); and either's canonical path (what a single-model
//! server reports as its model id). `BASE:ADAPTER` names adapter ADAPTER on model BASE:
//! routed by BASE (the adapter is the model's to resolve).

use std::path::{Path, PathBuf};

use crate::load::hub::{resolve_in, RepoRef};

/// One configured model.
#[derive(Debug, Clone)]
pub struct Spec {
    /// Its short name (`/v1/models` lists it).
    pub name: String,
    /// Its directory.
    pub path: PathBuf,
    /// Its canonical path, as text (its other name).
    pub canonical: String,
}

impl Spec {
    fn new(name: String, path: PathBuf) -> Self {
        let canonical = path
            .canonicalize()
            .unwrap_or_else(|_| path.clone())
            .display()
            .to_string();
        Spec {
            name,
            path,
            canonical,
        }
    }

    fn named(&self, name: &str) -> bool {
        self.name == name || self.canonical == name
    }
}

/// The name of a model directory: its hub repo id when it is a hub-cache snapshot
/// (`…/models--org--name/snapshots/<commit>`), else its basename.
pub fn name_of(path: &Path) -> String {
    let snapshot = path
        .parent()
        .filter(|p| p.file_name().is_some_and(|n| n == "snapshots"))
        .and_then(Path::parent)
        .and_then(|repo| repo.file_name())
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_prefix("models--"))
        .map(|id| id.replacen("--", "/", 1));
    snapshot.unwrap_or_else(|| {
        path.file_name().map_or_else(
            || path.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        )
    })
}

/// Whether `dir` holds a model: a config.json and at least one *.safetensors file.
fn is_model_dir(dir: &Path) -> bool {
    dir.join("config.json").is_file()
        && std::fs::read_dir(dir).is_ok_and(|entries| {
            entries.flatten().any(|e| {
                e.path()
                    .extension()
                    .is_some_and(|x| x.eq_ignore_ascii_case("safetensors"))
            })
        })
}

/// The models directly under `dir`: model directories and hub-cache repos (their `main`
/// snapshot), in name order.
fn scan(dir: &Path) -> anyhow::Result<Vec<Spec>> {
    let entries = std::fs::read_dir(dir).map_err(|e| {
        anyhow::anyhow!(
            "--models-dir {}: cannot list it ({e}); give a directory of model directories",
            dir.display()
        )
    })?;
    let mut found = Vec::new();
    for entry in entries.flatten() {
        let path = entry.path();
        let Some(file) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        if let Some(id) = file.strip_prefix("models--") {
            let id = id.replacen("--", "/", 1);
            if let Some(repo) = RepoRef::parse(&id) {
                if let Ok(snapshot) = resolve_in(dir, &repo) {
                    if is_model_dir(&snapshot) {
                        found.push(Spec::new(id, snapshot));
                    }
                }
            }
        } else if is_model_dir(&path) {
            found.push(Spec::new(file.to_owned(), path));
        }
    }
    found.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(found)
}

/// The configured models, the default (the first `--model`, else the first found) first.
#[derive(Debug)]
pub struct Catalog {
    pub specs: Vec<Spec>,
}

/// Why a request's `model` names no configured model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unknown;

impl Catalog {
    /// Every `--model` (in order), then every model under `--models-dir`; a name given
    /// twice is refused.
    pub fn new(models: &[PathBuf], models_dir: Option<&Path>) -> anyhow::Result<Self> {
        let mut specs: Vec<Spec> = models
            .iter()
            .map(|p| Spec::new(name_of(p), p.clone()))
            .collect();
        if let Some(dir) = models_dir {
            let found = scan(dir)?;
            anyhow::ensure!(
                !found.is_empty() || !specs.is_empty(),
                "--models-dir {} holds no model (a directory with config.json and \
                 *.safetensors, or a hub-cache models--org--name folder)",
                dir.display()
            );
            specs.extend(found);
        }
        for (i, a) in specs.iter().enumerate() {
            for b in &specs[..i] {
                anyhow::ensure!(
                    !(b.named(&a.name) || b.named(&a.canonical)),
                    "two models are named {:?} ({} and {}); each model needs its own name \
                     (rename a directory, or give it once)",
                    a.name,
                    b.path.display(),
                    a.path.display()
                );
            }
        }
        Ok(Catalog { specs })
    }

    /// The model a name names exactly (a `--pin`).
    pub fn exact(&self, name: &str) -> Option<usize> {
        self.specs.iter().position(|s| s.named(name))
    }

    /// The model a request's `model` routes to: none given → the default; a model's name,
    /// or `BASE:ADAPTER` with BASE one → that model; anything else → the default where it
    /// is the only model (clients send fixed names such as "gpt-4o"), else Unknown.
    pub fn route(&self, requested: Option<&str>) -> Result<usize, Unknown> {
        let Some(name) = requested else {
            return Ok(0);
        };
        if let Some(i) = self.exact(name) {
            return Ok(i);
        }
        if let Some(i) = crate::serve::adapters::split(name).and_then(|(base, _)| self.exact(base))
        {
            return Ok(i);
        }
        if self.specs.len() == 1 {
            return Ok(0);
        }
        Err(Unknown)
    }

    /// The names, for a refusal.
    pub fn names(&self) -> Vec<&str> {
        self.specs.iter().map(|s| s.name.as_str()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn catalog(names: &[&str]) -> Catalog {
        Catalog {
            specs: names
                .iter()
                .map(|n| Spec {
                    name: n.to_string(),
                    path: PathBuf::from(format!("/m/{n}")),
                    canonical: format!("/m/{n}"),
                })
                .collect(),
        }
    }

    #[test]
    fn requests_route_by_name_path_or_adapter_base_and_nothing_else() {
        let c = catalog(&["a", "org/b"]);
        assert_eq!(c.route(None), Ok(0));
        assert_eq!(c.route(Some("org/b")), Ok(1));
        assert_eq!(c.route(Some("/m/org/b")), Ok(1));
        assert_eq!(c.route(Some("org/b:my-lora")), Ok(1));
        for hostile in [
            "",
            "gpt-4o",
            "../a",
            "/m",
            "a/..",
            "org",
            &"a".repeat(10_000),
        ] {
            assert_eq!(c.route(Some(hostile)), Err(Unknown), "{hostile:.20}");
        }
        // One model: every name is that model's (clients send fixed names).
        assert_eq!(catalog(&["a"]).route(Some("gpt-4o")), Ok(0));
    }

    #[test]
    fn hub_snapshots_are_named_by_repo_id() {
        let p = Path::new("/cache/models--org--some-model/snapshots/0123abcd");
        assert_eq!(name_of(p), "org/some-model");
        assert_eq!(name_of(Path::new("/models/tiny-qwen3")), "tiny-qwen3");
    }

    #[test]
    fn a_directory_of_models_is_scanned_and_duplicates_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        for name in ["b", "a", "not-a-model"] {
            let d = dir.path().join(name);
            std::fs::create_dir(&d).unwrap();
            if name != "not-a-model" {
                std::fs::write(d.join("config.json"), "{}").unwrap();
                std::fs::write(d.join("model.safetensors"), "").unwrap();
            }
        }
        let snap = dir.path().join("models--org--c/snapshots/abc");
        std::fs::create_dir_all(&snap).unwrap();
        std::fs::create_dir_all(dir.path().join("models--org--c/refs")).unwrap();
        std::fs::write(dir.path().join("models--org--c/refs/main"), "abc").unwrap();
        std::fs::write(snap.join("config.json"), "{}").unwrap();
        std::fs::write(snap.join("model.safetensors"), "").unwrap();
        let c = Catalog::new(&[], Some(dir.path())).unwrap();
        assert_eq!(c.names(), ["a", "b", "org/c"]);
        let again = Catalog::new(&[dir.path().join("a")], Some(dir.path()));
        assert!(again
            .unwrap_err()
            .to_string()
            .contains("two models are named"));
    }
}
