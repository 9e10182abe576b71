//! The SSD tier under hostile or unlucky conditions (issue 18, items 2–6 and 12): another
//! model's entries are never restored; corrupted tensors are caught without
//! `--ssd-cache-verify`; entries that disagree with the model's cache geometry are
//! quarantined; the start-up scan never follows symlinks, deletes only what the store wrote,
//! reads headers only, trims a store over its cap, and leaves a directory named like an
//! entry alone.

use crate::common;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::server::Server;
use std::time::{Duration, Instant, SystemTime};

use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use engine::cache::kvstore::{self, Identity};
use engine::cache::ssd::{Geometry, SsdStore};
use engine::cache::{Cache, QuantSdpa};
use engine::generate::{Session, SessionOptions};

fn model() -> Box<dyn engine::model::LanguageModel> {
    common::model("tiny-llama-trained")
}

fn id(fp: &str) -> Identity {
    common::ssd_identity(fp)
}

fn open(dir: &Path, fp: &str, max: u64, verify: bool) -> SsdStore {
    let geometry = Geometry::probe(&[model().as_ref()], None).unwrap();
    SsdStore::open(dir, id(fp), geometry, max, verify).unwrap()
}

fn prefilled(m: &dyn engine::model::LanguageModel, prompt: &[u32]) -> Vec<Box<dyn Cache>> {
    let mut s = Session::with_options(m, &SessionOptions::default());
    s.prefill(prompt).unwrap();
    std::mem::take(&mut s.caches)
}

/// The `.mlxkv` files under `dir` (recursively, symlinks not followed).
fn entries(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let t = e.file_type().unwrap();
        if t.is_dir() {
            out.extend(entries(&e.path()));
        } else if t.is_file() && e.file_name().to_string_lossy().ends_with(".mlxkv") {
            out.push(e.path());
        }
    }
    out.sort();
    out
}

/// A store in `dir` (fingerprint `fp`) holding one entry for `prompt`; its file.
fn one_entry(dir: &Path, fp: &str, prompt: &[u32]) -> PathBuf {
    let m = model();
    let mut store = open(dir, fp, 1 << 30, false);
    assert!(store.store("", prompt, &prefilled(m.as_ref(), prompt), "t"));
    let files = entries(&dir.join(fp));
    assert_eq!(files.len(), 1);
    files[0].clone()
}

/// Rewrites a file's JSON header through `edit`, with a valid header hash (what a buggy or
/// hostile writer could leave behind): only the checks past the header hash can catch it.
fn rewrite_header(path: &Path, edit: impl FnOnce(&mut Value)) {
    let bytes = std::fs::read(path).unwrap();
    let len = u32::from_le_bytes(bytes[12..16].try_into().unwrap()) as usize;
    let data_start = u64::from_le_bytes(bytes[16..24].try_into().unwrap()) as usize;
    let mut header: Value = serde_json::from_slice(&bytes[56..56 + len]).unwrap();
    edit(&mut header);
    let json = serde_json::to_vec(&header).unwrap();
    assert!(56 + json.len() <= data_start, "the edited header fits");
    let mut out = bytes[..12].to_vec();
    out.extend_from_slice(&(json.len() as u32).to_le_bytes());
    out.extend_from_slice(&bytes[16..24]);
    out.extend_from_slice(&Sha256::digest(&json));
    out.extend_from_slice(&json);
    out.resize(data_start, 0);
    out.extend_from_slice(&bytes[data_start..]);
    std::fs::write(path, out).unwrap();
}

/// Opens the store again and tries to restore `prompt`'s entry: the restored caches, if
/// any, and the store (for its stats).
fn try_restore(dir: &Path, prompt: &[u32]) -> (Option<Vec<Box<dyn Cache>>>, SsdStore) {
    let mut store = open(dir, "fp", 1 << 30, false);
    let mut next = prompt.to_vec();
    next.push(5);
    let restored = store
        .find("", &next)
        .and_then(|(i, n)| store.restore(i, n, QuantSdpa::MlxLm));
    (restored, store)
}

const PROMPT: [u32; 6] = [11, 12, 13, 14, 15, 16];

