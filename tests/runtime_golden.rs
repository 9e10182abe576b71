//! The runtime golden (goldens/runtime, written by oracles/gen_runtime.py from the same MLX
//! wheel) reproduced by Rust bit for bit: seeded RNG, matmul, softmax, rms_norm, SDPA,
//! quantize + quantized_matmul, value_and_grad, bf16/f16 matmul.
//! Run single-threaded (MLX is not thread-safe): `cargo test -- --test-threads=1`.

use harness::goldens::TensorGolden;
use harness::parity::runtime::{check_all, check_case, Tamper, CASES};

fn golden() -> TensorGolden {
    TensorGolden::open("runtime").expect("goldens/runtime is committed")
}

#[test]
fn every_runtime_case_is_bit_exact_with_python_mlx() {
    let golden = golden();
    let reports = check_all(&golden).unwrap();
    for r in &reports {
        println!("{}/{}: {}", r.case, r.tensor, r.comparison);
    }
    let exact = reports.iter().filter(|r| r.comparison.bit_exact).count();
    println!(
        "runtime golden: {exact}/{} tensors bit-exact",
        reports.len()
    );
    assert_eq!(reports.len(), 18, "every golden tensor is checked");
    assert_eq!(exact, reports.len(), "all tensors bit-exact (max |Δ| = 0)");
}

/// Planted defect: one input value changed (+1) must break every case's gate in an output
/// tensor (not just in the stored input), and the report must say where.
#[test]
fn changing_one_input_value_fails_the_gate() {
    let golden = golden();
    for case in CASES {
        let reports = check_case(&golden, case, Tamper::FirstInputValue).unwrap();
        let broken: Vec<_> = reports.iter().filter(|r| !r.comparison.bit_exact).collect();
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
