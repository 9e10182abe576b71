//! L1 at real vocabulary sizes. A tiny model (goldens/models) with its embedding — and its
//! separate unembedding, if it has one — resized to a real tokenizer's vocabulary, the
//! tokenizer being a fetched fixture (`scripts/fetch_fixtures.sh`). The big matrices are not
//! committed: they are regenerated here from a fixed seed (`materialize`), and the golden
//! pins the sha256 of the weights file so that the oracle and the engine judge the same bytes.
//!
//! Full-vocabulary logits at 128k–262k entries would make multi-megabyte goldens, so the
//! golden keeps, per compared step, the sha256 of the f32 logits (bit-exact or not, with
//! certainty) and the top entries (what the report shows, and the top-2 gap for ties).

use std::path::{Path, PathBuf};

use engine::generate::{greedy, Session};
use engine::load::template::ChatTemplate;
use engine::load::tokenizer::Tokenizer;
use safetensors::tensor::{Dtype, TensorView};
use serde::Deserialize;

use super::fixture::sha256_hex;
use super::l1::Prompt;
use super::{Count, ParityError, Report};

/// A real tokenizer and the tiny model whose vocabulary is resized to it.
#[derive(Debug, Clone, Copy)]
pub struct Pairing {
    /// The model's name in the gate (`vocab-<fixture>`).
    pub name: &'static str,
    /// The tokenizer fixture (`<cache>/fixtures/tokenizers/<fixture>`).
    pub fixture: &'static str,
    /// The tiny model under goldens/models whose other weights are kept.
    pub base: &'static str,
    /// The real model's `vocab_size` (embedding rows; at least the tokenizer's length).
    pub vocab_size: usize,
}

pub const PAIRINGS: &[Pairing] = &[
    Pairing {
        name: "vocab-qwen3",
        fixture: "qwen3",
        base: "tiny-qwen3",
        vocab_size: 151_936,
    },
    // The hybrids of the Qwen family on Qwen3's tokenizer (Qwen3-Next ships it; the npm
    // package serves the family): gated delta nets at a real vocabulary.
    Pairing {
        name: "vocab-qwen3-5",
        fixture: "qwen3",
        base: "tiny-qwen3-5",
        vocab_size: 151_936,
    },
    Pairing {
        name: "vocab-qwen3-next",
        fixture: "qwen3",
        base: "tiny-qwen3-next",
        vocab_size: 151_936,
    },
    Pairing {
        name: "vocab-gemma3",
        fixture: "gemma3",
        base: "tiny-gemma3",
        vocab_size: 262_208,
    },
    Pairing {
        name: "vocab-llama3.1",
        fixture: "llama3.1",
        base: "tiny-llama",
        vocab_size: 128_256,
    },
    Pairing {
        name: "vocab-mistral-v3",
        fixture: "mistral-v3",
        base: "tiny-llama",
        vocab_size: 32_768,
    },
];

impl Pairing {
    pub fn named(name: &str) -> Result<&'static Pairing, ParityError> {
        PAIRINGS.iter().find(|p| p.name == name).ok_or_else(|| {
            let names: Vec<&str> = PAIRINGS.iter().map(|p| p.name).collect();
            ParityError::Usage(format!(
                "no real-vocabulary model `{name}` (available: {})",
                names.join(", ")
            ))
        })
    }
}

/// The seed of the generated rows; changing it (or the generator) changes every golden's
/// `weights_sha256`, which the gate checks first.
const SEED: u64 = 0x005e_ed0f_706b_656e;

/// splitmix64: a tiny, exactly specified generator (the same stream on every machine).
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1) with 24 bits.
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> ParityError + '_ {
    move |e| ParityError::Index(format!("{}: {e}", path.display()))
}

