//! The gate table: every parity gate with its tier, golden group, oracle generator, models,
//! planted defects and run. `harness parity` iterates it, `harness goldens list|check|regen`
//! take the goldens and their generators from it, and the tests in tests/ call its runs.

use std::fmt;
use std::path::Path;

pub use super::plant::{Plant, Tweak};
use super::runtime::Tamper;
use super::{batch, detok, l1, l2, l3, runtime, sampling, spec, spec_l2, tokenize, train, vocab};
use super::{ParityError, Report};
use crate::goldens::{Layer, TensorGolden};

type Result<T> = std::result::Result<T, ParityError>;

/// The guarantee a gate proves (docs/parity-tiers.md); `Runtime` is the model-free MLX golden.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    Runtime,
    L1,
    L2,
    L3,
}

impl Tier {
    pub const ALL: [Tier; 4] = [Tier::Runtime, Tier::L1, Tier::L2, Tier::L3];

    /// As `--tier` spells it.
    pub fn name(self) -> &'static str {
        match self {
            Tier::Runtime => "runtime",
            Tier::L1 => "l1",
            Tier::L2 => "l2",
            Tier::L3 => "l3",
        }
    }

    /// What its gates compare against (the results DB's peer).
    pub fn oracle(self) -> &'static str {
        match self {
            Tier::Runtime => "mlx",
            Tier::L1 => "mlx-lm",
            Tier::L2 => "mlx-optiq",
            Tier::L3 => "frozen L2 trajectory",
        }
    }
}

impl std::str::FromStr for Tier {
    type Err = ParityError;

    fn from_str(s: &str) -> Result<Self> {
        Tier::ALL
            .into_iter()
            .find(|t| t.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Tier::ALL.iter().map(|t| t.name()).collect();
                ParityError::Usage(format!(
                    "tier `{s}` does not exist (available: {})",
                    names.join(", ")
                ))
            })
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Tier::Runtime => f.write_str("runtime"),
            tier => f.write_str(&tier.name().to_uppercase()),
        }
    }
}

/// What one run of a gate checks.
#[derive(Debug, Clone, Copy)]
pub struct Target<'a> {
    pub model: &'a str,
    /// One case of the golden (a batch scenario, a speculative case); None: every case.
    pub case: Option<&'a str>,
    /// Goldens the oracle wrote just now (`--out DIR`), in place of the committed ones.
    pub live: Option<&'a Path>,
}

impl<'a> Target<'a> {
    pub fn new(model: &'a str) -> Self {
        Target {
            model,
            case: None,
            live: None,
        }
    }
}

type Run = fn(&Gate, &Target, Option<&Plant>) -> Result<Box<dyn Report>>;

/// One parity gate.
#[derive(Debug)]
pub struct Gate {
    pub name: &'static str,
    pub tier: Tier,
    /// Its goldens: `goldens/<group>/<model><suffix>`, or `goldens/<group>` without models.
    pub group: &'static str,
    pub suffix: &'static str,
    /// The script under oracles/ that writes its goldens and its arguments (`{model}`: the
    /// model); None where our own engine froze them (`harness freeze-perf-oracle`).
    pub generator: Option<(&'static str, &'static [&'static str])>,
    /// `harness parity --live` runs the generator now: `oracles/<script> MODEL… --out DIR`.
    pub live: bool,
    pub models: &'static [&'static str],
    /// Models its runs load besides `models` (the drafters).
    pub fixtures: &'static [&'static str],
    /// Cases `harness parity` reports one by one (the batch scenarios).
    pub cases: &'static [&'static str],
    /// Its plants, as `--plant` spells them ([`Plant::form`]).
    pub plants: &'static [&'static str],
    /// Its models are real tokenizers fetched into the cache dir (`crate::fixtures`), not
    /// models under goldens/models (so none is registered as a model).
    pub on_fixtures: bool,
    run: Run,
}

