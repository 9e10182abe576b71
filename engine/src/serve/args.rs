//! `engine serve`'s command line.

use std::path::PathBuf;

/// `engine serve` flags (mlx_lm.server's, where they mean the same here).
#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// Model directory in Hugging Face layout, or a hub repo id (`org/name[@revision]`)
    /// from the local Hugging Face cache (never downloaded). Repeatable: the first serves
    /// requests that name no model (docs/serve.md, "Many models").
    #[arg(long = "model", id = "models", value_name = "MODEL", value_parser = crate::load::hub::model_arg,
          required_unless_present = "models_dir")]
    pub models: Vec<PathBuf>,
    /// The model this process serves (the first `--model`; set by `run`).
    #[arg(skip)]
    pub model: PathBuf,
    /// Many models: every model directory (config.json + *.safetensors) or hub-cache repo
    /// (`models--org--name`) directly under this directory may be asked for by name.
    #[arg(long)]
    pub models_dir: Option<PathBuf>,
    /// Many models: how many may be loaded at once (least recently used unloads first).
    /// Default: the number of --pin models, at least 1.
    #[arg(long)]
    pub max_models: Option<usize>,
    /// Many models: unload a model after this many seconds without requests (0 = never).
    #[arg(long, default_value_t = 0.0, value_parser = seconds)]
    pub model_ttl: f64,
    /// Many models: keep this model (a name, as in /v1/models) loaded from startup on.
    /// Repeatable.
    #[arg(long)]
    pub pin: Vec<String>,
    /// Many models: how long a request waits for its model to load (or for room to load
    /// it) before a 503.
    #[arg(long, default_value_t = 300.0, value_parser = seconds)]
    pub load_timeout: f64,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port (0 picks a free one; the address is printed).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Default max_tokens of a request.
    #[arg(long, default_value_t = 512)]
    pub max_tokens: usize,
    /// Default sampling temperature.
    #[arg(long, default_value_t = 0.0)]
    pub temp: f64,
    /// Default nucleus sampling top-p.
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f64,
    /// Default top-k (0 = off).
    #[arg(long, default_value_t = 0)]
    pub top_k: i32,
    /// Default min-p (0 = off).
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f64,
    /// A chat template (Jinja source) to use instead of the tokenizer's.
    #[arg(long)]
    pub chat_template: Option<String>,
    /// Template kwargs for every chat request, as a JSON object (mlx_lm.server's
    /// --chat-template-args), e.g. '{"enable_thinking": false}'; a request's
    /// `chat_template_kwargs` go over them.
    #[arg(long, default_value = "{}")]
    pub chat_template_args: String,
    /// Prompt cache: how many entries (conversations' KV caches) to keep in RAM (0 = off).
    #[arg(long, default_value_t = 10)]
    pub prompt_cache_size: usize,
    /// Prompt cache: a cap on the bytes its entries hold (default: none).
    #[arg(long)]
    pub prompt_cache_bytes: Option<usize>,
    /// Prompt tokens per prefill chunk (mlx_lm.server's --prefill-step-size); in the batch
    /// lane, one chunk of an admitted prompt runs per decode step.
    #[arg(long, default_value_t = 2048)]
    pub prefill_step_size: usize,
    /// Batch lane: up to this many requests decode together in one forward (1 = the serial
    /// lane only). Full-attention models with dense caches only; others stay serial.
    #[arg(long, alias = "decode-concurrency", default_value_t = 1)]
    pub batch: usize,
    /// Speculative decoding: a smaller model sharing the tokenizer drafts tokens that the
    /// model verifies (mlx_lm.server's --draft-model). With --batch N the rows draft
    /// together in the batch lane where both models' caches are standard K/V (else the
    /// serial lane serves, and says why); requests with logits processors (penalties,
    /// logit bias) run without drafting. A directory or a hub repo id from the local
    /// cache, as --model.
    #[arg(long, value_parser = crate::load::hub::model_arg)]
    pub draft_model: Option<PathBuf>,
    /// A LoRA adapter to serve beside the model, as NAME=DIR (repeatable; DIR an mlx-lm
    /// adapter directory or a hub-cache id): requests pick it with `"model": "NAME"`.
    #[arg(long = "adapter", value_parser = super::adapters::flag)]
    pub adapter: Vec<super::adapters::Flag>,
    /// Tokens drafted per verify pass (γ).
    #[arg(long, default_value_t = 3)]
    pub num_draft_tokens: usize,
    /// SSD tier: keep conversation prefixes in kv-store files under this directory, so a
    /// restarted server resumes them (docs/kv-store.md). Off without it.
    #[arg(long)]
    pub ssd_cache: Option<PathBuf>,
    /// SSD tier: the most it may hold, in GiB.
    #[arg(long, default_value_t = 32.0)]
    pub ssd_cache_max: f64,
    /// SSD tier: also check every tensor's SHA-256 when restoring (the header hash and
    /// every tensor's xxh3-64 checksum are always checked).
    #[arg(long)]
    pub ssd_cache_verify: bool,
    /// SSD tier: write a finished conversation to disk once no request has arrived for this
    /// many milliseconds (RAM evictions and shutdown write at once).
    #[arg(long, default_value_t = 500)]
    pub ssd_cache_debounce_ms: u64,
    /// Do not open the chat page in a browser (it opens by default when stdout is an
    /// interactive terminal).
    #[arg(long)]
    pub no_open: bool,
    /// Require `Authorization: Bearer KEY` on every API route (OpenAI clients send their
    /// api_key so); the chat page asks for it. Also read from ENGINE_API_KEY.
    #[arg(long, env = "ENGINE_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Largest request body accepted, in bytes (images come inline, base64: raise it for
    /// large ones).
    #[arg(long, default_value_t = 4 << 20)]
    pub max_body_bytes: usize,
    /// Images given as `file://` paths (or absolute paths) are read from under this
    /// directory only; without it, only inline data: URLs and base64 blocks are read.
    #[arg(long, value_name = "DIR")]
    pub allow_local_files: Option<PathBuf>,
    /// Serve a vision checkpoint as a text model: its vision tower is not loaded (its
    /// memory saved) and requests with images are refused.
    #[arg(long)]
    pub text_only: bool,
    /// Most images one request may carry.
    #[arg(long, default_value_t = 8)]
    pub max_images_per_request: usize,
    /// Largest image accepted, in pixels (width × height, read from its header before it
    /// is decoded).
    #[arg(long, default_value_t = crate::vision::Limits::DEFAULT.max_pixels)]
    pub max_image_pixels: u64,
    /// Longest image side accepted, in pixels.
    #[arg(long, default_value_t = crate::vision::Limits::DEFAULT.max_side)]
    pub max_image_side: u32,
    /// Structured outputs: lexer fuel to compile one request's grammar (JSON schema,
    /// regex, Lark, strict tools); bounds its compile time (1M: ~20 ms). Over it: a 400.
    #[arg(long, default_value_t = crate::constrain::LIMITS.initial_lexer_fuel)]
    pub grammar_compile_fuel: u64,
    /// Structured outputs: lexer fuel per generated token's mask (200k: ~15 ms at worst).
    /// Over it, or over --grammar-step-items: the request ends with a 400 `grammar_error`.
    #[arg(long, default_value_t = crate::constrain::LIMITS.step_lexer_fuel)]
    pub grammar_step_fuel: u64,
    /// Structured outputs: Earley items per generated token's mask (50k: ~3 ms at worst).
    #[arg(long, default_value_t = crate::constrain::LIMITS.step_max_items)]
    pub grammar_step_items: usize,
    /// Cut a request whose client has read nothing for this many seconds while its answer
    /// waits (0 = never).
    #[arg(long, default_value_t = 5.0, value_parser = seconds)]
    pub stall_timeout: f64,
    /// Requests that may wait for the model (arrived, not yet running); more get 429 with
    /// Retry-After (0 = no cap).
    #[arg(long, default_value_t = 64)]
    pub max_queue: usize,
    /// A request's wall-clock limit in seconds from arrival, queueing included (0 = none);
    /// past it the request ends with a 504 error.
    #[arg(long, default_value_t = 600.0, value_parser = seconds)]
    pub request_timeout: f64,
    /// On SIGTERM / Ctrl-C: seconds running requests may take to finish before they are
    /// cut and the server exits.
    #[arg(long, default_value_t = 30.0, value_parser = seconds)]
    pub drain_timeout: f64,
    /// Serial lane: up to this many requests take turns, one token each (1 = one at a time,
    /// in arrival order).
    #[arg(long, default_value_t = 8)]
    pub interleave: usize,
    /// SSE streams: send a `: keep-alive` comment line after this many seconds without an
    /// event (0 = never), so that clients with idle timeouts stay connected while a long
    /// prompt prefills.
    #[arg(long, default_value_t = 5.0, value_parser = seconds)]
    pub sse_keep_alive: f64,
    /// `/v1/embeddings`: how an input's final hidden states become one vector: `last`
    /// (the last token's, as Qwen3-Embedding and sentence-transformers' "lasttoken") or
    /// `mean` (the mean over its tokens).
    #[arg(long, value_enum, default_value = "last")]
    pub embedding_pooling: crate::embed::Pooling,
    /// A bound on the memory the model's work holds (weights, KV caches, prompt cache,
    /// activations): bytes (`123456`, `6GB`, `512MiB`), a share of physical memory
    /// (`70%`) or `auto` (75%); requests that cannot fit get 400, requests that must
    /// wait for room get 429 after --budget-wait (docs/serve.md "Memory budget"). Off
    /// without it.
    #[arg(long)]
    pub memory_budget: Option<String>,
    /// With --memory-budget: seconds a request may wait for room before 429.
    #[arg(long, default_value_t = 5.0, value_parser = seconds)]
    pub budget_wait: f64,
    #[command(flatten)]
    pub tier: crate::tiers::TierArgs,
    /// Under mlx.launch: rank 0 serves HTTP, the other ranks follow it (docs/distributed.md).
    #[command(flatten)]
    pub dist: crate::dist::DistArgs,
}

