//! L1 on nemotron_h with Nemotron 3's mixture-of-experts blocks (`E`): tiny-nemotron-h-moe-q4
//! (Nemotron 3 Nano's routing, n_group 1, bf16, mlx-community's stacked and quantized
//! experts) and tiny-nemotron-h-moe-grouped (grouped selection, n_group 2 / topk_group 1, the
//! latent projections, f32, Hugging Face's per-expert layout); part of the `l1_models`
//! binary.

use super::*;

const FIXTURES: [&str; 2] = ["tiny-nemotron-h-moe-q4", "tiny-nemotron-h-moe-grouped"];

/// Planted: the router's weights read from the scores with `e_score_correction_bias`
/// added (the bias meant for the choice only) — every case of both fixtures fails at its
/// prefill. Each passes again after it (the compiled router is traced per plant state, so
/// no trace of the defect outlives it; before it: the L1 gate).
#[test]
fn planted_correction_bias_in_the_weights_fails_l1_on_nemotron_h_moe() {
    for name in FIXTURES {
        {
            let _on = engine::plant::on(engine::plant::Defect::MoeCorrectionBiasWeighted).unwrap();
            assert_fails_at_prefill(&l1(name, None), &format!("bias in the weights on {name}"));
        }
        assert!(
            l1(name, None).passed(),
            "{name}: the plant outlived its guard"
        );
    }
}

/// Planted through the config: routed_scaling_factor dropped (1.0) or the top k left
/// unnormalized on the Nano-style fixture; the grouping dropped (n_group 1) on the grouped
/// one — each breaks every case at its prefill.
#[test]
fn planted_router_config_defects_fail_l1_on_nemotron_h_moe() {
    for (name, plant) in [
        ("tiny-nemotron-h-moe-q4", "routed_scaling_factor=1.0"),
        ("tiny-nemotron-h-moe-q4", "norm_topk_prob=false"),
        ("tiny-nemotron-h-moe-grouped", "n_group=1"),
    ] {
        let report = l1(name, Some(plant));
        assert_fails_at_prefill(&report, &format!("{name} with {plant}"));
    }
}

/// `engine convert -q` of tiny-nemotron-h-moe (Hugging Face's per-expert layout, bf16) writes
/// tiny-nemotron-h-moe-q4's weights byte for byte (mlx_lm.convert -q's, which the convert
/// gate checks too), and the engine loads that output and runs it bit-exact against
/// tiny-nemotron-h-moe-q4's L1 golden.
#[test]
fn engine_convert_output_of_nemotron_h_moe_is_bit_exact_on_l1() {
    use engine::convert::{convert, ConvertArgs};
    use engine::load::template::ChatTemplate;
    use engine::load::tokenizer::Tokenizer;
    use harness::goldens::{model_dir, TensorGolden};
    use harness::parity::l1::{check_model_with, Stop};
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("q4");
    let mut args = ConvertArgs::new(model_dir("tiny-nemotron-h-moe").unwrap(), &out);
    args.quantize = true;
    args.quiet = true;
    convert(&args).unwrap();
    let fixture = model_dir("tiny-nemotron-h-moe-q4").unwrap();
    let written = std::fs::read(out.join("model.safetensors")).unwrap();
    let committed = std::fs::read(fixture.join("model.safetensors")).unwrap();
    assert!(
        written == committed,
        "engine convert -q differs from tiny-nemotron-h-moe-q4"
    );
    let model = engine::model::load(&out).unwrap();
    let tokenizer = Tokenizer::load(&out).unwrap();
    let template = ChatTemplate::from_tokenizer(&tokenizer).unwrap();
    let golden = TensorGolden::open("l1/tiny-nemotron-h-moe-q4").unwrap();
    let report = check_model_with(
        &golden,
        model.as_ref(),
        &tokenizer,
        template.as_ref(),
        2048,
        Stop::AtEnd,
    )
    .unwrap();
    harness::announce(&format!("engine convert -q output: {}", report.summary()));
    assert!(report.passed(), "{}", report.details().join("\n"));
}