const BASE: Gate = Gate {
    name: "",
    tier: Tier::L1,
    group: "",
    suffix: "",
    generator: None,
    live: false,
    models: &[],
    fixtures: &[],
    cases: &[],
    plants: &[],
    on_fixtures: false,
    run: |gate, _, _| Err(ParityError::Usage(format!("gate {} has no run", gate.name))),
};

pub static RUNTIME: Gate = Gate {
    name: "runtime",
    tier: Tier::Runtime,
    group: "runtime",
    generator: Some(("gen_runtime.py", &[])),
    plants: &["first-input"],
    run: |g, t, p| {
        let tamper = match p {
            Some(Plant::Harness(Tweak::FirstInput)) => Tamper::FirstInputValue,
            _ => Tamper::None,
        };
        boxed(runtime::run(&g.open(t)?, t.case, tamper))
    },
    ..BASE
};

pub static L1: Gate = Gate {
    name: "l1",
    group: "l1",
    generator: Some(("gen_l1.py", &["{model}"])),
    live: true,
    models: &[
        "tiny-llama",
        "tiny-qwen3",
        "tiny-llama-trained",
        "tiny-llama-trained-q4",
        "tiny-qwen3-q8",
        "tiny-gemma3",
        "tiny-gemma3-q4",
        "tiny-qwen2",
        "tiny-gemma4",
        "tiny-gemma4-keqv",
        "tiny-gemma4-q4",
        "tiny-llama-dynamic",
        "tiny-llama-yarn",
        "tiny-phi3",
        "tiny-llama-rope-params",
        "tiny-gemma3-rope-params",
        "tiny-gemma3-mm",
        "tiny-gemma4-mm",
        "tiny-gemma4-mm-mlx",
        "tiny-gemma3-mm-q4",
        "tiny-qwen3-moe",
        "tiny-qwen3-moe-q4",
        "tiny-mixtral",
        "tiny-qwen2-moe",
        "tiny-gemma4-moe",
        "tiny-gemma4-moe-q4",
        "tiny-llama-mxfp4",
        "tiny-llama-nvfp4",
        "tiny-llama-mxfp8",
        "tiny-llama-mixed-modes",
        "tiny-qwen3-moe-mxfp4",
        "tiny-gpt-oss",
        "tiny-gpt-oss-mxfp4",
    ],
    plants: &["KEY=VALUE"],
    run: |g, t, p| boxed(run_l1(g, t, p)),
    ..BASE
};

/// L1 at real vocabulary sizes: tiny models resized to fetched real tokenizers
/// (`parity::vocab`; the model dirs are generated into the cache dir).
pub static L1_VOCAB: Gate = Gate {
    name: "l1-vocab",
    group: "l1-vocab",
    generator: Some(("gen_l1_vocab.py", &["{model}"])),
    models: &[
        "vocab-qwen3",
        "vocab-gemma3",
        "vocab-llama3.1",
        "vocab-mistral-v3",
    ],
    plants: &["argmax-first-64k"],
    on_fixtures: true,
    run: |g, t, _| boxed(vocab::run(t.model, &g.open_index(t)?.index)),
    ..BASE
};

/// mlx-lm's own KV quantization (`generate_step(kv_bits=4, …)`), on the L1 gate's run.
pub static KV_BITS: Gate = Gate {
    name: "kv-bits",
    group: "l1",
    suffix: "-kv4",
    generator: Some((
        "gen_l1.py",
        &[
            "{model}",
            "--kv-bits",
            "4",
            "--kv-group-size",
            "32",
            "--prefill-step",
            "16",
            "--suffix=-kv4",
        ],
    )),
    models: &["tiny-llama-trained"],
    plants: &["sdpa=optiq-fused"],
    run: |g, t, p| boxed(run_l1(g, t, p).map(l1::KvBits)),
    ..BASE
};

pub static BATCH: Gate = Gate {
    name: "batch",
    group: "batch",
    generator: Some(("gen_batch.py", &["{model}"])),
    models: &[
        "tiny-llama-trained",
        "tiny-qwen3-moe",
        "tiny-mixtral",
        "tiny-qwen2-moe",
        "tiny-phi3",
    ],
    cases: &["b2", "b4", "joinleave"],
    plants: &["unmasked-padding", "moe-top-k-off-by-one"],
    run: |g, t, _| boxed(batch::run(t.model, &g.open(t)?, t.case)),
    ..BASE
};

