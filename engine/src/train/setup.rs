//! What a run trains and on what: the method and its settings (`TrainConfig`, with the
//! weight the dynamic-λ controller moves), the encoded data (`Dataset`), and how the data
//! becomes batches (length-sorted, a seeded permutation per pass; mlx-lm's SFT padding).
//! The loop (`trainer`), the chunked loss, the compiled step and the pair objectives all
//! read these.

use mlx_rs::error::Exception;
use mlx_rs::Array;

use super::data::{Example, Pair, PairSet};
use super::orpo::SftScope;

#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Method {
    Sft,
    Orpo,
    /// DPO, CPO or SimPO (`preference.rs`).
    Pairs(super::preference::PairObjective),
}

/// What to train and how (the CLI's flags, resolved).
#[derive(Debug, Clone, serde::Serialize)]
pub struct TrainConfig {
    pub method: Method,
    pub iters: usize,
    pub batch_size: usize,
    pub grad_accumulation: usize,
    pub max_grad_norm: Option<f32>,
    pub steps_per_eval: usize,
    pub val_batches: usize,
    pub save_every: usize,
    pub max_seq_length: usize,
    pub seed: u64,
    pub orpo_lambda: f32,
    pub sft_scope: SftScope,
    /// Segmented backward: blocks per segment (None: one backward over the whole model).
    pub segment_size: Option<usize>,
    /// ORPO: the forward over chosen and rejected (segmented runs take the joint one).
    pub orpo_forward: super::orpo_prefix::OrpoForward,
    /// The dynamic-λ controller (None: every weight stays as given).
    pub lambda_controller: Option<super::lambda::ControllerConfig>,
    /// The objective weight the controller moves (ORPO's λ; DPO's, CPO's or SimPO's β;
    /// SimPO's γ).
    pub actuated: super::lambda::Actuated,
    /// The chunked cross-entropy: tokens per chunk of the head (None: the whole logits).
    pub loss_chunk: Option<usize>,
}

impl TrainConfig {
    /// The value of the weight the controller moves (None: the method has no such weight).
    pub fn weight(&self) -> Option<f64> {
        use super::lambda::Actuated;
        match (self.method, self.actuated) {
            (Method::Orpo, Actuated::Lambda) => Some(self.orpo_lambda as f64),
            (Method::Pairs(obj), w) => obj.weight(w).map(f64::from),
            _ => None,
        }
    }

    /// Sets the weight the controller moves (nothing where the method has no such weight).
    pub fn set_weight(&mut self, value: f64) {
        match self.method {
            Method::Orpo => self.orpo_lambda = value as f32,
            // Planted: the objective keeps its weight, whatever the controller says.
            Method::Pairs(_) if crate::plant::is(crate::plant::Defect::WeightNotActuated) => {}
            Method::Pairs(obj) => {
                self.method = Method::Pairs(obj.with_weight(self.actuated, value as f32))
            }
            _ => {}
        }
    }
}

/// The training data, by method.
pub enum Dataset {
    Sft(Vec<Example>),
    Orpo(Vec<Pair>),
    /// DPO, CPO, SimPO: pairs with their reference log-probs (`preference_data.rs`).
    Pairs(PairSet),
}

impl Dataset {
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Examples (or pairs) in the set.
    pub fn len(&self) -> usize {
        match self {
            Dataset::Sft(v) => v.len(),
            Dataset::Orpo(v) => v.len(),
            Dataset::Pairs(s) => s.pairs.len(),
        }
    }

    /// Example `i`'s length in tokens (a pair's longer row).
    pub fn item_len(&self, i: usize) -> usize {
        match self {
            Dataset::Sft(v) => v[i].tokens.len(),
            Dataset::Orpo(v) => v[i].chosen.len().max(v[i].rejected.len()),
            Dataset::Pairs(s) => s.pairs[i].chosen.len().max(s.pairs[i].rejected.len()),
        }
    }
}

/// Batches of indices: sorted by length, cut into `batch_size` (a short tail dropped, as
/// mlx-lm's `iterate_batches` does).
pub fn batches(data: &Dataset, batch_size: usize) -> Vec<Vec<usize>> {
    let mut idx: Vec<usize> = (0..data.len()).collect();
    idx.sort_by_key(|&i| data.item_len(i));
    idx.chunks_exact(batch_size)
        .map(<[usize]>::to_vec)
        .collect()
}

/// A seeded permutation (Fisher–Yates over a 64-bit LCG).
pub fn permutation(n: usize, state: &mut u64) -> Vec<usize> {
    let mut p: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        *state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        p.swap(i, ((*state >> 33) % (i as u64 + 1)) as usize);
    }
    p
}

/// An SFT batch as mlx-lm builds it: ids zero-padded to 1 + a multiple of 32 (at most
/// `max_len`), lengths [[offset, length]].
pub fn sft_batch(examples: &[&Example], max_len: usize) -> (Array, Array) {
    let longest = examples.iter().map(|e| e.tokens.len()).max().unwrap_or(1);
    let width = (1 + 32 * longest.div_ceil(32)).min(max_len);
    let mut ids = vec![0i32; examples.len() * width];
    let mut lengths = Vec::new();
    for (j, e) in examples.iter().enumerate() {
        let n = e.tokens.len().min(max_len);
        for (k, &t) in e.tokens[..n].iter().enumerate() {
            ids[j * width + k] = t as i32;
        }
        lengths.extend([e.offset as i32, n as i32]);
    }
    let b = examples.len() as i32;
    (
        Array::from_slice(&ids, &[b, width as i32]),
        Array::from_slice(&lengths, &[b, 2]),
    )
}

/// A batch's loss from the logits of its inputs: SFT [loss, ntoks]; ORPO the
/// `OrpoTerms` in order.
pub type LossFromLogits = Box<dyn FnMut(&Array) -> Result<Vec<Array>, Exception>>;
