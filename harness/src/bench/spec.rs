//! `harness bench --suite spec`: speculative decoding's γ sweep, for both drafter kinds on
//! committed pairs whose drafts are sometimes right (random bench models would never agree,
//! so acceptance would mean nothing): tiny-llama-trained + tiny-llama-draft (mlx-lm's
//! speculative decoding; peer mlx-lm) and tiny-gemma4 + tiny-gemma4-assistant (optiq's
//! assistant drafter; peer mlx-optiq). The prompts are the target's L1 cases. Each leg is a
//! fresh process that runs every prompt greedily to --max-tokens (EOS does not stop it) at
//! one γ; γ = 0 is the same model without a drafter — the only baseline a speedup is
//! measured against. The peers run the same legs (`oracles/spec_leg.py`).
//!
//! Prompt lookup (no drafter; `LOOKUP_WORKLOADS`) runs the same legs with
//! `--draft-model prompt-lookup:N` (n-grams up to N): an edit-style task whose answer
//! repeats the prompt, and natural text beside it. Engine only: mlx-lm 0.32.2 has no
//! prompt lookup.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result};
use engine::generate::decode::Decoder;
use engine::generate::drafter::{Decode, Drafter};
use engine::generate::lookup::LookupParams;
use engine::generate::sampler::{Sampler, SamplingParams};
use engine::generate::{Flow, Session, SessionOptions};
use serde::{Deserialize, Serialize};

use super::median;

/// (target, drafter, the peer's stack name).
pub const PAIRS: [(&str, &str, &str); 2] = [
    ("tiny-llama-trained", "tiny-llama-draft", "mlx-lm"),
    ("tiny-gemma4", "tiny-gemma4-assistant", "mlx-optiq"),
];
pub const GAMMAS: [usize; 5] = [0, 1, 2, 3, 4];

/// What `leg-spec --draft-model` is given for a prompt-lookup leg: `prompt-lookup:N`, N
/// the longest n-gram matched.
pub const LOOKUP_DRAFTER: &str = "prompt-lookup";
/// Prompt lookup's γ sweep (10 is transformers' default) and its n-gram (its default, 2).
pub const LOOKUP_GAMMAS: [usize; 4] = [0, 2, 4, 10];
pub const LOOKUP_NGRAM: usize = engine::generate::lookup::DEFAULT_MAX_NGRAM;

/// Prompt lookup's workloads: the row label, and the prompts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Workload {
    /// The edit-style task on the bench model `tiny` (random weights): a seed of 64 ids and
    /// then the model's own greedy continuation of it (64 ids), so the answer continues a
    /// text the prompt already holds. No committed model follows an edit instruction; this
    /// one copies in the way its greedy decoding does, by going round the loop its text has
    /// entered (tiny-llama-trained does not: it copies a few ids at a time at best).
    Edit,
    /// tiny-llama-trained's L1 prompts: natural text, where drafts are copied only where
    /// the model repeats a phrase (a workload prompt lookup does not target).
    Text,
}

pub const LOOKUP_WORKLOADS: [Workload; 2] = [Workload::Edit, Workload::Text];

impl Workload {
    /// The row's model label.
    pub fn label(self) -> &'static str {
        match self {
            Workload::Edit => "tiny/edit",
            Workload::Text => "tiny-llama-trained/text",
        }
    }

    /// The model directory and the prompts.
    fn setup(self) -> Result<(PathBuf, Vec<Vec<u32>>)> {
        match self {
            Workload::Text => Ok((
                crate::goldens::model_dir("tiny-llama-trained")?,
                prompts("tiny-llama-trained")?,
            )),
            Workload::Edit => {
                let bench = super::models::TINY;
                let dir = bench.ensure()?;
                let model = engine::model::load(&dir)?;
                let prompts = (0..4)
                    .map(|seed| {
                        let mut ids = super::prompt_ids(64, bench.vocab, 100 + seed);
                        let mut more = Vec::new();
                        engine::generate::generate_greedy(
                            model.as_ref(),
                            &ids,
                            64,
                            &[],
                            |id, _| {
                                more.push(id);
                                Ok(Flow::Continue)
                            },
                        )?;
                        ids.extend(more);
                        Ok(ids)
                    })
                    .collect::<Result<Vec<_>>>()?;
                Ok((dir, prompts))
            }
        }
    }
}

