//! The sweep's write-up: the per-config table (mean ± sd over seeds), the verdict table
//! (each adaptive config against the best static λ and the trainer's default λ, per
//! metric, with seed noise), and the SVG plots (`crate::plot`).

use std::path::{Path, PathBuf};

use anyhow::Result;

use super::{Run, DEFAULT_STATIC};

/// Mean and sample standard deviation (0 for one value).
pub fn mean_sd(xs: &[f64]) -> (f64, f64) {
    let n = xs.len().max(1) as f64;
    let m = xs.iter().sum::<f64>() / n;
    let v = xs.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
    (m, v.sqrt())
}

/// Distinct values of `key` in first-seen order.
fn keys<T: PartialEq + Clone>(runs: &[Run], key: impl Fn(&Run) -> T) -> Vec<T> {
    let mut out: Vec<T> = Vec::new();
    for r in runs {
        let k = key(r);
        if !out.contains(&k) {
            out.push(k);
        }
    }
    out
}

fn cell<'a>(runs: &'a [Run], d: &str, m: &str, c: &str) -> Vec<&'a Run> {
    runs.iter()
        .filter(|r| r.dataset == d && r.model == m && r.config == c)
        .collect()
}

/// Per (dataset, model, config): mean ± sd over seeds of accuracy, margin, ℓw, ℓw drop,
/// λ at the end; the back-offs and runs summed.
pub fn table(runs: &[Run]) -> String {
    let mut s = String::from(
        "| dataset | model | config | val accuracy | margin | final ℓw | ℓw drop from best | final λ | back-offs | runs |\n|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for (d, m, c) in keys(runs, |r| {
        (r.dataset.clone(), r.model.clone(), r.config.clone())
    }) {
        let mine = cell(runs, &d, &m, &c);
        let stat = |f: fn(&Run) -> f64| mean_sd(&mine.iter().map(|r| f(r)).collect::<Vec<_>>());
        let (a, asd) = stat(|r| r.accuracy);
        let (mg, mgsd) = stat(|r| r.margin);
        let (lw, lwsd) = stat(|r| r.lw);
        let (dr, drsd) = stat(|r| r.lw_drop);
        let (fl, flsd) = stat(|r| r.final_lambda);
        let backoffs: usize = mine.iter().map(|r| r.backoffs).sum();
        s += &format!(
            "| {d} | {m} | {c} | {a:.2} ± {asd:.2} | {mg:.3} ± {mgsd:.3} | {lw:.3} ± {lwsd:.3} | {dr:.3} ± {drsd:.3} | {fl:.2} ± {flsd:.2} | {backoffs} | {} |\n",
            mine.len()
        );
    }
    s
}

/// A metric the verdict compares (higher is better for each).
type Metric = (&'static str, fn(&Run) -> f64);

pub const METRICS: [Metric; 3] = [
    ("final ℓw", |r| r.lw),
    ("margin", |r| r.margin),
    ("val accuracy", |r| r.accuracy),
];

/// Mean, sd and n of one metric over a cell's seeds.
#[derive(Debug, Clone, Copy)]
pub struct Stat {
    pub mean: f64,
    pub sd: f64,
    pub n: usize,
}

impl Stat {
    fn of(runs: &[&Run], f: fn(&Run) -> f64) -> Self {
        let (mean, sd) = mean_sd(&runs.iter().map(|r| f(r)).collect::<Vec<_>>());
        Stat {
            mean,
            sd,
            n: runs.len(),
        }
    }

    /// Seed noise of the difference of two means: 2 standard errors.
    fn noise(&self, o: &Stat) -> f64 {
        2.0 * (self.sd.powi(2) / self.n.max(1) as f64 + o.sd.powi(2) / o.n.max(1) as f64).sqrt()
    }

    /// `>`, `<` or `≈` (within seed noise) against `o`.
    pub fn against(&self, o: &Stat) -> &'static str {
        let d = self.mean - o.mean;
        if d.abs() <= self.noise(o) {
            "≈"
        } else if d > 0.0 {
            ">"
        } else {
            "<"
        }
    }
}

