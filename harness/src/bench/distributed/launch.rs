//! Starting the ranks of one leg as `mlx.launch --backend ring` does on one machine, bounded.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::RankLeg;

/// Two distinct free loopback ports (both bound at once, then released).
fn free_ports(n: usize) -> Result<Vec<u16>> {
    let socks = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0"))
        .collect::<std::io::Result<Vec<_>>>()?;
    socks.iter().map(|s| Ok(s.local_addr()?.port())).collect()
}

/// A started rank: its process and where its output goes.
struct Rank {
    child: Child,
    out: PathBuf,
    err: PathBuf,
}

/// Starts `ranks` copies of `make()`'s command (as mlx.launch would on one machine: a
/// hostfile of loopback ports, MLX_RANK and MLX_HOSTFILE each), waits up to `timeout` for
/// all of them, and returns each rank's JSON line. A rank that fails or overruns ends the
/// leg: every rank still running is killed, and the error quotes the failed rank's stderr.
pub fn launch(
    ranks: usize,
    make: &dyn Fn() -> Result<Command>,
    timeout: Duration,
    what: &str,
) -> Result<Vec<RankLeg>> {
    let tmp = tempfile::tempdir()?;
    let hostfile = tmp.path().join("hosts.json");
    if ranks > 1 {
        let hosts: Vec<Vec<String>> = free_ports(ranks)?
            .into_iter()
            .map(|p| vec![format!("127.0.0.1:{p}")])
            .collect();
        std::fs::write(&hostfile, serde_json::to_string(&hosts)?)?;
    }
    let mut started = Vec::new();
    for r in 0..ranks {
        let (out, err) = (
            tmp.path().join(format!("r{r}.out")),
            tmp.path().join(format!("r{r}.err")),
        );
        let mut cmd = make()?;
        cmd.env_remove("MLX_RANK").env_remove("MLX_HOSTFILE");
        if ranks > 1 {
            cmd.env("MLX_RANK", r.to_string())
                .env("MLX_HOSTFILE", &hostfile);
        }
        cmd.stdin(Stdio::null())
            .stdout(std::fs::File::create(&out)?)
            .stderr(std::fs::File::create(&err)?);
        match cmd.spawn() {
            Ok(child) => started.push(Rank { child, out, err }),
            Err(e) => {
                kill_all(&mut started);
                return Err(e).with_context(|| format!("starting rank {r} of the {what} leg"));
            }
        }
    }
    let result = wait_all(&mut started, timeout, what);
    kill_all(&mut started);
    result?;
    started
        .iter()
        .enumerate()
        .map(|(r, rank)| {
            let text = std::fs::read_to_string(&rank.out)?;
            let line = text
                .lines()
                .rev()
                .find(|l| l.starts_with('{'))
                .with_context(|| format!("rank {r} of the {what} leg printed no JSON"))?;
            Ok(serde_json::from_str(line)?)
        })
        .collect()
}

/// Polls every rank until all exit 0 (Ok), one fails, or `timeout` passes (Err).
fn wait_all(ranks: &mut [Rank], timeout: Duration, what: &str) -> Result<()> {
    let start = Instant::now();
    let mut done = vec![false; ranks.len()];
    while done.iter().any(|d| !d) {
        for (r, rank) in ranks.iter_mut().enumerate() {
            if done[r] {
                continue;
            }
            if let Some(status) = rank.child.try_wait()? {
                if !status.success() {
                    bail!(
                        "rank {r} of the {what} leg failed ({status}): {}",
                        stderr_tail(&rank.err)
                    );
                }
                done[r] = true;
            }
        }
        if start.elapsed() > timeout {
            bail!(
                "the {what} leg ran past {} s and was killed (ranks still running: {:?})",
                timeout.as_secs(),
                (0..ranks.len()).filter(|&r| !done[r]).collect::<Vec<_>>()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

fn kill_all(ranks: &mut [Rank]) {
    for rank in ranks {
        if let Ok(None) = rank.child.try_wait() {
            let _ = rank.child.kill();
        }
        let _ = rank.child.wait();
    }
}

/// The last lines of a rank's stderr (the error is at the end).
fn stderr_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    lines[lines.len().saturating_sub(6)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &'static str) -> impl Fn() -> Result<Command> {
        move || {
            let mut c = Command::new("sh");
            c.arg("-c").arg(script);
            Ok(c)
        }
    }

    #[test]
    fn every_rank_reports_its_own_line() {
        let legs = launch(
            2,
            &sh(r#"echo "{\"stack\":\"x\",\"rank\":$MLX_RANK,\"prompt_tokens\":1,\"generated_tokens\":1,\"ttft_s\":1,\"prefill_tps\":1,\"decode_tps\":1,\"peak_memory_bytes\":1}""#),
            Duration::from_secs(20),
            "test",
        )
        .unwrap();
        assert_eq!(legs.iter().map(|l| l.rank).collect::<Vec<_>>(), [0, 1]);
    }

    #[test]
    fn a_failed_rank_ends_the_leg_and_its_peer_is_killed() {
        let start = Instant::now();
        let err = launch(
            2,
            &sh(r#"if [ "$MLX_RANK" = 1 ]; then echo boom >&2; exit 3; fi; exec sleep 60"#),
            Duration::from_secs(50),
            "test",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("rank 1") && err.contains("boom"), "{err}");
        assert!(start.elapsed() < Duration::from_secs(20));
    }

    #[test]
    fn a_leg_past_its_timeout_is_killed() {
        let start = Instant::now();
        let err = launch(2, &sh("exec sleep 60"), Duration::from_secs(1), "test")
            .unwrap_err()
            .to_string();
        assert!(err.contains("ran past 1 s"), "{err}");
        assert!(start.elapsed() < Duration::from_secs(20));
    }
}
