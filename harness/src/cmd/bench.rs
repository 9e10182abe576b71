use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use harness::bench::{self, models};
use harness::db::Db;

#[derive(clap::Args)]
pub struct Args {
    /// Measure only on a machine preflight calls clean, waiting up to --settle-timeout for
    /// a busy one to settle (the default behaviour; the flag makes the intent explicit).
    #[arg(long, conflicts_with = "force")]
    clean: bool,
    /// Measure even on a dirty machine; rows are tagged and never promoted.
    #[arg(long)]
    force: bool,
    /// How long to wait for a busy machine to settle (the load of the build that just
    /// ran, say) before refusing, in seconds; 0 refuses at once. Not with --force.
    #[arg(long, default_value_t = 300, value_name = "SECONDS")]
    settle_timeout: u64,
    /// Benchmark suite: decode (prefill, decode, TTFT, peak and KV memory), serve
    /// (`engine serve` vs `mlx_lm.server` at 1/4/8/16/32 streaming clients, on a committed
    /// tiny model: --serve-model), restart (the SSD tier after a restart, judged against
    /// its exit criteria: --restart-via, --restart-kv-config) or spec
    /// (speculative decoding's γ sweep 1–4 vs the same model without a drafter) or
    /// distributed (1 rank vs 2 loopback ranks, tensor and pipeline, on --model) or
    /// constrain (decode with and without a JSON-schema mask, on tiny-llama-trained and the
    /// 151 936-id qwen3-vocab-tiny; engine only) or ready (spawn to the first answer,
    /// `engine serve` vs `mlx_lm.server`, on gemma3-vocab-tiny: the 262 k-id Gemma 3
    /// tokenizer) or batch-spec (prompt lookup and a draft model in the batch lane vs the
    /// plain batch lane and vs the serial lane's same speculation, 4 clients on
    /// tiny-llama-trained; engine only).
    #[arg(long, default_value = "decode")]
    suite: String,
    /// The bench model the restart suite runs on (its prompt is at least 4096 tokens:
    /// --prompt-tokens).
    #[arg(long, default_value = "small")]
    restart_model: String,
    /// Restart suite: `session` (in-process sessions and the kv-store directly) or `server`
    /// (`engine serve --ssd-cache` over HTTP, restarted between legs, as a client sees it;
    /// the bench model gets a variant whose config admits the prompt).
    #[arg(long, default_value = "session", value_parser = ["session", "server"])]
    restart_via: String,
    /// Restart suite, through the server: quantized KV caches from this kv_config.json
    /// (`engine serve --kv-quant config --kv-config`), stored and restored quantized;
    /// `bench` is the bench model's own (8 bits on layer 0, 4 on the rest, group 64).
    #[arg(long, value_name = "PATH|bench")]
    restart_kv_config: Option<String>,
    /// The committed model the serve suite runs on.
    #[arg(long, default_value = "tiny-llama-trained")]
    serve_model: String,
    /// Serve suite: the engine server's batch lane rows (`engine serve --batch`); 32 as
    /// mlx_lm.server's --decode-concurrency, so both stacks decode as many at once.
    #[arg(long, default_value_t = 32)]
    serve_batch: usize,
    /// Serve suite: requests per client per level.
    #[arg(long, default_value_t = 2)]
    per_client: usize,
    /// Built-in benchmark models to run (tiny, small, gemma-tiny, gemma4-tiny, moe-tiny,
    /// qwen3-vocab-tiny, qwen3-5-tiny).
    #[arg(long, value_delimiter = ',', default_value = "tiny")]
    model: Vec<String>,
    /// Measure the engine alone (no mlx-lm legs, no oracle venv needed).
    #[arg(long)]
    no_peer: bool,
    /// Also measure the engine with the compiled decode step off (stack "engine-eager"),
    /// to show what the default (compiled where its first steps measured faster) gains.
    #[arg(long)]
    compare_compile: bool,
    /// Also measure the L2 and L3 presets ("engine-l2", "engine-l3": quantized KV from the
    /// bench model's kv_config.json), with KV memory; use a long --prompt-tokens to see it.
    #[arg(long)]
    tiers: bool,
    /// Rounds of legs per stack (median over them; at least 3), or `auto`: the decode suite
    /// adds ABBA rounds (from 6) until the decode ratio's exact 95 % interval is within ±3 %
    /// of its median, or 16 rounds or 15 minutes per model; the serve suite runs 6, the
    /// others 3.
    #[arg(long, default_value = "auto")]
    rounds: harness::bench::spread::Rounds,
    /// Prompt length in tokens.
    #[arg(long, default_value_t = 256)]
    prompt_tokens: usize,
    /// Decode suite: a context sweep instead of one --prompt-tokens, e.g. 256,1024,4096:
    /// every model and stack at each prompt length (rows per length, tagged context-sweep;
    /// `harness promote` plots decode tok/s against them).
    #[arg(long, value_delimiter = ',', value_name = "TOKENS")]
    contexts: Vec<usize>,
    /// Tokens generated per leg.
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
}

