//! The chunked cross-entropy (`--loss-chunk`) against the plain loss over the whole logits:
//! one training batch through `trainer::batch_grads` both ways, SFT (prompt-masked, two
//! rows of unequal length) and ORPO (joint forward, two pairs), LoRA rank 4 on every linear
//! with nonzero B. Chunk sizes that do not divide the token count (so a chunk boundary falls
//! inside a row, and the last chunk is short), with and without segmented backward.
//!
//! - **f32** (the committed bf16 models converted with `engine convert --dtype float32`):
//!   every loss output and every adapter gradient bit-identical (max |Δ| = 0). Each token's
//!   CE is the same ops on the same row (the head and `cross_entropy` are row-wise), and the
//!   per-token CE is put back together before the plain path's own reduction.
//! - **bf16** (the committed weights): the ORPO prefix gate's measure (`orpo_prefix.rs`):
//!   each path's gradient error against the exact gradients (the plain path on the f32
//!   copy, same adapters held exactly in bf16), the chunked error at most
//!   `BF16_ERROR_RATIO` × the plain one. Measured: the two bf16 paths are bit-identical
//!   (loss and gradients |Δ| = 0, so the ratio is 1), and that is asserted too: the row-wise
//!   ops round the same way in bf16.
//!
//! Planted: a chunk boundary one row early (`LossChunkOffByOne`) changes the loss; the
//! head's gradient stopped in later chunks (`LossChunkHeadNoGrad`) leaves the loss and
//! changes the gradients.

use crate::common;

use std::path::{Path, PathBuf};

use engine::model::LanguageModel;
use engine::plant::{self, Defect};
use engine::train::data::{Example, Pair};
use engine::train::lora::Adapters;
use engine::train::orpo_prefix::OrpoForward;
use engine::train::trainer::{batch_grads, Dataset, Method, TrainConfig};
use mlx_rs::{Array, Dtype};

/// Llama (untied head) and Gemma 4 (tied head, final logit soft-capping, KV-shared layers
/// carried across segment boundaries).
const GATED: [&str; 2] = ["tiny-llama-trained", "tiny-gemma4"];

/// bf16: the chunked path's largest gradient error over the plain path's, both against the
/// f32 copy's plain gradients.
const BF16_ERROR_RATIO: f32 = 1.5;

fn attach(m: &dyn LanguageModel) -> Adapters<'_> {
    crate::common::train::attach_nonzero(m, 200)
}

fn datasets(dir: &Path) -> [Dataset; 2] {
    let tok = engine::load::tokenizer::Tokenizer::load(dir).unwrap();
    let enc = |s: &str, special| tok.encode(s, special).unwrap();
    let sft = ["The sky is blue and the grass is green today.", "Say hi."]
        .iter()
        .map(|s| Example {
            tokens: enc(s, true),
            offset: 2,
        })
        .collect();
    let pairs = [
        ("Name a yellow fruit.", " A banana.", " A cucumber, surely."),
        ("Count to three", " One, two, three.", " Three."),
    ]
    .iter()
    .map(|&(p, c, r)| {
        let prompt = enc(p, true);
        let (mut chosen, mut rejected) = (prompt.clone(), prompt.clone());
        chosen.extend(enc(c, false));
        rejected.extend(enc(r, false));
        Pair {
            prompt_len: prompt.len(),
            chosen,
            rejected,
        }
    })
    .collect();
    [Dataset::Sft(sft), Dataset::Orpo(pairs)]
}

fn config(method: Method, loss_chunk: Option<usize>, segment_size: Option<usize>) -> TrainConfig {
    TrainConfig {
        segment_size,
        orpo_forward: OrpoForward::Joint,
        loss_chunk,
        ..crate::common::train::config(method)
    }
}

/// The loss outputs and gradients of the model in `dir`, per method (SFT, ORPO).
fn run(dir: &Path, chunk: Option<usize>, segment: Option<usize>) -> Vec<(Vec<Array>, Vec<Array>)> {
    let m = engine::model::load(dir).unwrap();
    let adapters = attach(m.as_ref());
    let out = datasets(dir)
        .iter()
        .zip([Method::Sft, Method::Orpo])
        .map(|(data, method)| {
            let cfg = config(method, chunk, segment);
            let (o, g) = batch_grads(m.as_ref(), &adapters, data, &[0, 1], &cfg, &mut ()).unwrap();
            mlx_rs::transforms::eval(o.iter().chain(&g)).unwrap();
            (o, g)
        })
        .collect();
    adapters.detach();
    out
}

fn max_gap(a: &[Array], b: &[Array]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(a, b)| {
            let f = |x: &Array| x.as_dtype(Dtype::Float32).unwrap();
            let d = f(a)
                .subtract(f(b))
                .unwrap()
                .abs()
                .unwrap()
                .max(None)
                .unwrap();
            d.eval().unwrap();
            d.as_slice::<f32>()[0]
        })
        .fold(0.0, f32::max)
}

/// (loss gap, gradient gap) per method, chunked vs plain.
fn gaps(
    plain: &[(Vec<Array>, Vec<Array>)],
    chunked: &[(Vec<Array>, Vec<Array>)],
) -> Vec<(f32, f32)> {
    plain
        .iter()
        .zip(chunked)
        .map(|(p, c)| (max_gap(&p.0, &c.0), max_gap(&p.1, &c.1)))
        .collect()
}

