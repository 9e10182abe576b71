//! The SSD store (files are the database): a restart finds and restores a stored prefix
//! and continues bit-identically to a fresh prefill; the start-up scan removes temp files
//! and corrupt entries and never touches another fingerprint's directory; eviction goes by
//! oldest mtime (a restore counts as use); oversize entries are refused; a longer entry
//! supersedes its prefixes. The hybrids' recurrent states go through the same restart.

use crate::common;

use common::greedy_run;

fn model() -> Box<dyn engine::model::LanguageModel> {
    common::model("tiny-llama-trained")
}

use std::path::Path;

use engine::cache::kvstore::Identity;
use engine::cache::ssd::{Geometry, SsdStore};
use engine::cache::{Cache, QuantSdpa};
use engine::generate::{Session, SessionOptions};

/// tiny-llama-trained's cache geometry (what the store checks entries against).
fn geom() -> Geometry {
    Geometry::probe(&[model().as_ref()], None).unwrap()
}

fn id(fp: &str) -> Identity {
    common::ssd_identity(fp)
}

/// Caches holding `prompt` (prefilled, one step) and the tokens they hold.
fn prefilled(
    m: &dyn engine::model::LanguageModel,
    prompt: &[u32],
) -> (Vec<u32>, Vec<Box<dyn Cache>>) {
    let mut s = Session::with_options(m, &SessionOptions::default());
    s.prefill(prompt).unwrap();
    let caches = std::mem::take(&mut s.caches);
    (prompt.to_vec(), caches)
}

#[test]
fn a_restart_restores_the_prefix_and_continues_like_a_fresh_prefill() {
    let m = model();
    let dir = tempfile::tempdir().unwrap();
    let prompt: Vec<u32> = (0..40).map(|i| (i * 13 % 800) as u32 + 20).collect();
    let (tokens, caches) = prefilled(m.as_ref(), &prompt);
    {
        let mut store = SsdStore::open(dir.path(), id("fp1"), geom(), 1 << 30, true).unwrap();
        assert!(store.store("", &tokens, &caches, "t"));
    }
    // "Restart": a new store on the same directory.
    let mut store = SsdStore::open(dir.path(), id("fp1"), geom(), 1 << 30, true).unwrap();
    assert_eq!(store.stats().entries, 1);
    let mut next = prompt.clone();
    next.extend([7u32, 8, 9, 10]);
    let (index, usable) = store.find("", &next).unwrap();
    assert_eq!(usable, prompt.len());
    assert!(store.find("other-ns", &next).is_none());
    let restored = store.restore(index, usable, QuantSdpa::MlxLm).unwrap();
    assert_eq!(store.stats().restores, 1);
    let mut resumed = Session::with_caches(m.as_ref(), &SessionOptions::default(), restored);
    let (ids_back, lps_back) = greedy_run(&mut resumed, &next, usable, 16);
    let mut fresh = Session::with_options(m.as_ref(), &SessionOptions::default());
    let (ids_fresh, lps_fresh) = greedy_run(&mut fresh, &next, 0, 16);
    assert_eq!(ids_back, ids_fresh);
    assert!(
        lps_back == lps_fresh,
        "a restored prefix continues exactly as a fresh prefill"
    );
}

#[test]
fn the_scan_cleans_its_own_fingerprint_only() {
    let m = model();
    let dir = tempfile::tempdir().unwrap();
    let (tokens, caches) = prefilled(m.as_ref(), &[1, 2, 3, 4, 5]);
    let mut store = SsdStore::open(dir.path(), id("fp1"), geom(), 1 << 30, false).unwrap();
    assert!(store.store("", &tokens, &caches, "t"));
    assert!(store.store("", &[9, 9, 9], &prefilled(m.as_ref(), &[9, 9, 9]).1, "t"));
    drop(store);
    let ns = dir.path().join("fp1/_base");
    let mut files: Vec<_> = std::fs::read_dir(&ns)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    // Corrupt one entry's header, leave a temp file behind, and put a file under another
    // fingerprint.
    let mut bytes = std::fs::read(&files[0]).unwrap();
    bytes[70] ^= 0x10;
    std::fs::write(&files[0], bytes).unwrap();
    let temp = format!(".{}.mlxkv.tmp-999", "0".repeat(32));
    std::fs::write(ns.join(&temp), b"partial").unwrap();
    std::fs::create_dir_all(dir.path().join("fp2/_base")).unwrap();
    std::fs::write(dir.path().join("fp2/_base/keep.mlxkv"), b"someone else's").unwrap();

    let store = SsdStore::open(dir.path(), id("fp1"), geom(), 1 << 30, false).unwrap();
    assert_eq!(
        store.stats().entries,
        1,
        "the corrupt entry is gone, the good one stays"
    );
    assert_eq!(store.stats().removed_corrupt, 1);
    assert!(!files[0].exists());
    assert!(!ns.join(&temp).exists(), "leftover temp files are removed");
    assert!(
        dir.path().join("fp2/_base/keep.mlxkv").exists(),
        "other fingerprints are never touched"
    );
}

