//! The compiled decode step against the eager one: identical logits, bit for bit, on every
//! step where it is enabled; proof that it actually ran; and planted defects that the same
//! comparison catches (forcing it onto an f32 model, where CPU compilation changes SDPA
//! rounding; an attention bound one position short).

use crate::common;

use common::model;

use engine::generate::probe::{MemoKey, Path, PHASE};
use engine::generate::{CompileDecode, Session, SessionOptions};
use engine::plant::{self, Defect};
use mlx_rs::Array;

fn bytes(a: &Array) -> Vec<u8> {
    let a = a.as_dtype(mlx_rs::Dtype::Float32).unwrap();
    a.eval().unwrap();
    a.as_slice::<f32>()
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect()
}

/// Runs prefill + `steps` greedy steps; returns every logit vector and the compiled count.
fn trajectory(name: &str, policy: CompileDecode, steps: usize) -> (Vec<Vec<u8>>, usize) {
    let prompt: Vec<u32> = vec![1, 346, 403, 276, 22, 207];
    let (out, compiled, _) = trajectory_from(name, policy, &prompt, steps);
    (out, compiled)
}

/// `trajectory` after `prompt`, also giving the compile probe's choice.
fn trajectory_from(
    name: &str,
    opts: impl Into<SessionOptions>,
    prompt: &[u32],
    steps: usize,
) -> (Vec<Vec<u8>>, usize, Option<Path>) {
    trajectory_of(model(name).as_ref(), opts, prompt, steps)
}

/// `trajectory_from` on a loaded model (sessions sharing a memo share their model).
fn trajectory_of(
    m: &dyn engine::model::LanguageModel,
    opts: impl Into<SessionOptions>,
    prompt: &[u32],
    steps: usize,
) -> (Vec<Vec<u8>>, usize, Option<Path>) {
    let mut s = Session::with_options(m, &opts.into());
    let mut logits = s.prefill(prompt).unwrap();
    let mut out = vec![bytes(&logits)];
    for _ in 0..steps {
        let id = engine::generate::greedy(&logits).unwrap();
        logits = s.step(&[id]).unwrap();
        out.push(bytes(&logits));
    }
    let compiled = s.compiled_steps();
    (out, compiled, s.compile_choice())
}

#[test]
fn compiled_decode_is_bit_exact_with_eager_and_actually_runs() {
    // Prompt 6, 300 steps: the attention bound (offset + 1 rounded up to 128) is 128, then
    // 256; past 256 positions the KV buffers grow once (to 512) and the bound is 384. Each
    // bound is a graph of its own, every one compared with eager here.
    for name in ["tiny-llama-trained", "tiny-llama-trained-q4", "tiny-llama"] {
        let (eager, none) = trajectory(name, CompileDecode::Off, 300);
        let (compiled, ran) = trajectory(name, CompileDecode::WhereExact, 300);
        assert_eq!(none, 0);
        assert!(ran >= 299, "{name}: only {ran} compiled steps");
        let first_diff = eager.iter().zip(&compiled).position(|(a, b)| a != b);
        assert_eq!(
            first_diff, None,
            "{name}: compiled logits differ from eager"
        );
    }
}

#[test]
fn f32_and_f16_models_decode_eagerly_by_default() {
    for name in ["tiny-qwen3", "tiny-qwen2"] {
        let (_, ran) = trajectory(name, CompileDecode::WhereExact, 5);
        assert_eq!(ran, 0, "{name}");
    }
}

/// Planted defect: forcing the compiled step onto an f32 or f16 model changes the numbers
/// (measured), and the comparison above catches it.
#[test]
fn forcing_compile_on_f32_and_f16_models_is_caught() {
    for (name, steps) in [("tiny-qwen3", 8), ("tiny-qwen2", 120)] {
        let (eager, _) = trajectory(name, CompileDecode::Off, steps);
        let (forced, ran) = trajectory(name, CompileDecode::Always, steps);
        assert!(ran > 0);
        assert!(
            eager.iter().zip(&forced).any(|(a, b)| a != b),
            "{name}: forced compile unexpectedly exact"
        );
    }
}

