use anyhow::{bail, Result};
use harness::db::{Db, Row};
use harness::parity::l1::{self, ModelReport};
use harness::preflight::{self, Thresholds};

#[derive(clap::Args)]
pub struct Args {
    /// The tier to run: l1 (vs mlx-lm), l2 (vs mlx-optiq), l3 (the envelope gate).
    #[arg(long, default_value = "l1")]
    tier: String,
    /// One model (default: every model with goldens).
    #[arg(long)]
    model: Option<String>,
    /// Run the oracle now (mlx-lm in oracles/.venv, same prompt ids) instead of reading the
    /// committed goldens.
    #[arg(long)]
    live: bool,
    /// Do not write result rows.
    #[arg(long)]
    no_record: bool,
    /// A planted defect, to see the gate fail: for l1, `key=value` set in the model's
    /// config.json before loading (e.g. rms_norm_eps=1e-6); for l2, `sdpa=mlx-lm` (mlx-lm's
    /// quantized attention instead of optiq's fused kernel) or `kv_start=N`.
    #[arg(long, value_name = "KEY=VALUE")]
    plant: Option<String>,
}

fn record(reports: &[ModelReport], live: bool, suite: &str, peer: &str) -> Result<()> {
    let state = preflight::check(&Thresholds::from_env());
    let db = Db::open_default()?;
    let machine_state = serde_json::to_string(&serde_json::json!({ "before": state }))?;
    for r in reports {
        let (exact, total) = r.cases.iter().fold((0, 0), |(e, t), c| {
            (e + c.logits_exact(), t + c.logits.len())
        });
        let (ids, steps) = r.cases.iter().fold((0, 0), |(e, t), c| {
            (e + c.greedy_matching, t + c.greedy_total)
        });
        for (metric, value, total) in [
            ("logit_vectors_bit_exact", exact, total),
            ("greedy_ids_identical", ids, steps),
        ] {
            db.insert(&Row {
                ts: state.at.clone(),
                commit: state.commit.clone(),
                dirty: state.dirty,
                machine_key: state.machine_key.clone(),
                machine_state: machine_state.clone(),
                preflight: state.verdict().into(),
                suite: suite.into(),
                model: r.model.clone(),
                metric: metric.into(),
                value: value as f64,
                unit: format!("/{total}"),
                stack: "engine".into(),
                peer: Some(peer.into()),
                params: serde_json::json!({ "live": live }).to_string(),
                tags: if live {
                    "live".into()
                } else {
                    "committed-goldens".into()
                },
            })?;
        }
    }
    Ok(())
}

fn run_l2(args: &Args) -> Result<()> {
    use harness::parity::l2;
    let models: Vec<&str> = match &args.model {
        Some(m) => vec![m.as_str()],
        None => l2::MODELS.to_vec(),
    };
    let live = if args.live {
        println!(
            "running the oracle now (mlx-optiq in {})…",
            harness::oracle::venv_dir().display()
        );
        Some(l1::live_goldens("gen_l2.py", &models)?)
    } else {
        None
    };
    let plant = args.plant.clone();
    if let Some(p) = &plant {
        println!("planted defect: {p}");
    }
    let mut reports = Vec::new();
    for name in models {
        let report = l2::check_named(name, live.as_ref().map(|d| d.path()), |opts| {
            let Some(plan) = opts.kv_quant.as_mut() else {
                return;
            };
            match plant.as_deref() {
                Some("sdpa=mlx-lm") => plan.sdpa = engine::cache::QuantSdpa::MlxLm,
                Some(p) if p.starts_with("kv_start=") => {
                    plan.start = p["kv_start=".len()..].parse().unwrap_or(plan.start)
                }
                _ => {}
            }
        })?;
        println!("{}", report.summary());
        for line in report.details() {
            println!("{line}");
        }
        reports.push(report);
    }
    if !args.no_record && plant.is_none() {
        record(&reports, args.live, "parity-l2", "mlx-optiq")?;
    }
    let mut failed: Vec<String> = reports
        .iter()
        .filter(|r| !r.passed())
        .map(|r| r.model.clone())
        .collect();
    // Speculative decoding with optiq's assistant drafter (committed goldens).
    if plant.is_none() && !args.live && args.model.as_deref().is_none_or(|m| m == "tiny-gemma4") {
        let r = harness::parity::spec_l2::run("tiny-gemma4", None)?;
        println!("L2 spec (assistant drafter) tiny-gemma4: {}", r.summary());
        if !r.passed() {
            failed.push("spec-l2/tiny-gemma4".into());
        }
    }
    if !failed.is_empty() {
        bail!("L2 failed for: {}", failed.join(", "));
    }
    Ok(())
}

pub fn freeze(model: Option<String>) -> Result<()> {
    use harness::parity::l3;
    let models: Vec<String> = match model {
        Some(m) => vec![m],
        None => l3::MODELS.iter().map(|m| m.to_string()).collect(),
    };
    for name in models {
        let dir = l3::freeze(&name)?;
        println!("froze the L2 trajectories of {name} -> {}", dir.display());
    }
    Ok(())
}

