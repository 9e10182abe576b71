//! The serve prompt store (`engine::serve::store::PromptStore`): RAM and SSD tiers behind
//! one take / keep. A take serves from RAM unless the SSD tier holds a strictly longer
//! prefix; keeps become write-behind snapshots, written at a flush (or after the debounce,
//! or when the queue closes), an earlier prefix of the same conversation coalesced; what
//! RAM evicts goes to the SSD tier at once; keep_fed trims caches holding more than the
//! tokens. The /stats mirror follows.

use crate::common;

use std::sync::mpsc;
use std::time::Duration;

use engine::cache::kvstore::Identity;
use engine::cache::prompt::PromptCache;
use engine::cache::ssd::{Geometry, SsdStore};
use engine::cache::{Cache, QuantSdpa};
use engine::generate::{Session, SessionOptions};
use engine::model::LanguageModel;
use engine::serve::store::{PromptStore, StatsMirror};

fn model() -> Box<dyn LanguageModel> {
    common::model("tiny-llama-trained")
}

fn ssd(m: &dyn LanguageModel, dir: &std::path::Path) -> SsdStore {
    let id = Identity {
        model_id: "tiny-llama-trained".into(),
        config_fingerprint: "fp".into(),
        ns: String::new(),
        tokenizer_hash: "t".into(),
    };
    SsdStore::open(
        dir,
        id,
        Geometry::probe(&[m], None).unwrap(),
        1 << 30,
        false,
    )
    .unwrap()
}

fn store(ram: usize, ssd: Option<SsdStore>, mirror: &StatsMirror) -> PromptStore {
    PromptStore::new(
        PromptCache::new(ram, None),
        ssd,
        QuantSdpa::MlxLm,
        Duration::from_millis(20),
        mirror.clone(),
    )
}

/// Caches holding `prompt` (prefilled).
fn caches(m: &dyn LanguageModel, prompt: &[u32]) -> Vec<Box<dyn Cache>> {
    let mut s = Session::with_options(m, &SessionOptions::default());
    s.prefill(prompt).unwrap();
    std::mem::take(&mut s.caches)
}

fn conversation(n: usize) -> Vec<u32> {
    (0..n).map(|i| (i * 13 % 800) as u32 + 20).collect()
}

fn offset(hit: &engine::cache::prompt::Hit) -> usize {
    hit.caches[0].offset() as usize
}

#[test]
fn a_take_serves_the_longest_prefix_from_ram() {
    let m = model();
    let mirror = StatsMirror::default();
    let mut st = store(4, None, &mirror);
    let conv = conversation(40);
    st.keep("", conv[..20].to_vec(), caches(m.as_ref(), &conv[..20]));
    st.keep("", vec![5, 6, 7], caches(m.as_ref(), &[5, 6, 7]));
    assert!(
        st.pending().is_empty(),
        "no SSD tier: nothing to write behind"
    );
    assert!(st.take("", &[900, 901]).is_none());
    let hit = st.take("", &conv).unwrap();
    assert_eq!((hit.reused, offset(&hit)), (20, 20));
    let ram = mirror.ram.lock().unwrap().clone();
    assert_eq!((ram.hits, ram.misses, ram.entries), (1, 1, 1));
    assert!(mirror.ssd.lock().unwrap().is_none());
}

#[test]
fn the_ssd_tier_serves_only_a_strictly_longer_prefix() {
    let m = model();
    let dir = tempfile::tempdir().unwrap();
    let conv = conversation(40);
    let mut disk = ssd(m.as_ref(), dir.path());
    assert!(disk.store("", &conv[..30], &caches(m.as_ref(), &conv[..30]), "t"));
    let mirror = StatsMirror::default();
    let mut st = store(4, Some(disk), &mirror);
    assert_eq!(mirror.ssd.lock().unwrap().as_ref().unwrap().entries, 1);
    // RAM holds 20 tokens, the SSD tier 30: the longer one is restored.
    st.keep("", conv[..20].to_vec(), caches(m.as_ref(), &conv[..20]));
    let hit = st.take("", &conv).unwrap();
    assert_eq!((hit.reused, offset(&hit)), (30, 30));
    assert_eq!(st.ssd().unwrap().stats().restores, 1);
    // RAM as long as the SSD tier: RAM serves, nothing is read from disk.
    st.keep("", conv[..30].to_vec(), caches(m.as_ref(), &conv[..30]));
    let hit = st.take("", &conv).unwrap();
    assert_eq!(hit.reused, 30);
    assert_eq!(st.ssd().unwrap().stats().restores, 1);
    assert_eq!(mirror.ssd.lock().unwrap().as_ref().unwrap().restores, 1);
}