fn is_static(c: &str) -> bool {
    c.starts_with("static-")
}

/// Per (dataset, model) and metric: the best static λ (by mean), the default static λ,
/// and each adaptive config with `≈`/`>`/`<` against both (≈: within 2 standard errors of
/// the difference over seeds); then per adaptive config the count of cells where it is
/// within noise of (or above) the best static, and above the default.
pub fn verdict(runs: &[Run]) -> String {
    verdict_against(runs, DEFAULT_STATIC)
}

/// `verdict` with the trainer's default weight `default` (ORPO's λ 0.1, SimPO's γ 0.5).
pub fn verdict_against(runs: &[Run], default: f64) -> String {
    let configs = keys(runs, |r| r.config.clone());
    let adaptive: Vec<&String> = configs.iter().filter(|c| !is_static(c)).collect();
    let default = format!("static-{default}");
    let mut s = format!("| dataset · model | metric | best static | default ({default}) |");
    for a in &adaptive {
        s += &format!(" {a} (vs best, vs default) |");
    }
    s += "\n|---|---|---|---|";
    s += &"---|".repeat(adaptive.len());
    s += "\n";
    // Per adaptive config and metric: (cells ≥ best within noise, cells > default, cells).
    let mut score = vec![vec![(0, 0, 0); METRICS.len()]; adaptive.len()];
    for (d, m) in keys(runs, |r| (r.dataset.clone(), r.model.clone())) {
        for (mi, (metric, f)) in METRICS.iter().enumerate() {
            let stat = |c: &str| Stat::of(&cell(runs, &d, &m, c), *f);
            let Some(best) = configs
                .iter()
                .filter(|c| is_static(c) && !cell(runs, &d, &m, c).is_empty())
                .max_by(|a, b| stat(a).mean.total_cmp(&stat(b).mean))
            else {
                continue;
            };
            let (b, def) = (stat(best), stat(&default));
            s += &format!(
                "| {d} · {m} | {metric} | {best}: {:.3} ± {:.3} | {:.3} ± {:.3} |",
                b.mean, b.sd, def.mean, def.sd
            );
            for (ai, a) in adaptive.iter().enumerate() {
                let mine = cell(runs, &d, &m, a);
                if mine.is_empty() {
                    s += " – |";
                    continue;
                }
                let x = Stat::of(&mine, *f);
                let (vb, vd) = (x.against(&b), x.against(&def));
                let t = &mut score[ai][mi];
                t.0 += usize::from(vb != "<");
                t.1 += usize::from(def.n > 0 && vd == ">");
                t.2 += 1;
                s += &format!(" {:.3} ± {:.3} ({vb} best, {vd} default) |", x.mean, x.sd);
            }
            s += "\n";
        }
    }
    s += &dominance(runs, &configs, &adaptive);
    s += "\n| adaptive config | metric | within noise of (or above) the best static | above the default |\n|---|---|---|---|\n";
    for (ai, a) in adaptive.iter().enumerate() {
        for (mi, (metric, _)) in METRICS.iter().enumerate() {
            let (w, above, n) = score[ai][mi];
            s += &format!("| {a} | {metric} | {w} of {n} | {above} of {n} |\n");
        }
    }
    s
}

