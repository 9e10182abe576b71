//! One request's output side, shared by the serial and the batch lane: each generated id
//! goes through the streaming detokenizer and the stop matcher, gets its log-probabilities
//! if asked, and is sent to the client.
//!
//! The model thread never blocks on a client. Each request's channel is bounded; an event
//! it has no room for waits in the request's own backlog, and the last event (Done or an
//! error) always fits because one slot is reserved for it at the start. A request is cut
//! when its client has gone, when its backlog has made no progress for `--stall-timeout`
//! (the client stopped reading), when it passed `--request-timeout`, or when a drain
//! reached its deadline.

use std::collections::VecDeque;
use std::time::Instant;

use mlx_rs::ops::argsort_axis;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;
use tokio::sync::mpsc::error::TrySendError;
use tokio::sync::mpsc::{OwnedPermit, Sender};

use super::error::ApiError;
use super::tools::machine::{Machine, State};
use super::tools::split::{Delta, Splitter};
use super::tools::Markers;
use super::{Counters, Limits};
use crate::generate::stop::TextStream;
use crate::generate::{Finish, Flow};
use crate::load::tokenizer::Tokenizer;

/// One token's log-probability and its best alternatives.
#[derive(Debug, Clone, serde::Serialize)]
pub struct TokenLogprob {
    pub id: u32,
    /// The id's vocabulary string; None (JSON null) for an id past the tokenizer's
    /// vocabulary (a model's padding rows), as mlx_lm.server's `convert_ids_to_tokens` gives.
    pub token: Option<String>,
    pub logprob: f32,
    pub top: Vec<(u32, Option<String>, f32)>,
}

#[derive(Debug)]
pub enum Event {
    /// The prompt was encoded: its length.
    Started {
        prompt_tokens: usize,
    },
    /// One streamed chunk's worth: content, reasoning, tool calls (`tools::split`).
    Text {
        delta: Delta,
        logprobs: Vec<TokenLogprob>,
    },
    Done {
        finish_reason: &'static str,
        usage: Usage,
        /// What the last chunk carries besides the finish reason.
        last: Delta,
        /// The stop string that ended the answer (finish_reason "stop" by a stop string).
        stop_sequence: Option<String>,
    },
    Failed(ApiError),
    /// The prompt's prefill progress, after a chunk (`return_progress`; `progress`).
    Progress(Progress),
    /// Several events at once, in order (what a slow client had not taken yet, then the
    /// last event).
    Batch(Vec<Event>),
}

/// A prompt's prefill progress (llama.cpp's `prompt_progress`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Progress {
    /// Prompt tokens.
    pub total: usize,
    /// Prompt tokens served from the prompt cache.
    pub cache: usize,
    /// Prompt tokens in the caches so far, the cached ones included.
    pub processed: usize,
    /// Milliseconds since the prefill began.
    pub time_ms: f64,
}

impl Progress {
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "total": self.total,
            "cache": self.cache,
            "processed": self.processed,
            "time_ms": self.time_ms,
        })
    }
}

/// A finished request's token counts, as `usage` reports them.
#[derive(Debug, Clone, Copy)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens served from the prompt cache.
    pub cached_tokens: usize,
}

impl Usage {
    /// OpenAI's `usage` object.
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        })
    }
}

/// Events a request's channel holds before the model thread keeps the rest back.
pub const EVENT_SLOTS: usize = 16;

/// The chosen token's log-probability and the `top` most likely ones.
pub fn logprob(
    tokenizer: &Tokenizer,
    id: u32,
    logprobs: &Array,
    top: usize,
) -> Result<TokenLogprob, mlx_rs::error::Exception> {
    let flat = logprobs.reshape(&[-1])?.as_dtype(mlx_rs::Dtype::Float32)?;
    let chosen = flat.index(id as i32);
    chosen.eval()?;
    // mlx_lm.server names tokens by their vocabulary strings (`Ġsky`), not decoded text.
    let decode = |i: u32| tokenizer.id_to_token(i);
    let mut alternatives = Vec::new();
    if top > 0 {
        let order = argsort_axis(flat.negative()?, -1)?.index(..top as i32);
        let values = flat.take_axis(&order, 0)?;
        mlx_rs::transforms::eval([&order, &values])?;
        for (&i, &v) in order.as_slice::<u32>().iter().zip(values.as_slice::<f32>()) {
            alternatives.push((i, decode(i), v));
        }
    }
    Ok(TokenLogprob {
        id,
        token: decode(id),
        logprob: chosen.as_slice::<f32>()[0],
        top: alternatives,
    })
}

