//! The `harness` binary end to end: gates exit non-zero on failure and say where.

use std::process::Command;

fn harness() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_harness"));
    // Never touch the user's results DB from tests.
    c.env(
        "HARNESS_DB",
        std::env::temp_dir().join(format!("harness-cli-test-{}.sqlite", std::process::id())),
    );
    c
}

#[test]
fn parity_passes_on_committed_goldens_and_a_planted_defect_exits_non_zero() {
    let ok = harness()
        .args(["parity", "--model", "tiny-qwen3", "--no-record"])
        .output()
        .unwrap();
    let text = String::from_utf8(ok.stdout).unwrap();
    assert!(ok.status.success(), "{text}");
    assert!(
        text.contains("L1 tiny-qwen3: 85/85 logit vectors bit-exact"),
        "{text}"
    );

    let bad = harness()
        .args([
            "parity",
            "--model",
            "tiny-qwen3",
            "--no-record",
            "--plant",
            "rms_norm_eps=1e-5",
        ])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    let text = String::from_utf8(bad.stdout).unwrap();
    assert!(text.contains("first inexact logits at step 0"), "{text}");
    assert!(String::from_utf8(bad.stderr)
        .unwrap()
        .contains("L1 failed for: tiny-qwen3"));
}

#[test]
fn goldens_check_passes_and_list_shows_layers() {
    let out = harness().args(["goldens", "check"]).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let out = harness()
        .args(["goldens", "list"])
        .env("HARNESS_MACHINE", "nobody-here")
        .output()
        .unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains("machine key nobody-here") && text.contains("reference"),
        "{text}"
    );
}

/// The rank commands' timeout flags are read as the engine's are: `inf`, `1e300`, NaN or 0
/// is a usage error (exit 2) naming the bound, not a panic in `Duration` once the rank
/// starts (issue 43's leftover; it panicked with 101 before).
#[test]
fn rank_timeouts_past_a_week_are_usage_errors_not_panics() {
    for (command, flag) in [
        (&["dist-rank", "l1"][..], "--dist-connect-timeout"),
        (&["dist-rank", "l1"][..], "--dist-timeout"),
        (&["leg-dist"][..], "--dist-timeout"),
    ] {
        for value in ["inf", "1e300", "NaN", "0"] {
            let out = harness()
                .args(command)
                .args([flag, value])
                .output()
                .unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(
                out.status.code(),
                Some(2),
                "{command:?} {flag} {value}: {err}"
            );
            assert!(
                err.contains("at most 604800 (a week)"),
                "{command:?} {flag} {value}: {err}"
            );
        }
    }
}
