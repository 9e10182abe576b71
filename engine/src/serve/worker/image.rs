//! Requests with images on the serial lane, as mlx_vlm.server runs them (its generate path
//! is `generate_step`, mlx_vlm/generate/ar.py, as `engine generate --image` runs it:
//! `vision::generate`). The HTTP side made the prompt's ids (`Encoder::encode_request`);
//! here the model's processor makes the pixels from the templated text (and must expand it
//! to the same text), the prompt with its images runs through fresh caches
//! (`ImageModel::prefill`), and each later token goes in by id (`ImageRun::decode`: for the
//! Qwen family at its position plus the prompt's M-RoPE delta). Each step is one token of
//! this request, taking turns with the lane's other requests like a text request's step.
//!
//! The prompt cache (gemma3, Qwen3-VL): an entry is keyed by token ids, and two prompts with different
//! images of one size have the same ids, so a prompt with images is keyed by its ids with
//! each image's token run replaced by ids past any vocabulary (bit 31 set) that carry the
//! image's SHA-256: its first [`HASH_WORDS`] positions hold 31 bits of the hash each, the
//! rest their place in the run. A cached prefix that stops inside an image's hash words
//! (two hashes sharing their first words) is not used, so a prefix reaches into an image's
//! run only when the whole hash matched (≥ 124 bits: runs of at least 4 tokens). Entries
//! live in their own namespace ([`IMAGES_NS`]): the vision model's caches never serve a
//! text request, nor the text model's an image one. A hit continues the prefill from the
//! cached position with the prompt's embeddings (the images through the tower again),
//! which gives the same logits as a fresh prefill, bit for bit (measured on
//! tiny-gemma3-vl at cuts before, inside and after the images; gated on both families).
//! Qwen3-VL's positions and deepstack rows are the whole prompt's, sliced from the cached
//! position. Not cached: gemma4 (its image blocks attend both ways, so a prefix may not
//! stop inside one, and mlx-vlm prefills its image prompts in one forward) and Qwen3.5 (a
//! gated delta net's chunked scan depends on where its chunks start).
//!
//! Adapters apply to the text model only, so a request naming one with images is refused.

use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;

use super::Worker;
use crate::cache::{Cache, KvCache};
use crate::generate::decode::Decoder;
use crate::generate::{Finish, Flow};
use crate::plant::{self, Defect};
use crate::serve::error::ApiError;
use crate::serve::request::GenRequest;
use crate::vision::model::{gemma3_prefill, ImageInputs, ImageModel, ImageModelError, ImageRun};
use crate::vision::qwen_lm::generate_chunks;
use crate::vision::RgbImage;

/// A request with images between two of its steps: its run (the caches after the prompt,
/// the rope delta), the logits of the position whose id comes next, and its prompt's cache
/// key (None: not cached).
pub(in crate::serve) struct ImageSteps<'w> {
    run: ImageRun<'w>,
    logits: Option<Array>,
    key: Option<Vec<u32>>,
    /// Prompt tokens a cached prefix gave.
    pub(in crate::serve) cached: usize,
}

/// The prompt cache's namespace of prompts with images (an adapter's is `name@hash`).
const IMAGES_NS: &str = "#images";

/// Positions of an image's token run that carry its hash (31 bits each).
const HASH_WORDS: usize = 8;

/// Bit 31: past any vocabulary.
const PAST_VOCAB: u32 = 1 << 31;

fn model_error(e: ImageModelError) -> ApiError {
    ApiError::generation(e)
}

/// `ids` with the k-th run of `image_token`s carrying `hashes[k]`; None if the runs and the
/// images do not pair up.
fn cache_key(ids: &[u32], image_token: u32, hashes: &[[u8; 32]]) -> Option<Vec<u32>> {
    let mut key = Vec::with_capacity(ids.len());
    let (mut image, mut j) = (0usize, 0usize);
    for &id in ids {
        if id != image_token {
            if j > 0 {
                image += 1;
            }
            j = 0;
            key.push(id);
            continue;
        }
        let hash = hashes.get(image)?;
        key.push(
            match hash.get(4 * j..4 * j + 4).filter(|_| j < HASH_WORDS) {
                Some(w) => PAST_VOCAB | (u32::from_le_bytes([w[0], w[1], w[2], w[3]]) >> 1),
                None => PAST_VOCAB | j as u32,
            },
        );
        j += 1;
    }
    let runs = image + usize::from(j > 0);
    (runs == hashes.len()).then_some(key)
}