fn run_l3(args: &Args) -> Result<()> {
    use harness::parity::l3;
    if args.live {
        bail!("L3 has no oracle to run live; its reference is the frozen trajectory (harness freeze-perf-oracle)");
    }
    let models: Vec<&str> = match &args.model {
        Some(m) => vec![m.as_str()],
        None => l3::MODELS.to_vec(),
    };
    let plant = match args.plant.as_deref() {
        None => false,
        Some("perf-path") => true,
        Some(other) => {
            bail!("--plant for l3: `perf-path` (breaks the L3 decode path), not `{other}`")
        }
    };
    let _planted = plant
        .then(|| engine::plant::on(engine::plant::Defect::PerfDecodeDropsNewest))
        .transpose()?;
    if plant {
        println!("planted defect: the L3 decode path leaves the newest position out of attention");
    }
    let mut failed = Vec::new();
    for name in models {
        let report = l3::check(name, |_| {})?;
        println!("{}", report.summary());
        if !report.passed() {
            failed.push(name.to_owned());
        }
    }
    if !failed.is_empty() {
        bail!("L3 envelope failed for: {}", failed.join(", "));
    }
    Ok(())
}

pub fn run(args: Args) -> Result<()> {
    match args.tier.as_str() {
        "l1" => {}
        "l2" => return run_l2(&args),
        "l3" => return run_l3(&args),
        other => bail!("tier `{other}` does not exist (available: l1, l2, l3)"),
    }
    let models: Vec<&str> = match &args.model {
        Some(m) => vec![m.as_str()],
        None => l1::MODELS.to_vec(),
    };
    let live = if args.live {
        println!(
            "running the oracle now (mlx-lm in {})…",
            harness::oracle::venv_dir().display()
        );
        Some(l1::live_goldens("gen_l1.py", &models)?)
    } else {
        None
    };
    let plant = match &args.plant {
        Some(p) => {
            let (k, v) = p
                .split_once('=')
                .ok_or_else(|| anyhow::anyhow!("--plant wants KEY=VALUE, got `{p}`"))?;
            let v: serde_json::Value =
                serde_json::from_str(v).unwrap_or(serde_json::Value::String(v.into()));
            println!("planted defect: config.json {k} = {v}");
            Some((k.to_owned(), v))
        }
        None => None,
    };
    let mut reports = Vec::new();
    for name in models {
        let report = l1::check_named_against(name, live.as_ref().map(|d| d.path()), |c| {
            if let Some((k, v)) = &plant {
                c[k.as_str()] = v.clone();
            }
        })?;
        println!("{}", report.summary());
        for line in report.details() {
            println!("{line}");
        }
        reports.push(report);
    }
    // Goldens made with mlx-lm's KV quantization (committed goldens only).
    if plant.is_none() && !args.live {
        for (golden, _) in l1::KV_GOLDENS {
            let mut report = l1::check_golden(golden)?;
            if args.model.as_deref().is_some_and(|m| m != report.model) {
                continue;
            }
            report.model = golden.to_string();
            println!("{} (mlx-lm kv_bits)", report.summary());
            reports.push(report);
        }
    }
    if !args.no_record && plant.is_none() {
        record(&reports, args.live, "parity-l1", "mlx-lm")?;
    }
    // The B=N gate: batched decoding vs mlx-lm's BatchGenerator (committed goldens).
    let mut batch_failed = Vec::new();
    if plant.is_none()
        && !args.live
        && args
            .model
            .as_deref()
            .is_none_or(|m| m == "tiny-llama-trained")
    {
        for scenario in harness::parity::batch::SCENARIOS {
            let r = harness::parity::batch::run("tiny-llama-trained", scenario)?;
            println!("L1 batch tiny-llama-trained {scenario}: {}", r.summary());
            if !r.passed() {
                batch_failed.push(format!("batch/{scenario}"));
            }
        }
        // Speculative decoding vs mlx-lm's speculative_generate_step (ids, trace, log-probs).
        let r = harness::parity::spec::run("tiny-llama-trained", None)?;
        println!("L1 spec tiny-llama-trained: {}", r.summary());
        if !r.passed() {
            batch_failed.push("spec/tiny-llama-trained".into());
        }
        // The streaming detokenizer vs mlx-lm's: every piece of streamed text.
        for model in harness::parity::detok::MODELS {
            let r = harness::parity::detok::run(model, |_| {})?;
            println!("L1 detok {model}: {}", r.summary());
            if !r.passed() {
                batch_failed.push(format!("detok/{model}"));
            }
        }
        // LoRA training steps vs mlx-lm's LoRA layers, loss, autodiff and AdamW.
        for model in harness::parity::train::MODELS {
            let r = harness::parity::train::run(model, |_| {})?;
            println!("L1 train (LoRA) {model}: {}", r.summary());
            if !r.passed() {
                batch_failed.push(format!("train/{model}"));
            }
        }
    }
    let mut failed: Vec<String> = reports
        .iter()
        .filter(|r| !r.passed())
        .map(|r| r.model.clone())
        .collect();
    failed.extend(batch_failed);
    // The sampling gates (same models where they have sampling goldens).
    if plant.is_none() {
        let sampling_models: Vec<&str> = harness::parity::sampling::MODELS
            .into_iter()
            .filter(|m| args.model.as_deref().is_none_or(|want| want == *m))
            .collect();
        let live_sampling = match (args.live, sampling_models.is_empty()) {
            (true, false) => Some(l1::live_goldens("gen_sampling.py", &sampling_models)?),
            _ => None,
        };
        for name in sampling_models {
            let live_dir = live_sampling.as_ref().map(|d| d.path());
            let report = harness::parity::sampling::check_named_against(name, live_dir, |_| {})?;
            println!("{}", report.summary());
            for line in report.details() {
                println!("{line}");
            }
            if !report.passed() {
                failed.push(format!("sampling/{name}"));
            }
        }
    }
    if !failed.is_empty() {
        bail!("L1 failed for: {}", failed.join(", "));
    }
    Ok(())
}
