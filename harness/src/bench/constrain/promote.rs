//! RESULTS.md's table of the constrain suite.

use super::{PLAIN, SCHEMA};
use crate::db::Row;

/// RESULTS.md's "Structured outputs: mask cost" table from promotable rows (None without
/// constrain rows): per model, its newest run.
pub fn promote_table(rows: &[&Row]) -> Option<String> {
    let mine: Vec<&Row> = rows
        .iter()
        .copied()
        .filter(|r| r.suite == "constrain")
        .collect();
    let mut models: Vec<&str> = mine.iter().map(|r| r.model.as_str()).collect();
    models.sort();
    models.dedup();
    if models.is_empty() {
        return None;
    }
    let mut out = String::from(
        "\n#### Structured outputs: mask cost\n\n\
         | model | vocab | plain decode | json-schema decode | ratio | cost | added per token | mask alone (bias array) | tokens (plain / constrained) | commit | date |\n\
         |---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for model in models {
        let newest = mine
            .iter()
            .filter(|r| r.model == model)
            .map(|r| r.ts.as_str())
            .max()?;
        let run: Vec<&Row> = mine
            .iter()
            .copied()
            .filter(|r| r.model == model && r.ts == newest)
            .collect();
        let get = |stack: &str, metric: &str| {
            run.iter()
                .find(|r| r.stack == stack && r.metric == metric)
                .map(|r| r.value)
        };
        let f = |v: Option<f64>, unit: &str, digits: usize| {
            v.map_or("-".to_owned(), |v| format!("{v:.digits$}{unit}"))
        };
        let vocab = serde_json::from_str::<serde_json::Value>(&run[0].params)
            .ok()
            .and_then(|p| p["vocab"].as_i64())
            .map_or("-".to_owned(), |v| v.to_string());
        let tokens = match (
            get(PLAIN, "generated_tokens"),
            get(SCHEMA, "generated_tokens"),
        ) {
            (Some(a), Some(b)) => {
                let done = if get(SCHEMA, "answer_complete") == Some(1.0) {
                    ", complete"
                } else {
                    ""
                };
                format!("{a:.0} / {b:.0}{done}")
            }
            _ => "-".to_owned(),
        };
        let mask = match (
            get(SCHEMA, "mask_us_per_token"),
            get(SCHEMA, "bias_us_per_token"),
        ) {
            (Some(m), Some(b)) => format!("{m:.0} µs ({b:.0} µs)"),
            (m, _) => f(m, " µs", 0),
        };
        // Where the run kept its legs: the paired rounds' ratio and its interval.
        let ratio = run
            .iter()
            .find(|r| r.stack == SCHEMA && r.metric == "decode_ratio_vs_plain")
            .and_then(|r| crate::bench::spread::RatioInterval::of_params(&r.params))
            .map_or_else(
                || f(get(SCHEMA, "decode_ratio_vs_plain"), "×", 3),
                |i| i.cell(),
            );
        out.push_str(&format!(
            "| {model} | {vocab} | {} | {} | {} | {} | {} | {} | {tokens} | {} | {} |\n",
            f(get(PLAIN, "decode_tps"), " tok/s", 1),
            f(get(SCHEMA, "decode_tps"), " tok/s", 1),
            ratio,
            f(get(SCHEMA, "decode_cost_pct"), " %", 1),
            f(get(SCHEMA, "added_us_per_token"), " µs", 0),
            mask,
            run[0].commit,
            run[0].ts.get(..10).unwrap_or(&run[0].ts),
        ));
    }
    out.push_str(
        "\nGreedy decoding of the same prompt ids, plain vs constrained to a JSON schema (`harness bench --suite constrain`): \
         medians of fresh-process legs in ABBA order, decode tok/s over the tokens each leg generated. \
         Cost = 1 − ratio; added per token = 1/constrained − 1/plain; mask alone = llguidance's mask and its \
         application to the logits, replayed over the same ids outside the timed run (in brackets: the part \
         that is building the −∞/0 bias array over the vocabulary and adding it, without llguidance).\n",
    );
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::db::RowContext;

    #[test]
    fn promote_renders_the_newest_run_per_model() {
        let ctx = |ts: &str| RowContext {
            ts: ts.into(),
            commit: "0123456789ab".into(),
            dirty: false,
            machine_key: "m".into(),
            machine_state: "{}".into(),
            preflight: "clean".into(),
            tags: String::new(),
        };
        let params = serde_json::json!({"vocab": 151936, "max_tokens": 128});
        let mut rows: Vec<Row> = super::super::tests::result()
            .rows()
            .into_iter()
            .map(|(s, m, v, u)| {
                ctx("2026-12-02T08:00:00Z").row(
                    "constrain",
                    "qwen3-vocab-tiny",
                    (m, v, u),
                    s,
                    None,
                    params.clone(),
                )
            })
            .collect();
        // An older run's number never shows.
        rows.push(ctx("2026-12-01T08:00:00Z").row(
            "constrain",
            "qwen3-vocab-tiny",
            ("decode_tps", 7.0, "tok/s"),
            PLAIN,
            None,
            params.clone(),
        ));
        rows.push(ctx("2026-12-01T08:00:00Z").row(
            "decode",
            "tiny",
            ("decode_tps", 5.0, "tok/s"),
            "engine",
            None,
            params,
        ));
        let refs: Vec<&Row> = rows.iter().collect();
        let md = promote_table(&refs).unwrap();
        assert!(
            md.contains("| qwen3-vocab-tiny | 151936 | 110.0 tok/s | 90.0 tok/s | 0.818× | 18.2 % | 2020 µs | 250 µs (125 µs) | 128 / 128 | 0123456789ab | 2026-12-02 |"),
            "{md}"
        );
        assert!(!md.contains("7.0 tok/s") && !md.contains("| tiny |"));
        assert!(promote_table(&refs[refs.len() - 1..]).is_none());
    }
}
