use std::io::{Read, Write};
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use engine::generate::decode::Decoder;
use engine::generate::drafter::Decode;
use engine::generate::sampler::{Sampler, SamplingParams};
use engine::generate::stop::TextStream;
use engine::generate::{self as gen, Finish, Flow};
use engine::load::template::{ChatTemplate, RenderArgs};
use engine::load::tokenizer::Tokenizer;
use engine::runtime;
use engine::serve::tools::infer_thinking;

mod images;

/// An LLM engine on MLX.
#[derive(Parser)]
#[command(name = "engine", disable_version_flag = true)]
struct Cli {
    /// Print the engine version, the MLX runtime version, the backend and the default device.
    #[arg(short = 'V', long)]
    version: bool,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Check the MLX runtime: versions, where libmlx came from, memory counters, a self-check.
    Doctor,
    /// Generate text from a prompt (greedy), streaming it to stdout; stats go to stderr.
    Generate(Box<GenerateArgs>),
    /// Serve the model over an OpenAI-compatible HTTP API (a drop-in for mlx_lm.server).
    Serve(Box<engine::serve::ServeArgs>),
    /// Fine-tune LoRA adapters (SFT or ORPO) on jsonl data; writes mlx-lm-format adapters.
    Train(Box<engine::train::cli::TrainArgs>),
    /// Convert a Hugging Face model dir to MLX (dtype cast, quantization), as mlx_lm.convert.
    Convert(Box<engine::convert::ConvertArgs>),
    /// Fuse LoRA / DoRA adapters into the base model, as mlx_lm.fuse.
    Fuse(Box<engine::convert::fuse::FuseArgs>),
}

