//! Requests with images on the serial lane, as mlx_vlm.server runs them (its generate path
//! is `generate_step`, mlx_vlm/generate/ar.py, as `engine generate --image` runs it:
//! `vision::generate`). The HTTP side made the prompt's ids (`Encoder::encode_request`);
//! here the model's processor makes the pixels from the templated text (and must expand it
//! to the same text), the prompt with its images runs through fresh caches
//! (`ImageModel::prefill`), and each later token goes in by id (`ImageRun::decode`: for the
//! Qwen family at its position plus the prompt's M-RoPE delta). Each step is one token of
//! this request, taking turns with the lane's other requests like a text request's step.
//!
//! Such a request neither reads nor fills the prompt cache: an entry is keyed by token ids,
//! and two prompts with different images of one size have the same ids. Adapters apply to
//! the text model only, so a request naming one with images is refused.

use mlx_rs::Array;

use super::Worker;
use crate::generate::decode::Decoder;
use crate::generate::{Finish, Flow};
use crate::plant::{self, Defect};
use crate::serve::error::ApiError;
use crate::serve::request::GenRequest;
use crate::vision::model::{ImageInputs, ImageModelError, ImageRun};
use crate::vision::RgbImage;

/// A request with images between two of its steps: its run (the caches after the prompt,
/// the rope delta) and the logits of the position whose id comes next.
pub(super) struct ImageSteps<'w> {
    run: ImageRun<'w>,
    logits: Option<Array>,
}

fn model_error(e: ImageModelError) -> ApiError {
    ApiError::generation(e)
}

thread_local! {
    /// Planted `ImageRequestCachedByIds`: the last prompt's ids and image inputs, reused by
    /// the next prompt with the same ids (what a prompt cache keyed by ids alone would do).
    static BY_IDS: std::cell::RefCell<Option<(Vec<u32>, ImageInputs)>> =
        const { std::cell::RefCell::new(None) };
}

impl Worker {
    /// Prefills `request`'s prompt with its images: the steps to decode from.
    pub(super) fn start_image<'w>(
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
        let (expanded, mut inputs) = model
            .prepare(&text.templated, &images)
            .map_err(model_error)?;
        if expanded != text.expanded {
            return Err(ApiError::server(
                "the model's processor expanded the prompt unlike the server's encoder",
            ));
        }
        if plant::is(Defect::ImageRequestCachedByIds) {
            let earlier = BY_IDS.with(|m| m.borrow_mut().take());
            let copy = model
                .prepare(&text.templated, &images)
                .map_err(model_error)?
                .1;
            if let Some((_, e)) = earlier.filter(|(ids, _)| ids == prompt_ids) {
                inputs = e;
            }
            BY_IDS.with(|m| *m.borrow_mut() = Some((prompt_ids.to_vec(), copy)));
        }
        let (run, logits) = model
            .prefill(prompt_ids, &inputs, self.prefill_step)
            .map_err(model_error)?;
        dec.prompt_done();
        Ok(ImageSteps {
            run,
            logits: Some(logits),
        })
    }
}

impl ImageSteps<'_> {
    /// One token: picked from the last logits, emitted, and (unless the request is over)
    /// fed back for the next logits. Some(finish) when the request is over.
    pub(super) fn advance(
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
