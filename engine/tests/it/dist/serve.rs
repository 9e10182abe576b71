//! `engine serve` as two ranks of a tensor-parallel group (mlx.launch's environment:
//! MLX_RANK, MLX_HOSTFILE on loopback): rank 0's HTTP answers exactly as a one-process
//! server on the same model, streamed and not, with stops, seeds, cache reuse and
//! interleaved requests; SIGTERM stops both ranks cleanly; a lost peer fails the request in
//! flight and ends rank 0 with status 4; what mlx_lm.server refuses across ranks is refused.

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::ranks::{self, free_ports};
use crate::common;
use crate::common::server::{engine_bin, http, serve_model, stats};

const MODEL: &str = "tiny-llama-trained";

/// Two `engine serve` ranks; both killed when dropped.
struct Ranks {
    children: Vec<Child>,
    port: u16,
    hostfile: PathBuf,
}

impl Drop for Ranks {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_file(&self.hostfile);
    }
}

/// A hostfile for two loopback ranks, as mlx.launch writes one.
fn hostfile() -> PathBuf {
    let ports = free_ports::<2>();
    let name = format!("serve_dist-{}-{}.json", std::process::id(), ports[0]);
    ranks::hostfile(&std::env::temp_dir(), &name, &ports)
}

/// How the ranks are started: the model, extra flags, extra environment.
#[derive(Clone, Copy, Debug)]
struct Launch<'a> {
    model: &'a str,
    extra: &'a [&'a str],
    env: &'a [(&'a str, &'a str)],
    /// `--dist-timeout` (seconds): how long a rank waits on a stalled step.
    dist_timeout: &'a str,
}

