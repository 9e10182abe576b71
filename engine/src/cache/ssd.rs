//! The SSD store: kv-store v2 files in `<dir>/<fingerprint>/<ns>/<id>.mlxkv`, where the
//! files are the database — a start-up scan reads headers only and rebuilds the index.
//! The scan removes leftover temp files, and deletes entries of its own fingerprint that
//! are corrupt or were written for another config; other fingerprints' directories are
//! never touched. `find` is the longest usable prefix (as the RAM tier's), `restore`
//! touches the file's mtime, `store` supersedes shorter prefixes it makes redundant and
//! evicts the oldest mtime first to stay under the cap; an entry larger than the cap is
//! refused, and a full disk is reported once while serving goes on.

use std::path::{Path, PathBuf};
use std::time::SystemTime;

use sha2::{Digest, Sha256};

use super::kvstore::{self, Header, Identity, KvStoreError};
use super::{restore, Cache, QuantSdpa};

struct Entry {
    path: PathBuf,
    ns: String,
    tokens: Vec<u32>,
    bytes: u64,
    mtime: SystemTime,
    /// Whether every cache can give back positions (no wrapped ring).
    trimmable: bool,
}

#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct SsdStats {
    pub entries: usize,
    pub bytes: u64,
    pub max_bytes: u64,
    pub restores: u64,
    pub spills: u64,
    pub removed_corrupt: u64,
    pub restore_ms_last: f64,
}

pub struct SsdStore {
    root: PathBuf,
    id: Identity,
    max_bytes: u64,
    verify: bool,
    entries: Vec<Entry>,
    counter: u64,
    warned: bool,
    stats: SsdStats,
}

fn ns_dir(ns: &str) -> String {
    if ns.is_empty() {
        "_base".into()
    } else {
        format!("{:x}", Sha256::digest(ns.as_bytes()))[..16].to_owned()
    }
}

