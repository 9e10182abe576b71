//! The gate table: every parity gate with its tier, golden group, oracle generator, models,
//! planted defects and run. `harness parity` iterates it, `harness goldens list|check|regen`
//! take the goldens and their generators from it, and the tests in tests/ call its runs.

use std::fmt;
use std::path::Path;

pub use super::plant::{Plant, Tweak};
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
    /// Its models: the manifest's rows that name this gate (tiny models), or a list (real
    /// tokenizers, `on_fixtures`).
    pub models: Models,
    /// Models its runs load besides its models (the drafters), from the manifest's
    /// `fixture_of`.
    pub fixtures: Models,
    /// Cases `harness parity` reports one by one (the batch scenarios).
    pub cases: &'static [&'static str],
    /// Its plants, as `--plant` spells them ([`Plant::form`]).
    pub plants: &'static [&'static str],
    /// Its models are real tokenizers fetched into the cache dir (`crate::fixtures`), not
    /// models under goldens/models (so none is registered as a model).
    pub on_fixtures: bool,
    run: Run,
}

mod table;
pub use table::*;

/// Where a gate's models are listed.
#[derive(Debug, Clone, Copy)]
pub enum Models {
    /// goldens/models/manifest.json (`crate::manifest`).
    Manifest,
    /// Here (the real-tokenizer fixtures, which are not tiny models).
    Listed(&'static [&'static str]),
}

impl Gate {
    /// The gate by name (`l1`, `spec-l2`, …).
    pub fn named(name: &str) -> Option<&'static Gate> {
        GATES.iter().copied().find(|g| g.name == name)
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

