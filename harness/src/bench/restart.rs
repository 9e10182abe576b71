//! `harness bench --suite restart`: what the SSD tier buys after a restart. On the `small`
//! bench model with a long prompt, each leg is a fresh process: "fresh" prefills the whole
//! prompt and decodes; "store" prefills and writes the caches to a kv-store directory
//! (untimed); "restored" opens that store as a restarted server would, restores the prefix,
//! feeds the last prompt token and decodes. TTFT counts from the start of the request (for
//! "restored": the store lookup, the file read and the restore included). The restored
//! legs also report the restore's own time, the always-on tensor checksums' hashing time
//! (on their own thread, overlapped with the copy into MLX) and what the restore waited
//! for them: the wall time the check adds.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use engine::cache::kvstore::Identity;
use engine::cache::ssd::{Geometry, SsdStore};
use engine::cache::QuantSdpa;
use engine::generate::{Session, SessionOptions};
use serde::{Deserialize, Serialize};

use super::median;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RestartLeg {
    pub mode: String,
    pub ttft_s: f64,
    pub decode_tps: f64,
    /// "restored": the store's restore (read, checks, rebuild); the always-on tensor
    /// checksums' hashing time (on their own thread, overlapped with the copy) and the wall
    /// time the restore waited for them.
    #[serde(default)]
    pub restore_ms: f64,
    #[serde(default)]
    pub checksum_ms: f64,
    #[serde(default)]
    pub checksum_wait_ms: f64,
}

fn identity() -> Identity {
    Identity {
        model_id: "bench".into(),
        config_fingerprint: "restart-bench".into(),
        ns: String::new(),
        tokenizer_hash: "none".into(),
    }
}

/// One leg in this process (`harness leg-restart`).
pub fn leg(
    mode: &str,
    model: &Path,
    ids: &[u32],
    max_tokens: usize,
    ssd: &Path,
) -> Result<RestartLeg> {
    let m = engine::model::load(model)?;
    let opts = SessionOptions::default();
    let geometry = Geometry::probe(&[m.as_ref()], None)?;
    let mut restore_ms = (0.0, 0.0, 0.0);
    let start = Instant::now();
    let (mut session, cached) = match mode {
        "fresh" => (Session::with_options(m.as_ref(), &opts), 0),
        "store" => {
            let mut s = Session::with_options(m.as_ref(), &opts);
            s.prefill(ids)?;
            let mut store = SsdStore::open(ssd, identity(), geometry, u64::MAX, false)?;
            if !store.store("", ids, &s.caches, "bench") {
                bail!("the store refused the entry");
            }
            return Ok(RestartLeg {
                mode: mode.into(),
                ttft_s: 0.0,
                decode_tps: 0.0,
                restore_ms: 0.0,
                checksum_ms: 0.0,
                checksum_wait_ms: 0.0,
            });
        }
        "restored" => {
            let mut store = SsdStore::open(ssd, identity(), geometry, u64::MAX, false)?;
            let (index, usable) = store
                .find("", ids)
                .context("nothing stored for this prompt")?;
            let caches = store
                .restore(index, usable, QuantSdpa::MlxLm)
                .context("the stored entry could not be restored")?;
            let st = store.stats();
            restore_ms = (
                st.restore_ms_last,
                st.checksum_ms_last,
                st.checksum_wait_ms_last,
            );
            (Session::with_caches(m.as_ref(), &opts, caches), usable)
        }
        other => bail!("unknown restart leg `{other}`"),
    };
    let times = engine::generate::bench::token_times(&mut session, ids, cached, max_tokens)?;
    let (ttft, after_first, span) = engine::generate::bench::token_timing(start, &times);
    Ok(RestartLeg {
        mode: mode.into(),
        ttft_s: ttft,
        decode_tps: engine::generate::bench::decode_rate(after_first, span),
        restore_ms: restore_ms.0,
        checksum_ms: restore_ms.1,
        checksum_wait_ms: restore_ms.2,
    })
}

