//! The output head of optiq 0.7.7's Gemma 4 assistant drafter, chosen by the tensors the
//! checkpoint carries: the centroid head (`masked_embedding.*`, the small E2B/E4B
//! drafters), else its own `lm_head`, else the tied embedding (the large unified drafters).
//!
//! optiq itself decides from the config flags (`use_ordered_embeddings` with the centroid
//! counts, `tie_word_embeddings`) and loads non-strictly: a flagged-tied drafter that carries
//! an `lm_head` drafts with the embedding and never reads it, and a flagged-untied one
//! without an `lm_head` is refused ("drafter parameters missing"). Where flags and tensors
//! agree, both choose the same head.

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::ops::{argpartition_axis, broadcast_to};
use mlx_rs::Array;
use serde_json::Value;

use crate::load::weights::Weights;
use crate::load::LoadError;
use crate::model::layers::{Embedding, Linear};
use crate::plant::{self, Defect};

type R<T> = Result<T, Exception>;

const CENTROIDS: &str = "masked_embedding.centroids.weight";
const ORDERING: &str = "masked_embedding.token_ordering";
const LM_HEAD: &str = "lm_head.weight";

/// The tensor names in `dir`'s `*.safetensors` files (their headers only); empty where
/// none can be read.
pub fn tensor_names(dir: &std::path::Path) -> Vec<String> {
    let mut names = Vec::new();
    let files = std::fs::read_dir(dir).into_iter().flatten().flatten();
    for path in files.map(|e| e.path()) {
        if path.extension().is_some_and(|e| e == "safetensors") {
            names.extend(header_names(&path).unwrap_or_default());
        }
    }
    names
}

fn header_names(path: &std::path::Path) -> std::io::Result<Vec<String>> {
    use std::io::Read;
    let mut f = std::fs::File::open(path)?;
    let mut len = [0u8; 8];
    f.read_exact(&mut len)?;
    let len = u64::from_le_bytes(len).min(100 << 20) as usize;
    let mut header = vec![0u8; len];
    f.read_exact(&mut header)?;
    let header: Value = serde_json::from_slice(&header).unwrap_or(Value::Null);
    let keys = header.as_object().into_iter().flat_map(|m| m.keys());
    Ok(keys.filter(|k| *k != "__metadata__").cloned().collect())
}

/// What the config says about the head (read only for the centroid head's top-k, for
/// checks, and by the planted defect that follows the flags as optiq does).
#[derive(Debug, Clone, Default)]
pub struct HeadFlags {
    pub use_ordered_embeddings: Option<bool>,
    pub num_centroids: i64,
    pub centroid_intermediate_top_k: i64,
    /// The top level's flag, else `text_config`'s; None where neither says.
    pub tie_word_embeddings: Option<bool>,
}

impl HeadFlags {
    /// The flags at the top level of `config` (optiq reads the centroid fields there only).
    pub fn read(config: &Value, tie: Option<bool>) -> Self {
        let int = |k: &str| config[k].as_i64().unwrap_or(0);
        HeadFlags {
            use_ordered_embeddings: config["use_ordered_embeddings"].as_bool(),
            num_centroids: int("num_centroids"),
            centroid_intermediate_top_k: int("centroid_intermediate_top_k"),
            tie_word_embeddings: tie,
        }
    }

    /// optiq's `from_dict`: the flag (default: both counts non-zero) and both counts.
    fn says_centroid(&self) -> bool {
        let counts = self.num_centroids != 0 && self.centroid_intermediate_top_k != 0;
        self.use_ordered_embeddings.unwrap_or(counts) && counts
    }
}

/// Which head the drafter projects with.
pub enum DrafterHead {
    /// The embedding table as a linear (`embed_tokens.as_linear`).
    Tied,
    Own(Linear),
    Centroid(CentroidHead),
}

/// Two-stage decode: score every centroid, keep the top-k, score only the tokens of those
/// centroids (their ids from `token_ordering`), every other logit -1e30.
pub struct CentroidHead {
    /// [C, hidden]
    centroids: Array,
    /// [C, vocab / C]: row c lists centroid c's token ids.
    ordering: Array,
    top_k: i32,
    vocab: i32,
}

impl DrafterHead {
    /// The head the tensors in `w` make (and takes them): `masked_embedding.*` → centroid
    /// (an `lm_head` beside it is passed over, as optiq does), else `lm_head` → own, else
    /// tied. `vocab` rows of `hidden` wide.
    pub fn load(
        w: &mut Weights,
        flags: &HeadFlags,
        hidden: i32,
        vocab: i32,
    ) -> Result<Self, LoadError> {
        if plant::is(Defect::AssistantHeadFromFlags) {
            return Self::load_by_flags(w, flags, hidden, vocab);
        }
        if w.contains(CENTROIDS) || w.contains(ORDERING) {
            let head = CentroidHead::load(w, flags, hidden, vocab)?;
            w.discard(|n| n == LM_HEAD);
            return Ok(DrafterHead::Centroid(head));
        }
        if w.contains(LM_HEAD) {
            return Ok(DrafterHead::Own(super::linear_in(w, "lm_head", hidden)?));
        }
        Ok(DrafterHead::Tied)
    }

