//! `harness promote`: renders RESULTS.md from the newest promotable rows of the results DB
//! (preflight clean, not tagged went-dirty). The renderer is a pure function of the rows, so
//! the same rows always give the same bytes (snapshot-tested).

use std::collections::BTreeMap;

use crate::db::Row;

mod carry;

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
    // The peers' versions from the newest row that ran them (an engine-only run, say
    // `--no-peer`, records none).
    let mut newest_first: Vec<&&Row> = rows.iter().collect();
    newest_first.sort_by(|a, b| b.ts.cmp(&a.ts));
    let versions = newest_first.iter().find_map(|r| {
        let state: serde_json::Value = serde_json::from_str(&r.machine_state).ok()?;
        let s = state.get("before").unwrap_or(&state);
        s.get("oracle_versions")?.as_object().cloned()
    });
    if let Some(map) = versions {
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
            p.get("method").and_then(|v| v.as_str()),
        ) {
            (Some(mode), Some(seq), _) => format!("{mode}, seq {seq}"),
            // Train rows: one line per method (ORPO's and GRPO's legs share stack names).
            (_, _, Some(method)) => method.to_owned(),
            _ => return None,
        },
    };
    let label = match p.get("engine_batch").and_then(|v| v.as_u64()) {
        Some(b) => format!("{label}, engine --batch {b}"),
        None => label,
    };
    // Restart rows measured through the server, with or without quantized KV.
    let label = match (
        p.get("via").and_then(|v| v.as_str()),
        p.get("kv_config").and_then(|v| v.as_str()),
    ) {
        (Some(via), Some(kv)) => format!("{label}, via {via}, kv_config {kv}"),
        (Some(via), None) => format!("{label}, via {via}"),
        _ => label,
    };
    // Distributed rows: how many ranks, split which way.
    Some(
        match (
            p.get("ranks").and_then(|v| v.as_u64()),
            p.get("split").and_then(|v| v.as_str()),
        ) {
            (Some(1), _) => format!("{label}, 1 rank"),
            (Some(n), Some(split)) => format!("{label}, {split} ×{n}"),
            _ => label,
        },
    )
}

/// The heading that opens one machine's section: "## Machine `<key>`".
const MACHINE_HEADING: &str = "## Machine `";

const INTRO: &str = "# Results\n\nWritten by `harness promote` from preflight-clean rows of the results DB; do not edit by hand. \
One section per machine: a promote rewrites the section of the machine it runs on, from that machine's DB, and keeps every \
other machine's section as it was.\n";

/// RESULTS.md for `rows` (already filtered to promotable ones): one section per machine.
pub fn render(rows: &[Row]) -> String {
    let mut sections = BTreeMap::new();
    for key in rows.iter().map(|r| r.machine_key.clone()) {
        if let std::collections::btree_map::Entry::Vacant(e) = sections.entry(key) {
            let section = machine_section(e.key(), rows);
            e.insert(section);
        }
    }
    document(&sections)
}

/// RESULTS.md as `harness promote` on `machine` writes it: that machine's section rendered
/// from its rows of `rows`, with the table rows, plot links and subsections of its committed
/// section that the rendering lacks carried over (`carry`: a new machine's DB starts empty),
/// every other machine's section of `existing` (the current RESULTS.md) kept byte for byte.
/// Rows of other machines are not used (this DB holds only part of their history); with no
/// promotable row of `machine`, its existing section stays too. Returns the text and how
/// many rows it was rendered from.
pub fn merge(existing: Option<&str>, machine: &str, rows: &[Row]) -> (String, usize) {
    let mut sections = existing.map(sections).unwrap_or_default();
    let mine: Vec<Row> = rows
        .iter()
        .filter(|r| r.machine_key == machine && promotable(r))
        .cloned()
        .collect();
    if !mine.is_empty() || !sections.contains_key(machine) {
        let fresh = machine_section(machine, &mine);
        let section = match sections.get(machine) {
            Some(committed) => carry::carry_over(committed, &fresh),
            None => fresh,
        };
        sections.insert(machine.to_owned(), section);
    }
    (document(&sections), mine.len())
}

