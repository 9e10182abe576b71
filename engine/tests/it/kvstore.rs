//! kv-store v3 files: every cache kind (kv, rotating, qkv, rotating-qkv) round-trips byte
//! for byte; continuing from restored caches equals continuing in memory (bit-identical
//! log-probabilities) for plain, rotating and quantized caches; a flipped byte in the header
//! or in a tensor (always-on checksum; SHA-256 with verification) is refused with a clear
//! error; older and malformed files are refused cleanly; writes leave no temporary file
//! behind.

use crate::common;

use common::{bytes, goldens, greedy_run};

use engine::cache::kv_quant::{KvLayers, KvQuantPlan};
use engine::cache::kvstore::{self, Identity};
use engine::cache::{restore, Cache, QuantSdpa, Snapshot};
use engine::generate::{Session, SessionOptions};

fn id() -> Identity {
    Identity {
        model_id: "test".into(),
        config_fingerprint: "f".repeat(64),
        ns: String::new(),
        tokenizer_hash: "t".repeat(64),
    }
}

/// tiny-gemma3-kv with optiq's kv_config: layers 0, 2 are quantized rings, 1 a quantized
/// plain cache, 3 a dense plain cache — all four kinds.
fn l2_options() -> SessionOptions {
    SessionOptions {
        kv_quant: Some(KvQuantPlan {
            layers: KvLayers::from_config_file(&goldens().join("l2/tiny-gemma3-kv/kv_config.json"))
                .unwrap(),
            start: 0,
            sdpa: QuantSdpa::OptiqFused,
        }),
        ..Default::default()
    }
}

fn snapshots(caches: &[Box<dyn Cache>]) -> Vec<Snapshot> {
    caches.iter().map(|c| c.snapshot().unwrap()).collect()
}

/// Prefill + a few steps, then: snapshot → file → restore, and continue both ways.
fn fork_compare(model: &str, opts: &SessionOptions) -> Vec<String> {
    fork_compare_with(model, opts, |_| {}).expect("restored caches continue identically")
}

/// As `fork_compare`, with `plant` applied to the restored snapshots; None if the
/// continuations differ.
fn fork_compare_with(
    model: &str,
    opts: &SessionOptions,
    plant: impl Fn(&mut Vec<Snapshot>),
) -> Option<Vec<String>> {
    let m = engine::model::load(&goldens().join("models").join(model)).unwrap();
    let prompt: Vec<u32> = (0..30).map(|i| (i * 37 % 900) as u32 + 10).collect();
    let mut live = Session::with_options(m.as_ref(), opts);
    let (first, _) = greedy_run(&mut live, &prompt, 0, 6);
    let fed = live.caches[0].offset() as usize;
    let mut tokens = prompt.clone();
    tokens.extend(&first);
    tokens.truncate(fed);
    let snaps = snapshots(&live.caches);
    let kinds: Vec<String> = snaps
        .iter()
        .map(|s| format!("{}{}", s.kind, if s.quant.is_some() { "+q" } else { "" }))
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("entry.mlxkv");
    kvstore::write(&path, &id(), &tokens, &snaps, "2026-11-29T00:00:00Z").unwrap();
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        1,
        "no temporary file left behind"
    );
    let (header, mut back) = kvstore::read(&path, true).unwrap();
    assert_eq!(header.tokens, tokens);
    // Byte-identical round trip, every tensor of every cache.
    for (a, b) in snaps.iter().zip(&back) {
        assert_eq!(
            (
                a.offset,
                &a.kind,
                &a.meta,
                a.quant.map(|q| (q.bits, q.group_size))
            ),
            (
                b.offset,
                &b.kind,
                &b.meta,
                b.quant.map(|q| (q.bits, q.group_size))
            )
        );
        for (x, y) in a.tensors.iter().zip(b.tensors.iter()) {
            assert_eq!(x.shape(), y.shape());
            assert_eq!(x.dtype(), y.dtype());
            assert_eq!(bytes(x), bytes(y));
        }
    }
    plant(&mut back);
    // Continue in memory and from the restored caches on the same next prompt.
    let sdpa = opts.kv_quant.as_ref().map_or(QuantSdpa::MlxLm, |p| p.sdpa);
    let restored: Vec<Box<dyn Cache>> = back
        .into_iter()
        .map(|s| restore(s, sdpa).unwrap())
        .collect();
    let mut next = tokens.clone();
    next.extend([5u32, 17, 99]);
    let (ids_live, lps_live) = greedy_run(&mut live, &next, fed, 12);
    let mut resumed = Session::with_caches(m.as_ref(), opts, restored);
    let (ids_back, lps_back) = greedy_run(&mut resumed, &next, fed, 12);
    (ids_live == ids_back && lps_live == lps_back).then_some(kinds)
}