/// The preflight gate every suite passes before measuring: at least 3 rounds, a clean
/// machine (or --force), the oracle venv when a peer runs. Returns the thresholds and the
/// state before.
fn preflight_gate(
    args: &Args,
    suite: &str,
) -> Result<(
    harness::preflight::Thresholds,
    harness::preflight::MachineState,
)> {
    use harness::preflight::{self, Thresholds};
    wait_until_settled(args)?;
    let thresholds = Thresholds::from_env();
    let before = preflight::check(&thresholds);
    if !before.clean && !args.force {
        bail!(
            "this machine is not clean, so the {suite} bench refuses to measure: {}\n\
             Let it settle and retry, or pass --force.",
            before.reasons.join("; ")
        );
    }
    if !args.no_peer {
        harness::bench::ensure_oracle_venv()?;
    }
    Ok((thresholds, before))
}

fn run_restart(args: &Args) -> Result<()> {
    use harness::bench::restart;
    let model = models::by_name(&args.restart_model).with_context(|| {
        format!(
            "unknown bench model `{}` ({})",
            args.restart_model,
            models::NAMES
        )
    })?;
    let server = args.restart_via == "server";
    if args.restart_kv_config.is_some() && !server {
        bail!("--restart-kv-config is for the server legs: add --restart-via server");
    }
    let (thresholds, before) = preflight_gate(args, "restart")?;
    // Shorter prompts only for smoke runs (--force: never promoted).
    let prompt_tokens = if args.force {
        args.prompt_tokens
    } else {
        args.prompt_tokens.max(4096)
    };
    let mut opts = restart::RestartOptions {
        model,
        prompt_tokens,
        max_tokens: args.max_tokens,
        rounds: args.rounds.count(),
        server,
        kv_config: None,
    };
    opts.kv_config = match args.restart_kv_config.as_deref() {
        None => None,
        // The variant's directory holds its kv_config.json (ensure writes it).
        Some("bench") => Some(opts.served_model().dir().join("kv_config.json")),
        Some(path) => Some(
            std::fs::canonicalize(path)
                .with_context(|| format!("--restart-kv-config {path}: no such file"))?,
        ),
    };
    let kv_config = opts.kv_config.clone();
    let r = restart::run(&opts)?;
    let after = harness::preflight::check_since(&before, &thresholds);
    let via = if server { "server" } else { "session" };
    let kv = kv_config.as_ref().map(|p| p.display().to_string());
    let setting = match &kv {
        Some(p) => format!("{via}, kv_config {p}"),
        None => via.to_owned(),
    };
    for (metric, value, unit) in r.rows() {
        println!(
            "restart {} (prompt {prompt_tokens}, {setting}): {metric} {value:.1} {unit}",
            r.model
        );
    }
    print!("{}", r.words());
    for (what, measured, limit, passed) in restart::criteria(&r) {
        println!(
            "exit criterion {what}: {measured} (limit {limit}): {}",
            if passed { "PASS" } else { "FAIL" }
        );
    }
    let db = Db::open_default()?;
    let labels =
        harness::bench::run_labels(args.rounds.count(), "fresh-process-legs", &before, &after)?;
    let ctx = harness::db::RowContext::between(&before, &after, labels);
    let rows = r.rows();
    let mut params = serde_json::json!({"prompt_tokens": prompt_tokens, "max_tokens": args.max_tokens, "rounds": args.rounds.count()});
    if server {
        params["via"] = "server".into();
        params["kv_config"] = kv.map_or(serde_json::Value::Null, |_| {
            args.restart_kv_config.clone().unwrap_or_default().into()
        });
    }
    for m in &rows {
        let params = r.row_params(params.clone(), m.0);
        db.insert(&ctx.row("restart", r.model, *m, "engine", None, params))?;
    }
    recorded(rows.len(), &before, &after);
    Ok(())
}

