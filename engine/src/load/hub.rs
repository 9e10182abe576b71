//! `--model` as a Hugging Face hub repo id (`org/name`, optionally `org/name@revision`),
//! resolved from the local hub cache only: the engine never downloads. The cache is found
//! as huggingface_hub's constants find it (`HF_HUB_CACHE`, the legacy
//! `HUGGINGFACE_HUB_CACHE`, `HF_HOME/hub`, `XDG_CACHE_HOME/huggingface/hub`,
//! `~/.cache/huggingface/hub`), and a revision as `snapshot_download(local_files_only=True)`
//! finds it: `models--org--name/refs/<revision>` holds a commit, whose files are under
//! `snapshots/<commit>/`; a 40-hex revision is a commit already. A path that exists wins.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// Why a `--model` value names no model directory.
#[derive(Debug, thiserror::Error)]
pub enum HubError {
    /// A repo id (or revision) the cache does not hold.
    #[error(
        "no such directory, and the Hugging Face repo {repo_id}{at} is not in the \
         local hub cache {cache} ({missing} not found); the engine never downloads: fetch it \
         first with `hf download {repo_id}{revision_flag}` (or `huggingface-cli download \
         {repo_id}{revision_flag}`), or set HF_HUB_CACHE to the cache that holds it",
        cache = cache.display(),
        missing = missing.display(),
        at = revision.as_ref().map(|r| format!(" at revision {r}")).unwrap_or_default(),
        revision_flag = revision.as_ref().map(|r| format!(" --revision {r}")).unwrap_or_default()
    )]
    NotCached {
        repo_id: String,
        revision: Option<String>,
        cache: PathBuf,
        /// The first piece of the layout that is absent.
        missing: PathBuf,
    },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// A repo id and the revision asked for (`None`: the `main` ref).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepoRef {
    pub repo_id: String,
    pub revision: Option<String>,
}

/// huggingface_hub's `validate_repo_id`: one or two `[\w\-.]` names, at most 96 characters,
/// no `--` or `..`, a name neither starts nor ends with `-` or `.`.
fn valid_repo_id(id: &str) -> bool {
    let name_ok = |n: &str| {
        !n.is_empty()
            && n.chars()
                .all(|c| c.is_alphanumeric() || c == '_' || c == '-' || c == '.')
            && !n.starts_with(['-', '.'])
            && !n.ends_with(['-', '.'])
    };
    let parts: Vec<&str> = id.split('/').collect();
    id.len() <= 96
        && parts.len() <= 2
        && parts.iter().all(|p| name_ok(p))
        && !id.contains("--")
        && !id.contains("..")
}

impl RepoRef {
    /// `org/name` or `org/name@revision` (a bare `name` too, as the hub allows); `None` for
    /// anything that cannot be a repo id (an absolute path, `./dir`, …).
    pub fn parse(s: &str) -> Option<RepoRef> {
        let (id, revision) = match s.split_once('@') {
            Some((id, rev)) if !rev.is_empty() => (id, Some(rev.to_owned())),
            Some(_) => return None,
            None => (s, None),
        };
        valid_repo_id(id).then(|| RepoRef {
            repo_id: id.to_owned(),
            revision,
        })
    }

    /// The repo's folder in the cache (`repo_folder_name`): `models--org--name`.
    pub fn folder_name(&self) -> String {
        format!("models--{}", self.repo_id.replace('/', "--"))
    }
}

/// `~` and `~/…` as `os.path.expanduser` reads them.
fn expand_user(path: OsString, home: Option<&OsString>) -> PathBuf {
    let path = PathBuf::from(path);
    match (path.strip_prefix("~"), home) {
        (Ok(rest), Some(home)) => Path::new(home).join(rest),
        _ => path,
    }
}

/// The hub cache directory from the environment `var` reads, in huggingface_hub's order.
pub fn cache_dir_from(var: impl Fn(&str) -> Option<OsString>) -> PathBuf {
    let home = var("HOME");
    if let Some(dir) = var("HF_HUB_CACHE").or_else(|| var("HUGGINGFACE_HUB_CACHE")) {
        return expand_user(dir, home.as_ref());
    }
    let hf_home = var("HF_HOME").unwrap_or_else(|| {
        let cache = var("XDG_CACHE_HOME").map_or_else(
            || expand_user("~".into(), home.as_ref()).join(".cache"),
            PathBuf::from,
        );
        cache.join("huggingface").into_os_string()
    });
    expand_user(hf_home, home.as_ref()).join("hub")
}