/// Item 3: a flipped tensor byte is caught by the always-on checksum (no
/// `--ssd-cache-verify`): the entry is quarantined and the request falls back to a prefill.
#[test]
fn a_flipped_tensor_byte_is_caught_without_verify() {
    let dir = tempfile::tempdir().unwrap();
    let file = one_entry(dir.path(), "fp", &PROMPT);
    let mut bytes = std::fs::read(&file).unwrap();
    let data_start = u64::from_le_bytes(bytes[16..24].try_into().unwrap()) as usize;
    bytes[data_start + 3] ^= 0x01;
    std::fs::write(&file, &bytes).unwrap();
    let err = kvstore::read(&file, false)
        .err()
        .expect("a flipped tensor byte is refused by default");
    assert!(err.to_string().contains("checksum mismatch"), "{err}");
    let (restored, store) = try_restore(dir.path(), &PROMPT);
    assert!(restored.is_none(), "corrupted caches are never used");
    assert!(!file.exists(), "the corrupt entry is quarantined");
    assert_eq!(store.stats().removed_corrupt, 1);
}

/// Item 4: an entry whose header hash is valid but whose tensor shapes disagree with the
/// model's caches (here: 1 head of 64 instead of 2 of 32; the bytes add up) is removed, not
/// restored (it used to answer 500 on every request sharing the prefix).
#[test]
fn shapes_that_disagree_with_the_model_are_quarantined() {
    let dir = tempfile::tempdir().unwrap();
    let file = one_entry(dir.path(), "fp", &PROMPT);
    rewrite_header(&file, |h| {
        for c in h["caches"].as_array_mut().unwrap() {
            for t in c["tensors"].as_array_mut().unwrap() {
                let s = t["shape"].as_array().unwrap().clone();
                assert_eq!(s[1], 2, "tiny-llama-trained has 2 KV heads");
                t["shape"] = json!([s[0], 1, s[2], s[3].as_i64().unwrap() * 2]);
            }
        }
    });
    let (restored, store) = try_restore(dir.path(), &PROMPT);
    assert!(restored.is_none(), "mis-shaped caches are never used");
    assert!(!file.exists(), "the inconsistent entry is quarantined");
    assert_eq!(store.stats().removed_corrupt, 1);
}

/// Where a hybrid's scan state lies in its SSD entry: the model, the cache (one per layer)
/// that holds it, and that cache's kind in the header — `arrays`, or `list` for falcon_h1's
/// `CacheList` (mlx-lm's `CacheList(ArraysCache(2), KVCache())`), whose parts' tensors
/// follow one another in the list's entry, the state's first. The scan state is the cache's
/// tensor 1, after the conv window: [1, 8, 16, 16] in every model here.
struct StateAt {
    model: &'static str,
    cache: usize,
    kind: &'static str,
}

/// tiny-mamba2: every layer an `arrays` cache (conv window [1, 3, 192], scan state).
const MAMBA2: StateAt = StateAt {
    model: "tiny-mamba2",
    cache: 2,
    kind: "arrays",
};

/// tiny-falcon-h1: every layer a `CacheList` (conv window [1, 3, 192], scan state, then K
/// and V [1, 2, positions, 16]).
const FALCON_H1: StateAt = StateAt {
    model: "tiny-falcon-h1",
    cache: 2,
    kind: "list",
};

/// tiny-nemotron-h-moe-q4 (pattern ME*E-): the Mamba-2 block's `arrays` cache first, beside
/// the attention block's K/V and the mixture-of-experts blocks, which keep nothing.
const NEMOTRON_MOE: StateAt = StateAt {
    model: "tiny-nemotron-h-moe-q4",
    cache: 0,
    kind: "arrays",
};

/// What the SSD tier did with a hybrid's 24-token entry (each check on a fresh store).
#[derive(Debug, PartialEq)]
struct StateChecks {
    /// Found for the prompt and one token more, with its whole length.
    serves_its_prefix: bool,
    /// Not found for a prompt that leaves it after 20 tokens (a state is not trimmed back).
    not_trimmed: bool,
    restores: bool,
    /// A flipped byte of the scan state: caught by the checksum at restore, the entry
    /// removed and counted.
    flipped_byte_quarantined: bool,
    /// The scan state's shape rewritten with heads and head width swapped (the bytes add
    /// up, the header hash is valid): refused by the start-up scan, removed and counted.
    other_shape_quarantined: bool,
}

const ALL_HELD: StateChecks = StateChecks {
    serves_its_prefix: true,
    not_trimmed: true,
    restores: true,
    flipped_byte_quarantined: true,
    other_shape_quarantined: true,
};

