//! L3 (`gates::L3`): our dequantizing one-token decode attention over quantized KV has no
//! oracle; it is gated by the teacher-forced envelope against trajectories frozen from our
//! own L2 engine (goldens/l3/<model>, `harness freeze-perf-oracle`): ≥56/64 argmax agreement
//! on a short and a long prompt, and a counter proving the path ran. Planted defects: a
//! broken perf path, a run where the path never ran, and a stale fingerprint are all
//! refused.

use harness::parity::gates::{Plant, L3};
use harness::parity::l3::L3Report;
use harness::parity::Report;

fn l3(name: &str, plant: Option<&str>) -> L3Report {
    let plant = plant.map(|p| Plant::parse(p).unwrap());
    L3.run(name, plant.as_ref()).unwrap().downcast().unwrap()
}

#[test]
fn l3_envelope_passes_and_the_perf_path_ran() {
    for name in L3.models() {
        let report = l3(name, None);
        harness::announce(&report.summary());
        assert!(report.passed(), "{}", report.summary());
        assert!(report.perf_path_steps > 0);
    }
}

#[test]
fn planted_broken_perf_path_fails_the_envelope() {
    let report = l3("tiny-llama-trained", Some("perf-path"));
    println!("planted L3 defect caught: {}", report.summary());
    assert!(!report.passed());
}

/// Agreement alone is not enough: if the perf path never ran (here: plain L2 options, optiq's
/// fused kernel), the gate must fail even though every id agrees.
#[test]
fn the_envelope_fails_when_the_perf_path_did_not_run() {
    let report = l3("tiny-llama-trained", Some("sdpa=optiq-fused"));
    assert_eq!(report.perf_path_steps, 0);
    assert!(!report.passed(), "{}", report.summary());
}

/// A frozen trajectory whose fingerprint no longer matches the model and KV scheme is
/// refused, not used.
#[test]
fn a_stale_fingerprint_is_refused() {
    let src = harness::goldens::goldens_root();
    let tmp = tempfile::tempdir().unwrap();
    let name = "tiny-llama-trained";
    for sub in [
        format!("models/{name}"),
        format!("l2/{name}"),
        format!("l3/{name}"),
    ] {
        let (from, to) = (src.join(&sub), tmp.path().join(&sub));
        std::fs::create_dir_all(&to).unwrap();
        for entry in std::fs::read_dir(&from).unwrap() {
            let entry = entry.unwrap();
            std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
        }
    }
    std::fs::copy(src.join("REFERENCE"), tmp.path().join("REFERENCE")).unwrap();
    // The KV scheme changes after the freeze: layer 2 now at 8 bits.
    std::fs::write(
        tmp.path().join(format!("l2/{name}/kv_config.json")),
        r#"[{"layer_idx": 0, "bits": 8, "group_size": 32}, {"layer_idx": 2, "bits": 8, "group_size": 32}]"#,
    )
    .unwrap();
    std::env::set_var("HARNESS_GOLDENS", tmp.path());
    let result = L3.run(name, None);
    std::env::remove_var("HARNESS_GOLDENS");
    let err = result.err().expect("a stale frozen oracle must be refused");
    assert!(err.to_string().contains("stale"), "{err}");
}
