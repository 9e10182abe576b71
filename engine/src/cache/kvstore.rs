//! kv-store v3: one file holds the KV caches of one token sequence (docs/kv-store.md).
//!
//!   bytes 0..8    magic `MLXKV\0v3`
//!   8..12         format version, u32 LE (3)
//!   12..16        header length H, u32 LE
//!   16..24        data start D, u64 LE (a multiple of 16 KiB)
//!   24..56        sha256 of the header bytes
//!   56..56+H      the header: UTF-8 JSON (below)
//!   D..           tensors, each at D + its `off` (a multiple of 16 KiB), raw row-major bytes
//!
//! Header: {formatVersion, createdAt, modelId, configFingerprint, ns, tokenizerHash, tokens,
//! caches: [{kind, offset, <meta>…, groupSize?, bits?, tensors: [{off, bytes, shape, dtype,
//! xxh3, hash}]}]}. A cache is its snapshot (`Cache::snapshot`: kind tag, meta, arrays), so
//! the file knows no kinds: `kind` is the snapshot's tag (`kv`, `rotating`, …), `qkv`/
//! `<tag>-qkv` when quantized; the meta's entries (a ring's `idx`, `maxSize`, `keep`) sit
//! beside it; reading rebuilds through `restore`'s table, which refuses a kind or
//! meta it does not know. The K/V kinds' entries are byte-identical to before the protocol. A write goes to a temp file
//! in the same directory, is fsynced and renamed into place, so a reader never sees half a
//! file. A read maps the file, always checks the header hash and every tensor's xxh3-64
//! checksum (fast enough to be always on), and each tensor's SHA-256 when asked to.
//! v2 files (no checksums) are refused by version, as any other version is.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use memmap2::MmapOptions;
use mlx_rs::{Array, Dtype};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::{KvQuant, Meta, QuantSdpa, Snapshot};

pub const MAGIC: &[u8; 8] = b"MLXKV\0v3";
pub const FORMAT_VERSION: u32 = 3;
pub const ALIGN: u64 = 16 * 1024;
const PREAMBLE: usize = 56;
/// Every version of the format starts with this (then the version's digit).
const MAGIC_FAMILY: &[u8; 7] = b"MLXKV\0v";
/// A header larger than this is refused before it is read (a million tokens take ~8 MB).
const MAX_HEADER: usize = 256 << 20;

