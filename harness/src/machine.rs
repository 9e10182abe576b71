//! The machine key: which machine a golden or a number belongs to. Backend + device name,
//! lowercased, runs of non-alphanumerics turned into '-' (e.g. `cpu-amd-epyc`,
//! `cuda-nvidia-h200`, `apple-m4-pro`); `HARNESS_MACHINE` overrides it. The oracle scripts
//! apply the same rule (oracles/provenance.py).

use std::process::Command;

/// Lowercase, drop (R)/(TM)/(C) marks, and turn runs of other characters into '-'.
pub fn slug(text: &str) -> String {
    let lower = text
        .to_lowercase()
        .replace("(r)", "")
        .replace("(tm)", "")
        .replace("(c)", "");
    let mut out = String::new();
    for c in lower.chars() {
        if c.is_ascii_alphanumeric() {
            out.push(c);
        } else if !out.is_empty() && !out.ends_with('-') {
            out.push('-');
        }
    }
    out.trim_end_matches('-').to_owned()
}

fn cpu_name() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_owned())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_owned())
}

fn command_line(program: &str, args: &[&str]) -> Option<String> {
    let out = Command::new(program).args(args).output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let first = text.lines().next()?.trim().to_owned();
    (out.status.success() && !first.is_empty()).then_some(first)
}

/// This machine's key, for the backend the engine was built with.
pub fn machine_key() -> String {
    if let Ok(key) = std::env::var("HARNESS_MACHINE") {
        if !key.is_empty() {
            return key;
        }
    }
    match engine::runtime::backend() {
        "cuda" => {
            let gpu = command_line("nvidia-smi", &["--query-gpu=name", "--format=csv,noheader"]);
            slug(&format!("cuda {}", gpu.as_deref().unwrap_or("gpu")))
        }
        "metal" => slug(
            &command_line("sysctl", &["-n", "machdep.cpu.brand_string"])
                .unwrap_or_else(|| "apple".to_owned()),
        ),
        _ => slug(&format!("cpu {}", cpu_name())),
    }
}

#[cfg(test)]
mod tests {
    use super::slug;

    #[test]
    fn slugs_match_the_documented_examples() {
        assert_eq!(
            slug("cpu Intel(R) Xeon(R) Processor"),
            "cpu-intel-xeon-processor"
        );
        assert_eq!(slug("cuda NVIDIA H200"), "cuda-nvidia-h200");
        assert_eq!(slug("Apple M4 Pro"), "apple-m4-pro");
        assert_eq!(slug("cpu AMD EPYC"), "cpu-amd-epyc");
    }
}