pub static SPEC: Gate = Gate {
    name: "spec",
    group: "spec",
    generator: Some(("gen_spec.py", &["{model}"])),
    models: &["tiny-llama-trained"],
    fixtures: &["tiny-llama-draft"],
    plants: &["keep-draft-tail", "target-trim-short"],
    run: |g, t, _| boxed(spec::run(t.model, &g.open(t)?, t.case)),
    ..BASE
};

pub static DETOK: Gate = Gate {
    name: "detok",
    group: "detok",
    generator: Some(("gen_detok.py", &["{model}"])),
    models: &["tiny-llama-trained"],
    plants: &["lost-character"],
    run: |g, t, p| {
        let lose = p == Some(&Plant::Harness(Tweak::LostCharacter));
        boxed(detok::run(t.model, &g.open_index(t)?, |pieces| {
            if let Some(p) = pieces.iter_mut().find(|p| lose && !p.is_empty()) {
                p.remove(0);
            }
        }))
    },
    ..BASE
};

/// The streaming detokenizer on the real tokenizers (byte-level BPE and SentencePiece).
pub static DETOK_REAL: Gate = Gate {
    name: "detok-real",
    group: "detok",
    generator: Some(("gen_detok.py", &["{model}", "--fixture"])),
    models: &REAL_TOKENIZERS,
    plants: &["lost-character", "spm-leading-space"],
    on_fixtures: true,
    run: |g, t, p| {
        let lose = p == Some(&Plant::Harness(Tweak::LostCharacter));
        boxed(detok::run_fixture(t.model, &g.open_index(t)?, |pieces| {
            if let Some(p) = pieces.iter_mut().find(|p| lose && !p.is_empty()) {
                p.remove(0);
            }
        }))
    },
    ..BASE
};

/// The real tokenizers the tokenizer gates run on (`crate::fixtures::TOKENIZERS`).
const REAL_TOKENIZERS: [&str; 6] = crate::fixtures::TOKENIZERS;

/// Tokenization vs transformers on the real tokenizers: ids and decoded text.
pub static TOKENIZE: Gate = Gate {
    name: "tokenize",
    group: "tokenize",
    generator: Some(("gen_tokenize.py", &["{model}"])),
    models: &REAL_TOKENIZERS,
    plants: &["no-post-processor"],
    on_fixtures: true,
    run: |g, t, _| boxed(tokenize::run(t.model, &g.open_index(t)?)),
    ..BASE
};

/// Chat templates vs transformers' apply_chat_template on the real tokenizers' templates
/// and our own `pyisms` (`parity::templates`).
pub static TEMPLATES: Gate = Gate {
    name: "templates",
    group: "templates",
    generator: Some(("gen_templates.py", &["{model}"])),
    models: &["qwen3", "gemma3", "llama3.1", "llama3.2", "pyisms"],
    plants: &["tojson-html-escape", "template-kwargs-dropped"],
    on_fixtures: true,
    run: |g, t, _| boxed(super::templates::run(t.model, &g.open_index(t)?)),
    ..BASE
};

pub static TRAIN: Gate = Gate {
    name: "train",
    group: "train",
    generator: Some(("gen_train.py", &["{model}"])),
    models: &[
        "tiny-llama-trained",
        "tiny-gemma3",
        "tiny-gemma4",
        "tiny-phi3",
        "tiny-gemma3-mm",
        "tiny-gemma4-mm",
        "tiny-qwen3-moe",
        "tiny-mixtral",
        "tiny-qwen2-moe",
        "tiny-qwen3-moe-q4",
    ],
    plants: &["weight-decay"],
    run: |g, t, p| {
        let decay = p == Some(&Plant::Harness(Tweak::WeightDecay));
        boxed(train::run(t.model, &g.open(t)?, |opt| {
            if decay {
                opt.weight_decay *= 1.1;
            }
        }))
    },
    ..BASE
};

