//! `harness eval`: the quality of every tier on held-out text. Per tier: teacher-forced
//! KL(L1 ‖ tier) per position (mean and max nats), top-1 agreement with L1 and the
//! teacher-forced perplexity of the decode path (`kl.rs`); for the model itself, the
//! perplexity exactly as `mlx_lm.perplexity` computes it (`ppl.rs`, over `data.rs`'s rows;
//! L1 must give mlx-lm's number bit for bit). The L3 KL gate and the L1 perplexity golden
//! check on these measures are gate-table rows (`parity/quality.rs`).

pub mod data;
pub mod kl;
pub mod ppl;
pub mod render;

use std::path::{Path, PathBuf};

use engine::generate::SessionOptions;
use engine::tiers::{Tier, TierArgs};

pub use data::DataSpec;
pub use kl::TierStats;
pub use ppl::Perplexity;

#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    #[error("eval data: {0}")]
    Data(String),
    #[error("engine: {0}")]
    Load(#[from] engine::load::LoadError),
    #[error("MLX: {0}")]
    Mlx(#[from] mlx_rs::error::Exception),
    #[error("tier options: {0}")]
    Tier(#[from] engine::tiers::TierError),
    #[error(transparent)]
    Golden(#[from] crate::goldens::GoldenError),
}

/// Everything an evaluation is asked for.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct EvalSpec {
    pub data: DataSpec,
    /// mlx_lm.perplexity's --batch-size.
    pub batch_size: usize,
    /// Ids prefilled before the teacher-forced steps of each row.
    pub prefix: usize,
    /// How many rows (the first ones) the tiers are compared on (all when larger).
    pub kl_rows: usize,
}

impl Default for EvalSpec {
    /// Sized for the tiny models and the committed held-out corpus (1 104 tokens with
    /// tiny-llama-trained's tokenizer): 12 rows of 64, two batches (8 and 4).
    fn default() -> Self {
        EvalSpec {
            data: DataSpec {
                sequence_length: 64,
                num_samples: 12,
                seed: 123,
            },
            batch_size: 8,
            prefix: 16,
            kl_rows: 12,
        }
    }
}

/// Each tier with its session options.
pub type TierOptions = Vec<(Tier, SessionOptions)>;

/// The tiers' session options for the model in `dir`, L1 first. L2 and L3 need a
/// kv_config: `kv_config`, else `<dir>/kv_config.json`, else the committed L2 golden's
/// (`goldens/l2/<name>/kv_config.json`, the tiny models); without one only L1 is returned
/// with the reason.
pub fn tier_options(
    dir: &Path,
    kv_config: Option<PathBuf>,
) -> Result<(TierOptions, Option<String>), EvalError> {
    let preset = |tier: Tier, kv_config: Option<PathBuf>| TierArgs {
        l1: tier == Tier::L1,
        l2: tier == Tier::L2,
        l3: tier == Tier::L3,
        kv_quant: None,
        kv_config,
        kv_group_size: 64,
        quantized_kv_start: 0,
        fused_sdpa: None,
        perf_decode: None,
        no_compile: false,
    };
    let mut out = vec![(Tier::L1, preset(Tier::L1, None).resolve(dir)?)];
    let name = dir.file_name().map(|n| n.to_string_lossy().into_owned());
    let golden_kv = name.and_then(|n| {
        let p = crate::goldens::goldens_root()
            .join("l2")
            .join(n)
            .join("kv_config.json");
        p.is_file().then_some(p)
    });
    let kv = kv_config
        .or_else(|| Some(dir.join("kv_config.json")).filter(|p| p.is_file()))
        .or(golden_kv);
    let Some(kv) = kv else {
        return Ok((
            out,
            Some(format!(
                "L2/L3 need a kv_config.json ({} has none; pass --kv-config PATH)",
                dir.display()
            )),
        ));
    };
    for tier in [Tier::L2, Tier::L3] {
        out.push((tier, preset(tier, Some(kv.clone())).resolve(dir)?));
    }
    Ok((out, None))
}

pub fn tier_name(t: Tier) -> &'static str {
    match t {
        Tier::L1 => "L1",
        Tier::L2 => "L2",
        Tier::L3 => "L3",
    }
}

/// One model's evaluation.
#[derive(Debug, Clone, serde::Serialize)]
pub struct EvalReport {
    pub model: String,
    pub corpus: String,
    pub spec: EvalSpec,
    /// mlx_lm.perplexity's computation on the engine (L1: dense, no cache).
    pub ppl: Perplexity,
    /// KL(L1 ‖ tier) per tier (L1 included: KL 0), then KL(L2 ‖ L3), teacher-forced.
    pub tiers: Vec<kl::Pair>,
    /// Steps that went through the L3 perf path while L3 ran.
    pub perf_path_steps: usize,
    /// Why L2/L3 were left out, if they were.
    pub skipped: Option<String>,
}

/// Evaluates the model in `dir` on the documents of `corpus`.
pub fn evaluate(
    name: &str,
    dir: &Path,
    corpus: &Path,
    spec: &EvalSpec,
    kv_config: Option<PathBuf>,
) -> Result<EvalReport, EvalError> {
    let tokenizer = engine::load::tokenizer::Tokenizer::load(dir)?;
    let rows = data::load_data(&tokenizer, &data::documents(corpus)?, &spec.data)?;
    let model = engine::model::load(dir)?;
    let ppl = ppl::eval_ppl(model.as_ref(), &rows, spec.batch_size)?;
    let (options, skipped) = tier_options(dir, kv_config)?;
    let tiers: Vec<(String, SessionOptions)> = options
        .into_iter()
        .map(|(t, o)| (tier_name(t).to_owned(), o))
        .collect();
    // KL(L1 ‖ every tier), and KL(L2 ‖ L3): the perf path against the tier it speeds up.
    let mut pairs: Vec<(usize, usize)> = (0..tiers.len()).map(|t| (0, t)).collect();
    if tiers.len() == 3 {
        pairs.push((1, 2));
    }
    let before = engine::model::sdpa::perf_decode_calls();
    let kl_rows = &rows[..spec.kl_rows.min(rows.len())];
    let tiers = kl::compare(model.as_ref(), &tiers, &pairs, kl_rows, spec.prefix)?;
    Ok(EvalReport {
        model: name.to_owned(),
        corpus: corpus.display().to_string(),
        spec: spec.clone(),
        ppl,
        tiers,
        perf_path_steps: engine::model::sdpa::perf_decode_calls() - before,
        skipped,
    })
}

impl EvalReport {
    /// Human-readable lines.
    pub fn lines(&self) -> Vec<String> {
        let mut out = vec![format!(
            "{}: perplexity (mlx_lm.perplexity's computation, L1) {} ± {} over {} tokens",
            self.model, self.ppl.ppl, self.ppl.standard_error, self.ppl.tokens
        )];
        for p in &self.tiers {
            let (r, t, s) = (&p.reference, &p.tier, &p.stats);
            out.push(format!(
                "  {t}: KL({r}‖{t}) mean {:.3e} max {:.3e} nats (row {}, position {}), \
                 top-1 = {r} {}/{} ({:.1} %), teacher-forced ppl {:.4}",
                s.kl_mean(),
                s.kl_max,
                s.kl_max_at.0,
                s.kl_max_at.1,
                s.top1_agree,
                s.positions,
                100.0 * s.top1(),
                s.teacher_forced_ppl()
            ));
        }
        if let Some(why) = &self.skipped {
            out.push(format!("  {why}"));
        }
        out
    }
}
