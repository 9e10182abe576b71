//! The convert gate: `engine convert` writes what `mlx_lm convert` 0.32.2 writes, byte for
//! byte, on the cases of goldens/convert/index.json (oracles/gen_convert.py): every output
//! file's sha256, and on a difference the first differing tensor. The converted models
//! also generate what mlx_lm.generate generates on mlx-lm's output.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use clap::Parser;
use engine::convert::{convert, ConvertArgs};
use engine::plant::{self, Defect};
use serde_json::Value;
use sha2::{Digest, Sha256};

pub(super) fn goldens() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../goldens")
}

fn index() -> Value {
    let text = std::fs::read_to_string(goldens().join("convert/index.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn cases() -> Vec<Value> {
    index()["cases"].as_array().unwrap().clone()
}

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: ConvertArgs,
}

/// The case's source dir: the golden one, or a copy under `tmp` with the case's
/// `config_overrides` set in its config.json (as gen_convert.py makes it).
fn source_of(case: &Value, tmp: &Path) -> PathBuf {
    let src = goldens().join(case["source"].as_str().unwrap());
    let Some(overrides) = case.get("config_overrides").and_then(Value::as_object) else {
        return src;
    };
    let copy = tmp.join(format!("src-{}", case["name"].as_str().unwrap()));
    std::fs::create_dir_all(&copy).unwrap();
    for entry in std::fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, copy.join(path.file_name().unwrap())).unwrap();
    }
    let cfg_path = copy.join("config.json");
    let mut config: serde_json::Map<String, Value> =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    config.extend(overrides.clone());
    std::fs::write(&cfg_path, serde_json::to_string(&config).unwrap()).unwrap();
    copy
}

