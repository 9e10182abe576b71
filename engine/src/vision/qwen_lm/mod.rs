//! What Qwen3-VL's and Qwen3.5's language models share on a prompt with images, as mlx-vlm
//! 0.7.10 computes it (mlx_vlm/models/qwen3_vl and qwen3_5: `Model.__call__`,
//! `get_input_embeddings`, the language model's ends, `generate_step`'s chunked prefill).
//! [`super::qwen3vl_lm`] and [`super::qwen35_lm`] give their own mixers ([`QwenMixer`]:
//! deepstack; gated attention and delta nets); the rest is one [`QwenImageModel`]:
//!
//! - [`mrope`]: the prompt's (t, h, w) positions, the rope delta and the rotation;
//! - `TextTrunk`: the embedding, the final norm and head, and the prompt's input
//!   (`TextTrunk::prompt`: `embed(ids)` with the tower's merged features copied in at the
//!   image tokens in order, `masked_scatter`) or a decode step's (`o + delta` positions, one
//!   for all three rows);
//! - `Block`, `attend_rotated`: a layer's norms and MLP around its mixer, and attention's
//!   rotation, cache and causal SDPA;
//! - [`generate_chunks`], `run_chunks`: `generate_step`'s prefill chunks (all but the last
//!   token in chunks of `prefill_step_size`, then the last token), each chunk run with the
//!   prompt's positions (and deepstack rows).

pub mod mrope;

use std::collections::HashMap;
use std::path::Path;

use mlx_rs::error::Exception;
use mlx_rs::ops;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::Value;

use super::qwen_vit::{tower_name, QwenVit, QwenVitError};
use super::qwen_vl::QwenVlPixels;
use crate::cache::{AttentionCache, KvCache, Mask};
use crate::load::weights::Weights;
use crate::load::LoadError;
use crate::model::layers::{Attention, Embedding, Glu, Linear, Mlp, RmsNorm};
use crate::plant::{self, Defect};
use mrope::{apply_interleaved, MRope};
pub use mrope::{rope_index, VisionIds};

type R<T> = Result<T, Exception>;

/// A family's mixer (what each decoder layer runs on its normed input) under
/// [`QwenImageModel`], with its cache.
pub trait QwenMixer: Sized {
    /// One layer's cache.
    type Cache;
    /// The planted defect that drops the rope delta from the decode positions.
    const DELTA_DROPPED: Defect;
    /// A fresh cache for this layer (mlx-vlm's `make_cache`).
    fn make_cache(&self) -> Self::Cache;
    /// Whether `caches` are a fresh set for `layers` layers.
    fn fresh(caches: &[Self::Cache], layers: usize) -> bool;
    /// The attention cache offset decode positions count from.
    fn offset(caches: &[Self::Cache]) -> i32;
    /// The mixer on `x`, attention rotated and masked as `step` says.
    fn forward(&self, x: &Array, step: &Step, cache: &mut Self::Cache) -> R<Array>;
}

/// What a mixer's attention reads besides its input: the chunk's cos / sin and mask, and
/// the heads' width.
pub struct Step<'a> {
    pub(crate) cos_sin: (&'a Array, &'a Array),
    pub(crate) mask: &'a Mask,
    pub(crate) head_dim: i32,
}

/// A Qwen checkpoint with its image path: the vision tower and the language model, its
/// layers' mixers `M` the family's, as mlx-vlm runs them.
pub struct QwenImageModel<M> {
    pub vit: QwenVit,
    pub ids: VisionIds,
    trunk: TextTrunk,
    blocks: Vec<Block<M>>,
    head_dim: i32,
}

impl<M> QwenImageModel<M> {
    /// The model from its parts, the final norm and head the last tensors taken from `w`;
    /// every tensor of `w` must have been taken (`what` names the model when one is left).
    pub(crate) fn assemble(
        (raw, vit): (&Value, QwenVit),
        mut w: Weights,
        (cfg, rope): (&CommonTextConfig, MRope),
        blocks: Vec<Block<M>>,
        head_dim: i32,
        what: &str,
    ) -> Result<Self, QwenVitError> {
        let trunk = TextTrunk::load(&mut w, LANGUAGE_MODEL, cfg, rope)?;
        w.ensure_consumed(what, |_| false)?;
        Ok(QwenImageModel {
            vit,
            ids: VisionIds::from_config(raw),
            trunk,
            blocks,
            head_dim,
        })
    }
}

