//! Sentence embeddings from a causal language model, as Qwen3-Embedding defines them and
//! sentence-transformers (6.2.0) computes them: the model's final hidden states (after its
//! final norm, before the output head: `LanguageModel::final_hidden`) of one input's tokens,
//! in float32, pooled into one vector, then L2-normalized:
//!
//!   h = final_hidden(ids)[0] as f32          [L, H]
//!   v = h[L-1]                                last-token pooling (Qwen3-Embedding: the
//!                                             end-of-text token its tokenizer appends)
//!     | (1/L) Σ_t h[t]                        mean pooling (`--embedding-pooling mean`)
//!   e = v / sqrt(Σ v²)
//!   with `dimensions` d < H (Matryoshka):  e = e[..d] / sqrt(Σ e[..d]²)
//!
//! Each input runs alone (batch 1, no padding), so an embedding never depends on what it was
//! sent with; the ops are those of the reference (oracles/gen_embeddings.py: mlx-lm's
//! `model.model(ids)`, `h[-1]` / `mx.mean(h, axis=0)`, `v / mx.sqrt(mx.sum(v * v))`), so the
//! answer is the same to the bit.

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{Array, Dtype};

use crate::model::LanguageModel;

/// How one input's hidden states become one vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Pooling {
    /// The last token's state (Qwen3-Embedding; sentence-transformers' "lasttoken").
    #[default]
    Last,
    /// The mean of every token's state (sentence-transformers' "mean").
    Mean,
}

#[derive(Debug, thiserror::Error)]
pub enum EmbedError {
    /// The model's family cannot give its final hidden states (its refusal names it).
    #[error("{0}")]
    Unsupported(String),
    #[error("`dimensions` must be between 1 and the model's hidden size {hidden}, not {asked}")]
    Dimensions { asked: usize, hidden: usize },
    #[error("an input must hold at least one token")]
    Empty,
    #[error("the model failed: {0}")]
    Model(String),
}

impl From<Exception> for EmbedError {
    fn from(e: Exception) -> Self {
        EmbedError::Model(e.what().to_owned())
    }
}

/// The model's hidden size, from one token through fresh caches; the family's refusal when
/// it does not expose its final hidden states.
pub fn hidden_size(model: &dyn LanguageModel) -> Result<usize, EmbedError> {
    let mut caches = model.make_caches();
    let h = model
        .final_hidden(&Array::from_slice(&[0i32], &[1, 1]), &mut caches)
        .map_err(|e| EmbedError::Unsupported(e.what().to_owned()))?;
    Ok(*h.shape().last().unwrap_or(&0) as usize)
}

/// One input's embedding: `ids` (each below the model's vocabulary: the caller checks)
/// through the model, pooled, normalized, truncated to `dimensions` (then normalized again).
pub fn embed(
    model: &dyn LanguageModel,
    ids: &[u32],
    pooling: Pooling,
    dimensions: Option<usize>,
) -> Result<Vec<f32>, EmbedError> {
    if ids.is_empty() {
        return Err(EmbedError::Empty);
    }
    let input = Array::from_slice(ids, &[1, ids.len() as i32]).as_dtype(Dtype::Int32)?;
    let mut caches = model.make_caches();
    let h = model
        .final_hidden(&input, &mut caches)?
        .index(0)
        .as_dtype(Dtype::Float32)?;
    let hidden = *h.shape().last().unwrap_or(&0) as usize;
    if let Some(d) = dimensions {
        if d == 0 || d > hidden {
            return Err(EmbedError::Dimensions { asked: d, hidden });
        }
    }
    let mut e = normalize(&pool(&h, pooling)?)?;
    if let Some(d) = dimensions.filter(|&d| d < hidden) {
        e = normalize(&e.index(..d as i32))?;
    }
    e.eval()?;
    Ok(e.as_slice::<f32>().to_vec())
}

/// [L, H] → [H].
fn pool(h: &Array, pooling: Pooling) -> Result<Array, Exception> {
    let len = h.shape()[0];
    match pooling {
        // Planted: the token before the last (an off-by-one over the appended end-of-text).
        Pooling::Last
            if crate::plant::is(crate::plant::Defect::EmbedPoolsBeforeLast) && len > 1 =>
        {
            Ok(h.index(len - 2))
        }
        Pooling::Last => Ok(h.index(len - 1)),
        Pooling::Mean => h.mean_axis(0, None),
    }
}

/// v / sqrt(Σ v²).
fn normalize(v: &Array) -> Result<Array, Exception> {
    v.divide(v.multiply(v)?.sum(None)?.sqrt()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> Box<dyn LanguageModel> {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../goldens/models/tiny-qwen3-embedding");
        crate::model::load(&dir).unwrap()
    }

    /// Unit length, also after truncation; a truncated embedding is the full one's prefix,
    /// normalized again; a `dimensions` past the hidden size is refused naming it.
    #[test]
    fn embeddings_are_unit_vectors_and_truncation_renormalizes_the_prefix() {
        let model = tiny();
        assert_eq!(hidden_size(model.as_ref()).unwrap(), 64);
        let ids = [5u32, 17, 300, 2];
        for pooling in [Pooling::Last, Pooling::Mean] {
            let full = embed(model.as_ref(), &ids, pooling, None).unwrap();
            let cut = embed(model.as_ref(), &ids, pooling, Some(16)).unwrap();
            let norm = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>().sqrt();
            assert_eq!((full.len(), cut.len()), (64, 16));
            assert!((norm(&full) - 1.0).abs() < 1e-5 && (norm(&cut) - 1.0).abs() < 1e-5);
            let n = norm(&full[..16]);
            for (c, f) in cut.iter().zip(&full[..16]) {
                assert!((c - f / n).abs() < 1e-5, "{c} vs {}", f / n);
            }
        }
        let e = embed(model.as_ref(), &ids, Pooling::Last, Some(65)).unwrap_err();
        assert!(e.to_string().contains("hidden size 64, not 65"), "{e}");
        assert!(matches!(
            embed(model.as_ref(), &[], Pooling::Last, None),
            Err(EmbedError::Empty)
        ));
    }

    /// A family that does not expose its final hidden states is refused by name.
    #[test]
    fn a_family_without_final_hidden_states_is_refused_by_name() {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../goldens/models/tiny-gemma3n");
        let model = crate::model::load(&dir).unwrap();
        match hidden_size(model.as_ref()) {
            Err(EmbedError::Unsupported(why)) => {
                assert!(why.starts_with(model.model_type()), "{why}");
                assert!(why.contains("cannot compute embeddings"), "{why}");
            }
            other => panic!("{other:?}"),
        }
    }
}
