//! The results DB: one append-only `runs` table in SQLite (bundled), at
//! `$HARNESS_DB` or `<cache dir>/results.sqlite` (see `harness::cache_dir`). Rows are never updated or deleted.

use std::path::{Path, PathBuf};

use rusqlite::{params, Connection};
use serde::{Deserialize, Serialize};

/// One measured (or checked) number with everything needed to judge it later.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Row {
    pub ts: String,
    pub commit: String,
    pub dirty: bool,
    pub machine_key: String,
    pub machine_state: String,
    /// "clean" or "dirty".
    pub preflight: String,
    pub suite: String,
    pub model: String,
    pub metric: String,
    pub value: f64,
    pub unit: String,
    /// Which stack produced it: engine, mlx-lm, optiq.
    pub stack: String,
    /// The stack it is compared against, if any.
    pub peer: Option<String>,
    pub params: String,
    pub tags: String,
}

/// What every row of one recording shares: when, at which commit, on which machine in
/// which state, the preflight verdict and the run's tags.
#[derive(Debug, Clone)]
pub struct RowContext {
    pub ts: String,
    pub commit: String,
    pub dirty: bool,
    pub machine_key: String,
    pub machine_state: String,
    pub preflight: String,
    pub tags: String,
}

/// One measured value: (metric, value, unit).
pub type Measure<'a> = (&'a str, f64, &'a str);

impl RowContext {
    /// A bench run measured between two machine states (`bench::run_labels`' labels).
    pub fn between(
        before: &crate::preflight::MachineState,
        after: &crate::preflight::MachineState,
        labels: (Vec<String>, &str, String),
    ) -> Self {
        let (tags, preflight, state) = labels;
        RowContext {
            ts: after.at.clone(),
            commit: before.commit.clone(),
            dirty: before.dirty,
            machine_key: before.machine_key.clone(),
            machine_state: state,
            preflight: preflight.into(),
            tags: tags.join(" "),
        }
    }

    /// A single-state recording (probes, sweeps).
    pub fn at(state: &crate::preflight::MachineState, tags: &str) -> Self {
        RowContext {
            ts: state.at.clone(),
            commit: state.commit.clone(),
            dirty: state.dirty,
            machine_key: state.machine_key.clone(),
            machine_state: serde_json::to_string(state).unwrap_or_default(),
            preflight: state.verdict().into(),
            tags: tags.into(),
        }
    }

    pub fn row(
        &self,
        suite: &str,
        model: &str,
        (metric, value, unit): Measure,
        stack: &str,
        peer: Option<String>,
        params: serde_json::Value,
    ) -> Row {
        Row {
            ts: self.ts.clone(),
            commit: self.commit.clone(),
            dirty: self.dirty,
            machine_key: self.machine_key.clone(),
            machine_state: self.machine_state.clone(),
            preflight: self.preflight.clone(),
            suite: suite.into(),
            model: model.into(),
            metric: metric.into(),
            value,
            unit: unit.into(),
            stack: stack.into(),
            peer,
            params: params.to_string(),
            tags: self.tags.clone(),
        }
    }
}

pub fn default_path() -> PathBuf {
    if let Ok(p) = std::env::var("HARNESS_DB") {
        return PathBuf::from(p);
    }
    crate::cache_dir().join("results.sqlite")
}

pub struct Db {
    conn: Connection,
}

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS runs (
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
    ts            TEXT NOT NULL,
    commit_sha    TEXT NOT NULL,
    dirty         INTEGER NOT NULL,
    machine_key   TEXT NOT NULL,
    machine_state TEXT NOT NULL,
    preflight     TEXT NOT NULL,
    suite         TEXT NOT NULL,
    model         TEXT NOT NULL,
    metric        TEXT NOT NULL,
    value         REAL NOT NULL,
    unit          TEXT NOT NULL,
    stack         TEXT NOT NULL,
    peer          TEXT,
    params        TEXT NOT NULL,
    tags          TEXT NOT NULL
);
-- Append-only: refuse updates and deletes at the database itself.
CREATE TRIGGER IF NOT EXISTS runs_no_update BEFORE UPDATE ON runs
BEGIN SELECT RAISE(ABORT, 'runs is append-only'); END;
CREATE TRIGGER IF NOT EXISTS runs_no_delete BEFORE DELETE ON runs
BEGIN SELECT RAISE(ABORT, 'runs is append-only'); END;
";

