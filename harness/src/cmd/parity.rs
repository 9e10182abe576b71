use anyhow::{anyhow, bail, Result};
use harness::db::{Db, RowContext};
use harness::parity::gates::{Gate, Plant, Target, Tier, GATES, L3};
use harness::parity::Report;
use harness::preflight::{self, Thresholds};

#[derive(clap::Args)]
pub struct Args {
    /// The tier to run: runtime (the model-free MLX golden), l1 (vs mlx-lm), l2 (vs
    /// mlx-optiq), l3 (the envelope gate).
    #[arg(long, default_value = "l1")]
    tier: String,
    /// One model (default: every model of every gate of the tier).
    #[arg(long)]
    model: Option<String>,
    /// Run the oracle now (in oracles/.venv, same prompt ids) instead of reading the
    /// committed goldens, for the gates whose generator can (l1, sampling, l2); the other
    /// gates are left out.
    #[arg(long)]
    live: bool,
    /// Do not write result rows.
    #[arg(long)]
    no_record: bool,
    /// A planted defect, to see a gate fail; only the gates of the tier that know it run.
    /// l1: `KEY=VALUE` set in the model's config.json before loading (e.g.
    /// rms_norm_eps=1e-6; KEY may be a dotted path); l2: `sdpa=mlx-lm` (mlx-lm's quantized
    /// attention instead of optiq's fused kernel) or `kv_start=N`; l3: `perf-path`. An unknown
    /// one lists every gate's plants. Engine defects (perf-path, unmasked-padding, …) need a
    /// build with `--features plant`.
    #[arg(long, value_name = "PLANT")]
    plant: Option<String>,
}

/// Runs the gates of the tier from the gate table, one verdict block per run.
pub fn run(args: Args) -> Result<()> {
    let tier: Tier = args.tier.parse()?;
    let plant = match args.plant.as_deref() {
        Some(p) => Some(Plant::parse(p).map_err(|e| anyhow!("{e}; {}", plants_of(tier)))?),
        None => None,
    };
    let gates = choose(tier, &args, plant.as_ref())?;
    if let Some(p) = &plant {
        println!("planted defect: {p}");
    }
    let recorder = match args.no_record || plant.is_some() {
        true => None,
        false => Some(Recorder::open(tier, args.live)?),
    };
    let mut failed = Vec::new();
    for (gate, models) in gates {
        let live = match args.live {
            true => {
                let venv = harness::oracle::venv_dir();
                println!(
                    "running the oracle now ({} in {})…",
                    tier.oracle(),
                    venv.display()
                );
                Some(gate.live_goldens(&models)?)
            }
            false => None,
        };
        let cases: Vec<Option<&str>> = match gate.cases {
            [] => vec![None],
            cases => cases.iter().map(|c| Some(*c)).collect(),
        };
        for model in models {
            for &case in &cases {
                let live = live.as_ref().map(|d| d.path());
                let target = Target { model, case, live };
                let report = gate.run_target(&target, plant.as_ref())?;
                println!("{}", report.summary());
                for line in report.details() {
                    println!("{line}");
                }
                if let Some(r) = &recorder {
                    r.record(&gate.golden_name(model), report.as_ref())?;
                }
                if !report.passed() {
                    failed.push(gate.label(&target));
                }
            }
        }
    }
    if !failed.is_empty() {
        bail!("{tier} failed for: {}", failed.join(", "));
    }
    Ok(())
}

/// The gates of `tier` that --plant, --live and --model leave, each with its models.
fn choose(
    tier: Tier,
    args: &Args,
    plant: Option<&Plant>,
) -> Result<Vec<(&'static Gate, Vec<&'static str>)>> {
    let mut gates: Vec<&Gate> = GATES.iter().copied().filter(|g| g.tier == tier).collect();
    if let Some(p) = plant {
        gates.retain(|g| g.accepts(p));
        if gates.is_empty() {
            bail!(
                "no gate of tier {} has the plant `{p}`; {}",
                tier.name(),
                plants_of(tier)
            );
        }
    }
    if args.live {
        gates.retain(|g| g.live);
        if gates.is_empty() && tier == Tier::L3 {
            bail!("L3 has no oracle to run live; its reference is the frozen trajectory (harness freeze-perf-oracle)");
        }
        if gates.is_empty() {
            bail!("no gate of tier {} runs its oracle live", tier.name());
        }
    }
    let chosen: Vec<_> = gates
        .into_iter()
        .map(|g| (g, g.models_for(args.model.as_deref())))
        .filter(|(_, models)| !models.is_empty())
        .collect();
    if chosen.is_empty() {
        let model = args.model.as_deref().unwrap_or_default();
        bail!(
            "no gate of tier {} has goldens of `{model}` (see `harness goldens list`)",
            tier.name()
        );
    }
    Ok(chosen)
}

/// Every gate of `tier` with its plants, for an error message.
fn plants_of(tier: Tier) -> String {
    let gates: Vec<String> = GATES
        .iter()
        .filter(|g| g.tier == tier)
        .map(|g| format!("{}: {}", g.name, g.plants.join(", ")))
        .collect();
    format!("the plants of tier {}: {}", tier.name(), gates.join("; "))
}

/// Writes each report's counts to the results DB (suite `parity-<tier>`).
struct Recorder {
    db: Db,
    ctx: RowContext,
    tier: Tier,
    live: bool,
}

impl Recorder {
    fn open(tier: Tier, live: bool) -> Result<Self> {
        let state = preflight::check(&Thresholds::from_env());
        let tags = if live { "live" } else { "committed-goldens" };
        let ctx = RowContext {
            machine_state: serde_json::json!({ "before": state }).to_string(),
            ..RowContext::at(&state, tags)
        };
        Ok(Recorder {
            db: Db::open_default()?,
            ctx,
            tier,
            live,
        })
    }

    fn record(&self, model: &str, report: &dyn Report) -> Result<()> {
        let suite = format!("parity-{}", self.tier.name());
        for c in report.counts() {
            let measure = (c.metric, c.value as f64, format!("/{}", c.total));
            let row = self.ctx.row(
                &suite,
                model,
                (measure.0, measure.1, &measure.2),
                "engine",
                Some(self.tier.oracle().into()),
                serde_json::json!({ "live": self.live }),
            );
            self.db.insert(&row)?;
        }
        Ok(())
    }
}

pub fn freeze(model: Option<String>) -> Result<()> {
    let models: Vec<String> = match model {
        Some(m) => vec![m],
        None => L3.models().iter().map(|m| m.to_string()).collect(),
    };
    for name in models {
        let dir = harness::parity::l3::freeze(&name)?;
        println!("froze the L2 trajectories of {name} -> {}", dir.display());
    }
    Ok(())
}
