//! L3: our own perf paths, which have no oracle. `freeze` records a trajectory from our own
//! L2 engine (bit-exact with optiq) — 64 greedy ids on a short and a long prompt — with a
//! fingerprint of everything that shapes the graph. The gate then runs the L3 engine
//! teacher-forced (the frozen id is fed at every step, so one disagreement cannot cascade)
//! and passes iff its argmax agrees with the frozen id on at least 56 of 64 steps on both
//! prompts AND a counter shows the perf path actually ran. A fingerprint that no longer
//! matches is refused: re-freeze, never compare against a stale trajectory.

use std::path::PathBuf;

use engine::cache::QuantSdpa;
use engine::generate::{greedy, Session, SessionOptions};
use engine::load::tokenizer::Tokenizer;
use engine::model::sdpa::perf_decode_calls;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::{ParityError, Report};
use crate::goldens::{goldens_root, TensorGolden};

pub const STEPS: usize = 64;
pub const MIN_AGREEMENT: usize = 56;
/// Long enough that the KV axis spans two of optiq's 512-position tiles.
const LONG_PROMPT_TOKENS: usize = 700;
const PREFILL_STEP: usize = 256;

#[derive(Debug, Serialize, Deserialize)]
pub struct FrozenCase {
    pub name: String,
    pub prompt_ids: Vec<u32>,
    pub ids: Vec<u32>,
}

#[derive(Debug, Serialize, Deserialize)]
struct Frozen {
    fingerprint: String,
    fingerprint_inputs: serde_json::Value,
    cases: Vec<FrozenCase>,
}

/// One prompt's agreement.
#[derive(Debug, Clone)]
pub struct CaseAgreement {
    pub name: String,
    pub agree: usize,
    pub total: usize,
    pub first_disagreement: Option<usize>,
}

#[derive(Debug, Clone)]
pub struct L3Report {
    pub model: String,
    pub cases: Vec<CaseAgreement>,
    /// Decode steps that went through the L3 path during the gate.
    pub perf_path_steps: usize,
}

impl Report for L3Report {
    fn passed(&self) -> bool {
        self.perf_path_steps > 0 && self.cases.iter().all(|c| c.agree >= MIN_AGREEMENT)
    }

    fn summary(&self) -> String {
        let cases: Vec<String> = self
            .cases
            .iter()
            .map(|c| {
                let first = c.first_disagreement.map_or(String::new(), |s| {
                    format!(", first disagreement at step {s}")
                });
                format!("{} {}/{}{first}", c.name, c.agree, c.total)
            })
            .collect();
        format!(
            "L3 {}: {} (needs ≥{MIN_AGREEMENT}/{STEPS} each), perf path ran {} steps — {}",
            self.model,
            cases.join(", "),
            self.perf_path_steps,
            if self.passed() { "pass" } else { "FAIL" }
        )
    }
}

/// The L2 options for `name` (its L2 golden's kv_config, optiq's fused kernel).
fn l2_options(name: &str) -> Result<(SessionOptions, String), ParityError> {
    let golden = TensorGolden::open_index_only(&format!("l2/{name}"))?;
    let opts = super::l2::options(&golden)?;
    let kv = std::fs::read_to_string(golden.dir.join("kv_config.json"))
        .map_err(|e| ParityError::Index(format!("kv_config.json: {e}")))?;
    Ok((opts, kv))
}

fn l3_options(mut opts: SessionOptions) -> SessionOptions {
    if let Some(plan) = opts.kv_quant.as_mut() {
        plan.sdpa = QuantSdpa::DequantDecode;
    }
    opts
}

/// sha256 over what shapes the graph and the trajectory: the model's config.json and
/// weights, the KV scheme, the conversion start, the prefill chunk and the step count.
fn fingerprint(
    name: &str,
    opts: &SessionOptions,
    kv_config: &str,
) -> Result<(String, serde_json::Value), ParityError> {
    let dir = crate::goldens::model_dir(name)?;
    let read =
        |f: &str| std::fs::read(dir.join(f)).map_err(|e| ParityError::Index(format!("{f}: {e}")));
    let hex = |b: &[u8]| format!("{:x}", Sha256::digest(b));
    let plan = opts.kv_quant.as_ref();
    let inputs = serde_json::json!({
        "config_json_sha256": hex(&read("config.json")?),
        "weights_sha256": hex(&read("model.safetensors")?),
        "kv_config": serde_json::from_str::<serde_json::Value>(kv_config).unwrap_or_default(),
        "quantized_kv_start": plan.map(|p| p.start),
        "prefill_step": PREFILL_STEP,
        "steps": STEPS,
    });
    let inputs = sorted_keys(&inputs);
    Ok((hex(inputs.to_string().as_bytes()), inputs))
}

/// `v` with every object's keys in sorted order, so that its text — and the fingerprint —
/// does not depend on insertion order (serde_json keeps it, with `preserve_order`).
fn sorted_keys(v: &serde_json::Value) -> serde_json::Value {
    match v {
        serde_json::Value::Object(m) => {
            let mut keys: Vec<&String> = m.keys().collect();
            keys.sort();
            let sorted = keys.into_iter().map(|k| (k.clone(), sorted_keys(&m[k])));
            serde_json::Value::Object(sorted.collect())
        }
        serde_json::Value::Array(a) => {
            serde_json::Value::Array(a.iter().map(sorted_keys).collect())
        }
        other => other.clone(),
    }
}