/// Why a request stopped before its answer was complete.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cut {
    /// The client closed its connection.
    Gone,
    /// The client stopped reading for `--stall-timeout`.
    Stalled,
    /// The request ran past `--request-timeout`.
    TimedOut,
    /// The server is stopping and the drain deadline passed.
    Draining,
}

impl Cut {
    /// What the client is told (nothing, when it has gone).
    pub fn error(self, limits: &Limits) -> Option<ApiError> {
        use axum::http::StatusCode;
        match self {
            Cut::Gone => None,
            Cut::Stalled => Some(
                ApiError::server(format!(
                    "the client read nothing for {:.1} s (--stall-timeout); the request was \
                     cancelled",
                    limits.stall.as_secs_f64()
                ))
                .with_status(StatusCode::REQUEST_TIMEOUT),
            ),
            Cut::TimedOut => Some(
                ApiError::server(format!(
                    "the request ran longer than {:.1} s (--request-timeout) and was stopped",
                    limits.request_timeout.map_or(0.0, |d| d.as_secs_f64())
                ))
                .with_status(StatusCode::GATEWAY_TIMEOUT),
            ),
            Cut::Draining => Some(
                ApiError::server("the server is shutting down; the request was stopped")
                    .with_status(StatusCode::SERVICE_UNAVAILABLE),
            ),
        }
    }
}

/// A request's side of its event channel, as the model thread holds it.
pub struct Outbox {
    events: Sender<Event>,
    /// The slot reserved for the last event.
    last: Option<OwnedPermit<Event>>,
    /// Events the channel had no room for yet, oldest first.
    backlog: VecDeque<Event>,
    /// When the client last took an event (or the backlog was last empty).
    progress: Instant,
    /// When the request arrived plus `--request-timeout`.
    deadline: Option<Instant>,
}

impl Outbox {
    /// Reserves the last event's slot; fails only if the client has gone already.
    pub fn new(events: Sender<Event>, deadline: Option<Instant>) -> Option<Self> {
        let last = events.clone().try_reserve_owned().ok()?;
        Some(Outbox {
            events,
            last: Some(last),
            backlog: VecDeque::new(),
            progress: Instant::now(),
            deadline,
        })
    }

    /// Queues `event` behind the backlog and moves what fits into the channel.
    pub fn push(&mut self, event: Event) {
        self.backlog.push_back(event);
        self.drain();
    }

    fn drain(&mut self) {
        while let Some(event) = self.backlog.pop_front() {
            match self.events.try_send(event) {
                Ok(()) => self.progress = Instant::now(),
                Err(TrySendError::Full(event)) | Err(TrySendError::Closed(event)) => {
                    self.backlog.push_front(event);
                    return;
                }
            }
        }
        self.progress = Instant::now();
    }

    /// Whether events wait that the client has not taken (it reads slower than the model
    /// writes, or not at all).
    pub fn backlogged(&mut self) -> bool {
        self.drain();
        !self.backlog.is_empty()
    }

    /// Whether the request must stop now, and why.
    pub fn check(&mut self, limits: &Limits) -> Option<Cut> {
        if self.events.is_closed() {
            return Some(Cut::Gone);
        }
        if limits.cut_all.load(std::sync::atomic::Ordering::Relaxed) {
            return Some(Cut::Draining);
        }
        if self.deadline.is_some_and(|d| Instant::now() >= d) {
            return Some(Cut::TimedOut);
        }
        if !self.backlog.is_empty() {
            self.drain();
            if !self.backlog.is_empty() && self.progress.elapsed() >= limits.stall {
                return Some(Cut::Stalled);
            }
        }
        None
    }

    /// Sends the last event (after the backlog) in the reserved slot; the channel closes.
    pub fn close(mut self, event: Option<Event>) {
        self.drain();
        let Some(permit) = self.last.take() else {
            return;
        };
        let mut rest: Vec<Event> = self.backlog.drain(..).collect();
        rest.extend(event);
        match rest.len() {
            0 => {}
            1 => {
                permit.send(rest.remove(0));
            }
            _ => {
                permit.send(Event::Batch(rest));
            }
        }
    }
}

/// How a request's text is split (reasoning, tool calls, content) and when it ends.
pub struct Shape<'a> {
    pub markers: &'a Markers,
    pub machine: &'a std::sync::Arc<Machine>,
    pub prompt: &'a [u32],
    /// The request's token limit as its Decoder has it (its last token flushes the text).
    pub max_tokens: usize,
}