fn document(sections: &BTreeMap<String, String>) -> String {
    let mut out = String::from(INTRO);
    for section in sections.values() {
        out.push('\n');
        out.push_str(section);
    }
    out
}

/// The machine sections of a RESULTS.md, by machine key, each from its heading to the next
/// (ending in one newline). A file from before per-machine sections (one machine, named in
/// its header line) becomes that machine's section, its headings one level down.
pub fn sections(md: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut current: Option<(String, String)> = None;
    for line in md.split_inclusive('\n') {
        if let Some(rest) = line.strip_prefix(MACHINE_HEADING) {
            if let Some((key, text)) = current.take() {
                out.insert(key, finish(text));
            }
            let key = rest.split('`').next().unwrap_or("").to_owned();
            current = Some((key, line.to_owned()));
        } else if let Some((_, text)) = current.as_mut() {
            text.push_str(line);
        }
    }
    if let Some((key, text)) = current {
        out.insert(key, finish(text));
    }
    if out.is_empty() {
        if let Some((key, section)) = legacy_section(md) {
            out.insert(key, section);
        }
    }
    out
}

/// The one machine of a RESULTS.md without machine headings: its header line names it
/// ("machine `<key>` · …"); the section runs from there to the end.
fn legacy_section(md: &str) -> Option<(String, String)> {
    let at = md.find("\nmachine `")? + 1;
    let key = md[at + "machine `".len()..].split('`').next()?.to_owned();
    let body: String = md[at..]
        .split_inclusive('\n')
        .map(|l| match l.strip_prefix("## ") {
            Some(rest) => format!("### {rest}"),
            None => l.to_owned(),
        })
        .collect();
    Some((
        key.clone(),
        finish(format!("{MACHINE_HEADING}{key}`\n\n{body}")),
    ))
}

/// `text` with exactly one trailing newline.
fn finish(text: String) -> String {
    format!("{}\n", text.trim_end())
}

fn promotable(r: &Row) -> bool {
    r.preflight == "clean" && r.suite != "lambda-sweep"
}

/// One machine's section: its header line, then parity, performance and quality.
fn machine_section(machine: &str, rows: &[Row]) -> String {
    // The λ study is per run and seed; its table lives in docs/dynamic-lambda.md.
    let rows: Vec<&Row> = rows
        .iter()
        .filter(|r| r.machine_key == machine && promotable(r))
        .collect();
    let mut out = format!("{MACHINE_HEADING}{machine}`\n\n");
    out.push_str(&header(&rows));
    out.push_str("\n\n### Parity\n\n");
    parity_section(&mut out, &rows);
    out.push_str("\n### Performance\n\n");
    performance_section(&mut out, &rows);
    plots_section(&mut out, machine, &rows);
    out.push_str("\n### Quality\n\n");
    quality_section(&mut out, &rows);
    out
}

/// Where `harness promote` writes the plots, relative to the repository root (RESULTS.md's
/// directory).
pub const PLOTS_DIR: &str = "docs/plots";

/// The plots of `machine`'s section, from its promotable rows of `rows` (what
/// `harness promote` writes under PLOTS_DIR; the section links them).
pub fn plots(machine: &str, rows: &[Row]) -> Vec<crate::plot::results::Plot> {
    let mine: Vec<&Row> = rows
        .iter()
        .filter(|r| r.machine_key == machine && promotable(r))
        .collect();
    crate::plot::results::plots(machine, &mine)
}

