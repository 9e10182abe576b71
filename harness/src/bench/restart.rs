//! `harness bench --suite restart`: what the SSD tier buys after a restart. On the `small`
//! bench model with a long prompt, each leg is a fresh process: "fresh" prefills the whole
//! prompt and decodes; "store" prefills and writes the caches to a kv-store directory
//! (untimed); "restored" opens that store as a restarted server would, restores the prefix,
//! feeds the last prompt token and decodes. TTFT counts from the start of the request (for
//! "restored": the store lookup, the file read and the restore included). The restored
//! legs also report the restore's own time, the always-on tensor checksums' hashing time
//! (on their own thread, overlapped with the copy into MLX) and what the restore waited
//! for them: the wall time the check adds. `--restart-via server` runs the same legs through
//! `engine serve` over HTTP instead (`restart/server.rs`: a client's TTFT, a bench model variant
//! that admits long prompts, optionally a kv_config). Every run is judged against the exit
//! criteria (`criteria`).

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

mod server;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RestartLeg {
    pub mode: String,
    pub ttft_s: f64,
    pub decode_tps: f64,
    /// Through the server: its CPU time per decoded token (all threads), a measure that
    /// other load inflates far less than `decode_tps`; None in-process.
    #[serde(default)]
    pub decode_cpu_ms_per_token: Option<f64>,
    /// "restored": the store's restore (read, checks, rebuild); the always-on tensor
    /// checksums' hashing time (on their own thread, overlapped with the copy) and the wall
    /// time the restore waited for them.
    #[serde(default)]
    pub restore_ms: f64,
    #[serde(default)]
    pub checksum_ms: f64,
    #[serde(default)]
    pub checksum_wait_ms: f64,
    /// In-process legs: the one-token steps that ran through the compiled graph (the
    /// `WherePays` probe picks per session: a leg that decoded eagerly says so here).
    #[serde(default)]
    pub compiled_steps: Option<usize>,
    /// Through the server: the minor page faults its process took per decoded token (a
    /// leg whose allocations miss the allocator's free memory faults fresh pages in).
    #[serde(default)]
    pub minor_faults_per_token: Option<f64>,
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
                decode_cpu_ms_per_token: None,
                restore_ms: 0.0,
                checksum_ms: 0.0,
                checksum_wait_ms: 0.0,
                compiled_steps: None,
                minor_faults_per_token: None,
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
        decode_cpu_ms_per_token: None,
        restore_ms: restore_ms.0,
        checksum_ms: restore_ms.1,
        checksum_wait_ms: restore_ms.2,
        compiled_steps: Some(session.compiled_steps()),
        minor_faults_per_token: None,
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
    /// Every leg's `decode_tps` and `ttft_ms` (stacks "fresh" and "restored"), as they ran.
    pub kept: super::kept::Kept,
}

/// How the restart suite runs its legs.
pub struct RestartOptions {
    pub model: super::models::BenchModel,
    pub prompt_tokens: usize,
    pub max_tokens: usize,
    pub rounds: usize,
    /// Through `engine serve` over HTTP (else in-process sessions, `harness leg-restart`).
    pub server: bool,
    /// The servers' `--kv-config` (quantized KV caches, stored and restored quantized).
    pub kv_config: Option<PathBuf>,
}

impl RestartOptions {
    /// The model the legs load: through the server, the variant that admits the prompt.
    pub fn served_model(&self) -> super::models::BenchModel {
        if self.server {
            // The prompt, the answer and the warm-up's margin.
            self.model
                .long_context(self.prompt_tokens + self.max_tokens + 16)
        } else {
            self.model
        }
    }
}

/// The kv_config legs' `--quantized-kv-start`: each cache converts once it holds the
/// prompt but its last token (after the last prefill chunk, as generate_step's hook does),
/// so the prompt is prefilled dense and the last token, the decode and the stored entry are
/// quantized. From the start (optiq's default 0) every prefill chunk would attend through
/// MLX's CPU `quantized_matmul`, which accumulates in the activation dtype one element at a
/// time: 16-19x the dense matmul's time at these shapes, so a 16k prefill takes most of
/// an hour (in mlx-lm as in the engine: the same kernel).
pub fn kv_start(prompt_tokens: usize) -> i32 {
    prompt_tokens.saturating_sub(1) as i32
}