/// `prompt-lookup:N` → Some(N); a directory → None.
fn lookup_arg(draft: &Path) -> Result<Option<usize>> {
    let Some(n) = draft.to_str().and_then(|s| s.strip_prefix(LOOKUP_DRAFTER)) else {
        return Ok(None);
    };
    let n = n.strip_prefix(':').unwrap_or("2");
    Ok(Some(n.parse().with_context(|| {
        format!("--draft-model {LOOKUP_DRAFTER}:N: `{n}` is not an n-gram size")
    })?))
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SpecLeg {
    pub stack: String,
    pub gamma: usize,
    pub ttft_s: f64,
    pub decode_tps: f64,
    pub drafted: usize,
    pub accepted: usize,
}

/// One engine leg in this process (`harness leg-spec`): totals over `prompts`, after one
/// discarded warm-up on the first.
pub fn leg(
    target: &Path,
    draft: &Path,
    prompts: &[Vec<u32>],
    max_tokens: usize,
    gamma: usize,
) -> Result<SpecLeg> {
    let t = engine::model::load(target)?;
    let lookup = lookup_arg(draft)?;
    let d = match lookup {
        Some(_) => None,
        None => {
            let tokenizer = engine::load::tokenizer::Tokenizer::load(target)?;
            Some(Drafter::load(draft, t.as_ref(), &tokenizer)?)
        }
    };
    let one = |ids: &[u32]| -> Result<(f64, usize, f64, usize, usize)> {
        let mut sampler = Sampler::new(SamplingParams::default())?;
        let mut times = Vec::new();
        let start = Instant::now();
        let mut target = Session::new(t.as_ref());
        let (drafted, accepted) = if gamma == 0 {
            times = engine::generate::bench::token_times(&mut target, ids, 0, max_tokens)?;
            (0, 0)
        } else {
            let opts = SessionOptions::default();
            let mut dec = Decoder::new(ids, max_tokens, &[], &mut sampler);
            let draft = d.as_ref().map(|d| {
                target.prefill_step = d.prefill_step();
                (d, gamma, d.make_caches())
            });
            let lookup = lookup
                .map(|n| LookupParams::new(gamma, Some(n)))
                .transpose()
                .map_err(|e| anyhow::anyhow!("prompt lookup: {}", e.message))?;
            let mut decode = Decode::start_with(target, draft, lookup, &opts, &mut dec, ids, 0)?;
            decode.run(&mut dec, &mut |_, _, _| -> Result<Flow> {
                times.push(Instant::now());
                Ok(Flow::Continue)
            })?;
            let s = decode.spec_stats().cloned().unwrap_or_default();
            decode.end()?;
            (s.drafted, s.accepted)
        };
        let (ttft, after_first, span) = engine::generate::bench::token_timing(start, &times);
        Ok((ttft, after_first, span, drafted, accepted))
    };
    one(&prompts[0])?;
    let (mut ttft, mut tokens, mut seconds, mut drafted, mut accepted) = (0.0, 0, 0.0, 0, 0);
    for ids in prompts {
        let (a, b, c, dr, ac) = one(ids)?;
        ttft += a;
        tokens += b;
        seconds += c;
        drafted += dr;
        accepted += ac;
    }
    Ok(SpecLeg {
        stack: "engine".into(),
        gamma,
        ttft_s: ttft / prompts.len() as f64,
        decode_tps: engine::generate::bench::decode_rate(tokens, seconds),
        drafted,
        accepted,
    })
}

fn run_leg(
    stack: &str,
    gamma: usize,
    dirs: (&Path, &Path),
    prompts: &Path,
    max_tokens: usize,
) -> Result<SpecLeg> {
    let mut cmd = if stack == "engine" {
        let mut c = Command::new(std::env::current_exe()?);
        c.arg("leg-spec");
        c
    } else {
        let mut c = Command::new(crate::oracle::python());
        c.arg(crate::oracle::repo_root().join("oracles/spec_leg.py"));
        c
    };
    cmd.arg("--model")
        .arg(dirs.0)
        .arg("--draft-model")
        .arg(dirs.1)
        .arg("--prompts")
        .arg(prompts)
        .arg("--max-tokens")
        .arg(max_tokens.to_string())
        .arg("--num-draft-tokens")
        .arg(gamma.to_string());
    super::run_json_leg(&mut cmd, &format!("{stack} γ={gamma}"))
}

/// Median legs per (stack, γ) of one pair, and every leg's figures (named as the results
/// DB's metrics: `g{γ}_decode_tps`, `g{γ}_ttft_ms`, `g{γ}_speedup_vs_nonspec`).
pub struct SpecResult {
    pub target: &'static str,
    pub draft: &'static str,
    pub legs: Vec<SpecLeg>,
    pub kept: super::kept::Kept,
    pub prompts: usize,
}

/// Keeps `leg`'s figures; a γ > 0 leg's speed-up is over the same stack's γ = 0 leg of the
/// same round (γ = 0 runs first in every sweep).
fn keep(kept: &mut super::kept::Kept, leg: &SpecLeg) {
    let g = leg.gamma;
    let mut figures = vec![
        (format!("g{g}_decode_tps"), leg.decode_tps),
        (format!("g{g}_ttft_ms"), leg.ttft_s * 1e3),
    ];
    if let Some(&plain) = kept.values(&leg.stack, "g0_decode_tps").last() {
        if g > 0 {
            figures.push((format!("g{g}_speedup_vs_nonspec"), leg.decode_tps / plain));
        }
    }
    kept.push(&leg.stack, figures);
}

/// The L1 cases' prompts of `target`.
fn prompts(target: &str) -> Result<Vec<Vec<u32>>> {
    let golden = crate::goldens::TensorGolden::open_index_only(&format!("l1/{target}"))?;
    golden.index["cases"]
        .as_array()
        .context("l1 index has no cases")?
        .iter()
        .map(|c| Ok(serde_json::from_value(c["prompt_ids"].clone())?))
        .collect()
}

/// Runs the sweep for every pair, then prompt lookup's on every workload.
pub fn run(rounds: usize, max_tokens: usize, peer: bool) -> Result<Vec<SpecResult>> {
    let mut results: Vec<SpecResult> = PAIRS
        .iter()
        .map(|&(target, draft, peer_stack)| {
            run_pair(
                target,
                draft,
                peer.then_some(peer_stack),
                rounds,
                max_tokens,
            )
        })
        .collect::<Result<_>>()?;
    for w in LOOKUP_WORKLOADS {
        results.push(run_lookup(w, rounds, max_tokens)?);
    }
    Ok(results)
}

/// Prompt lookup's γ sweep on one workload (engine legs only, γ = 0 plain decoding).
pub fn run_lookup(w: Workload, rounds: usize, max_tokens: usize) -> Result<SpecResult> {
    let (dir, prompts) = w.setup()?;
    let tmp = tempfile::tempdir()?;
    let file: PathBuf = tmp.path().join("prompts.json");
    std::fs::write(&file, serde_json::to_string(&prompts)?)?;
    let drafter = PathBuf::from(format!("{LOOKUP_DRAFTER}:{LOOKUP_NGRAM}"));
    let bar = super::Progress::new("spec", rounds * LOOKUP_GAMMAS.len());
    let mut all = Vec::new();
    let mut kept = super::kept::Kept::default();
    for _ in 0..rounds {
        for gamma in LOOKUP_GAMMAS {
            bar.start(format!("{} + {LOOKUP_DRAFTER} · γ={gamma}", w.label()));
            let leg = run_leg("engine", gamma, (&dir, &drafter), &file, max_tokens)?;
            keep(&mut kept, &leg);
            all.push(leg);
            bar.done();
        }
    }
    bar.finish();
    Ok(SpecResult {
        target: w.label(),
        draft: LOOKUP_DRAFTER,
        legs: medians(&all, &["engine"], &LOOKUP_GAMMAS),
        kept,
        prompts: prompts.len(),
    })
}

/// The median leg per (stack, γ).
fn medians(all: &[SpecLeg], stacks: &[&str], gammas: &[usize]) -> Vec<SpecLeg> {
    let mut legs = Vec::new();
    for &stack in stacks {
        for &gamma in gammas {
            let mine: Vec<&SpecLeg> = all
                .iter()
                .filter(|l| l.stack == stack && l.gamma == gamma)
                .collect();
            legs.push(SpecLeg {
                stack: stack.into(),
                gamma,
                ttft_s: median(mine.iter().map(|l| l.ttft_s).collect()),
                decode_tps: median(mine.iter().map(|l| l.decode_tps).collect()),
                drafted: mine[0].drafted,
                accepted: mine[0].accepted,
            });
        }
    }
    legs
}

fn run_pair(
    target_name: &'static str,
    draft_name: &'static str,
    peer: Option<&'static str>,
    rounds: usize,
    max_tokens: usize,
) -> Result<SpecResult> {
    let target = crate::goldens::model_dir(target_name)?;
    let draft = crate::goldens::model_dir(draft_name)?;
    let prompts = prompts(target_name)?;
    let tmp = tempfile::tempdir()?;
    let file: PathBuf = tmp.path().join("prompts.json");
    std::fs::write(&file, serde_json::to_string(&prompts)?)?;
    let mut stacks: Vec<&'static str> = vec!["engine"];
    stacks.extend(peer);
    let order = super::leg_order(rounds, &stacks);
    let bar = super::Progress::new("spec", order.len() * GAMMAS.len());
    let mut all = Vec::new();
    let mut kept = super::kept::Kept::default();
    for stack in order {
        for gamma in GAMMAS {
            bar.start(format!(
                "{target_name} + {draft_name} · {stack} · γ={gamma}"
            ));
            let leg = run_leg(stack, gamma, (&target, &draft), &file, max_tokens)?;
            keep(&mut kept, &leg);
            all.push(leg);
            bar.done();
        }
    }
    bar.finish();
    Ok(SpecResult {
        target: target_name,
        draft: draft_name,
        legs: medians(&all, &stacks, &GAMMAS),
        kept,
        prompts: prompts.len(),
    })
}

impl SpecResult {
    fn baseline(&self, stack: &str) -> f64 {
        self.legs
            .iter()
            .find(|l| l.stack == stack && l.gamma == 0)
            .map_or(f64::NAN, |l| l.decode_tps)
    }

    /// (stack, γ, metric, value, unit) rows; speedups are against the same stack's γ = 0.
    pub fn rows(&self) -> Vec<(String, usize, &'static str, f64, &'static str)> {
        let mut rows = Vec::new();
        for l in &self.legs {
            rows.push((
                l.stack.clone(),
                l.gamma,
                "decode_tps",
                l.decode_tps,
                "tok/s",
            ));
            rows.push((l.stack.clone(), l.gamma, "ttft_ms", l.ttft_s * 1e3, "ms"));
            if l.gamma > 0 {
                let acc = 100.0 * l.accepted as f64 / l.drafted.max(1) as f64;
                rows.push((l.stack.clone(), l.gamma, "acceptance_pct", acc, "%"));
                let speedup = l.decode_tps / self.baseline(&l.stack);
                rows.push((l.stack.clone(), l.gamma, "speedup_vs_nonspec", speedup, "x"));
            }
        }
        rows
    }

    pub fn table(&self) -> String {
        let mut s = format!(
            "spec {} + drafter {} ({} prompts, greedy)\n  stack      γ   decode tok/s  speedup  acceptance\n",
            self.target, self.draft, self.prompts
        );
        for l in &self.legs {
            let speedup = l.decode_tps / self.baseline(&l.stack);
            let acc = if l.gamma == 0 {
                "—".to_owned()
            } else {
                format!(
                    "{}/{} ({:.0}%)",
                    l.accepted,
                    l.drafted,
                    100.0 * l.accepted as f64 / l.drafted.max(1) as f64
                )
            };
            s += &format!(
                "  {:9} {:2}   {:11.1}  {:6.2}×  {acc}\n",
                l.stack, l.gamma, l.decode_tps, speedup
            );
        }
        let peer = self
            .legs
            .iter()
            .map(|l| l.stack.as_str())
            .find(|s| *s != "engine");
        for g in self
            .legs
            .iter()
            .filter(|l| l.stack == "engine")
            .map(|l| l.gamma)
        {
            let names = [
                format!("g{g}_decode_tps"),
                format!("g{g}_speedup_vs_nonspec"),
            ];
            let kinds = [
                (names[0].as_str(), "tok/s", true),
                (names[1].as_str(), "×", true),
            ];
            s += &self.kept.lines(&kinds, "engine", peer);
        }
        s
    }
}