/// Whether a cached prefix of `reused` key tokens ends outside every image's hash words.
fn whole_hashes(key: &[u32], reused: usize) -> bool {
    let image = |p: usize| key.get(p).is_some_and(|&t| t & PAST_VOCAB != 0);
    let starts = (0..key.len()).filter(|&p| image(p) && (p == 0 || !image(p - 1)));
    starts.into_iter().all(|s| {
        let words = (s..key.len())
            .take_while(|&p| image(p))
            .count()
            .min(HASH_WORDS);
        !(s < reused && reused < s + words)
    })
}

impl Worker {
    /// Prefills `request`'s prompt with its images: the steps to decode from.
    pub(in crate::serve) fn start_image<'w>(
        &'w self,
        request: &GenRequest,
        prompt_ids: &[u32],
        dec: &mut Decoder<'w>,
    ) -> Result<ImageSteps<'w>, ApiError> {
        let model = self.vision.as_ref().ok_or_else(|| {
            ApiError::invalid("this model reads text only: send the request without images")
        })?;
        let text = request.image_text.as_ref().ok_or_else(|| {
            ApiError::server("a request with images came without its prompt text")
        })?;
        let images: Vec<RgbImage> = request.images.iter().map(|i| (*i.pixels).clone()).collect();
        let (expanded, inputs) = model
            .prepare(&text.templated, &images)
            .map_err(model_error)?;
        if expanded != text.expanded {
            return Err(ApiError::server(
                "the model's processor expanded the prompt unlike the server's encoder",
            ));
        }
        let steps = self.prefill_image(request, prompt_ids, &inputs)?;
        dec.prompt_done();
        Ok(steps)
    }

    /// The prompt with its images through caches: a cached prefix's (gemma3, Qwen3-VL) or
    /// fresh ones.
    fn prefill_image<'w>(
        &'w self,
        request: &GenRequest,
        prompt_ids: &[u32],
        inputs: &ImageInputs,
    ) -> Result<ImageSteps<'w>, ApiError> {
        let model = self.vision.as_ref().expect("checked by start_image");
        let hashes: Vec<[u8; 32]> = request.images.iter().map(|i| i.sha256).collect();
        // The families whose prefill starts from a cached position, by their image token.
        let image_token = match model {
            ImageModel::Gemma3 { model: g, .. } => Some(g.image_token),
            ImageModel::Qwen3Vl { model: q, .. } => Some(q.ids.image),
            _ => None,
        };
        let key = image_token.and_then(|token| match plant::is(Defect::ImageRequestCachedByIds) {
            // Planted: keyed by the ids alone.
            true => Some(prompt_ids.to_vec()),
            false => cache_key(prompt_ids, token, &hashes),
        });
        self.trim_to_budget();
        let hit = key
            .as_ref()
            .and_then(|k| self.store.borrow_mut().take(IMAGES_NS, k))
            .filter(|h| whole_hashes(key.as_deref().unwrap_or_default(), h.reused));
        let start = hit.as_ref().map_or(0, |h| h.reused);
        // generate_step's chunks of what is left (all but the last token, then the last).
        let ends: Vec<usize> = generate_chunks(prompt_ids.len() - start, self.prefill_step)
            .into_iter()
            .map(|end| start + end)
            .collect();
        // The run, the last position's logits `[1, vocab]`, the tokens the cache gave.
        let (run, logits, cached) = match (model, inputs) {
            (ImageModel::Gemma3 { model: g, .. }, ImageInputs::Gemma3(pixels)) => {
                let mut caches = hit.map_or_else(|| g.make_caches(), |h| h.caches);
                let last = gemma3_prefill(
                    g,
                    prompt_ids,
                    pixels,
                    (&mut caches, start),
                    self.prefill_step,
                )
                .map_err(model_error)?;
                (ImageRun::Gemma3 { model: g, caches }, last, start)
            }
            (ImageModel::Qwen3Vl { model: q, .. }, ImageInputs::Qwen3Vl(patches, grids)) => {
                // The entry's caches back as the model's own (a snapshot's parts, no copy).
                let restored = hit.and_then(|h| {
                    let own = h
                        .caches
                        .iter()
                        .map(|c| KvCache::from_state(c.snapshot()?).ok());
                    own.collect::<Option<Vec<_>>>()
                });
                let (mut caches, start, ends) = match restored {
                    Some(caches) => (caches, start, ends),
                    None => (
                        q.make_caches(),
                        0,
                        generate_chunks(prompt_ids.len(), self.prefill_step),
                    ),
                };
                let p = q
                    .prefill_in_chunks_from(prompt_ids, (patches, grids), &mut caches, start, &ends)
                    .map_err(|e| model_error(e.into()))?;
                let run = ImageRun::Qwen3Vl {
                    model: q,
                    caches,
                    rope_delta: p.rope_delta,
                };
                (run, p.logits.index((.., -1, ..)), start)
            }
            _ => {
                let (run, logits) = model
                    .prefill(prompt_ids, inputs, self.prefill_step)
                    .map_err(model_error)?;
                (run, logits, 0)
            }
        };
        Ok(ImageSteps {
            run,
            logits: Some(logits),
            key,
            cached,
        })
    }

    /// Keeps a finished request's caches in the prompt cache under its key and `produced`.
    pub(in crate::serve) fn keep_image(&self, steps: ImageSteps<'_>, produced: &[u32]) {
        let caches: Vec<Box<dyn Cache>> = match steps.run {
            ImageRun::Gemma3 { caches, .. } => caches,
            ImageRun::Qwen3Vl { caches, .. } => caches
                .into_iter()
                .map(|c| Box::new(c) as Box<dyn Cache>)
                .collect(),
            _ => return,
        };
        let Some(mut tokens) = steps.key else {
            return;
        };
        tokens.extend(produced);
        self.store.borrow_mut().keep_fed(IMAGES_NS, caches, tokens);
        self.trim_to_budget();
    }
}

