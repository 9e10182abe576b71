//! `engine train`: LoRA fine-tuning from the command line (mlx_lm.lora's flags where they
//! exist), SFT or ORPO, with a progress bar; adapters and `metrics.jsonl` go to
//! `--adapter-path`.

use std::path::PathBuf;

use anyhow::Context;
use serde_json::json;

use super::data::{read_jsonl, Encoder};
use super::lambda::{ControllerConfig, Eps, Law};
use super::lora::{AdapterConfig, Adapters, LoraParams};
use super::optim::{AdamW, Schedule};
use super::orpo::SftScope;
use super::preference_cli::{PairMethod, PrefArgs};
use super::trainer::{Dataset, Method, Metrics, TrainConfig};
use crate::load::template::ChatTemplate;
use crate::load::tokenizer::Tokenizer;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum MethodArg {
    Sft,
    Orpo,
    Grpo,
    Dpo,
    Cpo,
    Simpo,
}

impl MethodArg {
    /// The pair objective this method trains (None: sft, orpo, grpo).
    fn pair_method(self) -> Option<PairMethod> {
        match self {
            MethodArg::Sft | MethodArg::Orpo | MethodArg::Grpo => None,
            MethodArg::Dpo => Some(PairMethod::Dpo),
            MethodArg::Cpo => Some(PairMethod::Cpo),
            MethodArg::Simpo => Some(PairMethod::Simpo),
        }
    }
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
    /// Model directory in Hugging Face layout, or a hub repo id (`org/name[@revision]`)
    /// from the local Hugging Face cache (never downloaded).
    #[arg(long, value_parser = crate::load::hub::model_arg)]
    pub model: PathBuf,
    /// Directory with train.jsonl (and valid.jsonl for validation), mlx-lm's formats.
    #[arg(long)]
    pub data: PathBuf,
    /// sft (next-token cross-entropy), or a preference method on pairs: orpo, dpo, cpo,
    /// simpo (docs/training.md).
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
    /// mlx-lm's --fine-tune-type: lora, dora (`DoRALinear`: a learned magnitude per output
    /// row over the normalized adapted weight) or full (every weight of the last
    /// --num-layers blocks; docs/training.md).
    #[arg(long, default_value = "lora", value_parser = ["lora", "dora", "full"])]
    pub fine_tune_type: String,
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
    /// ORPO, DPO, CPO, SimPO: the forward over chosen and rejected (prefix-shared: the
    /// prompt both share runs once per pair; joint: one forward of 2B rows, TRL's; the same
    /// losses, the same gradients up to rounding, prefix-shared with less memory and time).
    /// Segmented runs are joint.
    #[arg(long, value_enum, default_value = "prefix-shared")]
    pub orpo_forward: super::orpo_prefix::OrpoForward,
    /// Segmented backward: run the backward this many blocks at a time (less memory; the
    /// same loss and gradients).
    #[arg(long)]
    pub segment_size: Option<usize>,
    /// Chunked cross-entropy: apply the head and the loss this many tokens at a time, so
    /// the full [tokens × vocab] logits never exist (the same loss and gradients; ORPO runs
    /// its joint forward). Off: the whole logits.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub loss_chunk: Option<u64>,
    /// The objective's weight fixed (static) or moved by the dynamic-λ controller after
    /// each eval (adaptive; docs/dynamic-lambda.md): ORPO's λ, or the weight
    /// --adaptive-weight names for dpo, cpo and simpo.
    #[arg(
        long,
        value_enum,
        default_value = "static",
        visible_alias = "weight-schedule"
    )]
    pub orpo_lambda_schedule: LambdaScheduleArg,
    /// The weight the adaptive schedule moves: lambda (orpo), beta (dpo, cpo, simpo) or
    /// gamma (simpo) [default: the method's: lambda, beta, beta, gamma].
    #[arg(long, value_enum)]
    pub adaptive_weight: Option<super::lambda::Actuated>,
    /// The adaptive schedule's control law.
    #[arg(long, value_enum, default_value = "aimd")]
    pub lambda_law: LambdaLawArg,
    #[command(flatten)]
    pub lambda_knobs: LambdaKnobs,
    /// DPO, CPO, SimPO: β, label smoothing, loss type, α, γ.
    #[command(flatten)]
    pub pref: PrefArgs,
    /// The training step compiled (one MLX graph per batch shape) or eager: auto times
    /// both on the first batch and keeps the faster (docs/training.md).
    #[arg(long, value_enum, default_value = "auto")]
    pub compile_step: super::compiled::CompileStep,
    #[command(flatten)]
    pub grpo: super::grpo_cli::GrpoArgs,
    /// No progress bar or messages (metrics.jsonl is still written).
    #[arg(long)]
    pub quiet: bool,
}