/// Runs the store leg, then `rounds` × (fresh, restored) legs ABBA; medians.
pub fn run(opts: &RestartOptions) -> Result<RestartResult> {
    let model = opts.served_model();
    let progress = super::Progress::new("restart", 1 + 2 * opts.rounds);
    progress.start(format!("{} · preparing the bench model", model.name));
    let dir = model.ensure()?;
    let tmp = tempfile::tempdir()?;
    let ids = super::prompt_ids(opts.prompt_tokens, model.vocab, model.seed);
    let ids_file: PathBuf = tmp.path().join("ids.json");
    std::fs::write(&ids_file, serde_json::to_string(&ids)?)?;
    let ssd = tmp.path().join("ssd");
    let order = super::leg_order(opts.rounds, &["fresh", "restored"]);
    let prompt = super::models::prompt_text(&ids);
    // Warm-up ids start with another id than the prompt, so they never restore anything.
    let warmup = super::models::prompt_text(&[(ids[0] + 1) % model.vocab as u32, 1, 2, 3]);
    let server = server::ServerLegs {
        model: &dir,
        kv_config: opts.kv_config.as_deref(),
        kv_start: kv_start(opts.prompt_tokens),
        prompt: &prompt,
        warmup: &warmup,
        max_tokens: opts.max_tokens,
        ssd: &ssd,
        logs: tmp.path(),
    };
    if opts.server {
        model.ensure_tokenizer(&dir)?;
    }
    let what = |mode: &str| format!("{} · prompt {} · {mode}", model.name, opts.prompt_tokens);
    progress.start(what("store"));
    if opts.server {
        server::store(&server)?;
    } else {
        run_leg("store", &dir, &ids_file, opts.max_tokens, &ssd)?;
    }
    progress.done();
    let mut legs = Vec::new();
    for (n, mode) in order.into_iter().enumerate() {
        progress.start(what(mode));
        legs.push(if opts.server {
            server::leg(&server, mode, n)?
        } else {
            run_leg(mode, &dir, &ids_file, opts.max_tokens, &ssd)?
        });
        progress.done();
    }
    progress.finish();
    let mut kept = super::kept::Kept::default();
    for l in &legs {
        let compiled = l
            .compiled_steps
            .map(|n| ("compiled_steps".to_owned(), n as f64));
        let faults = l
            .minor_faults_per_token
            .map(|f| ("minor_faults_per_token".to_owned(), f));
        kept.push(
            &l.mode,
            [
                ("decode_tps".to_owned(), l.decode_tps),
                ("ttft_ms".to_owned(), l.ttft_s * 1e3),
            ]
            .into_iter()
            .chain(compiled)
            .chain(faults),
        );
    }
    let med = |mode: &str| {
        let mine: Vec<&RestartLeg> = legs.iter().filter(|l| l.mode == mode).collect();
        RestartLeg {
            mode: mode.into(),
            ttft_s: median(mine.iter().map(|l| l.ttft_s).collect()),
            decode_tps: median(mine.iter().map(|l| l.decode_tps).collect()),
            decode_cpu_ms_per_token: mine
                .iter()
                .map(|l| l.decode_cpu_ms_per_token)
                .collect::<Option<Vec<f64>>>()
                .map(median),
            restore_ms: median(mine.iter().map(|l| l.restore_ms).collect()),
            checksum_ms: median(mine.iter().map(|l| l.checksum_ms).collect()),
            checksum_wait_ms: median(mine.iter().map(|l| l.checksum_wait_ms).collect()),
            compiled_steps: mine.iter().filter_map(|l| l.compiled_steps).min(),
            minor_faults_per_token: mine
                .iter()
                .map(|l| l.minor_faults_per_token)
                .collect::<Option<Vec<f64>>>()
                .map(median),
        }
    };
    Ok(RestartResult {
        model: model.name,
        prompt_tokens: opts.prompt_tokens,
        fresh: med("fresh"),
        restored: med("restored"),
        kept,
    })
}

/// One exit criterion: (what, measured, limit, passed).
pub type Criterion = (&'static str, String, &'static str, bool);

/// The seed's exit criteria for the SSD tier (issue 23: restored TTFT < 2.5 s and at most
/// 10 % of a full prefill; decode after a restore less than 2 % slower).
pub fn criteria(r: &RestartResult) -> Vec<Criterion> {
    let restored = r.restored.ttft_s;
    let pct = 100.0 * restored / r.fresh.ttft_s;
    let overhead = 100.0 * (1.0 - r.restored.decode_tps / r.fresh.decode_tps);
    vec![
        (
            "restored TTFT",
            format!("{:.0} ms", restored * 1e3),
            "< 2500 ms",
            restored < 2.5,
        ),
        (
            "restored TTFT / full prefill",
            format!("{pct:.1} %"),
            "<= 10 %",
            pct <= 10.0,
        ),
        (
            "decode overhead after a restore",
            format!("{overhead:.1} %"),
            "< 2 %",
            overhead < 2.0,
        ),
    ]
}

impl RestartResult {
    /// A row's parameters: decode rows keep their legs, and the decode overhead the interval
    /// of restored / fresh decode over paired rounds.
    pub fn row_params(&self, params: serde_json::Value, metric: &str) -> serde_json::Value {
        let k = &self.kept;
        match metric {
            "decode_tps_ssd_off" => k.row_params(params, "fresh", None, "decode_tps"),
            "decode_tps_ssd_on" | "decode_overhead_pct" => {
                k.row_params(params, "restored", Some("fresh"), "decode_tps")
            }
            _ => params,
        }
    }

