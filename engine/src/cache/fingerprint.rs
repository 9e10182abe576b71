//! The SSD tier's identity of a session: what its stored caches depend on. Entries live
//! under `<dir>/<config fingerprint>/` and carry the fingerprint, model id and tokenizer hash
//! in their headers; the store uses only entries whose three values equal the session's.
//!
//! The fingerprint covers everything that changes the numbers a cache holds for given token
//! ids: the model directory's files (every `*.json`, `*.safetensors` and `*.jinja` at its top:
//! config, weights, tokenizer, chat template, kv config), the drafter's and the adapters'
//! files alike, the `--chat-template` source, the KV quantization plan, the engine version
//! and the kv-store format. The tokenizer and the template do not change the KV of given
//! ids, but they change which ids a request becomes; they are in, to be safe.
//!
//! Each file's content is hashed (xxh3-128, streamed) once and the hash kept in
//! `<dir>/file-hashes.json`, keyed by the file's canonical path, size, mtime and, on Unix,
//! ctime, inode and device: any write to a file changes its ctime (which no tool can set
//! back), so a changed file is hashed again, and an unchanged one is not read at all at the
//! next start. A hash is kept only if the file's metadata was the same before and after
//! reading it. xxh3-128 detects accidental change (the threat here); someone able to
//! rewrite the model directory needs no hash collision to do harm.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::kv_quant::KvQuantPlan;
use super::kvstore::{Identity, FORMAT_VERSION};

/// What a session's caches are computed from.
pub struct Sources<'a> {
    pub model: &'a Path,
    pub draft: Option<&'a Path>,
    /// LoRA adapter directories, in the order they apply.
    pub adapters: &'a [PathBuf],
    /// A `--chat-template` given instead of the tokenizer's.
    pub chat_template: Option<&'a str>,
    pub kv_plan: Option<&'a KvQuantPlan>,
}

#[derive(Debug, thiserror::Error)]
pub enum FingerprintError {
    #[error("fingerprinting {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// The identity and how many bytes had to be read for it (0 when every hash was cached).
pub struct Fingerprint {
    pub identity: Identity,
    pub bytes_hashed: u64,
}

const CACHE_FILE: &str = "file-hashes.json";

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct FileKey {
    size: u64,
    mtime_ns: i128,
    ctime_ns: i128,
    ino: u64,
    dev: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Cached {
    key: FileKey,
    xxh3_128: String,
}

#[derive(Default, Serialize, Deserialize)]
struct HashCache {
    files: BTreeMap<String, Cached>,
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> FingerprintError + '_ {
    move |source| FingerprintError::Io {
        path: path.to_owned(),
        source,
    }
}

fn key_of(m: &std::fs::Metadata) -> FileKey {
    let ns = |t: std::io::Result<std::time::SystemTime>| {
        t.ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos() as i128)
    };
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        FileKey {
            size: m.len(),
            mtime_ns: ns(m.modified()),
            ctime_ns: m.ctime() as i128 * 1_000_000_000 + m.ctime_nsec() as i128,
            ino: m.ino(),
            dev: m.dev(),
        }
    }
    #[cfg(not(unix))]
    FileKey {
        size: m.len(),
        mtime_ns: ns(m.modified()),
        ctime_ns: 0,
        ino: 0,
        dev: 0,
    }
}