/// The dynamic-λ controller's knobs (`--orpo-lambda-schedule adaptive`; the design's
/// defaults, docs/dynamic-lambda.md).
#[derive(clap::Args, Debug, Clone)]
pub struct LambdaKnobs {
    /// λ's floor (and its value in warm-up and after a hard stop).
    #[arg(long, default_value_t = 0.05)]
    pub lambda_min: f64,
    #[arg(long, default_value_t = 0.5)]
    pub lambda_max: f64,
    /// The ramp's additive step per eval.
    #[arg(long, default_value_t = 0.05)]
    pub lambda_step: f64,
    /// The back-off's multiplier per eval.
    #[arg(long, default_value_t = 0.5)]
    pub lambda_backoff: f64,
    /// Evals a condition must hold for a phase flip (warm-up's end, the hold after recovery).
    #[arg(long, default_value_t = 3)]
    pub lambda_k: usize,
    /// SFT saturated below this |ΔLw|: a number, or a multiple of the measured noise
    /// (standard error) of ΔLw between evals, e.g. 2sigma.
    #[arg(long, default_value = "2sigma")]
    pub lambda_eps_sft: Eps,
    /// Displacement past this fall of ℓw: a number or a noise multiple, e.g. 2sigma.
    #[arg(long, default_value = "2sigma")]
    pub lambda_eps_disp: Eps,
    /// "ΔLr ≪ 0": ℓr falling by more than this many ε_disp (with ℓw not rising).
    #[arg(long, default_value_t = 3.0)]
    pub lambda_lr_drop: f64,
    /// Hard stop: ℓw this far below its value at the start of warm-up.
    #[arg(long, default_value_t = 1.0)]
    pub lambda_hard_drop: f64,
    /// P/PD/PID gains and the slope window (evals).
    #[arg(long, default_value_t = 0.5)]
    pub lambda_kp: f64,
    #[arg(long, default_value_t = 0.25)]
    pub lambda_kd: f64,
    #[arg(long, default_value_t = 0.1)]
    pub lambda_ki: f64,
    #[arg(long, default_value_t = 4)]
    pub lambda_window: usize,
}