fn trimmable(h: &Header) -> bool {
    h.caches
        .iter()
        .all(|c| c.max_size.is_none_or(|max| c.offset < max))
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl SsdStore {
    /// Opens (creating) `<dir>/<fingerprint>` and scans it.
    pub fn open(
        dir: &Path,
        id: Identity,
        max_bytes: u64,
        verify: bool,
    ) -> Result<Self, KvStoreError> {
        let root = dir.join(&id.config_fingerprint);
        std::fs::create_dir_all(&root).map_err(|source| KvStoreError::Io {
            path: root.clone(),
            source,
        })?;
        let mut store = SsdStore {
            root,
            id,
            max_bytes,
            verify,
            entries: Vec::new(),
            counter: 0,
            warned: false,
            stats: SsdStats {
                max_bytes,
                ..Default::default()
            },
        };
        store.scan();
        Ok(store)
    }

    fn scan(&mut self) {
        let Ok(namespaces) = std::fs::read_dir(&self.root) else {
            return;
        };
        for ns in namespaces.flatten().filter(|e| e.path().is_dir()) {
            for file in std::fs::read_dir(ns.path()).into_iter().flatten().flatten() {
                let path = file.path();
                let name = file.file_name().to_string_lossy().into_owned();
                if name.starts_with('.') && name.contains(".tmp-") {
                    let _ = std::fs::remove_file(&path);
                    continue;
                }
                if !name.ends_with(".mlxkv") {
                    continue;
                }
                match kvstore::read_header(&path) {
                    Ok(h) if h.config_fingerprint == self.id.config_fingerprint => {
                        let meta = file.metadata().ok();
                        self.entries.push(Entry {
                            trimmable: trimmable(&h),
                            ns: h.ns,
                            tokens: h.tokens,
                            bytes: meta.as_ref().map_or(0, |m| m.len()),
                            mtime: meta
                                .and_then(|m| m.modified().ok())
                                .unwrap_or(SystemTime::UNIX_EPOCH),
                            path,
                        });
                    }
                    // Corrupt, or written for another config under this fingerprint: gone.
                    _ => {
                        let _ = std::fs::remove_file(&path);
                        self.stats.removed_corrupt += 1;
                    }
                }
            }
        }
        self.refresh();
    }

    fn refresh(&mut self) {
        self.stats.entries = self.entries.len();
        self.stats.bytes = self.entries.iter().map(|e| e.bytes).sum();
    }

    pub fn stats(&self) -> SsdStats {
        self.stats.clone()
    }

    /// The longest usable prefix of `prompt` on disk: (entry, tokens usable).
    pub fn find(&self, ns: &str, prompt: &[u32]) -> Option<(usize, usize)> {
        self.entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.ns == ns)
            .filter_map(|(i, e)| {
                let n = common_prefix(&e.tokens, prompt).min(prompt.len().saturating_sub(1));
                let fits = n == e.tokens.len() || e.trimmable;
                (n > 0 && fits).then_some((i, n))
            })
            .max_by_key(|&(_, n)| n)
    }

    /// Restores entry `index` trimmed to `usable` tokens; a file that fails to read is
    /// deleted (None).
    pub fn restore(
        &mut self,
        index: usize,
        usable: usize,
        sdpa: QuantSdpa,
    ) -> Option<Vec<Box<dyn Cache>>> {
        let start = std::time::Instant::now();
        let path = self.entries[index].path.clone();
        let snapshots = match kvstore::read(&path, self.verify) {
            Ok((_, s)) => s,
            Err(e) => {
                eprintln!("ssd cache: removing {}: {e}", path.display());
                let _ = std::fs::remove_file(&path);
                self.entries.remove(index);
                self.stats.removed_corrupt += 1;
                self.refresh();
                return None;
            }
        };
        let mut caches = Vec::new();
        for s in snapshots {
            caches.push(restore(s, sdpa).ok()?);
        }
        let trim = (self.entries[index].tokens.len() - usable) as i32;
        if trim > 0 && caches.iter_mut().any(|c| c.trim(trim) != trim) {
            return None;
        }
        if let Ok(f) = std::fs::File::options().write(true).open(&path) {
            let _ = f.set_modified(SystemTime::now());
        }
        self.entries[index].mtime = SystemTime::now();
        self.stats.restores += 1;
        self.stats.restore_ms_last = start.elapsed().as_secs_f64() * 1e3;
        Some(caches)
    }

    fn new_path(&mut self, ns: &str) -> PathBuf {
        self.counter += 1;
        let seed = format!(
            "{:?}-{}-{}",
            SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .unwrap_or_default(),
            std::process::id(),
            self.counter
        );
        let id = format!("{:x}", Sha256::digest(seed.as_bytes()));
        self.root
            .join(ns_dir(ns))
            .join(format!("{}.mlxkv", &id[..32]))
    }

    /// Stores caches holding `tokens`. Returns whether an entry was written.
    pub fn store(
        &mut self,
        ns: &str,
        tokens: &[u32],
        caches: &[Box<dyn Cache>],
        created_at: &str,
    ) -> bool {
        let Some(snapshots) = caches
            .iter()
            .map(|c| c.snapshot())
            .collect::<Option<Vec<_>>>()
        else {
            return false;
        };
        let estimate: u64 = caches.iter().map(|c| c.nbytes() as u64).sum();
        if tokens.is_empty() || estimate > self.max_bytes {
            return false;
        }
        let path = self.new_path(ns);
        if let Some(parent) = path.parent() {
            let _ = std::fs::create_dir_all(parent);
        }
        let id = Identity {
            ns: ns.to_owned(),
            ..self.id.clone()
        };
        let bytes = match kvstore::write(&path, &id, tokens, &snapshots, created_at) {
            Ok(b) => b,
            Err(e) => {
                if !self.warned {
                    eprintln!("ssd cache: cannot write ({e}); serving goes on without it");
                    self.warned = true;
                }
                return false;
            }
        };
        // Shorter prefixes of these tokens are redundant now (if they could be trimmed to
        // any prefix, this entry serves every prompt they serve).
        let trimmable_new = caches.iter().all(|c| c.is_trimmable());
        self.entries.retain(|e| {
            let redundant = trimmable_new
                && e.ns == ns
                && e.tokens.len() < tokens.len()
                && tokens.starts_with(&e.tokens);
            if redundant {
                let _ = std::fs::remove_file(&e.path);
            }
            !redundant
        });
        self.entries.push(Entry {
            path,
            ns: ns.to_owned(),
            tokens: tokens.to_vec(),
            bytes,
            mtime: SystemTime::now(),
            trimmable: trimmable_new,
        });
        while self.entries.iter().map(|e| e.bytes).sum::<u64>() > self.max_bytes {
            let oldest = self
                .entries
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.mtime)
                .map(|(i, _)| i)
                .expect("non-empty while over the cap");
            let e = self.entries.remove(oldest);
            let _ = std::fs::remove_file(&e.path);
        }
        self.stats.spills += 1;
        self.refresh();
        true
    }
}