#[derive(Debug, thiserror::Error)]
pub enum KvStoreError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: not a kv-store v3 file ({why})")]
    Format { path: PathBuf, why: String },
    #[error("{path}: corrupt: {why}")]
    Corrupt { path: PathBuf, why: String },
    #[error("{path}: {why}")]
    Refused { path: PathBuf, why: String },
    #[error("MLX: {0}")]
    Mlx(#[from] mlx_rs::error::Exception),
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct TensorEntry {
    pub off: u64,
    pub bytes: u64,
    pub shape: Vec<i32>,
    pub dtype: String,
    /// xxh3-64 of the bytes, 16 hex digits: checked at every read.
    pub xxh3: String,
    /// SHA-256 of the bytes: checked when verification is asked for.
    pub hash: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct CacheEntry {
    pub kind: String,
    pub offset: i32,
    /// The snapshot's meta, in its order (a ring's `idx`, `maxSize`, `keep`).
    #[serde(flatten)]
    pub meta: Meta,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub group_size: Option<i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bits: Option<i32>,
    pub tensors: Vec<TensorEntry>,
}

impl CacheEntry {
    /// The meta integer `key`, if there.
    pub fn meta_i32(&self, key: &str) -> Option<i32> {
        self.meta
            .get(key)
            .and_then(|v| v.as_i64())
            .and_then(|v| i32::try_from(v).ok())
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Header {
    pub format_version: u32,
    pub created_at: String,
    pub model_id: String,
    pub config_fingerprint: String,
    pub ns: String,
    pub tokenizer_hash: String,
    pub tokens: Vec<u32>,
    pub caches: Vec<CacheEntry>,
}

/// Who the caches belong to (goes into the header as is).
#[derive(Debug, Clone)]
pub struct Identity {
    pub model_id: String,
    pub config_fingerprint: String,
    pub ns: String,
    pub tokenizer_hash: String,
}

pub fn dtype_name(d: Dtype) -> Option<&'static str> {
    Some(match d {
        Dtype::Float32 => "float32",
        Dtype::Float16 => "float16",
        Dtype::Bfloat16 => "bfloat16",
        Dtype::Uint32 => "uint32",
        _ => return None,
    })
}

fn dtype_of(name: &str) -> Option<Dtype> {
    Some(match name {
        "float32" => Dtype::Float32,
        "float16" => Dtype::Float16,
        "bfloat16" => Dtype::Bfloat16,
        "uint32" => Dtype::Uint32,
        _ => return None,
    })
}

fn hex(bytes: &[u8]) -> String {
    format!("{:x}", Sha256::digest(bytes))
}

fn xxh3_hex(bytes: &[u8]) -> String {
    format!("{:016x}", xxhash_rust::xxh3::xxh3_64(bytes))
}

/// Bytes per element of the dtypes the format stores.
pub fn dtype_width(name: &str) -> Option<u64> {
    Some(match dtype_of(name)? {
        Dtype::Float32 | Dtype::Uint32 => 4,
        _ => 2,
    })
}

/// prod(shape) × width, if every dim is non-negative and nothing overflows.
pub fn tensor_bytes(shape: &[i32], dtype: &str) -> Option<u64> {
    shape.iter().try_fold(dtype_width(dtype)?, |acc, &d| {
        acc.checked_mul(u64::try_from(d).ok()?)
    })
}

/// An array's row-major bytes.
fn bytes_of(a: &Array) -> Result<Vec<u8>, mlx_rs::error::Exception> {
    let flat = a.reshape(&[-1])?.view::<u8>()?;
    flat.eval()?;
    Ok(flat.as_slice::<u8>().to_vec())
}

/// The file's name of a snapshot kind: `qkv` for a quantized `kv`, `<kind>-qkv` for
/// another quantized kind, the tag itself otherwise.
fn kind_name(kind: &str, quantized: bool) -> String {
    match (kind, quantized) {
        ("kv", true) => "qkv".to_owned(),
        (k, true) => format!("{k}-qkv"),
        (k, false) => k.to_owned(),
    }
}

/// A file kind's snapshot tag and whether it is quantized (`kind_name` undone).
pub fn split_kind(name: &str) -> (&str, bool) {
    match name {
        "qkv" => ("kv", true),
        n => match n.strip_suffix("-qkv") {
            Some(k) => (k, true),
            None => (n, false),
        },
    }
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> KvStoreError + '_ {
    move |source| KvStoreError::Io {
        path: path.to_owned(),
        source,
    }
}

/// Writes `snapshots` (one per cache, in layer order) for `tokens` to `path` atomically.
pub fn write(
    path: &Path,
    id: &Identity,
    tokens: &[u32],
    snapshots: &[Snapshot],
    created_at: &str,
) -> Result<u64, KvStoreError> {
    let (caches, blobs) = layout(path, snapshots)?;
    let header = Header {
        format_version: FORMAT_VERSION,
        created_at: created_at.to_owned(),
        model_id: id.model_id.clone(),
        config_fingerprint: id.config_fingerprint.clone(),
        ns: id.ns.clone(),
        tokenizer_hash: id.tokenizer_hash.clone(),
        tokens: tokens.to_vec(),
        caches,
    };
    let dir = path.parent().unwrap_or(Path::new("."));
    let tmp = dir.join(format!(
        ".{}.tmp-{}",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("entry"),
        std::process::id()
    ));
    let result = write_file(&tmp, &header, &blobs).and_then(|()| {
        std::fs::rename(&tmp, path).map_err(io(path))?;
        if let Ok(d) = File::open(dir) {
            let _ = d.sync_all();
        }
        Ok(())
    });
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result?;
    Ok(std::fs::metadata(path).map_err(io(path))?.len())
}

/// The header's entry for each snapshot and the bytes of every tensor, in file order; each
/// tensor's `off` (from the start of the data) is aligned to `ALIGN`.
fn layout(
    path: &Path,
    snapshots: &[Snapshot],
) -> Result<(Vec<CacheEntry>, Vec<Vec<u8>>), KvStoreError> {
    let mut blobs: Vec<Vec<u8>> = Vec::new();
    let mut caches = Vec::new();
    let mut off = 0u64;
    for s in snapshots {
        let mut tensors = Vec::new();
        for t in &s.tensors {
            let dtype = dtype_name(t.dtype()).ok_or_else(|| KvStoreError::Format {
                path: path.to_owned(),
                why: format!("cannot store dtype {:?}", t.dtype()),
            })?;
            let bytes = bytes_of(t)?;
            tensors.push(TensorEntry {
                off,
                bytes: bytes.len() as u64,
                shape: t.shape().to_vec(),
                dtype: dtype.to_owned(),
                xxh3: xxh3_hex(&bytes),
                hash: hex(&bytes),
            });
            off += (bytes.len() as u64).div_ceil(ALIGN) * ALIGN;
            blobs.push(bytes);
        }
        caches.push(cache_entry(s, tensors));
    }
    Ok((caches, blobs))
}

/// A snapshot's header entry: its kind, positions, quantization and `tensors`.
fn cache_entry(s: &Snapshot, tensors: Vec<TensorEntry>) -> CacheEntry {
    CacheEntry {
        kind: kind_name(&s.kind, s.quant.is_some()),
        offset: s.offset,
        meta: s.meta.clone(),
        group_size: s.quant.map(|q| q.group_size),
        bits: s.quant.map(|q| q.bits),
        tensors,
    }
}

/// Writes and syncs the file `tmp`: the preamble, the header's JSON, zeros up to the data
/// start, then each tensor's bytes at its offset.
fn write_file(tmp: &Path, header: &Header, blobs: &[Vec<u8>]) -> Result<(), KvStoreError> {
    let json = serde_json::to_vec(header).expect("a header serializes");
    let data_start = ((PREAMBLE + json.len()) as u64).div_ceil(ALIGN) * ALIGN;
    let mut f = File::create(tmp).map_err(io(tmp))?;
    let mut pre = Vec::with_capacity(PREAMBLE);
    pre.extend_from_slice(MAGIC);
    pre.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    pre.extend_from_slice(&(json.len() as u32).to_le_bytes());
    pre.extend_from_slice(&data_start.to_le_bytes());
    pre.extend_from_slice(&Sha256::digest(&json));
    f.write_all(&pre).map_err(io(tmp))?;
    f.write_all(&json).map_err(io(tmp))?;
    let mut pos = (PREAMBLE + json.len()) as u64;
    let pad_to = |f: &mut File, target: u64, pos: &mut u64| -> Result<(), KvStoreError> {
        let zeros = vec![0u8; (target - *pos) as usize];
        f.write_all(&zeros).map_err(io(tmp))?;
        *pos = target;
        Ok(())
    };
    pad_to(&mut f, data_start, &mut pos)?;
    let entries = header.caches.iter().flat_map(|c| c.tensors.iter());
    for (blob, e) in blobs.iter().zip(entries) {
        pad_to(&mut f, data_start + e.off, &mut pos)?;
        f.write_all(blob).map_err(io(tmp))?;
        pos += blob.len() as u64;
    }
    f.sync_all().map_err(io(tmp))
}

/// Reads and checks the preamble and header only (a store's start-up scan): two reads of
/// the file's first 56 + H bytes, never the tensors.
pub fn read_header(path: &Path) -> Result<Header, KvStoreError> {
    use std::io::Read;
    let mut f = File::open(path).map_err(io(path))?;
    let mut pre = [0u8; PREAMBLE];
    f.read_exact(&mut pre).map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => format_error(path, "shorter than the preamble"),
        _ => io(path)(e),
    })?;
    let (len, _) = parse_preamble(path, &pre)?;
    let mut json = vec![0u8; len];
    f.read_exact(&mut json).map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => format_error(path, "truncated header"),
        _ => io(path)(e),
    })?;
    parse_json(path, &pre, &json)
}

