//! One request's output side, shared by the serial and the batch lane: each generated id
//! goes through the streaming detokenizer and the stop matcher, gets its log-probabilities
//! if asked, and is sent to the client; a send that fails means the client has gone.

use mlx_rs::Array;
use tokio::sync::mpsc::UnboundedSender;

use super::error::ApiError;
use super::worker::{Event, Worker};
use crate::generate::stop::{StopMatcher, StopStep};
use crate::generate::{Finish, Flow};
use crate::load::detok::StreamingDetokenizer;

pub struct Emitter<'t> {
    events: UnboundedSender<Event>,
    detok: StreamingDetokenizer<'t>,
    stops: StopMatcher,
    logprobs: bool,
    top_logprobs: usize,
    pub produced: Vec<u32>,
    /// The client disconnected.
    pub gone: bool,
}

impl<'t> Emitter<'t> {
    pub fn new(
        worker: &'t Worker,
        request: &super::request::GenRequest,
        events: UnboundedSender<Event>,
    ) -> Self {
        Emitter {
            events,
            detok: worker.tokenizer.detokenizer(),
            stops: StopMatcher::new(request.stop.iter().cloned()),
            logprobs: request.logprobs,
            top_logprobs: request.top_logprobs,
            produced: Vec::new(),
            gone: false,
        }
    }

    pub fn send(&self, event: Event) -> bool {
        self.events.send(event).is_ok()
    }

    /// Emits generated id `id` (sampled from `logprobs`); Stop when a stop string completed
    /// or the client has gone.
    pub fn token(&mut self, worker: &Worker, id: u32, logprobs: &Array) -> Result<Flow, ApiError> {
        self.produced.push(id);
        let piece = self
            .detok
            .push(id)
            .map_err(|e| ApiError::server(e.to_string()))?;
        let (text, flow) = match self.stops.push(&piece) {
            StopStep::Continue(t) => (t, Flow::Continue),
            StopStep::Stop(t) => (t, Flow::Stop),
        };
        let lp = if self.logprobs {
            vec![worker
                .logprob(id, logprobs, self.top_logprobs)
                .map_err(|e| ApiError::server(e.to_string()))?]
        } else {
            Vec::new()
        };
        if (!text.is_empty() || !lp.is_empty()) && !self.send(Event::Text { text, logprobs: lp }) {
            self.gone = true;
            return Ok(Flow::Stop);
        }
        Ok(flow)
    }

    /// Flushes held-back text (unless a stop string ended it) and sends Done; returns the
    /// number of generated tokens.
    pub fn finish(
        &mut self,
        finish: Finish,
        prompt_tokens: usize,
        cached_tokens: usize,
    ) -> Result<usize, ApiError> {
        if finish != Finish::Stop {
            let tail = self
                .detok
                .finish()
                .map_err(|e| ApiError::server(e.to_string()))?;
            let tail = match self.stops.push(&tail) {
                StopStep::Continue(t) => t + &self.stops.finish(),
                StopStep::Stop(t) => t,
            };
            if !tail.is_empty() {
                self.send(Event::Text {
                    text: tail,
                    logprobs: Vec::new(),
                });
            }
        }
        self.send(Event::Done {
            finish_reason: if finish == Finish::Length {
                "length"
            } else {
                "stop"
            },
            prompt_tokens,
            // mlx_lm.server counts the EOS token that ended the answer as generated.
            completion_tokens: self.produced.len() + usize::from(finish == Finish::Eos),
            cached_tokens,
        });
        Ok(self.produced.len())
    }
}
