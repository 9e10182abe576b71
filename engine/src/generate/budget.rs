//! A thinking budget as a logits processor: once the answer has written `budget` tokens
//! inside an open thinking block, the thinking-end marker's ids are forced, one a step,
//! so the block closes and the answer goes on. Whether a block is open is read from the
//! ids alone (prompt included: a chat template may open the block in the prompt), so the
//! serial and the batch lane, which both hand the sampler the whole history, enforce it
//! alike. (Anthropic's `thinking.budget_tokens`; the server's Messages API sets it.)

use mlx_rs::error::Exception;
use mlx_rs::ops::select;
use mlx_rs::Array;

use crate::plant::{self, Defect};

/// The model's thinking markers as ids, and the budget.
#[derive(Debug, Clone, PartialEq)]
pub struct ThinkBudget {
    pub start_ids: Vec<u32>,
    pub end_ids: Vec<u32>,
    /// Tokens a thinking block may hold before its end is forced (at least 1).
    pub budget: usize,
}

/// Where `needle` last occurs in `hay` (its start).
fn rfind(hay: &[u32], needle: &[u32]) -> Option<usize> {
    if needle.is_empty() || needle.len() > hay.len() {
        return None;
    }
    (0..=hay.len() - needle.len())
        .rev()
        .find(|&i| &hay[i..i + needle.len()] == needle)
}

impl ThinkBudget {
    /// The id the next step must take after `history` (None: free).
    pub fn forced(&self, history: &[u32]) -> Option<u32> {
        if plant::is(Defect::MessagesBudgetIgnored) || self.end_ids.is_empty() {
            return None;
        }
        let start = rfind(history, &self.start_ids)?;
        let inside = start + self.start_ids.len();
        if rfind(&history[inside..], &self.end_ids).is_some() {
            return None;
        }
        let written = &history[inside..];
        // The end marker under way (a multi-id marker, forced or not): its next id.
        let partial = (1..self.end_ids.len())
            .rev()
            .find(|&k| written.ends_with(&self.end_ids[..k]));
        match partial {
            Some(k) => Some(self.end_ids[k]),
            None if written.len() >= self.budget => Some(self.end_ids[0]),
            None => None,
        }
    }

    /// `logits` [1, vocab] with every id but the forced one at -inf (unchanged when none is
    /// forced, when the forced id lies outside the logits, or when an earlier processor, a
    /// grammar, has masked it: the grammar wins, and sampling stays defined).
    pub fn apply(&self, logits: &Array, history: &[u32]) -> Result<Array, Exception> {
        let Some(id) = self.forced(history) else {
            return Ok(logits.clone());
        };
        let vocab = logits.shape().last().copied().unwrap_or(0);
        if id as i64 >= vocab as i64 {
            return Ok(logits.clone());
        }
        let ids = Array::from_iter(0..vocab, &[1, vocab]);
        let keep = ids.eq(Array::from_int(id as i32))?;
        let floor = Array::from_f32(f32::NEG_INFINITY).as_dtype(logits.dtype())?;
        let forced = select(&keep, logits, &floor)?;
        let allowed = logits
            .take_axis(Array::from_int(id as i32), -1)?
            .gt(&floor)?;
        select(&allowed, &forced, logits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(n: usize) -> ThinkBudget {
        ThinkBudget {
            start_ids: vec![7],
            end_ids: vec![8, 9],
            budget: n,
        }
    }

    #[test]
    fn the_end_is_forced_once_the_block_holds_the_budget() {
        let b = budget(3);
        assert_eq!(b.forced(&[1, 2, 3]), None, "no block open");
        assert_eq!(b.forced(&[1, 7, 4, 4]), None, "two of three");
        assert_eq!(b.forced(&[1, 7, 4, 4, 4]), Some(8), "the budget is spent");
        assert_eq!(
            b.forced(&[1, 7, 4, 4, 4, 8]),
            Some(9),
            "the marker's next id"
        );
        assert_eq!(b.forced(&[1, 7, 4, 4, 4, 8, 9, 5, 5, 5]), None, "closed");
        assert_eq!(b.forced(&[7, 8, 9, 1, 7]), None, "a new block, empty");
        assert_eq!(b.forced(&[7, 4, 8]), Some(9), "a marker begun by the model");
    }

    #[test]
    fn the_mask_keeps_only_the_forced_id() {
        let b = budget(1);
        let logits = Array::from_slice(
            &[0.5f32, 2.0, 1.0, 0.1, 0.0, 0.0, 0.0, 0.0, 0.2, 0.3],
            &[1, 10],
        );
        let out = b.apply(&logits, &[7, 4]).unwrap();
        let best = mlx_rs::ops::indexing::argmax_axis(&out, -1, None).unwrap();
        assert_eq!(best.as_slice::<u32>(), &[8]);
        let masked = logits
            .multiply(Array::from_slice(
                &[
                    1.0f32,
                    1.0,
                    1.0,
                    1.0,
                    1.0,
                    1.0,
                    1.0,
                    1.0,
                    f32::INFINITY,
                    1.0,
                ],
                &[1, 10],
            ))
            .unwrap()
            .negative()
            .unwrap();
        let kept = b.apply(&masked, &[7, 4]).unwrap();
        assert_eq!(
            kept.as_slice::<f32>(),
            masked.as_slice::<f32>(),
            "a masked id is not forced"
        );
        let free = b.apply(&logits, &[1]).unwrap();
        assert_eq!(free.as_slice::<f32>(), logits.as_slice::<f32>());
    }
}
