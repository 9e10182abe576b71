//! Segmented backward against the unsegmented step (both ours): on tiny-llama-trained with
//! LoRA on every linear, for segment sizes 1, 2 and 3 (= unsegmented), SFT and ORPO — the
//! loss bit-identical and every gradient within the stated bound (measured: identical); the
//! same on tiny-smollm3 (SFT), on Gemma 4 (carried K/V) and on the hybrids (recurrent mixers: every model of the
//! LoRA training gate with a recurrent state, read from goldens/models/manifest.json —
//! falcon_h1's parallel layers and nemotron_h's `E` blocks among them).
//! Planted: dropping the cotangent between segments fails.

use crate::common;

use common::{goldens, model};
use engine::plant::{self, Defect};
use engine::train::lora::{AdapterConfig, Adapters};
use engine::train::orpo::{orpo_from_logits, pair_batch, SftScope};
use engine::train::segmented::segmented_value_and_grad;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;

type LossFn = Box<dyn FnMut(&Array) -> Result<Vec<Array>, mlx_rs::error::Exception>>;

/// The largest gradient gap allowed (absolute). Measured on cpu-amd-epyc: 0.
const GRAD_BOUND: f32 = 0.0;

fn bytes(a: &Array) -> Vec<u8> {
    common::bytes(a)
}

fn max_gap(a: &Array, b: &Array) -> f32 {
    let d = a.subtract(b).unwrap().abs().unwrap().max(None).unwrap();
    d.eval().unwrap();
    d.as_slice::<f32>()[0]
}

/// Rank-4 adapters (scale 20) on every linear of the last 3 blocks, seed 3; on every block
/// of the Gemma 4s, so the donor layers (1 and 2 of tiny-gemma4's 6) have adapters whose
/// gradients depend on what the KV-shared layers 3-5 make of their K/V.
fn attach(m: &dyn engine::model::LanguageModel) -> Adapters<'_> {
    let num_layers = if m.model_type().starts_with("gemma4") {
        usize::MAX
    } else {
        3
    };
    let config = AdapterConfig::lora(num_layers, 4);
    Adapters::attach(m, config, 3).unwrap()
}

/// (loss gap bit-identical?, largest gradient gap) between segmented and unsegmented.
fn compare(name: &str, method: &str, segment_size: usize) -> (bool, f32) {
    let m = model(name);
    let adapters = attach(m.as_ref());
    // Nonzero B, so every adapter parameter gets a gradient.
    let params: Vec<Array> = adapters
        .params()
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let key = mlx_rs::random::key(100 + i as u64).unwrap();
            mlx_rs::random::normal::<f32>(p.shape(), None, None, &key)
                .unwrap()
                .multiply(Array::from_f32(0.01))
                .unwrap()
        })
        .collect();
    adapters.set(&params);
    let tok =
        engine::load::tokenizer::Tokenizer::load(&goldens().join("models").join(name)).unwrap();
    let layered = m.as_layered().unwrap();
    let (ids, loss_fn): (Array, LossFn) = match method {
        "sft" => {
            let a = tok
                .encode(
                    "The robot took a spring from the jar and fixed the clock.",
                    true,
                )
                .unwrap();
            let b = tok
                .encode("Mira came back the next week with a music box.", true)
                .unwrap();
            let ex: Vec<engine::train::data::Example> = [a, b]
                .into_iter()
                .map(|tokens| engine::train::data::Example { tokens, offset: 3 })
                .collect();
            let refs: Vec<&_> = ex.iter().collect();
            let (batch, lengths) = engine::train::trainer::sft_batch(&refs, 2048);
            let b2 = batch.clone();
            (
                batch,
                Box::new(move |logits: &Array| {
                    let (l, n) = engine::train::loss::sft_loss(logits, &b2, &lengths)?;
                    Ok(vec![l, n])
                }),
            )
        }
        _ => {
            let enc = |s: &str| tok.encode(s, true).unwrap();
            let prompt = enc("Question: What color is the sky?");
            let mut chosen = prompt.clone();
            chosen.extend(tok.encode(" Answer: The sky is blue.", false).unwrap());
            let mut rejected = prompt.clone();
            rejected.extend(tok.encode(" Answer: The sky is green.", false).unwrap());
            let pair = engine::train::data::Pair {
                prompt_len: prompt.len(),
                chosen,
                rejected,
            };
            let (ids, pm, rm) = pair_batch(&[&pair]);
            let ids2 = ids.clone();
            (
                ids,
                Box::new(move |logits: &Array| {
                    Ok(orpo_from_logits(logits, &ids2, &pm, &rm, 0.1, SftScope::Full)?.into_vec())
                }),
            )
        }
    };
    let t = ids.shape()[1];
    let inputs = ids.index((.., ..t - 1));
    let mut loss_fn = loss_fn;
    // Unsegmented: one value-and-grad over the whole forward.
    let (full_out, full_grads) = engine::train::value_and_grad(&adapters, || {
        let logits = m.forward(
            &inputs,
            &mut engine::cache::none::none_for(&m.make_caches()),
        )?;
        loss_fn(&logits)
    })
    .unwrap();
    let (seg_out, seg_grads) = segmented_value_and_grad(
        layered,
        &adapters,
        &inputs,
        segment_size,
        &mut loss_fn,
        &mut (),
    )
    .unwrap();
    let same_loss = bytes(&full_out[0]) == bytes(&seg_out[0]);
    let gap = full_grads
        .iter()
        .zip(&seg_grads)
        .map(|(a, b)| max_gap(a, b))
        .fold(0.0, f32::max);
    let identical = full_grads
        .iter()
        .zip(&seg_grads)
        .filter(|(a, b)| bytes(a) == bytes(b))
        .count();
    println!(
        "{name} {method} segment {segment_size}: loss identical {same_loss}, \
         {identical}/{} gradients bit-identical, max gradient gap {gap:e}",
        full_grads.len()
    );
    (same_loss, gap)
}

