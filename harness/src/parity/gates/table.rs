//! The table itself: one static per gate (its tier, goldens, generator, models, cases,
//! plants and run), and `GATES`, the order `harness parity` runs them in.

use super::*;
use crate::parity::runtime::Tamper;
use crate::parity::{
    batch, detok, l1, l2, l3, quality, runtime, sampling, spec, spec_l2, tokenize, train, vocab,
};

const BASE: Gate = Gate {
    name: "",
    tier: Tier::L1,
    group: "",
    suffix: "",
    generator: None,
    live: false,
    models: Models::Manifest,
    fixtures: Models::Manifest,
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
    models: Models::Listed(&[
        "vocab-qwen3",
        "vocab-qwen3-5",
        "vocab-qwen3-next",
        "vocab-gemma3",
        "vocab-llama3.1",
        "vocab-mistral-v3",
    ]),
    plants: &["argmax-first-64k"],
    on_fixtures: true,
    run: |g, t, _| boxed(vocab::run(t.model, &g.open_index(t)?.index)),
    ..BASE
};

/// L1 on one 4,096-token prompt (`gen_l1.py --long 4096`, prefilled in mlx-lm's chunks of
/// 2048): recurrent states carried across prefill chunks and across the scans' own chunks
/// (the hybrids' mixer kinds).
pub static L1_LONG: Gate = Gate {
    name: "l1-long",
    group: "l1",
    suffix: "-long",
    generator: Some((
        "gen_l1.py",
        &["{model}", "--long", "4096", "--suffix=-long"],
    )),
    live: true,
    plants: &["KEY=VALUE"],
    run: |g, t, p| boxed(run_l1(g, t, p)),
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
    plants: &["sdpa=optiq-fused"],
    run: |g, t, p| boxed(run_l1(g, t, p).map(l1::KvBits)),
    ..BASE
};

pub static BATCH: Gate = Gate {
    name: "batch",
    group: "batch",
    generator: Some(("gen_batch.py", &["{model}"])),
    cases: &["b2", "b4", "joinleave", "ring"],
    plants: &[
        "unmasked-padding",
        "moe-top-k-off-by-one",
        "ring-mask-unrolled",
        "state-rows-unfiltered",
    ],
    run: |g, t, _| boxed(batch::run(t.model, &g.open(t)?, t.case)),
    ..BASE
};

/// The B=N gate over quantized KV: the batch against each row's single-sequence
/// `generate_step(kv_bits=4)` run (mlx-lm has no quantized batch cache).
pub static BATCH_KV4: Gate = Gate {
    name: "batch-kv4",
    group: "batch",
    suffix: "-kv4",
    generator: Some((
        "gen_batch.py",
        &[
            "{model}",
            "--kv-bits",
            "4",
            "--kv-group-size",
            "32",
            "--suffix=-kv4",
        ],
    )),
    cases: &["b2", "b4", "joinleave", "ring"],
    plants: &["unmasked-padding", "batch-kv-biases-dropped"],
    run: |g, t, _| boxed(batch::run(t.model, &g.open(t)?, t.case)),
    ..BASE
};

pub static SPEC: Gate = Gate {
    name: "spec",
    group: "spec",
    generator: Some(("gen_spec.py", &["{model}"])),
    plants: &["keep-draft-tail", "target-trim-short"],
    run: |g, t, _| boxed(spec::run(t.model, &g.open(t)?, t.case)),
    ..BASE
};

