//! What a machine's committed section keeps when `harness promote` renders it again. The
//! results DB lives in one checkout's cache dir. A new machine of the same key starts with
//! an empty one, and its first promote must not drop the rows earlier runs recorded. A
//! table row of the committed section stays unless the new rendering has a row with the same
//! key, where the key is its identifying cells (suite, model, metric, tier, check …). A
//! subsection the new rendering lacks, or has only as a "No … recorded yet." line, stays
//! whole. A plot link stays unless the new rendering links the same file.

/// Column names that identify a row (the leading ones of each table's header).
const KEY_COLUMNS: [&str; 7] = [
    "suite",
    "model",
    "metric",
    "tier",
    "check",
    "held-out run",
    "vocab",
];

/// `new` (a machine section rendered from the DB) with what `old` (the same machine's
/// committed section) has and `new` lacks.
pub(super) fn carry_over(old: &str, new: &str) -> String {
    let old = Section::parse(old);
    let mut new = Section::parse(new);
    for line in new.head.iter_mut() {
        if let Some(was) = old.head.iter().find(|l| l.starts_with(HEADER_START)) {
            if line.starts_with(HEADER_START) {
                *line = merge_header(was, line);
            }
        }
    }
    for (i, (heading, body)) in old.parts.iter().enumerate() {
        match new.parts.iter_mut().find(|(h, _)| h == heading) {
            Some((_, mine)) => *mine = merge_body(body, mine),
            None => {
                // After the last part before it (in the old order) that the new one has.
                let at = old.parts[..i]
                    .iter()
                    .rev()
                    .find_map(|(h, _)| new.parts.iter().position(|(n, _)| n == h))
                    .map_or(new.parts.len(), |p| p + 1);
                new.parts.insert(at, (heading.clone(), body.clone()));
            }
        }
    }
    new.render()
}

/// How a section's machine/toolchain line starts (`promote::header`).
const HEADER_START: &str = "machine `";

/// The peers whose versions the header names.
const PEERS: [&str; 3] = ["mlx-lm", "mlx-optiq", "transformers"];

/// The `new` header line, plus the peers' versions `old` names and `new` does not (rows of
/// the carried section were measured against them; a new engine-only run records none).
fn merge_header(old: &str, new: &str) -> String {
    let peer_of = |part: &str| {
        part.rsplit_once(' ')
            .map(|(k, _)| k)
            .filter(|k| PEERS.contains(k))
            .map(str::to_owned)
    };
    let named: Vec<String> = new.split(" · ").filter_map(peer_of).collect();
    let mut line = new.to_owned();
    for part in old.split(" · ") {
        if peer_of(part).is_some_and(|k| !named.contains(&k)) {
            line.push_str(" · ");
            line.push_str(part);
        }
    }
    line
}

/// A section as its lines before the first subsection heading, then (heading, body) parts.
struct Section {
    head: Vec<String>,
    parts: Vec<(String, Vec<String>)>,
}

impl Section {
    fn parse(text: &str) -> Section {
        let mut s = Section {
            head: Vec::new(),
            parts: Vec::new(),
        };
        for line in text.lines() {
            if line.starts_with("### ") || line.starts_with("#### ") {
                s.parts.push((line.to_owned(), Vec::new()));
            } else if let Some((_, body)) = s.parts.last_mut() {
                body.push(line.to_owned());
            } else {
                s.head.push(line.to_owned());
            }
        }
        s
    }

    fn render(&self) -> String {
        let mut lines = self.head.clone();
        for (h, body) in &self.parts {
            lines.push(h.clone());
            lines.extend(body.iter().cloned());
        }
        format!("{}\n", lines.join("\n").trim_end())
    }
}

fn is_table_line(l: &str) -> bool {
    l.starts_with('|')
}

fn is_separator(l: &str) -> bool {
    l.starts_with("|---")
}