pub static SAMPLING: Gate = Gate {
    name: "sampling",
    group: "sampling",
    generator: Some(("gen_sampling.py", &["{model}"])),
    live: true,
    models: &["tiny-llama-trained", "tiny-qwen3", "tiny-llama-trained-q4"],
    plants: &["seed", "top-p-and-penalty"],
    run: |g, t, p| {
        let tweak = |s: &mut engine::generate::sampler::SamplingParams| match p {
            Some(Plant::Harness(Tweak::Seed)) if s.temp > 0.0 => s.seed += 1,
            Some(Plant::Harness(Tweak::TopPAndPenalty)) => {
                if s.top_p > 0.0 {
                    s.top_p = 0.5;
                }
                if let Some(r) = s.repetition_penalty.as_mut() {
                    *r += 0.2;
                }
            }
            _ => {}
        };
        boxed(sampling::run(t.model, &g.open_index(t)?, tweak))
    },
    ..BASE
};

pub static L2: Gate = Gate {
    name: "l2",
    tier: Tier::L2,
    group: "l2",
    generator: Some(("gen_l2.py", &["{model}"])),
    live: true,
    models: &["tiny-llama-trained", "tiny-gemma3-kv", "tiny-gemma4"],
    plants: &["sdpa=mlx-lm", "kv_start=N"],
    run: |g, t, p| boxed(l2::run(t.model, &g.open(t)?, |o| Plant::options(p, o))),
    ..BASE
};

pub static SPEC_L2: Gate = Gate {
    name: "spec-l2",
    tier: Tier::L2,
    group: "spec-l2",
    generator: Some(("gen_spec_l2.py", &[])),
    models: &["tiny-gemma4"],
    fixtures: &["tiny-gemma4-assistant"],
    plants: &["ring-trim", "first-sliding-donor"],
    run: |g, t, _| boxed(spec_l2::run(t.model, &g.open(t)?, t.case)),
    ..BASE
};

/// The assistant drafter's head variants (oracles/make_assistants.py) on the spec-l2 cases:
/// its models are the drafters, their target is tiny-gemma4. The centroid head, and the pair
/// whose config flags contradict their tensors (the head is the one the tensors carry).
pub static SPEC_L2_HEADS: Gate = Gate {
    name: "spec-l2-heads",
    tier: Tier::L2,
    group: "spec-l2",
    generator: Some(("gen_spec_l2.py", &["--drafter", "{model}"])),
    models: &[
        "tiny-gemma4-assistant-centroid",
        "tiny-gemma4-assistant-lm-head",
        "tiny-gemma4-assistant-no-lm-head",
    ],
    fixtures: &["tiny-gemma4"],
    plants: &["head-from-flags", "centroid-top-k-short"],
    run: |g, t, _| boxed(spec_l2::run_drafter(t.model, &g.open(t)?, t.case)),
    ..BASE
};

/// Frozen from our own L2 engine by `harness freeze-perf-oracle`, not by an oracle script.
pub static L3: Gate = Gate {
    name: "l3",
    tier: Tier::L3,
    group: "l3",
    models: &["tiny-llama-trained", "tiny-gemma4"],
    plants: &["perf-path", "sdpa=optiq-fused"],
    run: |g, t, p| {
        boxed(l3::check(t.model, &g.open_index(t)?, |o| {
            Plant::options(p, o)
        }))
    },
    ..BASE
};

/// Every gate, in the order `harness parity` runs them.
pub static GATES: [&Gate; 16] = [
    &RUNTIME,
    &L1,
    &L1_VOCAB,
    &KV_BITS,
    &BATCH,
    &SPEC,
    &DETOK,
    &DETOK_REAL,
    &TOKENIZE,
    &TEMPLATES,
    &TRAIN,
    &SAMPLING,
    &L2,
    &SPEC_L2,
    &SPEC_L2_HEADS,
    &L3,
];

