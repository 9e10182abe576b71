//! Perplexity as `mlx_lm.perplexity.eval_ppl` 0.32.2 computes it, op for op: rows in
//! batches of `batch_size` (the last one shorter), the logits of `batch[:, :-1]` from the
//! model with no cache, cast to float32, `nn.losses.cross_entropy` against `batch[:, 1:]`
//! (no reduction), every batch's losses flattened and concatenated, their MLX mean (f32,
//! read back as a double), `exp` of it; the standard error from MLX's `var(ddof=1)`, its
//! square root, divided by √n on the host and scaled by the perplexity (the delta method).

use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::ops::{concatenate, sqrt};
use mlx_rs::{Array, Dtype};

use engine::cache::none::none_for;
use engine::model::LanguageModel;
use engine::train::loss::cross_entropy;

use super::EvalError;

/// One perplexity and what it was computed over.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Perplexity {
    pub ppl: f64,
    pub standard_error: f64,
    /// The mean loss (nats per token) as MLX's f32 mean gave it.
    pub mean_loss: f64,
    pub tokens: usize,
}

/// The rows as one int32 array [rows, len], as `mx.array(list_of_lists)` makes it.
pub fn rows_array(rows: &[Vec<u32>]) -> Array {
    let len = rows.first().map_or(0, Vec::len);
    let flat: Vec<i32> = rows.iter().flatten().map(|&t| t as i32).collect();
    Array::from_slice(&flat, &[rows.len() as i32, len as i32])
}

/// `eval_ppl(model, data, batch_size)`.
pub fn eval_ppl(
    model: &dyn LanguageModel,
    rows: &[Vec<u32>],
    batch_size: usize,
) -> Result<Perplexity, EvalError> {
    if rows.is_empty() || batch_size == 0 {
        return Err(EvalError::Data(
            "no rows to score (or --batch-size 0)".into(),
        ));
    }
    let data = rows_array(rows);
    let (n, len) = (rows.len() as i32, rows[0].len() as i32);
    let mut losses = Vec::new();
    for start in (0..n).step_by(batch_size) {
        let batch = data.index(start..(start + batch_size as i32).min(n));
        let inputs = batch.index((.., ..len - 1));
        let logits = model
            .forward(&inputs, &mut none_for(&model.make_caches()))?
            .as_dtype(Dtype::Float32)?;
        let loss = cross_entropy(&logits, &batch.index((.., 1..)))?;
        loss.eval()?;
        losses.push(loss.flatten(None, None)?);
    }
    let all = concatenate(&losses, 0)?;
    let mean = if engine::plant::is(engine::plant::Defect::EvalMeanOnHost) {
        // Planted: the mean taken on the host in f64 instead of MLX's f32 mean.
        all.eval()?;
        let v = all.as_slice::<f32>();
        v.iter().map(|&x| f64::from(x)).sum::<f64>() / v.len() as f64
    } else {
        f64::from(all.mean(None)?.item_exact::<f32>())
    };
    let ppl = mean.exp();
    let std_dev = f64::from(sqrt(all.var(None, 1)?)?.item_exact::<f32>());
    let tokens = all.size();
    let standard_error = std_dev / (tokens as f64).sqrt();
    Ok(Perplexity {
        ppl,
        standard_error: ppl * standard_error,
        mean_loss: mean,
        tokens,
    })
}