/// The scan state's tensor entry in a header (checking the cache's kind on the way).
fn scan_state_tensor<'h>(header: &'h mut Value, at: &StateAt) -> &'h mut Value {
    let c = &mut header["caches"][at.cache];
    assert_eq!(c["kind"], at.kind, "{}: cache {}", at.model, at.cache);
    if at.kind == "list" {
        assert_eq!(c["caches"][0]["kind"], "arrays", "the list's state part");
    }
    let t = &mut c["tensors"][1];
    assert_eq!(
        t["shape"],
        json!([1, 8, 16, 16]),
        "{}: the scan state",
        at.model
    );
    t
}

/// Writes one entry for a 24-token prompt of `at.model`, then serves, trims, restores,
/// flips a byte of the scan state and reshapes it, each on a fresh store.
fn damaged_state_checks(at: &StateAt) -> StateChecks {
    let m = common::model(at.model);
    let g = Geometry::probe(&[m.as_ref()], None).unwrap();
    let open = |dir: &Path| SsdStore::open(dir, id("fp"), g.clone(), 1 << 30, false).unwrap();
    let prompt: Vec<u32> = (0..24).map(|i| (i * 7 % 500) as u32 + 30).collect();
    let write = |dir: &Path| {
        let caches = prefilled(m.as_ref(), &prompt);
        assert!(open(dir).store("", &prompt, &caches, "t"));
        let files = entries(&dir.join("fp"));
        assert_eq!(files.len(), 1);
        files[0].clone()
    };
    let mut next = prompt.clone();
    next.push(3);
    let removed = |store: &SsdStore, file: &Path| {
        store.stats().removed_corrupt == 1 && !file.exists() && store.stats().entries == 0
    };

    let dir = tempfile::tempdir().unwrap();
    write(dir.path());
    let mut store = open(dir.path());
    let serves_its_prefix =
        store.stats().entries == 1 && store.find("", &next).map(|f| f.1) == Some(prompt.len());
    let mut diverging = prompt[..20].to_vec();
    diverging.extend([1, 2, 3]);
    let not_trimmed = store.find("", &diverging).is_none();
    let restores = store
        .find("", &next)
        .and_then(|(i, n)| store.restore(i, n, QuantSdpa::MlxLm))
        .is_some();

    let dir = tempfile::tempdir().unwrap();
    let file = write(dir.path());
    let mut bytes = std::fs::read(&file).unwrap();
    let len = u32::from_le_bytes(bytes[12..16].try_into().unwrap()) as usize;
    let data_start = u64::from_le_bytes(bytes[16..24].try_into().unwrap()) as usize;
    let mut header: Value = serde_json::from_slice(&bytes[56..56 + len]).unwrap();
    let off = scan_state_tensor(&mut header, at)["off"].as_u64().unwrap() as usize;
    bytes[data_start + off + 5] ^= 0x01;
    std::fs::write(&file, &bytes).unwrap();
    let mut store = open(dir.path());
    let refused = store
        .find("", &next)
        .is_some_and(|(i, n)| store.restore(i, n, QuantSdpa::MlxLm).is_none());
    let flipped_byte_quarantined = refused && removed(&store, &file);

    let dir = tempfile::tempdir().unwrap();
    let file = write(dir.path());
    rewrite_header(&file, |h| {
        let t = scan_state_tensor(h, at);
        t["shape"] = json!([1, 16, 8, 16]);
    });
    let other_shape_quarantined = removed(&open(dir.path()), &file);
    StateChecks {
        serves_its_prefix,
        not_trimmed,
        restores,
        flipped_byte_quarantined,
        other_shape_quarantined,
    }
}

/// A hybrid's recurrent state (issue 37; tiny-mamba2, every layer a state, and Nemotron 3's
/// tiny-nemotron-h-moe-q4, a state beside K/V and cacheless expert blocks) is stored whole
/// in `arrays` caches: an entry serves its exact prefix only (a state cannot be trimmed
/// back), a flipped byte of the scan state is caught by the checksum, and a state of another
/// shape is quarantined by the geometry.
#[test]
fn a_hybrid_entry_serves_its_exact_prefix_and_a_damaged_state_is_quarantined() {
    for at in [MAMBA2, NEMOTRON_MOE] {
        assert_eq!(damaged_state_checks(&at), ALL_HELD, "{}", at.model);
    }
}