/// `engine generate`: mlx_lm.generate's flags where they mean the same here (names, short
/// forms and defaults), plus ours (stop strings, penalties, logit bias, tiers).
#[derive(clap::Args)]
struct GenerateArgs {
    /// Model directory in Hugging Face layout (config.json, *.safetensors, tokenizer.json),
    /// or a hub repo id (`org/name[@revision]`) from the local Hugging Face cache (never
    /// downloaded).
    #[arg(long, value_parser = engine::load::hub::model_arg)]
    model: PathBuf,
    /// The message to the model ('-' reads it from stdin); `\n` and `\t` as typed become a
    /// newline and a tab. Wrapped as a user turn with the model's chat template unless
    /// --ignore-chat-template or the model has none.
    #[arg(long, short = 'p', default_value = "hello", allow_hyphen_values = true)]
    prompt: String,
    /// Use the raw prompt without the model's chat template.
    #[arg(long, conflicts_with = "chat")]
    ignore_chat_template: bool,
    /// Apply the chat template (the default already; an error if the model has none).
    #[arg(long)]
    chat: bool,
    /// A system message for the chat template (`--system` is the older spelling).
    #[arg(long, visible_alias = "system", allow_hyphen_values = true)]
    system_prompt: Option<String>,
    /// The start of the assistant's answer: the template continues that message.
    #[arg(long, allow_hyphen_values = true)]
    prefill_response: Option<String>,
    /// More arguments for the chat template, as a JSON object, e.g. '{"enable_thinking": false}'.
    #[arg(long)]
    chat_template_config: Option<String>,
    /// Tokens (strings or ids) that also end generation.
    #[arg(long, num_args = 1..)]
    extra_eos_token: Vec<String>,
    /// Maximum number of tokens to generate.
    #[arg(long, short = 'm', default_value_t = 100)]
    max_tokens: usize,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    temp: f64,
    /// Nucleus sampling: keep the most likely tokens up to this probability mass (1 or 0 = off).
    #[arg(long, default_value_t = 1.0)]
    top_p: f64,
    /// Keep only the k most likely tokens (0 = off).
    #[arg(long, default_value_t = 0)]
    top_k: i32,
    /// Drop tokens under min_p × the top token's probability (0 = off).
    #[arg(long, default_value_t = 0.0)]
    min_p: f64,
    /// Tokens min-p sampling always keeps.
    #[arg(long, default_value_t = 1)]
    min_tokens_to_keep: i32,
    /// Seed of the sampler's random key sequence.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Prompt tokens processed per forward pass (default 2048).
    #[arg(long)]
    prefill_step_size: Option<usize>,
    /// Multiplicative penalty on tokens among the last --repetition-context-size.
    #[arg(long)]
    repetition_penalty: Option<f64>,
    #[arg(long, default_value_t = 20)]
    repetition_context_size: usize,
    /// Additive penalty on tokens present in the last 20.
    #[arg(long)]
    presence_penalty: Option<f64>,
    /// Additive penalty per occurrence in the last 20.
    #[arg(long)]
    frequency_penalty: Option<f64>,
    #[command(flatten)]
    tier: engine::tiers::TierArgs,
    /// LoRA adapters to apply (a directory with adapters.safetensors and
    /// adapter_config.json, as `engine train` or mlx_lm.lora writes it).
    #[arg(long)]
    adapter_path: Option<PathBuf>,
    /// Speculative decoding: a smaller model sharing the tokenizer drafts tokens that the
    /// model verifies (mlx_lm.generate's --draft-model); a directory or a hub repo id, as
    /// --model.
    #[arg(long, value_parser = engine::load::hub::model_arg)]
    draft_model: Option<PathBuf>,
    /// Tokens drafted per verify pass (γ).
    #[arg(long, default_value_t = 2)]
    num_draft_tokens: usize,
    /// Prompt-lookup decoding (speculation without a draft model): up to N tokens per
    /// verify pass copied from what followed the latest earlier occurrence of the last
    /// tokens in the prompt and the text so far (transformers' prompt_lookup_num_tokens;
    /// vLLM's ngram num_speculative_tokens). `--prompt-lookup` alone drafts 10.
    #[arg(long, visible_alias = "prompt-lookup", value_name = "N", num_args = 0..=1,
          default_missing_value = "10", conflicts_with = "draft_model")]
    prompt_lookup_num_tokens: Option<usize>,
    /// The longest n-gram prompt lookup matches; shorter ones down to 1 are tried when it
    /// finds none (transformers' max_matching_ngram_size, vLLM's prompt_lookup_max; default 2).
    #[arg(
        long,
        visible_alias = "prompt-lookup-max",
        value_name = "N",
        requires = "prompt_lookup_num_tokens"
    )]
    max_matching_ngram_size: Option<usize>,
    /// Stop when the generated text contains this string (repeatable); the stop string
    /// itself is not printed.
    #[arg(long)]
    stop: Vec<String>,
    /// Additive logit bias, e.g. `50:2.0,100:-5`.
    #[arg(long, value_delimiter = ',', value_parser = parse_bias)]
    logit_bias: Vec<(u32, f32)>,
    /// Constrain the answer to the JSON schema in FILE (structured output).
    #[arg(long, value_name = "FILE", conflicts_with_all = ["regex", "grammar"])]
    json_schema: Option<PathBuf>,
    /// Constrain the answer to match this regex.
    #[arg(long, conflicts_with = "grammar")]
    regex: Option<String>,
    /// Constrain the answer to the Lark grammar in FILE (llguidance's dialect).
    #[arg(long, value_name = "FILE")]
    grammar: Option<PathBuf>,
    /// Print prompt and generation tok/s and peak memory after the text (as mlx_lm.generate:
    /// `--verbose False` prints only the response).
    #[arg(long, default_value = "true", value_parser = parse_bool, action = clap::ArgAction::Set)]
    verbose: bool,
    /// Refuse up front (before the prefill) a prompt + --max-tokens that cannot fit in this
    /// much memory: bytes (6GB, 512MiB), a share of physical memory (70%) or auto, as
    /// `engine serve --memory-budget` (docs/serve.md "Memory budget").
    #[arg(long)]
    memory_budget: Option<String>,
    /// As a rank under mlx.launch (tensor parallel, or --pipeline).
    #[command(flatten)]
    dist: engine::dist::DistArgs,
    /// An image for the prompt (repeatable; PNG, JPEG, WebP or GIF), for a model with a
    /// vision tower this engine runs (gemma3, Qwen3-VL): the prompt is built as
    /// mlx_vlm.generate builds it (docs/vision.md).
    #[arg(long, value_name = "PATH")]
    image: Vec<PathBuf>,
    /// Largest --image accepted, in pixels (width × height, read from its header before it
    /// is decoded).
    #[arg(long, default_value_t = engine::vision::Limits::DEFAULT.max_pixels)]
    max_image_pixels: u64,
}