fn format_error(path: &Path, why: &str) -> KvStoreError {
    KvStoreError::Format {
        path: path.to_owned(),
        why: why.to_owned(),
    }
}

/// Magic, version and sizes: (header length, data start).
fn parse_preamble(path: &Path, pre: &[u8]) -> Result<(usize, u64), KvStoreError> {
    let bad = |why: &str| format_error(path, why);
    if pre.len() < PREAMBLE || &pre[..7] != MAGIC_FAMILY {
        return Err(bad("wrong magic"));
    }
    let version = u32::from_le_bytes(pre[8..12].try_into().unwrap());
    if version != FORMAT_VERSION || pre[..8] != MAGIC[..] {
        return Err(bad(&format!(
            "format version {version}, this engine reads {FORMAT_VERSION}"
        )));
    }
    let len = u32::from_le_bytes(pre[12..16].try_into().unwrap()) as usize;
    let data_start = u64::from_le_bytes(pre[16..24].try_into().unwrap());
    if len > MAX_HEADER {
        return Err(bad(&format!(
            "header of {len} bytes (at most {MAX_HEADER})"
        )));
    }
    if data_start < (PREAMBLE + len) as u64 {
        return Err(bad("data start inside the header"));
    }
    Ok((len, data_start))
}

/// Checks the header hash (in the preamble) and parses the JSON.
fn parse_json(path: &Path, pre: &[u8], json: &[u8]) -> Result<Header, KvStoreError> {
    let corrupt = |why: String| KvStoreError::Corrupt {
        path: path.to_owned(),
        why,
    };
    if Sha256::digest(json).as_slice() != &pre[24..56] {
        return Err(corrupt("header hash mismatch".into()));
    }
    let header: Header =
        serde_json::from_slice(json).map_err(|e| corrupt(format!("header JSON: {e}")))?;
    if header.format_version != FORMAT_VERSION {
        return Err(corrupt(format!(
            "header says format version {}",
            header.format_version
        )));
    }
    Ok(header)
}

