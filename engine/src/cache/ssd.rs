//! The SSD store: kv-store v3 files in `<dir>/<fingerprint>/<ns>/<id>.mlxkv`, where the
//! files are the database — a start-up scan reads headers only and rebuilds the index.
//! Nothing read from disk is used unchecked: an entry must carry this store's identity
//! (fingerprint, model id, tokenizer hash) and match the model's cache geometry (number,
//! kinds, shapes and dtypes of the caches a session of this model makes: K/V of any length
//! on the positions axis, a recurrent state exactly), at the scan and
//! again at restore, where every tensor's checksum is checked too; an entry that fails is
//! removed (quarantined) and the request prefills instead. The scan never follows symlinks
//! and deletes only regular files named as the store names them (its entries and temp
//! files); anything else is left alone and not counted. A store over its cap is trimmed at
//! start. `find` is the longest usable prefix (as the RAM tier's), `restore` touches the
//! file's mtime, `store` supersedes shorter prefixes it makes redundant and evicts the
//! least recently used first (in mtime order across restarts) to stay under the cap; an
//! entry larger than the cap is refused, and a failed write (e.g. a full disk) is reported once while serving goes on.

use std::path::{Path, PathBuf};
use std::time::SystemTime;

use mlx_rs::error::Exception;
use sha2::{Digest, Sha256};

use super::kv_quant::KvQuantPlan;
use super::kvstore::{self, CacheEntry, Header, Identity, KvStoreError};
use super::{kv_quant_of, restore, Cache, QuantSdpa, Snapshot};

struct Entry {
    path: PathBuf,
    ns: String,
    tokens: Vec<u32>,
    bytes: u64,
    mtime: SystemTime,
    /// Order of last use, for eviction: from mtimes at the scan, then a counter this
    /// process bumps (a wall clock that steps back, or two uses in one tick of it, would
    /// misorder them).
    used: u64,
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
    /// Entries removed as corrupt or inconsistent (checksum, identity, geometry).
    pub removed_corrupt: u64,
    /// The last restore, file read, checks and cache rebuild included.
    pub restore_ms_last: f64,
    /// The last restore's tensor checksums: hashing time (on their own thread, overlapped
    /// with the copy into MLX), and how long the restore waited for them after its copy.
    pub checksum_ms_last: f64,
    pub checksum_wait_ms_last: f64,
}

/// One stored tensor as the model's caches hold it; axis 2 (positions) is free.
#[derive(Debug, Clone, PartialEq)]
struct TensorGeom {
    shape: Vec<i32>,
    dtype: String,
}

#[derive(Debug, Clone)]
struct CacheGeom {
    /// (max_size, keep) for a ring; None for a standard cache.
    ring: Option<(i32, i32)>,
    dense: Vec<TensorGeom>,
    /// The session's quantization of this cache ((bits, group size)) and its tensors then.
    quant: Option<((i32, i32), Vec<TensorGeom>)>,
    /// A `CacheList`'s parts (kind, geometry), in order; None for any other cache.
    parts: Option<Vec<(String, CacheGeom)>>,
}

/// The caches a session of this model (and its drafter) makes, as the store checks entries
/// against them: built by `probe` on the model thread.
#[derive(Debug, Clone)]
pub struct Geometry {
    /// None where the layer's cache is never stored (no snapshot).
    caches: Vec<Option<CacheGeom>>,
    /// Caches convert to the plan's quantization once they hold this many positions.
    quant_start: i32,
}

fn tensor_geoms(s: &Snapshot) -> Option<Vec<TensorGeom>> {
    s.tensors
        .iter()
        .map(|t| {
            Some(TensorGeom {
                shape: t.shape().to_vec(),
                dtype: kvstore::dtype_name(t.dtype())?.to_owned(),
            })
        })
        .collect()
}