/// mlx-lm's `str2bool`: true/t/1/yes and false/f/0/no, any case.
fn parse_bool(s: &str) -> Result<bool, String> {
    match s.to_ascii_lowercase().as_str() {
        "true" | "t" | "1" | "yes" => Ok(true),
        "false" | "f" | "0" | "no" => Ok(false),
        _ => Err(format!("`{s}`: expected True or False")),
    }
}

fn parse_bias(s: &str) -> Result<(u32, f32), String> {
    let (id, bias) = s
        .split_once(':')
        .ok_or_else(|| format!("`{s}`: expected TOKEN_ID:BIAS"))?;
    Ok((
        id.trim()
            .parse()
            .map_err(|_| format!("`{id}` is not a token id"))?,
        bias.trim()
            .parse()
            .map_err(|_| format!("`{bias}` is not a number"))?,
    ))
}

impl GenerateArgs {
    /// The prompt-lookup settings, checked (None without --prompt-lookup).
    fn lookup(&self) -> Result<Option<gen::lookup::LookupParams>> {
        let Some(n) = self.prompt_lookup_num_tokens else {
            return Ok(None);
        };
        gen::lookup::LookupParams::new(n, self.max_matching_ngram_size)
            .map(Some)
            .map_err(|e| {
                let flag = match e.field {
                    "num_tokens" => "--prompt-lookup-num-tokens",
                    _ => "--max-matching-ngram-size",
                };
                anyhow::anyhow!("{flag}: {}", e.message)
            })
    }

    fn sampling(&self) -> SamplingParams {
        SamplingParams {
            temp: self.temp,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            min_tokens_to_keep: self.min_tokens_to_keep,
            seed: self.seed,
            repetition_penalty: self.repetition_penalty,
            repetition_context_size: self.repetition_context_size,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            logit_bias: self.logit_bias.clone(),
            ..SamplingParams::default()
        }
    }
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Some(Command::Doctor) => doctor(),
        Some(Command::Generate(args)) => generate(*args),
        Some(Command::Serve(args)) => engine::serve::run(*args),
        Some(Command::Train(args)) => engine::train::cli::run(*args),
        Some(Command::Convert(args)) => engine::convert::convert(&args),
        Some(Command::Fuse(args)) => engine::convert::fuse::fuse(&args),
        None if cli.version => {
            print_version();
            Ok(())
        }
        None => {
            use clap::CommandFactory;
            Cli::command().print_help()?;
            Ok(())
        }
    }
}

impl GenerateArgs {
    /// The grammar of --json-schema, --regex or --grammar (checked: it compiles).
    fn constraint(&self) -> Result<Option<engine::constrain::Grammar>> {
        use engine::constrain::Grammar;
        let read = |p: &PathBuf| {
            std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))
        };
        let grammar = if let Some(p) = &self.json_schema {
            let schema = serde_json::from_str(&read(p)?)
                .with_context(|| format!("--json-schema: {} is not JSON", p.display()))?;
            Grammar::JsonSchema(schema)
        } else if let Some(r) = &self.regex {
            Grammar::Regex(r.clone())
        } else if let Some(p) = &self.grammar {
            Grammar::Lark(read(p)?)
        } else {
            return Ok(None);
        };
        Ok(Some(grammar))
    }
}

fn generate(args: GenerateArgs) -> Result<()> {
    #[cfg(feature = "plant")]
    engine::plant::on_from_env().map_err(anyhow::Error::msg)?;
    if engine::dist::init(&args.dist)?.is_none() {
        return generate_on_rank(args);
    }
    anyhow::ensure!(
        args.image.is_empty(),
        "--image is not supported across ranks; run it on one machine"
    );
    if args.prompt_lookup_num_tokens.is_some() {
        anyhow::bail!("--prompt-lookup is not supported across ranks; run it on one machine");
    }
    if args.draft_model.is_some() || args.adapter_path.is_some() {
        anyhow::bail!(
            "--draft-model and --adapter-path are not supported across ranks (as in mlx-lm); \
             run them on one machine"
        );
    }
    // A failed collective leaves the ring unusable: this rank exits (status 4) so that the
    // launcher and the other ranks stop too.
    match generate_on_rank(args) {
        // A refusal at load (a family that cannot be sharded, a bad flag) is the same on
        // every rank and leaves no collective pending: an ordinary error.
        Err(e) if e.downcast_ref::<engine::load::LoadError>().is_some() => Err(e),
        Err(e) => engine::dist::fatal(&format!("{e:#}")),
        Ok(()) => Ok(()),
    }
}