#[test]
fn eviction_goes_by_oldest_use_and_oversize_is_refused() {
    let m = model();
    let dir = tempfile::tempdir().unwrap();
    let a = prefilled(m.as_ref(), &[1, 2, 3]);
    let b = prefilled(m.as_ref(), &[4, 5, 6]);
    let c = prefilled(m.as_ref(), &[7, 8, 9]);
    let size = {
        let mut s = SsdStore::open(dir.path(), id("probe"), geom(), 1 << 30, false).unwrap();
        s.store("", &a.0, &a.1, "t");
        s.stats().bytes
    };
    let mut store = SsdStore::open(dir.path(), id("fp"), geom(), size * 5 / 2, false).unwrap();
    assert!(store.store("", &a.0, &a.1, "t"));
    assert!(store.store("", &b.0, &b.1, "t"));
    // Using A makes B the oldest.
    let (i, n) = store.find("", &[1, 2, 3, 0]).unwrap();
    assert!(store.restore(i, n, QuantSdpa::MlxLm).is_some());
    assert!(store.store("", &c.0, &c.1, "t"));
    assert_eq!(store.stats().entries, 2);
    assert!(
        store.find("", &[1, 2, 3, 0]).is_some(),
        "A was used recently"
    );
    assert!(
        store.find("", &[4, 5, 6, 0]).is_none(),
        "B was the oldest: evicted"
    );
    assert!(store.find("", &[7, 8, 9, 0]).is_some());

    let mut tiny = SsdStore::open(dir.path(), id("tiny"), geom(), 1, false).unwrap();
    assert!(
        !tiny.store("", &a.0, &a.1, "t"),
        "larger than the cap: refused"
    );
}

#[test]
fn a_longer_entry_supersedes_its_prefixes() {
    let m = model();
    let dir = tempfile::tempdir().unwrap();
    let mut store = SsdStore::open(dir.path(), id("fp"), geom(), 1 << 30, false).unwrap();
    let short = prefilled(m.as_ref(), &[1, 2, 3]);
    let long = prefilled(m.as_ref(), &[1, 2, 3, 4, 5, 6]);
    store.store("", &short.0, &short.1, "t");
    store.store("", &long.0, &long.1, "t");
    assert_eq!(store.stats().entries, 1);
    let (_, n) = store.find("", &[1, 2, 3, 9]).unwrap();
    assert_eq!(n, 3, "served by the longer entry, trimmed");
}

/// Not a gate by itself: the writer process of `a_sigkill_during_writes_leaves_no_partial_entry`
/// (it runs only when that test starts it with SSD_CHILD_DIR set).
#[test]
fn child_writer_for_the_sigkill_test() {
    let Ok(dir) = std::env::var("SSD_CHILD_DIR") else {
        return;
    };
    let m = model();
    let mut store = SsdStore::open(Path::new(&dir), id("fp"), geom(), 1 << 40, false).unwrap();
    let prompt: Vec<u32> = (0..300).map(|i| (i * 7 % 900) as u32 + 10).collect();
    let (_, caches) = prefilled(m.as_ref(), &prompt);
    for round in 0u32.. {
        // A different token sequence each time, so nothing is superseded.
        let mut tokens = prompt.clone();
        tokens[0] = round;
        store.store("", &tokens, &caches, "t");
    }
}

/// The writer's full name in this test binary (module path without the crate's name), so
/// `--exact` selects it alone.
fn child_test_name() -> String {
    let module = module_path!().split_once("::").map_or("", |(_, m)| m);
    format!("{module}::child_writer_for_the_sigkill_test")
}