/// Where mlx-vlm's `Model` holds the language model's layers, embedding and final norm.
pub(crate) const LANGUAGE_MODEL: &str = "language_model.model";

impl<M: QwenMixer> QwenImageModel<M> {
    /// One cache per layer.
    pub fn make_caches(&self) -> Vec<M::Cache> {
        self.blocks.iter().map(|b| b.mixer.make_cache()).collect()
    }

    /// A prompt with its images (`patches` and `grids` as the processor gives them, the
    /// images in prompt order) through fresh `caches` in one forward (`Model.__call__`):
    /// every position's logits and the rope delta for the decode steps ([`Self::decode`]).
    pub fn prefill(
        &self,
        ids: &[u32],
        patches: &Array,
        grids: &[[i32; 3]],
        caches: &mut [M::Cache],
    ) -> Result<Prefill, QwenVitError> {
        self.prefill_in_chunks(ids, patches, grids, caches, &[ids.len()])
    }

    /// As [`Self::prefill`], the language model run on the prompt in chunks ending at `ends`
    /// (increasing, the last the prompt's length), each with the prompt's M-RoPE positions
    /// and deepstack rows, as mlx-vlm's `generate_step` prefills ([`generate_chunks`]); the
    /// logits of every chunk, concatenated.
    pub fn prefill_in_chunks(
        &self,
        ids: &[u32],
        patches: &Array,
        grids: &[[i32; 3]],
        caches: &mut [M::Cache],
        ends: &[usize],
    ) -> Result<Prefill, QwenVitError> {
        self.prefill_in_chunks_from(ids, (patches, grids), caches, 0, ends)
    }

    /// As [`Self::prefill_in_chunks`], the caches already holding the prompt's first `start`
    /// positions (a cached prefix: the serve prompt cache): the whole prompt's embeddings,
    /// positions and deepstack rows are made, and the chunks from `start` run (`ends` past
    /// it); the logits of those chunks. Attention-only models: a recurrent state's chunked
    /// scan depends on where its chunks start.
    pub fn prefill_in_chunks_from(
        &self,
        ids: &[u32],
        (patches, grids): (&Array, &[[i32; 3]]),
        caches: &mut [M::Cache],
        start: usize,
        ends: &[usize],
    ) -> Result<Prefill, QwenVitError> {
        let fresh = match start {
            0 => M::fresh(caches, self.blocks.len()),
            _ => M::offset(caches) == start as i32,
        };
        let vid = self.ids;
        let input = self
            .trunk
            .prompt(&self.vit, vid, (ids, patches, grids), ends, fresh)?;
        // h.at[visual positions].add(deepstack feature i) after layer i (Qwen3-VL).
        let deepstack = match input.deepstack.is_empty() {
            true => None,
            false => {
                let visual = Array::from_slice(
                    &ids.iter()
                        .map(|&t| t == vid.image || t == vid.video)
                        .collect::<Vec<_>>(),
                    &[1, ids.len() as i32, 1],
                );
                let feats = input
                    .deepstack
                    .iter()
                    .map(|f| spread(f, &input.feature_of))
                    .collect::<R<Vec<_>>>()?;
                Some((visual, feats))
            }
        };
        let logits = run_chunks_from(start, ends, |a, b| {
            let cut = |t: &Array| t.index((.., a..b));
            let deep = deepstack
                .as_ref()
                .map(|(visual, feats)| (cut(visual), feats.iter().map(cut).collect::<Vec<_>>()));
            let hc = self.layers_forward(
                cut(&input.h),
                (&cut(&input.cos), &cut(&input.sin)),
                caches,
                deep.as_ref().map(|(v, f)| (v, f.as_slice())),
            )?;
            self.trunk.head(&hc)
        })?;
        Ok(Prefill {
            logits,
            rope_delta: input.rope_delta,
        })
    }