/// The files of `dir` that go into the fingerprint, by name.
fn files_of(dir: &Path) -> Result<Vec<PathBuf>, FingerprintError> {
    let mut files = Vec::new();
    for e in std::fs::read_dir(dir).map_err(io(dir))? {
        let path = e.map_err(io(dir))?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        let wanted = [".json", ".safetensors", ".jinja"]
            .iter()
            .any(|ext| name.ends_with(ext));
        // Followed here: hub snapshots link their files to blobs.
        if wanted && !name.starts_with('.') && path.is_file() {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

fn is_tokenizer_file(name: &str) -> bool {
    name.starts_with("tokenizer")
        || name.contains("chat_template")
        || name == "special_tokens_map.json"
}

struct Hasher {
    cache: HashCache,
    used: BTreeMap<String, Cached>,
    bytes_hashed: u64,
}

impl Hasher {
    /// The content hash of `path`, from the cache when its metadata is unchanged.
    fn hash(&mut self, path: &Path) -> Result<String, FingerprintError> {
        let canonical = path.canonicalize().map_err(io(path))?;
        let name = canonical.display().to_string();
        let before = key_of(&std::fs::metadata(&canonical).map_err(io(path))?);
        if let Some(c) = self.cache.files.get(&name).filter(|c| c.key == before) {
            self.used.insert(name, c.clone());
            return Ok(c.xxh3_128.clone());
        }
        let mut f = std::fs::File::open(&canonical).map_err(io(path))?;
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        let mut buf = vec![0u8; 8 << 20];
        loop {
            let n = f.read(&mut buf).map_err(io(path))?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
            self.bytes_hashed += n as u64;
        }
        let digest = format!("{:032x}", h.digest128());
        let after = key_of(&std::fs::metadata(&canonical).map_err(io(path))?);
        if after == before {
            self.used.insert(
                name,
                Cached {
                    key: after,
                    xxh3_128: digest.clone(),
                },
            );
        }
        Ok(digest)
    }

    /// One line per file of `dir`: `role/name size hash`.
    fn describe(
        &mut self,
        role: &str,
        dir: &Path,
        out: &mut Lines,
    ) -> Result<(), FingerprintError> {
        for path in files_of(dir)? {
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            let size = std::fs::metadata(&path).map_err(io(&path))?.len();
            let line = format!("{role}/{name} {size} {}\n", self.hash(&path)?);
            if role == "model" && is_tokenizer_file(&name) {
                out.tokenizer.push_str(&line);
            } else if role == "model" {
                out.model.push_str(&line);
            }
            out.all.push_str(&line);
        }
        Ok(())
    }
}

#[derive(Default)]
struct Lines {
    model: String,
    tokenizer: String,
    all: String,
}

fn sha_hex(s: &str) -> String {
    format!("{:x}", Sha256::digest(s.as_bytes()))
}

/// The session's identity for the SSD tier; content hashes cached in `cache_dir`
/// (best effort: a cache that cannot be read or written only costs rereading).
pub fn fingerprint(src: &Sources, cache_dir: &Path) -> Result<Fingerprint, FingerprintError> {
    let cache_path = cache_dir.join(CACHE_FILE);
    let cache = std::fs::read(&cache_path)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default();
    let mut hasher = Hasher {
        cache,
        used: BTreeMap::new(),
        bytes_hashed: 0,
    };
    let mut lines = Lines::default();
    lines.all.push_str(&format!(
        "engine {} kv-store {FORMAT_VERSION}\n",
        env!("CARGO_PKG_VERSION")
    ));
    hasher.describe("model", src.model, &mut lines)?;
    if let Some(d) = src.draft {
        hasher.describe("draft", d, &mut lines)?;
    }
    for (i, a) in src.adapters.iter().enumerate() {
        hasher.describe(&format!("adapter{i}"), a, &mut lines)?;
    }
    lines.all.push_str(&format!(
        "chat-template {:?}\nkv-plan {:?}\n",
        src.chat_template.map(sha_hex),
        src.kv_plan
    ));
    if hasher.bytes_hashed > 0 || hasher.used.len() != hasher.cache.files.len() {
        save(&cache_path, hasher.cache.files, &hasher.used);
    }
    Ok(Fingerprint {
        identity: Identity {
            model_id: sha_hex(&lines.model),
            config_fingerprint: sha_hex(&lines.all),
            ns: String::new(),
            tokenizer_hash: sha_hex(&lines.tokenizer),
        },
        bytes_hashed: hasher.bytes_hashed,
    })
}

/// Writes the hash cache atomically: this run's hashes, plus the old ones of files that
/// are still there (other models sharing the directory).
fn save(path: &Path, old: BTreeMap<String, Cached>, used: &BTreeMap<String, Cached>) {
    let mut files: BTreeMap<String, Cached> = old
        .into_iter()
        .filter(|(p, _)| Path::new(p).is_file())
        .collect();
    files.extend(used.iter().map(|(k, v)| (k.clone(), v.clone())));
    let Ok(json) = serde_json::to_vec(&HashCache { files }) else {
        return;
    };
    if let Some(dir) = path.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    let tmp = path.with_file_name(format!(".{CACHE_FILE}.tmp-{}", std::process::id()));
    if std::fs::write(&tmp, json).is_err() || std::fs::rename(&tmp, path).is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}