/// One cache's geometry: its dense snapshot `d`, and `c` as the plan left it (None where a
/// tensor's dtype cannot be stored).
fn cache_geom(d: Snapshot, c: &dyn Cache) -> Option<CacheGeom> {
    let meta = |key: &str| super::meta_i32(&d.meta, key).ok();
    let ring = meta("maxSize").map(|max| (max, meta("keep").unwrap_or(0)));
    let quant = match (kv_quant_of(c), c.snapshot()) {
        (Some(q), Some(s)) => Some(((q.bits, q.group_size), tensor_geoms(&s)?)),
        _ => None,
    };
    let parts = match d.kind.as_str() {
        super::list::KIND => Some(part_geoms(&d, c)?),
        _ => None,
    };
    Some(CacheGeom {
        ring,
        dense: tensor_geoms(&d)?,
        quant,
        parts,
    })
}

/// A `CacheList`'s parts as its dense snapshot `d` nests them (each part's kind, offset,
/// meta and tensor count in `caches`, the tensors in order), with `c`'s parts as the plan
/// left them.
fn part_geoms(d: &Snapshot, c: &dyn Cache) -> Option<Vec<(String, CacheGeom)>> {
    let subs = c.sub_caches()?;
    let metas = d.meta.get("caches")?.as_array()?;
    if metas.len() != subs.len() {
        return None;
    }
    let mut tensors = d.tensors.iter();
    metas
        .iter()
        .zip(subs)
        .map(|(m, sub)| {
            let meta = m.as_object()?.clone();
            let kind = meta.get("kind")?.as_str()?.to_owned();
            let count = usize::try_from(meta.get("tensors")?.as_u64()?).ok()?;
            let part = Snapshot {
                kind: kind.clone(),
                offset: i32::try_from(meta.get("offset")?.as_i64()?).ok()?,
                quant: None,
                meta,
                tensors: tensors.by_ref().take(count).cloned().collect(),
            };
            Some((kind, cache_geom(part, sub.as_ref())?))
        })
        .collect()
}

/// A stored `CacheList` (`c`): its tensors split into the parts its meta lists, and each
/// part checked against the model's part of the same place and kind.
fn check_parts(c: &CacheEntry, g: &CacheGeom, n: i32, quant_start: i32) -> Result<(), String> {
    let want = g
        .parts
        .as_ref()
        .ok_or("a cache list, the model's cache is not")?;
    if crate::plant::is(crate::plant::Defect::SsdListPartsUnchecked) {
        return Ok(());
    }
    let metas = c
        .meta
        .get("caches")
        .and_then(|v| v.as_array())
        .ok_or("a cache list without its parts")?;
    if metas.len() != want.len() {
        return Err(format!(
            "a cache list of {} parts, the model's has {}",
            metas.len(),
            want.len()
        ));
    }
    let mut tensors = c.tensors.iter();
    for (pi, (m, (kind, geom))) in metas.iter().zip(want).enumerate() {
        let mut meta = m.as_object().cloned().ok_or("a cache list's part")?;
        let mut take = |key: &str| meta.remove(key);
        let int = |v: Option<serde_json::Value>| v.and_then(|v| v.as_i64());
        let part_kind = take("kind").and_then(|v| v.as_str().map(str::to_owned));
        let (offset, count) = (int(take("offset")), int(take("tensors")));
        let (bits, group_size) = (int(take("bits")), int(take("groupSize")));
        let (Some(part_kind), Some(offset), Some(count)) = (part_kind, offset, count) else {
            return Err(format!(
                "part {pi}: its kind, offset or tensor count missing"
            ));
        };
        if kvstore::split_kind(&part_kind).0 != kind.as_str() {
            return Err(format!(
                "part {pi}: kind `{part_kind}`, the model's is `{kind}`"
            ));
        }
        let count = usize::try_from(count).map_err(|_| format!("part {pi}: {count} tensors"))?;
        let part = CacheEntry {
            kind: part_kind,
            offset: i32::try_from(offset).map_err(|_| format!("part {pi}: offset {offset}"))?,
            meta,
            group_size: group_size.and_then(|v| i32::try_from(v).ok()),
            bits: bits.and_then(|v| i32::try_from(v).ok()),
            tensors: tensors.by_ref().take(count).cloned().collect(),
        };
        if part.tensors.len() != count {
            return Err(format!("part {pi}: {count} tensors, the list holds fewer"));
        }
        check_cache(&part, geom, n, quant_start).map_err(|why| format!("part {pi}: {why}"))?;
    }
    if tensors.next().is_some() {
        return Err("a cache list with tensors past its parts'".into());
    }
    Ok(())
}

