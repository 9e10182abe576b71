//! The tokenizer fixtures as the gates on them use them (`crate::fixtures`): a fixture's
//! dir, or the error naming the command that fetches it; its tokenizer, built once per
//! process; and the check that one of its files is, byte for byte, the one the golden was
//! made from (the golden pins its sha256).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use engine::load::tokenizer::Tokenizer;

use serde_json::Value;
use sha2::{Digest, Sha256};

use super::ParityError;

/// The dir of tokenizer fixture `name`, or the error that says how to fetch it.
pub fn dir(name: &str) -> Result<PathBuf, ParityError> {
    crate::fixtures::tokenizer_dir(name).map_err(|m| ParityError::Usage(m.to_string()))
}

/// The tokenizer of the fixture at `dir`. Building one from a real tokenizer.json takes
/// seconds in a test build and the tokenization and detokenizer gates read the same
/// fixtures, so it is built once per process — while no defect is planted: a planted
/// defect may act while loading, so a planted run always builds its own.
pub fn tokenizer(dir: &Path) -> Result<Arc<Tokenizer>, ParityError> {
    static BUILT: OnceLock<Mutex<HashMap<PathBuf, Arc<Tokenizer>>>> = OnceLock::new();
    if engine::plant::any() {
        return Ok(Arc::new(Tokenizer::load(dir)?));
    }
    let built = BUILT.get_or_init(Default::default);
    if let Some(t) = built.lock().unwrap_or_else(|e| e.into_inner()).get(dir) {
        return Ok(t.clone());
    }
    let t = Arc::new(Tokenizer::load(dir)?);
    built
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(dir.to_owned(), t.clone());
    Ok(t)
}

/// sha256 of `bytes`, lowercase hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// `dir/file` must have the sha256 the golden's `settings.<key>` pins: else the comparison
/// would judge other bytes than the oracle did.
pub fn check_sha(dir: &Path, file: &str, settings: &Value, key: &str) -> Result<(), ParityError> {
    let Some(want) = settings[key].as_str() else {
        return Err(ParityError::Index(format!("settings.{key} missing")));
    };
    let path = dir.join(file);
    let bytes =
        std::fs::read(&path).map_err(|e| ParityError::Usage(format!("{}: {e}", path.display())))?;
    let got = sha256_hex(&bytes);
    match got == want {
        true => Ok(()),
        false => Err(ParityError::Usage(format!(
            "{} has sha256 {got}, the golden was made from {want}: run `{}`",
            path.display(),
            crate::fixtures::FETCH
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_changed_fixture_file_names_the_command() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(tmp.path().join("tokenizer.json"), b"{}").unwrap();
        // sha256 of "{}".
        let sha = "44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a";
        assert_eq!(sha256_hex(b"{}"), sha);
        let ok = serde_json::json!({ "k": sha });
        assert!(check_sha(tmp.path(), "tokenizer.json", &ok, "k").is_ok());
        let stale = serde_json::json!({ "k": "00" });
        let err = check_sha(tmp.path(), "tokenizer.json", &stale, "k")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("run `bash scripts/fetch_fixtures.sh`"),
            "{err}"
        );
        let missing = check_sha(tmp.path(), "tokenizer.json", &ok, "other").unwrap_err();
        assert!(missing.to_string().contains("settings.other missing"));
    }
}
