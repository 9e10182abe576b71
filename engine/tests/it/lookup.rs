//! Prompt-lookup decoding's trace gate: on tiny-llama-trained, for several γ and n-gram
//! sizes, the ids are plain greedy decoding's, and the trace adds up (every id flagged as an
//! accepted draft is counted, drafts were accepted where the text repeats). The verify pass
//! runs the target over up to γ+1 positions at once, whose rounding may differ from a
//! one-token step: each emitted id's log-probabilities are compared with plain decoding's
//! at the same position (counted, max |Δ| printed), and a divergence is allowed only where
//! plain greedy's top-two gap is at most TIE (one bf16 step) on a prompt that has an exact
//! tie somewhere; a tie-free prompt must not diverge at all. Also the CLI and the server.

use crate::common;

use common::{goldens, greedy_run, model};
use engine::generate::decode::Decoder;
use engine::generate::drafter::Decode;
use engine::generate::lookup::{propose, LookupParams};
use engine::generate::sampler::{Sampler, SamplingParams};
use engine::generate::speculative::SpecStats;
use engine::generate::{Flow, Session, SessionOptions};
use engine::model::LanguageModel;

const TIE: f32 = 0.125;
const STEPS: usize = 48;

/// Texts whose continuation repeats them (the model memorized these lines of its corpus,
/// whose sentences repeat one pattern), so drafts copied from the prompt get accepted.
const COPY_TEXTS: [&str; 3] = [
    "On Monday the robot cleans the table. On Tuesday the robot sorts the bolts. On",
    "One, two, three, four, five, six, seven, eight, nine, ten. Two and two make four.",
    "The days of the week are Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and",
];

/// (γ, longest n-gram) settings the gate runs.
const SETTINGS: [(usize, usize); 4] = [(1, 2), (4, 2), (10, 2), (6, 4)];

struct Run {
    ids: Vec<u32>,
    lps: Vec<Vec<f32>>,
    drafted_flags: usize,
    spec: SpecStats,
}

fn f32s(lp: &mlx_rs::Array) -> Vec<f32> {
    let lp = lp.as_dtype(mlx_rs::Dtype::Float32).unwrap();
    lp.eval().unwrap();
    lp.as_slice::<f32>().to_vec()
}

fn lookup_run(
    target: &dyn LanguageModel,
    prompt: &[u32],
    params: LookupParams,
    sampling: SamplingParams,
) -> Run {
    let opts = SessionOptions::default();
    let session = Session::with_options(target, &opts);
    let sampler = Sampler::new(sampling).unwrap();
    let mut dec = Decoder::new(prompt, STEPS, &[], sampler);
    let mut decode =
        Decode::start_with(session, None, Some(params), &opts, &mut dec, prompt, 0).unwrap();
    let (mut ids, mut lps, mut drafted_flags) = (Vec::new(), Vec::new(), 0);
    decode
        .run(&mut dec, &mut |id,
                             lp,
                             drafted|
         -> Result<
            Flow,
            mlx_rs::error::Exception,
        > {
            ids.push(id);
            lps.push(f32s(lp));
            drafted_flags += usize::from(drafted);
            Ok(Flow::Continue)
        })
        .unwrap();
    let spec = decode
        .spec_stats()
        .cloned()
        .expect("a lookup run has stats");
    decode.end().unwrap();
    Run {
        ids,
        lps,
        drafted_flags,
        spec,
    }
}

/// The top-1 minus top-2 log-probability.
fn margin(lp: &[f32]) -> f32 {
    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &x in lp {
        if x > a {
            (a, b) = (x, a);
        } else if x > b {
            b = x;
        }
    }
    a - b
}

/// What one prompt showed over every setting.
#[derive(Default, Debug)]
struct Outcome {
    tie_free: bool,
    /// (γ, n-gram, token index, plain greedy's margin there).
    divergences: Vec<(usize, usize, usize, f32)>,
    drafted: usize,
    accepted: usize,
    /// Emitted ids (before any divergence) whose log-probabilities differ from plain
    /// decoding's at all, out of how many, and the largest difference.
    lp_differ: usize,
    lp_compared: usize,
    max_delta: f32,
}