/// What the probe needs of a model: its fresh caches after one token went through them.
/// Every `LanguageModel` is one (`model` implements it).
pub trait CacheSource {
    fn probe_caches(&self) -> Result<Vec<Box<dyn Cache>>, Exception>;
}

impl Geometry {
    /// Reads the caches each model makes for one token (the model's, then a drafter model's,
    /// as an entry holds them; an assistant drafter has none of its own): their snapshots'
    /// kinds, shapes and dtypes, dense and as `plan` quantizes them. Nothing is evaluated:
    /// MLX knows shapes without computing.
    pub fn probe<M: CacheSource + ?Sized>(
        models: &[&M],
        plan: Option<&KvQuantPlan>,
    ) -> Result<Self, Exception> {
        let mut caches = Vec::new();
        for m in models {
            let mut cs = m.probe_caches()?;
            let dense: Vec<Option<Snapshot>> = cs.iter().map(|c| c.snapshot()).collect();
            if let Some(p) = plan {
                // Every planned cache converts now, whatever the plan's start.
                KvQuantPlan {
                    start: 0,
                    ..p.clone()
                }
                .apply(&mut cs)?;
            }
            for (d, c) in dense.into_iter().zip(&cs) {
                caches.push(d.and_then(|d| cache_geom(d, c.as_ref())));
            }
        }
        Ok(Geometry {
            caches,
            quant_start: plan.map_or(0, |p| p.start),
        })
    }

    /// Whether an entry's header describes caches this model's session could have made,
    /// holding exactly its tokens: the reason if not.
    pub fn check(&self, h: &Header) -> Result<(), String> {
        if h.caches.len() != self.caches.len() {
            return Err(format!(
                "{} caches, the model's sessions have {}",
                h.caches.len(),
                self.caches.len()
            ));
        }
        let n = i32::try_from(h.tokens.len()).map_err(|_| "too many tokens".to_owned())?;
        if n == 0 {
            return Err("no tokens".into());
        }
        for (i, (c, g)) in h.caches.iter().zip(&self.caches).enumerate() {
            let g = g
                .as_ref()
                .ok_or_else(|| format!("cache {i}: this layer's cache is never stored"))?;
            check_cache(c, g, n, self.quant_start).map_err(|why| format!("cache {i}: {why}"))?;
        }
        Ok(())
    }
}

