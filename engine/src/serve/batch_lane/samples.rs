//! A batch-lane step's samples, queued and not yet emitted: one (id [1], log-probabilities
//! [1, vocab]) per row, or — when every row samples plain greedy — every row's at once: ids
//! [B] and log-probabilities [B, vocab] from one log-softmax and one argmax over the step's
//! logits (`decode::greedy_rows`, bitwise each row's own pick), so B rows cost the sampling
//! ops of one and the next step is fed the ids as they are.

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;

pub(super) enum Samples {
    PerRow(Vec<(Array, Array)>),
    Whole {
        ids: Array,
        logprobs: Array,
        rows: usize,
    },
}

impl Samples {
    pub fn len(&self) -> usize {
        match self {
            Samples::PerRow(v) => v.len(),
            Samples::Whole { rows, .. } => *rows,
        }
    }

    /// The ids to feed the next step, [rows] (lazy).
    pub fn ids(&self) -> Result<Array, Exception> {
        match self {
            // One row (a lone request): its sample as it is, no copy.
            Samples::PerRow(v) if v.len() == 1 => Ok(v[0].0.clone()),
            Samples::PerRow(v) => {
                let ys: Vec<&Array> = v.iter().map(|(y, _)| y).collect();
                mlx_rs::ops::concatenate(&ys, 0)
            }
            Samples::Whole { ids, .. } => Ok(ids.clone()),
        }
    }

    /// Queues the ids' evaluation.
    pub fn queue(&self) {
        let _ = match self {
            Samples::PerRow(v) => mlx_rs::transforms::async_eval(v.iter().map(|(y, _)| y)),
            Samples::Whole { ids, .. } => mlx_rs::transforms::async_eval([ids]),
        };
    }

    /// Evaluates the ids: one per row, on the host.
    pub fn host_ids(&self) -> Result<Vec<u32>, Exception> {
        match self {
            Samples::PerRow(v) => {
                mlx_rs::transforms::eval(v.iter().map(|(y, _)| y))?;
                Ok(v.iter().map(|(y, _)| y.as_slice::<u32>()[0]).collect())
            }
            Samples::Whole { ids, .. } => {
                ids.eval()?;
                Ok(ids.as_slice::<u32>().to_vec())
            }
        }
    }

    /// Row `i`'s (id [1], log-probabilities [1, vocab]), lazy.
    pub fn row(&self, i: usize) -> Result<(Array, Array), Exception> {
        match self {
            Samples::PerRow(v) => v
                .get(i)
                .cloned()
                .ok_or_else(|| Exception::custom("no such sample row")),
            Samples::Whole { ids, logprobs, .. } => {
                let r = i as i32;
                Ok((ids.index(r..r + 1), logprobs.index(r..r + 1)))
            }
        }
    }

    /// Row `i`'s log-probabilities [1, vocab], lazy.
    pub fn logprobs(&self, i: usize) -> Array {
        match self {
            Samples::PerRow(v) => v[i].1.clone(),
            Samples::Whole { logprobs, .. } => logprobs.index(i as i32..i as i32 + 1),
        }
    }

    /// Only rows `keep`, in that order.
    pub fn keep(self, keep: &[usize]) -> Result<Self, Exception> {
        if keep.len() == self.len() && keep.iter().enumerate().all(|(i, &k)| i == k) {
            return Ok(self);
        }
        if keep.is_empty() {
            return Ok(Samples::PerRow(Vec::new()));
        }
        Ok(match self {
            Samples::PerRow(v) => Samples::PerRow(
                v.into_iter()
                    .enumerate()
                    .filter(|(i, _)| keep.contains(i))
                    .map(|(_, s)| s)
                    .collect(),
            ),
            Samples::Whole { ids, logprobs, .. } => {
                let at: Vec<i32> = keep.iter().map(|&k| k as i32).collect();
                let at = Array::from_slice(&at, &[at.len() as i32]);
                Samples::Whole {
                    ids: ids.take_axis(&at, 0)?,
                    logprobs: logprobs.take_axis(&at, 0)?,
                    rows: keep.len(),
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use mlx_rs::Array;

    use super::Samples;

    fn whole() -> Samples {
        let logits = Array::from_slice(&[0.0f32, 2.0, 1.0, 3.0, 0.5, 0.1, 0.2, 0.3, 9.0], &[3, 3]);
        let (ids, logprobs) = crate::generate::decode::greedy_rows(&logits).unwrap();
        Samples::Whole {
            ids,
            logprobs,
            rows: 3,
        }
    }

    #[test]
    fn kept_rows_keep_their_own_ids_and_log_probabilities() {
        let all = whole();
        assert_eq!(all.host_ids().unwrap(), vec![1, 0, 2]);
        let last = all.logprobs(2);
        let kept = all.keep(&[0, 2]).unwrap();
        assert_eq!(kept.len(), 2);
        assert_eq!(kept.host_ids().unwrap(), vec![1, 2]);
        assert_eq!(kept.ids().unwrap().as_slice::<u32>(), &[1, 2]);
        let moved = kept.logprobs(1);
        moved.eval().unwrap();
        last.eval().unwrap();
        assert_eq!(moved.as_slice::<f32>(), last.as_slice::<f32>());
        assert_eq!(kept.keep(&[]).unwrap().len(), 0);
    }

    #[test]
    fn one_row_feeds_its_sample_as_it_is() {
        let y = Array::from_slice(&[7u32], &[1]);
        let one = Samples::PerRow(vec![(y, Array::from_f32(0.0))]);
        assert_eq!(one.ids().unwrap().as_slice::<u32>(), &[7]);
        assert_eq!(one.host_ids().unwrap(), vec![7]);
    }
}