/// A process killed with SIGKILL in the middle of writing entries leaves no visible
/// partial entry: every .mlxkv file that remains reads back, and the next scan removes the
/// temp files.
#[test]
fn a_sigkill_during_writes_leaves_no_partial_entry() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", &child_test_name(), "--test-threads=1"])
        .env("SSD_CHILD_DIR", dir.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let ns = dir.path().join("fp/_base");
    let start = std::time::Instant::now();
    // Let it write a good number of entries, then kill it mid-stream.
    let finished = |ns: &std::path::Path| {
        std::fs::read_dir(ns).map_or(0, |d| {
            d.flatten()
                .filter(|f| !f.file_name().to_string_lossy().starts_with('.'))
                .count()
        })
    };
    // Finished entries only (the temp file being written is a dot file).
    while finished(&ns) < 20 {
        assert!(
            start.elapsed() < std::time::Duration::from_secs(120),
            "the writer wrote nothing"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    for f in std::fs::read_dir(&ns).unwrap().flatten() {
        let name = f.file_name().to_string_lossy().into_owned();
        if name.ends_with(".mlxkv") && !name.starts_with('.') {
            engine::cache::kvstore::read(&f.path(), true)
                .unwrap_or_else(|e| panic!("a visible entry is partial: {e}"));
        }
    }
    let store = SsdStore::open(dir.path(), id("fp"), geom(), 1 << 40, false).unwrap();
    assert_eq!(
        store.stats().removed_corrupt,
        0,
        "no entry was half-written"
    );
    assert!(store.stats().entries >= 20);
    let leftovers = std::fs::read_dir(&ns)
        .unwrap()
        .flatten()
        .filter(|f| f.file_name().to_string_lossy().contains(".tmp-"))
        .count();
    assert_eq!(
        leftovers, 0,
        "the scan removed the killed writer's temp file"
    );
}

/// An entry under this fingerprint's directory whose header names another config (copied
/// in by hand, or left from a bug) is deleted by the scan; the same file under its own
/// fingerprint's directory is left alone.
#[test]
fn a_fingerprint_mismatch_is_removed_by_the_scan() {
    let m = model();
    let dir = tempfile::tempdir().unwrap();
    let (tokens, caches) = prefilled(m.as_ref(), &[1, 2, 3, 4]);
    let mut other = SsdStore::open(dir.path(), id("fpB"), geom(), 1 << 30, false).unwrap();
    assert!(other.store("", &tokens, &caches, "t"));
    drop(other);
    let src = std::fs::read_dir(dir.path().join("fpB/_base"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    std::fs::create_dir_all(dir.path().join("fpA/_base")).unwrap();
    let planted = dir.path().join("fpA/_base").join(src.file_name().unwrap());
    std::fs::copy(&src, &planted).unwrap();
    let store = SsdStore::open(dir.path(), id("fpA"), geom(), 1 << 30, false).unwrap();
    assert_eq!(store.stats().entries, 0);
    assert_eq!(store.stats().removed_corrupt, 1);
    assert!(!planted.exists(), "the mismatched entry is deleted");
    assert!(src.exists(), "its own fingerprint's copy is untouched");
}

/// How a continuation from a stored prefix compares: with the same caches continued in
/// memory (the RAM tier's path), and with a fresh prefill of the whole prompt.
struct Continuation {
    like_memory: bool,
    like_fresh: bool,
}

/// A session of `name` prefills a 40-token prompt; its caches are stored, a new store on
/// the same directory (a restart) restores them, and the next prompt continues from them:
/// ids and every step's log-probabilities, bit for bit, against the same caches continued
/// in memory and against a fresh prefill. `claim_extra`: the planted defect, the session
/// told the restored caches hold one token more than they do.
fn restart_continuation(name: &str, claim_extra: bool) -> Continuation {
    let m = common::model(name);
    let g = Geometry::probe(&[m.as_ref()], None).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let prompt: Vec<u32> = (0..40).map(|i| (i * 13 % 800) as u32 + 20).collect();
    let mut next = prompt.clone();
    next.extend([7u32, 8, 9, 10]);
    let opts = SessionOptions::default();
    let (tokens, caches) = prefilled(m.as_ref(), &prompt);
    {
        let mut store = SsdStore::open(dir.path(), id(name), g.clone(), 1 << 30, true).unwrap();
        assert!(store.store("", &tokens, &caches, "t"), "{name}: stored");
    }
    let mut live = Session::with_caches(m.as_ref(), &opts, caches);
    let memory = greedy_run(&mut live, &next, prompt.len(), 16);
    let mut store = SsdStore::open(dir.path(), id(name), g, 1 << 30, true).unwrap();
    assert_eq!(store.stats().entries, 1, "{name}: the scan finds the entry");
    let (index, usable) = store.find("", &next).unwrap();
    assert_eq!(usable, prompt.len(), "{name}");
    let restored = store
        .restore(index, usable, QuantSdpa::MlxLm)
        .unwrap_or_else(|| panic!("{name}: the entry restores"));
    let mut resumed = Session::with_caches(m.as_ref(), &opts, restored);
    let back = greedy_run(&mut resumed, &next, usable + claim_extra as usize, 16);
    let mut fresh = Session::with_options(m.as_ref(), &opts);
    let fresh = greedy_run(&mut fresh, &next, 0, 16);
    Continuation {
        like_memory: back == memory,
        like_fresh: back == fresh,
    }
}

/// The families added for real checkpoints (issue 21) through the SSD tier: mixture of
/// experts (qwen3_moe, also with affine experts, mixtral, qwen2_moe), phi3 (longrope),
/// yarn RoPE, the multimodal wrappers gemma3 / gemma4 with their text families, and
/// gpt-oss (sinks, mxfp4 experts) and Gemma 4's MoE block on their bf16 fixtures (rotating caches: the window of 8 has
/// wrapped by 40 tokens, so the rings are stored and restored as rings), and batch one's
/// dense families (gemma2's softcapped attention, olmo2 / olmo3 / exaone4 / cohere2 with
/// their windows, seed_oss, hunyuan_v1_dense, minicpm), and issue 38's others (smollm3's
/// NoPE layers, ernie4_5_moe, minimax, phimoe, llama4_text, the mistral3 / qwen3_vl wrappers,
/// minicpm3's unabsorbed latent attention).
const FAMILIES: [&str; 30] = [
    "tiny-ministral3",
    "tiny-glm4-moe",
    "tiny-qwen3-moe",
    "tiny-mixtral",
    "tiny-qwen2-moe",
    "tiny-phi3",
    "tiny-llama-yarn",
    "tiny-gemma3",
    "tiny-gemma3-mm",
    "tiny-gemma4",
    "tiny-gemma4-mm",
    "tiny-qwen3-moe-q4",
    "tiny-gpt-oss-mxfp4",
    "tiny-gemma4-moe-q4",
    "tiny-gemma2",
    "tiny-olmo2",
    "tiny-olmo3",
    "tiny-seed-oss",
    "tiny-exaone4",
    "tiny-hunyuan",
    "tiny-minicpm",
    "tiny-cohere2",
    "tiny-smollm3",
    "tiny-ernie4-5-moe",
    "tiny-minimax",
    "tiny-phimoe",
    "tiny-llama4-text",
    "tiny-mistral3",
    "tiny-qwen3-vl",
    "tiny-minicpm3",
];

#[test]
fn a_restart_continues_like_a_fresh_prefill_on_the_newer_families() {
    for name in FAMILIES {
        let c = restart_continuation(name, false);
        assert!(c.like_memory && c.like_fresh, "{name}");
    }
}

#[test]
fn planted_one_token_too_many_restored_is_caught_on_the_newer_families() {
    for name in FAMILIES {
        let c = restart_continuation(name, true);
        assert!(!c.like_memory && !c.like_fresh, "{name}");
    }
}

/// The hybrid families (issue 37): gated delta net (qwen3_5, its MoE and multimodal
/// layouts, qwen3_next), short conv (lfm2, lfm2_moe), Mamba-2 (mamba2, nemotron_h,
/// granitemoehybrid, nemotron_h with Nemotron 3's mixture-of-experts blocks, and falcon_h1
/// beside K/V in one layer's `CacheList`). Their layers' `arrays` caches (conv window + scan
/// state) are stored and restored beside the attention layers' K/V (falcon_h1's nested in
/// the list's entry); an entry serves its exact prefix only (a recurrent state cannot be
/// trimmed). These are the hybrids of `common::HYBRIDS` and `common::LIST_HYBRIDS`, and
/// Qwen 3.5's multimodal layout.
fn hybrids() -> impl Iterator<Item = &'static str> {
    common::HYBRIDS
        .into_iter()
        .chain(common::LIST_HYBRIDS)
        .chain(["tiny-qwen3-5-mm"])
}

#[test]
fn a_restart_continues_like_a_fresh_prefill_on_the_hybrids() {
    for name in hybrids() {
        let c = restart_continuation(name, false);
        assert!(c.like_memory && c.like_fresh, "{name}");
    }
}

#[test]
fn planted_one_token_too_many_restored_is_caught_on_the_hybrids() {
    for name in hybrids() {
        let c = restart_continuation(name, true);
        assert!(!c.like_memory && !c.like_fresh, "{name}");
    }
}

/// Dynamic RoPE recomputes its base from each call's last position (as mlx-lm's
/// DynamicNTKScalingRoPE), so a continuation from stored caches is not the computation of
/// one prefill: such caches are never stored (`store` writes nothing), and an entry that
/// claims to hold them is refused with the reason.
#[test]
fn dynamic_rope_caches_are_never_stored() {
    let m = common::model("tiny-llama-dynamic");
    let g = Geometry::probe(&[m.as_ref()], None).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut store = SsdStore::open(dir.path(), id("dyn"), g.clone(), 1 << 30, false).unwrap();
    let (tokens, caches) = prefilled(m.as_ref(), &[1, 2, 3, 4, 5]);
    assert!(
        !store.store("", &tokens, &caches, "t"),
        "nothing is written"
    );
    assert_eq!(store.stats().entries, 0);
    // The same prefix through the same-shaped tiny-llama, written as an entry: refused.
    let plain = common::model("tiny-llama");
    let (tokens, caches) = prefilled(plain.as_ref(), &[1, 2, 3, 4, 5]);
    let snaps: Vec<_> = caches.iter().map(|c| c.snapshot().unwrap()).collect();
    let path = dir.path().join("e.mlxkv");
    engine::cache::kvstore::write(&path, &id("dyn"), &tokens, &snaps, "t").unwrap();
    let header = engine::cache::kvstore::read_header(&path).unwrap();
    let why = g.check(&header).unwrap_err();
    assert_eq!(why, "cache 0: this layer's cache is never stored");
}

/// The identity of a model directory as `engine serve --ssd-cache` computes it.
fn served_identity(name: &str, dir: &Path) -> Identity {
    let model = common::goldens().join("models").join(name);
    let sources = engine::cache::fingerprint::Sources {
        model: &model,
        draft: None,
        adapters: &[],
        chat_template: None,
        kv_plan: None,
    };
    engine::cache::fingerprint::fingerprint(&sources, dir)
        .unwrap()
        .identity
}

/// tiny-mixtral and tiny-qwen2-moe make caches of the same geometry (2 layers, 2 KV heads
/// of 16, f32): only the fingerprint tells their entries apart. An entry mixtral wrote is
/// never seen by qwen2_moe's store, and copied into its directory it is removed by the
/// scan. Planted defect: a store keyed by the wrong identity restores mixtral's caches
/// into a qwen2_moe session, which then continues unlike a fresh qwen2_moe prefill.
#[test]
fn an_entry_written_by_another_model_is_refused() {
    let (a, b) = ("tiny-mixtral", "tiny-qwen2-moe");
    let dir = tempfile::tempdir().unwrap();
    let (id_a, id_b) = (
        served_identity(a, dir.path()),
        served_identity(b, dir.path()),
    );
    assert_ne!(id_a.config_fingerprint, id_b.config_fingerprint);
    assert_ne!(id_a.model_id, id_b.model_id);
    let (ma, mb) = (common::model(a), common::model(b));
    let (ga, gb) = (
        Geometry::probe(&[ma.as_ref()], None).unwrap(),
        Geometry::probe(&[mb.as_ref()], None).unwrap(),
    );
    let prompt: Vec<u32> = (0..30).map(|i| (i * 13 % 800) as u32 + 20).collect();
    let (tokens, caches) = prefilled(ma.as_ref(), &prompt);
    let mut store_a = SsdStore::open(dir.path(), id_a.clone(), ga, 1 << 30, false).unwrap();
    assert!(store_a.store("", &tokens, &caches, "t"));
    drop(store_a);
    let src = std::fs::read_dir(dir.path().join(&id_a.config_fingerprint).join("_base"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let header = engine::cache::kvstore::read_header(&src).unwrap();
    assert!(
        gb.check(&header).is_ok(),
        "the geometry alone would pass it"
    );

    let store_b = SsdStore::open(dir.path(), id_b.clone(), gb.clone(), 1 << 30, false).unwrap();
    assert_eq!(
        store_b.stats().entries,
        0,
        "another model's entries are not seen"
    );
    drop(store_b);
    let planted = dir
        .path()
        .join(&id_b.config_fingerprint)
        .join("_base")
        .join(src.file_name().unwrap());
    std::fs::create_dir_all(planted.parent().unwrap()).unwrap();
    std::fs::copy(&src, &planted).unwrap();
    let store_b = SsdStore::open(dir.path(), id_b, gb.clone(), 1 << 30, false).unwrap();
    assert_eq!(store_b.stats().entries, 0);
    assert_eq!(store_b.stats().removed_corrupt, 1, "removed by the scan");
    assert!(!planted.exists() && src.exists());

    let mut wrong = SsdStore::open(dir.path(), id_a, gb, 1 << 30, false).unwrap();
    let mut next = prompt.clone();
    next.extend([7u32, 8, 9]);
    let (index, usable) = wrong.find("", &next).unwrap();
    let restored = wrong.restore(index, usable, QuantSdpa::MlxLm).unwrap();
    let opts = SessionOptions::default();
    let mut resumed = Session::with_caches(mb.as_ref(), &opts, restored);
    let (_, lps_wrong) = greedy_run(&mut resumed, &next, usable, 8);
    let mut fresh = Session::with_options(mb.as_ref(), &opts);
    let (_, lps_fresh) = greedy_run(&mut fresh, &next, 0, 8);
    assert!(lps_wrong != lps_fresh, "the planted wrong identity shows");
}

/// float32 models with sliding windows (tiny-gpt-oss, tiny-gemma4-moe): a stored prefix continues exactly
/// as the same caches continued in memory, but not bit for bit as one prefill of the whole
/// prompt — in mlx-lm 0.32.2 too. There, once the prefix is longer than the window (8),
/// the last prefix token fed as a one-token step (as a session prefills) and the same
/// token inside a prefill chunk give logits ~2e-6 apart (0 up to 8 tokens; 0 on the bf16
/// gemma3 / gemma4 / gpt-oss-mxfp4 / gemma4-moe-q4 fixtures and the windowless f32 qwen3_moe); from the
/// 40-token prefix mlx-lm's continuation differs from its fresh prefill by the amounts the
/// engine's does (max |Δ| log-prob at step 0: 9.5e-7 on tiny-gpt-oss, 2.9e-6 on
/// tiny-gemma4-moe). The same holds of DeepSeek-V3's multi-head latent attention (float32
/// tiny-deepseek-v3, no window): a token's latent and rope key made in a one-token step and
/// inside a prefill differ in the last bits (one row through `kv_a_proj_with_mqa` against
/// many), and mlx-lm 0.32.2's prompt-cache continuation differs from its fresh prefill too
/// (max |Δ| logit 7.2e-7 over a 48-token cached turn and a 6-token suffix). So it is for
/// the other MLA families with the absorbed one-token step (glm4_moe_lite, kimi_k25,
/// deepseek_v32; not minicpm3, which never absorbs) and for gemma3n: this test's scenario run
/// in mlx-lm 0.32.2 (the 40-token prefix prefilled as generate_step does, 39 then 1, then
/// the 4-token suffix, 16 greedy steps) differs from its fresh prefill by 8.3e-7 (glm4_moe_lite),
/// 1.3e-6 (kimi_k25), 1.1e-6 (deepseek_v32), 1.0e-6 (deepseek_v3), 2.1e-6 (gemma3n) in the
/// logits, ids equal, and by 0 on minicpm3.
const SPLIT_DEPENDENT: [&str; 7] = [
    "tiny-gpt-oss",
    "tiny-gemma4-moe",
    "tiny-deepseek-v3",
    "tiny-glm4-moe-lite",
    "tiny-kimi-k25",
    "tiny-deepseek-v32",
    "tiny-gemma3n",
];

#[test]
fn split_dependent_models_restore_like_memory() {
    for name in SPLIT_DEPENDENT {
        let c = restart_continuation(name, false);
        assert!(c.like_memory, "{name}: the SSD tier changes nothing");
        assert!(
            !c.like_fresh,
            "{name}: now split-independent; move it to FAMILIES"
        );
        assert!(
            !restart_continuation(name, true).like_memory,
            "{name}: planted"
        );
    }
}
