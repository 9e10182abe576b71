//! The quality gates of `harness eval`'s measures (rows `l3-kl` and `eval-ppl` of the gate
//! table), each seconds long on the committed tiny models:
//!
//! - the L3 KL gate: teacher-forced KL(L2 ‖ L3) over the held-out corpus — the perf path
//!   against the tier whose numerics it replaces — mean ≤ 5e-3 and max ≤ 5e-2 nats per
//!   position, and the perf path must have run (next to the L3 argmax envelope of
//!   `parity::l3`, which compares against a frozen L2 trajectory). KL(L1 ‖ L3) and
//!   KL(L1 ‖ L2) are measured beside it and reported, not bounded: on the tiny models the
//!   quantized KV scheme alone is far past these bounds (see the summary line);
//! - the L1 perplexity golden: `goldens/eval/<model>/index.json`, written by
//!   oracles/eval_ppl.py from mlx_lm.perplexity's own functions; the engine's rows must be
//!   the golden's ids and its perplexity the same double, bit for bit.

use super::Report;
use crate::eval::{data, kl, ppl, tier_name, EvalError, EvalSpec, TierStats};
use crate::goldens::TensorGolden;

pub const KL_MEAN_BOUND: f64 = 5e-3;
pub const KL_MAX_BOUND: f64 = 5e-2;
/// Rows the KL gate compares (of 64 ids, 16 prefilled: 49 positions each).
pub const GATE_ROWS: usize = 4;

fn corpus() -> std::path::PathBuf {
    crate::oracle::repo_root().join(data::HELDOUT)
}

/// The L3 KL gate's verdict on one model.
#[derive(Debug, Clone)]
pub struct KlGateReport {
    pub model: String,
    /// KL(L1 ‖ L2): what the quantized KV scheme itself costs.
    pub l1_l2: TierStats,
    /// KL(L1 ‖ L3): quantized KV plus the perf path.
    pub l1_l3: TierStats,
    /// KL(L2 ‖ L3): the perf path against the tier it speeds up (what the gate bounds).
    pub l2_l3: TierStats,
    pub perf_path_steps: usize,
}

fn within(s: &TierStats) -> bool {
    s.positions > 0 && s.kl_mean() <= KL_MEAN_BOUND && s.kl_max <= KL_MAX_BOUND
}

impl Report for KlGateReport {
    fn passed(&self) -> bool {
        self.perf_path_steps > 0 && within(&self.l2_l3)
    }

    fn summary(&self) -> String {
        let s = |t: &TierStats| {
            format!(
                "mean {:.3e} max {:.3e} top-1 {}/{}",
                t.kl_mean(),
                t.kl_max,
                t.top1_agree,
                t.positions
            )
        };
        format!(
            "L3 KL {}: KL(L2‖L3) {} (bounds: mean ≤ {KL_MEAN_BOUND:.0e}, max ≤ {KL_MAX_BOUND:.0e} \
             nats); measured beside it, unbounded: KL(L1‖L3) {}, KL(L1‖L2) {}; perf path ran {} \
             steps — {}",
            self.model,
            s(&self.l2_l3),
            s(&self.l1_l3),
            s(&self.l1_l2),
            self.perf_path_steps,
            if self.passed() { "pass" } else { "FAIL" }
        )
    }
}

/// Runs the KL gate on the committed tiny model `name`.
pub fn l3_kl(name: &str) -> Result<KlGateReport, EvalError> {
    let dir = crate::goldens::model_dir(name)?;
    let spec = EvalSpec::default();
    let tokenizer = engine::load::tokenizer::Tokenizer::load(&dir)?;
    let rows = data::load_data(&tokenizer, &data::documents(&corpus())?, &spec.data)?;
    let model = engine::model::load(&dir)?;
    let (options, skipped) = crate::eval::tier_options(&dir, None)?;
    if let Some(why) = skipped {
        return Err(EvalError::Data(why));
    }
    let tiers: Vec<_> = options
        .into_iter()
        .map(|(t, o)| (tier_name(t).to_owned(), o))
        .collect();
    let before = engine::model::sdpa::perf_decode_calls();
    let pairs = [(0, 1), (0, 2), (1, 2)];
    let mut stats = kl::compare(
        model.as_ref(),
        &tiers,
        &pairs,
        &rows[..GATE_ROWS],
        spec.prefix,
    )?
    .into_iter()
    .map(|p| p.stats);
    let perf_path_steps = engine::model::sdpa::perf_decode_calls() - before;
    let mut next = || stats.next().unwrap_or_default();
    Ok(KlGateReport {
        model: name.to_owned(),
        l1_l2: next(),
        l1_l3: next(),
        l2_l3: next(),
        perf_path_steps,
    })
}