/// Gemma 4 (tiny-gemma4: 6 blocks, layers 3-5 borrow the K/V of 1 (sliding) and 2 (full);
/// per-layer inputs): segments of 1, 2 and 3 blocks put donors and sharers in different
/// segments (at 2, layer 1's K/V pass through the segment of blocks 2-3 to reach 4), SFT
/// and ORPO, the loss and every gradient identical to the whole step. The multimodal
/// wrapper (tiny-gemma4-mm, the same text model) and K = V attention (tiny-gemma4-keqv, no
/// sharing) at one block per segment.
#[test]
fn segmented_gemma4_matches_the_full_step() {
    let cases = [
        ("tiny-gemma4", "sft", 1..=3),
        ("tiny-gemma4", "orpo", 1..=3),
        ("tiny-gemma4-mm", "sft", 1..=1),
        ("tiny-gemma4-keqv", "sft", 1..=1),
    ];
    for (name, method, sizes) in cases {
        for size in sizes {
            let (same, gap) = compare(name, method, size);
            assert!(
                same && gap <= GRAD_BOUND,
                "{name} {method} segment {size}: loss identical {same}, gap {gap:e}"
            );
        }
    }
}

/// Planted: the donor K/V's cotangent dropped at the segment boundaries (the sharers' part
/// of the donors' gradients lost) fails at every segment size that splits donors from
/// their sharers; the hidden state's dropped cotangent fails too.
#[test]
fn planted_dropped_donor_cotangent_fails_on_gemma4() {
    let gaps = {
        let _on = plant::on(Defect::DropCarriedKvCotangent).unwrap();
        [1, 2, 3].map(|size| compare("tiny-gemma4", "sft", size).1)
    };
    assert!(gaps.iter().all(|&gap| gap > GRAD_BOUND), "{gaps:?}");
    let _on = plant::on(Defect::DropCotangent).unwrap();
    let gap = compare("tiny-gemma4", "sft", 1).1;
    assert!(gap > GRAD_BOUND, "{gap:e}");
}

#[test]
fn segmented_sft_matches_the_full_step() {
    for (name, sizes) in [
        ("tiny-llama-trained", 1..=3),
        ("tiny-gemma3", 1..=4),
        // SmolLM 3: its NoPE layer (3 of 4) in a segment of its own, and with the others.
        ("tiny-smollm3", 1..=4),
    ] {
        for size in sizes {
            let (same, gap) = compare(name, "sft", size);
            assert!(
                same && gap <= GRAD_BOUND,
                "{name} segment {size}: loss identical {same}, gap {gap:e}"
            );
        }
    }
}

#[test]
fn segmented_orpo_matches_the_full_step() {
    for (name, sizes) in [("tiny-llama-trained", 1..=2), ("tiny-gemma3", 1..=2)] {
        for size in sizes {
            let (same, gap) = compare(name, "orpo", size);
            assert!(
                same && gap <= GRAD_BOUND,
                "{name} segment {size}: loss identical {same}, gap {gap:e}"
            );
        }
    }
}

/// The models of the LoRA training gate (manifest rows with `train`) that keep a recurrent
/// state (an `ArraysCache`, alone or in a layer's `CacheList`): the hybrids whose LoRA is
/// gated against mlx-lm's trainer, so whose segmented backward is claimed too.
pub(crate) fn trained_hybrids() -> Vec<String> {
    fn recurrent(c: &mut dyn engine::cache::Cache) -> bool {
        c.as_arrays().is_some()
            || c.sub_caches_mut()
                .is_some_and(|parts| parts.iter_mut().any(|p| recurrent(p.as_mut())))
    }
    let rows = common::manifest();
    let trained = rows.iter().filter(|r| {
        let gates = r["gates"].as_array();
        gates.is_some_and(|g| g.iter().any(|g| g == "train"))
    });
    let names = trained.map(|r| r["name"].as_str().unwrap().to_owned());
    let hybrids: Vec<String> = names
        .filter(|n| {
            let m = model(n);
            let mut caches = m.make_caches();
            caches.iter_mut().any(|c| recurrent(c.as_mut()))
        })
        .collect();
    assert!(
        !hybrids.is_empty(),
        "no trained model keeps a recurrent state"
    );
    hybrids
}