impl Db {
    pub fn open(path: &Path) -> rusqlite::Result<Self> {
        if let Some(dir) = path.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let conn = Connection::open(path)?;
        conn.execute_batch(SCHEMA)?;
        Ok(Db { conn })
    }

    pub fn open_default() -> rusqlite::Result<Self> {
        Self::open(&default_path())
    }

    pub fn insert(&self, row: &Row) -> rusqlite::Result<i64> {
        self.conn.execute(
            "INSERT INTO runs (ts, commit_sha, dirty, machine_key, machine_state, preflight, suite,
                               model, metric, value, unit, stack, peer, params, tags)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15)",
            params![
                row.ts,
                row.commit,
                row.dirty,
                row.machine_key,
                row.machine_state,
                row.preflight,
                row.suite,
                row.model,
                row.metric,
                row.value,
                row.unit,
                row.stack,
                row.peer,
                row.params,
                row.tags
            ],
        )?;
        Ok(self.conn.last_insert_rowid())
    }

    /// Rows, newest first, optionally of one suite.
    pub fn query(&self, suite: Option<&str>, limit: usize) -> rusqlite::Result<Vec<Row>> {
        let mut stmt = self.conn.prepare(
            "SELECT ts, commit_sha, dirty, machine_key, machine_state, preflight, suite, model,
                    metric, value, unit, stack, peer, params, tags
             FROM runs WHERE (?1 IS NULL OR suite = ?1) ORDER BY id DESC LIMIT ?2",
        )?;
        let rows = stmt.query_map(params![suite, limit as i64], |r| {
            Ok(Row {
                ts: r.get(0)?,
                commit: r.get(1)?,
                dirty: r.get(2)?,
                machine_key: r.get(3)?,
                machine_state: r.get(4)?,
                preflight: r.get(5)?,
                suite: r.get(6)?,
                model: r.get(7)?,
                metric: r.get(8)?,
                value: r.get(9)?,
                unit: r.get(10)?,
                stack: r.get(11)?,
                peer: r.get(12)?,
                params: r.get(13)?,
                tags: r.get(14)?,
            })
        })?;
        rows.collect()
    }

    /// For each (suite, model, metric, stack, params), the newest row that is promotable:
    /// preflight clean, not tagged `went-dirty`, from a clean tree.
    pub fn latest_clean(&self) -> rusqlite::Result<Vec<Row>> {
        let all = self.query(None, usize::MAX >> 1)?;
        let mut seen = std::collections::HashSet::new();
        let mut out = Vec::new();
        for row in all {
            if row.preflight != "clean" || row.tags.split_whitespace().any(|t| t == "went-dirty") {
                continue;
            }
            let key = (
                row.suite.clone(),
                row.model.clone(),
                row.metric.clone(),
                row.stack.clone(),
                row.params.clone(),
            );
            if seen.insert(key) {
                out.push(row);
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(metric: &str, value: f64, preflight: &str) -> Row {
        Row {
            ts: "2026-01-01T00:00:00Z".into(),
            commit: "abc".into(),
            dirty: false,
            machine_key: "cpu-test".into(),
            machine_state: "{}".into(),
            preflight: preflight.into(),
            suite: "decode".into(),
            model: "tiny".into(),
            metric: metric.into(),
            value,
            unit: "tok/s".into(),
            stack: "engine".into(),
            peer: Some("mlx-lm".into()),
            params: "{}".into(),
            tags: String::new(),
        }
    }

    #[test]
    fn rows_round_trip_and_cannot_be_deleted_or_changed() {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(&dir.path().join("r.sqlite")).unwrap();
        db.insert(&row("decode_tps", 1.0, "clean")).unwrap();
        db.insert(&row("decode_tps", 2.0, "dirty")).unwrap();
        let rows = db.query(Some("decode"), 10).unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].value, 2.0, "newest first");
        assert!(db.conn.execute("DELETE FROM runs", []).is_err());
        assert!(db.conn.execute("UPDATE runs SET value = 0", []).is_err());
        // latest_clean skips the dirty row and returns the older clean one.
        let clean = db.latest_clean().unwrap();
        assert_eq!(clean.len(), 1);
        assert_eq!(clean[0].value, 1.0);
    }
}
