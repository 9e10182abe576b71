//! `harness dist-rank l1`: one rank of the distributed L1 gate. Every rank (started by
//! `mlx.launch`, or with `MLX_RANK`/`MLX_HOSTFILE` set by a test) joins the group, loads its
//! part of the model as `engine generate` does (tensor parallel, or pipeline parallel when
//! the golden was made with `--pipeline`), and runs the L1 check on a golden of
//! `goldens/l1-dist/<tp|pp>/<model>`: every stored logit vector bit-exact and every greedy
//! id identical. Every rank runs the same computation (the collectives must match); rank 0
//! alone prints the verdict, as one JSON line per golden, and its exit status is the gate's
//! (0 all passed, 1 one failed). Several goldens of one mode run one after another in the
//! same group, so a gate over all of them pays for starting the ranks and forming the ring
//! once. A rank whose step fails exits with `engine::dist::exit::PEER_LOST`.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use engine::cache::Cache;
use engine::dist::{DistArgs, Mode};
use engine::load::template::ChatTemplate;
use engine::load::tokenizer::Tokenizer;
use engine::model::LanguageModel;
use harness::goldens::TensorGolden;
use harness::parity::l1::{self, ModelReport};
use harness::parity::Report;
use mlx_rs::error::Exception;
use mlx_rs::Array;
use serde_json::{json, Value};

#[derive(clap::Subcommand)]
pub enum Command {
    /// The L1 gate on this rank's part of the model, against a golden of mlx-lm's sharded
    /// generation (`l1-dist/tp/tiny-llama`; `oracles/gen_l1_dist.py`). Rank 0 prints
    /// `{"summary", "passed", "cases": […], …}` on one line and exits 1 if it failed.
    L1(L1Args),
}

#[derive(clap::Args)]
pub struct L1Args {
    /// The golden under goldens/ (machine layer first, then the reference set), e.g.
    /// `l1-dist/tp/tiny-llama`; its settings.mode `pp` runs pipeline parallel. Repeat it to
    /// run several goldens of one mode in turn.
    #[arg(long, required = true)]
    golden: Vec<String>,
    /// The model directory (default: each golden's own model under goldens/models).
    #[arg(long)]
    model: Option<PathBuf>,
    /// MLX's distributed backend (ring, mpi, nccl, jaccl; any = the first that works).
    #[arg(long, default_value = "any")]
    dist_backend: String,
    /// Seconds a rank waits for the group to form before it gives up (exit 3).
    #[arg(long, default_value_t = 60.0, value_parser = engine::dist::seconds)]
    dist_connect_timeout: f64,
    /// Seconds a step may wait on the other ranks before this rank gives up (exit 5).
    #[arg(long, default_value_t = 60.0, value_parser = engine::dist::seconds)]
    dist_timeout: f64,
}

pub fn run(command: Command) -> Result<()> {
    match command {
        Command::L1(args) => l1_rank(args),
    }
}

/// One rank of the distributed L1 gate; ends the process with the gate's status.
fn l1_rank(args: L1Args) -> Result<()> {
    #[cfg(feature = "plant")]
    engine::plant::on_from_env().map_err(anyhow::Error::msg)?;
    let goldens = (args.golden.iter())
        .map(|name| TensorGolden::open(name))
        .collect::<Result<Vec<_>, _>>()?;
    let modes = goldens
        .iter()
        .map(golden_mode)
        .collect::<Result<Vec<_>>>()?;
    let mode = modes[0];
    if let Some(other) = modes.iter().position(|&m| m != mode) {
        bail!(
            "{} is {} parallel and {} is {}: one group runs goldens of one mode",
            args.golden[0],
            mode.name(),
            args.golden[other],
            modes[other].name()
        );
    }
    let dist = DistArgs {
        pipeline: mode == Mode::Pipeline,
        dist_backend: args.dist_backend.clone(),
        dist_connect_timeout: args.dist_connect_timeout,
        dist_timeout: args.dist_timeout,
    };
    let group = engine::dist::init(&dist)?;
    let ranks = group.map_or(1, |g| g.size);
    for (golden, name) in goldens.iter().zip(&args.golden) {
        if let Some(want) = golden.index["settings"]["ranks"].as_u64() {
            if group.is_some() && want as usize != ranks {
                bail!("{name} was made on {want} ranks; this group has {ranks}");
            }
        }
    }
    // Every rank passes the end together (with a defect planted that drops the collectives,
    // the ranks would otherwise finish apart, and the first to exit look like a lost peer).
    let checked = (goldens.iter().zip(&args.golden))
        .map(|(golden, name)| check(golden, name, &args))
        .collect::<Result<Vec<_>>>()
        .and_then(|r| Ok(engine::dist::finish().map(|()| r)?));
    let reports = match checked {
        Ok(reports) => reports,
        // A failed step leaves the ring unusable: this rank exits (status 4), so that the
        // launcher and the other ranks stop too.
        Err(e) if group.is_some() => engine::dist::fatal(&format!("{e:#}")),
        Err(e) => return Err(e),
    };
    if !engine::dist::is_writer() {
        return Ok(());
    }
    for (report, name) in reports.iter().zip(&args.golden) {
        println!("{}", verdict(name, mode, ranks, report));
    }
    if !reports.iter().all(ModelReport::passed) {
        std::process::exit(1);
    }
    Ok(())
}