/// falcon_h1's layers keep one `CacheList` each (a Mamba-2 state beside K/V), stored as one
/// entry per layer with its parts' tensors in order. As for the other hybrids: an entry
/// serves its exact prefix only, a flipped byte of a scan state is caught by the checksum,
/// and a scan state of another shape is quarantined by the geometry.
#[test]
fn a_cache_list_entry_serves_its_exact_prefix_and_a_damaged_state_is_quarantined() {
    assert_eq!(damaged_state_checks(&FALCON_H1), ALL_HELD);
}

/// Planted: a stored list checked as a whole only (its parts not against the model's)
/// lets the mis-shaped scan state through.
#[test]
fn planted_unchecked_list_parts_let_a_misshaped_state_through() {
    let _on = engine::plant::on(engine::plant::Defect::SsdListPartsUnchecked).unwrap();
    assert!(!damaged_state_checks(&FALCON_H1).other_shape_quarantined);
}

/// Item 4: caches claiming more positions than they store (offset past the data, tokens to
/// match) are removed, not restored (they used to give silent garbage).
#[test]
fn an_offset_past_the_stored_data_is_quarantined() {
    let dir = tempfile::tempdir().unwrap();
    let file = one_entry(dir.path(), "fp", &PROMPT);
    let longer: Vec<u32> = PROMPT.iter().chain(&PROMPT).copied().collect();
    rewrite_header(&file, |h| {
        h["tokens"] = json!(longer);
        for c in h["caches"].as_array_mut().unwrap() {
            c["offset"] = json!(longer.len());
        }
    });
    let (restored, store) = try_restore(dir.path(), &longer);
    assert!(restored.is_none(), "caches past their data are never used");
    assert!(!file.exists(), "the inconsistent entry is quarantined");
    assert_eq!(store.stats().removed_corrupt, 1);
}

/// Item 4: an entry with fewer caches than the model has layers is removed, not restored.
#[test]
fn a_missing_cache_is_quarantined() {
    let dir = tempfile::tempdir().unwrap();
    let file = one_entry(dir.path(), "fp", &PROMPT);
    rewrite_header(&file, |h| {
        h["caches"].as_array_mut().unwrap().pop();
    });
    let (restored, _) = try_restore(dir.path(), &PROMPT);
    assert!(restored.is_none(), "an entry missing a layer is never used");
    assert!(!file.exists(), "the inconsistent entry is quarantined");
}

/// Item 5: symlinks inside the store are never followed, and only files the store writes
/// (its entries and temp files, by name, regular files only) are ever deleted. Decoys in a
/// symlinked namespace directory's target, a symlinked entry's target and a foreign file
/// in the store stay untouched.
#[test]
fn the_scan_never_follows_symlinks_or_deletes_foreign_files() {
    let dir = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    let entry_name = format!("{}.mlxkv", "ab".repeat(16));
    let temp_name = format!(".{entry_name}.tmp-4242");
    let decoys = [
        outside.path().join(&entry_name),
        outside.path().join(&temp_name),
        outside.path().join("target.mlxkv"),
    ];
    for d in &decoys {
        std::fs::write(d, b"someone else's file").unwrap();
    }
    let ns = dir.path().join("fp/_base");
    std::fs::create_dir_all(&ns).unwrap();
    // A namespace-named directory that is a symlink to the outside directory.
    std::os::unix::fs::symlink(outside.path(), dir.path().join("fp/0123456789abcdef")).unwrap();
    // An entry-named symlink to an outside file.
    std::os::unix::fs::symlink(
        outside.path().join("target.mlxkv"),
        ns.join(format!("{}.mlxkv", "cd".repeat(16))),
    )
    .unwrap();
    // A foreign regular file that merely ends in .mlxkv.
    std::fs::write(ns.join("notes.mlxkv"), b"the user's notes").unwrap();

    let store = open(dir.path(), "fp", 1 << 30, false);
    assert_eq!(store.stats().entries, 0);
    assert_eq!(
        store.stats().removed_corrupt,
        0,
        "nothing of ours was corrupt"
    );
    for d in &decoys {
        assert!(d.exists(), "{} was deleted through a symlink", d.display());
    }
    assert!(
        ns.join("notes.mlxkv").exists(),
        "a foreign file was deleted"
    );
    assert!(ns
        .join(format!("{}.mlxkv", "cd".repeat(16)))
        .symlink_metadata()
        .is_ok());

    // The fingerprint's directory itself a symlink: the store refuses to open on it.
    std::fs::create_dir_all(outside.path().join("_base")).unwrap();
    let decoy = outside.path().join("_base").join(&entry_name);
    std::fs::write(&decoy, b"someone else's file").unwrap();
    std::os::unix::fs::symlink(outside.path(), dir.path().join("fpL")).unwrap();
    let geometry = Geometry::probe(&[model().as_ref()], None).unwrap();
    let err = SsdStore::open(dir.path(), id("fpL"), geometry, 1 << 30, false)
        .err()
        .expect("a symlinked fingerprint directory is refused");
    assert!(err.to_string().contains("is a symlink"), "{err}");
    assert!(decoy.exists());
}

