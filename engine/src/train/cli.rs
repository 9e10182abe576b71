//! `engine train`: LoRA fine-tuning from the command line (mlx_lm.lora's flags where they
//! exist), SFT or ORPO, with a progress bar; adapters and `metrics.jsonl` go to
//! `--adapter-path`.

use std::path::PathBuf;

use anyhow::Context;
use serde_json::json;

use super::data::{read_jsonl, Encoder};
use super::lora::{AdapterConfig, Adapters, LoraParams};
use super::optim::{AdamW, Schedule};
use super::orpo::SftScope;
use super::trainer::{train, Dataset, Method, Metrics, TrainConfig};
use crate::load::template::ChatTemplate;
use crate::load::tokenizer::Tokenizer;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum MethodArg {
    Sft,
    Orpo,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ScopeArg {
    Full,
    Response,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ScheduleArg {
    Constant,
    Cosine,
}

#[derive(clap::Args, Debug)]
pub struct TrainArgs {
    /// Model directory in Hugging Face layout.
    #[arg(long)]
    pub model: PathBuf,
    /// Directory with train.jsonl (and valid.jsonl for validation), mlx-lm's formats.
    #[arg(long)]
    pub data: PathBuf,
    /// sft (next-token cross-entropy) or orpo (preference pairs).
    #[arg(long, value_enum, default_value = "sft")]
    pub method: MethodArg,
    /// Where adapters.safetensors, adapter_config.json and metrics.jsonl go.
    #[arg(long, default_value = "adapters")]
    pub adapter_path: PathBuf,
    #[arg(long, default_value_t = 1000)]
    pub iters: usize,
    #[arg(long, default_value_t = 4)]
    pub batch_size: usize,
    #[arg(long, default_value_t = 1e-5)]
    pub learning_rate: f64,
    /// constant, or cosine decay to --min-learning-rate over --iters (after the warm-up).
    #[arg(long, value_enum, default_value = "cosine")]
    pub lr_schedule: ScheduleArg,
    /// Linear warm-up steps from 0 (cosine schedule).
    #[arg(long, default_value_t = 0)]
    pub warmup: u64,
    #[arg(long, default_value_t = 0.0)]
    pub min_learning_rate: f64,
    #[arg(long, default_value_t = 0.01)]
    pub weight_decay: f64,
    #[arg(long, default_value_t = 1)]
    pub grad_accumulation_steps: usize,
    /// Clip gradients to this global norm (off by default).
    #[arg(long)]
    pub max_grad_norm: Option<f32>,
    #[arg(long, default_value_t = 200)]
    pub steps_per_eval: usize,
    /// Validation batches per eval (0 = the whole validation set).
    #[arg(long, default_value_t = 25)]
    pub val_batches: usize,
    #[arg(long, default_value_t = 100)]
    pub save_every: usize,
    #[arg(long, default_value_t = 2048)]
    pub max_seq_length: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Blocks (from the last) that get adapters.
    #[arg(long, default_value_t = 16)]
    pub num_layers: usize,
    #[arg(long, default_value_t = 8)]
    pub lora_rank: i32,
    /// mlx-lm's LoRA scale (the multiplier itself).
    #[arg(long, default_value_t = 20.0, conflicts_with = "lora_alpha")]
    pub lora_scale: f32,
    /// LoRA alpha: scale = alpha / rank (or alpha / √rank with --rslora).
    #[arg(long)]
    pub lora_alpha: Option<f32>,
    #[arg(long, requires = "lora_alpha")]
    pub rslora: bool,
    #[arg(long, default_value_t = 0.0)]
    pub lora_dropout: f32,
    /// Linear layers to adapt, e.g. self_attn.q_proj,self_attn.v_proj (default: all).
    #[arg(long, value_delimiter = ',')]
    pub lora_keys: Vec<String>,
    /// SFT: supervise only the completion (chat-shaped data).
    #[arg(long)]
    pub mask_prompt: bool,
    /// ORPO: the odds-ratio weight λ.
    #[arg(long, default_value_t = 0.1)]
    pub orpo_lambda: f32,
    /// ORPO: what the NLL term covers (full: prompt and response, as TRL; response only).
    #[arg(long, value_enum, default_value = "full")]
    pub sft_scope: ScopeArg,
    /// Segmented backward: run the backward this many blocks at a time (less memory; the
    /// same loss and gradients).
    #[arg(long)]
    pub segment_size: Option<usize>,
    /// ORPO: λ fixed (static) or moved by the dynamic-λ controller after each eval
    /// (adaptive; docs/dynamic-lambda.md).
    #[arg(long, value_enum, default_value = "static")]
    pub orpo_lambda_schedule: LambdaScheduleArg,
    /// The adaptive schedule's control law.
    #[arg(long, value_enum, default_value = "aimd")]
    pub lambda_law: LambdaLawArg,
    /// No progress bar or messages (metrics.jsonl is still written).
    #[arg(long)]
    pub quiet: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LambdaScheduleArg {
    Static,
    Adaptive,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LambdaLawArg {
    Aimd,
    P,
    Pd,
    Pid,
}

pub fn run(args: TrainArgs) -> anyhow::Result<()> {
    let model = crate::model::load(&args.model)
        .with_context(|| format!("loading model from {}", args.model.display()))?;
    if args.segment_size.is_some() && model.as_layered().is_none() {
        anyhow::bail!(
            "--segment-size is not available for model_type `{}` yet (the llama family and \
             gemma3_text have it); train this model without it",
            model.model_type()
        );
    }
    let tokenizer = Tokenizer::load(&args.model)?;
    let template = ChatTemplate::from_tokenizer(&tokenizer)?;
    let encoder = Encoder {
        tokenizer: &tokenizer,
        template: template.as_ref(),
    };
    let load = |name: &str| -> anyhow::Result<Option<Dataset>> {
        let file = args.data.join(name);
        if !file.exists() {
            return Ok(None);
        }
        Ok(Some(match args.method {
            MethodArg::Sft => {
                Dataset::Sft(read_jsonl(&file, |v| encoder.sft(v, args.mask_prompt))?)
            }
            MethodArg::Orpo => Dataset::Orpo(read_jsonl(&file, |v| encoder.pair(v))?),
        }))
    };
    let train_set = load("train.jsonl")?.with_context(|| {
        format!(
            "{} has no train.jsonl (one JSON example per line)",
            args.data.display()
        )
    })?;
    let valid_set = load("valid.jsonl")?;
    let scale = match args.lora_alpha {
        Some(alpha) if args.rslora => alpha / (args.lora_rank as f32).sqrt(),
        Some(alpha) => alpha / args.lora_rank as f32,
        None => args.lora_scale,
    };
    let adapter_config = AdapterConfig {
        fine_tune_type: "lora".into(),
        num_layers: args.num_layers,
        lora_parameters: LoraParams {
            rank: args.lora_rank,
            scale,
            dropout: args.lora_dropout,
            keys: (!args.lora_keys.is_empty()).then(|| args.lora_keys.clone()),
        },
        extra: Default::default(),
    };
    let adapters = Adapters::attach(model.as_ref(), adapter_config.clone(), args.seed)?;
    let schedule = match args.lr_schedule {
        ScheduleArg::Constant => Schedule::Constant(args.learning_rate),
        ScheduleArg::Cosine => Schedule::WarmupCosine {
            warmup: args.warmup,
            warmup_init: 0.0,
            peak: args.learning_rate,
            decay_steps: (args.iters as u64).saturating_sub(args.warmup).max(1),
            end: args.min_learning_rate,
        },
    };
    let mut opt = AdamW::new(schedule, args.weight_decay);
    let cfg = TrainConfig {
        method: match args.method {
            MethodArg::Sft => Method::Sft,
            MethodArg::Orpo => Method::Orpo,
        },
        iters: args.iters,
        batch_size: args.batch_size,
        grad_accumulation: args.grad_accumulation_steps,
        max_grad_norm: args.max_grad_norm,
        steps_per_eval: args.steps_per_eval,
        val_batches: args.val_batches,
        save_every: args.save_every,
        max_seq_length: args.max_seq_length,
        seed: args.seed,
        orpo_lambda: args.orpo_lambda,
        sft_scope: match args.sft_scope {
            ScopeArg::Full => SftScope::Full,
            ScopeArg::Response => SftScope::Response,
        },
        segment_size: args.segment_size,
        lambda_controller: (args.orpo_lambda_schedule == LambdaScheduleArg::Adaptive).then(|| {
            use super::lambda::{ControllerConfig, Law};
            ControllerConfig::new(match args.lambda_law {
                LambdaLawArg::Aimd => Law::Aimd,
                LambdaLawArg::P => Law::P,
                LambdaLawArg::Pd => Law::Pd,
                LambdaLawArg::Pid => Law::Pid,
            })
        }),
    };
    std::fs::create_dir_all(&args.adapter_path)?;
    let mut metrics = Metrics::create(
        &args.adapter_path.join("metrics.jsonl"),
        json!({
            "model": args.model.display().to_string(),
            "data": args.data.display().to_string(),
            "config": cfg,
            "lora": adapter_config,
            "learning_rate": args.learning_rate,
            "lr_schedule": format!("{:?}", args.lr_schedule).to_lowercase(),
            "warmup": args.warmup,
            "weight_decay": args.weight_decay,
            "engine": crate::VERSION,
            "started": crate::clock::now_utc(),
        }),
    )?;
    let bar = if args.quiet {
        indicatif::ProgressBar::hidden()
    } else {
        indicatif::ProgressBar::new(args.iters as u64)
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} {msg} ({elapsed}<{eta})")
            .expect("valid template"),
    );
    train(
        model.as_ref(),
        &adapters,
        &mut opt,
        &train_set,
        valid_set.as_ref(),
        &cfg,
        &mut metrics,
        &args.adapter_path,
        |r, eval| match eval {
            Some(m) => {
                let parts: Vec<String> = m.iter().map(|(k, v)| format!("{k} {v:.4}")).collect();
                bar.println(format!("step {}: eval {}", r.step, parts.join(", ")));
            }
            None => {
                bar.set_position(r.step as u64);
                bar.set_message(format!(
                    "loss {:.4} lr {:.2e} {:.0} tok/s",
                    r.loss, r.lr, r.tokens_per_s
                ));
            }
        },
    )?;
    bar.finish();
    if args.quiet {
        return Ok(());
    }
    println!(
        "adapters: {} (load with --adapter-path in mlx_lm or `engine generate`)",
        args.adapter_path.display()
    );
    Ok(())
}