/// Sliding-window models stay eager by default: compiling their rings was measured not
/// exact (the L1 goldens of tiny-gemma4 and tiny-gemma3 diverge late in one case each).
#[test]
fn ring_models_decode_eagerly_by_default() {
    for name in ["tiny-gemma4", "tiny-gemma3"] {
        let (_, ran) = trajectory(name, CompileDecode::WhereExact, 12);
        assert_eq!(ran, 0, "{name}");
    }
}

/// Forced, a full ring (window 8 here, prompt 6) is written at its slot inside the compiled
/// graph: two eager steps while the rings grow to the window, then compiled.
#[test]
fn forcing_compile_runs_full_rings_in_the_graph() {
    let (eager, _) = trajectory("tiny-gemma4", CompileDecode::Off, 40);
    let (forced, ran) = trajectory("tiny-gemma4", CompileDecode::Always, 40);
    assert!(ran >= 37, "only {ran} compiled steps");
    let first_diff = eager.iter().zip(&forced).position(|(a, b)| a != b);
    println!("tiny-gemma4 forced compile: first differing logit vector {first_diff:?}");
}

/// Planted defect: the attention bound rounds the offset up instead of the offset + 1, so
/// the step at offset 128 (prompt 6: the 123rd step, logit vector 123) attends without its
/// own token. The bit-exact comparison must fail there, and only from there.
#[test]
fn an_attention_bound_one_short_is_caught() {
    let name = "tiny-llama-trained";
    let (eager, _) = trajectory(name, CompileDecode::Off, 130);
    let _on = plant::on(Defect::CompiledBoundShort).unwrap();
    let (short, ran) = trajectory(name, CompileDecode::WhereExact, 130);
    assert!(ran >= 129, "only {ran} compiled steps");
    let first_diff = eager.iter().zip(&short).position(|(a, b)| a != b);
    println!("planted CompiledBoundShort: first differing logit vector {first_diff:?}");
    assert_eq!(first_diff, Some(123), "the short bound went unnoticed");
}

/// A 120-token prompt: the default policy's compiled phase (the prefill's last token and the
/// first steps, offsets 119–134) covers offset 128, where a bound can first fall short.
fn long_prompt() -> Vec<u32> {
    (0..120).map(|i| 1 + (i * 37 % 500) as u32).collect()
}

/// The default (`WherePays`): compiled steps, then eager ones, then whichever measured
/// faster, every logit vector bit-equal to an all-eager run whatever the choice.
#[test]
fn the_timed_choice_between_paths_is_bit_exact_with_eager() {
    for name in ["tiny-llama-trained", "tiny-llama-trained-q4"] {
        let prompt = long_prompt();
        let (eager, _, _) = trajectory_from(name, CompileDecode::Off, &prompt, 200);
        let (timed, ran, choice) = trajectory_from(name, CompileDecode::WherePays, &prompt, 200);
        assert!(
            ran >= PHASE - 1,
            "{name}: only {ran} compiled steps in the probe"
        );
        let choice = choice.unwrap_or_else(|| panic!("{name}: the probe never chose"));
        println!("{name}: {ran} compiled steps, kept {choice:?}");
        let first_diff = eager.iter().zip(&timed).position(|(a, b)| a != b);
        assert_eq!(first_diff, None, "{name}: the timed policy's logits differ");
    }
}

/// Planted defect: the bound one short, in the probe's compiled phase (offset 128 is the
/// prompt's 10th one-token step, logit vector 9); the same comparison catches it.
#[test]
fn a_short_bound_in_the_probe_phase_is_caught() {
    let name = "tiny-llama-trained";
    let prompt = long_prompt();
    let (eager, _, _) = trajectory_from(name, CompileDecode::Off, &prompt, 40);
    let _on = plant::on(Defect::CompiledBoundShort).unwrap();
    let (short, _, _) = trajectory_from(name, CompileDecode::WherePays, &prompt, 40);
    let first_diff = eager.iter().zip(&short).position(|(a, b)| a != b);
    assert_eq!(first_diff, Some(9), "the short bound went unnoticed");
}