    /// Tokens after the prompt (`[1, n]` ids) through the caches: their logits. Positions are
    /// `offset + rope_delta` on, as mlx-vlm's decode steps take them.
    pub fn decode(&self, ids: &[u32], rope_delta: i32, caches: &mut [M::Cache]) -> R<Array> {
        let (h, cos, sin) =
            self.trunk
                .decode_input(ids, M::offset(caches), rope_delta, M::DELTA_DROPPED)?;
        let h = self.layers_forward(h, (&cos, &sin), caches, None)?;
        self.trunk.head(&h)
    }

    /// `h` through the layers; on a prompt chunk with deepstack (Qwen3-VL), its visual
    /// positions' mask and the features added there after each of the first layers.
    fn layers_forward(
        &self,
        mut h: Array,
        cos_sin: (&Array, &Array),
        caches: &mut [M::Cache],
        deepstack: Option<(&Array, &[Array])>,
    ) -> R<Array> {
        let mask = chunk_mask(&h);
        let step = Step {
            cos_sin,
            mask: &mask,
            head_dim: self.head_dim,
        };
        for (i, (block, cache)) in self.blocks.iter().zip(caches.iter_mut()).enumerate() {
            h = block.forward(&h, |mixer, x| mixer.forward(x, &step, cache))?;
            if let Some((visual, feats)) = deepstack {
                if i < feats.len() && !plant::is(Defect::DeepstackSkipped) {
                    // h.at[image positions].add(features): the sum at those rows only.
                    h = ops::select(visual, &h.add(&feats[i])?, &h)?;
                }
            }
        }
        Ok(h)
    }
}

/// A prompt's result: every position's logits `[1, L, vocab]` and the rope delta its decode
/// steps continue from.
pub struct Prefill {
    pub logits: Array,
    pub rope_delta: i32,
}

/// The processor's images (in prompt order) as the tower takes them: their patches in one
/// `[n, C·T·P·P]` f32 tensor and their grids (`Qwen3VLProcessor`'s `pixel_values`,
/// `image_grid_thw`).
pub fn patches_of(images: &[QwenVlPixels]) -> Result<(Array, Vec<[i32; 3]>), QwenVitError> {
    let width = images.first().map_or(0, |i| i.pixels.shape[1]);
    if images.is_empty()
        || images
            .iter()
            .any(|i| i.pixels.shape.len() != 2 || i.pixels.shape[1] != width)
    {
        return Err(QwenVitError::Input(
            "no images, or images from processors of different patch sizes: preprocess every \
             image of a prompt with the checkpoint's one processor"
                .into(),
        ));
    }
    let data: Vec<f32> = images
        .iter()
        .flat_map(|i| i.pixels.data.iter().copied())
        .collect();
    let rows = (data.len() / width) as i32;
    let grids = images
        .iter()
        .map(|i| i.grid_thw.map(|v| v as i32))
        .collect();
    Ok((Array::from_slice(&data, &[rows, width as i32]), grids))
}

/// The chunk ends of mlx-vlm's `generate_step` prefill for a prompt of `len` tokens: all but
/// the last token in chunks of at most `step` (`prefill_step_size`, 2048 by default), then the
/// last token by itself.
pub fn generate_chunks(len: usize, step: usize) -> Vec<usize> {
    let mut ends = Vec::new();
    let mut at = 0;
    while len - at > 1 {
        at += step.max(1).min(len - at - 1);
        ends.push(at);
    }
    ends.push(len);
    ends
}

/// The prompt's chunks `[a, b)` (the first from `start`, ending at `ends`) through `chunk`,
/// which gives each one's logits; all of them concatenated along the sequence.
fn run_chunks_from(
    mut start: usize,
    ends: &[usize],
    mut chunk: impl FnMut(i32, i32) -> R<Array>,
) -> R<Array> {
    let mut logits = Vec::with_capacity(ends.len());
    for &end in ends {
        logits.push(chunk(start as i32, end as i32)?);
        start = end;
    }
    ops::concatenate(&logits, 1)
}

