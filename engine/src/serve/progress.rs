//! What a streaming client sees while its prompt prefills, before the first token:
//! keep-alive comments and, when asked, prompt-progress chunks.
//!
//! - Keep-alive (`--sse-keep-alive SECS`): every SSE stream (chat, completions, responses;
//!   any later API builds its stream with `sse`) sends a `: keep-alive` comment line after
//!   each interval without an event, so clients and proxies with idle timeouts keep the
//!   connection through a long prefill. A stream's headers go out when the model thread
//!   admits the request (`Event::Started`), which both lanes send before prefilling; every
//!   refusal (queue full, draining, a prompt the model cannot take, a bad sampler) comes
//!   before that, with its own status code.
//! - Progress (`return_progress: true`, llama.cpp's name): after each prefill chunk
//!   (`--prefill-step-size` tokens) the stream carries a chunk with no choices and
//!   `prompt_progress: {total, cache, processed, time_ms}` (llama.cpp's field names:
//!   prompt tokens, those served from the prompt cache, those in the caches so far with
//!   the cached ones, milliseconds since prefill began).

use std::convert::Infallible;
use std::time::{Duration, Instant};

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::Stream;
use tokio::sync::mpsc::WeakSender;

use super::emit::{Event, Progress};

/// The keep-alive comment's text (`: keep-alive`).
pub const KEEP_ALIVE_TEXT: &str = "keep-alive";

/// An SSE response of `events`, with keep-alive comments every `keep_alive` without an
/// event (None: none). The one place the server's SSE streams are built.
pub fn sse<S>(keep_alive: Option<Duration>, events: S) -> Response
where
    S: Stream<Item = Result<SseEvent, Infallible>> + Send + 'static,
{
    sse_with(keep_alive, events, KeepAlive::new().text(KEEP_ALIVE_TEXT))
}

/// `sse` whose keep-alive is an event of the API's own (the Messages API's `ping`).
pub fn sse_pinging<S>(keep_alive: Option<Duration>, events: S, ping: SseEvent) -> Response
where
    S: Stream<Item = Result<SseEvent, Infallible>> + Send + 'static,
{
    sse_with(keep_alive, events, KeepAlive::new().event(ping))
}

fn sse_with<S>(keep_alive: Option<Duration>, events: S, how: KeepAlive) -> Response
where
    S: Stream<Item = Result<SseEvent, Infallible>> + Send + 'static,
{
    // Planted: no keep-alive (caught by engine/tests/it/serve_metrics.rs).
    let keep_alive =
        keep_alive.filter(|_| !crate::plant::is(crate::plant::Defect::SseKeepAliveOff));
    match keep_alive {
        Some(every) => Sse::new(events)
            .keep_alive(how.interval(every))
            .into_response(),
        None => Sse::new(events).into_response(),
    }
}

/// Test builds: `ENGINE_TEST_PREFILL_DELAY_MS` makes each prefill chunk take that much
/// longer, so that a test can make prefill slow without a big model.
fn chunk_delay() -> Option<Duration> {
    #[cfg(feature = "plant")]
    {
        static DELAY: std::sync::OnceLock<Option<Duration>> = std::sync::OnceLock::new();
        *DELAY.get_or_init(|| {
            std::env::var("ENGINE_TEST_PREFILL_DELAY_MS")
                .ok()
                .and_then(|v| v.parse::<u64>().ok())
                .filter(|&ms| ms > 0)
                .map(Duration::from_millis)
        })
    }
    #[cfg(not(feature = "plant"))]
    None
}

/// The session hook (`Session::on_prefill`) of a request whose prompt is `total` tokens,
/// `cached` of them from the prompt cache: sends a Progress event after each chunk when
/// `report` (never blocking the model thread: one the channel has no room for is dropped),
/// until the prompt is in (the last token is fed by the first decode step, not a chunk;
/// chunks fed later, e.g. a speculative rollback's, are not prompt progress). None when
/// there is nothing to do.
pub fn prefill_hook(
    events: Option<WeakSender<Event>>,
    total: usize,
    cached: usize,
    report: bool,
) -> Option<Box<dyn FnMut(usize) + Send>> {
    let report = report && !crate::plant::is(crate::plant::Defect::PromptProgressDropped);
    let delay = chunk_delay();
    if !report && delay.is_none() {
        return None;
    }
    let events = events.filter(|_| report);
    let start = Instant::now();
    let mut processed = cached;
    let prompt_end = total.saturating_sub(1);
    Some(Box::new(move |n| {
        if processed >= prompt_end {
            return;
        }
        processed = (processed + n).min(prompt_end);
        if let Some(d) = delay {
            std::thread::sleep(d);
        }
        if let Some(tx) = events.as_ref().and_then(WeakSender::upgrade) {
            let _ = tx.try_send(Event::Progress(Progress {
                total,
                cache: cached,
                processed,
                time_ms: start.elapsed().as_secs_f64() * 1e3,
            }));
        }
    }))
}
