//! The per-token cost of constrained decoding's mask, without a model: random logits
//! [1, vocab] (vocab: the tokenizer's) go through the sampler with and without a grammar,
//! greedy, each chosen id fed back (so the grammar walks a real path), and the wall time
//! per token is compared. Usage:
//!
//! ```text
//! cargo run --release -p engine --example mask_cost -- TOKENIZER_DIR [TOKENS]
//! ```
//!
//! A quick probe for `engine::constrain` work; the numbers that count come from
//! `harness bench`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use engine::constrain::Grammar;
use engine::generate::sampler::{constrain, Sampler, SamplingParams};
use engine::load::tokenizer::Tokenizer;
use mlx_rs::Array;

fn schema() -> Grammar {
    Grammar::JsonSchema(serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 400},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 40},
            "n": {"type": "integer"}
        },
        "required": ["name", "tags", "n"],
        "additionalProperties": false
    }))
}

/// `tokens` greedy picks over fresh random logits; (time per token, tokens, restarts).
fn run(
    tok: &Arc<Tokenizer>,
    grammar: Option<&Grammar>,
    vocab: i32,
    tokens: usize,
) -> (Duration, usize) {
    let mut sampler = constrain(
        Sampler::new(SamplingParams::default()).unwrap(),
        tok,
        grammar,
    )
    .unwrap();
    let mut history: Vec<u32> = vec![1];
    let mut restarts = 0;
    let key = mlx_rs::random::key(7).unwrap();
    // The logits of each step, made and evaluated before timing (a model's forward).
    let all = mlx_rs::random::normal::<f32>(&[tokens as i32, 1, vocab], None, None, &key).unwrap();
    all.eval().unwrap();
    let rows: Vec<Array> = (0..tokens as i32)
        .map(|i| {
            use mlx_rs::ops::indexing::IndexOp;
            let r = all.index(i);
            r.eval().unwrap();
            r
        })
        .collect();
    let mut total = Duration::ZERO;
    for logits in &rows {
        let t = Instant::now();
        let (id, _) = match sampler.pick(logits, &history) {
            Ok(p) => p,
            Err(_) => {
                // The grammar finished (EOS): start a new answer.
                restarts += 1;
                sampler = constrain(
                    Sampler::new(SamplingParams::default()).unwrap(),
                    tok,
                    grammar,
                )
                .unwrap();
                history = vec![1];
                continue;
            }
        };
        id.eval().unwrap();
        let id = id.as_slice::<u32>()[0];
        total += t.elapsed();
        if tok.eos_token_ids.contains(&id) {
            restarts += 1;
            sampler = constrain(
                Sampler::new(SamplingParams::default()).unwrap(),
                tok,
                grammar,
            )
            .unwrap();
            history = vec![1];
        } else {
            history.push(id);
        }
    }
    (total / tokens as u32, restarts)
}

fn main() {
    let mut args = std::env::args().skip(1);
    let dir = args
        .next()
        .expect("usage: mask_cost TOKENIZER_DIR [TOKENS]");
    let tokens: usize = args.next().map_or(400, |s| s.parse().unwrap());
    let tok = Arc::new(Tokenizer::load(std::path::Path::new(&dir)).unwrap());
    let vocab = tok.vocab_size() as i32;
    let grammar = schema();
    // Warm up (the env and the first grammar compile).
    run(&tok, Some(&grammar), vocab, 20);
    // ABBA: plain, constrained, constrained, plain.
    let (p1, _) = run(&tok, None, vocab, tokens);
    let (c1, r1) = run(&tok, Some(&grammar), vocab, tokens);
    let (c2, r2) = run(&tok, Some(&grammar), vocab, tokens);
    let (p2, _) = run(&tok, None, vocab, tokens);
    let plain = (p1 + p2) / 2;
    let held = (c1 + c2) / 2;
    println!(
        "vocab {vocab}: plain {:.1} µs/token, constrained {:.1} µs/token, mask cost {:.1} µs/token \
         ({tokens} tokens a leg, {} grammar restarts)",
        plain.as_secs_f64() * 1e6,
        held.as_secs_f64() * 1e6,
        (held.as_secs_f64() - plain.as_secs_f64()) * 1e6,
        r1 + r2
    );
}