impl LambdaKnobs {
    fn config(&self, law: Law) -> ControllerConfig {
        ControllerConfig {
            law,
            min: self.lambda_min,
            max: self.lambda_max,
            step: self.lambda_step,
            backoff: self.lambda_backoff,
            k: self.lambda_k,
            eps_sft: self.lambda_eps_sft,
            eps_disp: self.lambda_eps_disp,
            lr_drop: self.lambda_lr_drop,
            hard_drop: self.lambda_hard_drop,
            kp: self.lambda_kp,
            kd: self.lambda_kd,
            ki: self.lambda_ki,
            window: self.lambda_window,
        }
    }
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
    args.check_pair_flags().map_err(anyhow::Error::msg)?;
    let model = crate::model::load(&args.model)
        .with_context(|| format!("loading model from {}", args.model.display()))?;
    if args.loss_chunk.is_some() && super::segmented::layered(model.as_ref()).is_none() {
        anyhow::bail!(super::chunked::refusal(model.model_type()));
    }
    if args.segment_size.is_some() && super::segmented::layered(model.as_ref()).is_none() {
        anyhow::bail!(
            "{}; train this model without it",
            super::segmented::refusal(model.model_type())
        );
    }
    let tokenizer = Tokenizer::load(&args.model)?;
    let template = ChatTemplate::from_tokenizer(&tokenizer)?;
    let encoder = Encoder {
        tokenizer: &tokenizer,
        template: template.as_ref(),
    };
    if args.method == MethodArg::Grpo {
        return super::grpo_cli::run(&args.grpo_run(), model.as_ref(), &tokenizer, &encoder);
    }
    let (mut train_set, mut valid_set) = args.datasets(&encoder)?;
    let adaptive = args.orpo_lambda_schedule == LambdaScheduleArg::Adaptive;
    if adaptive && valid_set.is_none() {
        anyhow::bail!(super::lambda::needs_validation(
            &args.data.display().to_string()
        ));
    }
    let adapter_config = args.adapter_config();
    let adapters = Adapters::attach(model.as_ref(), adapter_config.clone(), args.seed)?;
    let mut opt = AdamW::new(args.schedule(), args.weight_decay);
    let cfg = args.train_config();
    let scored = super::preference_data::fill_reference(
        model.as_ref(),
        &adapters,
        &cfg.method,
        &mut [Some(&mut train_set), valid_set.as_mut()],
        args.batch_size,
    )?;
    if scored > 0 && !args.quiet {
        println!("reference log-probs: {scored} pairs scored by the base model (adapters off)");
    }
    super::compiled_probe::refuse(args.compile_step, &adapters, &train_set, &cfg)?;
    std::fs::create_dir_all(&args.adapter_path)?;
    let mut metrics = args.open_metrics(&cfg, &adapter_config)?;
    let mut steps = super::compiled_probe::Steps::new(
        model.as_ref(),
        &adapters,
        &train_set,
        &cfg,
        args.compile_step,
        &mut metrics,
    )?;
    let bar = super::progress::bar(args.quiet, args.iters);
    super::trainer::train_with(
        model.as_ref(),
        &adapters,
        &mut opt,
        &train_set,
        valid_set.as_ref(),
        &cfg,
        &mut metrics,
        &args.adapter_path,
        &mut steps,
        |r, eval| super::progress::show(&bar, args.quiet, r, eval),
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

impl TrainArgs {
    /// The training set (train.jsonl, required) and the validation set (valid.jsonl, if
    /// there is one), encoded for the method.
    fn datasets(&self, encoder: &Encoder) -> anyhow::Result<(Dataset, Option<Dataset>)> {
        let load = |name: &str| -> anyhow::Result<Option<Dataset>> {
            let file = self.data.join(name);
            if !file.exists() {
                return Ok(None);
            }
            Ok(Some(match self.method {
                MethodArg::Sft => {
                    Dataset::Sft(read_jsonl(&file, |v| encoder.sft(v, self.mask_prompt))?)
                }
                MethodArg::Orpo => Dataset::Orpo(read_jsonl(&file, |v| encoder.pair(v))?),
                MethodArg::Grpo => unreachable!("GRPO reads its prompts in grpo_cli"),
                m => Dataset::Pairs(super::preference_data::read_pairs(
                    &file,
                    encoder,
                    &self.pref.objective(m.pair_method().expect("a pair method")),
                    self.max_seq_length,
                )?),
            }))
        };
        let train_set = load("train.jsonl")?.with_context(|| {
            format!(
                "{} has no train.jsonl (one JSON example per line)",
                self.data.display()
            )
        })?;
        Ok((train_set, load("valid.jsonl")?))
    }

    /// Refuses flags the method does not take (before anything is loaded or written).
    fn check_pair_flags(&self) -> Result<(), String> {
        let pair = self.method.pair_method();
        self.pref.check(pair)?;
        self.actuated().map(|_| ())
    }

    /// The weight the controller moves (checked against the method).
    fn actuated(&self) -> Result<super::lambda::Actuated, String> {
        let method = clap::ValueEnum::to_possible_value(&self.method).expect("a named method");
        super::preference_cli::actuated_weight(
            method.get_name(),
            self.orpo_lambda_schedule == LambdaScheduleArg::Adaptive,
            self.adaptive_weight,
        )
    }

    /// What a GRPO run reads of these flags.
    fn grpo_run(&self) -> super::grpo_cli::GrpoRun<'_> {
        super::grpo_cli::GrpoRun {
            grpo: &self.grpo,
            model: &self.model,
            data: &self.data,
            adapter_path: &self.adapter_path,
            iters: self.iters,
            batch_size: self.batch_size,
            max_seq_length: self.max_seq_length,
            max_grad_norm: self.max_grad_norm,
            steps_per_eval: self.steps_per_eval,
            save_every: self.save_every,
            seed: self.seed,
            quiet: self.quiet,
            lora_dropout: self.lora_dropout,
            segmented: self.segment_size.is_some() || self.loss_chunk.is_some(),
            grad_accumulation_steps: self.grad_accumulation_steps,
            learning_rate: self.learning_rate,
            weight_decay: self.weight_decay,
            adapter_config: self.adapter_config(),
            schedule: self.schedule(),
        }
    }

    /// The adapters' settings, as adapter_config.json records them.
    fn adapter_config(&self) -> AdapterConfig {
        let scale = match self.lora_alpha {
            Some(alpha) if self.rslora => alpha / (self.lora_rank as f32).sqrt(),
            Some(alpha) => alpha / self.lora_rank as f32,
            None => self.lora_scale,
        };
        AdapterConfig {
            fine_tune_type: self.fine_tune_type.clone(),
            num_layers: self.num_layers,
            lora_parameters: LoraParams {
                rank: self.lora_rank,
                scale,
                dropout: self.lora_dropout,
                keys: (!self.lora_keys.is_empty()).then(|| self.lora_keys.clone()),
            },
            extra: Default::default(),
        }
    }

    /// The learning-rate schedule.
    fn schedule(&self) -> Schedule {
        match self.lr_schedule {
            ScheduleArg::Constant => Schedule::Constant(self.learning_rate),
            ScheduleArg::Cosine => Schedule::WarmupCosine {
                warmup: self.warmup,
                warmup_init: 0.0,
                peak: self.learning_rate,
                decay_steps: (self.iters as u64).saturating_sub(self.warmup).max(1),
                end: self.min_learning_rate,
            },
        }
    }

    /// The trainer's settings.
    fn train_config(&self) -> TrainConfig {
        TrainConfig {
            method: match self.method {
                MethodArg::Sft => Method::Sft,
                MethodArg::Orpo => Method::Orpo,
                MethodArg::Grpo => unreachable!("GRPO runs from grpo_cli"),
                m => Method::Pairs(self.pref.objective(m.pair_method().expect("a pair method"))),
            },
            iters: self.iters,
            batch_size: self.batch_size,
            grad_accumulation: self.grad_accumulation_steps,
            max_grad_norm: self.max_grad_norm,
            steps_per_eval: self.steps_per_eval,
            val_batches: self.val_batches,
            save_every: self.save_every,
            max_seq_length: self.max_seq_length,
            seed: self.seed,
            orpo_lambda: self.orpo_lambda,
            sft_scope: match self.sft_scope {
                ScopeArg::Full => SftScope::Full,
                ScopeArg::Response => SftScope::Response,
            },
            segment_size: self.segment_size,
            orpo_forward: self.orpo_forward,
            actuated: self.actuated().expect("checked before loading"),
            loss_chunk: self.loss_chunk.map(|n| n as usize),
            lambda_controller: (self.orpo_lambda_schedule == LambdaScheduleArg::Adaptive).then(
                || {
                    self.lambda_knobs.config(match self.lambda_law {
                        LambdaLawArg::Aimd => Law::Aimd,
                        LambdaLawArg::P => Law::P,
                        LambdaLawArg::Pd => Law::Pd,
                        LambdaLawArg::Pid => Law::Pid,
                    })
                },
            ),
        }
    }

    /// `<adapter path>/metrics.jsonl`, headed by the run's settings.
    fn open_metrics(&self, cfg: &TrainConfig, lora: &AdapterConfig) -> anyhow::Result<Metrics> {
        Ok(Metrics::create(
            &self.adapter_path.join("metrics.jsonl"),
            json!({
                "model": self.model.display().to_string(),
                "data": self.data.display().to_string(),
                "config": cfg,
                "lora": lora,
                "learning_rate": self.learning_rate,
                "lr_schedule": format!("{:?}", self.lr_schedule).to_lowercase(),
                "warmup": self.warmup,
                "weight_decay": self.weight_decay,
                "engine": crate::VERSION,
                "started": crate::clock::now_utc(),
            }),
        )?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: TrainArgs,
    }

    #[test]
    fn lambda_knobs_reach_the_controller() {
        let dir = env!("CARGO_MANIFEST_DIR");
        let base = [
            "train",
            "--model",
            dir,
            "--data",
            dir,
            "--method",
            "orpo",
            "--orpo-lambda-schedule",
        ];
        let parse = |extra: &[&str]| {
            let argv = base.iter().chain(extra).copied();
            Cli::try_parse_from(argv).unwrap().args.train_config()
        };
        let c = parse(&["adaptive", "--lambda-max", "0.8", "--lambda-k", "5"])
            .lambda_controller
            .unwrap();
        let d = ControllerConfig::new(Law::Aimd);
        assert_eq!((c.max, c.k, c.min, c.step), (0.8, 5, d.min, d.step));
        let c = parse(&[
            "adaptive",
            "--lambda-eps-disp",
            "0.03",
            "--lambda-eps-sft",
            "3sigma",
        ])
        .lambda_controller
        .unwrap();
        assert_eq!(
            (c.eps_disp, c.eps_sft),
            (Eps::Fixed(0.03), Eps::Sigmas(3.0))
        );
        assert!(parse(&["static"]).lambda_controller.is_none());
    }
}