/// config.json's `text_config`: the fields both families read, and the family's own `X`.
#[derive(Debug, Clone, Deserialize)]
pub(crate) struct TextConfig<X> {
    #[serde(flatten)]
    pub common: CommonTextConfig,
    #[serde(flatten)]
    pub family: X,
}

impl<X: DeserializeOwned> TextConfig<X> {
    /// `raw`'s `text_config`.
    pub fn of(raw: &Value) -> Result<Self, QwenVitError> {
        raw.get("text_config")
            .ok_or_else(|| QwenVitError::Config("config.json has no `text_config`".into()))
            .and_then(|v| {
                serde_json::from_value(v.clone())
                    .map_err(|e| QwenVitError::Config(format!("text_config: {e}")))
            })
    }
}

/// The `text_config` fields both families read the same way (mlx-vlm's `TextConfig`s).
#[derive(Debug, Clone, Deserialize)]
pub(crate) struct CommonTextConfig {
    pub num_hidden_layers: usize,
    pub hidden_size: i32,
    pub intermediate_size: i32,
    pub num_attention_heads: i32,
    pub rms_norm_eps: f32,
    pub vocab_size: i32,
    #[serde(default)]
    pub tie_word_embeddings: bool,
}

/// A prompt's input to the layers: the embeddings with the image features in, cos / sin of
/// its M-RoPE positions, the rope delta, and what a family spreads more features with.
pub(crate) struct PromptInput {
    pub h: Array,
    pub cos: Array,
    pub sin: Array,
    pub rope_delta: i32,
    /// Per position, the index of the image feature it takes (0 off the image tokens).
    pub feature_of: Array,
    /// The tower's deepstack features (Qwen3-VL's; none for Qwen3.5).
    pub deepstack: Vec<Array>,
}

/// The language model's ends: the token embedding, M-RoPE, and the final norm and head
/// (untied, or the embedding as a linear).
pub(crate) struct TextTrunk {
    pub embed: Embedding,
    pub norm: RmsNorm,
    pub lm_head: Option<Linear>,
    pub rope: MRope,
}

impl TextTrunk {
    /// `{p}.embed_tokens`, `{p}.norm` and (untied) `language_model.lm_head`.
    pub fn load(
        w: &mut Weights,
        p: &str,
        cfg: &CommonTextConfig,
        rope: MRope,
    ) -> Result<Self, LoadError> {
        let d = cfg.hidden_size;
        let embed = Embedding::load(w, &format!("{p}.embed_tokens"), [cfg.vocab_size, d])?;
        let norm = RmsNorm::load(w, &format!("{p}.norm"), d, cfg.rms_norm_eps)?;
        let lm_head = match cfg.tie_word_embeddings {
            true => None,
            false => Some(Linear::load(
                w,
                "language_model.lm_head",
                false,
                [cfg.vocab_size, d],
            )?),
        };
        Ok(TextTrunk {
            embed,
            norm,
            lm_head,
            rope,
        })
    }

    /// `embed_tokens` of `ids` as `[1, n]`.
    pub fn embed_ids(&self, ids: &[u32]) -> R<Array> {
        let l = ids.len() as i32;
        let ids_arr =
            Array::from_slice(&ids.iter().map(|&t| t as i32).collect::<Vec<_>>(), &[1, l]);
        self.embed.forward(&ids_arr)
    }

    /// The logits of hidden states: `lm_head(norm(h))`.
    pub fn head(&self, h: &Array) -> R<Array> {
        let h = self.norm.forward(h)?;
        match &self.lm_head {
            Some(head) => head.forward(&h),
            None => self.embed.as_linear(&h),
        }
    }