pub struct Emitter<'t> {
    out: Option<Outbox>,
    limits: &'t Limits,
    /// Names the log-probabilities' tokens.
    tokenizer: &'t Tokenizer,
    /// Detokenizer and stop strings.
    text: TextStream<'t>,
    /// Reasoning / tool-call / content split of the text.
    split: Splitter,
    max_tokens: usize,
    logprobs: bool,
    top_logprobs: usize,
    pub produced: Vec<u32>,
    /// `GenRequest::strip`: the answer's end whitespace held back.
    strip: Option<Strip>,
    /// The request was cut (its client gone, stalled, timed out, drained): it is not
    /// finished normally and its caches are not kept.
    pub gone: bool,
    pub cut: Option<Cut>,
}

impl<'t> Emitter<'t> {
    pub fn new(
        limits: &'t Limits,
        tokenizer: &'t Tokenizer,
        request: &super::request::GenRequest,
        out: Outbox,
        shape: Shape<'_>,
    ) -> Self {
        // Chat prompts start in reasoning when the template opened a think block.
        let (initial, tools) = match &request.prompt {
            super::request::Prompt::Chat(c) => {
                (shape.markers.initial_state(shape.prompt), c.tools.clone())
            }
            super::request::Prompt::Text(_) => (State::Normal, None),
        };
        Emitter {
            out: Some(out),
            limits,
            tokenizer,
            text: match request.images.is_empty() {
                true => TextStream::new(tokenizer, request.stop.iter().cloned()),
                // An answer about images streams as mlx_vlm.server streams it.
                false => {
                    TextStream::new(tokenizer, request.stop.iter().cloned()).as_mlx_vlm_server()
                }
            },
            split: Splitter::new(shape.markers, shape.machine.clone(), tools, initial),
            max_tokens: shape.max_tokens,
            logprobs: request.logprobs,
            top_logprobs: request.top_logprobs,
            produced: Vec::new(),
            strip: request.strip.then(Strip::default),
            gone: false,
            cut: None,
        }
    }

    fn push(&mut self, event: Event) {
        if let Some(out) = self.out.as_mut() {
            out.push(event);
        }
    }

    /// The request's channel, not kept open by the holder (the prefill hook's: `progress`).
    pub fn weak_events(&self) -> Option<tokio::sync::mpsc::WeakSender<Event>> {
        self.out.as_ref().map(|o| o.events.downgrade())
    }

    /// The request was admitted: its prompt length goes first.
    pub fn started(&mut self, prompt_tokens: usize) {
        self.push(Event::Started { prompt_tokens });
    }

    /// Checks the request's limits; true (and `cut` set) if it must stop.
    pub fn check(&mut self) -> bool {
        if self.cut.is_none() {
            self.cut = self.out.as_mut().and_then(|o| o.check(self.limits));
        }
        self.gone = self.cut.is_some();
        self.gone
    }

    /// Whether the client is behind (see `Outbox::backlogged`).
    pub fn backlogged(&mut self) -> bool {
        self.out.as_mut().is_some_and(Outbox::backlogged)
    }

    /// Sends an error as the request's last event.
    pub fn fail(&mut self, e: ApiError) {
        if let Some(out) = self.out.take() {
            out.close(Some(Event::Failed(e)));
        }
    }

    /// Ends a cut request: its error to the client (if any is left to tell), counted.
    pub fn end_cut(&mut self, counters: &Counters) {
        use std::sync::atomic::Ordering::Release;
        let cut = self.cut.unwrap_or(Cut::Gone);
        match cut {
            Cut::Gone | Cut::Draining => counters.cancelled.fetch_add(1, Release),
            // A stalled request is a cancelled one: cancelled first, so a reader (which
            // loads stalled first) never sees more stalled than cancelled.
            Cut::Stalled => {
                counters.cancelled.fetch_add(1, Release);
                counters.stalled.fetch_add(1, Release)
            }
            Cut::TimedOut => counters.timed_out.fetch_add(1, Release),
        };
        let error = cut.error(self.limits);
        if let Some(out) = self.out.take() {
            out.close(error.map(Event::Failed));
        }
    }