fn check_cache(c: &CacheEntry, g: &CacheGeom, n: i32, quant_start: i32) -> Result<(), String> {
    let (kind, quantized) = kvstore::split_kind(&c.kind);
    if !super::KINDS.contains(&kind) {
        return Err(format!("kind `{}`", c.kind));
    }
    // A ring is the kind whose meta has a window (the geometry compares it).
    let ring = c
        .meta_i32("maxSize")
        .map(|max| (max, c.meta_i32("keep").unwrap_or(0)));
    if ring != g.ring {
        return Err(format!(
            "kind {} (ring {ring:?}), the model's is ring {:?}",
            c.kind, g.ring
        ));
    }
    if c.offset != n {
        return Err(format!("offset {}, the entry holds {n} tokens", c.offset));
    }
    let stored_quant = c.bits.zip(c.group_size);
    let want = match (quantized, stored_quant, &g.quant) {
        (false, None, None) => &g.dense,
        (false, None, Some(_)) if c.offset < quant_start => &g.dense,
        (true, Some(q), Some((planned, tensors))) if q == *planned => tensors,
        _ => {
            return Err(format!(
                "quantization {stored_quant:?} ({}), the session's is {:?}",
                c.kind,
                g.quant.as_ref().map(|q| q.0)
            ))
        }
    };
    if c.tensors.len() != want.len() {
        return Err(format!(
            "{} tensors, the model's cache has {}",
            c.tensors.len(),
            want.len()
        ));
    }
    if kind == super::arrays::KIND {
        return check_state(c, want);
    }
    if kind == super::list::KIND {
        return check_parts(c, g, n, quant_start);
    }
    let mut positions = None;
    for (ti, (t, w)) in c.tensors.iter().zip(want).enumerate() {
        let same_but_positions = t.shape.len() == w.shape.len()
            && t.shape.len() == 4
            && t.shape
                .iter()
                .zip(&w.shape)
                .enumerate()
                .all(|(axis, (a, b))| axis == 2 || a == b);
        if !same_but_positions || t.dtype != w.dtype {
            return Err(format!(
                "tensor {ti}: {:?} {}, the model's cache holds {:?} {} (any length on axis 2)",
                t.shape, t.dtype, w.shape, w.dtype
            ));
        }
        if kvstore::tensor_bytes(&t.shape, &t.dtype) != Some(t.bytes) {
            return Err(format!("tensor {ti}: {} bytes for {:?}", t.bytes, t.shape));
        }
        let len = t.shape[2];
        if *positions.get_or_insert(len) != len {
            return Err(format!("tensor {ti}: {len} positions, the others differ"));
        }
    }
    let len = positions.unwrap_or(0);
    match ring {
        None if len != c.offset => Err(format!("{len} positions stored for offset {}", c.offset)),
        Some((max, _)) => {
            let idx = c.meta_i32("idx").ok_or("a ring without idx")?;
            if len < c.offset.min(max) || !(0..=len).contains(&idx) || len > c.offset + max {
                Err(format!(
                    "a ring of {len} positions with offset {}, idx {idx}, maxSize {max}",
                    c.offset
                ))
            } else {
                Ok(())
            }
        }
        None => Ok(()),
    }
}

/// A recurrent state (`arrays`: a conv window and a scan state) has no positions axis:
/// every tensor is exactly the shape and dtype of the model's, whatever the tokens.
fn check_state(c: &CacheEntry, want: &[TensorGeom]) -> Result<(), String> {
    for (ti, (t, w)) in c.tensors.iter().zip(want).enumerate() {
        if t.shape != w.shape || t.dtype != w.dtype {
            return Err(format!(
                "tensor {ti}: {:?} {}, the model's state is {:?} {}",
                t.shape, t.dtype, w.shape, w.dtype
            ));
        }
        if kvstore::tensor_bytes(&t.shape, &t.dtype) != Some(t.bytes) {
            return Err(format!("tensor {ti}: {} bytes for {:?}", t.bytes, t.shape));
        }
    }
    Ok(())
}

fn ns_dir(ns: &str) -> String {
    if ns.is_empty() {
        "_base".into()
    } else {
        format!("{:x}", Sha256::digest(ns.as_bytes()))[..16].to_owned()
    }
}

fn is_hex(s: &str, len: usize) -> bool {
    s.len() == len
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// The names the store gives its namespace directories (`ns_dir`).
fn is_ns_name(name: &str) -> bool {
    name == "_base" || is_hex(name, 16)
}

/// The names the store gives its entries (`new_path`): 32 hex digits + `.mlxkv`.
fn is_entry_name(name: &str) -> bool {
    name.strip_suffix(".mlxkv").is_some_and(|id| is_hex(id, 32))
}

/// The names `kvstore::write` gives its temp files: `.<entry name>.tmp-<pid>`.
fn is_temp_name(name: &str) -> bool {
    name.strip_prefix('.')
        .and_then(|n| n.split_once(".tmp-"))
        .is_some_and(|(entry, pid)| {
            is_entry_name(entry) && !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit())
        })
}