/// The hybrids (recurrent mixers: gated delta nets, Mamba-2, short convolutions, beside
/// attention and experts; falcon_h1's Mamba-2 and attention side by side): each segment's blocks run from a zero recurrent state over the
/// whole sequence, as the whole-model forward does, and the cotangent of the hidden state
/// is all that crosses a boundary (no recurrent state crosses: every block's recurrence
/// starts and ends within it). SFT at one and two blocks a segment, ORPO at one; the loss
/// and every gradient identical to the whole step.
#[test]
fn segmented_hybrids_match_the_full_step() {
    for name in trained_hybrids() {
        for (method, size) in [("sft", 1), ("sft", 2), ("orpo", 1)] {
            let (same, gap) = compare(&name, method, size);
            assert!(
                same && gap <= GRAD_BOUND,
                "{name} {method} segment {size}: loss identical {same}, gap {gap:e}"
            );
        }
    }
}

/// Planted: the hidden state's cotangent dropped between segments fails on every hybrid.
#[test]
fn planted_dropped_cotangent_fails_on_the_hybrids() {
    let hybrids = trained_hybrids();
    let gaps: Vec<f32> = {
        let _on = plant::on(Defect::DropCotangent).unwrap();
        hybrids
            .iter()
            .map(|name| compare(name, "sft", 1).1)
            .collect()
    };
    assert!(gaps.iter().all(|&gap| gap > GRAD_BOUND), "{gaps:?}");
}

#[test]
fn planted_dropped_cotangent_fails() {
    let gaps = {
        let _on = plant::on(Defect::DropCotangent).unwrap();
        ["tiny-llama-trained", "tiny-gemma3", "tiny-smollm3"].map(|name| compare(name, "sft", 1).1)
    };
    assert!(gaps.iter().all(|&gap| gap > GRAD_BOUND), "{gaps:?}");
}

/// The training loop takes the segmented backward when `segment_size` is set (it once did
/// not: `--segment-size` was accepted and the whole-model backward ran, so the CLI test of
/// equal adapters could not fail): three steps of `train` with segments of one block end
/// with the whole-model adapters, and with different ones under the planted dropped
/// cotangent.
/// The same on tiny-gemma4, the donor K/V's dropped cotangent planted.
#[test]
fn the_training_loop_runs_the_segmented_backward() {
    training_loop_matches("tiny-llama-trained", Defect::DropCotangent);
    training_loop_matches("tiny-gemma4", Defect::DropCarriedKvCotangent);
}

fn training_loop_matches(name: &str, defect: Defect) {
    use engine::train::optim::{AdamW, Schedule};
    use engine::train::trainer::{train, Dataset, Method, Metrics, TrainConfig};
    let m = model(name);
    let tok =
        engine::load::tokenizer::Tokenizer::load(&goldens().join("models").join(name)).unwrap();
    let data = Dataset::Sft(
        [
            "The robot took a spring from the jar and fixed the clock.",
            "Mira came back the next week with a music box.",
            "The sky is blue and the grass is green.",
            "A girl named Mira came to the workshop.",
        ]
        .iter()
        .map(|s| engine::train::data::Example {
            tokens: tok.encode(s, true).unwrap(),
            offset: 3,
        })
        .collect(),
    );
    let run = |segment_size: Option<usize>, plant: bool| -> Vec<Vec<u8>> {
        let adapters = attach(m.as_ref());
        let cfg = TrainConfig {
            iters: 3,
            segment_size,
            ..crate::common::train::config(Method::Sft)
        };
        let mut opt = AdamW::new(Schedule::Constant(1e-3), 0.01);
        let dir = tempfile::tempdir().unwrap();
        let mut metrics =
            Metrics::create(&dir.path().join("metrics.jsonl"), serde_json::json!({})).unwrap();
        let planted = plant.then(|| plant::on(defect).unwrap());
        let done = train(
            m.as_ref(),
            &adapters,
            &mut opt,
            &data,
            None,
            &cfg,
            &mut metrics,
            dir.path(),
            |_, _| {},
        );
        drop(planted);
        done.unwrap();
        adapters.params().iter().map(bytes).collect()
    };
    let whole = run(None, false);
    assert!(
        whole == run(Some(1), false),
        "{name}: segmented training differs"
    );
    assert!(
        whole != run(Some(1), true),
        "{name}: the planted {defect:?} went unnoticed"
    );
}
