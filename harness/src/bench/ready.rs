//! `harness bench --suite ready`: how soon a server started on a model gives its first
//! answer — from spawning the process to the first streamed token of a one-token
//! completion, polled from the moment of the spawn — for `engine serve` (`harness
//! leg-serve`, the same `engine::serve::run`) and `mlx_lm.server`, on the same model, ABBA
//! over the rounds. Everything a user waits for is inside: loading the libraries, the
//! weights, the tokenizer and the chat template, binding the port, the first request.
//!
//! The model is `gemma3-vocab-tiny`: 6 small layers and the real Gemma 3 tokenizer (262 k
//! ids, a 33 MB tokenizer.json), so the figure is what a Gemma-3-sized tokenizer costs.

use std::time::{Duration, Instant};

use anyhow::{bail, Result};

use super::kept::Kept;

/// The bench model the suite runs on.
pub const MODEL: &str = "gemma3-vocab-tiny";

/// The longest a server may take to give its first answer.
const LIMIT: Duration = Duration::from_secs(180);

/// One leg: spawn `stack`'s server and time its first answer (ms).
fn leg(stack: &str, model: &std::path::Path) -> Result<f64> {
    let start = Instant::now();
    let server = super::serve::spawn(stack, model, 1)?;
    loop {
        let mut answered = false;
        let attempt =
            super::serve::stream_completion(server.port, "Hello", 1, LIMIT, |_| answered = true);
        if attempt.is_ok() && answered {
            return Ok(start.elapsed().as_secs_f64() * 1e3);
        }
        if start.elapsed() > LIMIT {
            bail!("the {stack} server gave no answer within {LIMIT:?}: {attempt:?}");
        }
        // Not listening yet (refused), or listening and not answering yet.
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Every leg's `ready_ms`, stacks ABBA over `rounds`.
pub fn run(rounds: usize, peer: bool) -> Result<Kept> {
    let model = super::models::by_name(MODEL).expect("a built-in bench model");
    let mut stacks = vec!["engine"];
    if peer {
        stacks.push("mlx-lm");
    }
    let order = super::leg_order(rounds, &stacks);
    let progress = super::Progress::new("ready", order.len());
    progress.start(format!("preparing bench model {MODEL}"));
    let dir = model.ensure()?;
    let mut kept = Kept::default();
    for stack in order {
        progress.start(format!("{MODEL} · {stack}"));
        let ms = leg(stack, &dir)?;
        kept.push(stack, [("ready_ms".to_owned(), ms)]);
        progress.done();
    }
    progress.finish();
    Ok(kept)
}