/// `pairing`'s model dir in the cache, written once (atomically) and reused: the base's
/// config with the real `vocab_size`, the fixture's tokenizer files, and one
/// model.safetensors holding the base's tensors with the vocabulary-sized ones regenerated.
pub fn materialize(pairing: &Pairing) -> Result<PathBuf, ParityError> {
    let dir = crate::cache_dir().join("models").join(pairing.name);
    let fixture = super::fixture::dir(pairing.fixture)?;
    if dir.join("model.safetensors").is_file() && holds_fixture(&dir, &fixture)? {
        return Ok(dir);
    }
    let base = crate::goldens::model_dir(pairing.base)?;
    let partial = dir.with_extension("partial");
    let _ = std::fs::remove_dir_all(&partial);
    std::fs::create_dir_all(&partial).map_err(io(&partial))?;
    for entry in std::fs::read_dir(&fixture).map_err(io(&fixture))? {
        let path = entry.map_err(io(&fixture))?.path();
        if path.is_file() {
            let to = partial.join(path.file_name().unwrap_or_default());
            std::fs::copy(&path, &to).map_err(io(&to))?;
        }
    }
    let config_path = base.join("config.json");
    let text = std::fs::read_to_string(&config_path).map_err(io(&config_path))?;
    let mut config: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| ParityError::Index(e.to_string()))?;
    let base_vocab = config["vocab_size"].as_u64().unwrap_or(0) as usize;
    config["vocab_size"] = pairing.vocab_size.into();
    let to = partial.join("config.json");
    std::fs::write(&to, serde_json::to_string_pretty(&config).unwrap()).map_err(io(&to))?;
    write_weights(
        &base,
        base_vocab,
        pairing.vocab_size,
        &partial.join("model.safetensors"),
    )?;
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::rename(&partial, &dir).map_err(io(&dir))?;
    Ok(dir)
}

/// Whether `dir` has every file of `fixture`, byte for byte (a re-fetched fixture makes
/// the model anew).
fn holds_fixture(dir: &Path, fixture: &Path) -> Result<bool, ParityError> {
    for entry in std::fs::read_dir(fixture).map_err(io(fixture))? {
        let path = entry.map_err(io(fixture))?.path();
        let copy = dir.join(path.file_name().unwrap_or_default());
        if path.is_file() && std::fs::read(&path).ok() != std::fs::read(&copy).ok() {
            return Ok(false);
        }
    }
    Ok(true)
}

/// The base's tensors, those with `base_vocab` rows regenerated with `vocab` rows: uniform
/// values with the base tensor's standard deviation, seeded by the tensor's name.
fn write_weights(
    base: &Path,
    base_vocab: usize,
    vocab: usize,
    out: &Path,
) -> Result<(), ParityError> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(base)
        .map_err(io(base))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            name.starts_with("model") && name.ends_with(".safetensors")
        })
        .collect();
    files.sort();
    let bytes: Vec<Vec<u8>> = files
        .iter()
        .map(|f| std::fs::read(f).map_err(io(f)))
        .collect::<Result<_, _>>()?;
    let mut tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (file, data) in files.iter().zip(&bytes) {
        let st = safetensors::SafeTensors::deserialize(data)
            .map_err(|e| ParityError::Index(format!("{}: {e}", file.display())))?;
        for (name, view) in st.tensors() {
            let shape = view.shape().to_vec();
            let data = if shape.len() == 2 && shape[0] == base_vocab {
                resized(&name, view.dtype(), view.data(), [vocab, shape[1]])?
            } else {
                view.data().to_vec()
            };
            let shape = match shape.len() == 2 && shape[0] == base_vocab {
                true => vec![vocab, shape[1]],
                false => shape,
            };
            tensors.push((name, view.dtype(), shape, data));
        }
    }
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(name, dtype, shape, data)| {
            TensorView::new(*dtype, shape.clone(), data)
                .map(|v| (name.clone(), v))
                .map_err(|e| ParityError::Index(format!("{name}: {e}")))
        })
        .collect::<Result<_, _>>()?;
    let metadata = Some([("format".to_owned(), "mlx".to_owned())].into());
    safetensors::serialize_to_file(views, metadata, out)
        .map_err(|e| ParityError::Index(format!("{}: {e}", out.display())))
}

