//! The plots `harness promote` puts in RESULTS.md, from promotable rows of one machine:
//! decode tok/s against prompt length per stack (the newest context sweep of each model:
//! `harness bench --contexts`), and serve TTFT and throughput against clients per stack
//! (the newest serve run of each model), and the training step's peak memory against
//! sequence length per mode — whole, segmented, chunked loss, both — (the newest
//! `harness probe memory` run of each model). A plot takes the rows of one run only (one
//! timestamp), so a curve never mixes runs; it needs at least two x values.

use std::collections::BTreeMap;

use super::{Figure, Panel, Series};
use crate::db::Row;

/// One plot: its file name under docs/plots/, what the link says, the SVG text.
#[derive(Debug, Clone, PartialEq)]
pub struct Plot {
    pub file: String,
    pub caption: String,
    pub svg: String,
}

/// The stacks in legend order: the engine presets first, peers after.
fn stack_order(stacks: impl Iterator<Item = String>) -> Vec<String> {
    let mut v: Vec<String> = stacks.collect();
    v.sort_by_key(|s| (!s.starts_with("engine"), s.clone()));
    v.dedup();
    v
}

/// A file-name-safe form of a model or machine name.
fn slug(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// Per model, the rows of its newest run among `rows` (newest timestamp).
pub fn newest_run<'a>(rows: impl Iterator<Item = &'a Row>) -> BTreeMap<String, Vec<&'a Row>> {
    let mut by_model: BTreeMap<String, Vec<&Row>> = BTreeMap::new();
    for r in rows {
        by_model.entry(r.model.clone()).or_default().push(r);
    }
    for v in by_model.values_mut() {
        let ts = v.iter().map(|r| r.ts.clone()).max().unwrap_or_default();
        v.retain(|r| r.ts == ts);
    }
    by_model
}

/// One panel: per stack, (x, value) of the rows `pick` maps to an x.
fn panel(
    title: &str,
    x_label: &str,
    legend: &[String],
    rows: &[&Row],
    pick: impl Fn(&Row) -> Option<f64>,
) -> Panel {
    let series = legend
        .iter()
        .map(|stack| {
            let mut points: Vec<(f64, f64)> = rows
                .iter()
                .filter(|r| &r.stack == stack)
                .filter_map(|r| pick(r).map(|x| (x, r.value)))
                .collect();
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
            (!points.is_empty()).then(|| Series {
                name: stack.clone(),
                points,
            })
        })
        .collect();
    Panel {
        title: title.into(),
        x_label: x_label.into(),
        series,
        log_x: true,
        y_from_zero: true,
    }
}

fn distinct_x(p: &Panel) -> usize {
    let mut xs: Vec<f64> = p
        .series
        .iter()
        .flatten()
        .flat_map(|s| s.points.iter().map(|q| q.0))
        .collect();
    xs.sort_by(f64::total_cmp);
    xs.dedup();
    xs.len()
}

fn prompt_tokens(r: &Row) -> Option<f64> {
    let p: serde_json::Value = serde_json::from_str(&r.params).ok()?;
    p.get("prompt_tokens")?.as_f64()
}

/// Decode tok/s against prompt length, per model (the newest context sweep).
fn decode_plots(machine: &str, rows: &[&Row]) -> Vec<Plot> {
    let sweep = rows.iter().copied().filter(|r| {
        r.suite == "decode"
            && r.metric == "decode_tps"
            && r.tags.split_whitespace().any(|t| t == "context-sweep")
    });
    let mut out = Vec::new();
    for (model, run) in newest_run(sweep) {
        let legend = stack_order(run.iter().map(|r| r.stack.clone()));
        let p = panel(
            "decode tok/s",
            "prompt tokens",
            &legend,
            &run,
            prompt_tokens,
        );
        if distinct_x(&p) < 2 {
            continue;
        }
        let commit = &run[0].commit;
        out.push(Plot {
            file: format!("{}-decode-context-{}.svg", slug(machine), slug(&model)),
            caption: format!("decode tok/s vs prompt length, {model} (commit {commit})"),
            svg: super::svg(&Figure {
                title: format!("{model}: decode tok/s vs prompt length · {machine} · {commit}"),
                legend,
                panels: vec![p],
            }),
        });
    }
    out
}

