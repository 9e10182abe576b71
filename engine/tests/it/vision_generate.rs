//! The `engine generate --image` gate (issue 41): the prompt and the greedy ids against
//! `mlx_vlm.generate`'s CLI path (mlx-vlm 0.7.10), goldens/vision/generate/generate.json made
//! by oracles/gen_vision_generate.py.
//!
//! For tiny-gemma3-vl, tiny-qwen3-vl-vision, tiny-gemma4-vl and tiny-qwen3-5-vl (each with the
//! overlay of goldens/vision/generate/<model>/: config, tokenizer with the multimodal tokens,
//! chat template), with 1 and 2 images: the templated prompt string, the prompt's ids and 8
//! greedy ids identical, through the library functions the binary calls; the binary itself,
//! on the 2-image prompt of each, prints the same prompt ids and the same text. Planted
//! defects must fail it: the images on the wrong side of the text (every family); gemma4's
//! soft tokens without their boi / eoi (the prompt ids differ); gemma4's image prompt
//! prefilled in chunks (its chunked_prefill_policy ignored: with a prefill step of 4 the
//! greedy ids differ, where the engine's one forward keeps mlx-vlm's); Qwen3.5's decode
//! steps without the rope delta (the greedy ids differ). Refusals: a text model given --image, a
//! corrupt image and one over --max-image-pixels, each naming the cause.

use std::path::{Path, PathBuf};
use std::process::Command;

use engine::generate::sampler::{Sampler, SamplingParams};
use engine::generate::Flow;
use engine::load::tokenizer::Tokenizer;
use engine::plant::{self, Defect};
use engine::vision::generate::{cli_prompt, generate, read_images};
use engine::vision::model::ImageModel;
use engine::vision::Limits;
use serde_json::Value;

use crate::common::goldens;