/// A `[rows, cols]` tensor of `dtype` (f32 or bf16) drawn with the std of `like`'s values.
fn resized(
    name: &str,
    dtype: Dtype,
    like: &[u8],
    [rows, cols]: [usize; 2],
) -> Result<Vec<u8>, ParityError> {
    let values: Vec<f32> = match dtype {
        Dtype::F32 => like
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        Dtype::BF16 => like
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes(c.try_into().unwrap()).to_f32())
            .collect(),
        other => {
            return Err(ParityError::Usage(format!(
                "{name}: a {other:?} vocabulary matrix cannot be resized (f32 or bf16 only)"
            )))
        }
    };
    let n = values.len().max(1) as f64;
    let mean = values.iter().map(|&v| v as f64).sum::<f64>() / n;
    let var = values
        .iter()
        .map(|&v| (v as f64 - mean).powi(2))
        .sum::<f64>()
        / n;
    let half_width = (3.0 * var).sqrt() as f32;
    let seed = name
        .bytes()
        .fold(SEED, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3));
    let mut rng = SplitMix(seed);
    let count = rows * cols;
    let mut out = Vec::with_capacity(count * if dtype == Dtype::F32 { 4 } else { 2 });
    for _ in 0..count {
        let v = rng.unit() * half_width;
        match dtype {
            Dtype::F32 => out.extend_from_slice(&v.to_le_bytes()),
            _ => out.extend_from_slice(&half::bf16::from_f32(v).to_le_bytes()),
        }
    }
    Ok(out)
}

/// sha256 of a file, hex.
pub fn file_sha256(path: &Path) -> Result<String, ParityError> {
    let bytes = std::fs::read(path).map_err(io(path))?;
    Ok(sha256_hex(&bytes))
}

#[derive(Debug, Deserialize)]
struct Golden {
    weights_sha256: String,
    cases: Vec<Case>,
}

#[derive(Debug, Deserialize)]
struct Case {
    name: String,
    #[serde(flatten)]
    prompt: Prompt,
    greedy_ids: Vec<u32>,
    logits: Vec<StepDigest>,
}

/// One step's logits as the golden keeps them.
#[derive(Debug, Deserialize)]
struct StepDigest {
    sha256: String,
    /// The largest entries, (id, value), largest first.
    top: Vec<(u32, f32)>,
}

/// A logit vector's largest entry: (id, value).
pub type Top = (u32, f32);

/// One prompt's verdict.
#[derive(Debug, Clone)]
pub struct CaseReport {
    pub name: String,
    pub ids_match: bool,
    pub template_match: Option<bool>,
    /// Per compared step: the logits' sha256 equal.
    pub logits_exact: Vec<bool>,
    /// Where the first inexact step's top entry differs: (ours, oracle's).
    pub first_difference: Option<(usize, Top, Top)>,
    pub greedy_matching: usize,
    pub greedy_total: usize,
    /// The oracle's top-2 gap at the first divergent step was under `l1::TIE_EPS`.
    pub tie_at: Option<usize>,
}

impl CaseReport {
    fn passed(&self) -> bool {
        let greedy_ok = self.greedy_matching == self.greedy_total || self.tie_at.is_some();
        self.ids_match
            && self.template_match != Some(false)
            && self.logits_exact.iter().all(|&e| e)
            && greedy_ok
    }
}

#[derive(Debug, Clone)]
pub struct ModelReport {
    pub model: String,
    pub vocab_size: usize,
    pub cases: Vec<CaseReport>,
}

impl Report for ModelReport {
    fn passed(&self) -> bool {
        self.cases.iter().all(CaseReport::passed)
    }

    fn summary(&self) -> String {
        let c = self.counts();
        let worst = self
            .cases
            .iter()
            .find_map(|c| c.first_difference.map(|d| (c.name.clone(), d)))
            .map(|(case, (step, ours, theirs))| {
                format!(
                    " (first: {case} step {step}: top {}={} vs oracle {}={})",
                    ours.0, ours.1, theirs.0, theirs.1
                )
            })
            .unwrap_or_default();
        let tok = self.cases.iter().filter(|c| c.ids_match).count();
        let tpl: Vec<bool> = self.cases.iter().filter_map(|c| c.template_match).collect();
        let tpl_ok = tpl.iter().filter(|&&m| m).count();
        format!(
            "L1 {} (vocab {}): {}/{} logit vectors bit-exact{worst}, {}/{} greedy ids, tokenizer {tok}/{}, \
             template {tpl_ok}/{}",
            self.model,
            self.vocab_size,
            c[0].value,
            c[0].total,
            c[1].value,
            c[1].total,
            self.cases.len(),
            tpl.len()
        )
    }