impl ImageSteps<'_> {
    /// One token: picked from the last logits, emitted, and (unless the request is over)
    /// fed back for the next logits. Some(finish) when the request is over.
    pub(in crate::serve) fn advance(
        &mut self,
        dec: &mut Decoder<'_>,
        on_token: &mut impl FnMut(u32, &Array) -> Result<Flow, ApiError>,
    ) -> Result<Option<Finish>, ApiError> {
        let logits = self
            .logits
            .take()
            .ok_or_else(|| ApiError::server("an image request stepped after it ended"))?;
        let (y, logprobs) = dec.pick(&logits)?;
        y.eval()?;
        let id = y.as_slice::<u32>()[0];
        if let Some(finish) = dec.emit(id, &logprobs, false, &mut |id, lp, _| on_token(id, lp))? {
            return Ok(Some(finish));
        }
        self.logits = Some(self.run.decode(id).map_err(model_error)?);
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_images_run_carries_its_hash_and_a_prefix_may_not_stop_inside_it() {
        let (a, b) = ([1u8; 32], [2u8; 32]);
        let ids = [5, 9, 9, 9, 9, 6, 9, 9, 9, 9, 7];
        let key = cache_key(&ids, 9, &[a, b]).unwrap();
        assert_eq!((key[0], key[5], key[10]), (5, 6, 7));
        assert!(key[1..5]
            .iter()
            .chain(&key[6..10])
            .all(|&t| t & PAST_VOCAB != 0));
        assert_ne!(key[1..5], key[6..10], "two images, two runs");
        let other = cache_key(&ids, 9, &[b, b]).unwrap();
        assert_ne!(
            key[1], other[1],
            "another image differs at its run's first token"
        );
        assert_eq!(cache_key(&ids, 9, &[a]), None, "two runs, one image");
        assert!(whole_hashes(&key, 1) && whole_hashes(&key, 5) && whole_hashes(&key, 10));
        assert!(!whole_hashes(&key, 2) && !whole_hashes(&key, 4) && !whole_hashes(&key, 8));
    }
}