/// `ttft_ms_c8` → ("ttft_ms", 8).
fn per_clients(metric: &str) -> Option<(&str, f64)> {
    let (name, c) = metric.rsplit_once("_c")?;
    Some((name, c.parse().ok()?))
}

/// Serve TTFT and throughput against clients, per model (the newest serve run).
fn serve_plots(machine: &str, rows: &[&Row]) -> Vec<Plot> {
    let serve = rows
        .iter()
        .copied()
        .filter(|r| r.suite == "serve" && per_clients(&r.metric).is_some());
    let mut out = Vec::new();
    for (model, run) in newest_run(serve) {
        let legend = stack_order(run.iter().map(|r| r.stack.clone()));
        let metric = |name: &'static str| {
            move |r: &Row| {
                per_clients(&r.metric)
                    .filter(|(m, _)| *m == name)
                    .map(|(_, c)| c)
            }
        };
        let panels = vec![
            panel(
                "TTFT ms (median)",
                "clients",
                &legend,
                &run,
                metric("ttft_ms"),
            ),
            panel(
                "throughput tok/s",
                "clients",
                &legend,
                &run,
                metric("throughput_tps"),
            ),
        ];
        if panels.iter().any(|p| distinct_x(p) < 2) {
            continue;
        }
        let commit = &run[0].commit;
        out.push(Plot {
            file: format!("{}-serve-{}.svg", slug(machine), slug(&model)),
            caption: format!("serve TTFT and throughput vs clients, {model} (commit {commit})"),
            svg: super::svg(&Figure {
                title: format!("{model}: serving vs concurrent clients · {machine} · {commit}"),
                legend,
                panels,
            }),
        });
    }
    out
}

/// A probe row's mode and sequence length (params `{"mode", "seq"}`).
fn mode_and_seq(r: &Row) -> Option<(String, f64)> {
    let p: serde_json::Value = serde_json::from_str(&r.params).ok()?;
    Some((
        p.get("mode")?.as_str()?.to_string(),
        p.get("seq")?.as_f64()?,
    ))
}

/// The training step's peak memory above its start against sequence length, one curve per
/// mode, per model (the newest memory probe).
fn memory_plots(machine: &str, rows: &[&Row]) -> Vec<Plot> {
    let probe = rows
        .iter()
        .copied()
        .filter(|r| r.suite == "memory-probe" && r.metric == "step_peak_above_start_mb");
    let mut out = Vec::new();
    for (model, run) in newest_run(probe) {
        // The modes take the place of stacks: one series each.
        let by_mode: Vec<Row> = run
            .iter()
            .filter_map(|r| {
                let (mode, _) = mode_and_seq(r)?;
                let mut r = (*r).clone();
                r.stack = mode;
                Some(r)
            })
            .collect();
        let refs: Vec<&Row> = by_mode.iter().collect();
        let legend = stack_order(refs.iter().map(|r| r.stack.clone()));
        let p = panel(
            "step peak above start, MB",
            "tokens per row",
            &legend,
            &refs,
            |r| mode_and_seq(r).map(|m| m.1),
        );
        if distinct_x(&p) < 2 {
            continue;
        }
        let commit = &run[0].commit;
        out.push(Plot {
            file: format!("{}-train-memory-{}.svg", slug(machine), slug(&model)),
            caption: format!(
                "training step peak memory vs sequence length, with and without the chunked \
                 loss, {model} (commit {commit})"
            ),
            svg: super::svg(&Figure {
                title: format!("{model}: training step memory vs length · {machine} · {commit}"),
                legend,
                panels: vec![p],
            }),
        });
    }
    out
}