fn parse_header(path: &Path, bytes: &[u8]) -> Result<(Header, u64), KvStoreError> {
    let (len, data_start) = parse_preamble(path, bytes)?;
    let json = bytes
        .get(PREAMBLE..PREAMBLE + len)
        .ok_or_else(|| format_error(path, "truncated header"))?;
    Ok((parse_json(path, bytes, json)?, data_start))
}

/// Reads a file back into snapshots (mapped; the header hash and every tensor's xxh3
/// checksum always checked, SHA-256 when `verify`).
pub fn read(path: &Path, verify: bool) -> Result<(Header, Vec<Snapshot>), KvStoreError> {
    read_timed(path, verify).map(|(h, s, _)| (h, s))
}

/// Time a read spent on checksums.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReadTimes {
    /// Hashing the tensors (on the checksum thread).
    pub checksum: std::time::Duration,
    /// How long the read waited for it after copying the tensors (the wall time it adds).
    pub checksum_wait: std::time::Duration,
}

/// As `read`, with the time spent on the checksums (the restart bench reports it).
pub fn read_timed(
    path: &Path,
    verify: bool,
) -> Result<(Header, Vec<Snapshot>, ReadTimes), KvStoreError> {
    let file = File::open(path).map_err(io(path))?;
    // SAFETY: read-only mapping, copied out of before it is dropped; store files are only
    // ever replaced by rename, never rewritten in place. Populated up front: every byte is
    // read anyway, and one pass over the page tables beats a fault per page.
    let map = unsafe { MmapOptions::new().populate().map(&file) }.map_err(io(path))?;
    let (header, data_start) = parse_header(path, &map)?;
    let corrupt = |why: String| KvStoreError::Corrupt {
        path: path.to_owned(),
        why,
    };
    // Every tensor's bytes, bounds and size checked first.
    let mut tensors = Vec::new();
    for (ci, c) in header.caches.iter().enumerate() {
        for (ti, t) in c.tensors.iter().enumerate() {
            let at = format!("cache {ci} tensor {ti}");
            let range = data_start
                .checked_add(t.off)
                .and_then(|s| Some(s..s.checked_add(t.bytes)?))
                .and_then(|r| Some(usize::try_from(r.start).ok()?..usize::try_from(r.end).ok()?));
            let data = range
                .and_then(|r| map.get(r))
                .ok_or_else(|| corrupt(format!("{at} runs past the end of the file")))?;
            let dtype =
                dtype_of(&t.dtype).ok_or_else(|| corrupt(format!("{at}: dtype {}", t.dtype)))?;
            if tensor_bytes(&t.shape, &t.dtype) != Some(t.bytes) {
                return Err(corrupt(format!(
                    "{at}: {} bytes do not hold shape {:?} of {}",
                    t.bytes, t.shape, t.dtype
                )));
            }
            tensors.push((at, data, dtype, t));
        }
    }
    // The checksums run on a second thread (plain bytes, no MLX) while this one copies the
    // same mapped bytes into MLX arrays: both passes are memory-bound, and overlapped the
    // check adds little wall time. Nothing is returned before every checksum has passed.
    let (snapshots, times) = std::thread::scope(|scope| {
        let checker = scope.spawn(|| {
            let started = std::time::Instant::now();
            let sums = tensors.iter().try_for_each(|(at, data, _, t)| {
                if xxh3_hex(data) != t.xxh3 {
                    return Err(format!("{at}: checksum mismatch"));
                }
                if verify && hex(data) != t.hash {
                    return Err(format!("{at}: hash mismatch"));
                }
                Ok(())
            });
            (sums, started.elapsed())
        });
        let built = build(&header, &tensors, &corrupt);
        let waited = std::time::Instant::now();
        let (sums, checksum) = checker.join().expect("the checksum thread does not panic");
        let times = ReadTimes {
            checksum,
            checksum_wait: waited.elapsed(),
        };
        sums.map_err(corrupt)?;
        Ok::<_, KvStoreError>((built?, times))
    })?;
    Ok((header, snapshots, times))
}