/// Item 6: `read_header` reads the header only, never the whole file. Shown on a FIFO whose
/// writer sends a valid header and then stays open: a whole-file read never returns.
#[test]
fn read_header_reads_the_header_only() {
    let dir = tempfile::tempdir().unwrap();
    let file = one_entry(dir.path(), "fp", &PROMPT);
    let bytes = std::fs::read(&file).unwrap();
    let len = u32::from_le_bytes(bytes[12..16].try_into().unwrap()) as usize;
    let fifo = dir.path().join("pipe.mlxkv");
    assert!(Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    let writer_path = fifo.clone();
    let head = bytes[..56 + len].to_vec();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    std::thread::spawn(move || {
        let mut w = std::fs::OpenOptions::new()
            .write(true)
            .open(writer_path)
            .unwrap();
        w.write_all(&head).unwrap();
        // Hold the pipe open (no EOF) until the test is over.
        let _ = done_rx.recv();
    });
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(kvstore::read_header(&fifo).map(|h| h.tokens));
    });
    let got = rx.recv_timeout(Duration::from_secs(20));
    drop(done_tx);
    let tokens = got
        .expect("read_header waited for the end of the file: it reads more than the header")
        .unwrap();
    assert_eq!(tokens, PROMPT);
}

/// Item 6: a store already over `--ssd-cache-max` is trimmed at start, oldest first.
#[test]
fn a_store_over_its_cap_is_trimmed_at_start_oldest_first() {
    let m = model();
    let dir = tempfile::tempdir().unwrap();
    let prompts: [&[u32]; 3] = [&[1, 2, 3], &[4, 5, 6], &[7, 8, 9]];
    let mut store = open(dir.path(), "fp", 1 << 30, false);
    for p in prompts {
        assert!(store.store("", p, &prefilled(m.as_ref(), p), "t"));
    }
    let size = store.stats().bytes / 3;
    drop(store);
    // Ages set explicitly (no sleeps): the entry for prompts[1] is the oldest, then [0].
    let t0 = SystemTime::now() - Duration::from_secs(3600);
    let age = |path: &Path| {
        let h = kvstore::read_header(path).unwrap();
        let rank = prompts.iter().position(|p| *p == h.tokens).unwrap();
        let when = t0 + Duration::from_secs([10, 0, 20][rank]);
        std::fs::File::options()
            .write(true)
            .open(path)
            .unwrap()
            .set_modified(when)
            .unwrap();
        rank
    };
    let files = entries(&dir.path().join("fp"));
    let ranks: Vec<usize> = files.iter().map(|f| age(f)).collect();
    let store = open(dir.path(), "fp", size * 5 / 2, false);
    assert_eq!(store.stats().entries, 2, "{:?}", store.stats());
    assert!(store.stats().bytes <= size * 5 / 2);
    for (f, rank) in files.iter().zip(ranks) {
        assert_eq!(f.exists(), rank != 1, "the oldest entry goes first");
    }
}

/// Item 12: a directory named like an entry is not the store's file: left alone, and not
/// counted as corrupt at every start.
#[test]
fn a_directory_named_like_an_entry_is_left_alone_and_not_counted() {
    let dir = tempfile::tempdir().unwrap();
    let odd = dir
        .path()
        .join("fp/_base")
        .join(format!("{}.mlxkv", "ef".repeat(16)));
    std::fs::create_dir_all(&odd).unwrap();
    for _ in 0..2 {
        let store = open(dir.path(), "fp", 1 << 30, false);
        assert_eq!(store.stats().removed_corrupt, 0);
        assert_eq!(store.stats().entries, 0);
        assert!(odd.is_dir());
    }
}

// ---- item 2 end to end: two `engine serve` processes on one --ssd-cache directory ----

fn serve(model: &Path, ssd: &Path) -> Server {
    let ssd = ssd.to_str().unwrap();
    let flags = [
        "--no-open",
        "--ssd-cache-debounce-ms",
        "0",
        "--ssd-cache",
        ssd,
    ];
    common::server::serve_dir(model, &flags)
}