/// Sessions sharing a memo (a server's): the second takes the first's choice from its first
/// one-token step, without timing, and every logit vector stays bit-equal to eager.
#[test]
fn sessions_sharing_probe_choices_take_the_first_choice_at_once_and_stay_bit_exact() {
    let name = "tiny-llama-trained";
    let prompt = long_prompt();
    let (eager, _, _) = trajectory_from(name, CompileDecode::Off, &prompt, 60);
    let opts = SessionOptions::default().sharing_probe_choices();
    let m = model(name);
    let (first, _, chosen) = trajectory_of(m.as_ref(), opts.clone(), &prompt, 60);
    let chosen = chosen.expect("the first session's probe chose");
    let mut s = Session::with_options(m.as_ref(), &opts);
    let logits = s.prefill(&prompt).unwrap();
    s.step(&[engine::generate::greedy(&logits).unwrap()])
        .unwrap();
    assert_eq!(
        s.compile_choice(),
        Some(chosen),
        "not taken at the first step"
    );
    assert_eq!(
        s.compile_probe_medians(),
        None,
        "the second session timed its steps"
    );
    drop(s);
    let (second, ran, _) = trajectory_of(m.as_ref(), opts, &prompt, 60);
    // The prompt's last id is a one-token step too: 61 of them.
    let want = if chosen == Path::Compiled { 61 } else { 0 };
    assert_eq!(
        ran, want,
        "{chosen:?} taken, yet {ran} of 61 steps compiled"
    );
    for (run, what) in [
        (&first, "the probing session"),
        (&second, "the adopting one"),
    ] {
        let first_diff = eager.iter().zip(run).position(|(a, b)| a != b);
        assert_eq!(first_diff, None, "{what}'s logits differ from eager");
    }
}

/// A 108-token prompt feeds position 128 (attention bound 128 crossed) at one-token step 21, logit vector 21: in
/// the probe's eager phase, so only a session that took "compiled" from a memo runs it
/// compiled there.
fn prompt_crossing_128_in_the_eager_phase() -> Vec<u32> {
    (0..108).map(|i| 1 + (i * 41 % 500) as u32).collect()
}

/// Planted defect: the bound one short. A probing session runs step 21 eagerly and shows
/// nothing; a session that took "compiled" from the memo runs it compiled, and the comparison
/// with eager catches it there — so the memo's choice really decides the path (a memo that
/// were ignored would leave this session probing, and it would pass unnoticed).
#[test]
fn a_short_bound_after_a_memo_choice_is_caught_where_the_probe_would_run_eagerly() {
    let name = "tiny-llama-trained";
    let prompt = prompt_crossing_128_in_the_eager_phase();
    let (eager, _, _) = trajectory_from(name, CompileDecode::Off, &prompt, 30);
    let opts = SessionOptions::default().sharing_probe_choices();
    let m = model(name);
    let key = MemoKey::new(m.as_ref(), prompt.len() as i32, false);
    opts.probe_memo.record(key, Path::Compiled);
    let _on = plant::on(Defect::CompiledBoundShort).unwrap();
    let diff = |run: &Vec<Vec<u8>>| eager.iter().zip(run).position(|(a, b)| a != b);
    let (probing, _, _) = trajectory_from(name, CompileDecode::WherePays, &prompt, 30);
    assert_eq!(diff(&probing), None, "step 21 ran compiled while probing");
    let (taken, ran, _) = trajectory_of(m.as_ref(), opts, &prompt, 30);
    assert_eq!(
        ran, 31,
        "every one-token step compiled, the prompt's last id's too"
    );
    assert_eq!(diff(&taken), Some(21), "the short bound went unnoticed");
}

