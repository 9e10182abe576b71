//! The quality gates of `harness eval`'s measures, rows `l3-kl` and `eval-ppl` of the gate
//! table (`harness parity --tier l3` / `--tier l1` runs them too), on the committed tiny
//! models (seconds each):
//!
//! - the L3 KL gate: teacher-forced KL(L2 ‖ L3) over the held-out corpus
//!   (goldens/eval/heldout.txt) ≤ 5e-3 nats mean and ≤ 5e-2 max per position, with the perf
//!   path proven to have run, on tiny-gemma4; planted `PerfDequantValueBiasesDropped` (the L3
//!   decode step dequantizes the values without their biases) must fail it. tiny-llama-trained is
//!   not gated: today's L3 is past the bounds there (measured KL(L2 ‖ L3) mean 1.8e-2, max
//!   0.99 nats; its sharp, overfit distributions turn bf16 attention differences into nats;
//!   `harness eval --model tiny-llama-trained` prints them).
//! - the L1 perplexity golden: the engine's perplexity of tiny-llama-trained and tiny-gemma4
//!   on the held-out corpus is mlx_lm.perplexity's (goldens/eval/<model>, oracles/eval_ppl.py),
//!   the same double bit for bit; planted `EvalMeanOnHost` (the mean loss in f64 on the host)
//!   must fail it.

use harness::parity::gates::{Plant, EVAL_PPL, L3, L3_KL};
use harness::parity::quality::{KlGateReport, PplGoldenReport};
use harness::parity::Report;

fn plant(name: &str) -> Plant {
    Plant::parse(name).unwrap()
}

fn kl(name: &str, plant: Option<&Plant>) -> KlGateReport {
    let report = L3_KL.run(name, plant).unwrap();
    harness::announce(&report.summary());
    report.downcast().unwrap()
}

#[test]
fn l3_kl_gate_passes_and_the_perf_path_ran() {
    for name in L3_KL.models() {
        let report = kl(name, None);
        assert!(report.perf_path_steps > 0);
        assert!(report.passed(), "{}", report.summary());
    }
}

#[test]
fn planted_value_bias_defect_fails_the_kl_gate() {
    let planted = plant("value-biases-dropped");
    let report = kl("tiny-gemma4", Some(&planted));
    assert!(report.perf_path_steps > 0);
    assert!(!report.passed(), "{}", report.summary());
    // For the record (not asserted): the argmax envelope lets this defect through on
    // tiny-gemma4 (measured 60/64 and 59/64, ≥ 56 needed) — the KL gate is the finer one.
    let _on = engine::plant::on(engine::plant::Defect::PerfDequantValueBiasesDropped).unwrap();
    let envelope = L3.run("tiny-gemma4", None).unwrap();
    harness::announce(&format!("with the same defect, {}", envelope.summary()));
}

fn ppl(name: &str, plant: Option<&Plant>) -> PplGoldenReport {
    let report = EVAL_PPL.run(name, plant).unwrap();
    harness::announce(&report.summary());
    report.downcast().unwrap()
}

#[test]
fn l1_perplexity_is_mlx_lm_perplexity_bit_for_bit() {
    for name in EVAL_PPL.models() {
        let report = ppl(name, None);
        assert!(report.same_rows, "{}", report.summary());
        assert!(report.passed(), "{}", report.summary());
    }
}

#[test]
fn planted_host_mean_fails_the_perplexity_golden() {
    let planted = plant("eval-mean-on-host");
    let report = ppl("tiny-llama-trained", Some(&planted));
    assert!(!report.passed(), "{}", report.summary());
}