/// `engine generate` on one machine, or as one rank of a group (only rank 0 writes).
fn generate_on_rank(args: GenerateArgs) -> Result<()> {
    if !args.image.is_empty() {
        return images::generate(&args);
    }
    let dir = &args.model;
    let model = engine::model::load(dir)
        .with_context(|| format!("loading model from {}", dir.display()))?;
    let tokenizer = std::sync::Arc::new(Tokenizer::load(dir)?);
    tokenizer.prepare_in_background();
    let _adapters = match &args.adapter_path {
        Some(path) => Some(
            engine::train::lora::Adapters::load(model.as_ref(), path)
                .with_context(|| format!("loading adapters from {}", path.display()))?,
        ),
        None => None,
    };
    let prompt_ids = encode_prompt(&args, &tokenizer)?;
    let eos_ids = eos_ids(&args.extra_eos_token, &tokenizer)?;

    let mut text = TextStream::new(&tokenizer, args.stop.iter().cloned());
    let mut stdout = std::io::stdout().lock();
    let sampling = args.sampling();
    sampling.check(model.vocab_size()).map_err(|e| {
        let flag = match e.field {
            "temperature" => "temp".to_owned(),
            f => f.replace('_', "-"),
        };
        anyhow::anyhow!("--{flag}: {}", e.message)
    })?;
    let sampler = Sampler::new(sampling)?;
    let sampler =
        engine::generate::sampler::constrain(sampler, &tokenizer, args.constraint()?.as_ref())
            .map_err(|e| anyhow::anyhow!("--json-schema/--regex/--grammar: {e}"))?;
    let lookup = args.lookup()?;
    if lookup.is_some() && sampler.has_penalties() {
        anyhow::bail!("--prompt-lookup: {}", gen::lookup::PROCESSORS_REFUSED);
    }
    let opts = args.tier.resolve(&args.model)?;
    let draft = match &args.draft_model {
        None => None,
        Some(d) => Some(
            gen::drafter::Drafter::load(d, model.as_ref(), &tokenizer)
                .with_context(|| format!("loading the draft model from {}", d.display()))?,
        ),
    };
    if let Some(flag) = &args.memory_budget {
        let make = || {
            let mut caches = model.make_caches();
            if let Some(d) = &draft {
                caches.extend(d.make_caches());
            }
            caches
        };
        let step = match (&draft, args.prefill_step_size) {
            (_, Some(step)) => step,
            (Some(d), None) => d.prefill_step(),
            (None, None) => gen::Session::new(model.as_ref()).prefill_step,
        };
        engine::serve::budget::check_alone(
            flag,
            model.as_ref(),
            &make,
            &opts,
            step,
            prompt_ids.len(),
            args.max_tokens,
        )?;
    }
    let mut session = gen::Session::with_options(model.as_ref(), &opts);
    let draft = draft.as_ref().map(|d| {
        session.prefill_step = d.prefill_step();
        (d, args.num_draft_tokens, d.make_caches())
    });
    if let Some(step) = args.prefill_step_size {
        session.prefill_step = step;
    }
    let writer = engine::dist::is_writer();
    engine::dist::arm("the prompt's prefill");
    let mut dec = Decoder::new(&prompt_ids, args.max_tokens, &eos_ids, sampler);
    let mut decode = Decode::start_with(session, draft, lookup, &opts, &mut dec, &prompt_ids, 0)?;
    let finish = decode.run(&mut dec, &mut |id, _, _| -> Result<Flow> {
        engine::dist::tick("a decode step");
        let (piece, flow) = text.push(id)?;
        if writer {
            stdout.write_all(piece.as_bytes())?;
            stdout.flush()?;
        }
        Ok(flow)
    });
    let stats = dec.finish();
    let spec_stats = decode.spec_stats().cloned();
    decode.end()?;
    // The ranks end together: a peer that exits after this is no loss.
    engine::dist::finish()?;
    let finish = finish?;
    let tail = text.finish(finish)?;
    if !writer {
        return Ok(());
    }
    stdout.write_all(tail.as_bytes())?;
    writeln!(stdout)?;
    stdout.flush()?;
    if !args.verbose {
        return Ok(());
    }
    print_stats(&args, &stats, finish, spec_stats)
}

