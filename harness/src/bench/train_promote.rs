//! RESULTS.md's training table: per bench model and method, the engine's step against
//! mlx-lm-lora's (the newest `harness bench --suite train` run of that model), the speed-up
//! and both peaks, and whether the row meets the bar the training work set itself: a step
//! at least 1.2× faster at no more than the peer's peak memory.

use crate::bench::spread::RatioInterval;
use crate::db::Row;

/// The speed-up a row must reach (peer step / engine step).
pub const SPEEDUP_BAR: f64 = 1.2;

/// A row's training method (its parameters' `method`).
fn method_of(r: &Row) -> String {
    serde_json::from_str::<serde_json::Value>(&r.params)
        .ok()
        .and_then(|p| p["method"].as_str().map(str::to_owned))
        .unwrap_or_else(|| "?".into())
}

/// The table over the train suite's rows (None without any engine row that has a peer).
pub fn promote_table(rows: &[&Row]) -> Option<String> {
    let runs =
        crate::plot::results::newest_run(rows.iter().copied().filter(|r| r.suite == "train"));
    let mut lines = Vec::new();
    for (model, run) in &runs {
        // ORPO's and GRPO's legs share stack names: a row is found by its method too.
        let get = |stack: &str, metric: &str, method: &str| {
            run.iter()
                .find(|r| r.stack == stack && r.metric == metric && method_of(r) == method)
                .map(|r| r.value)
        };
        for e in run
            .iter()
            .filter(|r| ["step_ms", "iteration_ms"].contains(&r.metric.as_str()))
        {
            let Some(peer) = e.peer.as_deref() else {
                continue;
            };
            let method = method_of(e);
            let Some(peer_step) = get(peer, &e.metric, &method) else {
                continue;
            };
            let (ep, pp) = (
                get(&e.stack, "peak_memory_mb", &method),
                get(peer, "peak_memory_mb", &method),
            );
            // Where the run kept its legs: the paired rounds' speed-up and its interval; the
            // bar holds only when the whole interval clears it.
            let interval = RatioInterval::of_params(&e.params).map(|i| i.inverse());
            let speedup = interval.map_or(peer_step / e.value, |i| i.median);
            let speedup_cell = interval.map_or(format!("{speedup:.2}×"), |i| i.cell());
            let meets = match (ep, pp) {
                (Some(a), Some(b)) if a > b => "no",
                (Some(_), Some(_)) => match interval {
                    Some(i) if i.lo >= SPEEDUP_BAR => "yes",
                    Some(_) if speedup >= SPEEDUP_BAR => "median only",
                    None if speedup >= SPEEDUP_BAR => "yes",
                    _ => "no",
                },
                _ => "-",
            };
            let mb = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.1} MB"));
            lines.push(format!(
                "| {model} | {method} | {} {:.1} ms | {peer} {:.1} ms | {speedup_cell} | {} | {} | {meets} | {} | {} |\n",
                e.stack,
                e.value,
                peer_step,
                mb(ep),
                mb(pp),
                e.commit,
                e.ts.get(..10).unwrap_or(&e.ts),
            ));
        }
    }
    if lines.is_empty() {
        return None;
    }
    // Per model, the methods in the order the bench runs them.
    let rank = |line: &str| {
        let method = line.split(" | ").nth(1).unwrap_or("");
        ["orpo", "dpo", "cpo", "simpo", "grpo"]
            .iter()
            .position(|m| *m == method)
            .unwrap_or(usize::MAX)
    };
    lines.sort_by_key(|l| (l.split(" | ").next().map(str::to_owned), rank(l)));
    let mut out = String::from(
        "\n#### Training vs mlx-lm-lora\n\n\
         | model | method | engine step | mlx-lm-lora step | speed-up | engine peak | mlx-lm-lora peak | ≥ 1.2× at ≤ its peak | commit | date |\n\
         |---|---|---|---|---|---|---|---|---|---|\n",
    );
    out.extend(lines);
    out.push_str(
        "\n`harness bench --suite train`: one training step (GRPO: one iteration, sampling and update) per \
         leg, medians of fresh-process legs in ABBA order; speed-up = mlx-lm-lora's step / the engine's, \
         where the run kept its legs the median of the paired rounds' speed-ups with its exact interval; \
         the bar is met (yes) when the whole interval clears it, `median only` when only the median does. \
         Peaks are MLX's peak memory over the timed steps of each leg. The methods' legs are described in \
         docs/training.md.\n",
    );
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::db::RowContext;

    fn ctx(ts: &str) -> RowContext {
        RowContext {
            ts: ts.into(),
            commit: "0123456789ab".into(),
            dirty: false,
            machine_key: "m".into(),
            machine_state: "{}".into(),
            preflight: "clean".into(),
            tags: String::new(),
        }
    }

    #[test]
    fn a_row_meets_the_bar_only_when_faster_by_enough_and_no_larger() {
        let c = ctx("2026-12-06T08:00:00Z");
        let dpo = serde_json::json!({"method": "dpo"});
        let grpo = serde_json::json!({"method": "grpo"});
        let peer = |s: &str| Some(s.to_owned());
        let rows = vec![
            // ORPO's engine leg shares GRPO's stack name; its peak is not GRPO's.
            c.row(
                "train",
                "tiny",
                ("peak_memory_mb", 5.0, "MB"),
                "engine",
                None,
                serde_json::json!({"method": "orpo"}),
            ),
            c.row(
                "train",
                "tiny",
                ("step_ms", 100.0, "ms"),
                "engine-dpo",
                peer("mlx-lm-lora-dpo"),
                dpo.clone(),
            ),
            c.row(
                "train",
                "tiny",
                ("step_ms", 130.0, "ms"),
                "mlx-lm-lora-dpo",
                None,
                dpo.clone(),
            ),
            c.row(
                "train",
                "tiny",
                ("peak_memory_mb", 10.0, "MB"),
                "engine-dpo",
                None,
                dpo.clone(),
            ),
            c.row(
                "train",
                "tiny",
                ("peak_memory_mb", 12.0, "MB"),
                "mlx-lm-lora-dpo",
                None,
                dpo.clone(),
            ),
            c.row(
                "train",
                "tiny",
                ("iteration_ms", 100.0, "ms"),
                "engine",
                peer("mlx-lm-lora"),
                grpo.clone(),
            ),
            c.row(
                "train",
                "tiny",
                ("iteration_ms", 113.0, "ms"),
                "mlx-lm-lora",
                None,
                grpo.clone(),
            ),
            c.row(
                "train",
                "tiny",
                ("peak_memory_mb", 50.0, "MB"),
                "engine",
                None,
                grpo.clone(),
            ),
            c.row(
                "train",
                "tiny",
                ("peak_memory_mb", 26.0, "MB"),
                "mlx-lm-lora",
                None,
                grpo.clone(),
            ),
            // An older run's number never shows.
            ctx("2026-12-01T08:00:00Z").row(
                "train",
                "tiny",
                ("step_ms", 1.0, "ms"),
                "engine-dpo",
                peer("mlx-lm-lora-dpo"),
                dpo,
            ),
        ];
        let refs: Vec<&Row> = rows.iter().collect();
        let md = promote_table(&refs).unwrap();
        assert!(md.contains("| tiny | dpo | engine-dpo 100.0 ms | mlx-lm-lora-dpo 130.0 ms | 1.30× | 10.0 MB | 12.0 MB | yes |"), "{md}");
        assert!(md.contains("| tiny | grpo | engine 100.0 ms | mlx-lm-lora 113.0 ms | 1.13× | 50.0 MB | 26.0 MB | no |"), "{md}");
        assert!(!md.contains(" 1.0 ms"), "{md}");
    }
}