    /// The planted defect: the head the flags name, as optiq 0.7.7 picks it.
    fn load_by_flags(
        w: &mut Weights,
        flags: &HeadFlags,
        hidden: i32,
        vocab: i32,
    ) -> Result<Self, LoadError> {
        if flags.says_centroid() {
            return Ok(DrafterHead::Centroid(CentroidHead::load(
                w, flags, hidden, vocab,
            )?));
        }
        w.discard(|n| n.starts_with("masked_embedding."));
        if flags.tie_word_embeddings.unwrap_or(true) {
            w.discard(|n| n == LM_HEAD);
            return Ok(DrafterHead::Tied);
        }
        Ok(DrafterHead::Own(super::linear_in(w, "lm_head", hidden)?))
    }

    /// Which head, in words (for errors and reports).
    pub fn kind(&self) -> &'static str {
        match self {
            DrafterHead::Tied => "tied embedding",
            DrafterHead::Own(_) => "lm_head",
            DrafterHead::Centroid(_) => "centroid",
        }
    }

    /// The logits [1, L, vocab] of a hidden state already through the final norm.
    pub fn logits(&self, embed: &Embedding, h: &Array) -> R<Array> {
        match self {
            DrafterHead::Tied => embed.as_linear(h),
            DrafterHead::Own(head) => head.forward(h),
            DrafterHead::Centroid(c) => c.decode(embed, h),
        }
    }
}

impl CentroidHead {
    fn load(
        w: &mut Weights,
        flags: &HeadFlags,
        hidden: i32,
        vocab: i32,
    ) -> Result<Self, LoadError> {
        let missing = |name: &str| {
            LoadError::Weights(format!(
                "the centroid head needs both `{CENTROIDS}` and `{ORDERING}`; `{name}` is missing"
            ))
        };
        let centroids = w.take(CENTROIDS).map_err(|_| missing(CENTROIDS))?;
        let ordering = w.take(ORDERING).map_err(|_| missing(ORDERING))?;
        let bad = |m: String| LoadError::Weights(format!("the centroid head: {m}"));
        let n = match centroids.shape() {
            [n, h] if *h == hidden && *n > 0 => *n,
            s => {
                return Err(bad(format!(
                    "`{CENTROIDS}` is {s:?}, expected [C, {hidden}]"
                )))
            }
        };
        if ordering.shape() != [vocab] || vocab % n != 0 {
            return Err(bad(format!(
                "`{ORDERING}` is {:?}; it must list the {vocab} token ids, {n} centroids of \
                 vocab / C each",
                ordering.shape()
            )));
        }
        if flags.num_centroids != 0 && flags.num_centroids != i64::from(n) {
            return Err(bad(format!(
                "config.json says num_centroids {}, the tensors hold {n}",
                flags.num_centroids
            )));
        }
        let k = flags.centroid_intermediate_top_k;
        if k <= 0 {
            return Err(bad(
                "config.json must set centroid_intermediate_top_k (how many centroids are \
                 expanded); the tensors do not say"
                    .into(),
            ));
        }
        Ok(CentroidHead {
            centroids,
            ordering: ordering.reshape(&[n, vocab / n])?,
            top_k: k.min(i64::from(n)) as i32,
            vocab,
        })
    }

    /// optiq's `_centroid_decode`, op by op, on h [1, 1, hidden].
    fn decode(&self, embed: &Embedding, h: &Array) -> R<Array> {
        let scores = h.matmul(&self.centroids.transpose_axes(&[1, 0])?)?;
        let k = match plant::is(Defect::AssistantCentroidTopKShort) {
            true => (self.top_k - 1).max(1),
            false => self.top_k,
        };
        let top = argpartition_axis(scores.negative()?, self.top_k - 1, -1)?;
        let top = top.index((.., .., ..k));
        let ids = self.ordering.take_axis(&top, 0)?;
        let emb = embed.weight.take_axis(&ids, 0)?;
        let hidden = *h.shape().last().unwrap_or(&0);
        let h_b = h.reshape(&[1, 1, 1, 1, hidden])?;
        let tok = h_b.multiply(&emb)?.sum_axis(-1, false)?;
        let width = k * self.ordering.shape()[1];
        let tok = tok.reshape(&[1, 1, width])?;
        let ids = ids
            .reshape(&[1, 1, width])?
            .as_dtype(mlx_rs::Dtype::Int32)?;
        let fill = Array::from_f32(-1e30).as_dtype(h.dtype())?;
        let logits = broadcast_to(&fill, &[1, 1, self.vocab])?;
        logits.put_along_axis(&ids, tok.as_dtype(h.dtype())?, -1)
    }
}