fn compare(target: &dyn LanguageModel, name: &str, prompt: &[u32]) -> Outcome {
    let mut plain = Session::new(target);
    let (want, want_lps) = greedy_run(&mut plain, prompt, 0, STEPS);
    let margins: Vec<f32> = want_lps.iter().map(|lp| margin(lp)).collect();
    let mut out = Outcome {
        tie_free: margins.iter().all(|&m| m > 0.0),
        ..Outcome::default()
    };
    for (gamma, ngram) in SETTINGS {
        let params = LookupParams::new(gamma, Some(ngram)).unwrap();
        let run = lookup_run(target, prompt, params, SamplingParams::default());
        assert_eq!(run.ids.len(), STEPS, "{name}: the run stopped early");
        assert_eq!(
            run.drafted_flags, run.spec.accepted,
            "{name} γ={gamma}: ids flagged as accepted drafts vs the accepted count"
        );
        let agree = run
            .ids
            .iter()
            .zip(&want)
            .take_while(|(a, b)| a == b)
            .count();
        if agree < STEPS {
            out.divergences.push((gamma, ngram, agree, margins[agree]));
        }
        for (a, b) in run.lps[..agree].iter().zip(&want_lps) {
            let d = a
                .iter()
                .zip(b)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0, f32::max);
            out.lp_differ += usize::from(d > 0.0);
            out.max_delta = out.max_delta.max(d);
        }
        out.lp_compared += agree;
        out.drafted += run.spec.drafted;
        out.accepted += run.spec.accepted;
        println!(
            "{name} γ={gamma} n≤{ngram}: accepted {}/{}, {} verify passes for {STEPS} ids",
            run.spec.accepted, run.spec.drafted, run.spec.target_calls
        );
    }
    out
}

/// Fails on a divergence that is not at a near-tie, or any divergence on a tie-free prompt.
fn check(name: &str, out: &Outcome) {
    for &(gamma, ngram, k, m) in &out.divergences {
        assert!(
            !out.tie_free && m <= TIE,
            "{name} γ={gamma} n≤{ngram}: diverged from plain greedy at token {k}, where \
             greedy's margin is {m}"
        );
        println!("{name} γ={gamma} n≤{ngram}: diverged at a near-tie (token {k}, margin {m})");
    }
}

fn prompts() -> Vec<(String, Vec<u32>)> {
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(goldens().join("l1/tiny-llama-trained/index.json")).unwrap(),
    )
    .unwrap();
    let mut all: Vec<(String, Vec<u32>)> = index["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let ids = serde_json::from_value(c["prompt_ids"].clone()).unwrap();
            (c["name"].as_str().unwrap().to_owned(), ids)
        })
        .collect();
    let tok =
        engine::load::tokenizer::Tokenizer::load(&goldens().join("models/tiny-llama-trained"))
            .unwrap();
    for (i, text) in COPY_TEXTS.iter().enumerate() {
        all.push((format!("copy{i}"), tok.encode(text, true).unwrap()));
    }
    all
}

#[test]
fn lookup_equals_plain_greedy_and_counts_its_acceptance() {
    let target = model("tiny-llama-trained");
    let (mut tie_free, mut drafted, mut accepted) = (0, 0, 0);
    let (mut differ, mut compared, mut max_delta, mut near_ties) = (0, 0, 0.0f32, 0);
    for (name, prompt) in prompts() {
        let out = compare(target.as_ref(), &name, &prompt);
        check(&name, &out);
        tie_free += usize::from(out.tie_free);
        near_ties += out.divergences.len();
        (drafted, accepted) = (drafted + out.drafted, accepted + out.accepted);
        (differ, compared) = (differ + out.lp_differ, compared + out.lp_compared);
        max_delta = max_delta.max(out.max_delta);
        if name.starts_with("copy") {
            assert!(
                out.accepted > 0,
                "{name}: no draft accepted on a repeating text"
            );
        }
    }
    println!(
        "accepted {accepted}/{drafted}; tie-free prompts {tie_free}; divergences at near-ties \
         {near_ties}; log-prob rows differing from plain decoding {differ}/{compared} (max |Δ| \
         {max_delta})"
    );
    assert!(
        tie_free >= 3,
        "only {tie_free} tie-free prompts: the gate would not bite"
    );
}

