//! `engine generate --image PATH…`: generation with images as `mlx_vlm.generate --image`
//! runs it (engine::vision::generate), the text streamed to stdout as the text path streams
//! it, the stats to stderr.

use std::io::Write;

use anyhow::{Context, Result};
use engine::generate::sampler::Sampler;
use engine::generate::stop::TextStream;
use engine::load::tokenizer::Tokenizer;
use engine::vision::generate::{cli_prompt, generate as run, read_images};
use engine::vision::model::{detect, ImageModel};
use engine::vision::Limits;

use super::{eos_ids, prompt_text, template_kwargs, GenerateArgs};

/// The text path's flags that the image path does not take, refused by name.
fn refuse_unsupported(args: &GenerateArgs) -> Result<()> {
    let unsupported = [
        (args.draft_model.is_some(), "--draft-model"),
        (args.adapter_path.is_some(), "--adapter-path"),
        (args.prompt_lookup_num_tokens.is_some(), "--prompt-lookup"),
        (args.json_schema.is_some(), "--json-schema"),
        (args.regex.is_some(), "--regex"),
        (args.grammar.is_some(), "--grammar"),
        (args.prefill_response.is_some(), "--prefill-response"),
        (args.ignore_chat_template, "--ignore-chat-template"),
        (args.memory_budget.is_some(), "--memory-budget"),
    ];
    if let Some((_, flag)) = unsupported.iter().find(|(on, _)| *on) {
        anyhow::bail!("{flag} is not supported with --image yet; drop one of them");
    }
    anyhow::ensure!(
        args.max_image_pixels > 0,
        "--max-image-pixels must be above 0"
    );
    Ok(())
}

pub fn generate(args: &GenerateArgs) -> Result<()> {
    refuse_unsupported(args)?;
    let dir = &args.model;
    let (family, model_type) = detect(dir)?;
    anyhow::ensure!(
        family.is_some(),
        "--image: {} is a `{model_type}` model, which has no vision tower this engine runs \
         (gemma3 or gemma4 with a vision_config, qwen3_vl, qwen3_5); drop --image or use \
         one of those",
        dir.display()
    );
    let limits = Limits {
        max_pixels: args.max_image_pixels,
        ..Limits::DEFAULT
    };
    // The files first: a bad one is refused before the model loads.
    let images = read_images(&args.image, &limits)?;
    let model =
        ImageModel::load(dir).with_context(|| format!("loading model from {}", dir.display()))?;
    let tokenizer = Tokenizer::load(dir)?;
    let kwargs = template_kwargs(args.chat_template_config.as_deref())?;
    let prompt = prompt_text(&args.prompt)?;
    let prompt = cli_prompt(
        &model,
        &tokenizer,
        dir,
        args.system_prompt.as_deref(),
        &prompt,
        &images,
        kwargs,
    )?;
    let eos = eos_ids(&args.extra_eos_token, &tokenizer)?;
    let sampling = args.sampling();
    let vocab = model.vocab_size();
    sampling.check(vocab).map_err(|e| {
        let flag = match e.field {
            "temperature" => "temp".to_owned(),
            f => f.replace('_', "-"),
        };
        anyhow::anyhow!("--{flag}: {}", e.message)
    })?;
    let mut sampler = Sampler::new(sampling)?;
    if std::env::var_os("ENGINE_PRINT_PROMPT_IDS").is_some() {
        // For the gate: the prompt's ids as the model takes them (stderr).
        eprintln!("prompt_ids: {:?}", prompt.ids);
    }
    let mut text = TextStream::new(&tokenizer, args.stop.iter().cloned()).as_mlx_vlm();
    let mut stdout = std::io::stdout().lock();
    let start = std::time::Instant::now();
    let step = args.prefill_step_size.unwrap_or(2048);
    let mut first = None;
    let (ids, finish) = run(
        &model,
        &prompt,
        &mut sampler,
        args.max_tokens,
        &eos,
        step,
        &mut |id| {
            first.get_or_insert_with(std::time::Instant::now);
            let (piece, flow) = text.push(id)?;
            stdout
                .write_all(piece.as_bytes())
                .and_then(|_| stdout.flush())
                .map_err(|e| engine::load::LoadError::Template(format!("stdout: {e}")))?;
            Ok(flow)
        },
    )?;
    let tail = text.finish(finish)?;
    stdout.write_all(tail.as_bytes())?;
    writeln!(stdout)?;
    stdout.flush()?;
    if args.verbose {
        let first = first.unwrap_or_else(std::time::Instant::now);
        let prefill = first.duration_since(start).as_secs_f64();
        let decode = first.elapsed().as_secs_f64();
        eprintln!("==========");
        eprintln!(
            "Prompt: {} tokens ({} images), {:.3} tokens-per-sec",
            prompt.ids.len(),
            images.len(),
            prompt.ids.len() as f64 / prefill.max(1e-9)
        );
        eprintln!(
            "Generation: {} tokens, {:.3} tokens-per-sec",
            ids.len(),
            ids.len().saturating_sub(1) as f64 / decode.max(1e-9)
        );
        eprintln!("Finish: {finish:?}");
    }
    Ok(())
}