/// The manifest's tiny models, those that load (assistant drafters load through their
/// target; bf16 dense expert stacks are refused on the CPU).
fn loadable_tiny_models() -> Vec<String> {
    common::manifest()
        .iter()
        .map(|row| row["name"].as_str().unwrap().to_owned())
        .filter(|name| engine::model::load(&common::goldens().join("models").join(name)).is_ok())
        .collect()
}

/// Every tiny model that decodes through the compiled step by default (bf16, a family
/// measured exact: `registry::Family::compiled_decode`): every logit vector of 300 steps
/// equals the eager run's. The models it does not take decode eagerly, with nothing to
/// compare.
#[test]
fn every_model_that_decodes_compiled_by_default_is_bit_exact_over_300_steps() {
    let mut compiled = Vec::new();
    for name in loadable_tiny_models() {
        if trajectory(&name, CompileDecode::WhereExact, 1).1 == 0 {
            continue;
        }
        let (eager, _) = trajectory(&name, CompileDecode::Off, 300);
        let (fast, ran) = trajectory(&name, CompileDecode::WhereExact, 300);
        assert!(ran >= 299, "{name}: only {ran} compiled steps");
        let first_diff = eager.iter().zip(&fast).position(|(a, b)| a != b);
        assert_eq!(
            first_diff, None,
            "{name}: compiled logits differ from eager"
        );
        compiled.push(name);
    }
    println!("compiled by default and bit-exact over 300 steps: {compiled:?}");
    assert!(
        compiled.len() >= 10,
        "too few models took the compiled step: {compiled:?}"
    );
}

/// Planted defect: the compiled step forced onto the families left out of it (smollm3's
/// NoPE model, quantized qwen3_moe) diverges from eager within 300 steps (measured: step 71
/// and step 240), and the comparison above catches it; by default they decode eagerly.
#[test]
fn forcing_compile_on_families_measured_inexact_is_caught() {
    for name in ["tiny-smollm3", "tiny-qwen3-moe-q4"] {
        assert_eq!(
            trajectory(name, CompileDecode::WhereExact, 1).1,
            0,
            "{name}"
        );
        let (eager, _) = trajectory(name, CompileDecode::Off, 300);
        let (forced, ran) = trajectory(name, CompileDecode::Always, 300);
        assert!(ran >= 299, "{name}: only {ran} compiled steps");
        let first_diff = eager.iter().zip(&forced).position(|(a, b)| a != b);
        println!("{name} forced compile: first differing logit vector {first_diff:?}");
        assert!(
            first_diff.is_some(),
            "{name}: forced compile unexpectedly exact"
        );
    }
}

/// `engine serve` shares one memo between its requests: the first request's probe chooses,
/// and the next request at the same context octave runs every one-token step on that path
/// (`/stats` `decode.compiled_steps`: all of them or none). A server whose requests each
/// probed would show a part (the probe's compiled phase).
#[test]
fn served_requests_after_the_first_take_its_probe_choice_for_every_step() {
    use crate::common::server::{post, serve_dir, stats};
    let server = serve_dir(&common::goldens().join("models/tiny-llama-trained"), &[]);
    let compiled = |port| stats(port)["decode"]["compiled_steps"].as_u64().unwrap();
    let ask = |prompt: &str| {
        let body = serde_json::json!({
            "prompt": prompt, "max_tokens": 48, "temperature": 0.0,
            "logit_bias": {"2": -100, "6": -100},
        });
        let (status, v) = post(server.port, "/v1/completions", &body);
        assert_eq!(status, 200, "{v}");
        v["usage"]["completion_tokens"].as_u64().unwrap()
    };
    let first = ask("Once upon a time");
    assert_eq!(first, 48);
    let probed = compiled(server.port);
    assert!(
        probed >= PHASE as u64 - 1,
        "the first request's probe: {probed}"
    );
    let tokens = ask("The little robot");
    let taken = compiled(server.port) - probed;
    assert!(
        taken == 0 || taken >= tokens,
        "the second request ran {taken} of its {tokens} steps compiled: it probed again"
    );
}