/// The gate bites: drafts copied from one position too far and accepted unchecked.
#[test]
fn planted_wrong_offset_unverified_diverges() {
    use engine::plant::{self, Defect};
    let target = model("tiny-llama-trained");
    let (name, prompt) = prompts().pop().unwrap();
    let planted = plant::on(Defect::LookupWrongOffsetUnverified).unwrap();
    let out = compare(target.as_ref(), &name, &prompt);
    drop(planted);
    println!("planted: {:?}", out.divergences);
    let caught = std::panic::catch_unwind(|| check(&name, &out));
    assert!(caught.is_err(), "the gate passed a planted defect");
}

/// Sampled requests: every emitted id is the target's own sample at its position (an
/// accepted draft equals it), so a run at a seed is reproducible and its acceptance counted.
#[test]
fn sampled_lookup_runs_and_counts() {
    let target = model("tiny-llama-trained");
    let (_, prompt) = prompts().remove(5);
    let sampling = SamplingParams {
        temp: 0.7,
        seed: 3,
        ..SamplingParams::default()
    };
    let params = LookupParams::new(4, None).unwrap();
    let a = lookup_run(target.as_ref(), &prompt, params, sampling.clone());
    let b = lookup_run(target.as_ref(), &prompt, params, sampling);
    assert_eq!(a.ids, b.ids, "the same seed gave different ids");
    assert_eq!(a.drafted_flags, a.spec.accepted);
    println!("sampled: accepted {}/{}", a.spec.accepted, a.spec.drafted);
}

#[test]
fn propose_copies_after_the_latest_earlier_match() {
    // The last 2 ids [1, 2] occur at 0 and 3; the latest earlier one (3) is followed by 9 7.
    let h = [1, 2, 5, 1, 2, 9, 7, 1, 2];
    assert_eq!(propose(&h, 2, 2), vec![9, 7]);
    // Past the history's end the copy goes on over its own drafts (a loop is drafted whole).
    assert_eq!(propose(&h, 2, 10), vec![9, 7, 1, 2, 9, 7, 1, 2, 9, 7]);
    assert_eq!(propose(&[3, 8, 8], 1, 4), vec![8, 8, 8, 8]);
    assert_eq!(propose(&h, 2, 0), Vec::<u32>::new());
    // No 3-gram match: falls back to the 2-gram.
    assert_eq!(propose(&[4, 1, 2, 5, 1, 2], 3, 1), vec![5]);
    // Nothing earlier: no drafts.
    assert_eq!(propose(&[1, 2, 3], 2, 4), Vec::<u32>::new());
    // Settings out of range are refused naming the setting.
    assert_eq!(LookupParams::new(0, None).unwrap_err().field, "num_tokens");
    assert_eq!(
        LookupParams::new(3, Some(0)).unwrap_err().field,
        "max_ngram"
    );
}

fn engine_generate(extra: &[&str]) -> std::process::Output {
    let dir = goldens().join("models/tiny-llama-trained");
    std::process::Command::new(env!("CARGO_BIN_EXE_engine"))
        .args([
            "generate",
            "--model",
            dir.to_str().unwrap(),
            "--ignore-chat-template",
        ])
        .args(["-p", COPY_TEXTS[2], "-m", "40"])
        .args(extra)
        .output()
        .unwrap()
}

#[test]
fn cli_prompt_lookup_prints_the_plain_text_and_refuses_bad_settings() {
    let plain = engine_generate(&["--verbose", "false"]);
    assert!(plain.status.success());
    for flags in [
        &["--prompt-lookup"][..],
        &["--prompt-lookup=3", "--max-matching-ngram-size", "3"],
    ] {
        let out = engine_generate(&[flags, &["--verbose", "false"][..]].concat());
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(out.stdout, plain.stdout, "{flags:?}");
    }
    let stats = engine_generate(&["--prompt-lookup"]);
    let stderr = String::from_utf8_lossy(&stats.stderr);
    assert!(stderr.contains("Speculative: γ 10, drafted"), "{stderr}");
    for (flags, says) in [
        (
            &["--prompt-lookup=0"][..],
            "--prompt-lookup-num-tokens: the drafts per pass must be between 1 and 64",
        ),
        (
            &["--prompt-lookup", "--max-matching-ngram-size", "0"][..],
            "--max-matching-ngram-size: the n-gram size must be between 1 and 16",
        ),
        (
            &["--prompt-lookup", "--repetition-penalty", "1.2"][..],
            "does not support repetition, presence or frequency penalties",
        ),
    ] {
        let out = engine_generate(flags);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && stderr.contains(says),
            "{flags:?}: {stderr}"
        );
    }
}