/// The prompt's ids as mlx_lm.generate makes them: the chat template rendered around the
/// prompt (and --system-prompt, --prefill-response) where the model has one, else the raw
/// text with the tokenizer's special tokens.
fn encode_prompt(args: &GenerateArgs, tokenizer: &Tokenizer) -> Result<Vec<u32>> {
    let kwargs = template_kwargs(args.chat_template_config.as_deref())?;
    let prompt = prompt_text(&args.prompt)?;
    let ids = match chat_template(args, tokenizer)? {
        Some(template) => {
            let text = render_chat(&template, args, &prompt, kwargs, tokenizer)?;
            // As mlx_lm.generate: the rendered template already holds any bos token.
            tokenizer.encode(&text, false)?
        }
        None => tokenizer.encode(&prompt, true)?,
    };
    anyhow::ensure!(
        !ids.is_empty(),
        "the prompt encodes to no tokens; give some text"
    );
    Ok(ids)
}

/// `--prompt` as mlx_lm.generate reads it: typed `\n` and `\t` become a newline and a tab,
/// and `-` reads the prompt from stdin.
fn prompt_text(arg: &str) -> Result<String> {
    let prompt = arg.replace("\\n", "\n").replace("\\t", "\t");
    if prompt != "-" {
        return Ok(prompt);
    }
    let mut text = String::new();
    std::io::stdin()
        .read_to_string(&mut text)
        .context("--prompt -: reading the prompt from stdin")?;
    Ok(text)
}

/// `--chat-template-config`: a JSON object whose entries become template variables.
fn template_kwargs(config: Option<&str>) -> Result<serde_json::Map<String, serde_json::Value>> {
    let Some(config) = config else {
        return Ok(Default::default());
    };
    let bad = |why: String| {
        anyhow::anyhow!(
            "--chat-template-config: {why}; give a JSON object of template arguments, e.g. \
             '{{\"enable_thinking\": false}}'"
        )
    };
    let value: serde_json::Value =
        serde_json::from_str(config).map_err(|e| bad(format!("invalid JSON ({e})")))?;
    let serde_json::Value::Object(map) = value else {
        return Err(bad(format!("{config} is not a JSON object")));
    };
    for key in [
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
    ] {
        anyhow::ensure!(
            !map.contains_key(key),
            "--chat-template-config: `{key}` is set by `engine generate` itself (as by \
             mlx_lm.generate); drop it"
        );
    }
    Ok(map)
}

/// The template to wrap the prompt in: none with --ignore-chat-template or when the model
/// has none (as mlx_lm.generate; `--chat` insists on one).
fn chat_template(args: &GenerateArgs, tokenizer: &Tokenizer) -> Result<Option<ChatTemplate>> {
    if args.ignore_chat_template {
        return Ok(None);
    }
    if let Some(template) = ChatTemplate::from_tokenizer(tokenizer)? {
        return Ok(Some(template));
    }
    let names: Vec<&str> = tokenizer.chat_template_names().collect();
    anyhow::ensure!(
        names.is_empty(),
        "{} has chat templates named {} but none named `default` (which apply_chat_template \
         uses); pass --ignore-chat-template for a raw prompt",
        args.model.display(),
        names.join(", ")
    );
    anyhow::ensure!(
        !args.chat,
        "{} has no chat template (chat_template.jinja, or chat_template in \
         tokenizer_config.json); drop --chat",
        args.model.display()
    );
    Ok(None)
}