/// Links to the section's plots, if any.
fn plots_section(out: &mut String, machine: &str, rows: &[&Row]) {
    let plots = crate::plot::results::plots(machine, rows);
    if plots.is_empty() {
        return;
    }
    out.push_str("\n#### Plots\n\n");
    for p in plots {
        out.push_str(&format!("![{}]({PLOTS_DIR}/{})\n", p.caption, p.file));
    }
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

/// (suite, model with its run parameters, metric) → stack → its row of the newest run.
type PerfTable<'a> = BTreeMap<(String, String, String), BTreeMap<String, &'a Row>>;

/// The performance rows (neither parity nor quality), the newest run's per line.
fn perf_table<'a>(rows: &[&'a Row]) -> PerfTable<'a> {
    let mut perf = PerfTable::new();
    for r in rows.iter().copied().filter(|r| {
        !r.suite.starts_with("parity") && !["quality", "constrain"].contains(&r.suite.as_str())
    }) {
        // Runs with other parameters (e.g. a longer prompt) are separate rows of the table.
        let model = match params_label(&r.params) {
            Some(label) => format!("{} ({label})", r.model),
            None => r.model.clone(),
        };
        // Rows come newest first: the newest run of each line is the one to show, all its
        // stacks from that run (one recording shares one timestamp), so a ratio never
        // divides one run's engine by another run's peer.
        let stacks = perf
            .entry((r.suite.clone(), model, r.metric.clone()))
            .or_default();
        let run = stacks.values().next().map(|first| first.ts.as_str());
        if run.is_none_or(|ts| ts == r.ts) {
            stacks.entry(r.stack.clone()).or_insert(r);
        }
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
    out.push_str("\nMedians of fresh-process legs in ABBA order (memory probes: one process); each row's tags and parameters are in the results DB. Where a run kept its legs (every suite's runs since `--rounds auto`), the ratio is the median of the paired rounds' ratios, followed by its exact 95 % interval, marked wide when it is wider than ±3 % of the ratio (docs/harness.md). The static-λ study's per-run numbers are in docs/dynamic-lambda.md.\n");
    // The constrain suite's rows have a table of their own.
    if let Some(table) = crate::bench::constrain::promote_table(rows) {
        out.push_str(&table);
    }
    if let Some(table) = crate::bench::train_promote::promote_table(rows) {
        out.push_str(&table);
    }
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
        (Some(e), Some(p)) if p.value > 0.0 => ratio_cell(e, e.value / p.value),
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

/// An engine row's ratio to its peer: where its run kept its legs (decode suite since
/// `--rounds auto`), the median of the paired rounds' ratios with its interval `[lo–hi]`,
/// marked `wide` past `--rounds auto`'s bound; else the ratio of the medians.
fn ratio_cell(engine: &Row, of_medians: f64) -> String {
    crate::bench::spread::RatioInterval::of_params(&engine.params)
        .map_or_else(|| format!("{of_medians:.2}×"), |i| i.cell())
}

/// The Quality table of `harness eval`'s rows (harness::eval::render).
fn quality_section(out: &mut String, rows: &[&Row]) {
    match crate::eval::render::quality_table(rows) {
        Some(table) => out.push_str(&table),
        None => out.push_str("No quality runs recorded yet.\n"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(suite: &str, model: &str, metric: &str, stack: &str, value: f64, unit: &str) -> Row {
        on("cpu-amd-epyc", suite, model, metric, stack, value, unit)
    }

    fn on(
        machine: &str,
        suite: &str,
        model: &str,
        metric: &str,
        stack: &str,
        value: f64,
        unit: &str,
    ) -> Row {
        crate::db::RowContext {
            ts: "2026-11-29T18:00:00Z".into(),
            commit: "0123456789ab".into(),
            dirty: false,
            machine_key: machine.into(),
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

    /// A ratio whose run kept its legs shows their interval, marked wide past ±3 %; a row
    /// without one shows the ratio alone.
    #[test]
    fn ratios_show_their_interval_and_wide_ones_are_marked() {
        let with = |lo: f64, hi: f64| {
            let mut r = row("decode", "tiny", "decode_tps", "engine", 110.0, "tok/s");
            r.params = serde_json::json!({"ratio_interval": {
                "median": 1.1, "lo": lo, "hi": hi, "coverage": 0.969, "rounds": 6}})
            .to_string();
            r
        };
        let line = |e: Row| {
            let peer = row("decode", "tiny", "decode_tps", "mlx-lm", 100.0, "tok/s");
            let stacks: BTreeMap<String, &Row> =
                [("engine".to_owned(), &e), ("mlx-lm".to_owned(), &peer)].into();
            perf_line("decode", "tiny", "decode_tps", &stacks).unwrap()
        };
        assert!(line(with(1.08, 1.12)).contains("| 1.10× [1.08–1.12] |"));
        assert!(line(with(0.95, 1.3)).contains("| 1.10× [0.95–1.30] wide |"));
        let plain = row("decode", "tiny", "decode_tps", "engine", 110.0, "tok/s");
        assert!(line(plain).contains("| 1.10× |"));
    }

    /// A line's stacks all come from its newest run: an older run's peer never completes
    /// a newer run's engine (nor its ratio).
    /// An engine-only run (no peer, no oracle versions recorded) after a run with peers: the
    /// header still names the peers' versions the rows below were measured against.
    #[test]
    fn the_header_keeps_the_peer_versions_after_an_engine_only_run() {
        let with_peer = on("m", "serve", "tiny", "decode_tps", "mlx-lm", 1.0, "tok/s");
        let mut engine_only = on("m", "spec", "tiny", "decode_tps", "engine", 1.0, "tok/s");
        engine_only.ts = "2026-11-30T18:00:00Z".into();
        engine_only.machine_state = r#"{"before":{"cores":2,"mlx_version":"0.32.2"}}"#.into();
        let line = header(&[&with_peer, &engine_only]);
        assert!(
            line.contains("mlx-lm 0.32.2 · transformers 5.12.1"),
            "{line}"
        );
    }

    #[test]
    fn a_line_never_mixes_runs() {
        let at = |ts: &str, stack: &str, value: f64| {
            let mut r = row("decode", "tiny", "decode_tps", stack, value, "tok/s");
            r.ts = ts.into();
            r
        };
        // Newest first, as the DB returns them.
        let rows = vec![
            at("2026-11-30T10:00:00Z", "engine", 120.0),
            at("2026-11-29T10:00:00Z", "engine", 100.0),
            at("2026-11-29T10:00:00Z", "mlx-lm", 110.0),
        ];
        let refs: Vec<&Row> = rows.iter().collect();
        let perf = perf_table(&refs);
        let stacks = perf.values().next().expect("one line");
        assert_eq!(stacks.len(), 1, "only the newest run's stacks");
        assert_eq!(stacks["engine"].value, 120.0);
        let md = render(&rows);
        assert!(md.contains("| 120 tok/s | - | - | - |"), "{md}");
    }

    /// A RESULTS.md from before per-machine sections (one machine, `##` headings).
    const LEGACY: &str = "# Results\n\nWritten by `harness promote` from preflight-clean rows of the results DB; do not edit by hand.\n\n\
machine `cpu-amd-epyc` · 2 cores · 24 GB RAM\n\n## Parity\n\n| tier | model | check | result | commit | date |\n|---|---|---|---|---|---|\n\
| l1 | tiny-llama | logit vectors bit exact | 85/85 | 913f1136bd36 | 2026-11-29 |\n\n## Performance\n\nNo performance runs recorded yet.\n\n\
## Quality\n\nNo quality runs recorded yet.\n";

    #[test]
    fn promote_keeps_the_sections_of_other_machines() {
        let rows = vec![
            on(
                "cpu-intel-xeon-processor",
                "decode",
                "tiny",
                "decode_tps",
                "engine",
                95.0,
                "tok/s",
            ),
            // A row of the other machine in this DB is not used: its section stays as it was.
            row("decode", "tiny", "decode_tps", "engine", 777.0, "tok/s"),
        ];
        let (md, used) = merge(Some(LEGACY), "cpu-intel-xeon-processor", &rows);
        assert_eq!(used, 1);
        let s = sections(&md);
        assert_eq!(
            s.keys().collect::<Vec<_>>(),
            ["cpu-amd-epyc", "cpu-intel-xeon-processor"]
        );
        // The old machine's lines, byte for byte (its headings one level down).
        for line in LEGACY.lines().skip(3) {
            let line = line
                .strip_prefix("## ")
                .map_or(line.to_owned(), |l| format!("### {l}"));
            assert!(s["cpu-amd-epyc"].contains(&line), "lost: {line}");
        }
        assert!(!md.contains("777"));
        assert!(s["cpu-intel-xeon-processor"].contains("| decode | tiny | decode tps | 95 tok/s |"));
        // Promoting again is a fixed point, and new rows replace only this machine's section.
        assert_eq!(merge(Some(&md), "cpu-intel-xeon-processor", &rows).0, md);
        let newer = vec![on(
            "cpu-intel-xeon-processor",
            "decode",
            "tiny",
            "decode_tps",
            "engine",
            97.0,
            "tok/s",
        )];
        let (md2, _) = merge(Some(&md), "cpu-intel-xeon-processor", &newer);
        assert_eq!(sections(&md2)["cpu-amd-epyc"], s["cpu-amd-epyc"]);
        assert!(md2.contains("97 tok/s") && !md2.contains("95 tok/s"));
        // No promotable row of this machine: its section is kept too.
        assert_eq!(merge(Some(&md2), "cpu-intel-xeon-processor", &[]).0, md2);
    }

    #[test]
    fn the_committed_results_md_survives_a_promote_elsewhere() {
        let committed = include_str!("../../RESULTS.md");
        let rows = vec![on(
            "some-other-machine",
            "decode",
            "tiny",
            "decode_tps",
            "engine",
            1.0,
            "tok/s",
        )];
        let (md, _) = merge(Some(committed), "some-other-machine", &rows);
        for line in committed
            .lines()
            .filter(|l| l.starts_with('|') || l.starts_with("machine `"))
        {
            assert!(md.contains(line), "promote elsewhere dropped: {line}");
        }
    }

    #[test]
    fn a_context_sweep_is_plotted_and_linked() {
        let rows: Vec<Row> = [256, 1024]
            .iter()
            .flat_map(|&n| {
                ["engine", "mlx-lm"].map(|stack| {
                    let mut r = row("decode", "tiny", "decode_tps", stack, 90.0, "tok/s");
                    r.params =
                        serde_json::json!({"prompt_tokens": n, "max_tokens": 128}).to_string();
                    r.tags = "median-of-3 abba context-sweep".into();
                    r
                })
            })
            .collect();
        let md = render(&rows);
        let file = "cpu-amd-epyc-decode-context-tiny.svg";
        assert!(
            md.contains(&format!(
                "#### Plots\n\n![decode tok/s vs prompt length, tiny (commit 0123456789ab)](docs/plots/{file})\n"
            )),
            "{md}"
        );
        let mine = plots("cpu-amd-epyc", &rows);
        assert_eq!(mine.len(), 1);
        assert_eq!(mine[0].file, file);
        assert!(plots("another-machine", &rows).is_empty());
    }

    #[test]
    fn distributed_rows_name_their_split() {
        let p = |v: serde_json::Value| params_label(&v.to_string()).unwrap();
        let base = serde_json::json!({"prompt_tokens": 256, "max_tokens": 128});
        let with = |ranks: u64, split: &str| {
            let mut v = base.clone();
            v["ranks"] = ranks.into();
            v["split"] = split.into();
            p(v)
        };
        assert_eq!(with(1, "single"), "prompt 256, 128 new, 1 rank");
        assert_eq!(with(2, "tensor"), "prompt 256, 128 new, tensor ×2");
        assert_eq!(p(base), "prompt 256, 128 new");
    }
}