/// The hub cache directory of this process's environment.
pub fn cache_dir() -> PathBuf {
    cache_dir_from(|name| std::env::var_os(name))
}

fn is_commit_hash(s: &str) -> bool {
    s.len() == 40 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// The snapshot directory of `repo` in `cache`.
pub fn resolve_in(cache: &Path, repo: &RepoRef) -> Result<PathBuf, HubError> {
    let not_cached = |missing: PathBuf| HubError::NotCached {
        repo_id: repo.repo_id.clone(),
        revision: repo.revision.clone(),
        cache: cache.to_owned(),
        missing,
    };
    let storage = cache.join(repo.folder_name());
    if !storage.is_dir() {
        return Err(not_cached(storage));
    }
    let revision = repo.revision.as_deref().unwrap_or("main");
    let commit = if is_commit_hash(revision) {
        revision.to_owned()
    } else {
        let ref_path = storage.join("refs").join(revision);
        if !ref_path.is_file() {
            return Err(not_cached(ref_path));
        }
        let text = std::fs::read_to_string(&ref_path).map_err(|source| HubError::Io {
            path: ref_path.clone(),
            source,
        })?;
        text.trim().to_owned()
    };
    let snapshot = storage.join("snapshots").join(commit);
    if !snapshot.is_dir() {
        return Err(not_cached(snapshot));
    }
    Ok(snapshot)
}

/// What `--model` names: `arg` itself where that path exists or cannot be a repo id (loading
/// it then says which file is missing), else the snapshot of the repo id it spells in the
/// local hub cache.
pub fn resolve_model(arg: &str) -> Result<PathBuf, HubError> {
    let path = Path::new(arg);
    match RepoRef::parse(arg) {
        Some(repo) if !path.exists() => resolve_in(&cache_dir(), &repo),
        _ => Ok(path.to_owned()),
    }
}

/// `resolve_model` as a clap `value_parser` for `--model`.
pub fn model_arg(arg: &str) -> Result<PathBuf, HubError> {
    resolve_model(arg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";
    const OTHER: &str = "fedcba9876543210fedcba9876543210fedcba98";

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<OsString> {
        let map: HashMap<String, OsString> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), OsString::from(v)))
            .collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn the_cache_dir_follows_huggingface_hubs_order() {
        let all = [
            ("HOME", "/home/u"),
            ("XDG_CACHE_HOME", "/xdg"),
            ("HF_HOME", "/hf"),
            ("HUGGINGFACE_HUB_CACHE", "/legacy"),
            ("HF_HUB_CACHE", "/hub"),
        ];
        let expect = [
            "/home/u/.cache/huggingface/hub",
            "/xdg/huggingface/hub",
            "/hf/hub",
        ];
        for (n, want) in expect.iter().enumerate() {
            assert_eq!(cache_dir_from(env(&all[..n + 1])), PathBuf::from(want));
        }
        assert_eq!(cache_dir_from(env(&all[..4])), PathBuf::from("/legacy"));
        assert_eq!(cache_dir_from(env(&all)), PathBuf::from("/hub"));
        let tilde = [("HOME", "/home/u"), ("HF_HOME", "~/hf")];
        assert_eq!(cache_dir_from(env(&tilde)), PathBuf::from("/home/u/hf/hub"));
        let tilde = [("HOME", "/home/u"), ("HF_HUB_CACHE", "~/c")];
        assert_eq!(cache_dir_from(env(&tilde)), PathBuf::from("/home/u/c"));
    }

    #[test]
    fn repo_ids_parse_as_the_hub_validates_them() {
        let r = RepoRef::parse("mlx-community/Qwen3-0.6B-4bit").unwrap();
        assert_eq!(r.repo_id, "mlx-community/Qwen3-0.6B-4bit");
        assert_eq!(r.revision, None);
        assert_eq!(r.folder_name(), "models--mlx-community--Qwen3-0.6B-4bit");
        let r = RepoRef::parse("org/name@v1.0").unwrap();
        assert_eq!(
            (r.repo_id.as_str(), r.revision.as_deref()),
            ("org/name", Some("v1.0"))
        );
        assert!(RepoRef::parse("gpt2").is_some());
        for bad in [
            "/abs/path",
            "./dir",
            "a/b/c",
            "org/-x",
            "or--g/x",
            "x..y",
            "org/name@",
            "",
        ] {
            assert_eq!(RepoRef::parse(bad), None, "{bad}");
        }
    }

    /// A cache as the hub writes it: blobs/<hash> files, snapshots/<commit>/<file> symlinks
    /// to them, refs/<name> holding the commit (no newline).
    fn fake_cache(root: &Path) -> PathBuf {
        let repo = root.join("models--org--name");
        std::fs::create_dir_all(repo.join("blobs")).unwrap();
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        for (commit, text) in [(COMMIT, "main"), (OTHER, "v1")] {
            let blob = repo.join("blobs").join(format!("blob-{text}"));
            std::fs::write(&blob, format!("{{\"which\": \"{text}\"}}")).unwrap();
            let snap = repo.join("snapshots").join(commit);
            std::fs::create_dir_all(&snap).unwrap();
            std::os::unix::fs::symlink(
                Path::new("../../blobs").join(format!("blob-{text}")),
                snap.join("config.json"),
            )
            .unwrap();
            std::fs::write(repo.join("refs").join(text), commit).unwrap();
        }
        repo
    }

    fn which(snapshot: &Path) -> String {
        let text = std::fs::read_to_string(snapshot.join("config.json")).unwrap();
        let json: serde_json::Value = serde_json::from_str(&text).unwrap();
        json["which"].as_str().unwrap().to_owned()
    }

    #[test]
    fn refs_lead_to_snapshots_and_a_commit_names_one_directly() {
        let dir = tempfile::tempdir().unwrap();
        let repo = fake_cache(dir.path());
        let resolve = |arg: &str| resolve_in(dir.path(), &RepoRef::parse(arg).unwrap());
        let main = resolve("org/name").unwrap();
        assert_eq!(main, repo.join("snapshots").join(COMMIT));
        assert_eq!(which(&main), "main");
        assert_eq!(which(&resolve("org/name@v1").unwrap()), "v1");
        assert_eq!(which(&resolve(&format!("org/name@{OTHER}")).unwrap()), "v1");
        assert_eq!(
            which(&resolve(&format!("org/name@{COMMIT}")).unwrap()),
            "main"
        );
    }

    /// The planted half: a cache whose `main` ref names the other commit resolves to the
    /// other snapshot, so the comparison above does tell revisions apart.
    #[test]
    fn a_moved_ref_resolves_elsewhere() {
        let dir = tempfile::tempdir().unwrap();
        let repo = fake_cache(dir.path());
        std::fs::write(repo.join("refs/main"), OTHER).unwrap();
        let snap = resolve_in(dir.path(), &RepoRef::parse("org/name").unwrap());
        assert_eq!(which(&snap.unwrap()), "v1");
    }

    #[test]
    fn absent_repos_and_revisions_say_what_is_missing_and_how_to_download() {
        let dir = tempfile::tempdir().unwrap();
        let repo = fake_cache(dir.path());
        let cache = dir.path().display();
        let err = |arg: &str| {
            resolve_in(dir.path(), &RepoRef::parse(arg).unwrap())
                .unwrap_err()
                .to_string()
        };
        assert_eq!(
            err("org/other"),
            format!(
                "no such directory, and the Hugging Face repo org/other is not in \
                 the local hub cache {cache} ({cache}/models--org--other not found); the engine \
                 never downloads: fetch it first with `hf download org/other` (or \
                 `huggingface-cli download org/other`), or set HF_HUB_CACHE to the cache that \
                 holds it"
            )
        );
        let msg = err("org/name@v2");
        assert!(
            msg.contains("org/name at revision v2")
                && msg.contains(&format!("{}/refs/v2 not found", repo.display()))
                && msg.contains("`hf download org/name --revision v2`"),
            "{msg}"
        );
        std::fs::remove_dir_all(repo.join("snapshots").join(COMMIT)).unwrap();
        let msg = err("org/name");
        assert!(
            msg.contains(&format!("snapshots/{COMMIT} not found")),
            "{msg}"
        );
    }

    #[test]
    fn an_existing_path_wins_and_a_non_id_stays_a_path() {
        let dir = tempfile::tempdir().unwrap();
        let arg = dir.path().to_str().unwrap();
        assert_eq!(resolve_model(arg).unwrap(), dir.path());
        let missing = resolve_model("/nonexistent/model").unwrap();
        assert_eq!(missing, Path::new("/nonexistent/model"));
    }
}
