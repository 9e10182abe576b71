//! `engine train --method grpo`'s flags and run: prompts from `train.jsonl` /
//! `valid.jsonl` (`{"prompt": …, other fields the rewards read}`), the reward spec, and
//! `grpo_train::train_grpo`. Everything a run reads is checked before its first step, and
//! nothing is written before that.

use std::path::PathBuf;

use anyhow::Context;
use serde_json::json;

use super::data::{read_jsonl, Encoder};
use super::grpo::{GrpoLoss, GrpoLossConfig, RewardScale};
use super::grpo_train::{train_grpo, GrpoConfig, GrpoExample};
use super::lora::{AdapterConfig, Adapters};
use super::optim::{AdamW, Schedule};
use super::reward::Rewards;
use super::trainer::Metrics;
use crate::load::tokenizer::Tokenizer;
use crate::model::LanguageModel;

/// GRPO's flags (TRL 1.16's `GRPOConfig` names and defaults).
#[derive(clap::Args, Debug, Clone)]
pub struct GrpoArgs {
    /// GRPO: the reward functions, a JSON list (docs/training.md: exact_match, regex,
    /// json_schema, length, http).
    #[arg(long)]
    pub reward_spec: Option<PathBuf>,
    /// GRPO: completions sampled per prompt (TRL's num_generations).
    #[arg(long, default_value_t = 8)]
    pub grpo_group_size: usize,
    /// GRPO: the longest completion sampled, in tokens.
    #[arg(long, default_value_t = 256)]
    pub max_completion_length: usize,
    /// GRPO: the sampling temperature (the log-probabilities are of logits / temperature).
    #[arg(long, default_value_t = 1.0)]
    pub grpo_temperature: f32,
    /// GRPO: optimizer steps per generation (TRL's num_iterations, μ).
    #[arg(long, default_value_t = 1)]
    pub grpo_iterations: usize,
    /// GRPO: how per-token losses are reduced (TRL's loss_type).
    #[arg(long, value_enum, default_value = "dapo")]
    pub grpo_loss: GrpoLoss,
    /// GRPO: the clip range's lower ε (and the upper one without --grpo-epsilon-high).
    #[arg(long, default_value_t = 0.2)]
    pub grpo_epsilon: f32,
    #[arg(long)]
    pub grpo_epsilon_high: Option<f32>,
    /// GRPO: the KL weight β toward the base model (0: no reference pass).
    #[arg(long, default_value_t = 0.0)]
    pub grpo_beta: f32,
    /// GRPO: advantages divided by the group's reward std, the batch's, or not at all.
    #[arg(long, value_enum, default_value = "group")]
    pub grpo_scale_rewards: RewardScale,
    /// GRPO: completions per forward and backward of the update (default: --batch-size, as
    /// mlx-lm-lora, so the group size does not multiply the update's peak memory). The
    /// gradients add up to the whole batch's either way; 0: all rows at once.
    #[arg(long)]
    pub grpo_micro_batch: Option<usize>,
}

impl GrpoArgs {
    fn check(&self) -> anyhow::Result<()> {
        let bad = |what: &str| anyhow::anyhow!("{what}");
        if self.grpo_group_size < 2 {
            return Err(bad(
                "--grpo-group-size must be at least 2: advantages compare completions of one prompt",
            ));
        }
        if self.max_completion_length == 0 {
            return Err(bad("--max-completion-length must be at least 1"));
        }
        if !(self.grpo_temperature.is_finite() && self.grpo_temperature > 0.0) {
            return Err(bad("--grpo-temperature must be a positive number"));
        }
        let eps = [Some(self.grpo_epsilon), self.grpo_epsilon_high];
        if eps.iter().flatten().any(|e| !(e.is_finite() && *e >= 0.0)) || self.grpo_epsilon >= 1.0 {
            return Err(bad(
                "--grpo-epsilon must be in [0, 1) and --grpo-epsilon-high ≥ 0",
            ));
        }
        if !(self.grpo_beta.is_finite() && self.grpo_beta >= 0.0) {
            return Err(bad("--grpo-beta must be a number ≥ 0"));
        }
        Ok(())
    }
}

/// The prompts of one jsonl file, each checked: its prompt renders, leaves room for a
/// completion within `max_seq_length`, and carries every field the rewards read.
fn prompts(
    file: &std::path::Path,
    encoder: &Encoder,
    rewards: &Rewards,
    max_seq_length: usize,
) -> anyhow::Result<Vec<GrpoExample>> {
    let fields = rewards.required_fields();
    Ok(read_jsonl(file, |v| {
        let (prompt, text) = encoder.grpo_prompt(v)?;
        if prompt.len() >= max_seq_length {
            return Err(format!(
                "the prompt is {} tokens, which leaves no room for a completion within \
                 --max-seq-length {max_seq_length}: shorten it or raise the limit",
                prompt.len()
            ));
        }
        if let Some(f) = fields.iter().find(|f| !v[**f].is_string()) {
            return Err(format!(
                "the reward spec's exact_match reads `{f}`, a string this line lacks"
            ));
        }
        Ok(GrpoExample {
            prompt,
            text,
            line: v.clone(),
        })
    })?)
}

