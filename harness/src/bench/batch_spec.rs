//! `harness bench --suite batch-spec`: speculation inside the batch lane (issue 43 item 4)
//! — prompt lookup, and a draft model — against the plain batch lane and against the same
//! speculation on the serial lane, engine legs only (mlx-lm 0.32.2 has neither prompt lookup
//! nor speculation in its batch generator). Each leg is a fresh `engine serve` (`harness
//! leg-serve`); `CLIENTS` clients at once each stream `per_client` greedy completions of
//! texts that repeat themselves (where lookup finds drafts). Per leg: the median per-stream
//! decode tok/s, the throughput (tokens over the leg's wall time) and, when it speculates,
//! the share of drafts accepted (/stats).
//!
//! One workload, `text`: the model's own answers to four prompts that repeat themselves.
//! An edit-style workload (an answer that copies the prompt, where lookup pays most) needs a
//! model that copies: tiny-llama-trained does not (a prompt holding its own continuation
//! twice gets 0–6 of 12–40 drafts accepted), and the bench models that loop have no
//! tokenizer for a server (the spec suite's `tiny/edit` rows run them in process).
//!
//! Stacks: `engine` is the batch lane with lookup, `engine-batch-draft` the batch lane with
//! the draft model (`DRAFTER`, the spec suite's pair); their peers are `engine-batch-plain`
//! (the same lane, no speculation), `engine-serial-lookup` and `engine-serial-draft`
//! (`--batch 1`: one request at a time, each speculating the same way).

use std::time::Instant;

use anyhow::{Context, Result};

use super::kept::Kept;
use super::median;
use super::serve::Sample;

/// The committed model the suite runs on.
pub const MODEL: &str = "tiny-llama-trained";
/// Clients at once (and the batch lane's rows).
pub const CLIENTS: usize = 4;
/// γ and the longest n-gram of the lookup legs.
pub const GAMMA: usize = 4;
pub const MAX_NGRAM: usize = 2;
/// Client i sends `PROMPTS[i % 4]`.
pub const PROMPTS: [&str; 4] = [
    "On Monday the robot cleans the table. On Tuesday the robot sorts the bolts. On",
    "One, two, three, four, five, six, seven, eight, nine, ten. Two and two make four.",
    "The days of the week are Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and",
    "The little robot went to the market. The little robot bought a clock. The little robot",
];

/// The drafter of the draft-model legs (tiny-llama-trained's in the spec suite).
pub const DRAFTER: &str = "tiny-llama-draft";

/// How a stack's requests speculate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Speculate {
    No,
    /// Prompt lookup, asked for by each request.
    Lookup,
    /// The server's draft model (`--draft-model DRAFTER --num-draft-tokens GAMMA`).
    Draft,
}

/// (stack, `--batch`, how it speculates).
pub const STACKS: [(&str, usize, Speculate); 5] = [
    ("engine", CLIENTS, Speculate::Lookup),
    ("engine-batch-plain", CLIENTS, Speculate::No),
    ("engine-serial-lookup", 1, Speculate::Lookup),
    ("engine-batch-draft", CLIENTS, Speculate::Draft),
    ("engine-serial-draft", 1, Speculate::Draft),
];

/// The comparisons the suite reports: (stack, against).
pub const PAIRS: [(&str, &str); 4] = [
    ("engine", "engine-batch-plain"),
    ("engine", "engine-serial-lookup"),
    ("engine-batch-draft", "engine-batch-plain"),
    ("engine-batch-draft", "engine-serial-draft"),
];

/// Workloads (figures are named `{figure}_{workload}`).
pub const WORKLOADS: [&str; 1] = ["text"];

/// The figures of one leg per workload, named `{figure}_{workload}`: (name, unit, higher is
/// better).
pub const FIGURES: [(&str, &str, bool); 3] = [
    ("decode_tps_per_stream", "tok/s", true),
    ("throughput_tps", "tok/s", true),
    ("accepted_pct", "%", true),
];

