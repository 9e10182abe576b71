//! Tensor parallel on the MoE families (qwen3_moe, gpt_oss) against mlx-lm 0.32.2's own
//! sharded generation (`goldens/l1-dist/tp/<model>`, oracles/gen_l1_dist.py): two ranks on
//! loopback (MLX's ring backend, the env mlx.launch gives), each this test binary re-run as
//! one rank; rank 0 runs the L1 check on its part of the model — every stored logit vector
//! bit-exact, every greedy id identical. The families mlx-lm does not shard are refused.
//! Run single-threaded (MLX is not thread-safe).

use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use engine::dist::DistArgs;
use engine::load::template::ChatTemplate;
use engine::load::tokenizer::Tokenizer;
use engine::model::shard::Part;
use harness::goldens::{model_dir, TensorGolden};
use harness::parity::Report;

/// Set in a rank's env: the golden it checks (`l1-dist/tp/tiny-qwen3-moe`).
const RANK_GOLDEN: &str = "DIST_MOE_GOLDEN";
/// How long a pair of ranks may take (two ranks on two cores are slow).
const RANKS_TIMEOUT: Duration = Duration::from_secs(400);

/// One rank (only when re-run by `two_ranks`; a no-op otherwise): loads its part of the
/// golden's model and checks every case; rank 0 prints `RESULT passed|failed` and the
/// report.
#[test]
fn rank() {
    let Ok(golden) = std::env::var(RANK_GOLDEN) else {
        return;
    };
    engine::plant::on_from_env().expect("ENGINE_PLANT");
    let args = DistArgs {
        dist_connect_timeout: 30.0,
        ..Default::default()
    };
    let group = engine::dist::init(&args).expect("join the group");
    let group = group.expect("a distributed group");
    let golden = TensorGolden::open(&golden).expect("golden");
    let name = golden.index["model"].as_str().unwrap().to_owned();
    let dir = model_dir(name.trim_start_matches("models/")).expect("model");
    let model = engine::model::load(&dir).expect("load and shard");
    let tokenizer = Tokenizer::load(&dir).unwrap();
    let template = ChatTemplate::from_tokenizer(&tokenizer).unwrap();
    let step = golden.index["settings"]["prefill_step_size"]
        .as_u64()
        .unwrap_or(2048) as usize;
    let report = harness::parity::l1::check_model_with(
        &golden,
        model.as_ref(),
        &tokenizer,
        template.as_ref(),
        step,
    )
    .expect("the cases run");
    if group.rank == 0 {
        let verdict = if report.passed() { "passed" } else { "failed" };
        println!("RESULT {verdict} {}", report.summary());
        for line in report.details() {
            println!("DETAIL {line}");
        }
    }
}

/// Two free loopback ports (bound, read, released).
fn free_ports() -> [u16; 2] {
    let a = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let b = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    [
        a.local_addr().unwrap().port(),
        b.local_addr().unwrap().port(),
    ]
}

/// Waits for `child` until `deadline`, killing it past that; its exit status and stdout.
fn finish(mut child: Child, deadline: Instant) -> (Option<i32>, String) {
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut out = String::new();
            child
                .stdout
                .take()
                .unwrap()
                .read_to_string(&mut out)
                .unwrap();
            return (status.code(), out);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return (None, String::new());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Runs `golden` on two ranks; rank 0's report lines. Both ranks must exit 0.
fn two_ranks(golden: &str, plant: Option<&str>) -> Vec<String> {
    let dir = tempfile::tempdir().unwrap();
    let hostfile = dir.path().join("hosts.json");
    let [p0, p1] = free_ports();
    let hosts = format!(r#"[["127.0.0.1:{p0}"],["127.0.0.1:{p1}"]]"#);
    std::fs::write(&hostfile, hosts).unwrap();
    let exe = std::env::current_exe().unwrap();
    let deadline = Instant::now() + RANKS_TIMEOUT;
    let ranks: Vec<Child> = (0..2)
        .map(|r| {
            let mut cmd = Command::new(&exe);
            cmd.args(["rank", "--exact", "--nocapture", "--test-threads=1"])
                .env(RANK_GOLDEN, golden)
                .env("MLX_RANK", r.to_string())
                .env("MLX_HOSTFILE", &hostfile)
                .env_remove("ENGINE_PLANT")
                .stdout(Stdio::piped());
            if let Some(p) = plant {
                cmd.env("ENGINE_PLANT", p);
            }
            cmd.spawn().unwrap()
        })
        .collect();
    let results: Vec<_> = ranks.into_iter().map(|c| finish(c, deadline)).collect();
    for (r, (code, _)) in results.iter().enumerate() {
        assert_eq!(*code, Some(0), "{golden}: rank {r} exited {code:?}");
    }
    let lines: Vec<String> = results[0]
        .1
        .lines()
        // The test runner's `test rank ... ` may lead the first line.
        .filter_map(|l| {
            ["RESULT", "DETAIL"]
                .iter()
                .find_map(|t| l.find(t))
                .map(|i| &l[i..])
        })
        .map(str::to_owned)
        .collect();
    for l in &lines {
        println!("{l}");
    }
    assert!(!lines.is_empty(), "{golden}: rank 0 printed no result");
    lines
}

fn assert_two_ranks_exact(golden: &str) {
    let lines = two_ranks(golden, None);
    assert!(
        lines[0].starts_with("RESULT passed"),
        "{golden}:\n{}",
        lines.join("\n")
    );
}

#[test]
fn tp_tiny_qwen3_moe_is_bit_exact() {
    assert_two_ranks_exact("l1-dist/tp/tiny-qwen3-moe");
}

#[test]
fn tp_tiny_gpt_oss_is_bit_exact() {
    assert_two_ranks_exact("l1-dist/tp/tiny-gpt-oss");
}

/// The sparse block's all_sum dropped (with the row-parallel linears'): the gate fails.
#[test]
fn tp_moe_reduce_dropped_fails() {
    let lines = two_ranks("l1-dist/tp/tiny-qwen3-moe", Some("DistReduceDropped"));
    assert!(
        lines[0].starts_with("RESULT failed"),
        "{}",
        lines.join("\n")
    );
}

/// In one process: build `model` and shard it as rank 0 of 2; the refusal's text.
fn shard_error(model: &str) -> String {
    let dir = model_dir(model).unwrap();
    let config = engine::load::config::ModelConfig::read(&dir).unwrap();
    let weights = engine::load::weights::Weights::load(&dir).unwrap();
    let mut built = engine::model::build(&config, weights).unwrap();
    match built.shard(Part { rank: 0, size: 2 }) {
        Ok(()) => panic!("{model} sharded"),
        Err(e) => e.to_string(),
    }
}

/// mixtral and qwen2_moe: mlx-lm 0.32.2 has no `shard` for them; refused by name.
#[test]
fn unshardable_moe_families_are_refused() {
    for (model, ty) in [("tiny-mixtral", "mixtral"), ("tiny-qwen2-moe", "qwen2_moe")] {
        let e = shard_error(model);
        println!("{model}: {e}");
        assert!(
            e.contains(&format!("`{ty}` cannot run tensor parallel")),
            "{e}"
        );
    }
}

/// Quantized experts whose down projection's input (32) halves below the group size (32):
/// the scales do not split, refused naming the tensor (mlx-lm's split fails too).
#[test]
fn quantized_experts_that_do_not_split_are_refused() {
    for model in ["tiny-qwen3-moe-q4", "tiny-gpt-oss-mxfp4"] {
        let e = shard_error(model);
        println!("{model}: {e}");
        assert!(e.contains("does not split into 2 equal parts"), "{e}");
    }
}
