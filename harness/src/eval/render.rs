//! RESULTS.md's Quality table (`promote::quality_section` calls it): one line per model, run
//! parameters and tier, from the newest promotable `quality` rows of `harness eval`.

use std::collections::BTreeMap;

use crate::db::Row;

fn num(v: f64) -> String {
    if v != 0.0 && !(1e-2..1e5).contains(&v.abs()) {
        format!("{v:.3e}")
    } else {
        format!("{v:.4}")
    }
}

/// What a row's parameters say about the run, for the table: corpus, rows × length.
fn run_label(params: &str) -> String {
    let p: serde_json::Value = serde_json::from_str(params).unwrap_or_default();
    let corpus = p["corpus"].as_str().unwrap_or("?");
    let corpus = corpus.rsplit('/').next().unwrap_or(corpus);
    format!(
        "{corpus}, {}×{}, {} positions",
        p["num_samples"].as_u64().unwrap_or(0),
        p["sequence_length"].as_u64().unwrap_or(0),
        p["kl_positions"].as_u64().unwrap_or(0)
    )
}

/// (model, run) → stack → metric → the newest row (rows come newest first).
type Groups<'a> = BTreeMap<(String, String), BTreeMap<String, BTreeMap<String, &'a Row>>>;

/// The Quality table, or None without quality rows.
pub fn quality_table(rows: &[&Row]) -> Option<String> {
    let mut groups = Groups::new();
    for r in rows.iter().copied().filter(|r| r.suite == "quality") {
        groups
            .entry((r.model.clone(), run_label(&r.params)))
            .or_default()
            .entry(r.stack.clone())
            .or_default()
            .entry(r.metric.clone())
            .or_insert(r);
    }
    if groups.is_empty() {
        return None;
    }
    let mut out = String::from(
        "| model | held-out run | tier | KL(L1 ‖ tier) mean | KL max | top-1 = L1 | KL(L2 ‖ L3) mean / max | teacher-forced ppl | perplexity (mlx_lm.perplexity's computation) | commit | date |\n\
         |---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for ((model, run), stacks) in &groups {
        let engine = stacks.get("engine");
        let oracle = stacks.get("mlx-lm").and_then(|m| m.get("ppl"));
        for tier in ["l1", "l2", "l3"] {
            let Some(m) = stacks.get(&format!("engine-{tier}")) else {
                continue;
            };
            let cell = |k: &str, unit: &str| {
                m.get(k)
                    .map_or("-".to_owned(), |r| format!("{}{unit}", num(r.value)))
            };
            let ppl = match (tier, engine.and_then(|e| e.get("ppl"))) {
                ("l1", Some(e)) => match oracle {
                    Some(o) if o.value.to_bits() == e.value.to_bits() => {
                        format!("{} (mlx-lm: identical)", num(e.value))
                    }
                    Some(o) => format!("{} (mlx-lm: {}, DIFFERENT)", num(e.value), num(o.value)),
                    None => format!("{} (oracle not run)", num(e.value)),
                },
                _ => "-".to_owned(),
            };
            let vs_l2 = match (m.get("kl_mean_vs_l2"), m.get("kl_max_vs_l2")) {
                (Some(a), Some(b)) => format!("{} / {} nats", num(a.value), num(b.value)),
                _ => "-".to_owned(),
            };
            let newest = m.values().max_by(|a, b| a.ts.cmp(&b.ts)).unwrap();
            out.push_str(&format!(
                "| {model} | {run} | {} | {} | {} | {} | {vs_l2} | {} | {ppl} | {} | {} |\n",
                tier.to_uppercase(),
                cell("kl_mean", " nats"),
                cell("kl_max", " nats"),
                m.get("top1_agree")
                    .map_or("-".to_owned(), |r| format!("{:.1} %", r.value)),
                cell("tf_ppl", ""),
                newest.commit,
                newest.ts.get(..10).unwrap_or(&newest.ts)
            ));
        }
    }
    out.push_str(
        "\n`harness eval`: every row of held-out ids prefilled for 16 ids, then teacher-forced one id \
         per step (the decode path each tier runs); KL per position against L1's distribution (and, for \
         L3, against L2's: the perf path alone), top-1 = argmax agrees with L1's. The perplexity is mlx_lm.perplexity's computation (no cache, \
         batches of 8) on the engine; `--oracle` runs mlx-lm's own and must give the same double.\n",
    );
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(metric: &str, stack: &str, value: f64) -> Row {
        crate::db::RowContext {
            ts: "2026-12-01T23:00:00Z".into(),
            commit: "0123456789ab".into(),
            dirty: false,
            machine_key: "cpu-test".into(),
            machine_state: "{}".into(),
            preflight: "clean".into(),
            tags: "teacher-forced".into(),
        }
        .row(
            "quality",
            "tiny-llama-trained",
            (metric, value, ""),
            stack,
            None,
            serde_json::json!({"corpus": "goldens/eval/heldout.txt", "num_samples": 12,
                "sequence_length": 64, "kl_positions": 588}),
        )
    }

    #[test]
    fn one_line_per_tier_with_the_perplexity_on_l1() {
        let rows = [
            row("ppl", "engine", 20617601.92310078),
            row("ppl", "mlx-lm", 20617601.92310078),
            row("kl_mean", "engine-l1", 0.0),
            row("kl_mean", "engine-l3", 1.5e-3),
            row("kl_max", "engine-l3", 2.0e-2),
            row("top1_agree", "engine-l3", 99.5),
            row("tf_ppl", "engine-l3", 31.25),
            row("kl_mean_vs_l2", "engine-l3", 1.8e-4),
            row("kl_max_vs_l2", "engine-l3", 1.4e-3),
        ];
        let refs: Vec<&Row> = rows.iter().collect();
        let md = quality_table(&refs).unwrap();
        assert!(
            md.contains(
                "| tiny-llama-trained | heldout.txt, 12×64, 588 positions | L1 | 0.0000 nats |"
            ),
            "{md}"
        );
        assert!(md.contains("2.062e7 (mlx-lm: identical)"), "{md}");
        assert!(
            md.contains("| L3 | 1.500e-3 nats | 0.0200 nats | 99.5 % | 1.800e-4 / 1.400e-3 nats | 31.2500 | - |"),
            "{md}"
        );
        assert!(!md.contains("| L2 |"));
        assert!(quality_table(&[]).is_none());
    }
}
