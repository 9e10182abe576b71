//! The held-out data as `mlx_lm.perplexity.load_data` 0.32.2 prepares it: the documents in
//! the order of numpy's seeded permutation (`np.random.seed(seed)`, then
//! `np.random.permutation(n)` on the legacy global RandomState: MT19937 and a Fisher–Yates
//! shuffle with masked rejection sampling), each encoded as mlx-lm's TextDataset does
//! (`tokenizer.encode(text)` with special tokens, eos appended unless it is already last),
//! concatenated until `sequence_length × num_samples` tokens are reached, cut to whole
//! sequences and reshaped to rows, the first `num_samples` kept.

use std::path::Path;

use engine::load::tokenizer::Tokenizer;

use super::EvalError;

/// The committed held-out corpus (never used to train a tiny fixture: those read
/// oracles/corpus.txt).
pub const HELDOUT: &str = "goldens/eval/heldout.txt";

/// The documents of a text file: split on blank lines, each stripped, empty ones skipped
/// (as oracles/eval_ppl.py reads it).
pub fn documents(path: &Path) -> Result<Vec<String>, EvalError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| EvalError::Data(format!("{}: {e}", path.display())))?;
    Ok(text
        .split("\n\n")
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(str::to_owned)
        .collect())
}

/// numpy's MT19937 as the legacy RandomState seeds it with an integer (`init_genrand`).
pub struct Mt19937 {
    key: [u32; 624],
    pos: usize,
}

impl Mt19937 {
    pub fn new(seed: u32) -> Self {
        let mut key = [0u32; 624];
        key[0] = seed;
        for i in 1..624 {
            let prev = key[i - 1];
            key[i] = 1_812_433_253u32
                .wrapping_mul(prev ^ (prev >> 30))
                .wrapping_add(i as u32);
        }
        Mt19937 { key, pos: 624 }
    }

    fn refill(&mut self) {
        const UPPER: u32 = 0x8000_0000;
        const LOWER: u32 = 0x7fff_ffff;
        for i in 0..624 {
            let y = (self.key[i] & UPPER) | (self.key[(i + 1) % 624] & LOWER);
            let mut next = self.key[(i + 397) % 624] ^ (y >> 1);
            if y & 1 == 1 {
                next ^= 0x9908_b0df;
            }
            self.key[i] = next;
        }
        self.pos = 0;
    }

    pub fn next_u32(&mut self) -> u32 {
        if self.pos == 624 {
            self.refill();
        }
        let mut y = self.key[self.pos];
        self.pos += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^ (y >> 18)
    }

    /// numpy's `random_interval(max)`: uniform in 0..=max by masked rejection (32-bit draws;
    /// every bound here is below 2³²).
    fn interval(&mut self, max: u32) -> u32 {
        if max == 0 {
            return 0;
        }
        let mut mask = max;
        for shift in [1, 2, 4, 8, 16] {
            mask |= mask >> shift;
        }
        loop {
            let v = self.next_u32() & mask;
            if v <= max {
                return v;
            }
        }
    }

    /// `np.random.permutation(n)`: arange(n) shuffled in place from the last index down.
    pub fn permutation(&mut self, n: usize) -> Vec<usize> {
        let mut out: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            let j = self.interval(i as u32) as usize;
            out.swap(i, j);
        }
        out
    }
}

/// What `load_data` is asked for.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct DataSpec {
    pub sequence_length: usize,
    pub num_samples: usize,
    pub seed: u32,
}

/// `load_data(tokenizer, data, num_samples, sequence_length)`: rows of token ids.
pub fn load_data(
    tokenizer: &Tokenizer,
    docs: &[String],
    spec: &DataSpec,
) -> Result<Vec<Vec<u32>>, EvalError> {
    let eos = tokenizer
        .eos_token
        .as_deref()
        .and_then(|t| tokenizer.token_to_id(t))
        .ok_or_else(|| {
            EvalError::Data("the tokenizer has no eos_token (TextDataset appends one)".into())
        })?;
    let (seq, wanted) = (
        spec.sequence_length,
        spec.sequence_length * spec.num_samples,
    );
    if spec.num_samples == 0 || seq < 2 {
        return Err(EvalError::Data(
            "--num-samples must be ≥ 1 and --sequence-length ≥ 2 (mlx_lm.perplexity's \
             -1 for all samples never ends its loop)"
                .into(),
        ));
    }
    let perm = Mt19937::new(spec.seed).permutation(docs.len());
    let mut data: Vec<u32> = Vec::new();
    let mut next = perm.iter();
    while data.len() < wanted {
        let Some(&i) = next.next() else {
            return Err(EvalError::Data(format!(
                "the corpus has {} tokens over {} documents; {} rows of {seq} need {wanted} \
                 (mlx_lm.perplexity would fail with an IndexError): lower --num-samples or \
                 --sequence-length",
                data.len(),
                docs.len(),
                spec.num_samples
            )));
        };
        let mut ids = tokenizer.encode(&docs[i], true)?;
        if ids.last() != Some(&eos) {
            ids.push(eos);
        }
        data.extend(ids);
    }
    let rows: Vec<Vec<u32>> = data.chunks_exact(seq).map(<[u32]>::to_vec).collect();
    Ok(rows.into_iter().take(spec.num_samples).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// numpy 1.26 / 2.x: `np.random.seed(123); np.random.permutation(13)` and the first
    /// eight of `permutation(1000)`.
    #[test]
    fn permutation_is_numpys() {
        assert_eq!(
            Mt19937::new(123).permutation(13),
            [7, 10, 4, 0, 5, 9, 8, 11, 3, 1, 6, 12, 2]
        );
        assert_eq!(
            Mt19937::new(123).permutation(1000)[..8],
            [131, 203, 50, 585, 138, 632, 328, 461]
        );
    }

    #[test]
    fn documents_are_paragraphs() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.txt");
        std::fs::write(&p, "a b\nc\n\n\n  d  \n\n").unwrap();
        assert_eq!(documents(&p).unwrap(), ["a b\nc", "d"]);
    }
}