fn run_spec(args: &Args) -> Result<()> {
    use harness::bench::spec;
    let (thresholds, before) = preflight_gate(args, "spec")?;
    let results = spec::run(args.rounds.count(), args.max_tokens, !args.no_peer)?;
    let after = harness::preflight::check_since(&before, &thresholds);
    let db = Db::open_default()?;
    let mut labels =
        harness::bench::run_labels(args.rounds.count(), "fresh-process-legs", &before, &after)?;
    let id: String = after.at.chars().filter(char::is_ascii_digit).collect();
    labels.0.push(format!("spec-bench[{id}]"));
    let ctx = harness::db::RowContext::between(&before, &after, labels);
    let mut n = 0;
    for r in &results {
        print!("{}", r.table());
        let peer = spec::PAIRS
            .iter()
            .find(|p| p.0 == r.target)
            .map(|p| p.2.to_owned());
        for (stack, gamma, metric, value, unit) in r.rows() {
            let params = serde_json::json!({"draft": r.draft, "gamma": gamma, "max_tokens": args.max_tokens, "rounds": args.rounds.count(), "prompts": r.prompts});
            let metric = format!("g{gamma}_{metric}");
            let peer = (stack == "engine" && !args.no_peer)
                .then(|| peer.clone())
                .flatten();
            let params = r.kept.row_params(params, &stack, peer.as_deref(), &metric);
            db.insert(&ctx.row(
                "spec",
                r.target,
                (&metric, value, unit),
                &stack,
                peer,
                params,
            ))?;
            n += 1;
        }
    }
    println!(
        "recorded {n} rows tagged spec-bench[{id}] (preflight before: {}, after: {})",
        before.summary(),
        after.summary()
    );
    Ok(())
}