fn cells(l: &str) -> Vec<&str> {
    l.trim()
        .trim_matches('|')
        .split('|')
        .map(str::trim)
        .collect()
}

/// The plot file a `![caption](path)` line links (None: not a plot link).
fn plot_target(l: &str) -> Option<&str> {
    l.strip_prefix("![")?.rsplit_once("](")?.1.strip_suffix(')')
}

/// One part's body: `new`'s, plus `old`'s rows and plot links it lacks; `old`'s whole
/// where `new` has neither a table nor a plot.
fn merge_body(old: &[String], new: &[String]) -> Vec<String> {
    let has_content = |b: &[String]| b.iter().any(|l| is_table_line(l) || l.starts_with("!["));
    if !has_content(new) {
        return if has_content(old) {
            old.to_vec()
        } else {
            new.to_vec()
        };
    }
    let mut out = Vec::with_capacity(new.len());
    let mut i = 0;
    while i < new.len() {
        let line = &new[i];
        if is_table_line(line) && new.get(i + 1).is_some_and(|l| is_separator(l)) {
            let end = (i + 2..new.len())
                .find(|&j| !is_table_line(&new[j]))
                .unwrap_or(new.len());
            out.extend(merge_table(old, &new[i..end]));
            i = end;
            continue;
        }
        out.push(line.clone());
        i += 1;
    }
    // Plot links of the old body that the new one lacks, after the new ones.
    let linked: Vec<&str> = new.iter().filter_map(|l| plot_target(l)).collect();
    let missing: Vec<String> = old
        .iter()
        .filter(|l| plot_target(l).is_some_and(|t| !linked.contains(&t)))
        .cloned()
        .collect();
    if !missing.is_empty() {
        let at = out
            .iter()
            .rposition(|l| plot_target(l).is_some())
            .map_or(out.len(), |p| p + 1);
        out.splice(at..at, missing);
    }
    out
}

/// `table` (header, separator, rows) with the rows of `old`'s table of the same header whose
/// key it lacks, all rows in key order.
fn merge_table(old: &[String], table: &[String]) -> Vec<String> {
    let header = &table[0];
    let width = cells(header)
        .iter()
        .take_while(|c| KEY_COLUMNS.contains(c))
        .count()
        .max(1);
    let key = |l: &str| -> Vec<String> {
        cells(l)
            .into_iter()
            .take(width)
            .map(str::to_owned)
            .collect()
    };
    let Some(start) = old.iter().position(|l| l == header) else {
        return table.to_vec();
    };
    let old_rows = old[start + 1..]
        .iter()
        .take_while(|l| is_table_line(l))
        .filter(|l| !is_separator(l));
    let mut rows: Vec<String> = table[2..].to_vec();
    let have: Vec<Vec<String>> = rows.iter().map(|r| key(r)).collect();
    let carried: Vec<String> = old_rows
        .filter(|r| !have.contains(&key(r)))
        .cloned()
        .collect();
    if carried.is_empty() {
        return table.to_vec();
    }
    rows.extend(carried);
    rows.sort_by_key(|r| key(r));
    let mut out = table[..2].to_vec();
    out.extend(rows);
    out
}

#[cfg(test)]
mod tests {
    use super::carry_over;

    const OLD: &str = "## Machine `m`\n\nmachine `m` · old\n\n### Parity\n\nNo parity runs recorded yet.\n\n\
### Performance\n\n| suite | model | metric | engine | commit | date |\n|---|---|---|---|---|---|\n\
| decode | small | decode tps | 14 tok/s | a | d1 |\n| decode | tiny | decode tps | 170 tok/s | a | d1 |\n\
| serve | tiny | ttft ms | 9 ms | a | d1 |\n\n#### Plots\n\n![old plot](docs/plots/p1.svg)\n![shared](docs/plots/p2.svg)\n\n\
### Quality\n\n| model | held-out run | tier | kl | commit | date |\n|---|---|---|---|---|---|\n| t | h | L1 | 0 | a | d1 |\n";