/// The L1 perplexity against mlx_lm.perplexity's golden.
#[derive(Debug, Clone)]
pub struct PplGoldenReport {
    pub model: String,
    pub golden_ppl: f64,
    pub ppl: f64,
    pub golden_se: f64,
    pub se: f64,
    /// Whether the engine's rows are the golden's ids.
    pub same_rows: bool,
    pub tokens: usize,
}

impl Report for PplGoldenReport {
    fn passed(&self) -> bool {
        self.same_rows
            && self.ppl.to_bits() == self.golden_ppl.to_bits()
            && self.se.to_bits() == self.golden_se.to_bits()
    }

    fn summary(&self) -> String {
        format!(
            "L1 perplexity {}: engine {:?} ± {:?}, mlx_lm.perplexity {:?} ± {:?} over {} tokens, \
             ids {} — {}",
            self.model,
            self.ppl,
            self.se,
            self.golden_ppl,
            self.golden_se,
            self.tokens,
            if self.same_rows {
                "the golden's"
            } else {
                "NOT the golden's"
            },
            if self.passed() {
                "identical"
            } else {
                "FAIL (not identical)"
            }
        )
    }
}

/// The golden's settings as an [`EvalSpec`].
pub fn spec_of(golden: &serde_json::Value) -> Result<EvalSpec, EvalError> {
    let s = &golden["settings"];
    let n = |k: &str| {
        s[k].as_u64()
            .ok_or_else(|| EvalError::Data(format!("golden settings.{k} missing")))
    };
    Ok(EvalSpec {
        data: data::DataSpec {
            sequence_length: n("sequence_length")? as usize,
            num_samples: n("num_samples")? as usize,
            seed: n("seed")? as u32,
        },
        batch_size: n("batch_size")? as usize,
        ..EvalSpec::default()
    })
}

/// Checks the engine's L1 perplexity of `name` against `goldens/eval/<name>`.
pub fn ppl_golden(name: &str) -> Result<PplGoldenReport, EvalError> {
    let golden = TensorGolden::open_index_only(&format!("eval/{name}"))?;
    let spec = spec_of(&golden.index)?;
    let dir = crate::goldens::model_dir(name)?;
    let file = golden.index["settings"]["data"]
        .as_str()
        .unwrap_or(data::HELDOUT);
    let docs = data::documents(&crate::oracle::repo_root().join(file))?;
    let tokenizer = engine::load::tokenizer::Tokenizer::load(&dir)?;
    let rows = data::load_data(&tokenizer, &docs, &spec.data)?;
    let want: Vec<Vec<u32>> = serde_json::from_value(golden.index["data"].clone())
        .map_err(|e| EvalError::Data(format!("golden data: {e}")))?;
    let model = engine::model::load(&dir)?;
    let got = ppl::eval_ppl(model.as_ref(), &rows, spec.batch_size)?;
    // The doubles from their bits (a JSON float may not parse back to the same bits).
    let f = |k: &str| {
        golden.index[format!("{k}_bits")]
            .as_u64()
            .map_or(f64::NAN, f64::from_bits)
    };
    Ok(PplGoldenReport {
        model: name.to_owned(),
        golden_ppl: f("ppl"),
        ppl: got.ppl,
        golden_se: f("ppl_standard_error"),
        se: got.standard_error,
        same_rows: rows == want,
        tokens: got.tokens,
    })
}