#[test]
fn server_prompt_lookup_per_request() {
    use common::server::{post, serve_model, stats};
    use serde_json::json;
    let server = serve_model("tiny-llama-trained", &[]);
    let body = |extra: serde_json::Value| {
        let mut b = json!({"prompt": COPY_TEXTS[2], "max_tokens": 40, "temperature": 0});
        b.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        b
    };
    let (status, plain) = post(server.port, "/v1/completions", &body(json!({})));
    assert_eq!(status, 200, "{plain}");
    let (status, looked) = post(
        server.port,
        "/v1/completions",
        &body(json!({"prompt_lookup_num_tokens": 4, "max_matching_ngram_size": 3})),
    );
    assert_eq!(status, 200, "{looked}");
    assert_eq!(looked["choices"][0]["text"], plain["choices"][0]["text"]);
    let spec = &stats(server.port)["speculative"];
    assert!(spec["drafted"].as_u64().unwrap() > 0, "{spec}");
    for (extra, param, says) in [
        (
            json!({"prompt_lookup_num_tokens": 65}),
            "prompt_lookup_num_tokens",
            "at most 64",
        ),
        (
            json!({"prompt_lookup_num_tokens": "4"}),
            "prompt_lookup_num_tokens",
            "must be an integer",
        ),
        (
            json!({"max_matching_ngram_size": 2}),
            "max_matching_ngram_size",
            "set prompt_lookup_num_tokens",
        ),
        (
            json!({"prompt_lookup_num_tokens": 4, "max_matching_ngram_size": 17}),
            "max_matching_ngram_size",
            "at most 16",
        ),
        (
            json!({"prompt_lookup_num_tokens": 4, "repetition_penalty": 1.2}),
            "prompt_lookup_num_tokens",
            "logits processors",
        ),
        (
            json!({"prompt_lookup_num_tokens": 4, "num_draft_tokens": 2}),
            "prompt_lookup_num_tokens",
            "set one of them",
        ),
    ] {
        let (status, err) = post(server.port, "/v1/completions", &body(extra.clone()));
        assert_eq!(status, 400, "{extra}: {err}");
        assert_eq!(err["error"]["param"], param, "{extra}: {err}");
        let msg = err["error"]["message"].as_str().unwrap();
        assert!(msg.contains(says), "{extra}: {msg}");
    }
}

/// Sliding-window models (tiny-gemma3, its window widened to 24): drafts go only where the
/// rings can still give them back, then plain steps past the window; the ids stay plain
/// greedy's (same tie rule), and nothing fails where a ring wraps.
#[test]
fn sliding_window_rings_draft_until_their_window() {
    let (_dir, target) = common::with_sliding_window("tiny-gemma3", 24);
    // 18 ids of a repeating pattern: the first passes draft from it while the rings near
    // their window (the last drafts allowed at offset 21).
    let prompt: Vec<u32> = [5, 6, 7].repeat(6);
    let out = compare(target.as_ref(), "tiny-gemma3 window 24", &prompt);
    check("tiny-gemma3 window 24", &out);
    assert!(out.drafted > 0, "no drafts under the window");
    // And on its real window of 8, wrapped from the prompt on: plain steps only.
    let target = model("tiny-gemma3");
    let prompt: Vec<u32> = (10..30).collect();
    let out = compare(target.as_ref(), "tiny-gemma3", &prompt);
    check("tiny-gemma3", &out);
    assert_eq!(out.drafted, 0, "drafts on a wrapped ring");
}