/// Every plot for `machine` from its promotable `rows`.
pub fn plots(machine: &str, rows: &[&Row]) -> Vec<Plot> {
    let mut out = decode_plots(machine, rows);
    out.extend(serve_plots(machine, rows));
    out.extend(memory_plots(machine, rows));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(ts: &str, suite: &str, metric: &str, stack: &str, value: f64, params: &str) -> Row {
        let mut r = crate::db::RowContext {
            ts: ts.into(),
            commit: "0123456789ab".into(),
            dirty: false,
            machine_key: "m".into(),
            machine_state: "{}".into(),
            preflight: "clean".into(),
            tags: "median-of-3 abba context-sweep".into(),
        }
        .row(
            suite,
            "tiny",
            (metric, value, "tok/s"),
            stack,
            None,
            serde_json::json!({}),
        );
        r.params = params.into();
        r
    }

    #[test]
    fn a_context_sweep_and_a_serve_run_become_plots() {
        let p = |n: u64| serde_json::json!({"prompt_tokens": n, "max_tokens": 128}).to_string();
        let mut rows = vec![];
        for (n, e, m) in [(256, 100.0, 95.0), (1024, 90.0, 88.0), (4096, 60.0, 61.0)] {
            rows.push(row("t2", "decode", "decode_tps", "engine", e, &p(n)));
            rows.push(row("t2", "decode", "decode_tps", "mlx-lm", m, &p(n)));
        }
        // An older sweep's point: not mixed into the newest curve.
        rows.push(row("t1", "decode", "decode_tps", "engine", 1.0, &p(8192)));
        // A plain decode run (no sweep tag): not plotted.
        let mut plain = row("t3", "decode", "decode_tps", "engine", 5.0, &p(512));
        plain.tags = "median-of-3".into();
        rows.push(plain);
        for c in [1, 4, 8] {
            for (stack, v) in [("engine", 10.0 * c as f64), ("mlx-lm", 9.0 * c as f64)] {
                rows.push(row("t4", "serve", &format!("ttft_ms_c{c}"), stack, v, "{}"));
                rows.push(row(
                    "t4",
                    "serve",
                    &format!("throughput_tps_c{c}"),
                    stack,
                    v,
                    "{}",
                ));
            }
        }
        rows.push(row("t4", "serve", "direct_decode_tps", "engine", 3.0, "{}"));
        let refs: Vec<&Row> = rows.iter().collect();
        let plots = plots("cpu-x", &refs);
        let files: Vec<&str> = plots.iter().map(|p| p.file.as_str()).collect();
        assert_eq!(
            files,
            ["cpu-x-decode-context-tiny.svg", "cpu-x-serve-tiny.svg"]
        );
        let decode = &plots[0].svg;
        assert_eq!(decode.matches("<polyline").count(), 2);
        assert_eq!(decode.matches("<circle").count(), 6, "3 lengths × 2 stacks");
        assert!(!decode.contains(">8192<") && !decode.contains(">512<"));
        let serve = &plots[1].svg;
        assert_eq!(serve.matches("<polyline").count(), 4, "2 panels × 2 stacks");
        assert_eq!(plots, super::plots("cpu-x", &refs), "deterministic");
        // A memory probe: one curve per mode over the lengths (the step peak only).
        let mut probe = vec![];
        for (seq, whole, chunked) in [(16, 80.0, 39.0), (32, 160.0, 39.2), (128, 650.0, 40.6)] {
            for (mode, v) in [("whole", whole), ("chunked-16+segmented-1", chunked)] {
                let params = serde_json::json!({"mode": mode, "seq": seq}).to_string();
                probe.push(row(
                    "t5",
                    "memory-probe",
                    "step_peak_above_start_mb",
                    "engine",
                    v,
                    &params,
                ));
                probe.push(row("t5", "memory-probe", "step_ms", "engine", 1.0, &params));
            }
        }
        let refs: Vec<&Row> = probe.iter().collect();
        let mem = super::plots("cpu-x", &refs);
        assert_eq!(mem.len(), 1);
        assert_eq!(mem[0].file, "cpu-x-train-memory-tiny.svg");
        assert_eq!(
            mem[0].svg.matches("<polyline").count(),
            2,
            "one curve per mode"
        );
        assert_eq!(
            mem[0].svg.matches("<circle").count(),
            6,
            "3 lengths × 2 modes"
        );
        // One x value only: no plot.
        let one: Vec<&Row> = rows
            .iter()
            .filter(|r| r.suite == "decode")
            .take(2)
            .collect();
        assert!(super::plots("cpu-x", &one).is_empty());
    }
}