/// Per (dataset, model) and adaptive config: the static λs that dominate it — a mean
/// final ℓw and a mean margin both at least as high — marked `*` where one of the two is
/// higher beyond seed noise. None: no constant λ of the sweep did better on both.
fn dominance(runs: &[Run], configs: &[String], adaptive: &[&String]) -> String {
    let (lw, margin) = (METRICS[0].1, METRICS[1].1);
    let mut s = String::from(
        "\n| dataset · model | adaptive config | final ℓw | margin | static λs that dominate it (mean ℓw and margin both ≥; * beyond noise) |\n|---|---|---|---|---|\n",
    );
    for (d, m) in keys(runs, |r| (r.dataset.clone(), r.model.clone())) {
        for a in adaptive {
            let mine = cell(runs, &d, &m, a);
            if mine.is_empty() {
                continue;
            }
            let (xw, xm) = (Stat::of(&mine, lw), Stat::of(&mine, margin));
            let mut by = Vec::new();
            for c in configs.iter().filter(|c| is_static(c)) {
                let theirs = cell(runs, &d, &m, c);
                if theirs.is_empty() {
                    continue;
                }
                let (sw, sm) = (Stat::of(&theirs, lw), Stat::of(&theirs, margin));
                if sw.mean >= xw.mean && sm.mean >= xm.mean {
                    let beyond = sw.against(&xw) == ">" || sm.against(&xm) == ">";
                    by.push(format!("{c}{}", if beyond { "*" } else { "" }));
                }
            }
            let by = if by.is_empty() {
                "none".to_string()
            } else {
                by.join(", ")
            };
            s += &format!(
                "| {d} · {m} | {a} | {:.3} ± {:.3} | {:.3} ± {:.3} | {by} |\n",
                xw.mean, xw.sd, xm.mean, xm.sd
            );
        }
    }
    s
}

/// (step, λ, ℓw, ℓr) → one of them.
type Getter = fn(&(f64, f64, f64, f64)) -> f64;

/// Per (dataset, model): `<prefix>lambda-<d>-<m>.svg`, λ, ℓw and ℓr over steps for every
/// config (first seed); per dataset: `<prefix>lambda-<d>-final.svg`, the final ℓw and
/// margin (mean over seeds) against static λ with each adaptive config as a flat line.
pub fn plots(runs: &[Run], dir: &Path, prefix: &str) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir)?;
    let mut written = Vec::new();
    let Some(first) = runs.first() else {
        return Ok(written);
    };
    let mut write = |name: String, svg: String| -> Result<()> {
        let path = dir.join(name);
        engine::train::write_atomic(&path, svg.as_bytes()).map_err(|e| anyhow::anyhow!("{e}"))?;
        written.push(path);
        Ok(())
    };
    for d in keys(runs, |r| r.dataset.clone()) {
        let models = keys(runs, |r| r.model.clone());
        for m in &models {
            let mine: Vec<&Run> = runs
                .iter()
                .filter(|r| r.dataset == d && &r.model == m && r.seed == first.seed)
                .collect();
            if !mine.is_empty() {
                write(
                    format!("{prefix}lambda-{d}-{m}.svg"),
                    trajectories(&format!("{d} · {m} · seed {}", first.seed), &mine),
                )?;
            }
        }
        write(
            format!("{prefix}lambda-{d}-final.svg"),
            finals(runs, &d, &models),
        )?;
        write(
            format!("{prefix}lambda-{d}-frontier.svg"),
            frontier(runs, &d, &models),
        )?;
    }
    Ok(written)
}

/// λ, ℓw and ℓr over steps, one line per config.
fn trajectories(title: &str, runs: &[&Run]) -> String {
    let panels: [(&str, Getter); 3] = [
        ("λ", |t| t.1),
        ("ℓw (chosen, validation)", |t| t.2),
        ("ℓr (rejected, validation)", |t| t.3),
    ];
    let fig = crate::plot::Figure {
        title: title.into(),
        legend: runs.iter().map(|r| r.config.clone()).collect(),
        panels: panels
            .iter()
            .enumerate()
            .map(|(p, (name, get))| crate::plot::Panel {
                title: (*name).into(),
                x_label: "step".into(),
                // ℓ panels skip the first eval (the untrained model), which would flatten
                // the rest.
                series: runs
                    .iter()
                    .map(|r| {
                        Some(crate::plot::Series {
                            name: r.config.clone(),
                            points: r
                                .trace
                                .iter()
                                .skip(usize::from(p > 0))
                                .map(|t| (t.0, get(t)))
                                .collect(),
                        })
                    })
                    .collect(),
                log_x: false,
                y_from_zero: false,
            })
            .collect(),
    };
    crate::plot::svg(&fig)
}