fn run_train(args: &Args) -> Result<()> {
    use harness::bench::train;
    let (thresholds, before) = preflight_gate(args, "train")?;
    let results = train::run(args.rounds.count(), 10, !args.no_peer)?;
    let after = harness::preflight::check_since(&before, &thresholds);
    let db = Db::open_default()?;
    let labels =
        harness::bench::run_labels(args.rounds.count(), "fresh-process-legs", &before, &after)?;
    let ctx = harness::db::RowContext::between(&before, &after, labels);
    let mut n = 0;
    for r in &results {
        print!("{}", r.table());
        for l in &r.legs {
            let method = harness::bench::train_pref::method_of(&l.stack).unwrap_or("orpo");
            let mut params = serde_json::json!({"method": method, "pairs": train::PAIRS, "tokens": r.tokens_per_pair, "rank": train::RANK, "steps": 10, "rounds": args.rounds.count()});
            if let Some(f) = train::forward_of(&l.stack) {
                params["forward"] = serde_json::json!(f.name());
                if l.stack == train::COMPILED {
                    params["compiled"] = serde_json::json!(true);
                }
            }
            let peer = train::peer_of(&l.stack).filter(|_| !args.no_peer);
            for m in [
                ("step_ms", l.step_s * 1e3, "ms"),
                ("peak_memory_mb", l.peak_memory_bytes / 1e6, "MB"),
            ] {
                let params = r.kept.row_params(params.clone(), &l.stack, peer, m.0);
                let peer = peer.map(str::to_owned);
                db.insert(&ctx.row("train", &r.model, m, &l.stack, peer, params))?;
                n += 1;
            }
        }
    }
    for (model, legs, kept) in
        harness::bench::train_grpo::run(args.rounds.count(), 3, !args.no_peer)?
    {
        print!("{}", harness::bench::train_grpo::table(&model, &legs));
        let kinds: Vec<_> = harness::bench::train_grpo::figures(&legs[0])
            .iter()
            .map(|(n, _, u)| (*n, *u, false))
            .collect();
        let peer = (!args.no_peer).then_some("mlx-lm-lora");
        print!("{}", kept.lines(&kinds, "engine", peer));
        let params = serde_json::json!({"method": "grpo", "prompts": harness::bench::train_grpo::PROMPTS, "group": harness::bench::train_grpo::GROUP, "completion": harness::bench::train_grpo::COMPLETION, "rank": train::RANK, "steps": 3, "rounds": args.rounds.count()});
        for l in &legs {
            let peer = (l.stack == "engine" && !args.no_peer).then_some("mlx-lm-lora");
            for m in harness::bench::train_grpo::figures(l) {
                let params = kept.row_params(params.clone(), &l.stack, peer, m.0);
                let peer = peer.map(str::to_owned);
                db.insert(&ctx.row("train", &model, m, &l.stack, peer, params))?;
                n += 1;
            }
        }
    }
    recorded(n, &before, &after);
    Ok(())
}

/// The last line of a suite's run: how many rows, and the machine before and after.
fn recorded(
    n: usize,
    before: &harness::preflight::MachineState,
    after: &harness::preflight::MachineState,
) {
    println!(
        "recorded {n} rows (preflight before: {}, after: {})",
        before.summary(),
        after.summary()
    );
}

/// The ready suite: spawn to first answer, `engine serve` vs `mlx_lm.server`, on a model
/// with the Gemma 3 tokenizer.
fn run_ready(args: &Args) -> Result<()> {
    use harness::bench::ready;
    let (thresholds, before) = preflight_gate(args, "ready")?;
    let rounds = args.rounds.fixed_or(harness::bench::spread::AUTO_FIRST);
    let kept = ready::run(rounds, !args.no_peer)?;
    let after = harness::preflight::check_since(&before, &thresholds);
    let peer = (!args.no_peer).then_some("mlx-lm");
    print!(
        "ready: spawn to the first answer on {} ({rounds} rounds)\n{}",
        ready::MODEL,
        kept.lines(&[("ready_ms", "ms", false)], "engine", peer)
    );
    let db = Db::open_default()?;
    let labels = harness::bench::run_labels(rounds, "fresh-server-processes", &before, &after)?;
    let ctx = harness::db::RowContext::between(&before, &after, labels);
    let mut n = 0;
    for stack in ["engine", "mlx-lm"]
        .into_iter()
        .take(1 + usize::from(peer.is_some()))
    {
        let theirs = (stack == "engine").then_some(peer).flatten();
        let params = kept.row_params(
            serde_json::json!({"rounds": rounds, "prompt": "Hello", "max_tokens": 1}),
            stack,
            theirs,
            "ready_ms",
        );
        let value = kept.median(stack, "ready_ms");
        let peer = theirs.map(str::to_owned);
        db.insert(&ctx.row(
            "ready",
            ready::MODEL,
            ("ready_ms", value, "ms"),
            stack,
            peer,
            params,
        ))?;
        n += 1;
    }
    recorded(n, &before, &after);
    Ok(())
}