/// One request: the JSON body of the answer.
fn http(port: u16, method: &str, path: &str, body: &str) -> Value {
    let (_, text) = common::server::http(port, method, path, body.as_bytes());
    serde_json::from_str(&text).unwrap_or_else(|_| panic!("not JSON: {text}"))
}

fn ssd_stats(port: u16) -> Value {
    http(port, "GET", "/stats", "")["ssd_cache"].clone()
}

/// Waits (bounded) until the server has written `n` entries.
fn wait_spills(port: u16, n: u64) {
    let start = Instant::now();
    while ssd_stats(port)["spills"].as_u64() < Some(n) {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{}",
            ssd_stats(port)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A copy of tiny-llama-trained with every k/v projection weight negated (same config,
/// tokenizer, sizes: only the numbers differ).
fn negated_copy(to: &Path) {
    let src = common::goldens().join("models/tiny-llama-trained");
    for f in std::fs::read_dir(&src).unwrap().flatten() {
        std::fs::copy(f.path(), to.join(f.file_name())).unwrap();
    }
    let path = to.join("model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let mut flipped = 0;
    for (name, t) in header.as_object().unwrap() {
        if !(name.contains("k_proj") || name.contains("v_proj")) {
            continue;
        }
        assert_eq!(t["dtype"], "BF16");
        let (a, b) = (
            t["data_offsets"][0].as_u64().unwrap() as usize,
            t["data_offsets"][1].as_u64().unwrap() as usize,
        );
        // bf16 little-endian: the sign bit is the top bit of each element's second byte.
        for i in (8 + n + a..8 + n + b).skip(1).step_by(2) {
            bytes[i] ^= 0x80;
        }
        flipped += 1;
    }
    assert_eq!(flipped, 6, "3 layers × (k, v)");
    std::fs::write(&path, bytes).unwrap();
}

/// Item 2: a variant of the model (k/v projection weights negated) serving on the same
/// --ssd-cache directory never restores the original's entry; the original restarted on
/// it does (so the check can fail).
#[test]
fn another_models_entry_is_never_restored() {
    let ssd = tempfile::tempdir().unwrap();
    let variant = tempfile::tempdir().unwrap();
    negated_copy(variant.path());
    let original = common::goldens().join("models/tiny-llama-trained");
    let turn1 = json!({"messages": [{"role": "user", "content": "What color is the sky?"}],
                       "max_tokens": 8});
    let turn2 = json!({"messages": [{"role": "user", "content": "What color is the sky?"},
                                    {"role": "assistant", "content": "The sky is blue."},
                                    {"role": "user", "content": "Who brought the broken clock?"}],
                       "max_tokens": 8});
    {
        let first = serve(&original, ssd.path());
        http(
            first.port,
            "POST",
            "/v1/chat/completions",
            &turn1.to_string(),
        );
        wait_spills(first.port, 1);
    }
    let other = serve(variant.path(), ssd.path());
    let r = http(
        other.port,
        "POST",
        "/v1/chat/completions",
        &turn2.to_string(),
    );
    assert_eq!(
        r["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(),
        Some(0),
        "the variant reused the original's caches: {r}"
    );
    assert_eq!(ssd_stats(other.port)["restores"], 0);
    drop(other);
    // Positive control: the original itself restores its entry.
    let again = serve(&original, ssd.path());
    let r = http(
        again.port,
        "POST",
        "/v1/chat/completions",
        &turn2.to_string(),
    );
    assert!(
        r["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64() > Some(0),
        "{r}"
    );
    assert_eq!(ssd_stats(again.port)["restores"], 1);
}

/// Item 4: the checks run again at restore, so a file changed after the scan is caught too.
#[test]
fn an_entry_changed_after_the_scan_is_checked_at_restore() {
    let dir = tempfile::tempdir().unwrap();
    let file = one_entry(dir.path(), "fp", &PROMPT);
    let mut store = open(dir.path(), "fp", 1 << 30, false);
    assert_eq!(store.stats().entries, 1);
    rewrite_header(&file, |h| {
        for c in h["caches"].as_array_mut().unwrap() {
            c["tensors"][0]["dtype"] = json!("float16");
        }
    });
    let mut next = PROMPT.to_vec();
    next.push(5);
    let (i, n) = store.find("", &next).unwrap();
    assert!(store.restore(i, n, QuantSdpa::MlxLm).is_none());
    assert!(!file.exists(), "quarantined at restore");
    assert_eq!(store.stats().entries, 0);
}

/// The geometry check accepts what real sessions store (no false quarantine): wrapped and
/// quantized rings and quantized and dense plain caches (tiny-gemma3-kv with optiq's
/// kv_config), dense caches before the plan's start, gemma4_text's, and the model's caches
/// followed by a drafter's. Planted: the same entries against another session's geometry are refused.
#[test]
fn the_geometry_accepts_what_sessions_store_and_refuses_other_sessions() {
    use engine::cache::kv_quant::{KvLayers, KvQuantPlan};
    let gemma = common::model("tiny-gemma3-kv");
    let plan = |start| KvQuantPlan {
        layers: KvLayers::from_config_file(
            &common::goldens().join("l2/tiny-gemma3-kv/kv_config.json"),
        )
        .unwrap(),
        start,
        sdpa: QuantSdpa::OptiqFused,
    };
    let prompt: Vec<u32> = (0..30).map(|i| (i * 37 % 900) as u32 + 10).collect();
    let check = |m: &[&dyn engine::model::LanguageModel],
                 caches: Vec<Box<dyn Cache>>,
                 geometry_plan: Option<KvQuantPlan>| {
        let dir = tempfile::tempdir().unwrap();
        let g = Geometry::probe(m, geometry_plan.as_ref()).unwrap();
        let mut store = SsdStore::open(dir.path(), id("fp"), g.clone(), 1 << 30, false).unwrap();
        assert!(store.store("", &prompt, &caches, "t"));
        let mut store = SsdStore::open(dir.path(), id("fp"), g, 1 << 30, false).unwrap();
        let mut next = prompt.clone();
        next.push(5);
        store
            .find("", &next)
            .and_then(|(i, n)| store.restore(i, n, QuantSdpa::OptiqFused))
            .is_some()
    };
    let session = |m: &dyn engine::model::LanguageModel, p: Option<KvQuantPlan>| {
        let opts = SessionOptions {
            kv_quant: p,
            ..Default::default()
        };
        let mut s = Session::with_options(m, &opts);
        s.prefill(&prompt).unwrap();
        std::mem::take(&mut s.caches)
    };
    // Written with a store that does not check (the same geometry as the entry's own), read
    // back under `reader`'s geometry.
    let cross = |m: &dyn engine::model::LanguageModel,
                 written: Option<KvQuantPlan>,
                 reader: Option<KvQuantPlan>| {
        let dir = tempfile::tempdir().unwrap();
        let caches = session(m, written.clone());
        let g = Geometry::probe(&[m], written.as_ref()).unwrap();
        let mut w = SsdStore::open(dir.path(), id("fp"), g, 1 << 30, false).unwrap();
        assert!(w.store("", &prompt, &caches, "t"));
        let g = Geometry::probe(&[m], reader.as_ref()).unwrap();
        SsdStore::open(dir.path(), id("fp"), g, 1 << 30, false)
            .unwrap()
            .stats()
            .entries
    };
    let g = gemma.as_ref();
    assert!(check(&[g], session(g, Some(plan(0))), Some(plan(0))));
    assert!(check(&[g], session(g, None), None));
    assert!(
        check(&[g], session(g, Some(plan(1000))), Some(plan(1000))),
        "dense before the plan's start"
    );
    assert_eq!(cross(g, Some(plan(0)), Some(plan(0))), 1);
    assert_eq!(
        cross(g, Some(plan(0)), None),
        0,
        "quantized entry, dense session"
    );
    assert_eq!(
        cross(g, None, Some(plan(0))),
        0,
        "dense entry, quantized session"
    );

    let gemma4 = common::model("tiny-gemma4");
    let g4 = gemma4.as_ref();
    assert!(check(&[g4], session(g4, None), None), "gemma4_text");

    let llama = model();
    let draft = common::model("tiny-llama-draft");
    let mut both = session(llama.as_ref(), None);
    both.extend(session(draft.as_ref(), None));
    assert!(check(&[llama.as_ref(), draft.as_ref()], both, None));
    let mut both = session(llama.as_ref(), None);
    both.extend(session(draft.as_ref(), None));
    assert!(
        !check(&[llama.as_ref()], both, None),
        "an entry with a drafter's caches, a session without"
    );
}

// ---- item 2: the fingerprint ----

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for f in std::fs::read_dir(from).unwrap().flatten() {
        std::fs::copy(f.path(), to.join(f.file_name())).unwrap();
    }
}

/// Rewrites one byte of `path` in place, its size and mtime kept (what an mtime-only cache
/// key would miss).
fn poke_keeping_mtime(path: &Path, at: usize) {
    let mtime = std::fs::metadata(path).unwrap().modified().unwrap();
    let mut bytes = std::fs::read(path).unwrap();
    bytes[at] ^= 0x01;
    std::fs::write(path, bytes).unwrap();
    std::fs::File::options()
        .write(true)
        .open(path)
        .unwrap()
        .set_modified(mtime)
        .unwrap();
    assert_eq!(std::fs::metadata(path).unwrap().modified().unwrap(), mtime);
}

/// The fingerprint changes with the weights (even rewritten in place with size and mtime
/// kept), the tokenizer, the chat template, the KV plan, the drafter's weights and an
/// adapter; an unchanged model is not read again (its hashes are cached by path and
/// metadata); the model id and tokenizer hash follow their own files only.
#[test]
fn the_fingerprint_follows_everything_that_changes_the_numbers() {
    use engine::cache::fingerprint::{fingerprint, Sources};
    let tmp = tempfile::tempdir().unwrap();
    let (model_dir, draft_dir, adapter) = (
        tmp.path().join("m"),
        tmp.path().join("d"),
        tmp.path().join("a"),
    );
    let cache = tmp.path().join("ssd");
    copy_dir(
        &common::goldens().join("models/tiny-llama-trained"),
        &model_dir,
    );
    copy_dir(
        &common::goldens().join("models/tiny-llama-draft"),
        &draft_dir,
    );
    std::fs::create_dir_all(&adapter).unwrap();
    std::fs::write(adapter.join("adapter_config.json"), b"{\"rank\": 4}").unwrap();
    let plan = engine::cache::kv_quant::KvQuantPlan {
        layers: engine::cache::kv_quant::KvLayers::Uniform {
            bits: 4,
            group_size: 32,
        },
        start: 0,
        sdpa: QuantSdpa::MlxLm,
    };
    let base = Sources {
        model: &model_dir,
        draft: None,
        adapters: &[],
        chat_template: None,
        kv_plan: None,
    };
    let fp = |s: &Sources| fingerprint(s, &cache).unwrap();
    let first = fp(&base);
    assert!(first.bytes_hashed > 1_000_000, "the weights were read");
    let again = fp(&base);
    assert_eq!(again.bytes_hashed, 0, "unchanged files are not read again");
    assert_eq!(
        again.identity.config_fingerprint,
        first.identity.config_fingerprint
    );
    let id0 = first.identity;
    let differs = |s: &Sources, what: &str| {
        let got = fp(s).identity;
        assert_ne!(got.config_fingerprint, id0.config_fingerprint, "{what}");
        got
    };
    differs(
        &Sources {
            chat_template: Some("{{ messages }}"),
            ..base
        },
        "chat template",
    );
    differs(
        &Sources {
            kv_plan: Some(&plan),
            ..base
        },
        "kv plan",
    );
    let with_draft = differs(
        &Sources {
            draft: Some(&draft_dir),
            ..base
        },
        "drafter",
    );
    poke_keeping_mtime(&draft_dir.join("model.safetensors"), 5000);
    let poked = fp(&Sources {
        draft: Some(&draft_dir),
        ..base
    });
    assert!(poked.bytes_hashed > 0);
    assert_ne!(
        poked.identity.config_fingerprint, with_draft.config_fingerprint,
        "drafter weights"
    );
    differs(
        &Sources {
            adapters: std::slice::from_ref(&adapter),
            ..base
        },
        "adapter",
    );

    poke_keeping_mtime(&model_dir.join("model.safetensors"), 5000);
    let weights = differs(&base, "weights rewritten in place, size and mtime kept");
    assert_ne!(weights.model_id, id0.model_id);
    assert_eq!(weights.tokenizer_hash, id0.tokenizer_hash);

    let tc = model_dir.join("tokenizer_config.json");
    let mut text = std::fs::read(&tc).unwrap();
    text.push(b'\n');
    std::fs::write(&tc, text).unwrap();
    let tok = differs(&base, "tokenizer config");
    assert_ne!(tok.tokenizer_hash, weights.tokenizer_hash);
    assert_eq!(tok.model_id, weights.model_id);
}