    /// A prompt with its images (`Model.__call__` up to the layers), after checking the chunk
    /// `ends` (increasing, the last the prompt's length), that the prompt holds no video
    /// token, and that the caches are `fresh`.
    pub fn prompt(
        &self,
        vit: &QwenVit,
        vid: VisionIds,
        (ids, patches, grids): (&[u32], &Array, &[[i32; 3]]),
        ends: &[usize],
        fresh: bool,
    ) -> Result<PromptInput, QwenVitError> {
        let increasing = ends.windows(2).all(|w| w[0] < w[1]) && ends.first() != Some(&0);
        if !increasing || ends.last() != Some(&ids.len()) {
            return Err(QwenVitError::Input(format!(
                "chunk ends {ends:?} for a prompt of {}: need increasing ends, the last the \
                 prompt's length",
                ids.len()
            )));
        }
        if ids.contains(&vid.video) {
            // mlx-vlm counts video tokens as visual positions for deepstack; without video
            // features that count no longer matches and its deepstack is skipped or misread.
            return Err(QwenVitError::Input(format!(
                "the prompt holds the video token (id {}): video input is not supported yet; \
                 send images",
                vid.video
            )));
        }
        if !fresh {
            return Err(QwenVitError::Input(
                "a prompt with images starts from empty caches (make_caches)".into(),
            ));
        }
        let (rows, rope_delta) = rope_index(ids, grids, vid, vit.config.spatial_merge_size)?;
        let out = vit.forward(patches, grids)?;
        let image_at: Vec<usize> = (0..ids.len()).filter(|&i| ids[i] == vid.image).collect();
        let n_features = out.merged.shape()[0] as usize;
        if image_at.len() != n_features {
            return Err(QwenVitError::Input(format!(
                "Image features and image tokens do not match: tokens: {}, features {n_features}",
                image_at.len()
            )));
        }
        let l = ids.len() as i32;
        let embeds = self.embed_ids(ids)?;
        // masked_scatter: the k-th image token's row is feature k (copies).
        let mut map = vec![0i32; ids.len()];
        for (k, &i) in image_at.iter().enumerate() {
            map[i] = k as i32;
        }
        let feature_of = Array::from_slice(&map, &[l]);
        let is_image = Array::from_slice(
            &ids.iter().map(|&t| t == vid.image).collect::<Vec<_>>(),
            &[1, l, 1],
        );
        let features = out.merged.as_dtype(embeds.dtype())?;
        let h = ops::select(&is_image, &spread(&features, &feature_of)?, &embeds)?;
        let (cos, sin) = self.rope.prompt(&rows, h.dtype())?;
        Ok(PromptInput {
            h,
            cos,
            sin,
            rope_delta,
            feature_of,
            deepstack: out.deepstack,
        })
    }

    /// Decode tokens' embeddings and cos / sin: positions `offset + rope_delta` on (the
    /// delta dropped where `dropped` is planted), as mlx-vlm's decode steps take them.
    pub fn decode_input(
        &self,
        ids: &[u32],
        offset: i32,
        rope_delta: i32,
        dropped: Defect,
    ) -> R<(Array, Array, Array)> {
        let h = self.embed_ids(ids)?;
        let delta = match plant::is(dropped) {
            true => 0,
            false => rope_delta,
        };
        let (cos, sin) = self
            .rope
            .decode(offset + delta, ids.len() as i32, h.dtype())?;
        Ok((h, cos, sin))
    }
}

/// Features `[n, …]` spread over the prompt's positions by `feature_of`: `[1, L, …]`.
pub(crate) fn spread(features: &Array, feature_of: &Array) -> R<Array> {
    features.take_axis(feature_of, 0)?.expand_dims(0)
}

/// A decoder layer: `h += mixer(input_layernorm(h))`, `h += mlp(post_attention_layernorm(h))`.
pub(crate) struct Block<M> {
    pub mixer: M,
    input_norm: RmsNorm,
    post_norm: RmsNorm,
    mlp: Mlp,
}

