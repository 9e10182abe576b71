//! `harness promote`: renders RESULTS.md from the newest promotable rows of the results DB
//! (preflight clean, not tagged went-dirty). The renderer is a pure function of the rows, so
//! the same rows always give the same bytes (snapshot-tested).

use std::collections::BTreeMap;

use crate::db::Row;

/// The machine/toolchain header line, from a row's stored machine state.
fn header(rows: &[&Row]) -> String {
    let Some(row) = rows.iter().max_by(|a, b| a.ts.cmp(&b.ts)) else {
        return "No promotable rows yet.".to_owned();
    };
    let state: serde_json::Value = serde_json::from_str(&row.machine_state).unwrap_or_default();
    let s = state.get("before").unwrap_or(&state);
    let mut parts = vec![format!("machine `{}`", row.machine_key)];
    if let Some(cores) = s.get("cores").and_then(|v| v.as_u64()) {
        parts.push(format!("{cores} cores"));
    }
    if let Some(mem) = s.get("mem_total_mb").and_then(|v| v.as_f64()) {
        parts.push(format!("{:.0} GB RAM", mem / 1024.0));
    }
    if let Some(v) = s.get("engine_version").and_then(|v| v.as_str()) {
        parts.push(format!("engine {v}"));
    }
    if let Some(v) = s.get("mlx_version").and_then(|v| v.as_str()) {
        parts.push(format!("MLX {v}"));
    }
    if let Some(map) = s.get("oracle_versions").and_then(|v| v.as_object()) {
        for key in ["mlx-lm", "mlx-optiq", "transformers"] {
            if let Some(v) = map.get(key).and_then(|v| v.as_str()) {
                parts.push(format!("{key} {v}"));
            }
        }
    }
    parts.join(" · ")
}

fn date(ts: &str) -> &str {
    ts.get(..10).unwrap_or(ts)
}

fn fmt_value(v: f64) -> String {
    if v.fract() == 0.0 || v >= 100.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

/// The run parameters that change what a number means: prompt and generation length.
fn params_label(params: &str) -> Option<String> {
    let p: serde_json::Value = serde_json::from_str(params).ok()?;
    let tokens = p.get("max_tokens").and_then(|v| v.as_u64());
    let label = match (p.get("prompt_tokens").and_then(|v| v.as_u64()), tokens) {
        (Some(prompt), Some(gen)) => format!("prompt {prompt}, {gen} new"),
        (None, Some(gen)) => format!("{gen} new"),
        // Memory probes: which backward, at which length.
        _ => match (
            p.get("mode").and_then(|v| v.as_str()),
            p.get("seq").and_then(|v| v.as_u64()),
        ) {
            (Some(mode), Some(seq)) => format!("{mode}, seq {seq}"),
            _ => return None,
        },
    };
    Some(match p.get("engine_batch").and_then(|v| v.as_u64()) {
        Some(b) => format!("{label}, engine --batch {b}"),
        None => label,
    })
}

/// RESULTS.md for `rows` (already filtered to promotable ones).
pub fn render(rows: &[Row]) -> String {
    // The λ study is per run and seed; its table lives in docs/dynamic-lambda.md.
    let rows: Vec<&Row> = rows
        .iter()
        .filter(|r| r.preflight == "clean" && r.suite != "lambda-sweep")
        .collect();
    let mut out = String::from("# Results\n\n");
    out.push_str("Written by `harness promote` from preflight-clean rows of the results DB; do not edit by hand.\n\n");
    out.push_str(&header(&rows));
    out.push_str("\n\n## Parity\n\n");
    parity_section(&mut out, &rows);
    out.push_str("\n## Performance\n\n");
    performance_section(&mut out, &rows);
    out.push_str("\n## Quality\n\n");
    quality_section(&mut out, &rows);
    out
}

/// One line per parity check, by tier, model and check.
fn parity_section(out: &mut String, rows: &[&Row]) {
    let mut parity: Vec<&Row> = rows
        .iter()
        .copied()
        .filter(|r| r.suite.starts_with("parity"))
        .collect();
    if parity.is_empty() {
        out.push_str("No parity runs recorded yet.\n");
        return;
    }
    out.push_str("| tier | model | check | result | commit | date |\n|---|---|---|---|---|---|\n");
    parity.sort_by(|a, b| (&a.suite, &a.model, &a.metric).cmp(&(&b.suite, &b.model, &b.metric)));
    for r in parity {
        let tier = r.suite.trim_start_matches("parity-");
        out.push_str(&format!(
            "| {tier} | {} | {} | {}{} | {} | {} |\n",
            r.model,
            r.metric.replace('_', " "),
            fmt_value(r.value),
            r.unit,
            r.commit,
            date(&r.ts)
        ));
    }
}

/// (suite, model with its run parameters, metric) → stack → the newest row.
type PerfTable<'a> = BTreeMap<(String, String, String), BTreeMap<String, &'a Row>>;

/// The performance rows (neither parity nor quality), newest per stack.
fn perf_table<'a>(rows: &[&'a Row]) -> PerfTable<'a> {
    let mut perf = PerfTable::new();
    for r in rows
        .iter()
        .copied()
        .filter(|r| !r.suite.starts_with("parity") && r.suite != "quality")
    {
        // Runs with other parameters (e.g. a longer prompt) are separate rows of the table.
        let model = match params_label(&r.params) {
            Some(label) => format!("{} ({label})", r.model),
            None => r.model.clone(),
        };
        // Rows come newest first: the first one per stack is the one to show.
        perf.entry((r.suite.clone(), model, r.metric.clone()))
            .or_default()
            .entry(r.stack.clone())
            .or_insert(r);
    }
    perf
}