fn f32_copy(name: &str, tmp: &Path) -> PathBuf {
    let out = tmp.join(name);
    let committed = common::goldens().join("models").join(name);
    let mut args = engine::convert::ConvertArgs::new(committed, &out);
    args.dtype = Some("float32".into());
    engine::convert::convert(&args).unwrap();
    out
}

#[test]
fn the_chunked_loss_is_the_plain_loss_bit_for_bit_in_f32_and_as_close_in_bf16() {
    let tmp = tempfile::tempdir().unwrap();
    let mut failed = Vec::new();
    for name in GATED {
        let dir = f32_copy(name, tmp.path());
        let plain = run(&dir, None, None);
        for (chunk, segment) in [(7, None), (5, Some(1))] {
            let g = gaps(&plain, &run(&dir, Some(chunk), segment));
            println!(
                "{name} f32 chunk {chunk} segment {segment:?}: (loss, grad) |Δ| SFT, ORPO {g:?}"
            );
            if g.iter().any(|&(l, d)| l != 0.0 || d != 0.0) {
                failed.push(format!("{name} f32 chunk {chunk}: {g:?}"));
            }
        }
        // bf16: each path's gradient error against the f32 plain gradients.
        let bf = common::goldens().join("models").join(name);
        let (p16, c16) = (run(&bf, None, None), run(&bf, Some(7), None));
        for (k, method) in ["SFT", "ORPO"].iter().enumerate() {
            let (e_plain, e_chunk) = (
                max_gap(&p16[k].1, &plain[k].1),
                max_gap(&c16[k].1, &plain[k].1),
            );
            let (loss, grad) = (max_gap(&p16[k].0, &c16[k].0), max_gap(&p16[k].1, &c16[k].1));
            println!(
                "{name} bf16 {method}: chunked vs plain |Δ| loss {loss:e}, gradients {grad:e}; \
                 gradient error against f32: plain {e_plain:e}, chunked {e_chunk:e}"
            );
            if e_chunk > BF16_ERROR_RATIO * e_plain || loss != 0.0 || grad != 0.0 {
                failed.push(format!("{name} bf16 {method}: {e_chunk:e} vs {e_plain:e}"));
            }
        }
    }
    assert!(failed.is_empty(), "chunked differs from plain: {failed:?}");
}

#[test]
fn planted_chunk_boundary_and_stopped_head_gradient_fail_the_gate() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = f32_copy(GATED[0], tmp.path());
    let plain = run(&dir, None, None);
    let off = {
        let _on = plant::on(Defect::LossChunkOffByOne).unwrap();
        gaps(&plain, &run(&dir, Some(7), None))
    };
    println!("planted off-by-one: {off:?}");
    assert!(
        off.iter().all(|&(l, _)| l > 0.0),
        "the loss should see it: {off:?}"
    );
    let stopped = {
        let _on = plant::on(Defect::LossChunkHeadNoGrad).unwrap();
        gaps(&plain, &run(&dir, Some(7), None))
    };
    println!("planted stopped head gradient: {stopped:?}");
    assert!(
        stopped.iter().all(|&(l, d)| l == 0.0 && d > 0.0),
        "{stopped:?}"
    );
}

/// The training loop takes the chunked loss with `loss_chunk` set, for its steps and its
/// evals: two SFT steps (an eval before the first and after the last) on the f32 copy end
/// with the plain run's adapters and validation losses, byte for byte; under the planted
/// stopped head gradient the adapters differ.
#[test]
fn the_training_loop_runs_the_chunked_loss() {
    use engine::train::optim::{AdamW, Schedule};
    use engine::train::trainer::{train, Metrics};
    let tmp = tempfile::tempdir().unwrap();
    let dir = f32_copy(GATED[0], tmp.path());
    let m = engine::model::load(&dir).unwrap();
    let [sft, _] = datasets(&dir);
    let run = |chunk: Option<usize>| -> (Vec<Vec<u8>>, Vec<f64>) {
        let adapters = attach(m.as_ref());
        let mut cfg = config(Method::Sft, chunk, None);
        cfg.iters = 2;
        let mut opt = AdamW::new(Schedule::Constant(1e-3), 0.01);
        let out = tempfile::tempdir().unwrap();
        let path = out.path().join("metrics.jsonl");
        let mut metrics = Metrics::create(&path, serde_json::json!({})).unwrap();
        train(
            m.as_ref(),
            &adapters,
            &mut opt,
            &sft,
            Some(&sft),
            &cfg,
            &mut metrics,
            out.path(),
            |_, _| {},
        )
        .unwrap();
        let evals = std::fs::read_to_string(&path)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .filter_map(|v| v["val_loss"].as_f64())
            .collect();
        let params = adapters.params().iter().map(common::bytes).collect();
        adapters.detach();
        (params, evals)
    };
    let plain = run(None);
    assert_eq!(plain.1.len(), 2, "two evals");
    assert!(
        plain == run(Some(7)),
        "the chunked loop differs from the plain one"
    );
    let _on = plant::on(Defect::LossChunkHeadNoGrad).unwrap();
    assert!(
        plain.0 != run(Some(7)).0,
        "the planted stopped head gradient went unnoticed"
    );
}