fn launch<'a>(extra: &'a [&'a str]) -> Launch<'a> {
    Launch {
        model: MODEL,
        extra,
        env: &[],
        dist_timeout: "30",
    }
}

fn rank_command(rank: usize, hostfile: &PathBuf, how: Launch) -> Command {
    let model = common::goldens().join("models").join(how.model);
    let mut cmd = Command::new(engine_bin());
    cmd.args(["serve", "--model", model.to_str().unwrap(), "--port", "0"])
        .args([
            "--dist-connect-timeout",
            "30",
            "--dist-timeout",
            how.dist_timeout,
        ])
        .args(how.extra)
        .env("MLX_RANK", rank.to_string())
        .env("MLX_HOSTFILE", hostfile)
        .envs(how.env.iter().copied());
    cmd
}

/// Both ranks, once rank 0 has printed the address it serves on (it does once the group
/// formed and the model loaded).
fn start_ranks(how: Launch) -> Ranks {
    let hostfile = hostfile();
    let follower = rank_command(1, &hostfile, how)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut leader = rank_command(0, &hostfile, how)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(leader.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let mut ranks = Ranks {
        children: vec![leader, follower],
        port: 0,
        hostfile,
    };
    ranks.port = line
        .trim()
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no address from rank 0 in `{line}`"));
    ranks
}

/// Waits (up to `limit`) for a child to exit.
fn wait_exit(child: &mut Child, limit: Duration) -> ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        assert!(
            start.elapsed() < limit,
            "the rank did not exit in {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn chat(content: &str) -> Value {
    json!({"messages": [{"role": "user", "content": content}], "max_tokens": 24})
}

/// The requests both servers answer, in order: (path, body).
fn suite() -> Vec<(&'static str, Value)> {
    let mut streamed = chat("What color is the sky?");
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let mut stopped = chat("What color is the sky?");
    stopped["stop"] = json!(["blue"]);
    // Greedy only: tensor parallel sums partial products, so log-probabilities differ from
    // one process in the last bits (as mlx-lm's do); sampled answers are compared with
    // mlx_lm.server under mlx.launch (harness serve-diff --ranks 2).
    let long = json!({"prompt": "Once upon a time", "max_tokens": 40,
        "logit_bias": {"2": -100, "6": -100}, "stream": true});
    vec![
        ("/v1/chat/completions", chat("What color is the sky?")),
        ("/v1/chat/completions", streamed),
        ("/v1/chat/completions", stopped),
        ("/v1/chat/completions", chat("Tell me a story")),
        ("/v1/completions", long),
        // The same conversation again: the prompt cache's reuse (cached_tokens) agrees.
        ("/v1/chat/completions", chat("What color is the sky?")),
    ]
}

/// A response with what differs between servers run at different times taken out.
fn normalized(text: &str) -> Vec<Value> {
    let mut out: Vec<Value> = if text.starts_with("data: ") || text.contains("\ndata: ") {
        text.lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .map(|d| serde_json::from_str(d).unwrap_or(Value::String(d.into())))
            .collect()
    } else {
        vec![serde_json::from_str(text).unwrap_or(Value::String(text.into()))]
    };
    for v in &mut out {
        if let Some(o) = v.as_object_mut() {
            o.remove("created");
        }
    }
    out
}

/// The suite's answers, then three interleaved streamed requests' answers (sorted: their
/// arrival order is the scheduler's).
fn answers(port: u16) -> Vec<Vec<Value>> {
    let mut out: Vec<Vec<Value>> = suite()
        .into_iter()
        .map(|(path, body)| {
            let (code, text) = http(port, "POST", path, body.to_string().as_bytes());
            assert_eq!(code, 200, "{path}: {text}");
            normalized(&text)
        })
        .collect();
    let together: Vec<_> = (0..3)
        .map(|i| {
            std::thread::spawn(move || {
                let mut b = chat(&format!("Tell me story number {i}"));
                b["stream"] = json!(true);
                let text = http(
                    port,
                    "POST",
                    "/v1/chat/completions",
                    b.to_string().as_bytes(),
                )
                .1;
                let mut chunks = normalized(&text);
                for c in &mut chunks {
                    c.as_object_mut().map(|o| o.remove("id"));
                }
                chunks
            })
        })
        .collect();
    let mut together: Vec<_> = together.into_iter().map(|t| t.join().unwrap()).collect();
    together.sort_by_key(|c| c.iter().map(|v| v.to_string()).collect::<String>());
    out.extend(together);
    out
}

#[test]
fn two_ranks_answer_as_one_process() {
    let single = answers(serve_model(MODEL, &[]).port);
    let mut ranks = start_ranks(launch(&[]));
    let dist = answers(ranks.port);
    assert_eq!(dist.len(), single.len());
    for (i, (d, s)) in dist.iter().zip(&single).enumerate() {
        assert_eq!(d.len(), s.len(), "answer {i}: chunk counts");
        assert_eq!(d, s, "answer {i}");
    }
    // The streamed answer is whole: text chunks, the finish, usage, [DONE].
    assert_eq!(dist[1].len(), 8, "{:?}", dist[1]);
    assert_eq!(
        dist[5][0]["usage"]["prompt_tokens_details"]["cached_tokens"],
        13
    );
    let st = stats(ranks.port);
    assert_eq!(st["group"], json!({"rank": 0, "size": 2, "mode": "tensor"}));
    assert_eq!(st["failed"], 0);

    // SIGTERM to rank 0: it drains, tells rank 1 to stop, and both exit 0.
    let pid = ranks.children[0].id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    for (r, c) in ranks.children.iter_mut().enumerate() {
        let status = wait_exit(c, Duration::from_secs(30));
        assert!(status.success(), "rank {r} after SIGTERM: {status}");
    }
}

/// Pipeline parallel (tiny-qwen2, one layer per rank; rank 0 holds the last): the same
/// answers as one process, bit for bit (no product is split), one request at a time on
/// the batch lane (`--batch 4`: a lone row).
#[test]
fn pipeline_ranks_answer_as_one_process() {
    let single = answers(serve_model("tiny-qwen2", &[]).port);
    let ranks = start_ranks(Launch {
        model: "tiny-qwen2",
        ..launch(&["--pipeline", "--batch", "4"])
    });
    let dist = answers(ranks.port);
    assert_eq!(dist, single);
    let st = stats(ranks.port);
    assert_eq!(st["lanes"]["batch_slots"], 4, "{st}");
    assert_eq!(
        st["group"],
        json!({"rank": 0, "size": 2, "mode": "pipeline"})
    );
}

/// The batch lane across two pipeline stages (`--pipeline --batch 4`, tiny-qwen2): the
/// waves of concurrent clients answer exactly as a one-process `--batch 4` server does,
/// with rows sharing steps. The follower's stage runs the first layer for every row and
/// sends the batch's hidden states on (its batch caches carry the send, as its row caches
/// do); planted `FollowerRowsReversed` (the follower feeds rank 0's ids to its rows in
/// reverse order) changes the answers: rank 0's layer reads what the follower computed.
#[test]
fn pipeline_batch_lane_ranks_answer_concurrent_clients_as_one_process() {
    let (single, st) = lane_answers_match("tiny-qwen2", &["--pipeline"]);
    let lanes = &st["lanes"];
    assert_eq!(lanes["batch_peak_rows"], 4, "{lanes}");
    assert!(lanes["batch_prompt_batches"].as_u64() >= Some(1), "{lanes}");
    let ranks = start_ranks(Launch {
        model: "tiny-qwen2",
        env: &[("ENGINE_PLANT", "BatchGathersFour,FollowerRowsReversed")],
        dist_timeout: "5",
        ..launch(&["--pipeline", "--batch", "4"])
    });
    let planted = wave_answers(ranks.port, lone_prompt("tiny-qwen2"));
    assert!(planted.iter().all(|a| a[0] == 200), "{planted:?}");
    assert_ne!(planted, single, "FollowerRowsReversed was not caught");
}

/// The comparison catches ranks that do not combine their shards: with the planted
/// DistReduceDropped (the row-split linears skip their all_sum) the first answer differs
/// from one process's. Each rank then computes logits of its own, so their decoding
/// diverges: rank 1 exits naming that (status 2), and rank 0 fails what is in flight.
#[test]
fn a_dropped_reduce_changes_the_answer() {
    let (path, body) = suite().remove(0);
    let one = |port: u16| http(port, "POST", path, body.to_string().as_bytes());
    let single = one(serve_model(MODEL, &[]).port);
    assert_eq!(single.0, 200);
    let mut ranks = start_ranks(Launch {
        env: &[("ENGINE_PLANT", "DistReduceDropped")],
        ..launch(&[])
    });
    let planted = one(ranks.port);
    assert_ne!(
        planted, single,
        "the planted defect left the answer unchanged"
    );
    let status = wait_exit(&mut ranks.children[1], Duration::from_secs(30));
    assert_eq!(status.code(), Some(2), "rank 1: {status}");
    let status = wait_exit(&mut ranks.children[0], Duration::from_secs(30));
    assert_eq!(status.code(), Some(4), "rank 0: {status}");
}

/// Rank 1 killed mid-stream: the request in flight ends with an error event naming the
/// lost peer, and rank 0 exits with status 4 (mlx_lm.server stays up, unhealthy; the
/// issue asks for an exit) — on the serial lane and on the batch lane (`--batch 4`), and
/// on the batch lane when the failed collective never returns (`LostCollectiveHangs`: as
/// MLX's ring now and then leaves it, with the model thread blocked; the peer watch then
/// tells the request and ends the rank).
#[test]
fn a_lost_peer_fails_the_request_and_ends_rank_0() {
    let hangs = [("ENGINE_PLANT", "LostCollectiveHangs")];
    for how in [
        launch(&[]),
        launch(&["--batch", "4"]),
        Launch {
            env: &hangs,
            ..launch(&["--batch", "4"])
        },
    ] {
        let (text, status) = lose_the_peer_mid_stream(how);
        assert!(text.contains("a peer rank was lost"), "{how:?}: {text}");
        assert!(
            !text.contains("\"finish_reason\":\"length\""),
            "{how:?}: {}",
            &text[text.len().saturating_sub(800)..]
        );
        assert_eq!(status.code(), Some(4), "rank 0 ({how:?}): {status}");
    }
}

/// Planted: the peer watch ends rank 0 without telling the request in flight (its hook
/// skipped) while the collective hangs. The rank still exits 4, but the stream ends
/// without naming the loss, and the gate above would see it.
#[test]
fn a_peer_watch_that_ends_rank_0_untold_is_caught() {
    let (text, status) = lose_the_peer_mid_stream(Launch {
        env: &[("ENGINE_PLANT", "LostCollectiveHangs,LostPeerUntold")],
        ..launch(&["--batch", "4"])
    });
    assert_eq!(status.code(), Some(4), "rank 0: {status}");
    assert!(!text.contains("a peer rank was lost"), "{text}");
}

/// Kills rank 1 once a long stream is decoding on both ranks: what the client read until
/// rank 0 closed the stream (a minute at most), and rank 0's exit status.
fn lose_the_peer_mid_stream(how: Launch) -> (String, ExitStatus) {
    let mut ranks = start_ranks(how);
    let lanes = stats(ranks.port)["lanes"].clone();
    let batched = !how.extra.is_empty();
    assert_eq!(lanes["batch_slots"], json!(if batched { 4 } else { 0 }));
    assert_eq!(lanes["serial_reason"], Value::Null, "{lanes}");
    let body = json!({"prompt": "Once", "max_tokens": 3000, "stream": true,
        "logit_bias": {"2": -100, "6": -100}});
    let body = body.to_string();
    let mut s = TcpStream::connect(("127.0.0.1", ranks.port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    // Ten tokens streamed: the request is decoding on both ranks.
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while String::from_utf8_lossy(&seen).matches("data: ").count() < 10 {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "the stream ended early");
        seen.extend_from_slice(&buf[..n]);
    }
    ranks.children[1].kill().unwrap();
    // Until rank 0 closes the stream, for a minute at most (a stream kept open by a stuck
    // rank fails the test instead of hanging it).
    let deadline = Instant::now() + Duration::from_secs(60);
    s.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
    while Instant::now() < deadline {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => seen.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(_) => break,
        }
    }
    let status = wait_exit(&mut ranks.children[0], Duration::from_secs(30));
    (String::from_utf8_lossy(&seen).into_owned(), status)
}

/// Two waves of four requests (path, body), each wave's sent at once; the second repeats
/// two prompts of the first, which the prompt store holds by then, and ends with `lone`, a
/// prompt of one token.
fn batch_waves(lone: &'static str) -> Vec<Vec<(&'static str, Value)>> {
    let ban = json!({"2": -100, "6": -100});
    let wave = |prompts: [&str; 4], lengths: [u32; 4]| -> Vec<(&'static str, Value)> {
        let mut out = Vec::new();
        for (i, (p, n)) in prompts.iter().zip(lengths).enumerate() {
            let (path, mut b) = match i % 2 {
                0 => ("/v1/chat/completions", chat(p)),
                _ => ("/v1/completions", json!({"prompt": p, "logit_bias": ban})),
            };
            b["max_tokens"] = json!(n);
            if i == 1 {
                b["stream"] = json!(true);
            }
            if i == 2 {
                b["stop"] = json!(["blue"]);
            }
            out.push((path, b));
        }
        out
    };
    vec![
        wave(
            [
                "What color is the sky?",
                "Once upon a time",
                "Tell me a story",
                "The robot",
            ],
            [12, 40, 24, 6],
        ),
        wave(
            [
                "What color is the sky?",
                "Once upon a time there",
                "Who fixed the clock?",
                // A one-token prompt with nothing cached: stepped alone.
                lone,
            ],
            [30, 8, 20, 16],
        ),
    ]
}

/// Each wave's answers (ids taken out: the schedule numbers them), its four requests sent
/// at once; the server gathers four arrivals before it starts (`BatchGathersFour`).
fn wave_answers(port: u16, lone: &'static str) -> Vec<Vec<Value>> {
    let mut out = Vec::new();
    for wave in batch_waves(lone) {
        let sent: Vec<_> = wave
            .into_iter()
            .map(|(path, body)| {
                std::thread::spawn(move || http(port, "POST", path, body.to_string().as_bytes()))
            })
            .collect();
        for h in sent {
            let (code, text) = h.join().unwrap();
            let mut chunks = normalized(&text);
            for c in &mut chunks {
                c.as_object_mut().map(|o| o.remove("id"));
            }
            chunks.insert(0, json!(code));
            out.push(chunks);
        }
    }
    out
}

/// The batch lane across two ranks (`--batch 4`): rank 0 schedules the rows and the
/// follower mirrors each change to the lane's caches (`batch_lane::mirror`). Two waves of
/// four clients at once (uncached prompts prefilled together, prompts the store holds
/// admitted through their last ids, a one-token prompt stepped alone, rows leaving at
/// different lengths and at a stop string, the last row stepping alone) answer exactly as
/// a one-process `--batch 4`
/// server does, and the rows did share steps (tensor parallel, tiny-llama-trained).
/// Planted `FollowerRowsReversed` (the follower feeds rank 0's ids to its rows in reverse
/// order) changes the answers.
#[test]
fn batch_lane_ranks_answer_concurrent_clients_as_one_process() {
    let (single, st) = lane_answers_match(MODEL, &[]);
    let lanes = &st["lanes"];
    assert_eq!(lanes["batch_peak_rows"], 4, "{lanes}");
    assert!(lanes["batch_prompt_batches"].as_u64() >= Some(1), "{lanes}");
    assert!(lanes["batch_lone_steps"].as_u64() >= Some(1), "{lanes}");
    let ranks = start_ranks(Launch {
        env: &[("ENGINE_PLANT", "BatchGathersFour,FollowerRowsReversed")],
        dist_timeout: "5",
        ..launch(&["--batch", "4"])
    });
    let planted = wave_answers(ranks.port, lone_prompt(MODEL));
    // Answered (not failed): the rows' ids went to other rows, and the answers changed.
    assert!(planted.iter().all(|a| a[0] == 200), "{planted:?}");
    assert_ne!(planted, single, "FollowerRowsReversed was not caught");
}

/// The one-token prompt of `model`'s waves: tiny-llama's tokenizer encodes "" as its BOS
/// id; tiny-qwen2's adds no BOS ("" would be refused, and the gathered wave stay three).
fn lone_prompt(model: &str) -> &'static str {
    match model {
        "tiny-qwen2" => "The",
        _ => "",
    }
}

/// `wave_answers` of `model` on two ranks (with `flags`) against one process, both with
/// `--batch 4`: the one process's answers and rank 0's /stats.
fn lane_answers_match(model: &str, flags: &[&str]) -> (Vec<Vec<Value>>, Value) {
    let lone = lone_prompt(model);
    let gather = [("ENGINE_PLANT", "BatchGathersFour")];
    let dir = common::goldens().join("models").join(model);
    let one = common::server::serve_dir_with_env(&dir, &["--batch", "4"], &gather);
    let single = wave_answers(one.port, lone);
    let mut rank_flags = vec!["--batch", "4"];
    rank_flags.extend(flags);
    let ranks = start_ranks(Launch {
        model,
        env: &gather,
        ..launch(&rank_flags)
    });
    let dist = wave_answers(ranks.port, lone);
    for (i, (d, s)) in dist.iter().zip(&single).enumerate() {
        assert_eq!(d, s, "{model} {flags:?}: answer {i}");
    }
    assert_eq!(dist.len(), 8);
    let st = stats(ranks.port);
    assert_eq!(st["failed"], 0, "{st}");
    // The second wave's first prompt came from the store.
    let cached = &dist[4][1]["usage"]["prompt_tokens_details"]["cached_tokens"];
    assert!(cached.as_u64() > Some(0), "{:?}", dist[4]);
    (single, st)
}

/// Rows take turns across ranks: with both slots of `--batch 2` busy and a third request
/// waiting, a row yields its slot after its time slice (parked with its caches on every
/// rank) and rejoins later; every answer is the serial lane's on the same ranks (one
/// process's drifts from both after ~100 tokens here: tensor parallel sums partial
/// products, so near-ties fall otherwise, on either lane alike). The slice is 20 ms
/// (`BatchSliceShort`), so rows take turns on any machine.
#[test]
fn a_full_batch_lane_across_ranks_takes_turns_and_answers_unchanged() {
    let prompts = ["The little robot", "Once upon a time", "The old clock"];
    let body =
        |p: &str| json!({"prompt": p, "max_tokens": 60, "logit_bias": {"2": -100, "6": -100}});
    let ranks = start_ranks(Launch {
        env: &[("ENGINE_PLANT", "BatchSliceShort")],
        ..launch(&["--batch", "2"])
    });
    let port = ranks.port;
    let sent: Vec<_> = prompts
        .iter()
        .map(|p| {
            let b = body(p).to_string();
            std::thread::spawn(move || http(port, "POST", "/v1/completions", b.as_bytes()))
        })
        .collect();
    let answers: Vec<(u16, String)> = sent.into_iter().map(|h| h.join().unwrap()).collect();
    let st = stats(port);
    assert!(
        st["lanes"]["batch_parks"].as_u64() > Some(0),
        "rows took turns: {st}"
    );
    drop(ranks);
    let serial = start_ranks(launch(&["--prompt-cache-size", "0"]));
    for (p, (code, text)) in prompts.iter().zip(&answers) {
        assert_eq!(*code, 200, "{text}");
        let want = http(
            serial.port,
            "POST",
            "/v1/completions",
            body(p).to_string().as_bytes(),
        );
        let text_of = |t: &str| normalized(t)[0]["choices"][0]["text"].clone();
        assert_eq!(text_of(text), text_of(&want.1), "prompt {p}");
    }
}

/// --draft-model across ranks is refused by every rank, as mlx_lm.server refuses it.
#[test]
fn draft_model_is_refused_across_ranks() {
    let hostfile = hostfile();
    let draft = common::goldens().join("models/tiny-llama-draft");
    let extra = ["--draft-model", draft.to_str().unwrap()];
    let children: Vec<_> = (0..2)
        .map(|r| {
            rank_command(r, &hostfile, launch(&extra))
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for (r, c) in children.into_iter().enumerate() {
        let out = c.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "rank {r}");
        assert!(
            err.contains("--draft-model is not supported across ranks"),
            "rank {r}: {err}"
        );
    }
    let _ = std::fs::remove_file(&hostfile);
}

/// The status of a request whose schema (a required self-reference) reaches the grammar
/// limits on its first step.
fn over_the_limits(port: u16) -> u16 {
    let schema = json!({"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}},
        "required": ["c"]}}, "$ref": "#/$defs/n"});
    let body = json!({"prompt": "The robot", "max_tokens": 8,
        "response_format": {"type": "json_schema",
            "json_schema": {"name": "t", "schema": schema, "strict": true}}});
    http(port, "POST", "/v1/completions", body.to_string().as_bytes()).0
}

