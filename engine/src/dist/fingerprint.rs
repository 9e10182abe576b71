//! The first collective of every rank: who it is. A rank started with another model, another
//! engine or MLX build, or another mode would compute different shapes and deadlock (or,
//! worse, agree on shapes and sum garbage), so the ranks compare 64-byte fingerprints and
//! all refuse to go on when any differs.

use std::io::Read;
use std::path::Path;

use mlx_rs::Array;
use sha2::{Digest, Sha256};

use super::{DistError, Mode};

const TAG: &[u8; 4] = b"EDST";
const LEN: usize = 64;

/// [tag 4][mode 1][size 1][rank 2][engine+mlx 24][model 32].
pub struct Fingerprint([u8; LEN]);

/// Bytes of a weight file's data hashed whole up to this size, else in [`SAMPLES`] blocks
/// of [`SAMPLE`] bytes spread evenly from the first byte to the last.
const WHOLE: u64 = 16 << 20;
const SAMPLE: u64 = 1 << 20;
const SAMPLES: u64 = 16;

/// The tensors' bytes of one weight file (after its header, `start..size`), or samples of
/// them: two checkpoints of one architecture (a base model and its fine-tune) have the same
/// headers, and their ranks would sum each other's numbers without a word.
fn hash_data(h: &mut Sha256, f: &mut std::fs::File, start: u64, size: u64) -> std::io::Result<()> {
    use std::io::{Seek, SeekFrom};
    let len = size.saturating_sub(start);
    let blocks: Vec<(u64, u64)> = if len <= WHOLE {
        vec![(start, len)]
    } else {
        (0..SAMPLES)
            .map(|i| (start + i * (len - SAMPLE) / (SAMPLES - 1), SAMPLE))
            .collect()
    };
    let mut buf = Vec::new();
    for (at, n) in blocks {
        buf.resize(n as usize, 0);
        f.seek(SeekFrom::Start(at))?;
        f.read_exact(&mut buf)?;
        h.update(&buf);
    }
    Ok(())
}

/// The bytes of config.json and each weight file's name, size, safetensors header (every
/// name, dtype, shape and offset) and its tensors' bytes, sampled past 16 MiB a file (reading
/// them all twice would double a large model's load time): what decides the shapes and
/// values a rank computes.
fn model_digest(dir: &Path, files: &[std::path::PathBuf]) -> Result<[u8; 32], DistError> {
    let io = |p: &Path, e: std::io::Error| DistError::Env(format!("{}: {e}", p.display()));
    let mut h = Sha256::new();
    let config = dir.join("config.json");
    h.update(std::fs::read(&config).map_err(|e| io(&config, e))?);
    for path in files {
        let mut f = std::fs::File::open(path).map_err(|e| io(path, e))?;
        let size = f.metadata().map_err(|e| io(path, e))?.len();
        let mut len = [0u8; 8];
        f.read_exact(&mut len).map_err(|e| io(path, e))?;
        let n = u64::from_le_bytes(len)
            .min(size.saturating_sub(8))
            .min(1 << 28);
        let mut header = vec![0u8; n as usize];
        f.read_exact(&mut header).map_err(|e| io(path, e))?;
        h.update(path.file_name().unwrap_or_default().as_encoded_bytes());
        h.update(size.to_le_bytes());
        h.update(&header);
        hash_data(&mut h, &mut f, 8 + n, size).map_err(|e| io(path, e))?;
    }
    Ok(h.finalize().into())
}

impl Fingerprint {
    /// Of the model in `dir` whose weights are `files` (the loader's list).
    pub fn new(
        (dir, files): (&Path, &[std::path::PathBuf]),
        mode: Mode,
        rank: usize,
        size: usize,
    ) -> Result<Self, DistError> {
        let mut b = [0u8; LEN];
        b[..4].copy_from_slice(TAG);
        b[4] = match mode {
            Mode::Tensor => 1,
            Mode::Pipeline => 2,
        };
        b[5] = size.min(255) as u8;
        b[6..8].copy_from_slice(&(rank as u16).to_le_bytes());
        let build = Sha256::digest(format!(
            "engine {} mlx {}",
            env!("CARGO_PKG_VERSION"),
            crate::runtime::mlx_version()
        ));
        b[8..32].copy_from_slice(&build[..24]);
        b[32..].copy_from_slice(&model_digest(dir, files)?);
        Ok(Fingerprint(b))
    }
}

/// Every rank's fingerprint to every rank (all_gather): Ok when they agree apart from the
/// rank field, else an error naming the ranks and what differs. Every rank calls it first.
pub fn check_fingerprints(mine: &Fingerprint) -> Result<(), DistError> {
    let mlx =
        |e: mlx_rs::error::Exception| DistError::Connect(format!("fingerprint exchange: {e}"));
    let all = super::all_gather(&Array::from_slice(&mine.0, &[1, LEN as i32])).map_err(mlx)?;
    all.eval().map_err(mlx)?;
    let all = all.as_slice::<u8>().to_vec();
    let mut problems = Vec::new();
    for (r, theirs) in all.chunks(LEN).enumerate() {
        let diff = |range: std::ops::Range<usize>| theirs[range.clone()] != mine.0[range];
        let mut what = Vec::new();
        if diff(0..4) {
            what.push("not an engine rank (another program, or another protocol)");
        } else {
            if diff(4..5) {
                what.push("parallel mode (--pipeline on some ranks only)");
            }
            if diff(5..6) {
                what.push("group size");
            }
            if diff(8..32) {
                what.push("engine or MLX version");
            }
            if diff(32..64) {
                what.push("model (config.json or weights differ)");
            }
        }
        if !what.is_empty() {
            problems.push(format!("rank {r}: {}", what.join(", ")));
        }
    }
    if problems.is_empty() {
        return Ok(());
    }
    Err(DistError::Mismatch(format!(
        "the ranks do not run the same thing ({}): start every rank with the same engine, \
         model directory and flags",
        problems.join("; ")
    )))
}