fn run_leg(
    mode: &str,
    model: &Path,
    ids_file: &Path,
    max_tokens: usize,
    ssd: &Path,
) -> Result<RestartLeg> {
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.args(["leg-restart", "--mode", mode])
        .arg("--model")
        .arg(model)
        .arg("--prompt-ids")
        .arg(ids_file)
        .arg("--max-tokens")
        .arg(max_tokens.to_string())
        .arg("--ssd")
        .arg(ssd);
    super::run_json_leg(&mut cmd, mode)
}

pub struct RestartResult {
    pub model: &'static str,
    pub prompt_tokens: usize,
    pub fresh: RestartLeg,
    pub restored: RestartLeg,
}

/// Runs `rounds` × (fresh, restored) legs after one store leg; medians.
pub fn run(
    model: super::models::BenchModel,
    prompt_tokens: usize,
    max_tokens: usize,
    rounds: usize,
) -> Result<RestartResult> {
    let dir = model.ensure()?;
    let tmp = tempfile::tempdir()?;
    let ids = super::prompt_ids(prompt_tokens, model.vocab, model.seed);
    let ids_file: PathBuf = tmp.path().join("ids.json");
    std::fs::write(&ids_file, serde_json::to_string(&ids)?)?;
    let ssd = tmp.path().join("ssd");
    run_leg("store", &dir, &ids_file, max_tokens, &ssd)?;
    let order = super::leg_order(rounds, &["fresh", "restored"]);
    let bar = indicatif::ProgressBar::new(order.len() as u64);
    let mut legs = Vec::new();
    for mode in order {
        legs.push(run_leg(mode, &dir, &ids_file, max_tokens, &ssd)?);
        bar.inc(1);
    }
    bar.finish_and_clear();
    let med = |mode: &str| {
        let mine: Vec<&RestartLeg> = legs.iter().filter(|l| l.mode == mode).collect();
        RestartLeg {
            mode: mode.into(),
            ttft_s: median(mine.iter().map(|l| l.ttft_s).collect()),
            decode_tps: median(mine.iter().map(|l| l.decode_tps).collect()),
            restore_ms: median(mine.iter().map(|l| l.restore_ms).collect()),
            checksum_ms: median(mine.iter().map(|l| l.checksum_ms).collect()),
            checksum_wait_ms: median(mine.iter().map(|l| l.checksum_wait_ms).collect()),
        }
    };
    Ok(RestartResult {
        model: model.name,
        prompt_tokens,
        fresh: med("fresh"),
        restored: med("restored"),
    })
}

impl RestartResult {
    pub fn rows(&self) -> Vec<(&'static str, f64, &'static str)> {
        let pct = 100.0 * self.restored.ttft_s / self.fresh.ttft_s;
        let overhead = 100.0 * (1.0 - self.restored.decode_tps / self.fresh.decode_tps);
        vec![
            ("ttft_ms_full_prefill", self.fresh.ttft_s * 1e3, "ms"),
            ("ttft_ms_restored", self.restored.ttft_s * 1e3, "ms"),
            ("restored_ttft_pct_of_full", pct, "%"),
            ("decode_tps_ssd_off", self.fresh.decode_tps, "tok/s"),
            ("decode_tps_ssd_on", self.restored.decode_tps, "tok/s"),
            ("decode_overhead_pct", overhead, "%"),
            ("restore_ms", self.restored.restore_ms, "ms"),
            ("restore_checksum_ms", self.restored.checksum_ms, "ms"),
            (
                "restore_checksum_wait_ms",
                self.restored.checksum_wait_ms,
                "ms",
            ),
            (
                "restore_checksum_wait_pct_of_restore",
                100.0 * self.restored.checksum_wait_ms / self.restored.restore_ms,
                "%",
            ),
        ]
    }
}
