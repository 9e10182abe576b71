//! The distributed suite's printed table and its DB rows.

use anyhow::Result;

use super::{Cell, DistResult, Options, Split};

impl DistResult {
    fn get(&self, split: Split, stack: &str) -> Option<&Cell> {
        self.cells
            .iter()
            .find(|c| c.split == split && c.stack == stack)
    }

    /// The printed table: each metric per split and stack, engine / mlx-lm, and each split
    /// against the same stack on one rank; failed legs by their error.
    pub fn table(&self, opts: &Options) -> String {
        let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
        let mut s = format!(
            "distributed: {} (prompt {}, {} new, median of {} rounds)\n\
             NOTE: both ranks run on this one machine and share its {cores} cores over \
             loopback: this measures the overhead of splitting a model across ranks, not a \
             speed-up.\n",
            self.model, opts.prompt_tokens, opts.max_tokens, opts.rounds
        );
        s += &format!(
            "{:<13} {:<24} {:>10} {:>10} {:>11} {:>16} {:>16}\n",
            "split", "metric", "engine", "mlx-lm", "eng/mlx-lm", "engine/1 rank", "mlx-lm/1 rank"
        );
        let splits: Vec<Split> = self
            .cells
            .iter()
            .map(|c| c.split)
            .fold(Vec::new(), |mut v, x| {
                if !v.contains(&x) {
                    v.push(x);
                }
                v
            });
        let value = |split, stack: &str, metric: &str| -> Option<f64> {
            let cell = self.get(split, stack)?;
            let m = cell.result.as_ref().ok()?;
            m.rows().into_iter().find(|r| r.0 == metric).map(|r| r.1)
        };
        let fmt = |v: Option<f64>| v.map_or("-".to_owned(), |x| format!("{x:.1}"));
        let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
            (Some(a), Some(b)) if b > 0.0 => format!("{:.2}x", a / b),
            _ => "-".to_owned(),
        };
        for &split in &splits {
            let metrics: Vec<(String, &str)> = (0..split.ranks()).fold(
                vec![
                    ("decode_tps".to_owned(), "tok/s"),
                    ("prefill_tps".to_owned(), "tok/s"),
                    ("ttft_ms".to_owned(), "ms"),
                ],
                |mut v, r| {
                    v.push((format!("peak_memory_mb_rank{r}"), "MB"));
                    v
                },
            );
            for (metric, unit) in &metrics {
                let (e, p) = (
                    value(split, "engine", metric),
                    value(split, "mlx-lm", metric),
                );
                // Against one rank: the same metric (a rank's peak against the one process's).
                let one = if metric.starts_with("peak_memory_mb_rank") {
                    "peak_memory_mb_rank0"
                } else {
                    metric.as_str()
                };
                let base = |stack| value(Split::Single, stack, one);
                s += &format!(
                    "{:<13} {:<24} {:>10} {:>10} {:>11} {:>16} {:>16}\n",
                    split.label(),
                    format!("{metric} ({unit})"),
                    fmt(e),
                    fmt(p),
                    ratio(e, p),
                    ratio(e, base("engine")),
                    ratio(p, base("mlx-lm"))
                );
            }
        }
        for &split in &splits {
            let kinds = [
                ("decode_tps", "tok/s", true),
                ("prefill_tps", "tok/s", true),
                ("ttft_ms", "ms", false),
            ];
            let peer = super::kept_stack("mlx-lm", split);
            let peer = self.get(split, "mlx-lm").map(|_| peer.as_str());
            s += &self
                .kept
                .lines(&kinds, &super::kept_stack("engine", split), peer);
        }
        for c in &self.cells {
            if let Err(e) = &c.result {
                s += &format!(
                    "{} {} failed: {}\n",
                    c.stack,
                    c.split.label(),
                    e.lines().next().unwrap_or("")
                );
            }
        }
        s
    }

    /// One row per (split, stack, metric) that ran; returns how many.
    pub fn record(
        &self,
        db: &crate::db::Db,
        ctx: &crate::db::RowContext,
        opts: &Options,
        params_m: f64,
    ) -> Result<usize> {
        let mut n = 0;
        for c in &self.cells {
            let Ok(m) = &c.result else { continue };
            let params = serde_json::json!({
                "prompt_tokens": opts.prompt_tokens,
                "max_tokens": opts.max_tokens,
                "rounds": opts.rounds,
                "ranks": c.split.ranks(),
                "split": c.split.name(),
                "params_m": params_m,
            });
            let peer = (c.stack == "engine" && opts.peer).then(|| "mlx-lm".to_owned());
            let (mine, theirs) = (
                super::kept_stack(c.stack, c.split),
                super::kept_stack("mlx-lm", c.split),
            );
            for (metric, value, unit) in m.rows() {
                let params = self.kept.row_params(
                    params.clone(),
                    &mine,
                    peer.as_ref().map(|_| theirs.as_str()),
                    &metric,
                );
                db.insert(&ctx.row(
                    "distributed",
                    &self.model,
                    (&metric, value, unit),
                    c.stack,
                    peer.clone(),
                    params,
                ))?;
                n += 1;
            }
        }
        Ok(n)
    }
}