/// The batch-spec suite: prompt lookup and a draft model in the batch lane vs the plain batch
/// lane and vs the serial lane's same speculation (engine legs only).
fn run_batch_spec(args: &Args) -> Result<()> {
    use harness::bench::batch_spec::{self, Speculate, FIGURES, MODEL, PAIRS, STACKS, WORKLOADS};
    let (thresholds, before) = preflight_gate(args, "batch-spec")?;
    let rounds = args.rounds.fixed_or(harness::bench::spread::AUTO_FIRST);
    let kept = batch_spec::run(rounds, args.per_client, args.max_tokens)?;
    let after = harness::preflight::check_since(&before, &thresholds);
    println!(
        "batch-spec on {MODEL}: {} clients, γ {}, {rounds} rounds",
        batch_spec::CLIENTS,
        batch_spec::GAMMA
    );
    let db = Db::open_default()?;
    let labels = harness::bench::run_labels(rounds, "fresh-server-processes", &before, &after)?;
    let ctx = harness::db::RowContext::between(&before, &after, labels);
    let mut n = 0;
    for workload in WORKLOADS {
        let named: Vec<(String, &str, bool)> = FIGURES
            .iter()
            .map(|(f, u, h)| (format!("{f}_{workload}"), *u, *h))
            .collect();
        let kinds: Vec<_> = named.iter().map(|(f, u, h)| (f.as_str(), *u, *h)).collect();
        println!("{workload}:");
        for (ours, theirs) in PAIRS {
            print!("{}", kept.lines(&kinds[..2], ours, Some(theirs)));
            if theirs != "engine-batch-plain" {
                print!("{}", kept.lines(&kinds[2..], ours, Some(theirs)));
            }
        }
        for (stack, _, how) in STACKS {
            for &(figure, unit, _) in &kinds {
                if figure.starts_with("accepted_pct") && how == Speculate::No {
                    continue;
                }
                // Speculation in the batch lane against the plain batch lane (the serial
                // legs, the other peers, are in the table above).
                let theirs = PAIRS.iter().find(|p| p.0 == stack).map(|p| p.1);
                let params = kept.row_params(
                    serde_json::json!({
                        "rounds": rounds, "clients": batch_spec::CLIENTS,
                        "per_client": args.per_client, "max_tokens": args.max_tokens,
                        "gamma": batch_spec::GAMMA, "max_ngram": batch_spec::MAX_NGRAM,
                        "workload": workload,
                    }),
                    stack,
                    theirs,
                    figure,
                );
                let value = kept.median(stack, figure);
                db.insert(&ctx.row(
                    "batch-spec",
                    MODEL,
                    (figure, value, unit),
                    stack,
                    theirs.map(str::to_owned),
                    params,
                ))?;
                n += 1;
            }
        }
    }
    recorded(n, &before, &after);
    Ok(())
}

/// The constrain suite: plain vs JSON-schema-constrained decode (engine legs only).
fn run_constrain(args: &Args) -> Result<()> {
    use harness::bench::constrain;
    let (thresholds, before) = preflight_gate(args, "constrain")?;
    let results = constrain::run(args.rounds.count(), args.max_tokens)?;
    let after = harness::preflight::check_since(&before, &thresholds);
    let db = Db::open_default()?;
    let labels =
        harness::bench::run_labels(args.rounds.count(), "fresh-process-legs", &before, &after)?;
    let ctx = harness::db::RowContext::between(&before, &after, labels);
    for r in &results {
        print!("{}", r.table());
    }
    let n = constrain::record(&db, &ctx, &results, args.rounds.count(), args.max_tokens)?;
    recorded(n, &before, &after);
    Ok(())
}