    /// The decode figures in words (restored against fresh).
    pub fn words(&self) -> String {
        let mut s = self
            .kept
            .lines(&[("decode_tps", "tok/s", true)], "restored", Some("fresh"));
        // Which decode path each in-process leg took (the compiled step's probe decides per
        // session): a decode overhead with one side eager is that, not the restore.
        let steps = |mode| self.kept.values(mode, "compiled_steps");
        let (fresh, restored) = (steps("fresh"), steps("restored"));
        if !fresh.is_empty() || !restored.is_empty() {
            s.push_str(&format!(
                "compiled decode steps per leg: fresh {fresh:?}, restored {restored:?}\n"
            ));
        }
        let faults = |mode| self.kept.values(mode, "minor_faults_per_token");
        let (fresh, restored) = (faults("fresh"), faults("restored"));
        if !fresh.is_empty() || !restored.is_empty() {
            s.push_str(&format!(
                "minor page faults per decoded token: fresh {fresh:.0?}, restored {restored:.0?}\n"
            ));
        }
        s
    }

    pub fn rows(&self) -> Vec<(&'static str, f64, &'static str)> {
        let passed = criteria(self).iter().filter(|c| c.3).count() as f64;
        let mut rows = self.measured();
        rows.push(("exit_criteria_passed", passed, "/3"));
        // Where a stack does not report a number (the server's checksum wait), no row.
        rows.retain(|r| r.1.is_finite());
        rows
    }

    fn measured(&self) -> Vec<(&'static str, f64, &'static str)> {
        let pct = 100.0 * self.restored.ttft_s / self.fresh.ttft_s;
        let overhead = 100.0 * (1.0 - self.restored.decode_tps / self.fresh.decode_tps);
        vec![
            ("ttft_ms_full_prefill", self.fresh.ttft_s * 1e3, "ms"),
            ("ttft_ms_restored", self.restored.ttft_s * 1e3, "ms"),
            ("restored_ttft_pct_of_full", pct, "%"),
            ("decode_tps_ssd_off", self.fresh.decode_tps, "tok/s"),
            ("decode_tps_ssd_on", self.restored.decode_tps, "tok/s"),
            ("decode_overhead_pct", overhead, "%"),
            (
                "decode_cpu_ms_per_token_ssd_off",
                self.fresh.decode_cpu_ms_per_token.unwrap_or(f64::NAN),
                "ms",
            ),
            (
                "decode_cpu_ms_per_token_ssd_on",
                self.restored.decode_cpu_ms_per_token.unwrap_or(f64::NAN),
                "ms",
            ),
            (
                "decode_cpu_overhead_pct",
                100.0
                    * (self.restored.decode_cpu_ms_per_token.unwrap_or(f64::NAN)
                        / self.fresh.decode_cpu_ms_per_token.unwrap_or(f64::NAN)
                        - 1.0),
                "%",
            ),
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

#[cfg(test)]
mod tests {
    use super::*;

    fn leg(mode: &str, tps: f64, cpu: Option<f64>) -> RestartLeg {
        RestartLeg {
            mode: mode.into(),
            ttft_s: if mode == "fresh" { 100.0 } else { 0.3 },
            decode_tps: tps,
            decode_cpu_ms_per_token: cpu,
            restore_ms: 10.0,
            checksum_ms: 1.0,
            checksum_wait_ms: 0.0,
            compiled_steps: None,
            minor_faults_per_token: None,
        }
    }

    fn result(cpu: (Option<f64>, Option<f64>)) -> RestartResult {
        RestartResult {
            model: "tiny",
            prompt_tokens: 16384,
            fresh: leg("fresh", 20.0, cpu.0),
            restored: leg("restored", 19.8, cpu.1),
            kept: Default::default(),
        }
    }

    #[test]
    fn cpu_rows_only_where_measured_and_kv_start_is_the_prompt_less_one() {
        let names = |r: &RestartResult| -> Vec<&str> { r.rows().iter().map(|r| r.0).collect() };
        let in_process = result((None, None));
        assert!(!names(&in_process).contains(&"decode_cpu_overhead_pct"));
        let server = result((Some(50.0), Some(51.0)));
        let rows = server.rows();
        let cpu = rows
            .iter()
            .find(|r| r.0 == "decode_cpu_overhead_pct")
            .unwrap();
        assert!((cpu.1 - 2.0).abs() < 1e-9, "{}", cpu.1);
        assert_eq!(
            rows.iter()
                .find(|r| r.0 == "exit_criteria_passed")
                .unwrap()
                .1,
            3.0
        );
        assert_eq!(kv_start(16384), 16383);
        assert_eq!(kv_start(0), 0);
    }
}
