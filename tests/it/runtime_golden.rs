//! The runtime golden (`gates::RUNTIME`: goldens/runtime, written by oracles/gen_runtime.py
//! from the same MLX wheel) reproduced by Rust bit for bit: seeded RNG, matmul, softmax,
//! rms_norm, SDPA, quantize + quantized_matmul, value_and_grad, bf16/f16 matmul.
//! Run single-threaded (MLX is not thread-safe): `cargo test -- --test-threads=1`.

use harness::parity::gates::{Plant, Target, Tweak, RUNTIME};
use harness::parity::runtime::{RuntimeReport, CASES};
use harness::parity::Report;

#[test]
fn every_runtime_case_is_bit_exact_with_python_mlx() {
    let report: RuntimeReport = RUNTIME.run("", None).unwrap().downcast().unwrap();
    for r in &report.tensors {
        println!("{}/{}: {}", r.case, r.tensor, r.comparison);
    }
    println!("{}", report.summary());
    let exact = report
        .tensors
        .iter()
        .filter(|r| r.comparison.bit_exact)
        .count();
    assert_eq!(report.tensors.len(), 18, "every golden tensor is checked");
    assert_eq!(exact, 18, "all tensors bit-exact (max |Δ| = 0)");
    assert!(report.passed());
}

/// Planted defect: one input value changed (+1) must break every case's gate in an output
/// tensor (not just in the stored input), and the report must say where.
#[test]
fn changing_one_input_value_fails_the_gate() {
    let plant = Plant::Harness(Tweak::FirstInput);
    for case in CASES {
        let target = Target {
            case: Some(case),
            ..Target::new("")
        };
        let report = RUNTIME.run_target(&target, Some(&plant)).unwrap();
        let report: RuntimeReport = report.downcast().unwrap();
        let broken: Vec<_> = report
            .tensors
            .iter()
            .filter(|r| !r.comparison.bit_exact)
            .collect();
        assert!(
            broken
                .iter()
                .any(|r| !["a", "b", "x", "w", "a_bf16", "a_f16"].contains(&r.tensor.as_str())),
            "case {case}: a changed input did not change any output"
        );
        for r in &broken {
            assert!(
                r.comparison.first_mismatch.is_some(),
                "{case}/{}: no location",
                r.tensor
            );
        }
        println!(
            "{case}: tampered input caught in {} tensor(s)",
            broken.len()
        );
    }
}