/// The distributed suite on each --model: 1 rank, tensor ×2, pipeline ×2; engine and mlx-lm.
fn run_distributed(args: &Args) -> Result<()> {
    use harness::bench::distributed;
    let chosen = args
        .model
        .iter()
        .map(|n| {
            models::by_name(n)
                .with_context(|| format!("unknown bench model `{n}` ({})", models::NAMES))
        })
        .collect::<Result<Vec<_>>>()?;
    let (thresholds, before) = preflight_gate(args, "distributed")?;
    let opts = distributed::Options {
        rounds: args.rounds.count(),
        prompt_tokens: args.prompt_tokens,
        max_tokens: args.max_tokens,
        peer: !args.no_peer,
        leg_timeout: std::time::Duration::from_secs(180),
    };
    let results = chosen
        .iter()
        .map(|m| distributed::run(m, &opts))
        .collect::<Result<Vec<_>>>()?;
    // The suite's own N ranks load every core (2 ranks on 2 cores: a load average near 2).
    let after = harness::preflight::check_after_own_load(&before, &thresholds);
    let db = Db::open_default()?;
    let labels =
        harness::bench::run_labels(args.rounds.count(), "fresh-process-legs", &before, &after)?;
    let ctx = harness::db::RowContext::between(&before, &after, labels);
    let mut n = 0;
    for (r, m) in results.iter().zip(&chosen) {
        print!("{}", r.table(&opts));
        let params_m = (m.parameter_count()? as f64 / 1e5).round() / 10.0;
        n += r.record(&db, &ctx, &opts, params_m)?;
    }
    recorded(n, &before, &after);
    let failed = results
        .iter()
        .flat_map(|r| &r.cells)
        .filter(|c| c.result.is_err())
        .count();
    if failed > 0 {
        bail!("{failed} (split, stack) leg(s) failed; see above");
    }
    Ok(())
}

/// `harness leg-train`: one train-suite engine leg in this fresh process.
#[derive(clap::Args)]
pub struct LegTrainArgs {
    #[arg(long)]
    model: PathBuf,
    #[arg(long)]
    pairs: PathBuf,
    #[arg(long)]
    steps: usize,
    #[arg(long)]
    num_layers: usize,
    /// The ORPO forward (prefix-shared or joint).
    #[arg(long, value_enum, default_value = "prefix-shared")]
    forward: engine::train::orpo_prefix::OrpoForward,
    /// orpo (the forward above), or dpo, cpo, simpo (the prefix-shared forward; DPO's
    /// reference precomputed).
    #[arg(long, default_value = "orpo")]
    method: String,
    /// Loss and gradients through the compiled step.
    #[arg(long)]
    compiled: bool,
}

pub fn leg_train(args: LegTrainArgs) -> Result<()> {
    if args.method != "orpo" {
        let leg = harness::bench::train_pref::leg(
            &args.model,
            &args.pairs,
            args.steps,
            args.num_layers,
            &args.method,
        )?;
        println!("{}", serde_json::to_string(&leg)?);
        return Ok(());
    }
    let leg = harness::bench::train::leg(
        &args.model,
        &args.pairs,
        args.steps,
        args.num_layers,
        args.forward,
        args.compiled,
    )?;
    println!("{}", serde_json::to_string(&leg)?);
    Ok(())
}

/// `harness leg-spec`: one spec-suite engine leg in this fresh process.
#[derive(clap::Args)]
pub struct LegSpecArgs {
    #[arg(long)]
    model: PathBuf,
    #[arg(long)]
    draft_model: PathBuf,
    #[arg(long)]
    prompts: PathBuf,
    #[arg(long)]
    max_tokens: usize,
    #[arg(long)]
    num_draft_tokens: usize,
}

pub fn leg_spec(args: LegSpecArgs) -> Result<()> {
    let prompts: Vec<Vec<u32>> = serde_json::from_str(&std::fs::read_to_string(&args.prompts)?)?;
    let leg = harness::bench::spec::leg(
        &args.model,
        &args.draft_model,
        &prompts,
        args.max_tokens,
        args.num_draft_tokens,
    )?;
    println!("{}", serde_json::to_string(&leg)?);
    Ok(())
}

/// `harness leg-restart`: one restart-suite leg in this fresh process.
#[derive(clap::Args)]
pub struct LegRestartArgs {
    #[arg(long)]
    mode: String,
    #[arg(long)]
    model: PathBuf,
    #[arg(long)]
    prompt_ids: PathBuf,
    #[arg(long)]
    max_tokens: usize,
    #[arg(long)]
    ssd: PathBuf,
}