/// Final ℓw and margin against static λ (log x), per model; adaptive configs flat.
fn finals(runs: &[Run], d: &str, models: &[String]) -> String {
    let configs = keys(runs, |r| r.config.clone());
    let statics: Vec<(f64, &String)> = configs
        .iter()
        .filter_map(|c| Some((c.strip_prefix("static-")?.parse().ok()?, c)))
        .collect();
    let adaptive: Vec<&String> = configs.iter().filter(|c| !is_static(c)).collect();
    let (lo, hi) = statics
        .iter()
        .fold((f64::MAX, f64::MIN), |a, s| (a.0.min(s.0), a.1.max(s.0)));
    let mut legend = vec!["static λ (mean of seeds)".to_string()];
    legend.extend(adaptive.iter().map(|a| format!("{a} (mean, flat)")));
    let mut panels = Vec::new();
    for m in models {
        for (metric, f) in METRICS.iter().take(2) {
            let mean = |c: &str| Stat::of(&cell(runs, d, m, c), *f);
            let mut series = vec![Some(crate::plot::Series {
                name: legend[0].clone(),
                points: statics
                    .iter()
                    .filter(|(_, c)| !cell(runs, d, m, c).is_empty())
                    .map(|(l, c)| (*l, mean(c).mean))
                    .collect(),
            })];
            for a in &adaptive {
                series.push((!cell(runs, d, m, a).is_empty() && lo <= hi).then(|| {
                    crate::plot::Series {
                        name: a.to_string(),
                        points: vec![(lo, mean(a).mean), (hi, mean(a).mean)],
                    }
                }));
            }
            panels.push(crate::plot::Panel {
                title: format!("{m}: {metric}"),
                x_label: "static λ".into(),
                series,
                log_x: true,
                y_from_zero: false,
            });
        }
    }
    crate::plot::svg(&crate::plot::Figure {
        title: format!("{d}: final eval against λ"),
        legend,
        panels,
    })
}