fn boxed<R: Report>(report: Result<R>) -> Result<Box<dyn Report>> {
    Ok(Box::new(report?))
}

fn run_l1(gate: &Gate, t: &Target, plant: Option<&Plant>) -> Result<l1::ModelReport> {
    let golden = gate.open(t)?;
    l1::run(
        t.model,
        &golden,
        |c| Plant::config(plant, c),
        |o| Plant::options(plant, o),
    )
}

impl Gate {
    /// The gate by name (`l1`, `spec-l2`, …).
    pub fn named(name: &str) -> Option<&'static Gate> {
        GATES.into_iter().find(|g| g.name == name)
    }

    /// Runs the committed golden of `model` (every case), with `plant` if given.
    pub fn run(&self, model: &str, plant: Option<&Plant>) -> Result<Box<dyn Report>> {
        self.run_target(&Target::new(model), plant)
    }

    /// Runs `target`; an engine plant is on for the run only (also if it panics).
    pub fn run_target(&self, target: &Target, plant: Option<&Plant>) -> Result<Box<dyn Report>> {
        if let Some(p) = plant.filter(|p| !self.accepts(p)) {
            return Err(ParityError::Usage(format!(
                "gate {} has no plant `{}` (it has: {})",
                self.name,
                p.form(),
                self.plants.join(", ")
            )));
        }
        let _on = match plant {
            Some(Plant::Engine(defect)) => Some(engine::plant::on(*defect)?),
            _ => None,
        };
        (self.run)(self, target, plant)
    }

    pub fn accepts(&self, plant: &Plant) -> bool {
        self.plants.contains(&plant.form().as_str())
    }

    /// Its models, or only `model` where it has that one; `[""]` for a gate without models
    /// (unless a model is asked for).
    pub fn models_for(&self, model: Option<&str>) -> Vec<&'static str> {
        match (self.models, model) {
            ([], None) => vec![""],
            (models, _) => models
                .iter()
                .copied()
                .filter(|m| model.is_none_or(|want| want == *m))
                .collect(),
        }
    }

    /// The golden of `model` under goldens/ (`l1/tiny-llama`, `runtime`).
    pub fn golden(&self, model: &str) -> String {
        match self.models {
            [] => self.group.to_owned(),
            _ => format!("{}/{}", self.group, self.golden_name(model)),
        }
    }

    /// The golden's name in its group (`tiny-llama-trained-kv4`), as the results DB and a
    /// live oracle's `--out` dir name it.
    pub fn golden_name(&self, model: &str) -> String {
        format!("{model}{}", self.suffix)
    }

    /// How `harness parity` names a failed run: by the golden's name in the tier's own group
    /// (`tiny-qwen3` for l1/tiny-qwen3), else by the golden (`runtime`), and the case if one
    /// (`batch/tiny-llama-trained/b2`).
    pub fn label(&self, t: &Target) -> String {
        let golden = match self.group == self.tier.name() && !self.models.is_empty() {
            true => self.golden_name(t.model),
            false => self.golden(t.model),
        };
        t.case
            .map_or_else(|| golden.clone(), |c| format!("{golden}/{c}"))
    }

    fn live_dir(&self, t: &Target) -> Option<std::path::PathBuf> {
        t.live.map(|d| d.join(self.golden_name(t.model)))
    }

    fn open(&self, t: &Target) -> Result<TensorGolden> {
        Ok(match self.live_dir(t) {
            Some(dir) => TensorGolden::open_dir(dir, Layer::Reference)?,
            None => TensorGolden::open(&self.golden(t.model))?,
        })
    }

    fn open_index(&self, t: &Target) -> Result<TensorGolden> {
        Ok(match self.live_dir(t) {
            Some(dir) => TensorGolden::open_index_dir(dir)?,
            None => TensorGolden::open_index_only(&self.golden(t.model))?,
        })
    }

    /// Runs the oracle now (`oracles/<script> MODEL… --out DIR`) and returns DIR, a temp dir
    /// of fresh goldens in the committed layout. Needs the oracle venv.
    pub fn live_goldens(&self, models: &[&str]) -> Result<tempfile::TempDir> {
        let oracle = |e: String| ParityError::Oracle(format!("gate {}: {e}", self.name));
        let script = match self.generator {
            Some((script, _)) if self.live => script,
            _ => return Err(oracle("its oracle cannot run live".into())),
        };
        let tmp = tempfile::tempdir().map_err(|e| oracle(e.to_string()))?;
        let out = std::process::Command::new(crate::oracle::python())
            .arg(crate::oracle::repo_root().join("oracles").join(script))
            .args(models)
            .arg("--out")
            .arg(tmp.path())
            .output()
            .map_err(|e| oracle(format!("running oracles/{script}: {e}")))?;
        if !out.status.success() {
            let stderr = String::from_utf8_lossy(&out.stderr);
            return Err(oracle(format!("oracles/{script} failed:\n{stderr}")));
        }
        Ok(tmp)
    }
}