impl ServeArgs {
    /// The image rules requests are read under (`serve::images`), `text_only` saying why
    /// this server reads none (None: it does); `--allow-local-files` is canonical here
    /// (`check_images` made it so at startup).
    pub fn image_rules(&self, text_only: Option<String>) -> super::images::Rules {
        super::images::Rules {
            local_dir: self.allow_local_files.clone(),
            max_images: self.max_images_per_request,
            limits: crate::vision::Limits {
                max_side: self.max_image_side,
                max_pixels: self.max_image_pixels,
            },
            text_only,
        }
    }

    /// Startup checks of the image flags; makes `--allow-local-files` canonical.
    pub fn check_images(&mut self) -> anyhow::Result<()> {
        if let Some(dir) = &self.allow_local_files {
            let real = dir.canonicalize().ok().filter(|d| d.is_dir());
            let Some(real) = real else {
                anyhow::bail!(
                    "--allow-local-files {}: not a directory; name an existing directory",
                    dir.display()
                );
            };
            self.allow_local_files = Some(real);
        }
        anyhow::ensure!(
            self.max_image_pixels > 0 && self.max_image_side > 0,
            "--max-image-pixels and --max-image-side must be above 0"
        );
        Ok(())
    }
}

/// The longest any seconds flag takes: ten years (a larger one is a typo; `Duration` itself
/// overflows past ~1.8e19 s and `inf` would panic there).
const MAX_SECONDS: f64 = 315_576_000.0;

/// A seconds flag (0 = none/never): a finite number, 0 or more, at most ten years.
fn seconds(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if (0.0..=MAX_SECONDS).contains(&v) => Ok(v),
        Ok(_) => Err(format!(
            "{s}: give a number of seconds from 0 (none) to {MAX_SECONDS} (ten years)"
        )),
        Err(_) => Err(format!("`{s}` is not a number of seconds")),
    }
}
