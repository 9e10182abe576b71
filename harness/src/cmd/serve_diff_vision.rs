//! `harness serve-diff --vision`: the same greedy requests with images to `engine serve` (in
//! this process, as the text diff runs it) and `mlx_vlm.server` 0.7.10 (the vlm-serve venv:
//! oracles/requirements-vision-serve.txt), on each vision model both serve, compared answer by
//! answer and streamed chunk by chunk by oracles/serve_diff_vision.py (its header: the
//! requests — one and two PNG pictures as data: URLs, before and after the text, on
//! chat/completions, Responses and Messages, plain and streamed — what is compared and what is
//! normalized away by design); then once more with its planted client-side difference (our
//! first picture swapped for the other one), which must be caught.
//!
//! A served model is assembled as engine/tests/it/common/vision.rs `assembled` does it: the
//! tiny fixture's weights, processor and generation configs from goldens/models/<m>, with
//! goldens/vision/generate/<m>/ (config, tokenizer, gemma3's processor config) over them.
//! Both servers load that one directory and every request names its canonical path.
//!
//! `--peer-only`: our server is not started; the script runs with the peer on both sides,
//! which checks the requests against mlx_vlm.server, its determinism (each request twice) and
//! that the plant is caught on real answers.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use super::serve_check::{free_port, serve_in_process, wait_ready, Peer};

/// The models both servers read images on (the fixtures of goldens/vision/generate).
const MODELS: [&str; 4] = [
    "tiny-gemma3-vl",
    "tiny-qwen3-vl-vision",
    "tiny-gemma4-vl",
    "tiny-qwen3-5-vl",
];

/// `VLM_SERVE_VENV`, else /work/vlmserve-venv.
fn venv() -> PathBuf {
    std::env::var_os("VLM_SERVE_VENV").map_or_else(|| "/work/vlmserve-venv".into(), PathBuf::from)
}

/// `model`'s served directory under `into` (module header), canonical.
fn assemble(model: &str, into: &Path) -> Result<PathBuf> {
    let goldens = harness::goldens::goldens_root();
    let dir = into.join(model);
    std::fs::create_dir_all(&dir)?;
    let base = goldens.join("models").join(model);
    // gemma4's processor reads processor_config.json (as tests/it/common/vision.rs has it).
    let processor = match model {
        "tiny-gemma4-vl" => "processor_config.json",
        _ => "preprocessor_config.json",
    };
    for f in ["model.safetensors", processor, "generation_config.json"] {
        std::fs::copy(base.join(f), dir.join(f)).with_context(|| format!("{base:?}/{f}"))?;
    }
    let overlay = goldens.join("vision/generate").join(model);
    for entry in std::fs::read_dir(&overlay).with_context(|| format!("{overlay:?}"))? {
        let p = entry?.path();
        std::fs::copy(&p, dir.join(p.file_name().context("a file name")?))?;
    }
    Ok(dir.canonicalize()?)
}

/// The last lines of the peer's log, for a refusal that says why it did not come up.
fn log_tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

pub fn run(peer_only: bool) -> Result<()> {
    let python = venv().join("bin/python");
    if !python.exists() {
        bail!(
            "no mlx_vlm.server venv at {:?}: make it as the header of \
             oracles/requirements-vision-serve.txt says, or point VLM_SERVE_VENV at one",
            venv()
        );
    }
    let tmp = std::env::temp_dir().join(format!("serve-diff-vision-{}", std::process::id()));
    std::fs::create_dir_all(&tmp)?;
    let result = compare_all(&python, &tmp, peer_only);
    let _ = std::fs::remove_dir_all(&tmp);
    result
}

fn compare_all(python: &Path, tmp: &Path, peer_only: bool) -> Result<()> {
    let script = harness::oracle::repo_root().join("oracles/serve_diff_vision.py");
    let mut failed = Vec::new();
    for name in MODELS {
        let model = assemble(name, tmp)?;
        let id = model.display().to_string();
        let ours = match peer_only {
            true => None,
            false => Some(
                serve_in_process(&model, &[])
                    .with_context(|| format!("engine serve on {name} (assembled at {id})"))?,
            ),
        };
        let peer_port = free_port()?;
        let log = tmp.join(format!("{name}.mlx_vlm.server.log"));
        let out = std::fs::File::create(&log)?;
        let mut peer = Peer(
            std::process::Command::new(python)
                .args(["-m", "mlx_vlm.server", "--host", "127.0.0.1"])
                .args(["--port", &peer_port.to_string(), "--model", &id])
                .stdout(out.try_clone()?)
                .stderr(out)
                .spawn()
                .context("starting mlx_vlm.server in the vlm-serve venv")?,
        );
        wait_ready(
            peer_port,
            "mlx_vlm.server",
            || peer.0.try_wait().ok().flatten().map(|s| s.to_string()),
            // It lists the model it preloaded under the path it was given.
            |body| body.contains(&serde_json::to_string(&id).unwrap_or_default()),
        )
        .with_context(|| {
            format!(
                "mlx_vlm.server on {name}; its log ends:\n{}",
                log_tail(&log)
            )
        })?;
        let peer_url = format!("http://127.0.0.1:{peer_port}");
        let ours_url = ours.map_or_else(|| peer_url.clone(), |p| format!("http://127.0.0.1:{p}"));
        let compare = |plant: bool| -> Result<bool> {
            let mut cmd = std::process::Command::new(python);
            cmd.arg(&script)
                .args(["--ours", &ours_url, "--peer", &peer_url, "--model", &id]);
            if plant {
                cmd.arg("--plant").stdout(std::process::Stdio::null());
            }
            Ok(cmd
                .status()
                .context("running oracles/serve_diff_vision.py")?
                .success())
        };
        match peer_only {
            true => println!("== {name}: mlx_vlm.server against itself (--peer-only)"),
            false => println!("== {name}: engine serve vs mlx_vlm.server, with images"),
        }
        if !compare(false)? {
            failed.push(name);
        }
        if compare(true)? {
            bail!("{name}: the planted difference (our first picture swapped for the other one) was not caught");
        }
        println!("planted difference caught");
        // A peer that lost its port to someone else would have exited: its answers were then
        // not its own.
        if let Some(status) = peer.0.try_wait()? {
            bail!(
                "{name}: mlx_vlm.server exited ({status}) during the diff; its answers are not \
                 trusted. Its log ends:\n{}",
                log_tail(&log)
            );
        }
    }
    if !failed.is_empty() {
        let who = match peer_only {
            true => "mlx_vlm.server differs from itself",
            false => {
                "engine serve differs from mlx_vlm.server (each FAIL line above names the side)"
            }
        };
        bail!("{who} on {failed:?}");
    }
    Ok(())
}