/// One streamed request, timed.
fn request(port: u16, prompt: &str, max_tokens: usize, how: Speculate) -> Result<Sample> {
    let mut body = serde_json::json!({
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": true,
    });
    if how == Speculate::Lookup {
        body["prompt_lookup_num_tokens"] = GAMMA.into();
        body["max_matching_ngram_size"] = MAX_NGRAM.into();
    }
    super::serve::timed_stream(port, &body, Instant::now())
}

/// `CLIENTS` clients at once, each sending `per_client` requests (client i: `prompts[i % 4]`)
/// to the server on `port`: the figures of `workload`.
fn clients(
    port: u16,
    prompts: &[String],
    workload: &str,
    (per_client, max_tokens, how): (usize, usize, Speculate),
) -> Result<Vec<(String, f64)>> {
    let spec = || -> Result<(f64, f64)> {
        let (_, body) = super::serve::get(port, "/stats")?;
        let st: serde_json::Value = serde_json::from_str(&body).context("/stats")?;
        let n = |k: &str| st["speculative"][k].as_f64().unwrap_or(0.0);
        Ok((n("drafted"), n("accepted")))
    };
    let (drafted0, accepted0) = spec()?;
    let prompts: Vec<String> = prompts.to_vec();
    let (samples, wall) = super::serve::fan_out(CLIENTS, per_client, move |i| {
        request(port, &prompts[i % prompts.len()], max_tokens, how)
    })?;
    let (drafted, accepted) = spec()?;
    let tokens: usize = samples.iter().map(|s| s.tokens).sum();
    let name = |i: usize| format!("{}_{workload}", FIGURES[i].0);
    let mut figures = vec![
        (
            name(0),
            median(samples.iter().map(|s| s.decode_tps).collect()),
        ),
        (name(1), tokens as f64 / wall),
    ];
    if how != Speculate::No {
        let share = 100.0 * (accepted - accepted0) / (drafted - drafted0).max(1.0);
        figures.push((name(2), share));
    }
    Ok(figures)
}

/// One leg of `stack`: a fresh server on `model`, a warm-up request, then each workload.
fn leg(
    stack: &str,
    model: &std::path::Path,
    workloads: &[(&str, Vec<String>)],
    per_client: usize,
    max_tokens: usize,
) -> Result<Vec<(String, f64)>> {
    let &(_, batch, how) = STACKS
        .iter()
        .find(|(s, _, _)| *s == stack)
        .expect("a stack of STACKS");
    let extra = match how {
        Speculate::Draft => {
            let drafter = super::serve::model_dir(DRAFTER)?;
            vec![
                "--draft-model".to_owned(),
                drafter.display().to_string(),
                "--num-draft-tokens".to_owned(),
                GAMMA.to_string(),
            ]
        }
        _ => Vec::new(),
    };
    let server = super::serve::start_with("engine", model, batch, &extra)?;
    request(server.port, PROMPTS[0], max_tokens, how)?;
    let mut figures = Vec::new();
    for (workload, prompts) in workloads {
        let leg = (per_client, max_tokens, how);
        figures.extend(clients(server.port, prompts, workload, leg)?);
    }
    Ok(figures)
}

/// Every leg, stacks ABBA over `rounds`.
pub fn run(rounds: usize, per_client: usize, max_tokens: usize) -> Result<Kept> {
    let dir = super::serve::model_dir(MODEL)?;
    let stacks: Vec<&'static str> = STACKS.iter().map(|s| s.0).collect();
    let order = super::leg_order(rounds, &stacks);
    let progress = super::Progress::new("batch-spec", order.len());
    let text: Vec<String> = PROMPTS.iter().map(|p| p.to_string()).collect();
    let workloads = [(WORKLOADS[0], text)];
    let mut kept = Kept::default();
    for stack in order {
        progress.start(format!("{MODEL} · {stack}"));
        let figures = leg(stack, &dir, &workloads, per_client, max_tokens)
            .with_context(|| format!("the {stack} leg"))?;
        kept.push(stack, figures);
        progress.done();
    }
    progress.finish();
    Ok(kept)
}