    /// Its models (see [`Models`]).
    pub fn models(&self) -> &'static [&'static str] {
        match self.models {
            Models::Manifest => crate::manifest::gate_models(self.name),
            Models::Listed(list) => list,
        }
    }

    /// The models its runs load besides its own (the drafters).
    pub fn fixtures(&self) -> &'static [&'static str] {
        match self.fixtures {
            Models::Manifest => crate::manifest::gate_fixtures(self.name),
            Models::Listed(list) => list,
        }
    }

    pub fn accepts(&self, plant: &Plant) -> bool {
        self.plants.contains(&plant.form().as_str())
    }

    /// Its models, or only `model` where it has that one; `[""]` for a gate without models
    /// (unless a model is asked for).
    pub fn models_for(&self, model: Option<&str>) -> Vec<&'static str> {
        match (self.models(), model) {
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
        match self.models() {
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
        let golden = match self.group == self.tier.name() && !self.models().is_empty() {
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
/// Goldens an oracle script writes that no parity gate reads (every tiny model is the
/// manifest's): the CLI gate's mlx_lm.generate transcripts (engine/tests/it/cli.rs).
#[allow(clippy::type_complexity)]
const OUTSIDE_GATES: [(&str, &str, &[&str]); 7] = [
    ("cli", "gen_cli.py", &[]),
    // MLA prefilled one token at a time (tests/it/l1_models/mla.rs): mlx-lm's absorbed path
    // from the first token, whose logits differ from the chunked prefill's in the last bits.
    (
        "l1/tiny-deepseek-v3-prefill1",
        "gen_l1.py",
        &[
            "tiny-deepseek-v3",
            "--prefill-step",
            "1",
            "--suffix=-prefill1",
        ],
    ),
    (
        "l1/tiny-deepseek-v32-prefill1",
        "gen_l1.py",
        &[
            "tiny-deepseek-v32",
            "--prefill-step",
            "1",
            "--suffix=-prefill1",
        ],
    ),
    // The tool parsers' gate (engine/tests/it/tool_parsers.rs): mlx-lm's parsers' output.
    ("tool_parsers", "gen_tool_parsers.py", &[]),
    // engine convert's gate (engine/tests/it/convert.rs): mlx_lm.convert's output hashes, and
    // the Hugging Face layout source it converts.
    ("convert", "gen_convert.py", &[]),
    ("convert/tiny-llama-hf", "gen_convert.py", &[]),
    // engine fuse's gate (engine/tests/it/fuse.rs): mlx_lm.fuse's output hashes.
    ("fuse", "gen_fuse.py", &[]),
];

/// The distributed L1 gate's modes (tensor and pipeline parallel). Its goldens are
/// multi-process (two ring ranks per check, harness/tests/it/l1_dist.rs), so not a row of the
/// in-process table; made by oracles/gen_l1_dist.py under mlx.launch on 2 ranks.
pub const L1_DIST_MODES: [&str; 2] = ["tp", "pp"];

/// The manifest's gate name for the distributed L1 in `mode`.
pub fn l1_dist_gate(mode: &str) -> String {
    format!("l1-dist-{mode}")
}

/// The models of the distributed L1 in `mode`: the manifest's rows naming `l1-dist-<mode>`.
pub fn l1_dist_models(mode: &str) -> &'static [&'static str] {
    crate::manifest::gate_models(&l1_dist_gate(mode))
}

/// `l1-dist/<mode>/<model>` for every distributed L1 golden.
pub fn l1_dist_goldens() -> Vec<String> {
    L1_DIST_MODES
        .iter()
        .flat_map(|mode| {
            l1_dist_models(mode)
                .iter()
                .map(move |m| format!("l1-dist/{mode}/{m}"))
        })
        .collect()
}

pub fn registry() -> Vec<Registered> {
    let mut out: Vec<Registered> = Vec::new();
    // Every tiny model is one row of the manifest; make_models.py makes any row by name,
    // each after the models it is made from.
    for m in crate::manifest::build_order() {
        out.push(Registered {
            name: format!("models/{}", m.name),
            script: "make_models.py",
            args: vec![m.name.clone()],
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
    for mode in L1_DIST_MODES {
        for model in l1_dist_models(mode) {
            out.push(Registered {
                name: format!("l1-dist/{mode}/{model}"),
                script: "gen_l1_dist.py",
                args: ["--launch", "--mode", mode, model]
                    .iter()
                    .map(|a| a.to_string())
                    .collect(),
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
    let mut groups = vec![
        "models",
        "data",
        "cli",
        "convert",
        "fuse",
        "l1-dist",
        "eval",
        "tool_parsers",
    ];
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

    /// The manifest drives the gates' model lists, so a misspelt gate name in a row would
    /// silently drop that model from its gate: every name a row gives must be a gate (or the
    /// distributed gate), every tiny-model gate but the model-free `runtime` must have
    /// models (a gate test looping over none would pass), and every manifest row must be a
    /// directory under goldens/models (and every directory a row).
    #[test]
    fn the_manifest_names_only_gates_that_exist_and_every_model_dir() {
        let dist: Vec<String> = L1_DIST_MODES.iter().map(|m| l1_dist_gate(m)).collect();
        let known = |g: &str| dist.iter().any(|d| d == g) || Gate::named(g).is_some();
        for row in crate::manifest::tiny_models() {
            for g in row.gates.iter().chain(&row.fixture_of) {
                assert!(
                    known(g),
                    "{}: gate `{g}` is not in the gate table",
                    row.name
                );
            }
        }
        for gate in GATES {
            if matches!(gate.models, Models::Manifest) && gate.name != RUNTIME.name {
                assert!(
                    !gate.models().is_empty(),
                    "{}: no manifest row names it",
                    gate.name
                );
            }
        }
        for mode in L1_DIST_MODES {
            assert!(
                !l1_dist_models(mode).is_empty(),
                "{}: no manifest row names it",
                l1_dist_gate(mode)
            );
        }
        let dirs: std::collections::BTreeSet<String> =
            std::fs::read_dir(repo().join("goldens/models"))
                .unwrap()
                .flatten()
                .filter(|e| e.path().is_dir())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect();
        let rows: std::collections::BTreeSet<String> = crate::manifest::tiny_models()
            .iter()
            .map(|r| r.name.clone())
            .collect();
        assert_eq!(dirs, rows, "goldens/models and its manifest disagree");
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
                if !entry.path().is_dir() || registered.contains(&name) {
                    continue;
                }
                // A golden group one level deeper (l1-dist/<mode>/<model>).
                let nested: Vec<String> = std::fs::read_dir(entry.path())
                    .into_iter()
                    .flatten()
                    .flatten()
                    .filter(|e| e.path().is_dir())
                    .map(|e| format!("{name}/{}", e.file_name().to_string_lossy()))
                    .collect();
                if nested.is_empty() || !registered.iter().any(|r| r.starts_with(&name)) {
                    missing.push(name);
                } else {
                    missing.extend(nested.into_iter().filter(|n| !registered.contains(n)));
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