/// The case's mlx_lm.convert flags, read by `engine convert`'s parser, into `out`.
fn args_of(case: &Value, out: &Path) -> ConvertArgs {
    let src = source_of(case, out.parent().unwrap());
    let mut argv: Vec<String> = vec!["convert".into(), "--hf-path".into()];
    argv.push(src.display().to_string());
    argv.extend([
        "--mlx-path".into(),
        out.display().to_string(),
        "--quiet".into(),
    ]);
    argv.extend(
        case["args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap().to_string()),
    );
    Cli::try_parse_from(argv).unwrap().args
}

fn sha256(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Files that differ from mlx_lm.convert's on purpose. transformers 5 loads a `qwen2`
/// model's tokenizer as its `Qwen2Tokenizer` class and saves that class's pipeline (an NFC
/// normalizer, Qwen's pre-tokenizer split, `unk_token`) in place of the source's
/// tokenizer.json, which changes how text tokenizes; `engine convert` keeps the source's
/// tokenizer.json as it is (and writes tokenizer_config.json as for every other family).
const KNOWN_DIFFERENCES: &[(&str, &str)] = &[
    ("qwen2-q4-g32", "tokenizer.json"),
    ("qwen2-q4-g32", "tokenizer_config.json"),
];

/// Each tensor of a safetensors file: name → (dtype, shape, sha256 of its bytes).
fn tensors(path: &Path) -> BTreeMap<String, (String, Vec<usize>, String)> {
    let data = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&data).unwrap();
    st.tensors()
        .into_iter()
        .map(|(k, t)| {
            let v = (
                format!("{:?}", t.dtype()),
                t.shape().to_vec(),
                sha256(t.data()),
            );
            (k, v)
        })
        .collect()
}

/// The first difference of the output dir from the golden case, named.
pub(super) fn first_difference(case: &Value, out: &Path) -> Option<String> {
    let name = case["name"].as_str().unwrap();
    let files = case["files"].as_object().unwrap();
    let mut ours: Vec<String> = std::fs::read_dir(out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    ours.sort();
    let theirs: Vec<String> = files.keys().cloned().collect();
    if ours != theirs {
        return Some(format!(
            "{name}: files {ours:?}, mlx_lm.convert wrote {theirs:?}"
        ));
    }
    for (file, want) in files {
        let bytes = std::fs::read(out.join(file)).unwrap();
        let same = sha256(&bytes) == want["sha256"].as_str().unwrap();
        let known = KNOWN_DIFFERENCES.contains(&(name, file.as_str()));
        if known && same {
            return Some(format!(
                "{name}: {file} is now identical: drop it from KNOWN_DIFFERENCES"
            ));
        }
        if same || known {
            continue;
        }
        if file == "config.json" {
            let got: Value = serde_json::from_slice(&bytes).unwrap();
            return Some(format!(
                "{name}: config.json differs:\n ours {got}\n mlx-lm {}",
                case["config"]
            ));
        }
        if let Some(want_tensors) = case["tensors"][file].as_object() {
            return Some(tensor_difference(name, file, &out.join(file), want_tensors));
        }
        return Some(format!("{name}: {file} differs (sha256)"));
    }
    None
}

fn tensor_difference(
    name: &str,
    file: &str,
    path: &Path,
    want: &serde_json::Map<String, Value>,
) -> String {
    let got = tensors(path);
    for (k, w) in want {
        let shape: Vec<usize> = w["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap() as usize)
            .collect();
        let wv = (
            w["dtype"].as_str().unwrap(),
            shape,
            w["sha256"].as_str().unwrap(),
        );
        match got.get(k) {
            None => return format!("{name}: {file}: tensor {k} missing"),
            Some((d, s, h)) if (d.as_str(), s.clone(), h.as_str()) != wv => {
                return format!(
                    "{name}: {file}: first differing tensor {k}: ours {d} {s:?}, mlx-lm {} {:?}",
                    wv.0, wv.1
                )
            }
            _ => {}
        }
    }
    if let Some(extra) = got.keys().find(|k| !want.contains_key(*k)) {
        return format!("{name}: {file}: extra tensor {extra}");
    }
    format!("{name}: {file}: same tensors, different layout (tensor order in the file)")
}

/// Converts every golden case; the differences found (none when all match).
fn run_cases(only: Option<&str>) -> Vec<String> {
    run_named(only.map(|o| vec![o]).as_deref())
        .into_iter()
        .flat_map(|(_, p)| p)
        .collect()
}

/// Converts the golden cases named (every one for None), reading the index once; each
/// case's differences.
fn run_named(names: Option<&[&str]>) -> Vec<(String, Vec<String>)> {
    let tmp = tempfile::tempdir().unwrap();
    let mut found = Vec::new();
    for case in cases() {
        let name = case["name"].as_str().unwrap();
        if names.is_some_and(|n| !n.contains(&name)) {
            continue;
        }
        let out = tmp.path().join(name);
        let problems = match convert(&args_of(&case, &out)) {
            Err(e) => vec![format!("{name}: engine convert failed: {e:#}")],
            Ok(()) => first_difference(&case, &out).into_iter().collect(),
        };
        found.push((name.to_string(), problems));
    }
    found
}

#[test]
fn every_case_is_byte_identical_to_mlx_lm_convert() {
    let n = cases().len();
    assert!(n >= 10, "{n} cases");
    let problems = run_cases(None);
    assert!(
        problems.is_empty(),
        "{} of {n} cases differ:\n{}",
        problems.len(),
        problems.join("\n")
    );
}

#[test]
fn planted_norms_left_uncast_fail_the_gate() {
    let _on = plant::on(Defect::ConvertNormsKeepDtype).unwrap();
    let problems = run_cases(Some("llama-bf16"));
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(
        problems[0].contains("first differing tensor model.layers.0.input_layernorm.weight"),
        "{}",
        problems[0]
    );
}

/// The same plant on olmo2 (post-norm layers, no input norm): layer 0's post-attention
/// norm, its first norm in the file, is the first differing tensor.
#[test]
fn planted_norms_left_uncast_fail_the_olmo2_case() {
    let _on = plant::on(Defect::ConvertNormsKeepDtype).unwrap();
    let problems = run_cases(Some("olmo2-f16"));
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(
        problems[0]
            .contains("first differing tensor model.layers.0.post_attention_layernorm.weight"),
        "{}",
        problems[0]
    );
}

/// And on gemma2 (bf16 → float32): its first norm in the file is the first differing tensor.
#[test]
fn planted_norms_left_uncast_fail_the_gemma2_case() {
    let _on = plant::on(Defect::ConvertNormsKeepDtype).unwrap();
    let problems = run_cases(Some("gemma2-f32"));
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(
        problems[0].contains("first differing tensor model.layers.0.input_layernorm.weight"),
        "{}",
        problems[0]
    );
}

/// A hybrid's sanitize step skipped (Qwen 3.5's (1 + w) norms left as Hugging Face stores
/// them) fails the qwen3_5 case, naming the first norm.
#[test]
fn planted_hybrid_norms_without_their_offset_fail_the_gate() {
    let _on = plant::on(Defect::HybridNormOffsetSkipped).unwrap();
    let problems = run_cases(Some("qwen3-5-bf16"));
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(
        problems[0].contains(
            "first differing tensor language_model.model.layers.0.input_layernorm.weight"
        ),
        "{}",
        problems[0]
    );
}

/// Falcon-H1's µP fold with in_proj's per-row multipliers left out (scaled by
/// `ssm_in_multiplier` alone) fails the falcon_h1 case, naming layer 0's in_proj: the
/// tensors before it (embedding, feed-forward, conv kernel) still match.
#[test]
fn planted_falcon_in_proj_without_its_mup_rows_fails_the_gate() {
    let _on = plant::on(Defect::FalconInProjMupSkipped).unwrap();
    let problems = run_cases(Some("falcon-h1-bf16"));
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(
        problems[0].contains("first differing tensor model.layers.0.mamba.in_proj.weight"),
        "{}",
        problems[0]
    );
}

/// Issue 38's families, one quantized case each (oracles/gen_convert.py).
const ISSUE_38_CASES: &[&str] = &[
    "deepseek-v3-q4-g32",
    "glm4-moe-q4-g32",
    "ministral3-q4",
    "mistral3-q4",
    "qwen3-vl-q4",
    "olmo3-q4",
    "seed-oss-q4",
    "exaone4-q4",
    "hunyuan-q4",
    "minicpm-q4",
    "cohere2-q4",
    "ernie4-5-moe-q4-g32",
    "minimax-q4-g32",
    "phimoe-q4-g32",
    "llama4-text-q4",
    "qwen3-moe-q4-g32",
    "mixtral-q4-g32",
    "qwen2-moe-q4-g32",
    "phi3-q4",
    "minimax-alias-q4-g32",
    "glm4-moe-lite-q4-g32",
    "deepseek-v32-q4-g32",
    "kimi-k25-q4-g32",
    "minicpm3-q4-g32",
    "gemma3-mm-q4",
    "gemma4-mm-q4",
    "llama4-q4-g32",
    "gpt-oss-q4-g32",
    "gemma3n-q4-g32",
];

/// The plant's problem on each of `names`, which must all fail.
fn planted_problems(names: &[&str]) -> Vec<(String, String)> {
    let found = run_named(Some(names));
    assert_eq!(found.len(), names.len(), "{found:?}");
    found
        .into_iter()
        .map(|(name, problems)| {
            assert_eq!(problems.len(), 1, "{name}: {problems:?}");
            (name, problems[0].clone())
        })
        .collect()
}

/// The tensors saved in name order, not the model's parameter order, fail every issue-38
/// family's case: the layer's modules' `__init__` order is what each family's table holds.
#[test]
fn planted_name_order_fails_every_family_case() {
    let _on = plant::on(Defect::ConvertParamsSortedByName).unwrap();
    for (name, p) in planted_problems(ISSUE_38_CASES) {
        assert!(p.contains("different layout"), "{name}: {p}");
    }
}

/// The gate projections stacked from the up projections' experts (and the reverse) fail
/// the per-expert checkpoints, naming a tensor of the first MoE layer's stacked gate projection.
#[test]
fn planted_gate_up_swap_fails_the_per_expert_moes() {
    let _on = plant::on(Defect::ConvertExpertsGateUpSwapped).unwrap();
    let cases = [
        "deepseek-v3-q4-g32",
        "glm4-moe-q4-g32",
        "glm4-moe-lite-q4-g32",
        "deepseek-v32-q4-g32",
        "ernie4-5-moe-q4-g32",
        "minimax-q4-g32",
        "phimoe-q4-g32",
    ];
    for (name, p) in planted_problems(&cases) {
        assert!(
            p.contains("first differing tensor model.layers.")
                && p.contains("switch_mlp.gate_proj."),
            "{name}: {p}"
        );
    }
    // Llama 4's fused experts, split into gate and up the other way round.
    for (name, p) in planted_problems(&["llama4-q4-g32"]) {
        assert!(p.contains("feed_forward.experts.gate_proj."), "{name}: {p}");
    }
}

/// The routers quantized with the top-level bits (the model's `quant_predicate` ignored)
/// fail qwen3_moe, minimax and gpt_oss: their config no longer names the routers' 8 bits.
#[test]
fn planted_routers_at_top_bits_fail_qwen3_moe_minimax_and_gpt_oss() {
    let _on = plant::on(Defect::ConvertRouterAtTopBits).unwrap();
    for (name, p) in planted_problems(&["qwen3-moe-q4-g32", "minimax-q4-g32", "gpt-oss-q4-g32"]) {
        assert!(p.contains("config.json differs"), "{name}: {p}");
    }
}

pub(super) fn engine() -> Command {
    Command::new(env!("CARGO_BIN_EXE_engine"))
}

/// The CLI converts, and the converted models generate what mlx_lm.generate generates on
/// mlx_lm.convert's output of the same case.
#[test]
fn converted_models_generate_as_mlx_lm() {
    let tmp = tempfile::tempdir().unwrap();
    let mut checked = 0;
    for case in cases().iter().filter(|c| c.get("generate").is_some()) {
        let name = case["name"].as_str().unwrap();
        if !GENERATES.contains(&name) {
            continue;
        }
        let out = tmp.path().join(name);
        let src = source_of(case, tmp.path());
        let mut cmd = engine();
        cmd.args(["convert", "--hf-path"])
            .arg(&src)
            .arg("--mlx-path")
            .arg(&out);
        cmd.args(
            case["args"]
                .as_array()
                .unwrap()
                .iter()
                .map(|a| a.as_str().unwrap()),
        );
        let status = cmd.output().unwrap();
        assert!(
            status.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&status.stderr)
        );
        let gen = &case["generate"];
        let mut cmd = engine();
        cmd.args(["generate", "--model"])
            .arg(&out)
            .args(["--verbose", "False"]);
        cmd.args(
            gen["args"]
                .as_array()
                .unwrap()
                .iter()
                .map(|a| a.as_str().unwrap()),
        );
        let res = cmd.output().unwrap();
        assert!(
            res.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&res.stderr)
        );
        let text = String::from_utf8_lossy(&res.stdout);
        assert_eq!(
            text.trim_end_matches('\n'),
            gen["text"].as_str().unwrap(),
            "{name}"
        );
        checked += 1;
    }
    assert_eq!(checked, GENERATES.len());
}

/// The cases whose converted model `engine generate` loads today.
const GENERATES: &[&str] = &[
    "llama-q4-g64",
    "llama-q8-g32",
    // Its per-module entries have "group_size": null (the affine default, 64).
    "llama-mixed-3-6",
    "llama-mixed-2-6-g32",
    "llama-bf16",
    // mxfp4 everywhere (uint8 scales, no biases), bf16 elsewhere.
    "llama-mxfp4",
    "mistral-tied-q4",
    // The hybrids, from Hugging Face's layout; the MoEs in float32 only (mlx_lm.generate
    // fails on their quantized stacks here, its QuantizedSwitchLinear handing MLX's
    // gather_qmm a `global_scale` it does not take, and bf16 stacks do not run on the CPU).
    "qwen3-5-bf16",
    "qwen3-5-q4",
    "qwen3-5-mm-q4",
    "qwen3-5-moe-f32",
    "qwen3-next-f32",
    "lfm2-f32",
    "lfm2-q4",
    "nemotron-h-q4",
    "nemotron-h-f16",
    "mamba2-q4",
    "mamba2-f16",
    "lfm2-moe-f32",
    "granite-h-f32",
    "falcon-h1-bf16",
    "falcon-h1-q4",
    // smollm3: its NoPE flags kept in the converted config.
    "smollm3-q4",
];

#[test]
fn refusals_say_what_is_wrong() {
    let tmp = tempfile::tempdir().unwrap();
    let src = goldens().join("convert/tiny-llama-hf");
    let exists = tmp.path().join("exists");
    std::fs::create_dir(&exists).unwrap();
    let err = convert(&ConvertArgs::new(&src, &exists))
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        format!(
            "Cannot save to the path {} as it already exists. Please delete the file/directory or specify a new path to save to.",
            exists.display()
        )
    );
    let mut args = ConvertArgs::new(&src, tmp.path().join("a"));
    args.quantize = true;
    args.q_mode = "mxfp4".into();
    args.quant_predicate = Some("mixed_3_6".into());
    let err = convert(&args).unwrap_err().to_string();
    assert_eq!(err, "Quant predicates only support 'affine' quantization.");

    let kimi_k2 = tmp.path().join("kimi_k2");
    std::fs::create_dir(&kimi_k2).unwrap();
    std::fs::write(kimi_k2.join("config.json"), r#"{"model_type": "kimi_k2"}"#).unwrap();
    let out = tmp.path().join("b");
    let err = convert(&ConvertArgs::new(&kimi_k2, &out))
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        engine::model::registry::refusal("kimi_k2", engine::model::registry::Capability::Convert)
    );
    assert!(!out.exists(), "a failed convert leaves nothing behind");
    let mut partial = out.into_os_string();
    partial.push(".partial");
    assert!(!Path::new(&partial).exists());

    let q4 = goldens().join("models/tiny-llama-trained-q4");
    let err = convert(&ConvertArgs::new(&q4, tmp.path().join("c")))
        .unwrap_err()
        .to_string();
    assert!(err.contains("is already quantized"), "{err}");
}