/// Planted defect: a ring restored with its index off by one continues differently.
#[test]
fn planted_wrong_ring_index_is_caught() {
    let caught = fork_compare_with("tiny-gemma3-kv", &l2_options(), |snaps| {
        for s in snaps.iter_mut() {
            if let Some(idx) = s.meta.get_mut("idx") {
                *idx = ((idx.as_i64().unwrap() + 1) % 8).into();
            }
        }
    });
    assert!(
        caught.is_none(),
        "a shifted ring index must change the continuation"
    );
}

#[test]
fn plain_caches_round_trip_and_continue_identically() {
    let kinds = fork_compare("tiny-llama-trained", &SessionOptions::default());
    assert!(kinds.iter().all(|k| k == "kv"), "{kinds:?}");
}

#[test]
fn rotating_and_quantized_caches_round_trip_and_continue_identically() {
    let kinds = fork_compare("tiny-gemma3-kv", &l2_options());
    for want in ["kv", "kv+q", "rotating", "rotating"] {
        assert!(
            kinds.iter().any(|k| k.starts_with(want)),
            "{want} missing in {kinds:?}"
        );
    }
    assert!(
        kinds
            .iter()
            .any(|k| k.starts_with("rotating") && k.ends_with("+q")),
        "{kinds:?}"
    );
}

#[test]
fn flipped_bytes_are_refused_not_fatal() {
    let m = engine::model::load(&goldens().join("models/tiny-llama-trained")).unwrap();
    let mut s = Session::with_options(m.as_ref(), &SessionOptions::default());
    s.prefill(&[1, 2, 3, 4, 5, 6]).unwrap();
    let snaps = snapshots(&s.caches);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("e.mlxkv");
    kvstore::write(&path, &id(), &[1, 2, 3, 4, 5, 6], &snaps, "t").unwrap();
    let clean = std::fs::read(&path).unwrap();

    let mut header_flip = clean.clone();
    header_flip[60] ^= 0x20; // inside the JSON header
    std::fs::write(&path, &header_flip).unwrap();
    let err = kvstore::read(&path, false)
        .err()
        .expect("a flipped header byte is refused");
    assert!(err.to_string().contains("header hash mismatch"), "{err}");
    assert!(kvstore::read_header(&path).is_err());

    let mut tensor_flip = clean.clone();
    let data_start = u64::from_le_bytes(clean[16..24].try_into().unwrap()) as usize;
    tensor_flip[data_start + 3] ^= 0x01;
    std::fs::write(&path, &tensor_flip).unwrap();
    for verify in [false, true] {
        let err = kvstore::read(&path, verify)
            .err()
            .expect("the always-on checksum catches a tensor flip");
        assert!(err.to_string().contains("checksum mismatch"), "{err}");
    }
    // With the flipped tensor's checksum rewritten to match (a valid header), only the
    // SHA-256 of --ssd-cache-verify can tell.
    std::fs::write(&path, &tensor_flip).unwrap();
    rewrite_header(&path, |h| {
        let t = &mut h["caches"][0]["tensors"][0];
        assert_eq!(t["off"], 0, "the flipped byte is in the first tensor");
        let len = t["bytes"].as_u64().unwrap() as usize;
        let flipped = xxhash_rust::xxh3::xxh3_64(&tensor_flip[data_start..data_start + len]);
        t["xxh3"] = serde_json::json!(format!("{flipped:016x}"));
    });
    assert!(kvstore::read(&path, false).is_ok());
    let err = kvstore::read(&path, true)
        .err()
        .expect("verification catches what the checksum was made to miss");
    assert!(err.to_string().contains("hash mismatch"), "{err}");

    std::fs::write(&path, b"not a kv file").unwrap();
    let err = kvstore::read(&path, false).err().unwrap();
    assert!(err.to_string().contains("not a kv-store v3 file"), "{err}");
}