    fn counts(&self) -> Vec<Count> {
        let exact = self
            .cases
            .iter()
            .flat_map(|c| &c.logits_exact)
            .filter(|&&e| e)
            .count();
        let total = self.cases.iter().map(|c| c.logits_exact.len()).sum();
        let ids = self.cases.iter().map(|c| c.greedy_matching).sum();
        let steps = self.cases.iter().map(|c| c.greedy_total).sum();
        vec![
            Count {
                metric: "logit_vectors_bit_exact",
                value: exact,
                total,
            },
            Count {
                metric: "greedy_ids_identical",
                value: ids,
                total: steps,
            },
        ]
    }
}

/// The gate: `golden` (goldens/l1-vocab/<name>/index.json) against the engine on the
/// materialized model.
pub fn run(name: &str, index: &serde_json::Value) -> Result<ModelReport, ParityError> {
    let pairing = Pairing::named(name)?;
    let golden: Golden =
        serde_json::from_value(index.clone()).map_err(|e| ParityError::Index(e.to_string()))?;
    let dir = materialize(pairing)?;
    let sha = file_sha256(&dir.join("model.safetensors"))?;
    if sha != golden.weights_sha256 {
        return Err(ParityError::Index(format!(
            "{}: the generated weights have sha256 {sha}, the golden was made from {}: the generator \
             changed (regenerate the golden) or the cached copy is stale (delete {})",
            pairing.name,
            golden.weights_sha256,
            dir.display()
        )));
    }
    let model = engine::model::load(&dir)?;
    let tokenizer = Tokenizer::load(&dir)?;
    let template = ChatTemplate::from_tokenizer(&tokenizer)?;
    let cases = golden
        .cases
        .iter()
        .map(|case| check_case(case, model.as_ref(), &tokenizer, template.as_ref()))
        .collect::<Result<_, _>>()?;
    Ok(ModelReport {
        model: pairing.name.to_owned(),
        vocab_size: pairing.vocab_size,
        cases,
    })
}

fn check_case(
    case: &Case,
    model: &dyn engine::model::LanguageModel,
    tokenizer: &Tokenizer,
    template: Option<&ChatTemplate>,
) -> Result<CaseReport, ParityError> {
    let (ids, template_match) = case.prompt.ids(&case.name, tokenizer, template)?;
    let mut session = Session::new(model);
    let mut logits = session.prefill(&case.prompt.prompt_ids)?;
    let mut report = CaseReport {
        name: case.name.clone(),
        ids_match: ids == case.prompt.prompt_ids,
        template_match,
        logits_exact: Vec::new(),
        first_difference: None,
        greedy_matching: 0,
        greedy_total: case.greedy_ids.len(),
        tie_at: None,
    };
    let mut diverged = false;
    for (step, &want) in case.greedy_ids.iter().enumerate() {
        if let (Some(digest), false) = (case.logits.get(step), diverged) {
            let flat = logits.as_dtype(mlx_rs::Dtype::Float32)?.reshape(&[-1])?;
            flat.eval()?;
            let values: &[f32] = flat.as_slice();
            let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            let exact = sha256_hex(&bytes) == digest.sha256;
            if !exact && report.first_difference.is_none() {
                let top = top_entry(values);
                let theirs = digest.top.first().copied().unwrap_or((u32::MAX, f32::NAN));
                report.first_difference = Some((step, top, theirs));
            }
            report.logits_exact.push(exact);
        }
        let id = greedy(&logits)?;
        if id == want && !diverged {
            report.greedy_matching += 1;
        } else if !diverged {
            diverged = true;
            let gap = case.logits.get(step).and_then(|d| match d.top.as_slice() {
                [a, b, ..] => Some(a.1 - b.1),
                _ => None,
            });
            if gap.is_some_and(|g| g <= super::l1::TIE_EPS) {
                report.tie_at = Some(step);
            }
        }
        // Past the first divergence nothing is compared (the trajectories differ, a tie or
        // not): the remaining steps are not run.
        if diverged {
            break;
        }
        if step + 1 < case.greedy_ids.len() {
            logits = session.step(&[id])?;
        }
    }
    Ok(report)
}

fn top_entry(values: &[f32]) -> Top {
    values
        .iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |best, (i, &v)| match v > best.1 {
            true => (i as u32, v),
            false => best,
        })
}