/// The snapshots of `header`'s caches from their checked tensor bytes (MLX copies them).
fn build(
    header: &Header,
    tensors: &[(String, &[u8], Dtype, &TensorEntry)],
    corrupt: &dyn Fn(String) -> KvStoreError,
) -> Result<Vec<Snapshot>, KvStoreError> {
    let mut arrays = tensors.iter().map(|(_, data, dtype, t)| {
        // SAFETY: `data` holds exactly prod(shape) elements of `dtype` (checked by the
        // caller); MLX copies them before the mapping goes away.
        unsafe { Array::from_raw_data(data.as_ptr().cast(), &t.shape, *dtype) }
    });
    let mut snapshots = Vec::new();
    for c in &header.caches {
        let tensors: Vec<Array> = arrays.by_ref().take(c.tensors.len()).collect();
        let quant = match (c.bits, c.group_size) {
            (Some(bits), Some(group_size)) => Some(KvQuant {
                bits,
                group_size,
                sdpa: QuantSdpa::MlxLm,
            }),
            _ => None,
        };
        let (kind, quantized) = split_kind(&c.kind);
        if quantized != quant.is_some() {
            return Err(corrupt(format!(
                "cache kind `{}` without its quantization",
                c.kind
            )));
        }
        let s = Snapshot {
            kind: kind.to_owned(),
            offset: c.offset,
            quant,
            meta: c.meta.clone(),
            tensors,
        };
        // The registry rebuilds it (arrays shared, nothing copied): an unknown kind or a
        // kind without its meta is refused here, not at restore.
        super::restore(s.clone(), QuantSdpa::MlxLm)
            .map_err(|e| corrupt(format!("cache {}: {e}", c.kind)))?;
        snapshots.push(s);
    }
    Ok(snapshots)
}