/// Margin against final ℓw (means over seeds), per model: the static λs as one line in λ
/// order (the trade-off a sweep finds), each adaptive config as one point.
fn frontier(runs: &[Run], d: &str, models: &[String]) -> String {
    let configs = keys(runs, |r| r.config.clone());
    let mut legend = vec!["static λ, in λ order".to_string()];
    legend.extend(configs.iter().filter(|c| !is_static(c)).cloned());
    let point = |m: &str, c: &str| {
        let mine = cell(runs, d, m, c);
        (!mine.is_empty()).then(|| {
            (
                Stat::of(&mine, METRICS[0].1).mean,
                Stat::of(&mine, METRICS[1].1).mean,
            )
        })
    };
    let panels = models
        .iter()
        .map(|m| {
            let mut series = vec![Some(crate::plot::Series {
                name: legend[0].clone(),
                points: configs
                    .iter()
                    .filter(|c| is_static(c))
                    .filter_map(|c| point(m, c))
                    .collect(),
            })];
            for a in &legend[1..] {
                series.push(point(m, a).map(|p| crate::plot::Series {
                    name: a.clone(),
                    points: vec![p],
                }));
            }
            crate::plot::Panel {
                title: format!("{m}: margin against final ℓw"),
                x_label: "final ℓw (validation)".into(),
                series,
                log_x: false,
                y_from_zero: false,
            }
        })
        .collect();
    crate::plot::svg(&crate::plot::Figure {
        title: format!("{d}: what each λ buys (static λ 0.05 → 5 along the line)"),
        legend,
        panels,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(config: &str, seed: u64, lw: f64, margin: f64) -> Run {
        Run {
            dataset: "swap".into(),
            model: "m".into(),
            config: config.into(),
            seed,
            accuracy: 1.0,
            margin,
            lw,
            lw_drop: 0.0,
            lambda_changes: 0,
            backoffs: usize::from(config.starts_with("adaptive")),
            hard_stops: 0,
            final_lambda: 0.1,
            trace: vec![(1.0, 0.1, lw - 1.0, lw - 2.0), (10.0, 0.1, lw, lw - margin)],
        }
    }

    fn study() -> Vec<Run> {
        let mut runs = Vec::new();
        for seed in 0..3 {
            let e = seed as f64 * 0.01;
            runs.push(run("static-0.1", seed, -2.0 + e, 1.0 + e));
            runs.push(run("static-1", seed, -3.0 + e, 3.0 + e));
            runs.push(run("adaptive-aimd", seed, -2.0 + e, 2.0 + e));
        }
        runs
    }

    #[test]
    fn the_verdict_compares_with_the_best_and_the_default_static() {
        let v = verdict(&study());
        // ℓw: best static is 0.1 (= the default); adaptive equals it.
        assert!(
            v.contains("| swap · m | final ℓw | static-0.1: -1.990"),
            "{v}"
        );
        assert!(v.contains("-1.990 ± 0.010 (≈ best, ≈ default)"), "{v}");
        // Margin: best static is 1; adaptive is below it and above the default.
        assert!(v.contains("| margin | static-1: 3.010"), "{v}");
        assert!(v.contains("2.010 ± 0.010 (< best, > default)"), "{v}");
        assert!(
            v.contains("| adaptive-aimd | final ℓw | 1 of 1 | 0 of 1 |"),
            "{v}"
        );
        assert!(
            v.contains("| adaptive-aimd | margin | 0 of 1 | 1 of 1 |"),
            "{v}"
        );
        // Neither static λ has both a higher ℓw and a higher margin than adaptive-aimd.
        assert!(
            v.contains("| swap · m | adaptive-aimd | -1.990 ± 0.010 | 2.010 ± 0.010 | none |"),
            "{v}"
        );
    }

    #[test]
    fn a_static_lambda_better_on_both_dominates() {
        let mut runs = study();
        for seed in 0..3 {
            let e = seed as f64 * 0.01;
            runs.push(run("adaptive-pd", seed, -2.5 + e, 0.5 + e));
        }
        let v = verdict(&runs);
        assert!(
            v.contains("| adaptive-pd | -2.490 ± 0.010 | 0.510 ± 0.010 | static-0.1* |"),
            "{v}"
        );
    }

    #[test]
    fn the_table_has_one_row_per_config_with_seed_spread() {
        let t = table(&study());
        assert_eq!(t.lines().count(), 2 + 3);
        assert!(
            t.contains(
                "| swap | m | adaptive-aimd | 1.00 ± 0.00 | 2.010 ± 0.010 | -1.990 ± 0.010 |"
            ),
            "{t}"
        );
        assert!(
            t.contains("| 3 | 3 |"),
            "back-offs summed, runs counted: {t}"
        );
    }

    #[test]
    fn plots_are_written_per_model_and_per_dataset() {
        let dir = tempfile::tempdir().unwrap();
        let paths = plots(&study(), dir.path(), "mach-").unwrap();
        let names: Vec<String> = paths
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            names,
            [
                "mach-lambda-swap-m.svg",
                "mach-lambda-swap-final.svg",
                "mach-lambda-swap-frontier.svg"
            ]
        );
        let fin = std::fs::read_to_string(&paths[1]).unwrap();
        // Two panels (ℓw, margin), each a static curve and one flat adaptive line.
        assert_eq!(fin.matches("<polyline").count(), 4);
    }
}
