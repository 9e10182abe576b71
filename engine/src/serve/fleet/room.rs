//! The fleet's room in the shared memory budget (docs/serve.md, "Many models under one
//! budget"): whether a model about to load fits beside the loaded ones, and its weights'
//! estimate before it loads.

use axum::http::StatusCode;

use super::Fleet;
use crate::plant::{self, Defect};
use crate::serve::budget::Need;

impl Fleet {
    /// Why model `keep` (its weights estimated at `bytes`) does not fit in the memory
    /// budget beside the loaded models now; None: it fits (or no budget).
    pub(super) fn memory_short(&self, keep: usize, bytes: Option<u64>) -> Option<String> {
        let (Some(b), Some(bytes)) = (&self.budget, bytes) else {
            return None;
        };
        if plant::is(Defect::FleetBudgetIgnored) {
            return None;
        }
        let (own_one, own_cache) = self.entries[keep].life().least.unwrap_or_default();
        let weights = b.weights();
        let cache = b.mlx_cache_limit().max(own_cache);
        let one = b.min_request().max(own_one);
        if weights + cache + bytes + one <= b.limit {
            return None;
        }
        Some(format!(
            "model {} does not fit in the memory budget: its weights (~{bytes} bytes, its \
             *.safetensors files) + the loaded models' weights ({weights}) + MLX's buffer \
             cache ({cache}) + one request's least need ({one}) = {} bytes, more than \
             --memory-budget {} bytes",
            self.entries[keep].spec.name,
            weights + cache + bytes + one,
            b.limit
        ))
    }
}

impl Fleet {
    /// Holds model `key`'s weights (`bytes`, estimated) in the ledger once they fit beside
    /// what running requests reserve and the other models' prompt caches hold: waited for
    /// as a reservation (which presses those caches to give way, `budget::caches`), up to
    /// `--budget-wait` and `--load-timeout`, then turned into the weights in one step.
    pub(super) async fn hold_weights(
        &self,
        key: &str,
        bytes: Option<u64>,
    ) -> Result<(), (StatusCode, String)> {
        let (Some(b), Some(bytes)) = (&self.budget, bytes) else {
            return Ok(());
        };
        // Planted: the weights are counted at once, beside whatever the caches hold
        // (caught by engine/tests/it/serve_fleet.rs: the ledger's peak passes the budget).
        if plant::is(Defect::FleetLoadBesideCaches) {
            b.reserve_weights(key, bytes);
            return Ok(());
        }
        let need = Need {
            prompt_tokens: 0,
            max_tokens: 0,
            kv: bytes,
            activations: 0,
            embedding: false,
        };
        let deadline = std::time::Instant::now().checked_add(self.load_timeout);
        match b.reserve(key, need, deadline).await {
            Ok(held) => {
                held.into_weights(key);
                Ok(())
            }
            Err(e) => Err((
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "the model's weights (~{bytes} bytes) found no room in the memory budget \
                     beside the running requests and the other models' prompt caches ({e}); \
                     retry later"
                ),
            )),
        }
    }
}

/// Model weights' bytes as stored: the sum of the *.safetensors files' sizes in `dir` (an
/// upper bound of what MLX holds once loaded; 0 when none can be read).
pub(super) fn weights_estimate(dir: &std::path::Path) -> u64 {
    let Ok(files) = std::fs::read_dir(dir) else {
        return 0;
    };
    files
        .flatten()
        .filter(|f| f.file_name().to_string_lossy().ends_with(".safetensors"))
        // A hub cache's files are links to its blobs.
        .filter_map(|f| std::fs::metadata(f.path()).ok())
        .map(|m| m.len())
        .sum()
}
