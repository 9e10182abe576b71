//! The distributed L1 gate: two ranks of `harness dist-rank l1` on loopback (MLX's ring
//! backend, each with `MLX_RANK` and a hostfile as `mlx.launch` gives them), each holding its
//! part of a tiny model (tensor parallel, or pipeline parallel for the `pp` goldens), must
//! reproduce mlx-lm's sharded generation (`goldens/l1-dist/<tp|pp>/<model>`, from
//! `oracles/gen_l1_dist.py`) bit for bit: every stored logit vector, every greedy id. Both
//! exit statuses are checked; every run is bounded and both ranks are killed past it. The
//! planted defects `DistShardWrongRank`, `DistReduceDropped` and `GdnConvShardUnsegmented`
//! (ENGINE_PLANT in the ranks' environment) must make it fail, as must the MLA ones
//! (`MlaHeadsOfOtherRank`, deepseek_v32's `IndexerShardedByHeads`).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// Past this a run's ranks are killed and the test fails (two ranks share 2 cores), plus
/// [`PER_GOLDEN`] for each golden the run checks (one takes ~1–4 s here).
const DEADLINE: Duration = Duration::from_secs(240);
const PER_GOLDEN: Duration = Duration::from_secs(60);

fn goldens() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../goldens")
}

/// Ports nobody listens on now: bound together (so they differ), then released.
fn free_ports(n: usize) -> Vec<u16> {
    let listeners: Vec<std::net::TcpListener> = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    listeners
        .iter()
        .map(|l| l.local_addr().unwrap().port())
        .collect()
}

/// What each rank left: its exit status, stdout and stderr.
struct Rank {
    status: ExitStatus,
    stdout: String,
    stderr: String,
}

/// The ranks of one run; those still running when it is dropped (a panic, a deadline) are
/// killed, by their own pids.
struct Ranks(Vec<Child>);

