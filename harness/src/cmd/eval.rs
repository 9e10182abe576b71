//! `harness eval`: quality per tier on held-out text (harness::eval), rows into the results
//! DB under suite `quality`; `--oracle` also runs mlx_lm.perplexity's computation
//! (oracles/eval_ppl.py) and records both perplexities.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use harness::db::{Db, RowContext};
use harness::eval::{self, data, EvalReport, EvalSpec};
use harness::preflight::{self, Thresholds};

#[derive(clap::Args)]
pub struct Args {
    /// A committed tiny model (goldens/models/<name>) or a model directory; repeat for
    /// several. (The bench models are refused: their tokenizers are synthetic.)
    #[arg(long, default_values_t = [super::DEFAULT_MODEL.to_owned()])]
    model: Vec<String>,
    /// The held-out text (documents separated by blank lines); default: the committed
    /// goldens/eval/heldout.txt, which no tiny fixture was trained on.
    #[arg(long)]
    data: Option<PathBuf>,
    /// mlx_lm.perplexity's --sequence-length.
    #[arg(long, default_value_t = 64)]
    sequence_length: usize,
    /// mlx_lm.perplexity's --num-samples (rows; the corpus must hold that many).
    #[arg(long, default_value_t = 12)]
    num_samples: usize,
    /// mlx_lm.perplexity's --batch-size.
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    /// mlx_lm.perplexity's --seed (numpy's permutation of the documents).
    #[arg(long, default_value_t = 123)]
    seed: u32,
    /// Ids of each row prefilled before the teacher-forced steps.
    #[arg(long, default_value_t = 16)]
    prefix: usize,
    /// Rows the tiers are compared on (default: all).
    #[arg(long)]
    kl_rows: Option<usize>,
    /// The kv_config.json for L2/L3 (default: <model>/kv_config.json, else the L2 golden's).
    #[arg(long)]
    kv_config: Option<PathBuf>,
    /// Also run mlx_lm.perplexity's computation in the oracle venv (oracles/eval_ppl.py)
    /// and record both numbers; the engine's L1 must be identical.
    #[arg(long)]
    oracle: bool,
    /// Do not write result rows.
    #[arg(long)]
    no_record: bool,
}

impl Args {
    fn spec(&self) -> EvalSpec {
        EvalSpec {
            data: data::DataSpec {
                sequence_length: self.sequence_length,
                num_samples: self.num_samples,
                seed: self.seed,
            },
            batch_size: self.batch_size,
            prefix: self.prefix,
            kl_rows: self.kl_rows.unwrap_or(usize::MAX),
        }
    }
}

/// A model argument as a directory.
fn model_dir(name: &str) -> Result<PathBuf> {
    if harness::bench::models::by_name(name).is_some() {
        bail!(
            "bench model `{name}` has a synthetic word-level tokenizer (t0…tN, no eos_token): \
             held-out text would be all unknown tokens, and mlx_lm.perplexity's TextDataset \
             appends tokenizer.eos_token_id; evaluate a committed tiny model \
             (e.g. tiny-llama-trained, tiny-gemma4) or a model directory with a real tokenizer"
        );
    }
    let path = Path::new(name);
    if path.join("config.json").is_file() {
        return Ok(path.to_path_buf());
    }
    harness::goldens::model_dir(name).with_context(|| {
        format!("`{name}` is neither a committed tiny model (goldens/models) nor a model directory")
    })
}

/// mlx_lm.perplexity's (ppl, standard error) from oracles/eval_ppl.py, bounded in time.
fn oracle_ppl(dir: &Path, corpus: &Path, spec: &EvalSpec) -> Result<(f64, f64)> {
    let out = tempfile::tempdir()?;
    let json = out.path().join("ppl.json");
    let script = harness::oracle::repo_root().join("oracles/eval_ppl.py");
    let d = &spec.data;
    let mut child = std::process::Command::new(harness::oracle::python())
        .arg(&script)
        .args(["--model", &dir.to_string_lossy()])
        .args(["--data", &corpus.to_string_lossy()])
        .args(["--sequence-length", &d.sequence_length.to_string()])
        .args(["--num-samples", &d.num_samples.to_string()])
        .args(["--batch-size", &spec.batch_size.to_string()])
        .args(["--seed", &d.seed.to_string()])
        .args(["--json", &json.to_string_lossy()])
        .spawn()
        .with_context(|| format!("starting {}", harness::oracle::python().display()))?;
    let deadline = Instant::now() + Duration::from_secs(900);
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!("oracles/eval_ppl.py ran past 900 s and was killed");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    if !status.success() {
        bail!("oracles/eval_ppl.py failed ({status})");
    }
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json)?)?;
    // From the doubles' bits: serde_json's default float parsing is not always exact.
    let exact = |k: &str| -> Result<f64> {
        let bits = v[format!("{k}_bits")].as_u64();
        bits.map(f64::from_bits)
            .with_context(|| format!("eval_ppl.py wrote no {k}_bits"))
    };
    Ok((exact("ppl")?, exact("ppl_standard_error")?))
}