    /// Emits generated id `id` (sampled from `logprobs`); Stop when a stop string completed
    /// or the request was cut (`gone`).
    pub fn token(&mut self, id: u32, logprobs: &Array) -> Result<Flow, ApiError> {
        if self.check() {
            return Ok(Flow::Stop);
        }
        self.produced.push(id);
        let (mut text, flow) = self
            .text
            .push(id)
            .map_err(|e| ApiError::server(e.to_string()))?;
        // The answer's last token (its limit): mlx-lm finalizes the detokenizer and flushes
        // the held text with it, in the same chunk.
        let delta = if flow == Flow::Continue && self.produced.len() >= self.max_tokens {
            let tail = self
                .text
                .finish(Finish::Length)
                .map_err(|e| ApiError::server(e.to_string()))?;
            text.push_str(&tail);
            let text = self.stripped(text);
            self.split.push_last(&text)
        } else {
            let text = self.stripped(text);
            self.split.push(&text)
        };
        let lp = if self.logprobs {
            vec![logprob(self.tokenizer, id, logprobs, self.top_logprobs)
                .map_err(|e| ApiError::server(e.to_string()))?]
        } else {
            Vec::new()
        };
        if delta.is_some() || !lp.is_empty() {
            self.push(Event::Text {
                delta: delta.unwrap_or_default(),
                logprobs: lp,
            });
        }
        Ok(flow)
    }

    /// `text` with the answer's end whitespace held back (`GenRequest::strip`).
    fn stripped(&mut self, text: String) -> String {
        match self.strip.as_mut() {
            Some(strip) => strip.delta(&text),
            None => text,
        }
    }

    /// Flushes held-back text (unless a stop string ended it) and sends Done. `counted`
    /// gets the completion tokens as `usage` counts them just before Done goes out, so
    /// /stats never lags an answer its client has.
    pub fn finish(
        &mut self,
        finish: Finish,
        prompt_tokens: usize,
        cached_tokens: usize,
        counted: impl FnOnce(usize),
    ) -> Result<(), ApiError> {
        // At EOS or a stop string mlx_lm.server drops what the detokenizer and the state
        // machine still hold; at the limit it was flushed with the last token.
        let stopped = finish != Finish::Length;
        if !stopped && self.produced.len() < self.max_tokens {
            let tail = self
                .text
                .finish(finish)
                .map_err(|e| ApiError::server(e.to_string()))?;
            let tail = self.stripped(tail);
            if let Some(delta) = self.split.push_last(&tail) {
                self.push(Event::Text {
                    delta,
                    logprobs: Vec::<TokenLogprob>::new(),
                });
            }
        }
        let (last, made_tool_call) = self.split.finish(stopped);
        // mlx_lm.server counts the EOS token that ended the answer as generated.
        let completion_tokens = self.produced.len() + usize::from(finish == Finish::Eos);
        let stop_sequence = self
            .text
            .matched()
            .filter(|_| finish == Finish::Stop)
            .map(str::to_owned);
        let done = Event::Done {
            stop_sequence,
            finish_reason: match finish {
                Finish::Length => "length",
                _ if made_tool_call => "tool_calls",
                _ => "stop",
            },
            last,
            usage: Usage {
                prompt_tokens,
                completion_tokens,
                cached_tokens,
            },
        };
        counted(completion_tokens);
        if let Some(out) = self.out.take() {
            out.close(Some(done));
        }
        Ok(())
    }
}

/// mlx_vlm.server's whitespace rule for an answer (its Responses stream's `stream_delta`,
/// and `str.strip()` of its whole answers): nothing is sent before the first
/// non-whitespace; each piece's trailing whitespace is held and goes out in front of the
/// next piece that has more; what is held at the end is dropped.
#[derive(Default)]
struct Strip {
    started: bool,
    held: String,
}

impl Strip {
    /// Python's `str.isspace` (Rust's White_Space plus U+001C–U+001F).
    fn space(c: char) -> bool {
        c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
    }

    fn delta(&mut self, piece: &str) -> String {
        let mut text = std::mem::take(&mut self.held) + piece;
        if !self.started {
            text = text.trim_start_matches(Self::space).to_owned();
        }
        let kept = text.trim_end_matches(Self::space).len();
        self.held = text.split_off(kept);
        self.started |= !text.is_empty();
        text
    }
}

#[cfg(test)]
mod tests {
    use super::Strip;

    #[test]
    fn strip_holds_the_answers_end_whitespace_as_mlx_vlm_server_does() {
        let mut st = Strip::default();
        let pieces = ["\n", " one", " two ", "\n", "three", "  \n"];
        let out: Vec<String> = pieces.iter().map(|p| st.delta(p)).collect();
        assert_eq!(out, ["", "one", " two", "", " \nthree", ""]);
        assert_eq!(out.concat(), "\n one two \nthree  \n".trim());
    }
}
