//! `--memory-budget`'s value: bytes, a share of physical memory or `auto`; and what the
//! system says of its memory (Linux /proc, macOS sysctl).

/// `auto`: this share of physical memory (docs/serve.md says why).
pub const AUTO_PERCENT: f64 = 75.0;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SpecError {
    #[error(
        "--memory-budget {0:?}: not a size; accepted forms: bytes (123456), bytes with a unit \
         (6GB, 6GiB, 512MiB, 1.5G: KB/MB/GB/TB are powers of 1000, K/M/G/T and KiB/MiB/GiB/TiB \
         powers of 1024), a share of physical memory (70%), or auto ({AUTO_PERCENT}% of \
         physical memory)"
    )]
    Syntax(String),
    #[error("--memory-budget {0:?}: a share of physical memory must be over 0% and at most 100%")]
    Percent(String),
    #[error("--memory-budget {0:?}: must be more than 0 bytes")]
    Zero(String),
    #[error(
        "--memory-budget {0}: this system's physical memory size cannot be read \
         (/proc/meminfo or sysctl hw.memsize); give the budget in bytes, e.g. 6GB"
    )]
    NoPhysical(String),
}

/// A parsed `--memory-budget`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Spec {
    Bytes(u64),
    Percent(f64),
    Auto,
}

/// Parses `BYTES|PERCENT|auto` (see `SpecError::Syntax` for the forms).
pub fn parse(text: &str) -> Result<Spec, SpecError> {
    let t = text.trim();
    let syntax = || SpecError::Syntax(text.to_owned());
    if t.eq_ignore_ascii_case("auto") {
        return Ok(Spec::Auto);
    }
    if let Some(p) = t.strip_suffix('%') {
        let v: f64 = p.trim().parse().map_err(|_| syntax())?;
        if !(v.is_finite() && v > 0.0 && v <= 100.0) {
            return Err(SpecError::Percent(text.to_owned()));
        }
        return Ok(Spec::Percent(v));
    }
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let unit = unit.trim();
    let scale: u64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        _ => return Err(syntax()),
    };
    if number.is_empty() || number == "." {
        return Err(syntax());
    }
    let bytes = if number.contains('.') {
        let v: f64 = number.parse().map_err(|_| syntax())?;
        let b = v * scale as f64;
        if !(b.is_finite() && b < u64::MAX as f64) {
            return Err(syntax());
        }
        b as u64
    } else {
        let v: u64 = number.parse().map_err(|_| syntax())?;
        v.checked_mul(scale).ok_or_else(syntax)?
    };
    if bytes == 0 {
        return Err(SpecError::Zero(text.to_owned()));
    }
    Ok(Spec::Bytes(bytes))
}

impl Spec {
    /// The budget in bytes, given physical memory (None: unknown).
    pub fn resolve(self, text: &str, physical: Option<u64>) -> Result<u64, SpecError> {
        let share = |p: f64| {
            physical
                .map(|m| (m as f64 * p / 100.0) as u64)
                .ok_or_else(|| SpecError::NoPhysical(text.to_owned()))
        };
        match self {
            Spec::Bytes(b) => Ok(b),
            Spec::Percent(p) => share(p),
            Spec::Auto => share(AUTO_PERCENT),
        }
    }
}

/// `--memory-budget` as bytes (None: no budget).
pub fn from_flag(flag: Option<&str>) -> Result<Option<u64>, SpecError> {
    flag.map(|text| parse(text)?.resolve(text, physical_memory()))
        .transpose()
}

/// Physical memory in bytes: Linux's /proc/meminfo MemTotal, macOS's `sysctl hw.memsize`.
pub fn physical_memory() -> Option<u64> {
    if let Ok(info) = std::fs::read_to_string("/proc/meminfo") {
        return meminfo_field(&info, "MemTotal:");
    }
    let out = std::process::Command::new("sysctl")
        .args(["-n", "hw.memsize"])
        .output()
        .ok()?;
    String::from_utf8(out.stdout).ok()?.trim().parse().ok()
}

/// A `kB` field of /proc/meminfo or /proc/self/status, in bytes.
fn meminfo_field(text: &str, key: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with(key))?;
    let kb: u64 = line[key.len()..].split_whitespace().next()?.parse().ok()?;
    Some(kb * 1024)
}

/// The process's peak resident set (Linux's VmHWM; None elsewhere).
pub fn peak_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    meminfo_field(&status, "VmHWM:")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_in_every_accepted_form() {
        assert_eq!(parse("123456"), Ok(Spec::Bytes(123_456)));
        assert_eq!(parse("6GB"), Ok(Spec::Bytes(6_000_000_000)));
        assert_eq!(parse("6GiB"), Ok(Spec::Bytes(6 << 30)));
        assert_eq!(parse("6g"), Ok(Spec::Bytes(6 << 30)));
        assert_eq!(parse("512MiB"), Ok(Spec::Bytes(512 << 20)));
        assert_eq!(parse("512 MB"), Ok(Spec::Bytes(512_000_000)));
        assert_eq!(parse("1.5G"), Ok(Spec::Bytes(3 << 29)));
        assert_eq!(parse("10b"), Ok(Spec::Bytes(10)));
        assert_eq!(parse("70%"), Ok(Spec::Percent(70.0)));
        assert_eq!(parse("AUTO"), Ok(Spec::Auto));
    }

    #[test]
    fn bad_sizes_are_refused_naming_the_accepted_forms() {
        for bad in [
            "",
            "GB",
            "6XB",
            "-5",
            "1e9",
            "six",
            ".",
            "99999999999999999999",
        ] {
            let e = parse(bad).unwrap_err();
            assert!(matches!(e, SpecError::Syntax(_)), "{bad}: {e:?}");
            assert!(e.to_string().contains("70%"), "{e}");
        }
        assert!(matches!(parse("0"), Err(SpecError::Zero(_))));
        assert!(matches!(parse("0%"), Err(SpecError::Percent(_))));
        assert!(matches!(parse("101%"), Err(SpecError::Percent(_))));
        assert!(matches!(parse("nan%"), Err(SpecError::Percent(_))));
    }

    #[test]
    fn shares_resolve_against_physical_memory() {
        assert_eq!(Spec::Percent(50.0).resolve("50%", Some(1000)), Ok(500));
        assert_eq!(Spec::Auto.resolve("auto", Some(1000)), Ok(750));
        assert!(matches!(
            Spec::Auto.resolve("auto", None),
            Err(SpecError::NoPhysical(_))
        ));
        assert!(physical_memory().is_some_and(|m| m > 0));
    }
}