/// Tensor or pipeline parallel, as the golden's settings.mode says (`tp` without one, as a
/// single-process golden).
fn golden_mode(golden: &TensorGolden) -> Result<Mode> {
    match golden.index["settings"]["mode"].as_str() {
        None | Some("tp") => Ok(Mode::Tensor),
        Some("pp") => Ok(Mode::Pipeline),
        Some(other) => bail!("golden settings.mode `{other}`: expected tp or pp"),
    }
}

/// Loads this rank's part of the model (`engine::model::load` shards under a group) and runs
/// every case of the golden through it, with the golden's session options and prefill chunk.
fn check(golden: &TensorGolden, name: &str, args: &L1Args) -> Result<ModelReport> {
    // After an earlier golden of the run the step watchdog is armed: the load starts its
    // clock afresh (a rank of the first golden loads before it is armed).
    engine::dist::tick("loading the next golden's model");
    let dir = match &args.model {
        Some(dir) => dir.clone(),
        None => {
            let name = golden.index["model"]
                .as_str()
                .context("the golden names no model")?;
            harness::goldens::model_dir(name.trim_start_matches("models/"))?
        }
    };
    let model = engine::model::load(&dir)
        .with_context(|| format!("loading model from {}", dir.display()))?;
    let tokenizer = Tokenizer::load(&dir)?;
    let template = ChatTemplate::from_tokenizer(&tokenizer)?;
    let prefill_step = golden.index["settings"]["prefill_step_size"]
        .as_u64()
        .map_or(engine::generate::PREFILL_STEP, |s| s as usize);
    engine::dist::arm("the first case's prefill");
    let ticking = Ticking(model.as_ref());
    let mut report = l1::check_model_opts(
        golden,
        &ticking,
        &tokenizer,
        template.as_ref(),
        prefill_step,
        &l1::options(golden),
    )?;
    report.model = name.to_owned();
    Ok(report)
}

/// Rank 0's line: the verdict, and per case where it first differs.
fn verdict(golden: &str, mode: Mode, ranks: usize, report: &ModelReport) -> Value {
    let max = |c: &l1::CaseReport| c.logits.iter().map(|l| l.max_abs_diff).fold(0.0, f64::max);
    let cases: Vec<Value> = report
        .cases
        .iter()
        .map(|c| {
            json!({
                "name": c.name,
                "passed": c.passed(),
                "logits_exact": c.logits_exact(),
                "logits": c.logits.len(),
                "first_inexact_step": c.first_inexact_logits(),
                "max_abs_diff": max(c),
                "greedy_matching": c.greedy_matching,
                "greedy_total": c.greedy_total,
                "first_divergent_step": c.first_divergent_step,
                "ids_match": c.ids_match,
                "template_match": c.template_match,
            })
        })
        .collect();
    let counts: Value = report
        .counts()
        .iter()
        .map(|c| (c.metric.to_owned(), json!([c.value, c.total])))
        .collect::<serde_json::Map<_, _>>()
        .into();
    json!({
        "gate": "l1-dist",
        "golden": golden,
        "mode": mode.name(),
        "ranks": ranks,
        "summary": report.summary(),
        "passed": report.passed(),
        "max_abs_diff": report.cases.iter().map(max).fold(0.0, f64::max),
        "counts": counts,
        "cases": cases,
        "details": report.details(),
    })
}

/// The model as it is, with a step-watchdog tick at every forward: the one before it has
/// been evaluated by then (its logits compared, its greedy id taken), so a rank whose peer
/// stalls exits after `--dist-timeout` instead of waiting forever.
struct Ticking<'a>(&'a dyn LanguageModel);

impl LanguageModel for Ticking<'_> {
    fn model_type(&self) -> &str {
        self.0.model_type()
    }

    fn activation_dtype(&self) -> mlx_rs::Dtype {
        self.0.activation_dtype()
    }

    fn vocab_size(&self) -> usize {
        self.0.vocab_size()
    }

    fn make_caches(&self) -> Vec<Box<dyn Cache>> {
        self.0.make_caches()
    }

    fn forward(&self, ids: &Array, caches: &mut [Box<dyn Cache>]) -> Result<Array, Exception> {
        engine::dist::tick("a forward step");
        self.0.forward(ids, caches)
    }

    fn linears(&self) -> Vec<(String, &engine::model::layers::Linear)> {
        self.0.linears()
    }

    fn switch_linears(&self) -> Vec<(String, &engine::model::moe::SwitchLinear)> {
        self.0.switch_linears()
    }

    fn as_layered(&self) -> Option<&dyn engine::model::Layered> {
        self.0.as_layered()
    }

    fn as_assistant_target(&self) -> Option<&dyn engine::model::AssistantTarget> {
        self.0.as_assistant_target()
    }
}
