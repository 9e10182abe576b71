//! `harness bench --suite spec`: speculative decoding's γ sweep, for both drafter kinds on
//! committed pairs whose drafts are sometimes right (random bench models would never agree,
//! so acceptance would mean nothing): tiny-llama-trained + tiny-llama-draft (mlx-lm's
//! speculative decoding; peer mlx-lm) and tiny-gemma4 + tiny-gemma4-assistant (optiq's
//! assistant drafter; peer mlx-optiq). The prompts are the target's L1 cases. Each leg is a
//! fresh process that runs every prompt greedily to --max-tokens (EOS does not stop it) at
//! one γ; γ = 0 is the same model without a drafter — the only baseline a speedup is
//! measured against. The peers run the same legs (`oracles/spec_leg.py`).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result};
use engine::generate::decode::Decoder;
use engine::generate::drafter::{Decode, Drafter};
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
    let tokenizer = engine::load::tokenizer::Tokenizer::load(target)?;
    let d = Drafter::load(draft, t.as_ref(), &tokenizer)?;
    let one = |ids: &[u32]| -> Result<(f64, usize, f64, usize, usize)> {
        let mut sampler = Sampler::new(SamplingParams::default())?;
        let mut times = Vec::new();
        let start = Instant::now();
        let mut target = Session::new(t.as_ref());
        let (drafted, accepted) = if gamma == 0 {
            times = engine::generate::bench::token_times(&mut target, ids, 0, max_tokens)?;
            (0, 0)
        } else {
            target.prefill_step = d.prefill_step();
            let opts = SessionOptions::default();
            let mut dec = Decoder::new(ids, max_tokens, &[], &mut sampler);
            let draft = Some((&d, gamma, d.make_caches()));
            let mut decode = Decode::start(target, draft, &opts, &mut dec, ids, 0)?;
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

/// Median legs per (stack, γ) of one pair.
pub struct SpecResult {
    pub target: &'static str,
    pub draft: &'static str,
    pub legs: Vec<SpecLeg>,
    pub prompts: usize,
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

/// Runs the sweep for every pair.
pub fn run(rounds: usize, max_tokens: usize, peer: bool) -> Result<Vec<SpecResult>> {
    PAIRS
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
        .collect()
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
    let bar = indicatif::ProgressBar::new((order.len() * GAMMAS.len()) as u64);
    bar.set_message(format!("{target_name} + {draft_name}"));
    let mut all = Vec::new();
    for stack in order {
        for gamma in GAMMAS {
            all.push(run_leg(stack, gamma, (&target, &draft), &file, max_tokens)?);
            bar.inc(1);
        }
    }
    bar.finish_and_clear();
    let mut legs = Vec::new();
    for stack in stacks {
        for gamma in GAMMAS {
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
    Ok(SpecResult {
        target: target_name,
        draft: draft_name,
        legs,
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
        s
    }
}
