//! The budget on the HTTP side: admission (`admit`), `/stats` `memory`, `/metrics` gauges.

use std::sync::Arc;
use std::time::Instant;

use super::{peak_rss, Budget, Refusal, Reservation};
use crate::serve::AppState;

/// A request's reservation (None: no budget), or the answer refusing it: 400 when it can
/// never fit, 429 with Retry-After when the budget stayed full for `--budget-wait`.
pub(crate) async fn admit(
    s: &AppState,
    prompt_tokens: usize,
    max_tokens: usize,
    deadline: Option<Instant>,
) -> Result<Option<Reservation>, axum::response::Response> {
    let Some(b) = &s.budget else {
        return Ok(None);
    };
    // As the model thread limits it: never past the context.
    let max_tokens = max_tokens.min(s.defaults.context.saturating_sub(prompt_tokens));
    let need = b.need(&s.model_id, prompt_tokens, max_tokens);
    admit_need(s, need, deadline).await
}

/// `admit` for a need worked out otherwise (an embeddings request's, `Budget::embed_need`).
pub(crate) async fn admit_need(
    s: &AppState,
    need: super::Need,
    deadline: Option<Instant>,
) -> Result<Option<Reservation>, axum::response::Response> {
    use axum::response::IntoResponse;
    use std::sync::atomic::Ordering;
    let Some(b) = &s.budget else {
        return Ok(None);
    };
    match b.reserve(&s.model_id, need, deadline).await {
        Ok(r) => Ok(Some(r)),
        Err(e @ Refusal::TooBig { .. }) => {
            s.counters.rejected.fetch_add(1, Ordering::Release);
            Err(crate::serve::error::ApiError::invalid(e.to_string()).into_response())
        }
        Err(e) => {
            s.counters.throttled.fetch_add(1, Ordering::Release);
            let mut response = crate::serve::error::ApiError::server(e.to_string())
                .with_status(axum::http::StatusCode::TOO_MANY_REQUESTS)
                .into_response();
            let retry = b.wait.as_secs().clamp(1, 60).to_string();
            if let Ok(v) = axum::http::HeaderValue::from_str(&retry) {
                response
                    .headers_mut()
                    .insert(axum::http::header::RETRY_AFTER, v);
            }
            Err(response)
        }
    }
}

/// `/stats` `memory`: the budget's ledger (null without one; each model's prompt cache in
/// `budget.models`), the prompt cache's bytes,
/// MLX's allocator counters and the process's peak RSS.
pub(crate) fn stats(s: &AppState) -> serde_json::Value {
    let prompt_cache = s.prompt_cache.lock().map(|p| p.bytes).unwrap_or_default();
    memory(s.budget.as_deref(), prompt_cache as u64)
}

/// `/stats` `memory` for `budget` (a many-model server's: shared by its models) and
/// `prompt_cache` bytes (summed over the loaded models).
pub(crate) fn memory(budget: Option<&Budget>, prompt_cache: u64) -> serde_json::Value {
    let mlx = crate::runtime::memory().ok();
    serde_json::json!({
        "budget": budget.map(|b| b.snapshot()),
        "prompt_cache_bytes": prompt_cache,
        "mlx_active": mlx.map(|m| m.active),
        "mlx_peak": mlx.map(|m| m.peak),
        "mlx_cache": mlx.map(|m| m.cache),
        "peak_rss": peak_rss(),
    })
}

/// `/metrics` gauges: the budget, what is reserved, MLX's active bytes.
#[derive(Debug)]
pub(crate) struct Gauges(pub Arc<Budget>);

impl prometheus_client::collector::Collector for Gauges {
    fn encode(
        &self,
        mut e: prometheus_client::encoding::DescriptorEncoder,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeMetric;
        use prometheus_client::metrics::gauge::ConstGauge;
        let snap = self.0.snapshot();
        let active = crate::runtime::memory().map_or(0, |m| m.active);
        let gauges = [
            (
                "memory_budget_bytes",
                "The server's --memory-budget",
                snap.budget,
            ),
            (
                "memory_reserved_bytes",
                "Bytes of the memory budget reserved by admitted requests",
                snap.reserved,
            ),
            (
                "memory_weights_bytes",
                "Bytes of the memory budget the loaded models' weights hold",
                snap.weights,
            ),
            (
                "mlx_active_memory_bytes",
                "MLX's active (allocated) bytes",
                active as u64,
            ),
        ];
        for (name, help, v) in gauges {
            let g = ConstGauge::new(v as i64);
            let m = e.encode_descriptor(name, help, None, g.metric_type())?;
            g.encode(m)?;
        }
        Ok(())
    }
}