/// Whether an entry's caches can be trimmed to a shorter prefix, from its header as
/// `Cache::is_trimmable` decides it: a ring until it wraps, never a recurrent state (nor a
/// list that may hold one).
fn trimmable(h: &Header) -> bool {
    h.caches.iter().all(|c| {
        let (kind, _) = kvstore::split_kind(&c.kind);
        ![super::arrays::KIND, super::list::KIND].contains(&kind)
            && c.meta_i32("maxSize").is_none_or(|max| c.offset < max)
    })
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// A path that is a symlink (not followed), or not there at all.
fn is_symlink(path: &Path) -> bool {
    path.symlink_metadata()
        .is_ok_and(|m| m.file_type().is_symlink())
}

pub struct SsdStore {
    root: PathBuf,
    id: Identity,
    geometry: Geometry,
    max_bytes: u64,
    verify: bool,
    entries: Vec<Entry>,
    counter: u64,
    /// The next `Entry::used`.
    uses: u64,
    warned: bool,
    stats: SsdStats,
}

impl SsdStore {
    /// Opens (creating) `<dir>/<fingerprint>` and scans it; entries are checked against
    /// `id` and `geometry`.
    pub fn open(
        dir: &Path,
        id: Identity,
        geometry: Geometry,
        max_bytes: u64,
        verify: bool,
    ) -> Result<Self, KvStoreError> {
        let root = dir.join(&id.config_fingerprint);
        if is_symlink(&root) {
            return Err(KvStoreError::Refused {
                path: root,
                why: "the store's fingerprint directory is a symlink; the store never \
                      follows links inside itself"
                    .into(),
            });
        }
        std::fs::create_dir_all(&root).map_err(|source| KvStoreError::Io {
            path: root.clone(),
            source,
        })?;
        let mut store = SsdStore {
            root,
            id,
            geometry,
            max_bytes,
            verify,
            entries: Vec::new(),
            counter: 0,
            uses: 0,
            warned: false,
            stats: SsdStats {
                max_bytes,
                ..Default::default()
            },
        };
        store.scan();
        Ok(store)
    }

    /// Why `h` cannot be used by this store, if it cannot.
    fn unusable(&self, h: &Header) -> Option<String> {
        let id = &self.id;
        if h.config_fingerprint != id.config_fingerprint {
            return Some(format!("fingerprint {}", h.config_fingerprint));
        }
        if h.model_id != id.model_id {
            return Some(format!(
                "model id {}, this model is {}",
                h.model_id, id.model_id
            ));
        }
        if h.tokenizer_hash != id.tokenizer_hash {
            return Some(format!("tokenizer hash {}", h.tokenizer_hash));
        }
        self.geometry.check(h).err()
    }

    fn quarantine(&mut self, path: &Path, why: &str) {
        eprintln!("ssd cache: removing {}: {why}", path.display());
        let _ = std::fs::remove_file(path);
        self.stats.removed_corrupt += 1;
    }

    fn scan(&mut self) {
        let Ok(namespaces) = std::fs::read_dir(&self.root) else {
            return;
        };
        for ns in namespaces.flatten() {
            // `file_type` does not follow symlinks: a linked directory is not ours.
            let ours = ns.file_type().is_ok_and(|t| t.is_dir())
                && is_ns_name(&ns.file_name().to_string_lossy());
            if !ours {
                continue;
            }
            for file in std::fs::read_dir(ns.path()).into_iter().flatten().flatten() {
                if !file.file_type().is_ok_and(|t| t.is_file()) {
                    continue;
                }
                let path = file.path();
                let name = file.file_name().to_string_lossy().into_owned();
                if is_temp_name(&name) {
                    let _ = std::fs::remove_file(&path);
                    continue;
                }
                if !is_entry_name(&name) {
                    continue;
                }
                let header = kvstore::read_header(&path).map_err(|e| e.to_string());
                let h = match header.and_then(|h| match self.unusable(&h) {
                    None => Ok(h),
                    Some(why) => Err(why),
                }) {
                    Ok(h) => h,
                    Err(why) => {
                        self.quarantine(&path, &why);
                        continue;
                    }
                };
                let meta = file.metadata().ok();
                self.entries.push(Entry {
                    trimmable: trimmable(&h),
                    ns: h.ns,
                    tokens: h.tokens,
                    bytes: meta.as_ref().map_or(0, |m| m.len()),
                    mtime: meta
                        .and_then(|m| m.modified().ok())
                        .unwrap_or(SystemTime::UNIX_EPOCH),
                    used: 0,
                    path,
                });
            }
        }
        self.entries.sort_by_key(|e| e.mtime);
        for e in self.entries.iter_mut() {
            e.used = self.uses;
            self.uses += 1;
        }
        self.evict_to_cap();
        self.refresh();
    }

    /// Removes the oldest entries (by mtime) until the store is under its cap.
    fn evict_to_cap(&mut self) {
        while self.entries.iter().map(|e| e.bytes).sum::<u64>() > self.max_bytes {
            let Some(oldest) = self
                .entries
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.used)
                .map(|(i, _)| i)
            else {
                break;
            };
            let e = self.entries.remove(oldest);
            let _ = std::fs::remove_file(&e.path);
        }
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

    /// Restores entry `index` trimmed to `usable` tokens. A file that fails to read, fails
    /// a checksum, or does not match this store's identity, the index or the model's cache
    /// geometry is removed (None: the request prefills instead).
    pub fn restore(
        &mut self,
        index: usize,
        usable: usize,
        sdpa: QuantSdpa,
    ) -> Option<Vec<Box<dyn Cache>>> {
        let start = std::time::Instant::now();
        let path = self.entries[index].path.clone();
        let checked = kvstore::read_timed(&path, self.verify)
            .map_err(|e| e.to_string())
            .and_then(|(h, snapshots, checksum)| {
                if let Some(why) = self.unusable(&h) {
                    return Err(why);
                }
                let e = &self.entries[index];
                if h.tokens != e.tokens || h.ns != e.ns {
                    return Err("the file changed since the scan".into());
                }
                let caches = snapshots
                    .into_iter()
                    .map(|s| restore(s, sdpa))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| e.to_string())?;
                Ok((caches, checksum))
            });
        let (mut caches, checksum) = match checked {
            Ok(c) => c,
            Err(why) => {
                self.quarantine(&path, &why);
                self.entries.remove(index);
                self.refresh();
                return None;
            }
        };
        let trim = (self.entries[index].tokens.len() - usable) as i32;
        if trim > 0 && caches.iter_mut().any(|c| c.trim(trim) != trim) {
            return None;
        }
        if let Ok(f) = std::fs::File::options().write(true).open(&path) {
            let _ = f.set_modified(SystemTime::now());
        }
        self.entries[index].mtime = SystemTime::now();
        self.entries[index].used = self.uses;
        self.uses += 1;
        self.stats.restores += 1;
        self.stats.restore_ms_last = start.elapsed().as_secs_f64() * 1e3;
        self.stats.checksum_ms_last = checksum.checksum.as_secs_f64() * 1e3;
        self.stats.checksum_wait_ms_last = checksum.checksum_wait.as_secs_f64() * 1e3;
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
            // Never write through a link planted where a namespace directory goes.
            if is_symlink(parent) {
                if !self.warned {
                    eprintln!(
                        "ssd cache: {} is a symlink; not writing there",
                        parent.display()
                    );
                    self.warned = true;
                }
                return false;
            }
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
            used: self.uses,
            trimmable: trimmable_new,
        });
        self.uses += 1;
        self.evict_to_cap();
        self.stats.spills += 1;
        self.refresh();
        true
    }
}