    const NEW: &str = "## Machine `m`\n\nmachine `m` · new\n\n### Parity\n\nNo parity runs recorded yet.\n\n\
### Performance\n\n| suite | model | metric | engine | commit | date |\n|---|---|---|---|---|---|\n\
| decode | small | decode tps | 17 tok/s | b | d2 |\n| train | tiny | step ms | 168 ms | b | d2 |\n\n\
Medians of legs.\n\n#### Structured outputs: mask cost\n\n| model | vocab | plain decode | commit | date |\n|---|---|---|---|---|\n\
| q | 151936 | 23 tok/s | b | d2 |\n\n#### Plots\n\n![shared, newer](docs/plots/p2.svg)\n\n### Quality\n\nNo quality runs recorded yet.\n";

    #[test]
    fn the_new_rendering_wins_and_nothing_old_is_dropped() {
        let got = carry_over(OLD, NEW);
        let perf: Vec<&str> = got
            .lines()
            .filter(|l| {
                l.starts_with("| decode") || l.starts_with("| serve") || l.starts_with("| train")
            })
            .collect();
        assert_eq!(
            perf,
            [
                "| decode | small | decode tps | 17 tok/s | b | d2 |",
                "| decode | tiny | decode tps | 170 tok/s | a | d1 |",
                "| serve | tiny | ttft ms | 9 ms | a | d1 |",
                "| train | tiny | step ms | 168 ms | b | d2 |",
            ],
            "{got}"
        );
        assert!(
            got.contains("machine `m` · new") && !got.contains("· old"),
            "{got}"
        );
        assert!(got.contains("| q | 151936 |"), "{got}");
        // The quality table the new rendering lacks stays; its placeholder goes.
        assert!(
            got.contains("| t | h | L1 | 0 | a | d1 |") && !got.contains("No quality"),
            "{got}"
        );
        // The plot the new rendering also links is linked once, with its new caption.
        assert_eq!(got.matches("docs/plots/p2.svg").count(), 1, "{got}");
        assert!(got.contains("![shared, newer]") && got.contains("![old plot](docs/plots/p1.svg)"));
        // Merging again changes nothing.
        assert_eq!(carry_over(&got, &got), got);
    }

    /// A new engine-only run names no peer: the carried rows' peers stay named, and a peer
    /// the new line names keeps its new version.
    #[test]
    fn the_header_keeps_the_peer_versions_the_new_run_lacks() {
        let old = "## Machine `m`\n\nmachine `m` · MLX 1 · mlx-lm 0.32.2 · mlx-optiq 0.7.7 · transformers 5.12.1\n";
        let new = "## Machine `m`\n\nmachine `m` · MLX 2 · mlx-optiq 0.8.0\n";
        let got = carry_over(old, new);
        assert!(
            got.contains(
                "machine `m` · MLX 2 · mlx-optiq 0.8.0 · mlx-lm 0.32.2 · transformers 5.12.1\n"
            ),
            "{got}"
        );
        assert!(!got.contains("0.7.7") && !got.contains("MLX 1"), "{got}");
    }

    #[test]
    fn a_table_keyed_by_fewer_columns_replaces_its_rows() {
        let old = "## Machine `m`\n\n#### Mask\n\n| model | vocab | plain | date |\n|---|---|---|---|\n| q | 1 | 5 | d1 |\n| t | 2 | 6 | d1 |\n";
        let new = "## Machine `m`\n\n#### Mask\n\n| model | vocab | plain | date |\n|---|---|---|---|\n| q | 1 | 7 | d2 |\n";
        let got = carry_over(old, new);
        assert!(
            got.contains("| q | 1 | 7 | d2 |") && !got.contains("| q | 1 | 5 |"),
            "{got}"
        );
        assert!(got.contains("| t | 2 | 6 | d1 |"), "{got}");
    }
}