/// A constrained answer (a JSON schema, greedy) across ranks: the follower masks with the
/// request's grammar too, so rank 0 answers as one process. The planted
/// `FollowerUnconstrained` (rank 1 samples without the grammar, so its ids — the input of
/// its half of every later forward — differ) changes the answer. A grammar's fault fails
/// its request alone on every rank and the group answers on (planted
/// `GrammarFaultLosesGroup`: the server goes down instead).
#[test]
fn a_constrained_answer_across_ranks_is_one_process_answer() {
    let schema = json!({"type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
        "required": ["name", "n"], "additionalProperties": false});
    let body = json!({"prompt": "The robot", "max_tokens": 40,
        "response_format": {"type": "json_schema",
            "json_schema": {"name": "t", "schema": schema, "strict": true}}});
    let one = |port: u16| {
        let (code, text) = http(port, "POST", "/v1/completions", body.to_string().as_bytes());
        (code, normalized(&text))
    };
    let single = one(serve_model(MODEL, &[]).port);
    assert_eq!(single.0, 200, "{:?}", single.1);
    let ranks = start_ranks(launch(&[]));
    let dist = one(ranks.port);
    assert_eq!(dist, single);
    // A grammar over the limits fails its request alone on every rank (a 400); the group
    // goes on and answers as before.
    assert_eq!(over_the_limits(ranks.port), 400);
    // The same text (its id and cached prompt tokens differ: a later request).
    let text = |answer: &(u16, Vec<Value>)| (answer.0, answer.1[0]["choices"].clone());
    assert_eq!(
        text(&one(ranks.port)),
        text(&single),
        "the group did not go on after a grammar's fault"
    );
    drop(ranks);
    // Planted: a grammar's fault taken for a lost group (rank 0 fails it and exits).
    let ranks = start_ranks(Launch {
        env: &[("ENGINE_PLANT", "GrammarFaultLosesGroup")],
        ..launch(&[])
    });
    let code = over_the_limits(ranks.port);
    assert_ne!(code, 400, "GrammarFaultLosesGroup was not caught");
    drop(ranks);
    let ranks = start_ranks(Launch {
        env: &[("ENGINE_PLANT", "FollowerUnconstrained")],
        // The ranks' diverged steps stall until rank 0 gives up: 5 s, not 30, is enough.
        dist_timeout: "5",
        ..launch(&[])
    });
    let planted = one(ranks.port);
    println!("planted FollowerUnconstrained: {planted:?}");
    assert_ne!(
        planted, single,
        "the planted defect left the answer unchanged"
    );
    drop(ranks);
}