/// Prompt lookup over a batch (`generate::batch_lookup`), rows decoded `STEPS` ids each: the
/// copy texts start together (left-padded to the longest), the last two prompts join after
/// the second round (left-padded to the running rows' position), and rows leave as they
/// reach `STEPS`. Returns each row's
/// ids (in `prompts` order) and the drafts made and accepted over all rows.
fn batched_lookup<'m>(
    target: &'m dyn LanguageModel,
    prompts: &[Vec<u32>],
    gamma: usize,
) -> (Vec<Vec<u32>>, usize, usize) {
    use engine::generate::batch::Batch;
    use engine::generate::batch_lookup::round;
    let mut batch = Batch::new(target);
    // (prompt index, text) of the rows in the batch, in batch order.
    let mut rows: Vec<(usize, Vec<u32>)> = Vec::new();
    let admit = |batch: &mut Batch<'m>, rows: &mut Vec<(usize, Vec<u32>)>, which: &[usize]| {
        let opts = SessionOptions::default();
        let sessions: Vec<Session<'m>> = which
            .iter()
            .map(|&p| {
                let mut s = Session::with_options(target, &opts);
                s.prefill(&prompts[p][..prompts[p].len() - 1]).unwrap();
                s
            })
            .collect();
        let last: Vec<u32> = which.iter().map(|&p| *prompts[p].last().unwrap()).collect();
        let logits = batch.admit(sessions, &last).unwrap();
        let first = mlx_rs::ops::indexing::argmax_axis(&logits, -1, None).unwrap();
        let first = first.as_dtype(mlx_rs::Dtype::Uint32).unwrap();
        first.eval().unwrap();
        for (&p, &id) in which.iter().zip(first.as_slice::<u32>()) {
            rows.push((p, [&prompts[p][..], &[id]].concat()));
        }
    };
    let (starting, joining): (Vec<usize>, Vec<usize>) =
        (0..prompts.len()).partition(|&p| p < prompts.len() - 2);
    admit(&mut batch, &mut rows, &starting);
    let mut done: Vec<Option<Vec<u32>>> = vec![None; prompts.len()];
    let (mut drafted, mut accepted) = (0, 0);
    for r in 0.. {
        if r == 2 {
            admit(&mut batch, &mut rows, &joining);
        }
        let mut texts: Vec<Vec<u32>> = rows.iter().map(|(_, t)| t.clone()).collect();
        for row in round(&mut batch, &mut texts, gamma, 2).unwrap() {
            drafted += row.drafted;
            accepted += row.accepted;
        }
        let mut keep = Vec::new();
        for (i, ((p, text), new)) in rows.iter_mut().zip(texts).enumerate() {
            *text = new;
            let emitted = &text[prompts[*p].len()..];
            if emitted.len() >= STEPS {
                done[*p] = Some(emitted[..STEPS].to_vec());
            } else {
                keep.push(i);
            }
        }
        batch.keep(&keep).unwrap();
        rows = keep.iter().map(|&i| rows[i].clone()).collect();
        if rows.is_empty() && r >= 2 {
            break;
        }
    }
    let ids = done
        .into_iter()
        .map(|d| d.expect("every row ran"))
        .collect();
    (ids, drafted, accepted)
}