impl<M> Block<M> {
    /// Layer `l`'s norms and SwiGLU MLP around `mixer`.
    pub fn load(
        w: &mut Weights,
        l: &str,
        cfg: &CommonTextConfig,
        mixer: M,
    ) -> Result<Self, LoadError> {
        let (d, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        Ok(Block {
            mixer,
            input_norm: RmsNorm::load(w, &format!("{l}.input_layernorm"), d, eps)?,
            post_norm: RmsNorm::load(w, &format!("{l}.post_attention_layernorm"), d, eps)?,
            mlp: Mlp::load(
                w,
                &format!("{l}.mlp"),
                false,
                d,
                cfg.intermediate_size,
                Glu::Swiglu,
            )?,
        })
    }

    /// The layer on `h`, `mixer` running the layer's mixer on the normed input.
    fn forward(&self, h: &Array, mixer: impl FnOnce(&M, &Array) -> R<Array>) -> R<Array> {
        let r = mixer(&self.mixer, &self.input_norm.forward(h)?)?;
        let hh = h.add(&r)?;
        hh.add(&self.mlp.forward(&self.post_norm.forward(&hh)?)?)
    }
}

/// The causal mask of a chunk of more than one token (none for one).
fn chunk_mask(h: &Array) -> Mask {
    match h.shape()[1] > 1 {
        true => Mask::Causal,
        false => Mask::None,
    }
}

/// `norm` (when there is one) on `x`.
fn maybe_norm(norm: &Option<RmsNorm>, x: &Array) -> R<Array> {
    match norm {
        Some(n) => n.forward(x),
        None => Ok(x.clone()),
    }
}

/// `attn`'s queries as `[b, heads, l, head_dim]` from already projected `q`, q-normed.
pub(crate) fn queries(attn: &Attention, q: &Array) -> R<Array> {
    maybe_norm(&attn.q_norm, q)?.transpose_axes(&[0, 2, 1, 3])
}

/// Attention of `x` with its queries `q` (`[b, heads, l, head_dim]`): keys (k-normed) and
/// values of `x`, q and k rotated by cos / sin, k and v through the cache, causal SDPA; the
/// heads' output as `[b, l, heads · head_dim]` (before `o_proj`).
pub(crate) fn attend_rotated(
    attn: &Attention,
    (x, q): (&Array, Array),
    step: &Step,
    cache: &mut KvCache,
) -> R<Array> {
    let (b, l) = (x.shape()[0], x.shape()[1]);
    let (cos, sin) = step.cos_sin;
    let shape = [b, l, attn.n_kv_heads, step.head_dim];
    let k = maybe_norm(&attn.k_norm, &attn.k_proj.forward(x)?.reshape(&shape)?)?
        .transpose_axes(&[0, 2, 1, 3])?;
    let v = attn
        .v_proj
        .forward(x)?
        .reshape(&shape)?
        .transpose_axes(&[0, 2, 1, 3])?;
    let (q, k) = apply_interleaved(q, k, cos, sin)?;
    let kv = cache.update_and_fetch(k, v)?;
    let out = crate::model::sdpa::attend(&q, &kv, attn.scale, step.mask)?;
    out.transpose_axes(&[0, 2, 1, 3])?.reshape(&[b, l, -1])
}

/// The checkpoint in `dir`: its config.json, its vision tower, and the language model's
/// tensors (as stored: each family renames them its own way).
pub(crate) fn load_checkpoint(
    dir: &Path,
) -> Result<(Value, QwenVit, HashMap<String, Array>), QwenVitError> {
    let raw = crate::load::read_json(&dir.join("config.json"))?;
    let all = Weights::load(dir)?.into_tensors();
    let (tower, text): (HashMap<_, _>, HashMap<_, _>) =
        all.into_iter().partition(|(n, _)| tower_name(n).is_some());
    let vit = QwenVit::from_checkpoint(&raw, tower)?;
    Ok((raw, vit, text))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generate_chunks_leave_the_last_token_alone() {
        assert_eq!(generate_chunks(18, 2048), [17, 18]);
        assert_eq!(generate_chunks(5, 2), [2, 4, 5]);
        assert_eq!(generate_chunks(1, 2048), [1]);
    }
}