/// What a GRPO run reads of `engine train`'s flags.
pub struct GrpoRun<'a> {
    pub grpo: &'a GrpoArgs,
    pub model: &'a std::path::Path,
    pub data: &'a std::path::Path,
    pub adapter_path: &'a std::path::Path,
    pub iters: usize,
    pub batch_size: usize,
    pub max_seq_length: usize,
    pub max_grad_norm: Option<f32>,
    pub steps_per_eval: usize,
    pub save_every: usize,
    pub seed: u64,
    pub quiet: bool,
    pub lora_dropout: f32,
    /// --segment-size or --loss-chunk (not taken by GRPO).
    pub segmented: bool,
    pub grad_accumulation_steps: usize,
    pub learning_rate: f64,
    pub weight_decay: f64,
    pub adapter_config: AdapterConfig,
    pub schedule: Schedule,
}

/// `engine train --method grpo` after the model and tokenizer are loaded.
pub fn run(
    args: &GrpoRun,
    model: &dyn LanguageModel,
    tokenizer: &Tokenizer,
    encoder: &Encoder,
) -> anyhow::Result<()> {
    let g = &args.grpo;
    g.check()?;
    if args.lora_dropout > 0.0 {
        anyhow::bail!(
            "--lora-dropout with --method grpo: completions are sampled with the adapters as \
             they stand, so train GRPO without dropout"
        );
    }
    if args.segmented || args.grad_accumulation_steps > 1 {
        anyhow::bail!(
            "--segment-size, --loss-chunk and --grad-accumulation-steps are not supported \
             with --method grpo; drop them (raise --batch-size or --grpo-group-size instead)"
        );
    }
    let opts = crate::generate::SessionOptions::default();
    if let Some(why) = crate::generate::batch::refusal(model, &opts) {
        anyhow::bail!("GRPO samples its groups with the batched decoder, which refuses {why}");
    }
    let spec = g
        .reward_spec
        .as_ref()
        .context("--method grpo needs --reward-spec FILE (a JSON list of reward functions)")?;
    let text =
        std::fs::read_to_string(spec).with_context(|| format!("reading {}", spec.display()))?;
    let rewards = Rewards::parse(&text).map_err(|e| anyhow::anyhow!("{}: {e}", spec.display()))?;
    let file = args.data.join("train.jsonl");
    if !file.exists() {
        anyhow::bail!(
            "{} has no train.jsonl (one {{\"prompt\"}} per line)",
            args.data.display()
        );
    }
    let train = prompts(&file, encoder, &rewards, args.max_seq_length)?;
    let valid_file = args.data.join("valid.jsonl");
    let valid = if valid_file.exists() {
        Some(prompts(
            &valid_file,
            encoder,
            &rewards,
            args.max_seq_length,
        )?)
    } else {
        None
    };
    let cfg = GrpoConfig {
        iters: args.iters,
        batch_size: args.batch_size,
        group_size: g.grpo_group_size,
        max_completion_length: g.max_completion_length,
        temperature: g.grpo_temperature,
        iterations: g.grpo_iterations.max(1),
        scale_rewards: g.grpo_scale_rewards,
        loss: GrpoLossConfig {
            loss_type: g.grpo_loss,
            epsilon_low: g.grpo_epsilon,
            epsilon_high: g.grpo_epsilon_high.unwrap_or(g.grpo_epsilon),
            beta: g.grpo_beta,
            max_completion_length: g.max_completion_length,
        },
        micro_batch: g.grpo_micro_batch.unwrap_or(args.batch_size),
        max_grad_norm: args.max_grad_norm,
        steps_per_eval: args.steps_per_eval,
        save_every: args.save_every,
        seed: args.seed,
    };
    let adapter_config = args.adapter_config.clone();
    let adapters = Adapters::attach(model, adapter_config.clone(), args.seed)?;
    let mut opt = AdamW::new(args.schedule.clone(), args.weight_decay);
    std::fs::create_dir_all(args.adapter_path)?;
    let mut metrics = Metrics::create(
        &args.adapter_path.join("metrics.jsonl"),
        json!({
            "model": args.model.display().to_string(),
            "data": args.data.display().to_string(),
            "method": "grpo",
            "grpo": cfg,
            "reward_spec": serde_json::from_str::<serde_json::Value>(&text)?,
            "lora": adapter_config,
            "learning_rate": args.learning_rate,
            "weight_decay": args.weight_decay,
            "engine": crate::VERSION,
            "started": crate::clock::now_utc(),
        }),
    )?;
    let bar = super::progress::bar(args.quiet, args.iters);
    train_grpo(
        model,
        tokenizer,
        &adapters,
        &mut opt,
        &train,
        valid.as_deref(),
        &rewards,
        &cfg,
        &mut metrics,
        args.adapter_path,
        |r, eval| super::progress::show(&bar, args.quiet, r, eval),
    )?;
    bar.finish();
    Ok(())
}
