//! The served batch-lane speculation gates' shared set-up (`lookup::`, `batch_draft::`):
//! plain answers from a serial server, and five requests on a `--batch 4` server where the
//! first four start together and the fifth joins later.

use std::path::Path;
use std::time::Duration;

use serde_json::Value;

use super::server::{post, serve_dir_with_env, serve_model, stats, wait_for};

/// For each variant of `bodies` (a flag: the plain row penalized or not), its requests and
/// their answers from a serial tiny-llama-trained server, sent one at a time without the
/// `speculation` keys (plain greedy decoding).
pub fn plain_runs(
    bodies: impl Fn(bool) -> Vec<Value>,
    speculation: &[&str],
) -> Vec<(bool, Vec<Value>, Vec<String>)> {
    let serial = serve_model("tiny-llama-trained", &["--prompt-cache-size", "0"]);
    [false, true]
        .into_iter()
        .map(|penalized| {
            let bodies = bodies(penalized);
            let plain = bodies
                .iter()
                .map(|b| {
                    let mut b = b.clone();
                    let o = b.as_object_mut().unwrap();
                    speculation.iter().for_each(|k| {
                        o.remove(*k);
                    });
                    let (code, r) = post(serial.port, "/v1/completions", &b);
                    assert_eq!(code, 200, "{r}");
                    r["choices"][0]["text"].as_str().unwrap().to_owned()
                })
                .collect();
            (penalized, bodies, plain)
        })
        .collect()
}

/// The five `bodies` on a `--batch 4 --prompt-cache-size 0` server of `model` with `flags`
/// (planted `plants` beside `BatchGathersFour`, which makes the first four requests start
/// together; the fifth arrives once they have started, waits for a free slot and joins the
/// rows still running): their texts and the server's /stats.
pub fn four_then_one(
    model: &Path,
    flags: &[&str],
    plants: &str,
    bodies: &[Value],
) -> (Vec<String>, Value) {
    let mut args = vec!["--batch", "4", "--prompt-cache-size", "0"];
    args.extend(flags);
    let server = serve_dir_with_env(
        model,
        &args,
        &[("ENGINE_PLANT", &format!("BatchGathersFour,{plants}"))],
    );
    let port = server.port;
    let spawn = |b: &Value| {
        let b = b.clone();
        std::thread::spawn(move || post(port, "/v1/completions", &b))
    };
    let mut handles: Vec<_> = bodies[..4].iter().map(spawn).collect();
    wait_for(port, "the four started", Duration::from_secs(60), |st| {
        st["running"].as_u64() > Some(0) || st["completed"].as_u64() > Some(0)
    });
    handles.push(spawn(&bodies[4]));
    let texts = handles
        .into_iter()
        .map(|h| {
            let (code, r) = h.join().unwrap();
            assert_eq!(code, 200, "{r}");
            r["choices"][0]["text"].as_str().unwrap().to_owned()
        })
        .collect();
    (texts, stats(port))
}