/// A committed golden and the oracle command that regenerates it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registered {
    pub name: String,
    /// Script under `oracles/` and its arguments.
    pub script: &'static str,
    pub args: Vec<String>,
}

/// Every golden an oracle script writes, in regeneration order: the models (of every gate,
/// and the drafters) first, then each gate's goldens. The l3 goldens are frozen from our
/// own engine (`harness freeze-perf-oracle`), so they are not regenerated from here.
/// Goldens an oracle script writes that no parity gate reads: the tool-calling model of the
/// serve tests and `harness serve-diff` (engine/tests/serve_tools.rs), and the CLI gate's
/// mlx_lm.generate transcripts (engine/tests/cli.rs).
#[allow(clippy::type_complexity)]
const OUTSIDE_GATES: [(&str, &str, &[&str]); 4] = [
    (
        "models/tiny-qwen3-tools",
        "make_models.py",
        &["tiny-qwen3-tools"],
    ),
    ("cli", "gen_cli.py", &[]),
    // engine convert's gate (engine/tests/convert.rs): mlx_lm.convert's output hashes, and
    // the Hugging Face layout source it converts.
    ("convert", "gen_convert.py", &[]),
    ("convert/tiny-llama-hf", "gen_convert.py", &[]),
];

pub fn registry() -> Vec<Registered> {
    let mut out: Vec<Registered> = Vec::new();
    let model_gates = GATES.iter().filter(|g| !g.on_fixtures);
    for m in model_gates.flat_map(|g| g.models.iter().chain(g.fixtures)) {
        let name = format!("models/{m}");
        if out.iter().any(|r| r.name == name) {
            continue;
        }
        // Without arguments make_models.py (make_quantized.py) writes all its models in one
        // run; `goldens regen` runs that once. The models outside L1 are made by name.
        let quantized = m.ends_with("-q4") || m.ends_with("-q8");
        out.push(Registered {
            name,
            script: if quantized {
                "make_quantized.py"
            } else {
                "make_models.py"
            },
            args: if L1.models.contains(m) {
                vec![]
            } else {
                vec![m.to_string()]
            },
        });
    }
    let registered = |(name, script, args): &(&str, &'static str, &[&str])| Registered {
        name: name.to_string(),
        script,
        args: args.iter().map(|a| a.to_string()).collect(),
    };
    let is_model = |g: &&(&str, &str, &[&str])| g.0.starts_with("models/");
    out.extend(OUTSIDE_GATES.iter().filter(is_model).map(registered));
    for gate in GATES {
        let Some((script, args)) = gate.generator else {
            continue;
        };
        for model in gate.models_for(None) {
            out.push(Registered {
                name: gate.golden(model),
                script,
                args: args.iter().map(|a| a.replace("{model}", model)).collect(),
            });
        }
    }
    out.extend(
        OUTSIDE_GATES
            .iter()
            .filter(|g| !is_model(g))
            .map(registered),
    );
    out
}