/// Batched prompt lookup (issue 43, item 4's first part): the copy texts and two L1 prompts
/// decode together, one forward per round verifying every row's drafts, each row's rejected
/// drafts rolled out of the batch cache on its own (`Batch::trim_rows`); rows join and
/// leave between rounds. Each row's ids are its plain greedy ids, a divergence allowed only
/// where plain greedy's top-two gap is at most TIE on a prompt with an exact tie somewhere
/// (as the serial gate above). Drafts are accepted and rejected (both paths run). Planted,
/// `BatchRowTrimShort` (one rejected position per row kept) changes the rows' ids.
#[test]
fn batched_lookup_rows_are_plain_greedy_and_a_short_row_trim_is_caught() {
    let target = model("tiny-llama-trained");
    let all = prompts();
    // The copy texts first (they start together), then two L1 prompts (they join).
    let chosen: Vec<(String, Vec<u32>)> = all[all.len() - COPY_TEXTS.len()..]
        .iter()
        .chain(&all[..2])
        .cloned()
        .collect();
    let prompts: Vec<Vec<u32>> = chosen.iter().map(|(_, p)| p.clone()).collect();
    for gamma in [2, 5] {
        let (rows, drafted, accepted) = batched_lookup(target.as_ref(), &prompts, gamma);
        println!("batched lookup γ={gamma}: accepted {accepted}/{drafted}");
        assert!(
            accepted > 0 && drafted > accepted,
            "γ={gamma}: the rounds need accepted and rejected drafts ({accepted}/{drafted})"
        );
        for ((name, prompt), ids) in chosen.iter().zip(&rows) {
            let (want, want_lps) = greedy_run(&mut Session::new(target.as_ref()), prompt, 0, STEPS);
            let margins: Vec<f32> = want_lps.iter().map(|lp| margin(lp)).collect();
            let out = Outcome {
                tie_free: margins.iter().all(|&m| m > 0.0),
                divergences: ids
                    .iter()
                    .zip(&want)
                    .position(|(a, b)| a != b)
                    .map(|k| (gamma, 2, k, margins[k]))
                    .into_iter()
                    .collect(),
                ..Outcome::default()
            };
            check(&format!("batched {name}"), &out);
        }
        let planted = engine::plant::on(engine::plant::Defect::BatchRowTrimShort).unwrap();
        let (short, _, _) = batched_lookup(target.as_ref(), &prompts, gamma);
        drop(planted);
        assert_ne!(
            short, rows,
            "γ={gamma}: a short row trim changed no row's ids"
        );
    }
}

/// The requests of the served batch-lane gate: the copy texts asking for prompt lookup and
/// a plain row beside them (greedy, or with a repetition penalty when `penalized`: then the
/// rounds pick row by row), then one more lookup request that joins later.
fn lane_lookup_bodies(penalized: bool) -> Vec<serde_json::Value> {
    use serde_json::json;
    let lookup = |p: &str, gamma: usize| {
        json!({"prompt": p, "max_tokens": 40, "temperature": 0,
               "prompt_lookup_num_tokens": gamma, "max_matching_ngram_size": 2})
    };
    let mut plain = json!({"prompt": "The little robot", "max_tokens": 40, "temperature": 0});
    // Penalized, the second lookup row samples at temperature 1 from its top 1 (the sampled
    // verify's path, whose draws are greedy's ids).
    let mut sampled = lookup(COPY_TEXTS[1], 2);
    if penalized {
        plain["repetition_penalty"] = 1.3.into();
        sampled["temperature"] = 1.0.into();
        sampled["top_k"] = 1.into();
    }
    vec![
        lookup(COPY_TEXTS[0], 4),
        sampled,
        lookup(COPY_TEXTS[2], 6),
        plain,
        lookup(COPY_TEXTS[2], 10),
    ]
}

/// `bodies` on a `--batch 4` tiny-llama-trained server (`common::lane::four_then_one`).
fn lane_lookup_run(bodies: &[serde_json::Value], plants: &str) -> (Vec<String>, serde_json::Value) {
    let model = goldens().join("models/tiny-llama-trained");
    common::lane::four_then_one(&model, &[], plants, bodies)
}

