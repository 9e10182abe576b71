//! A prompt-cache hit continues exactly as a fresh prefill would: the caches of a finished
//! conversation turn, trimmed to the common prefix, then the rest of the next prompt
//! prefilled, give bit-identical log-probabilities at every step to prefilling the whole
//! next prompt from scratch (plain and rotating caches). Planted defect: reusing one token
//! too many (no trim) must show.

use crate::common;

use common::{greedy_run, model};

use engine::cache::prompt::PromptCache;
use engine::generate::{Session, SessionOptions};

fn continuation_matches_fresh(name: &str, plant_extra_reuse: bool) -> bool {
    let m = model(name);
    let opts = SessionOptions::default();
    let turn1: Vec<u32> = (3..40).map(|i| (i * 7 % 900) as u32 + 10).collect();
    let mut first = Session::with_options(m.as_ref(), &opts);
    let (answer, _) = greedy_run(&mut first, &turn1, 0, 12);
    let fed = first.caches[0].offset() as usize;
    let mut tokens = turn1.clone();
    tokens.extend(&answer);
    tokens.truncate(fed);
    let mut pc = PromptCache::new(4, None);
    let _ = pc.put("", tokens, std::mem::take(&mut first.caches));
    drop(first);

    let mut turn2 = turn1.clone();
    turn2.extend(&answer);
    turn2.extend([5u32, 17, 99, 230, 41]);
    let hit = pc.take("", &turn2).expect("a hit");
    assert!(hit.reused >= turn1.len(), "reused {}", hit.reused);
    let mut caches = hit.caches;
    let mut reused = hit.reused;
    if plant_extra_reuse {
        // Planted defect: claim one more cached token than the caches hold.
        reused += 1;
    } else {
        assert_eq!(caches[0].offset() as usize, reused);
    }
    let mut resumed = Session::with_caches(m.as_ref(), &opts, std::mem::take(&mut caches));
    let (ids_hit, lps_hit) = greedy_run(&mut resumed, &turn2, reused, 24);
    let mut fresh = Session::with_options(m.as_ref(), &opts);
    let (ids_fresh, lps_fresh) = greedy_run(&mut fresh, &turn2, 0, 24);
    ids_hit == ids_fresh && lps_hit == lps_fresh
}

#[test]
fn a_cache_hit_continues_bit_identically_to_a_fresh_prefill() {
    for name in ["tiny-llama-trained", "tiny-gemma3"] {
        assert!(continuation_matches_fresh(name, false), "{name}");
    }
}

/// The families added for real checkpoints: mixture of experts, the multimodal wrappers,
/// phi3's fused projections, yarn RoPE. Not dynamic RoPE: it recomputes its base per call
/// from the call's last position (as mlx-lm's DynamicNTKScalingRoPE), so a continuation
/// from a cache is a different computation from one prefill of the whole prompt — in
/// mlx-lm too — and the two differ (`dynamic_rope_continuations_depend_on_the_split`).
/// Gemma 4's mixture of experts on its bf16 q4 fixture: the float32 tiny-gemma4-moe's
/// continuations differ from one prefill in the last bits in mlx-lm as well (up to 6e-6
/// after single-token decode steps, as do tiny-gemma3 and tiny-gemma4 cast to float32), so
/// that fixture cannot show bit-identity.
#[test]
fn a_cache_hit_continues_bit_identically_on_the_newer_families() {
    for name in [
        "tiny-ministral3",
        "tiny-glm4-moe",
        "tiny-olmo2",
        "tiny-qwen3-moe",
        "tiny-mixtral",
        "tiny-qwen2-moe",
        "tiny-gemma3-mm",
        "tiny-gemma4-mm",
        "tiny-phi3",
        "tiny-llama-yarn",
        // gpt-oss on its bf16 fixture: the float32 tiny-gpt-oss continues up to 3e-6 away
        // from one prefill in mlx-lm as well.
        "tiny-gpt-oss-mxfp4",
        "tiny-gemma4-moe-q4",
    ] {
        assert!(continuation_matches_fresh(name, false), "{name}");
    }
}

/// The hybrids (recurrent states in ArraysCaches beside K/V caches, or with them in one
/// layer's CacheList in falcon_h1, or beside Nemotron 3's cacheless mixture-of-experts
/// blocks): a recurrent state cannot be trimmed, so an entry is reused only where the next
/// prompt extends exactly the tokens it holds (as mlx_lm.server does), and then continues
/// bit-identically.
#[test]
fn a_cache_hit_continues_bit_identically_on_the_hybrids() {
    for name in common::HYBRIDS.into_iter().chain(common::LIST_HYBRIDS) {
        assert!(continuation_matches_fresh(name, false), "{name}");
    }
    // Planted: one token more claimed than the states consumed.
    for name in ["tiny-qwen3-5", "tiny-falcon-h1", "tiny-nemotron-h-moe-q4"] {
        assert!(!continuation_matches_fresh(name, true), "{name}");
    }
}

#[test]
fn planted_off_by_one_reuse_is_caught() {
    assert!(!continuation_matches_fresh("tiny-llama-trained", true));
}

#[test]
fn dynamic_rope_continuations_depend_on_the_split() {
    assert!(!continuation_matches_fresh("tiny-llama-dynamic", false));
}