fn prompts(name: &str) -> Result<Vec<(String, Vec<u32>)>, ParityError> {
    let tokenizer = Tokenizer::load(&crate::goldens::model_dir(name)?)?;
    let corpus = std::fs::read_to_string(crate::oracle::repo_root().join("oracles/corpus.txt"))
        .map_err(|e| ParityError::Index(format!("oracles/corpus.txt: {e}")))?;
    let mut long = tokenizer.encode(&corpus, true)?;
    long.truncate(LONG_PROMPT_TOKENS);
    Ok(vec![
        ("short".into(), tokenizer.encode("The little robot", true)?),
        ("long".into(), long),
    ])
}

fn frozen_dir(name: &str) -> PathBuf {
    let root = goldens_root();
    let reference = std::fs::read_to_string(root.join("REFERENCE")).unwrap_or_default();
    let key = crate::machine::machine_key();
    if reference.trim() == key {
        root.join("l3").join(name)
    } else {
        root.join(key).join("l3").join(name)
    }
}

/// Freezes the L2 trajectories of `name` (atomically: a temp file renamed into place).
pub fn freeze(name: &str) -> Result<PathBuf, ParityError> {
    let (opts, kv) = l2_options(name)?;
    let model = engine::model::load(&crate::goldens::model_dir(name)?)?;
    let mut cases = Vec::new();
    for (case, prompt) in prompts(name)? {
        let mut session = Session::with_options(model.as_ref(), &opts);
        session.prefill_step = PREFILL_STEP;
        let mut ids = vec![greedy(&session.prefill(&prompt)?)?];
        while ids.len() < STEPS {
            let last = *ids.last().unwrap();
            ids.push(greedy(&session.step(&[last])?)?);
        }
        cases.push(FrozenCase {
            name: case,
            prompt_ids: prompt,
            ids,
        });
    }
    let (fp, inputs) = fingerprint(name, &opts, &kv)?;
    let state = crate::preflight::check(&crate::preflight::Thresholds::from_env());
    let index = serde_json::json!({
        "provenance": {
            "oracle": "engine L2 (self: bit-exact with mlx-optiq on the L2 goldens)",
            "oracle_version": engine::VERSION,
            "mlx_version": engine::runtime::mlx_version(),
            "command": std::env::args().collect::<Vec<_>>().join(" "),
            "machine_key": state.machine_key,
            "commit": state.commit,
            "created": state.at,
        },
        "generator": "harness/src/parity/l3.rs",
        "model": format!("models/{name}"),
        "fingerprint": fp,
        "fingerprint_inputs": inputs,
        "cases": cases,
    });
    let dir = frozen_dir(name);
    std::fs::create_dir_all(&dir).map_err(|e| ParityError::Index(e.to_string()))?;
    let tmp = dir.join("index.json.tmp");
    std::fs::write(&tmp, serde_json::to_string_pretty(&index).unwrap())
        .and_then(|_| std::fs::rename(&tmp, dir.join("index.json")))
        .map_err(|e| ParityError::Index(format!("writing {}: {e}", dir.display())))?;
    Ok(dir)
}

/// The envelope gate for `name` against its frozen trajectories `golden` (`l3/<name>`);
/// `opts_tweak` may change the L3 options (planted defects).
pub fn check(
    name: &str,
    golden: &TensorGolden,
    opts_tweak: impl FnOnce(&mut SessionOptions),
) -> Result<L3Report, ParityError> {
    let frozen: Frozen = serde_json::from_value(golden.index.clone())
        .map_err(|e| ParityError::Index(format!("l3/{name}: {e}")))?;
    let (l2, kv) = l2_options(name)?;
    let (fp, _) = fingerprint(name, &l2, &kv)?;
    if fp != frozen.fingerprint {
        return Err(ParityError::Index(format!(
            "l3/{name}: the frozen perf oracle is stale (fingerprint {} was frozen, the current \
             model/KV scheme gives {fp}); refusing to compare — run `harness freeze-perf-oracle \
             --model {name}`",
            frozen.fingerprint
        )));
    }
    let mut opts = l3_options(l2);
    opts_tweak(&mut opts);
    let model = engine::model::load(&crate::goldens::model_dir(name)?)?;
    let before = perf_decode_calls();
    let mut cases = Vec::new();
    for case in &frozen.cases {
        let mut session = Session::with_options(model.as_ref(), &opts);
        session.prefill_step = PREFILL_STEP;
        let mut logits = session.prefill(&case.prompt_ids)?;
        let (mut agree, mut first) = (0, None);
        for (step, &frozen_id) in case.ids.iter().enumerate() {
            if greedy(&logits)? == frozen_id {
                agree += 1;
            } else if first.is_none() {
                first = Some(step);
            }
            if step + 1 < case.ids.len() {
                logits = session.step(&[frozen_id])?; // teacher forcing
            }
        }
        cases.push(CaseAgreement {
            name: case.name.clone(),
            agree,
            total: case.ids.len(),
            first_disagreement: first,
        });
    }
    Ok(L3Report {
        model: name.to_owned(),
        cases,
        perf_path_steps: perf_decode_calls() - before,
    })
}