pub fn leg_restart(args: LegRestartArgs) -> Result<()> {
    let ids: Vec<u32> = serde_json::from_str(&std::fs::read_to_string(&args.prompt_ids)?)?;
    let leg =
        harness::bench::restart::leg(&args.mode, &args.model, &ids, args.max_tokens, &args.ssd)?;
    println!("{}", serde_json::to_string(&leg)?);
    Ok(())
}

fn run_serve(args: &Args) -> Result<()> {
    use harness::bench::serve;
    let opts = serve::ServeOptions {
        model: args.serve_model.clone(),
        rounds: args.rounds.fixed_or(harness::bench::spread::AUTO_FIRST),
        per_client: args.per_client,
        max_tokens: args.max_tokens,
        peer: !args.no_peer,
        clean: args.clean,
        force: args.force,
        batch: args.serve_batch,
    };
    wait_until_settled(args)?;
    let (result, before, after) = serve::run(&opts)?;
    print!("{}", serve::table(&opts.model, &result));
    let db = Db::open_default()?;
    let n = serve::record(&db, &opts, &result, &before, &after)?;
    println!(
        "recorded {n} rows in {} (preflight before: {}, after: {})",
        harness::db::default_path().display(),
        before.summary(),
        after.summary()
    );
    Ok(())
}

/// `harness leg-serve`: `engine serve` in this fresh process (the serve suite's engine
/// server).
#[derive(clap::Args)]
pub struct LegServeArgs {
    #[arg(long)]
    model: PathBuf,
    #[arg(long)]
    port: u16,
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// More `engine serve` flags, after `--` (the restart suite's --ssd-cache, --kv-quant).
    #[arg(last = true)]
    serve_flags: Vec<String>,
}

pub fn leg_serve(args: LegServeArgs) -> Result<()> {
    let mut serve = serve_args_with(&args.model, args.port, &args.serve_flags)?;
    serve.batch = args.batch;
    engine::serve::run(serve)
}

/// `engine serve`'s arguments for `model` on loopback `port`, every other flag at its
/// default.
pub fn serve_args(model: &std::path::Path, port: u16) -> Result<engine::serve::ServeArgs> {
    serve_args_with(model, port, &[])
}

/// As `serve_args`, with `extra` flags of `engine serve` on top.
pub(super) fn serve_args_with(
    model: &std::path::Path,
    port: u16,
    extra: &[String],
) -> Result<engine::serve::ServeArgs> {
    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        serve: engine::serve::ServeArgs,
    }
    let mut argv = vec![
        "engine".to_owned(),
        "--model".into(),
        model.display().to_string(),
        "--port".into(),
        port.to_string(),
    ];
    argv.extend(extra.iter().cloned());
    let cli = <Cli as clap::Parser>::try_parse_from(argv)?;
    Ok(cli.serve)
}

/// Waits (bounded by --settle-timeout) for preflight's limits to hold, with a progress line
/// saying what it waits for; refuses if the machine does not settle in time. Every suite's
/// own preflight check then judges the settled machine.
fn wait_until_settled(args: &Args) -> Result<()> {
    use harness::preflight::{self, Thresholds, WallClock};
    use std::time::Duration;
    if args.force {
        return Ok(());
    }
    // The venv's first creation is minutes of pip work: done before the wait, so that its
    // load is waited out too instead of landing in the measurement.
    if !args.no_peer {
        harness::bench::ensure_oracle_venv()?;
    }
    let thresholds = Thresholds::from_env();
    let timeout = Duration::from_secs(args.settle_timeout);
    let bar = indicatif::ProgressBar::new_spinner();
    let mut announced = false;
    let settled = preflight::settle(
        &thresholds,
        timeout,
        Duration::from_secs(2),
        || preflight::read_machine(&thresholds),
        &mut WallClock::start(),
        |reasons, waited| {
            let what = reasons.join("; ");
            if !announced {
                // Once in plain text too, for logs where the spinner is not drawn.
                eprintln!(
                    "preflight: the machine is busy ({what}); waiting up to {} s for it to settle",
                    timeout.as_secs()
                );
                announced = true;
            }
            bar.set_message(format!(
                "waiting for the machine to settle ({} s of {} s): {what}",
                waited.as_secs(),
                timeout.as_secs()
            ));
            bar.tick();
        },
    );
    bar.finish_and_clear();
    match settled {
        Ok(waited) if waited.is_zero() => Ok(()),
        Ok(waited) => {
            eprintln!("preflight: settled after {} s", waited.as_secs());
            Ok(())
        }
        Err(reasons) => bail!(
            "this machine did not settle within {} s (--settle-timeout), so the bench refuses to measure:\n{}\n\
             Stop other work and retry, wait longer (--settle-timeout), or pass --force to measure \
             anyway (rows are then tagged dirty and never promoted).",
            timeout.as_secs(),
            reasons
                .iter()
                .map(|r| format!("  - {r}"))
                .collect::<Vec<_>>()
                .join("\n")
        ),
    }
}