#[test]
fn write_behind_is_written_at_a_flush_and_coalesces_an_earlier_prefix() {
    let m = model();
    let dir = tempfile::tempdir().unwrap();
    let conv = conversation(40);
    let mirror = StatsMirror::default();
    let mut st = store(4, Some(ssd(m.as_ref(), dir.path())), &mirror);
    st.keep("", conv[..20].to_vec(), caches(m.as_ref(), &conv[..20]));
    st.keep("", conv[..30].to_vec(), caches(m.as_ref(), &conv[..30]));
    st.keep("", vec![5, 6, 7], caches(m.as_ref(), &[5, 6, 7]));
    assert_eq!(
        st.pending(),
        [
            (String::new(), conv[..30].to_vec()),
            (String::new(), vec![5, 6, 7])
        ],
        "the conversation's earlier prefix is superseded"
    );
    assert_eq!(st.ssd().unwrap().stats().entries, 0, "nothing written yet");
    st.flush();
    assert!(st.pending().is_empty());
    let disk = st.ssd().unwrap();
    assert_eq!(disk.stats().entries, 2);
    assert_eq!(disk.find("", &conv).map(|(_, n)| n), Some(30));
    assert_eq!(mirror.ssd.lock().unwrap().as_ref().unwrap().entries, 2);
}

#[test]
fn recv_writes_behind_after_the_debounce_and_when_the_queue_closes() {
    let m = model();
    let dir = tempfile::tempdir().unwrap();
    let mut st = store(
        4,
        Some(ssd(m.as_ref(), dir.path())),
        &StatsMirror::default(),
    );
    st.keep("", vec![1, 2, 3], caches(m.as_ref(), &[1, 2, 3]));
    let (tx, rx) = mpsc::channel::<u32>();
    // A job arriving within the debounce: nothing is written yet.
    tx.send(7).unwrap();
    assert_eq!(st.recv(&rx), Some(7));
    assert_eq!(st.pending().len(), 1);
    // Idle past the debounce (the next job comes later): written before it arrives.
    let late = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        tx.send(8).unwrap();
        tx
    });
    assert_eq!(st.recv(&rx), Some(8));
    assert!(st.pending().is_empty());
    assert_eq!(st.ssd().unwrap().stats().entries, 1);
    // The queue closing writes what is pending.
    st.keep("", vec![4, 5, 6], caches(m.as_ref(), &[4, 5, 6]));
    drop(late.join().unwrap());
    assert_eq!(st.recv(&rx), None);
    assert!(st.pending().is_empty());
    assert_eq!(st.ssd().unwrap().stats().entries, 2);
}

#[test]
fn ram_evictions_are_spilled_to_the_ssd_tier_at_once() {
    let m = model();
    let dir = tempfile::tempdir().unwrap();
    let mirror = StatsMirror::default();
    let mut st = store(1, Some(ssd(m.as_ref(), dir.path())), &mirror);
    let (a, b) = (conversation(12), vec![700u32, 701, 702, 703]);
    st.keep("", a.clone(), caches(m.as_ref(), &a));
    st.keep("", b.clone(), caches(m.as_ref(), &b));
    // A left RAM (one entry only) and went to disk; B waits as write-behind.
    assert_eq!(st.ram().stats().entries, 1);
    assert!(st.ram().peek("", &a).is_none());
    assert_eq!(st.pending(), [(String::new(), b.clone())]);
    assert_eq!(st.ssd().unwrap().stats().entries, 1);
    let mut next = a.clone();
    next.push(9);
    assert_eq!(st.ssd().unwrap().find("", &next).map(|(_, n)| n), Some(12));
    let hit = st.take("", &next).unwrap();
    assert_eq!((hit.reused, offset(&hit)), (12, 12));
    assert_eq!(mirror.ssd.lock().unwrap().as_ref().unwrap().restores, 1);
}

#[test]
fn keep_fed_trims_caches_to_the_tokens_they_all_hold() {
    let m = model();
    let mut st = store(4, None, &StatsMirror::default());
    let conv = conversation(30);
    // Caches holding 30 tokens kept under 25 (e.g. drafts past the last verify): trimmed.
    st.keep_fed("", caches(m.as_ref(), &conv), conv[..25].to_vec());
    let kept = st
        .ram()
        .peek("", &conv[..25])
        .expect("kept under 25 tokens");
    assert!(kept.iter().all(|c| c.offset() == 25));
    // Tokens past what the caches hold (an id never fed back): the tokens are cut instead.
    let other = conversation(45)[30..].to_vec();
    let mut longer = other.clone();
    longer.extend([1, 2, 3]);
    st.keep_fed("", caches(m.as_ref(), &other), longer);
    let kept = st
        .ram()
        .peek("", &other)
        .expect("kept under the fed tokens");
    assert!(kept.iter().all(|c| c.offset() == other.len() as i32));
    assert_eq!(st.ram().stats().entries, 2);
}