pub fn run(args: Args) -> Result<()> {
    let spec = args.spec();
    let corpus = args
        .data
        .clone()
        .unwrap_or_else(|| harness::oracle::repo_root().join(data::HELDOUT));
    let before = preflight::check(&Thresholds::from_env());
    let mut results = Vec::new();
    let mut failed = Vec::new();
    for name in &args.model {
        let dir = model_dir(name)?;
        let report = eval::evaluate(name, &dir, &corpus, &spec, args.kv_config.clone())?;
        for line in report.lines() {
            println!("{line}");
        }
        let oracle = match args.oracle {
            true => Some(oracle_ppl(&dir, &corpus, &spec)?),
            false => None,
        };
        if let Some((ppl, se)) = oracle {
            let same = ppl.to_bits() == report.ppl.ppl.to_bits();
            println!(
                "  perplexity: engine L1 {:?} ± {:?}, mlx_lm.perplexity {ppl:?} ± {se:?} — {}",
                report.ppl.ppl,
                report.ppl.standard_error,
                if same { "identical" } else { "DIFFERENT" }
            );
            if !same {
                failed.push(name.clone());
            }
        }
        results.push((report, oracle));
    }
    let after = preflight::check_since(&before, &Thresholds::from_env());
    if !args.no_record {
        record(&results, &corpus, &before, &after)?;
    }
    if !failed.is_empty() {
        bail!(
            "the engine's L1 perplexity is not mlx_lm.perplexity's for: {}",
            failed.join(", ")
        );
    }
    Ok(())
}

/// Rows under suite `quality`: per tier (stack engine-l1/-l2/-l3) KL mean and max, top-1
/// agreement and teacher-forced perplexity; the perplexity (stack engine, and mlx-lm when
/// the oracle ran). Preflight before and after decide `clean`, as the benches' rows.
fn record(
    results: &[(EvalReport, Option<(f64, f64)>)],
    corpus: &Path,
    before: &preflight::MachineState,
    after: &preflight::MachineState,
) -> Result<()> {
    let labels = harness::bench::machine_labels(vec!["teacher-forced".to_owned()], before, after)?;
    let verdict = labels.1;
    let ctx = RowContext::between(before, after, labels);
    let db = Db::open_default()?;
    let root = harness::oracle::repo_root();
    let corpus = corpus
        .strip_prefix(&root)
        .unwrap_or(corpus)
        .display()
        .to_string();
    for (report, oracle) in results {
        let s = &report.spec;
        let params = serde_json::json!({
            "corpus": corpus,
            "sequence_length": s.data.sequence_length,
            "num_samples": s.data.num_samples,
            "batch_size": s.batch_size,
            "seed": s.data.seed,
            "prefix": s.prefix,
            "kl_positions": report.tiers.first().map_or(0, |p| p.stats.positions),
        });
        let row = |m: (&str, f64, &str), stack: &str, peer: Option<&str>| {
            ctx.row(
                "quality",
                &report.model,
                m,
                stack,
                peer.map(str::to_owned),
                params.clone(),
            )
        };
        db.insert(&row(("ppl", report.ppl.ppl, ""), "engine", Some("mlx-lm")))?;
        if let Some((ppl, _)) = oracle {
            db.insert(&row(("ppl", *ppl, ""), "mlx-lm", None))?;
            let same = f64::from(u8::from(ppl.to_bits() == report.ppl.ppl.to_bits()));
            db.insert(&row(("ppl_identical", same, ""), "engine", Some("mlx-lm")))?;
        }
        for p in &report.tiers {
            let (stack, t) = (format!("engine-{}", p.tier.to_lowercase()), &p.stats);
            let peer = format!("engine-{}", p.reference.to_lowercase());
            // Against L1 the plain names; against another tier (L2 ‖ L3) a suffix.
            let suffix = match p.reference.as_str() {
                "L1" => String::new(),
                r => format!("_vs_{}", r.to_lowercase()),
            };
            for (m, v, unit) in [
                ("kl_mean", t.kl_mean(), "nats"),
                ("kl_max", t.kl_max, "nats"),
                ("top1_agree", 100.0 * t.top1(), "%"),
            ] {
                let metric = format!("{m}{suffix}");
                db.insert(&row((&metric, v, unit), &stack, Some(&peer)))?;
            }
            if suffix.is_empty() {
                let m = ("tf_ppl", t.teacher_forced_ppl(), "");
                db.insert(&row(m, &stack, Some(&peer)))?;
            }
        }
    }
    println!(
        "recorded quality rows (preflight {verdict}) in {}",
        harness::db::default_path().display()
    );
    Ok(())
}
