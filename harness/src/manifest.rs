//! The one manifest of tiny models, `goldens/models/manifest.json` (compiled in): one row per
//! directory under goldens/models — its name, the oracle maker and seed that write it
//! (`oracles/make_models.py NAME`), its `model_type`, the models it is made from, the parity
//! gates whose models it is and the gates that load it besides their models (drafters). The
//! gate table's model lists are read from here, so a new tiny model joins a gate by its
//! manifest row alone.

use std::collections::BTreeMap;
use std::sync::LazyLock;

use serde::Deserialize;

/// One row.
#[derive(Debug, Clone, Deserialize)]
pub struct TinyModel {
    pub name: String,
    /// `module:function` in oracles/.
    pub maker: String,
    /// The seed its weights are drawn from (None: derived from another model).
    pub seed: Option<u64>,
    pub model_type: String,
    #[serde(default)]
    pub needs: Vec<String>,
    /// The gates (`Gate::name`) whose models it is.
    #[serde(default)]
    pub gates: Vec<String>,
    /// The gates that load it besides their models.
    #[serde(default)]
    pub fixture_of: Vec<String>,
}

static ROWS: LazyLock<Vec<TinyModel>> = LazyLock::new(|| {
    serde_json::from_str(include_str!("../../goldens/models/manifest.json"))
        .expect("goldens/models/manifest.json is a list of tiny-model rows")
});

/// Gate name → its models, and → its fixtures, in manifest order (by name).
type ByGate = BTreeMap<&'static str, Vec<&'static str>>;

static BY_GATE: LazyLock<(ByGate, ByGate)> = LazyLock::new(|| {
    let (mut models, mut fixtures) = (ByGate::new(), ByGate::new());
    for row in ROWS.iter() {
        for g in &row.gates {
            models
                .entry(g.as_str())
                .or_default()
                .push(row.name.as_str());
        }
        for g in &row.fixture_of {
            fixtures
                .entry(g.as_str())
                .or_default()
                .push(row.name.as_str());
        }
    }
    (models, fixtures)
});

/// Every row, sorted by name.
pub fn tiny_models() -> &'static [TinyModel] {
    &ROWS
}

/// Every row, each after the rows it `needs` (otherwise in manifest order): the order to
/// make them in.
pub fn build_order() -> Vec<&'static TinyModel> {
    fn visit(row: &'static TinyModel, done: &mut Vec<&'static TinyModel>) {
        if done.iter().any(|d| d.name == row.name) {
            return;
        }
        for need in &row.needs {
            if let Some(source) = ROWS.iter().find(|r| &r.name == need) {
                visit(source, done);
            }
        }
        done.push(row);
    }
    let mut done = Vec::new();
    for row in ROWS.iter() {
        visit(row, &mut done);
    }
    done
}

/// The models of gate `gate` (none: an empty list).
pub fn gate_models(gate: &str) -> &'static [&'static str] {
    BY_GATE.0.get(gate).map_or(&[], |v| v.as_slice())
}

/// The models gate `gate` loads besides its own.
pub fn gate_fixtures(gate: &str) -> &'static [&'static str] {
    BY_GATE.1.get(gate).map_or(&[], |v| v.as_slice())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_sorted_unique_and_name_their_sources() {
        let names: Vec<&str> = tiny_models().iter().map(|r| r.name.as_str()).collect();
        let mut sorted = names.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(
            names, sorted,
            "manifest rows must be sorted by name, each once"
        );
        for row in tiny_models() {
            for need in &row.needs {
                assert!(names.contains(&need.as_str()), "{}: needs {need}", row.name);
            }
        }
    }

    #[test]
    fn every_model_is_made_after_its_sources() {
        let order: Vec<&str> = build_order().iter().map(|r| r.name.as_str()).collect();
        assert_eq!(order.len(), tiny_models().len());
        for (i, row) in build_order().iter().enumerate() {
            for need in &row.needs {
                let at = order.iter().position(|n| n == need).unwrap();
                assert!(at < i, "{} is made before its source {need}", row.name);
            }
        }
        let pos = |n: &str| order.iter().position(|o| *o == n).unwrap();
        assert!(pos("tiny-llama-trained") < pos("tiny-llama-mxfp4"));
    }

    #[test]
    fn gates_read_their_models_from_the_rows() {
        assert!(gate_models("l1").contains(&"tiny-smollm3"));
        assert_eq!(gate_fixtures("spec"), ["tiny-llama-draft"]);
        assert!(gate_models("no-such-gate").is_empty());
    }
}
