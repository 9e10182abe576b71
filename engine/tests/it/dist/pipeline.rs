//! Pipeline parallel (mlx-lm's `PipelineMixin`, `engine generate --pipeline`) on two
//! loopback ranks started as mlx.launch starts them (MLX_RANK, MLX_HOSTFILE): rank 0 prints
//! the text one process prints, greedy, with the prompt prefilled in one chunk and in
//! chunks of 2 (the chunked prefill evaluates only the caches, which must still carry each
//! send); rank 1 prints nothing. The planted reversed stages change the text; families
//! mlx-lm does not pipeline are refused on both ranks. Every rank is bounded by a deadline
//! and killed past it; each rank's own exit status is checked.

use std::io::Read;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::ranks::{free_ports, hostfile, model};

const DEADLINE: Duration = Duration::from_secs(120);

/// What a process printed and how it ended.
struct Run {
    ok: bool,
    code: Option<i32>,
    out: String,
    err: String,
}

/// `engine generate --model <model> <args>` with `env`, not yet waited on.
fn start(model: &Path, args: &[&str], env: &[(&str, String)]) -> Child {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_engine"));
    cmd.arg("generate")
        .arg("--model")
        .arg(model)
        .args(args)
        .env_remove("ENGINE_PLANT")
        .env_remove("MLX_RANK")
        .env_remove("MLX_HOSTFILE")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.spawn().unwrap()
}

/// Waits for every child until the deadline (killing all of them past it), then reads
/// their output. Pipes are drained by threads so a chatty child cannot block.
fn finish(children: Vec<Child>) -> Vec<Run> {
    let deadline = Instant::now() + DEADLINE;
    let mut pending: Vec<_> = children
        .into_iter()
        .map(|mut c| {
            let mut out = c.stdout.take().unwrap();
            let mut err = c.stderr.take().unwrap();
            let out = std::thread::spawn(move || {
                let mut s = String::new();
                let _ = out.read_to_string(&mut s);
                s
            });
            let err = std::thread::spawn(move || {
                let mut s = String::new();
                let _ = err.read_to_string(&mut s);
                s
            });
            (c, out, err)
        })
        .collect();
    let mut statuses = vec![None; pending.len()];
    while statuses.iter().any(Option::is_none) {
        for (i, (c, _, _)) in pending.iter_mut().enumerate() {
            if statuses[i].is_none() {
                statuses[i] = c.try_wait().unwrap();
            }
        }
        if Instant::now() >= deadline {
            for (c, _, _) in pending.iter_mut() {
                let _ = c.kill();
                let _ = c.wait();
            }
            panic!("the ranks did not finish within {DEADLINE:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    pending
        .drain(..)
        .zip(statuses)
        .map(|((_, out, err), status)| {
            let status = status.unwrap();
            Run {
                ok: status.success(),
                code: status.code(),
                out: out.join().unwrap(),
                err: err.join().unwrap(),
            }
        })
        .collect()
}

/// `engine generate --pipeline` as two ranks; `plant` names a defect both ranks switch on.
fn two_ranks(model: &Path, args: &[&str], plant: Option<&str>) -> Vec<Run> {
    let dir = tempfile::tempdir().unwrap();
    let hosts = hostfile(dir.path(), "hosts.json", &free_ports::<2>());
    let mut args = args.to_vec();
    args.extend(["--pipeline", "--dist-connect-timeout", "30"]);
    let children = (0..2)
        .map(|r| {
            let mut env = vec![
                ("MLX_RANK", r.to_string()),
                ("MLX_HOSTFILE", hosts.display().to_string()),
            ];
            if let Some(p) = plant {
                env.push(("ENGINE_PLANT", p.to_owned()));
            }
            start(model, &args, &env)
        })
        .collect();
    finish(children)
}

fn single(model: &Path, args: &[&str]) -> Run {
    finish(vec![start(model, args, &[])]).remove(0)
}

const PROMPT: &[&str] = &[
    "--prompt",
    "The little robot walked into the old library and",
    "--ignore-chat-template",
    "--max-tokens",
    "24",
];

/// Rank 0 prints one process's text, rank 1 nothing, both exit 0; with the prompt in
/// one prefill chunk and in chunks of two tokens.
fn assert_matches_single_process(name: &str) {
    let dir = model(name);
    let want = single(&dir, PROMPT);
    assert!(want.ok, "{name} single process: {}", want.err);
    assert!(!want.out.trim().is_empty(), "{name}: no text");
    for chunk in [None, Some("2")] {
        let mut args = PROMPT.to_vec();
        if let Some(step) = chunk {
            args.extend(["--prefill-step-size", step]);
        }
        let ranks = two_ranks(&dir, &args, None);
        for (r, run) in ranks.iter().enumerate() {
            assert!(
                run.ok,
                "{name} rank {r} ({chunk:?}): {:?} {}",
                run.code, run.err
            );
        }
        assert_eq!(
            ranks[0].out, want.out,
            "{name} rank 0, prefill chunks {chunk:?}"
        );
        assert_eq!(ranks[1].out, "", "{name}: rank 1 writes nothing");
        println!(
            "{name} (prefill step {chunk:?}): rank 0 = single process: {:?}",
            want.out.trim()
        );
    }
}

#[test]
fn pipeline_qwen2_prints_the_single_process_text() {
    assert_matches_single_process("tiny-qwen2");
}

#[test]
fn pipeline_qwen3_moe_prints_the_single_process_text() {
    assert_matches_single_process("tiny-qwen3-moe");
}

#[test]
fn pipeline_qwen3_moe_q4_prints_the_single_process_text() {
    assert_matches_single_process("tiny-qwen3-moe-q4");
}

/// The planted defect reverses the stages (rank 0 runs the first layers): the text
/// changes, on both families.
#[test]
fn planted_reversed_stages_change_the_text() {
    for name in ["tiny-qwen2", "tiny-qwen3-moe"] {
        let dir = model(name);
        let want = single(&dir, PROMPT);
        assert!(want.ok, "{name}: {}", want.err);
        let ranks = two_ranks(&dir, PROMPT, Some("DistShardWrongRank"));
        for (r, run) in ranks.iter().enumerate() {
            assert!(run.ok, "{name} rank {r}: {:?} {}", run.code, run.err);
        }
        assert_ne!(
            ranks[0].out, want.out,
            "{name}: the reversed stages went unnoticed"
        );
        println!(
            "planted DistShardWrongRank on {name}: {:?} vs {:?}",
            ranks[0].out.trim(),
            want.out.trim()
        );
    }
}

/// Families mlx-lm 0.32.2 does not pipeline fail on both ranks, naming the ones that can.
#[test]
fn families_without_a_pipeline_are_refused() {
    for name in ["tiny-llama", "tiny-qwen3", "tiny-mixtral"] {
        let dir = model(name);
        if !dir.exists() {
            panic!("{} is missing (goldens/models)", dir.display());
        }
        let ranks = two_ranks(&dir, PROMPT, None);
        for (r, run) in ranks.iter().enumerate() {
            assert!(!run.ok, "{name} rank {r} ran pipelined");
            assert!(
                run.err.contains("cannot run pipeline parallel")
                    && run.err.contains("families that can: qwen2, qwen3_moe"),
                "{name} rank {r}: {}",
                run.err
            );
            assert_eq!(run.out, "", "{name} rank {r} printed text");
        }
        println!(
            "{name} refused: {}",
            ranks[0].err.lines().last().unwrap_or("")
        );
    }
}