/// Rewrites a file's JSON header through `edit`, with a valid header hash.
fn rewrite_header(path: &std::path::Path, edit: impl FnOnce(&mut serde_json::Value)) {
    use sha2::Digest;
    let bytes = std::fs::read(path).unwrap();
    let len = u32::from_le_bytes(bytes[12..16].try_into().unwrap()) as usize;
    let data_start = u64::from_le_bytes(bytes[16..24].try_into().unwrap()) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&bytes[56..56 + len]).unwrap();
    edit(&mut header);
    let json = serde_json::to_vec(&header).unwrap();
    let mut out = bytes[..12].to_vec();
    out.extend_from_slice(&(json.len() as u32).to_le_bytes());
    out.extend_from_slice(&bytes[16..24]);
    out.extend_from_slice(&sha2::Sha256::digest(&json));
    out.extend_from_slice(&json);
    out.resize(data_start, 0);
    out.extend_from_slice(&bytes[data_start..]);
    std::fs::write(path, out).unwrap();
}

/// The format bump: a v2 file (no checksums), a truncated file, an absurd header length
/// and a tensor said to lie past the end are each refused with an error naming the
/// problem, never a crash.
#[test]
fn older_and_malformed_files_are_refused_cleanly() {
    let m = engine::model::load(&goldens().join("models/tiny-llama-trained")).unwrap();
    let mut s = Session::with_options(m.as_ref(), &SessionOptions::default());
    s.prefill(&[1, 2, 3]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("e.mlxkv");
    kvstore::write(&path, &id(), &[1, 2, 3], &snapshots(&s.caches), "t").unwrap();
    let clean = std::fs::read(&path).unwrap();
    assert_eq!(&clean[..8], b"MLXKV\0v3");

    let mut v2 = clean.clone();
    v2[7] = b'2';
    v2[8..12].copy_from_slice(&2u32.to_le_bytes());
    std::fs::write(&path, &v2).unwrap();
    for err in [
        kvstore::read(&path, false).err().unwrap(),
        kvstore::read_header(&path).err().unwrap(),
    ] {
        assert!(
            err.to_string()
                .contains("format version 2, this engine reads 3"),
            "{err}"
        );
    }

    std::fs::write(&path, &clean[..40]).unwrap();
    let err = kvstore::read_header(&path).err().unwrap();
    assert!(
        err.to_string().contains("shorter than the preamble"),
        "{err}"
    );
    assert!(kvstore::read(&path, false).is_err());

    let mut huge = clean.clone();
    huge[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
    std::fs::write(&path, &huge).unwrap();
    let err = kvstore::read_header(&path).err().unwrap();
    assert!(
        err.to_string().contains("header of 4294967295 bytes"),
        "{err}"
    );
    assert!(kvstore::read(&path, false).is_err());

    std::fs::write(&path, &clean).unwrap();
    rewrite_header(&path, |h| {
        h["caches"][0]["tensors"][0]["off"] = serde_json::json!(u64::MAX - 10);
    });
    let err = kvstore::read(&path, false).err().unwrap();
    assert!(err.to_string().contains("runs past the end"), "{err}");
}

/// The families added for real checkpoints (issue 21): mixture of experts and phi3 hold
/// plain caches, the multimodal wrappers gemma3 / gemma4 their text families' rings and
/// plain caches, gpt-oss and Gemma 4's MoE rings and plain caches; each round-trips byte for byte and continues identically.
#[test]
fn the_newer_families_round_trip_and_continue_identically() {
    let opts = SessionOptions::default();
    for model in [
        "tiny-qwen3-moe",
        "tiny-mixtral",
        "tiny-qwen2-moe",
        "tiny-phi3",
    ] {
        let kinds = fork_compare(model, &opts);
        assert!(kinds.iter().all(|k| k == "kv"), "{model}: {kinds:?}");
    }
    for model in [
        "tiny-gemma3-mm",
        "tiny-gemma4-mm",
        "tiny-gpt-oss",
        "tiny-gemma4-moe",
    ] {
        let kinds = fork_compare(model, &opts);
        for want in ["kv", "rotating"] {
            assert!(
                kinds.iter().any(|k| k.starts_with(want)),
                "{model}: {want} missing in {kinds:?}"
            );
        }
    }
}