/// The chat text: system, user and (with --prefill-response) a final assistant message the
/// template continues; `enable_thinking` defaults as mlx-lm's TokenizerWrapper sets it
/// (`has_thinking`: the model has thinking markers, as the server's default).
fn render_chat(
    template: &ChatTemplate,
    args: &GenerateArgs,
    prompt: &str,
    mut kwargs: serde_json::Map<String, serde_json::Value>,
    tokenizer: &Tokenizer,
) -> Result<String> {
    use serde_json::json;
    let mut messages = Vec::new();
    if let Some(system) = &args.system_prompt {
        messages.push(json!({"role": "system", "content": system}));
    }
    messages.push(json!({"role": "user", "content": prompt}));
    let prefill = args.prefill_response.as_ref();
    if let Some(answer) = prefill {
        messages.push(json!({"role": "assistant", "content": answer}));
    }
    kwargs
        .entry("enable_thinking")
        .or_insert_with(|| infer_thinking(tokenizer).is_some().into());
    let render = RenderArgs {
        tools: kwargs.remove("tools"),
        documents: kwargs.remove("documents"),
        add_generation_prompt: prefill.is_none(),
        continue_final_message: prefill.is_some(),
        kwargs,
    };
    Ok(template.render_json(&messages, &render)?)
}

/// mlx_lm.generate's `--extra-eos-token`: each a token id or a token string, added to the
/// tokenizer's EOS ids.
fn eos_ids(extra: &[String], tokenizer: &Tokenizer) -> Result<Vec<u32>> {
    let mut ids = tokenizer.eos_token_ids.clone();
    for token in extra {
        let id = match token.trim().parse::<u32>() {
            Ok(id) => id,
            Err(_) => tokenizer.token_to_id(token).with_context(|| {
                format!("--extra-eos-token: '{token}' is not a token for this tokenizer")
            })?,
        };
        if !ids.contains(&id) {
            ids.push(id);
        }
    }
    Ok(ids)
}

/// mlx_lm.generate's verbose footer (stderr): speeds, why it stopped, peak memory.
fn print_stats(
    args: &GenerateArgs,
    stats: &gen::Stats,
    finish: Finish,
    spec: Option<gen::speculative::SpecStats>,
) -> Result<()> {
    eprintln!("==========");
    eprintln!(
        "Prompt: {} tokens, {:.3} tokens-per-sec",
        stats.prompt_tokens,
        stats.prompt_tps()
    );
    eprintln!(
        "Generation: {} tokens, {:.3} tokens-per-sec ({})",
        stats.generated_tokens,
        stats.generation_tps(),
        match finish {
            Finish::Eos => "stopped at EOS",
            Finish::Length => "max tokens reached",
            Finish::Stop => "stop string",
        }
    );
    if let Some(spec) = spec {
        eprintln!(
            "Speculative: γ {}, drafted {}, accepted {} ({:.1}%), target calls {}, draft calls {}",
            args.prompt_lookup_num_tokens
                .unwrap_or(args.num_draft_tokens),
            spec.drafted,
            spec.accepted,
            100.0 * spec.acceptance(),
            spec.target_calls,
            spec.draft_calls
        );
    }
    let mem = runtime::memory()?;
    eprintln!("Peak memory: {:.3} MB", mem.peak as f64 / 1e6);
    Ok(())
}

fn print_version() {
    println!("engine {}", engine::VERSION);
    println!("MLX {}", runtime::mlx_version());
    println!("backend {}", runtime::backend());
    println!("device {}", runtime::default_device());
}

fn doctor() -> Result<()> {
    print_version();
    println!(
        "accelerator available: {}",
        if runtime::accelerator_available() {
            "yes"
        } else {
            "no"
        }
    );
    println!(
        "libmlx built against: MLX {} from {}",
        runtime::BUILD_MLX_VERSION,
        runtime::BUILD_MLX_SOURCE
    );
    match runtime::loaded_library_path() {
        Some(path) => println!("libmlx loaded from: {}", path.display()),
        None => println!(
            "libmlx loaded from: (not reported by this OS; rpath {})",
            runtime::BUILD_MLX_LIB_DIR
        ),
    }
    let version = runtime::mlx_version();
    if version != runtime::BUILD_MLX_VERSION {
        anyhow::bail!(
            "the loaded libmlx is MLX {version} but this binary was built for {}: rebuild, \
             or remove the stray libmlx from LD_LIBRARY_PATH",
            runtime::BUILD_MLX_VERSION
        );
    }
    runtime::reset_peak_memory()?;
    runtime::self_check()?;
    let mem = runtime::memory()?;
    println!(
        "memory: active {} B, peak {} B, cache {} B",
        mem.active, mem.peak, mem.cache
    );
    println!("self-check: ok (matmul, add, sum)");
    Ok(())
}