/// The top-level dirs of goldens/ that are golden groups, not machine layers (`data` holds
/// the training sets of oracles/make_train_data.py, not oracle output).
pub fn groups() -> Vec<&'static str> {
    let mut groups = vec!["models", "data", "cli", "convert"];
    for gate in GATES {
        if !groups.contains(&gate.group) {
            groups.push(gate.group);
        }
    }
    groups
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::goldens::{check_dir, goldens_root, machine_layers};
    use engine::plant::Defect;

    fn repo() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
    }

    #[test]
    fn every_plant_a_gate_lists_parses_back_to_it() {
        for gate in GATES {
            for form in gate.plants {
                let spelled = form
                    .replace("KEY=VALUE", "rms_norm_eps=1e-6")
                    .replace("=N", "=9");
                let plant = Plant::parse(&spelled).unwrap();
                assert!(gate.accepts(&plant), "{}: {form}", gate.name);
            }
        }
        let names: Vec<&str> = GATES.iter().map(|g| g.name).collect();
        assert!(names
            .iter()
            .all(|n| Gate::named(n).is_some_and(|g| g.name == *n)));
    }

    #[test]
    fn plants_parse_as_harness_parity_prints_them() {
        let eps = Plant::parse("rms_norm_eps=1e-6").unwrap();
        assert_eq!(eps.to_string(), "config.json rms_norm_eps = 1e-6");
        let mut config = serde_json::json!({"rope_parameters": {"full_attention": {}}});
        let rope = Plant::parse("rope_parameters.full_attention.partial_rotary_factor=0.5");
        Plant::config(rope.as_ref().ok(), &mut config);
        assert_eq!(
            config["rope_parameters"]["full_attention"]["partial_rotary_factor"],
            0.5
        );
        assert_eq!(
            Plant::parse("sdpa=mlx-lm").unwrap().to_string(),
            "sdpa=mlx-lm"
        );
        assert_eq!(Plant::parse("kv_start=5000").unwrap(), Plant::KvStart(5000));
        assert_eq!(
            Plant::parse("perf-path").unwrap(),
            Plant::Engine(Defect::PerfDecodeDropsNewest)
        );
        for bad in ["nokv", "sdpa=none", "kv_start=late"] {
            assert!(Plant::parse(bad).is_err(), "{bad}");
        }
        let err = L1
            .run("tiny-llama", Some(&Plant::KvStart(0)))
            .err()
            .unwrap();
        assert!(
            err.to_string()
                .contains("gate l1 has no plant `kv_start=N`"),
            "{err}"
        );
    }

    #[test]
    fn every_committed_golden_has_provenance_and_a_generator() {
        let root = repo().join("goldens");
        for g in registry() {
            let problems = check_dir(&root.join(&g.name), &repo());
            assert!(problems.is_empty(), "{}: {problems:?}", g.name);
        }
    }

    /// Every golden dir in the repository is registered (so `goldens check` sees its
    /// provenance and `goldens regen` can rebuild it), except the frozen perf oracles (l3,
    /// written by the engine) and the training sets (data).
    #[test]
    fn every_committed_golden_is_registered() {
        let root = goldens_root();
        let registered: Vec<String> = registry().into_iter().map(|g| g.name).collect();
        let mut missing = Vec::new();
        for group in groups()
            .into_iter()
            .filter(|g| !["l3", "data", "runtime"].contains(g))
        {
            for entry in std::fs::read_dir(root.join(group))
                .into_iter()
                .flatten()
                .flatten()
            {
                let name = format!("{group}/{}", entry.file_name().to_string_lossy());
                if entry.path().is_dir() && !registered.contains(&name) {
                    missing.push(name);
                }
            }
        }
        assert!(missing.is_empty(), "unregistered goldens: {missing:?}");
        assert!(registered.contains(&"runtime".to_owned()));
        let groups = groups();
        assert!(
            machine_layers(&root, &groups)
                .iter()
                .all(|k| !groups.contains(&k.as_str())),
            "a golden group is taken for a machine layer"
        );
    }
}
