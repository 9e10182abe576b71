//! L1 on the multi-head latent attention families (`engine/src/model/mla.rs`): DeepSeek-V3
//! and the models built on it. Each fixture's clean run is part of `every_l1_model_is_bit_exact`;
//! here the planted defects, each of which must break every case at its prefill.

use super::*;

/// The MLA fixtures whose query has a rope half (all of them).
const FIXTURES: [&str; 6] = [
    "tiny-deepseek-v3",
    "tiny-deepseek-v3-q4",
    "tiny-deepseek-v32",
    "tiny-glm4-moe-lite",
    "tiny-kimi-k25",
    "tiny-minicpm3",
];

/// Planted: RoPE rotates the front of each query head (part of its nope half) and the rope
/// half is read unrotated. Each fixture passes again after the guard (and before it: the
/// L1 gate, `every_l1_model_is_bit_exact`).
#[test]
fn planted_rope_on_the_wrong_half_fails_l1_on_mla() {
    for name in FIXTURES {
        {
            let _on = engine::plant::on(engine::plant::Defect::MlaRopeOnWrongHalf).unwrap();
            assert_fails_at_prefill(
                &l1(name, None),
                &format!("rope on the wrong half on {name}"),
            );
        }
        assert!(
            l1(name, None).passed(),
            "{name}: the plant outlived its guard"
        );
    }
}

/// Planted through the config: the group-limited routing off by a group count — no grouping
/// (n_group 1) or four groups of two (n_group 4) where the checkpoint has two of four.
#[test]
fn planted_group_routing_defects_fail_l1_on_deepseek_v3() {
    for plant in ["n_group=1", "n_group=4"] {
        let report = l1("tiny-deepseek-v3", Some(plant));
        assert_fails_at_prefill(&report, &format!("tiny-deepseek-v3 with {plant}"));
    }
}

/// Planted through the config: GLM-4.7-Flash's routed_scaling_factor dropped to DeepSeek's
/// default (1.0); Kimi K2.5's text model keeping one group of its four where it keeps two
/// (topk_group 2: group routing off by one group).
#[test]
fn planted_router_config_defects_fail_l1_on_glm4_moe_lite_and_kimi_k25() {
    for (name, plant) in [
        ("tiny-glm4-moe-lite", "routed_scaling_factor=1.0"),
        ("tiny-kimi-k25", "text_config.topk_group=1"),
    ] {
        let report = l1(name, Some(plant));
        assert_fails_at_prefill(&report, &format!("{name} with {plant}"));
    }
}

/// Planted through the config: MiniCPM 3's scalings — the residual branches' scale_depth
/// (1.0 for 1.4) and the head's input divisor hidden / dim_model_base (64 for 256).
#[test]
fn planted_scaling_defects_fail_l1_on_minicpm3() {
    for plant in ["scale_depth=1.0", "dim_model_base=64"] {
        let report = l1("tiny-minicpm3", Some(plant));
        assert_fails_at_prefill(&report, &format!("tiny-minicpm3 with {plant}"));
    }
}

/// DeepSeek-V3.2's indexer, planted: its scores not clamped at zero (`IndexerReluDropped`),
/// and by config one position more per query (index_topk 4 for 3) or none dropped at all
/// (index_topk 4096: the indexer never selects). Each breaks every case at its prefill, so
/// the fixture's prompts are attended sparsely from the first step.
#[test]
fn planted_indexer_defects_fail_l1_on_deepseek_v32() {
    let name = "tiny-deepseek-v32";
    {
        let _on = engine::plant::on(engine::plant::Defect::IndexerReluDropped).unwrap();
        assert_fails_at_prefill(
            &l1(name, None),
            &format!("the indexer's ReLU dropped on {name}"),
        );
    }
    assert!(
        l1(name, None).passed(),
        "{name}: the plant outlived its guard"
    );
    for plant in ["index_topk=4", "index_topk=4096"] {
        let report = l1(name, Some(plant));
        assert_fails_at_prefill(&report, &format!("{name} with {plant}"));
    }
}

/// Chunked prefill (mlx-lm's prefill_step_size) of 5 and 16 tokens stays bit-exact on every
/// MLA fixture: later chunks attend over a cache that already holds positions (the causal
/// mask and the rope at an offset), and on deepseek_v32 the indexer selects over keys cached
/// by earlier chunks. Each case over its compared steps (as `chunked_prefill_is_bit_exact`).
/// Checked against the standard goldens: for chunks of more than one token
/// mlx-lm's own logits do not change (its goldens made with prefill_step_size 5 equaled them
/// byte for byte on tiny-deepseek-v3 and -v32).
#[test]
fn chunked_prefill_is_bit_exact_on_mla() {
    use harness::parity::l1::Stop;
    for name in FIXTURES {
        super::assert_chunked_runs_pass(name, "", &[5, 16], Stop::AtLastComparedLogits);
    }
}

/// One-token prefill steps take MLA's absorbed path (the query through `embed_q`, the output
/// through `unembed_out`), whose rounding differs from the prefill's expanded one — in
/// mlx-lm too (up to 1.5e-6 from the standard goldens) — so they are checked against mlx-lm
/// prefilling one token at a time (`l1/<model>-prefill1`, prefill_step_size 1).
#[test]
fn one_token_prefill_steps_are_bit_exact_on_mla() {
    use harness::goldens::TensorGolden;
    for name in ["tiny-deepseek-v3", "tiny-deepseek-v32"] {
        let golden = TensorGolden::open(&format!("l1/{name}-prefill1")).unwrap();
        let report = harness::parity::l1::run(
            name,
            &golden,
            |_| {},
            |_| {},
            harness::parity::l1::Stop::AtEnd,
        )
        .unwrap();
        harness::announce(&report.summary());
        assert!(report.passed(), "{}", report.details().join("\n"));
    }
}