pub static DETOK: Gate = Gate {
    name: "detok",
    group: "detok",
    generator: Some(("gen_detok.py", &["{model}"])),
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
    models: Models::Listed(&REAL_TOKENIZERS),
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
const REAL_TOKENIZERS: [&str; 11] = crate::fixtures::TOKENIZERS;

/// Tokenization vs transformers on the real tokenizers: ids and decoded text.
pub static TOKENIZE: Gate = Gate {
    name: "tokenize",
    group: "tokenize",
    generator: Some(("gen_tokenize.py", &["{model}"])),
    models: Models::Listed(&REAL_TOKENIZERS),
    plants: &[
        "no-post-processor",
        "tokenizer-class-ignored",
        "every-class-llama",
    ],
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
    models: Models::Listed(&[
        "qwen3",
        "gemma3",
        "llama3.1",
        "llama3.2",
        "deepseek-v3",
        "pyisms",
    ]),
    plants: &[
        "tojson-html-escape",
        "template-kwargs-dropped",
        "template-special-tokens-dropped",
    ],
    on_fixtures: true,
    run: |g, t, _| boxed(crate::parity::templates::run(t.model, &g.open_index(t)?)),
    ..BASE
};

pub static TRAIN: Gate = Gate {
    name: "train",
    group: "train",
    generator: Some(("gen_train.py", &["{model}"])),
    plants: &[
        "weight-decay",
        "recurrent-in-proj-lora-dropped",
        "mla-latent-proj-lora-dropped",
        "qlora-dequantized-base",
    ],
    run: run_train,
    ..BASE
};

/// The training gates' run: the harness's own plant (weight decay × 1.1) or none.
fn run_train(g: &Gate, t: &Target, p: Option<&Plant>) -> Result<Box<dyn Report>> {
    let decay = p == Some(&Plant::Harness(Tweak::WeightDecay));
    boxed(train::run(t.model, &g.open(t)?, |opt| {
        if decay {
            opt.weight_decay *= 1.1;
        }
    }))
}

/// DoRA (`--fine-tune-type dora`, mlx-lm's `DoRALinear`) through the same steps as `train`,
/// on a dense and on quantized bases: goldens/train/<model>-dora.
pub static TRAIN_DORA: Gate = Gate {
    name: "train-dora",
    group: "train",
    suffix: "-dora",
    generator: Some((
        "gen_train.py",
        &["{model}", "--fine-tune-type", "dora", "--suffix=-dora"],
    )),
    plants: &["weight-decay", "dora-norm-with-gradient"],
    run: run_train,
    ..BASE
};

/// Full fine-tuning (`--fine-tune-type full`: every weight of the last block) through the
/// same steps as `train`: goldens/train/<model>-full.
pub static TRAIN_FULL: Gate = Gate {
    name: "train-full",
    group: "train",
    suffix: "-full",
    generator: Some((
        "gen_train.py",
        &["{model}", "--fine-tune-type", "full", "--suffix=-full"],
    )),
    // Not the weight-decay plant: on bf16 weights 1 − lr·wd rounds to 1 either way.
    plants: &["full-one-layer-too-many"],
    run: run_train,
    ..BASE
};

pub static SAMPLING: Gate = Gate {
    name: "sampling",
    group: "sampling",
    generator: Some(("gen_sampling.py", &["{model}"])),
    live: true,
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
    plants: &["sdpa=mlx-lm", "kv_start=N"],
    run: |g, t, p| {
        boxed(l2::run(
            t.model,
            &g.open(t)?,
            |o| Plant::options(p, o),
            stop(p),
        ))
    },
    ..BASE
};

pub static SPEC_L2: Gate = Gate {
    name: "spec-l2",
    tier: Tier::L2,
    group: "spec-l2",
    generator: Some(("gen_spec_l2.py", &[])),
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
    plants: &["head-from-flags", "centroid-top-k-short"],
    run: |g, t, _| boxed(spec_l2::run_drafter(t.model, &g.open(t)?, t.case)),
    ..BASE
};

/// Frozen from our own L2 engine by `harness freeze-perf-oracle`, not by an oracle script.
pub static L3: Gate = Gate {
    name: "l3",
    tier: Tier::L3,
    group: "l3",
    plants: &["perf-path", "sdpa=optiq-fused"],
    run: |g, t, p| {
        boxed(l3::check(t.model, &g.open_index(t)?, |o| {
            Plant::options(p, o)
        }))
    },
    ..BASE
};

/// The L3 KL gate (`parity::quality`): teacher-forced KL(L2 ‖ L3) over the held-out corpus
/// within the seed's bounds, the perf path proven to have run; no goldens (both tiers run
/// live).
pub static L3_KL: Gate = Gate {
    name: "l3-kl",
    tier: Tier::L3,
    group: "eval",
    plants: &["value-biases-dropped"],
    run: |_, t, _| boxed(quality::l3_kl(t.model).map_err(ParityError::from)),
    ..BASE
};

/// The L1 perplexity: the engine's is mlx_lm.perplexity's, the same double.
pub static EVAL_PPL: Gate = Gate {
    name: "eval-ppl",
    group: "eval",
    generator: Some(("eval_ppl.py", &["--golden", "{model}"])),
    plants: &["eval-mean-on-host"],
    run: |_, t, _| boxed(quality::ppl_golden(t.model).map_err(ParityError::from)),
    ..BASE
};

/// Every gate, in the order `harness parity` runs them.
pub static GATES: &[&Gate] = &[
    &RUNTIME,
    &L1,
    &L1_VOCAB,
    &L1_LONG,
    &KV_BITS,
    &BATCH,
    &BATCH_KV4,
    &SPEC,
    &DETOK,
    &DETOK_REAL,
    &TOKENIZE,
    &TEMPLATES,
    &TRAIN,
    &TRAIN_DORA,
    &TRAIN_FULL,
    &SAMPLING,
    &EVAL_PPL,
    &L2,
    &SPEC_L2,
    &SPEC_L2_HEADS,
    &L3,
    &L3_KL,
];

fn boxed<R: Report>(report: Result<R>) -> Result<Box<dyn Report>> {
    Ok(Box::new(report?))
}

/// How far a run goes: a run with a planted defect (given here, or switched on around the
/// run) only has to show where each case first differs, so its cases stop there
/// ([`l1::Stop`]); an honest run runs every step.
fn stop(plant: Option<&Plant>) -> l1::Stop {
    match plant.is_some() || engine::plant::any() {
        true => l1::Stop::AtFirstDifference,
        false => l1::Stop::AtEnd,
    }
}

fn run_l1(gate: &Gate, t: &Target, plant: Option<&Plant>) -> Result<l1::ModelReport> {
    let golden = gate.open(t)?;
    l1::run(
        t.model,
        &golden,
        |c| Plant::config(plant, c),
        |o| Plant::options(plant, o),
        stop(plant),
    )
}