impl Drop for Ranks {
    fn drop(&mut self) {
        for child in &mut self.0 {
            if child.try_wait().ok().flatten().is_none() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}

impl Ranks {
    /// Waits for every rank, polling until `deadline`; past it, kills them all.
    fn wait(mut self, what: &str, logs: &Path, deadline: Duration) -> Vec<ExitStatus> {
        let end = Instant::now() + deadline;
        loop {
            let done: Vec<Option<ExitStatus>> = self
                .0
                .iter_mut()
                .map(|c| c.try_wait().expect("polling a rank"))
                .collect();
            if done.iter().all(Option::is_some) {
                return done.into_iter().flatten().collect();
            }
            if Instant::now() >= end {
                drop(self);
                let log = |r: usize| {
                    std::fs::read_to_string(logs.join(format!("r{r}.err"))).unwrap_or_default()
                };
                panic!(
                    "{what}: still running after {deadline:?}, both ranks killed\n\
                     rank 0 stderr:\n{}\nrank 1 stderr:\n{}",
                    log(0),
                    log(1)
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Two ranks of `harness dist-rank l1 --golden GOLDEN… ARGS…`, with `plant` (a defect's
/// name) in their ENGINE_PLANT.
fn run_ranks(goldens: &[&str], args: &[&str], plant: Option<&str>) -> Vec<Rank> {
    let tmp = tempfile::tempdir().unwrap();
    let hosts: Vec<Vec<String>> = free_ports(2)
        .into_iter()
        .map(|p| vec![format!("127.0.0.1:{p}")])
        .collect();
    let hostfile = tmp.path().join("hosts.json");
    std::fs::write(&hostfile, serde_json::to_string(&hosts).unwrap()).unwrap();
    let mut children = Ranks(Vec::new());
    for rank in 0..2 {
        let file = |ext: &str| std::fs::File::create(tmp.path().join(format!("r{rank}.{ext}")));
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_harness"));
        cmd.args(["dist-rank", "l1"])
            .args(goldens.iter().flat_map(|g| ["--golden", g]))
            .args(["--dist-connect-timeout", "60", "--dist-timeout", "120"])
            .args(args)
            .env("MLX_RANK", rank.to_string())
            .env("MLX_HOSTFILE", &hostfile)
            .env_remove("ENGINE_PLANT")
            .stdin(Stdio::null())
            .stdout(file("out").unwrap())
            .stderr(file("err").unwrap());
        if let Some(p) = plant {
            cmd.env("ENGINE_PLANT", p);
        }
        children.0.push(cmd.spawn().expect("starting a rank"));
    }
    let deadline = DEADLINE + PER_GOLDEN * goldens.len() as u32;
    let statuses = children.wait(&goldens.join(" "), tmp.path(), deadline);
    statuses
        .into_iter()
        .enumerate()
        .map(|(r, status)| {
            let read = |ext: &str| {
                std::fs::read_to_string(tmp.path().join(format!("r{r}.{ext}"))).unwrap()
            };
            Rank {
                status,
                stdout: read("out"),
                stderr: read("err"),
            }
        })
        .collect()
}

/// Rank 0's verdict lines, one per golden of `goldens` in order, after checking both
/// statuses: rank 1 exits 0 and prints nothing, rank 0 exits 0 when every golden passed and 1
/// when one failed.
fn verdicts(goldens: &[&str], ranks: &[Rank]) -> Vec<Value> {
    let what = goldens.join(" ");
    let show = || {
        ranks
            .iter()
            .enumerate()
            .map(|(r, k)| format!("rank {r}: {}\n{}{}", k.status, k.stdout, k.stderr))
            .collect::<Vec<_>>()
            .join("\n")
    };
    assert!(
        ranks[1].status.success() && ranks[1].stdout.is_empty(),
        "{what}: rank 1\n{}",
        show()
    );
    // Verdict lines only (anything else rank 0 may print is not one); one per golden.
    let verdicts: Vec<Value> = (ranks[0].stdout.lines())
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .filter(|v| v["gate"] == "l1-dist")
        .collect();
    let named: Vec<&str> = verdicts
        .iter()
        .map(|v| v["golden"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(
        named,
        goldens,
        "{what}: the verdicts name other goldens\n{}",
        show()
    );
    let passed = verdicts
        .iter()
        .all(|v| v["passed"].as_bool().expect("passed"));
    let want = if passed { 0 } else { 1 };
    assert_eq!(ranks[0].status.code(), Some(want), "{what}\n{}", show());
    verdicts
}

/// The one verdict of a run on `golden` alone.
fn verdict(golden: &str, ranks: &[Rank]) -> Value {
    verdicts(&[golden], ranks).remove(0)
}

/// Why the gate on `golden` does not pass (every logit vector bit-exact, max |Δ| 0, and every
/// greedy id), or None when it does, from its verdict `v`.
fn bit_exact_failure(golden: &str, v: &Value) -> Option<String> {
    println!("{}", v["summary"]);
    if !(v["passed"] == true && v["max_abs_diff"] == 0.0) {
        return Some(format!("{golden}: {}\n{:#}", v["summary"], v["details"]));
    }
    let counts = &v["counts"];
    ["logit_vectors_bit_exact", "greedy_ids_identical"]
        .into_iter()
        .find(|m| counts[m][0] != counts[m][1] || counts[m][1].as_u64() == Some(0))
        .map(|m| format!("{golden}: {m} {} of {}", counts[m][0], counts[m][1]))
}

/// The gate on `golden` with the planted defect fails, from the first logit vector of a case.
fn assert_plant_fails(golden: &str, plant: &str) {
    let v = verdict(golden, &run_ranks(&[golden], &[], Some(plant)));
    println!("{plant}: {}", v["summary"]);
    assert_eq!(
        v["passed"], false,
        "{golden} with {plant}: {}",
        v["summary"]
    );
    let cases = v["cases"].as_array().unwrap();
    assert!(
        cases.iter().any(|c| c["first_inexact_step"] == 0),
        "{golden} with {plant}: no case differs at step 0: {:#}",
        v["details"]
    );
}

/// Every distributed golden (the manifest's `l1-dist-tp` / `l1-dist-pp` rows) passes: one
/// pair of ranks runs every tensor-parallel golden in turn, another every pipeline one;
/// every failure is reported, not only the first.
#[test]
fn every_l1_dist_golden_is_bit_exact() {
    let goldens = harness::parity::gates::l1_dist_goldens();
    let mut failed = Vec::new();
    for mode in harness::parity::gates::L1_DIST_MODES {
        let prefix = format!("l1-dist/{mode}/");
        let run: Vec<&str> = (goldens.iter())
            .filter(|g| g.starts_with(&prefix))
            .map(String::as_str)
            .collect();
        if run.is_empty() {
            continue;
        }
        let verdicts = verdicts(&run, &run_ranks(&run, &[], None));
        failed.extend((run.iter().zip(&verdicts)).filter_map(|(g, v)| bit_exact_failure(g, v)));
    }
    assert!(
        failed.is_empty(),
        "distributed L1 failed:\n{}",
        failed.join("\n")
    );
    assert!(
        goldens.len() >= 24,
        "the distributed L1 lost goldens: {goldens:?}"
    );
}

/// Every committed golden of the distributed L1 is one the registry lists (and so the test
/// above runs it), and every one it lists is committed.
#[test]
fn every_l1_dist_golden_is_gated() {
    let registered = harness::parity::gates::l1_dist_goldens();
    let mut committed = Vec::new();
    for mode in harness::parity::gates::L1_DIST_MODES {
        for entry in std::fs::read_dir(goldens().join("l1-dist").join(mode))
            .into_iter()
            .flatten()
            .flatten()
        {
            if entry.path().is_dir() {
                committed.push(format!(
                    "l1-dist/{mode}/{}",
                    entry.file_name().to_string_lossy()
                ));
            }
        }
    }
    let missing: Vec<&String> = committed
        .iter()
        .filter(|c| !registered.contains(c))
        .collect();
    assert!(
        missing.is_empty(),
        "goldens no manifest row gates: {missing:?}"
    );
    let absent: Vec<&String> = registered
        .iter()
        .filter(|r| !committed.contains(r))
        .collect();
    assert!(absent.is_empty(), "gated but not committed: {absent:?}");
}

#[test]
fn planted_wrong_rank_slice_fails_tp() {
    assert_plant_fails("l1-dist/tp/tiny-llama", "DistShardWrongRank");
}

#[test]
fn planted_reversed_stages_fail_pp() {
    assert_plant_fails("l1-dist/pp/tiny-qwen2", "DistShardWrongRank");
}

#[test]
fn planted_dropped_all_sum_fails_tp() {
    assert_plant_fails("l1-dist/tp/tiny-llama", "DistReduceDropped");
}

/// The sparse block's all_sum after the experts are combined is dropped too.
#[test]
fn planted_dropped_all_sum_fails_tp_moe() {
    assert_plant_fails("l1-dist/tp/tiny-qwen3-moe", "DistReduceDropped");
}

/// glm4_moe with the all_sums dropped (the attention's and the block's after routed +
/// shared experts) fails.
#[test]
fn planted_dropped_all_sum_fails_tp_glm4_moe() {
    assert_plant_fails("l1-dist/tp/tiny-glm4-moe", "DistReduceDropped");
}

/// glm4_moe's pipeline with its stages reversed fails.
#[test]
fn planted_reversed_stages_fail_pp_glm4_moe() {
    assert_plant_fails("l1-dist/pp/tiny-glm4-moe", "DistShardWrongRank");
}

/// The gated delta net's conv kernel cut as one block, not per [q | k | v] segment: its
/// channels no longer meet in_proj_qkv's. Run after tiny-llama (no delta net) in the same
/// group, as the whole gate runs them: the failure is qwen3_5's alone, llama still passes.
#[test]
fn planted_unsegmented_conv_shard_fails_tp_gated_delta_net() {
    let run = ["l1-dist/tp/tiny-llama", "l1-dist/tp/tiny-qwen3-5"];
    let v = verdicts(&run, &run_ranks(&run, &[], Some("GdnConvShardUnsegmented")));
    assert_eq!(bit_exact_failure(run[0], &v[0]), None);
    assert_eq!(v[1]["passed"], false, "{}", v[1]["summary"]);
}

/// One group runs goldens of one mode: a tensor and a pipeline golden together are refused
/// before any rank joins a group, naming both.
#[test]
fn goldens_of_two_modes_are_refused_together() {
    let out = Command::new(env!("CARGO_BIN_EXE_harness"))
        .args(["dist-rank", "l1", "--golden", "l1-dist/tp/tiny-llama"])
        .args(["--golden", "l1-dist/pp/tiny-qwen2"])
        .env_remove("MLX_RANK")
        .env_remove("MLX_HOSTFILE")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("l1-dist/tp/tiny-llama") && stderr.contains("l1-dist/pp/tiny-qwen2"),
        "{stderr}"
    );
}

/// One K/V head over two ranks: each rank's half of the head, repeated after the split,
/// instead of the whole head repeated before it (mlx-lm's `repeat_kv_layer_inplace`).
#[test]
fn planted_kv_repeat_after_the_split_fails_tp_with_more_ranks_than_kv_heads() {
    assert_plant_fails("l1-dist/tp/tiny-qwen3-5-kv1", "KvRepeatAfterShard");
}

/// qwen3_5_moe with every tensor-parallel all_sum dropped (the delta nets' after out_proj, the
/// attention's, and the shared-expert block's after routed + shared) fails.
#[test]
fn planted_dropped_all_sum_fails_tp_shared_expert_moe() {
    assert_plant_fails("l1-dist/tp/tiny-qwen3-5-moe", "DistReduceDropped");
}

/// Multi-head latent attention: `embed_q` / `unembed_out` keeping the next rank's heads
/// (their latent expansion meets the other heads' queries) fails.
#[test]
fn planted_mla_heads_of_the_other_rank_fail_tp() {
    assert_plant_fails("l1-dist/tp/tiny-deepseek-v3", "MlaHeadsOfOtherRank");
}

/// deepseek_v3's stages reversed (3 layers: rank 0 runs layer 0 last) fails.
#[test]
fn planted_reversed_stages_fail_pp_mla() {
    assert_plant_fails("l1-dist/pp/tiny-deepseek-v3", "DistShardWrongRank");
}

/// deepseek_v3 with every tensor-parallel all_sum dropped (o_proj's, the dense MLP's, and
/// the sparse block's after routed + shared) fails.
#[test]
fn planted_dropped_all_sum_fails_tp_mla() {
    assert_plant_fails("l1-dist/tp/tiny-deepseek-v3", "DistReduceDropped");
}

/// minimax's q/k norms over all heads, each rank normalizing only its own features (no sum
/// of squares over the ranks, as mlx-lm's `ShardedRMSNorm` takes), fail.
#[test]
fn planted_per_rank_sharded_norm_fails_tp_minimax() {
    assert_plant_fails("l1-dist/tp/tiny-minimax", "ShardedNormPerRank");
}

/// minimax with its all_sums dropped (o_proj's, and the sparse block's after the experts are
/// weighed) fails.
#[test]
fn planted_dropped_all_sum_fails_tp_minimax() {
    assert_plant_fails("l1-dist/tp/tiny-minimax", "DistReduceDropped");
}

/// ministral3 (Llama's split under the scaled, partly sliding attention) with o_proj keeping
/// the other rank's slice fails.
#[test]
fn planted_wrong_rank_slice_fails_tp_ministral3() {
    assert_plant_fails("l1-dist/tp/tiny-ministral3", "DistShardWrongRank");
}

/// ministral3's pipeline with its stages reversed (sliding and full layers on each) fails.
#[test]
fn planted_reversed_stages_fail_pp_ministral3() {
    assert_plant_fails("l1-dist/pp/tiny-ministral3", "DistShardWrongRank");
}

/// glm4_moe_lite (deepseek_v3's split, its shared expert optional) with its all_sums dropped
/// fails.
#[test]
fn planted_dropped_all_sum_fails_tp_glm4_moe_lite() {
    assert_plant_fails("l1-dist/tp/tiny-glm4-moe-lite", "DistReduceDropped");
}

/// glm4_moe_lite's stages reversed fails.
#[test]
fn planted_reversed_stages_fail_pp_glm4_moe_lite() {
    assert_plant_fails("l1-dist/pp/tiny-glm4-moe-lite", "DistShardWrongRank");
}

/// deepseek_v32 with its indexer split by heads like the attention (mlx-lm keeps it whole:
/// each rank then picks other positions) fails.
#[test]
fn planted_indexer_sharded_by_heads_fails_tp_deepseek_v32() {
    assert_plant_fails("l1-dist/tp/tiny-deepseek-v32", "IndexerShardedByHeads");
}

/// deepseek_v32's stages reversed (each layer's cache a [latent, indexer keys] list) fails.
#[test]
fn planted_reversed_stages_fail_pp_deepseek_v32() {
    assert_plant_fails("l1-dist/pp/tiny-deepseek-v32", "DistShardWrongRank");
}

/// kimi_k25 (the plain `q_proj` split by columns) with `embed_q` / `unembed_out` keeping the
/// other rank's heads fails.
#[test]
fn planted_mla_heads_of_the_other_rank_fail_tp_kimi_k25() {
    assert_plant_fails("l1-dist/tp/tiny-kimi-k25", "MlaHeadsOfOtherRank");
}

/// kimi_k25's stages reversed (the text model under `language_model`) fails.
#[test]
fn planted_reversed_stages_fail_pp_kimi_k25() {
    assert_plant_fails("l1-dist/pp/tiny-kimi-k25", "DistShardWrongRank");
}

/// Two ranks of tiny-llama against the single-process golden of another model
/// (tiny-llama-trained: the same tokenizer and vocabulary, other sizes and weights) fail.
#[test]
fn another_models_golden_fails() {
    let model = harness::goldens::model_dir("tiny-llama").unwrap();
    let model = model.to_str().unwrap();
    let golden = "l1/tiny-llama-trained";
    let v = verdict(golden, &run_ranks(&[golden], &["--model", model], None));
    assert_eq!(v["passed"], false, "{}", v["summary"]);
    assert_eq!(v["mode"], "tensor");
}

/// The same gate with the ranks started by MLX's own launcher (`mlx.launch --backend ring
/// -n 2`, from the oracle venv). Ignored by default: `cargo test` never needs Python. Run it
/// with `cargo test -p harness --test it l1_dist:: -- --ignored`.
#[test]
#[ignore = "needs the oracle venv's mlx.launch (Python): run with --ignored"]
fn mlx_launch_runs_the_gate() {
    let launch = harness::oracle::venv_dir().join("bin/mlx.launch");
    if !launch.is_file() {
        eprintln!(
            "SKIPPED mlx_launch_runs_the_gate: no {} (create the venv with `bash \
             oracles/setup.sh`)",
            launch.display()
        );
        return;
    }
    let port = consecutive_free_ports();
    let golden = "l1-dist/tp/tiny-llama";
    let mut cmd = Command::new(&launch);
    cmd.args([
        "--backend",
        "ring",
        "-n",
        "2",
        "-p",
        &port.to_string(),
        "--",
    ])
    .arg(env!("CARGO_BIN_EXE_harness"))
    .args(["dist-rank", "l1", "--golden", golden])
    .args(["--dist-connect-timeout", "60", "--dist-timeout", "120"])
    .env_remove("ENGINE_PLANT")
    .stdin(Stdio::null());
    // Its own process group, so that a deadline ends the launcher and both ranks.
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    let out = output_within(cmd, DEADLINE + PER_GOLDEN);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    // mlx.launch exits 0 even when a rank fails; it says so on stderr.
    assert!(
        !stderr.contains("exited with code") && !stderr.contains("was killed"),
        "a rank failed:\n{stdout}\n{stderr}"
    );
    let line = stdout.lines().last().unwrap_or_default();
    let v: Value = serde_json::from_str(line)
        .unwrap_or_else(|e| panic!("no verdict ({e}):\n{stdout}\n{stderr}"));
    assert!(v["passed"] == true && v["ranks"] == 2, "{}", v["summary"]);
    println!("mlx.launch: {}", v["summary"]);
}

/// A port P with P + 1 free as well (mlx.launch's ring listens on P, P + 1, …).
fn consecutive_free_ports() -> u16 {
    (0..100)
        .find_map(|_| {
            let a = std::net::TcpListener::bind("127.0.0.1:0").ok()?;
            let p = a.local_addr().ok()?.port();
            let _b = std::net::TcpListener::bind(("127.0.0.1", p.checked_add(1)?)).ok()?;
            Some(p)
        })
        .expect("no two consecutive free ports")
}

/// Runs `cmd` (the leader of its own process group) to the end, or kills the group at
/// `limit` and fails.
fn output_within(mut cmd: Command, limit: Duration) -> std::process::Output {
    let child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pgid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(limit) {
        Ok(out) => out.unwrap(),
        Err(_) => {
            let _ = Command::new("kill")
                .args(["-KILL", "--", &format!("-{pgid}")])
                .status();
            panic!("mlx.launch still running after {limit:?}: its process group was killed");
        }
    }
}