/// One line per (suite, model, metric): engine, eager engine and mlx-lm side by side.
fn performance_section(out: &mut String, rows: &[&Row]) {
    let perf = perf_table(rows);
    if perf.is_empty() {
        out.push_str("No performance runs recorded yet.\n");
        return;
    }
    out.push_str(
        "| suite | model | metric | engine | engine, eager decode | mlx-lm | engine / mlx-lm | other stacks | commit | date |\n",
    );
    out.push_str("|---|---|---|---|---|---|---|---|---|---|\n");
    for ((suite, model, metric), stacks) in &perf {
        if let Some(line) = perf_line(suite, model, metric, stacks) {
            out.push_str(&line);
        }
    }
    out.push_str("\nMedians of fresh-process legs in ABBA order (memory probes: one process); each row's tags and parameters are in the results DB. The static-λ study's per-run numbers are in docs/dynamic-lambda.md.\n");
}

/// A performance line from the newest row of each stack (None without any).
fn perf_line(
    suite: &str,
    model: &str,
    metric: &str,
    stacks: &BTreeMap<String, &Row>,
) -> Option<String> {
    let e = stacks.get("engine");
    let g = stacks.get("engine-eager");
    let p = stacks.get("mlx-lm");
    let unit = e.or(p).map(|r| r.unit.as_str()).unwrap_or("");
    let cell =
        |r: Option<&&Row>| r.map_or("-".to_owned(), |r| format!("{} {unit}", fmt_value(r.value)));
    let ratio = match (e, p) {
        (Some(e), Some(p)) if p.value > 0.0 => format!("{:.2}×", e.value / p.value),
        _ => "-".to_owned(),
    };
    // Tier presets and other peers (engine-l2, engine-l3, mlx-optiq, …).
    let others: Vec<String> = stacks
        .iter()
        .filter(|(k, _)| !["engine", "engine-eager", "mlx-lm"].contains(&k.as_str()))
        .map(|(k, r)| format!("{k} {} {}", fmt_value(r.value), r.unit))
        .collect();
    let others = if others.is_empty() {
        "-".to_owned()
    } else {
        others.join(", ")
    };
    let newest = e.or(p).or(g).or_else(|| stacks.values().next())?;
    Some(format!(
        "| {suite} | {model} | {} | {} | {} | {} | {ratio} | {others} | {} | {} |\n",
        metric.replace('_', " "),
        cell(e),
        cell(g),
        cell(p),
        newest.commit,
        date(&newest.ts)
    ))
}

/// One line per quality row.
fn quality_section(out: &mut String, rows: &[&Row]) {
    let quality: Vec<&Row> = rows
        .iter()
        .copied()
        .filter(|r| r.suite == "quality")
        .collect();
    if quality.is_empty() {
        out.push_str("No quality runs recorded yet.\n");
        return;
    }
    out.push_str("| model | metric | value | commit | date |\n|---|---|---|---|---|\n");
    for r in quality {
        out.push_str(&format!(
            "| {} | {} | {} {} | {} | {} |\n",
            r.model,
            r.metric,
            fmt_value(r.value),
            r.unit,
            r.commit,
            date(&r.ts)
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(suite: &str, model: &str, metric: &str, stack: &str, value: f64, unit: &str) -> Row {
        crate::db::RowContext {
            ts: "2026-11-29T18:00:00Z".into(),
            commit: "0123456789ab".into(),
            dirty: false,
            machine_key: "cpu-amd-epyc".into(),
            machine_state: r#"{"before":{"cores":2,"mem_total_mb":24000,"engine_version":"0.1.0","mlx_version":"0.32.2","oracle_versions":{"mlx-lm":"0.32.2","transformers":"5.12.1"}}}"#.into(),
            preflight: "clean".into(),
            tags: String::new(),
        }
        .row(suite, model, (metric, value, unit), stack, None, serde_json::json!({}))
    }

    #[test]
    fn results_md_snapshot() {
        let mut dirty = row("decode", "tiny", "decode_tps", "engine", 9999.0, "tok/s");
        dirty.preflight = "dirty".into();
        let rows = vec![
            row("decode", "tiny", "decode_tps", "engine", 812.4, "tok/s"),
            row("decode", "tiny", "decode_tps", "mlx-lm", 790.0, "tok/s"),
            row("decode", "tiny", "ttft_ms", "engine", 12.25, "ms"),
            row("decode", "tiny", "ttft_ms", "mlx-lm", 14.0, "ms"),
            row(
                "decode",
                "tiny",
                "decode_tps",
                "engine-eager",
                800.0,
                "tok/s",
            ),
            row(
                "parity-l1",
                "tiny-llama",
                "logit_vectors_bit_exact",
                "engine",
                85.0,
                "/85",
            ),
            dirty,
        ];
        let md = render(&rows);
        assert_eq!(md, render(&rows), "deterministic");
        assert!(!md.contains("9999"), "dirty rows are never rendered");
        insta::assert_snapshot!(md);
    }
}