fn golden() -> Value {
    let path = goldens().join("vision/generate/generate.json");
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

fn image_paths(case: &Value) -> Vec<PathBuf> {
    case["images"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| goldens().join("vision").join(p.as_str().unwrap()))
        .collect()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// The golden generated ids as the engine reports them: an EOS that stopped mlx-vlm is not
/// a generated token here.
fn want_generated(case: &Value, eos: &[u32]) -> Vec<u32> {
    let mut out = ids(&case["generated"]);
    if case["finish_reason"] == "stop" && out.last().is_some_and(|t| eos.contains(t)) {
        out.pop();
    }
    out
}

/// Every mismatch of one case through the library (what `engine generate --image` calls).
fn case_mismatches(model: &ImageModel, tok: &Tokenizer, dir: &Path, case: &Value) -> Vec<String> {
    case_mismatches_with_step(model, tok, dir, case, 2048)
}

/// As [`case_mismatches`], the prompt prefilled in chunks of `step` where the family chunks.
fn case_mismatches_with_step(
    model: &ImageModel,
    tok: &Tokenizer,
    dir: &Path,
    case: &Value,
    step: usize,
) -> Vec<String> {
    let what = format!(
        "{} with {} image(s)",
        case["model"],
        case["images"].as_array().unwrap().len()
    );
    let images = read_images(&image_paths(case), &Limits::default()).unwrap();
    let prompt = cli_prompt(
        model,
        tok,
        dir,
        None,
        case["prompt"].as_str().unwrap(),
        &images,
        serde_json::Map::new(),
    )
    .unwrap();
    let mut bad = Vec::new();
    if prompt.templated != case["templated"].as_str().unwrap() {
        bad.push(format!(
            "{what}: templated prompt {:?}, mlx-vlm {:?}",
            prompt.templated, case["templated"]
        ));
    }
    if prompt.ids != ids(&case["prompt_ids"]) {
        bad.push(format!("{what}: prompt ids {:?}", prompt.ids));
        return bad;
    }
    let mut sampler = Sampler::new(SamplingParams::default()).unwrap();
    let max = case["generated"].as_array().unwrap().len();
    let (got, _) = generate(
        model,
        &prompt,
        &mut sampler,
        max,
        &tok.eos_token_ids,
        step,
        &mut |_| Ok(Flow::Continue),
    )
    .unwrap();
    let want = want_generated(case, &tok.eos_token_ids);
    if got != want {
        bad.push(format!("{what}: generated {got:?}, mlx-vlm {want:?}"));
    }
    bad
}

fn run_engine(dir: &Path, images: &[PathBuf], extra: &[&str]) -> std::process::Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_engine"));
    cmd.args(["generate", "--model"])
        .arg(dir)
        .args(["-p", "Describe this.", "-m", "8", "--verbose", "false"])
        .args(extra)
        .env("ENGINE_PRINT_PROMPT_IDS", "1")
        .env_remove("ENGINE_PLANT");
    for i in images {
        cmd.arg("--image").arg(i);
    }
    cmd.output().unwrap()
}

/// A defect only `name`'s family path can show, and what it must break: the first case's
/// prompt ids or its generated ids.
fn family_plant(name: &str) -> Option<(Defect, &'static str)> {
    match name {
        "tiny-gemma4-vl" => Some((Defect::Gemma4ImageUnbracketed, "prompt ids")),
        "tiny-qwen3-5-vl" => Some((Defect::Qwen35DeltaDropped, "generated")),
        _ => None,
    }
}

#[test]
fn engine_generate_with_images_builds_mlx_vlms_prompt_and_generates_its_greedy_ids() {
    let g = golden();
    let cases = g["cases"].as_array().unwrap();
    let mut bad = Vec::new();
    let models = [
        "tiny-gemma3-vl",
        "tiny-qwen3-vl-vision",
        "tiny-gemma4-vl",
        "tiny-qwen3-5-vl",
    ];
    for name in models {
        let dir = crate::common::vision::assembled(name);
        let model = ImageModel::load(dir.path()).unwrap();
        let tok = Tokenizer::load(dir.path()).unwrap();
        let mine: Vec<&Value> = cases.iter().filter(|c| c["model"] == name).collect();
        assert_eq!(mine.len(), 2, "{name}: a 1- and a 2-image case");
        for case in &mine {
            bad.extend(case_mismatches(&model, &tok, dir.path(), case));
        }
        // Planted: the images on the wrong side of the text; the prompt must differ.
        {
            let _on = plant::on(Defect::ImageMarkerBeforeText).unwrap();
            let planted = case_mismatches(&model, &tok, dir.path(), mine[0]);
            assert!(
                planted.iter().any(|m| m.contains("templated prompt")),
                "{name}: the planted image order went unnoticed: {planted:?}"
            );
        }
        if name == "tiny-gemma4-vl" {
            // A prefill step shorter than the prompt: mlx-vlm still prefills an image prompt
            // in one forward (chunked_prefill_policy), so the golden ids stand; planted
            // chunks (no policy) must change them.
            bad.extend(case_mismatches_with_step(
                &model,
                &tok,
                dir.path(),
                mine[0],
                4,
            ));
            let _on = plant::on(Defect::Gemma4ImagePromptChunked).unwrap();
            let planted = case_mismatches_with_step(&model, &tok, dir.path(), mine[0], 4);
            assert!(
                planted.iter().any(|m| m.contains("generated")),
                "{name}: planted chunks of an image prompt went unnoticed: {planted:?}"
            );
        }
        if let Some((defect, breaks)) = family_plant(name) {
            let _on = plant::on(defect).unwrap();
            let planted = case_mismatches(&model, &tok, dir.path(), mine[0]);
            assert!(
                planted.iter().any(|m| m.contains(breaks)),
                "{name}: planted {defect:?} went unnoticed: {planted:?}"
            );
        }
        // The binary, on the 2-image case: the same prompt ids and text.
        let case = mine[1];
        let out = run_engine(dir.path(), &image_paths(case), &[]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{name}: {stderr}");
        let want_ids = format!("prompt_ids: {:?}", ids(&case["prompt_ids"]));
        if !stderr.contains(&want_ids) {
            bad.push(format!("{name}: the binary's {stderr}"));
        }
        let stdout = String::from_utf8(out.stdout).unwrap();
        if stdout.strip_suffix('\n') != case["text"].as_str() {
            bad.push(format!(
                "{name}: the binary printed {stdout:?}, mlx-vlm {:?}",
                case["text"]
            ));
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

#[test]
fn engine_generate_refuses_images_for_a_text_model_and_bad_files_naming_the_cause() {
    let img = goldens().join("vision/images/rgb_64x64.png");
    // A text model: refused before anything loads.
    let text_model = goldens().join("models/tiny-gemma3");
    let out = run_engine(&text_model, std::slice::from_ref(&img), &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("gemma3_text") && err.contains("no vision tower"),
        "{err}"
    );
    let dir = crate::common::vision::assembled("tiny-qwen3-vl-vision");
    // A corrupt file: refused naming it.
    let bad = dir.path().join("broken.png");
    let mut bytes = std::fs::read(&img).unwrap();
    bytes.truncate(40);
    std::fs::write(&bad, bytes).unwrap();
    let out = run_engine(dir.path(), std::slice::from_ref(&bad), &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("broken.png") && err.contains("truncated"),
        "{err}"
    );
    // Over --max-image-pixels (64x64 = 4096): refused from its header.
    let out = run_engine(dir.path(), &[img], &["--max-image-pixels", "4000"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("rgb_64x64.png") && err.contains("over the limit of 4000"),
        "{err}"
    );
}