/// Prompt lookup inside the batch lane (issue 43 item 4): three lookup rows (γ 4, 2, 6) and
/// a plain row start together on a `--batch 4` server, and each round verifies every row's
/// drafts in one forward and gives back each row's rejected positions on its own; a fifth
/// lookup row (γ 10) joins when a slot frees (and runs its last rounds alone in batch form
/// when it outlasts the others). Twice: the plain row greedy (one argmax for every row of a
/// round) and with a repetition penalty (each row picks with its own sampler, the plain one
/// with its processors over its history, one lookup row sampling at temperature 1 from its
/// top 1). Every answer is the serial lane's answer without
/// lookup, drafts were both accepted and rejected (/stats `speculative`), and the four rows
/// shared steps. Planted, `BatchRowTrimShort` (each row keeps one rejected position) changes
/// an answer in both.
#[test]
fn batch_lane_lookup_rows_answer_as_plain_greedy_and_a_short_row_trim_is_caught() {
    let keys = ["prompt_lookup_num_tokens", "max_matching_ngram_size"];
    let runs = common::lane::plain_runs(lane_lookup_bodies, &keys);
    for (penalized, bodies, plain) in &runs {
        let (served, st) = lane_lookup_run(bodies, "");
        assert_eq!(
            &served, plain,
            "batch-lane lookup vs the serial lane (penalized row: {penalized}): {st}"
        );
        let spec = &st["speculative"];
        let (drafted, accepted) = (
            spec["drafted"].as_u64().unwrap(),
            spec["accepted"].as_u64().unwrap(),
        );
        println!("batch-lane lookup (penalized row: {penalized}): {spec}");
        assert!(
            accepted > 0 && drafted > accepted,
            "drafts accepted and rejected: {st}"
        );
        assert!(
            st["lanes"]["batch_peak_rows"].as_u64().unwrap() >= 4,
            "the rows never shared a round: {st}"
        );
        assert_eq!(st["failed"], 0, "{st}");
        let (planted, _) = lane_lookup_run(bodies, "BatchRowTrimShort");
        assert_ne!(
            &planted, plain,
            "a short row trim changed no answer (penalized row: {penalized})"
        );
    }
}

/// Five lookup rows sampling at temperature 0.8 from their top 5, each with its own seed.
fn sampled_lookup_bodies(reseeded: bool) -> Vec<serde_json::Value> {
    let seed = |s: u64| if reseeded { s + 100 } else { s };
    let row = |p: &str, gamma: usize, s: u64| {
        serde_json::json!({"prompt": p, "max_tokens": 40, "temperature": 0.8, "top_k": 5,
            "seed": seed(s), "prompt_lookup_num_tokens": gamma, "max_matching_ngram_size": 2})
    };
    vec![
        row(COPY_TEXTS[0], 4, 1),
        row(COPY_TEXTS[1], 2, 2),
        row(COPY_TEXTS[2], 6, 3),
        row(COPY_TEXTS[0], 3, 4),
        row(COPY_TEXTS[2], 10, 5),
    ]
}

/// Lookup rows that sample from more than one id (issue 43 item 4): four start together on a
/// `--batch 4` server and a fifth joins, each seeded; every answer is the one the serial
/// lane gives the same request, lookup and seed included. A row joins holding its prompt
/// but the last id (its first round feeds it before the drafts) and draws each round over
/// its own drafts + 1 positions, as the serial lane's verify does, so the seeded draws are
/// the same. Twice, with two sets of seeds (whose answers differ: the rows do sample).
/// Planted, each of `BatchLookupDrawsPadded` (a row draws over the round's longest run),
/// `BatchLookupFirstIdAtAdmission` (a row's first id is sampled when it joins) and
/// `BatchRowTrimShort` changes an answer.
#[test]
fn batch_lane_sampled_lookup_rows_answer_as_the_serial_lane_with_the_same_seeds() {
    let runs = common::lane::plain_runs(sampled_lookup_bodies, &[]);
    assert_ne!(runs[0].2, runs[1].2, "other seeds, the same answers");
    for (reseeded, bodies, serial) in &runs {
        let (served, st) = lane_lookup_run(bodies, "");
        assert_eq!(&served, serial, "reseeded: {reseeded}: {st}");
        let spec = &st["speculative"];
        let (drafted, accepted) = (
            spec["drafted"].as_u64().unwrap(),
            spec["accepted"].as_u64().unwrap(),
        );
        println!("batch-lane sampled lookup (reseeded: {reseeded}): {spec}");
        assert!(accepted > 0 && drafted > accepted, "{st}");
        assert!(
            st["lanes"]["batch_peak_rows"].as_u64().unwrap() >= 4,
            "{st}"
        );
        assert_eq!(st["failed"], 0, "{st}");
    }
    let (_, bodies, serial) = &runs[0];
    for plant in [
        "BatchLookupDrawsPadded",
        "BatchLookupFirstIdAtAdmission",
        "BatchRowTrimShort",
    ] {
        let (planted, _) = lane_lookup_run(bodies, plant);
        assert_ne!(&planted, serial, "{plant} changed no answer");
    }
}