pub fn run(args: Args) -> Result<()> {
    if let Some(why) = harness::preflight::stale_binary(&harness::oracle::repo_root()) {
        bail!("{why}");
    }
    match args.suite.as_str() {
        "decode" => {}
        "serve" => return run_serve(&args),
        "hostile" => return bench::hostile::main(&args.serve_model, args.per_client.max(5)),
        "restart" => return run_restart(&args),
        "spec" => return run_spec(&args),
        "train" => return run_train(&args),
        "distributed" => return run_distributed(&args),
        "constrain" => return run_constrain(&args),
        "ready" => return run_ready(&args),
        "batch-spec" => return run_batch_spec(&args),
        other => {
            bail!("suite `{other}` does not exist (available: decode, serve, hostile, restart, spec, train, distributed, constrain, ready, batch-spec)")
        }
    }
    let mut chosen = Vec::new();
    for name in &args.model {
        chosen.push(
            models::by_name(name)
                .with_context(|| format!("unknown bench model `{name}` ({})", models::NAMES))?,
        );
    }
    let opts = bench::Options {
        models: chosen,
        rounds: args.rounds,
        contexts: if args.contexts.is_empty() {
            vec![args.prompt_tokens]
        } else {
            args.contexts.clone()
        },
        max_tokens: args.max_tokens,
        peer: !args.no_peer,
        eager: args.compare_compile,
        tiers: args.tiers,
        clean: args.clean,
        force: args.force,
    };
    wait_until_settled(&args)?;
    let (results, before, after) = bench::run(&opts)?;
    print!("{}", bench::table(&results));
    print!("{}", bench::spread::summary(&results));
    let db = Db::open_default()?;
    let n = bench::record(&db, &opts, &results, &before, &after)?;
    println!(
        "recorded {n} rows in {} (preflight before: {}, after: {})",
        harness::db::default_path().display(),
        before.summary(),
        after.summary()
    );
    if before.clean && !after.clean {
        println!("the machine went dirty during the run; rows are tagged went-dirty and will not be promoted:");
        for r in &after.reasons {
            println!("  - {r}");
        }
    }
    Ok(())
}

#[derive(clap::Args)]
pub struct LegArgs {
    /// The stack name reported for this leg.
    #[arg(long, default_value = "engine")]
    stack: String,
    #[command(flatten)]
    tier: engine::tiers::TierArgs,
    #[arg(long)]
    model: PathBuf,
    #[arg(long)]
    prompt_ids: PathBuf,
    #[arg(long)]
    max_tokens: usize,
}

pub fn leg(args: LegArgs) -> Result<()> {
    let model = engine::model::load(&args.model)?;
    let ids: Vec<u32> = serde_json::from_str(&std::fs::read_to_string(&args.prompt_ids)?)?;
    let opts = args.tier.resolve(&args.model)?;
    let stack: &'static str = Box::leak(args.stack.into_boxed_str());
    let result =
        engine::generate::bench::run_leg(model.as_ref(), &ids, args.max_tokens, stack, &opts)?;
    println!("{}", serde_json::to_string(&result)?);
    Ok(())
}
