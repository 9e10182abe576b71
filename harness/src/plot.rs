//! The harness's one plotting code: line charts as hand-written SVG (no plotting crate is
//! vendored). A figure is a row of panels sharing a legend; each series keeps its colour in
//! every panel. Used by `harness sweep lambda` (λ trajectories) and `harness promote` (the
//! curves in RESULTS.md, `results`).

pub mod results;

/// One named line: (x, y) points in x order.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

/// One chart of a figure.
#[derive(Debug, Clone, Default)]
pub struct Panel {
    pub title: String,
    pub x_label: String,
    /// Series by legend entry: `series[i]` is drawn in colour i (None: absent here).
    pub series: Vec<Option<Series>>,
    /// x on a log scale (prompt lengths, client counts), ticked at every x of the data.
    pub log_x: bool,
    /// y from 0 (rates and latencies) rather than from the data's minimum.
    pub y_from_zero: bool,
}

/// Panels side by side under a title, with one legend.
#[derive(Debug, Clone, Default)]
pub struct Figure {
    pub title: String,
    pub legend: Vec<String>,
    pub panels: Vec<Panel>,
}

pub const COLORS: [&str; 9] = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#17becf",
];

const W: f64 = 360.0;
const H: f64 = 220.0;
const PAD: f64 = 44.0;
const TOP: f64 = 30.0;

/// A number as a tick label: few digits, no trailing zeros.
fn label(v: f64) -> String {
    let a = v.abs();
    if a >= 100.0 || v.fract() == 0.0 {
        format!("{v:.0}")
    } else if a >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.3}")
    }
}

/// XML text escaping.
fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

fn extent(vals: impl Iterator<Item = f64>) -> (f64, f64) {
    vals.filter(|v| v.is_finite())
        .fold((f64::MAX, f64::MIN), |a, b| (a.0.min(b), a.1.max(b)))
}

/// The SVG text of `fig`.
pub fn svg(fig: &Figure) -> String {
    let n = fig.panels.len().max(1) as f64;
    let mut s = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{}" font-family="sans-serif" font-size="11">"#,
        n * W + 170.0,
        H + TOP + 24.0
    );
    s += &format!(
        r#"<text x="10" y="16" font-size="13">{}</text>"#,
        esc(&fig.title)
    );
    for (p, panel) in fig.panels.iter().enumerate() {
        s += &panel_svg(panel, p as f64 * W);
    }
    for (i, name) in fig.legend.iter().enumerate() {
        let y = TOP + 20.0 + 16.0 * i as f64;
        s += &format!(
            r#"<rect x="{}" y="{}" width="10" height="3" fill="{c}"/><text x="{}" y="{}" fill="{c}">{}</text>"#,
            n * W + 10.0,
            y - 4.0,
            n * W + 24.0,
            y,
            esc(name),
            c = COLORS[i % COLORS.len()],
        );
    }
    s + "</svg>\n"
}

fn panel_svg(panel: &Panel, x0: f64) -> String {
    let pts = || panel.series.iter().flatten().flat_map(|s| s.points.iter());
    let tx = |x: f64| if panel.log_x { x.max(1e-12).log2() } else { x };
    let (xmin, xmax) = extent(pts().map(|p| tx(p.0)));
    let (mut ymin, ymax) = extent(pts().map(|p| p.1));
    if panel.y_from_zero {
        ymin = ymin.min(0.0);
    }
    if xmin > xmax {
        return String::new();
    }
    let (left, right, bottom) = (x0 + PAD, x0 + W - 12.0, TOP + H - PAD + 10.0);
    let sx = |x: f64| left + (tx(x) - xmin) / (xmax - xmin).max(1e-9) * (right - left);
    let sy = |y: f64| bottom - (y - ymin) / (ymax - ymin).max(1e-9) * (bottom - TOP - 18.0);
    let mut s = format!(
        r##"<rect x="{left}" y="{TOP}" width="{}" height="{}" fill="none" stroke="#ccc"/><text x="{}" y="{}">{}</text>"##,
        right - left,
        bottom - TOP,
        left + 4.0,
        TOP + 14.0,
        esc(&panel.title)
    );
    // y: the bottom, middle and top of the range.
    for v in [ymin, (ymin + ymax) / 2.0, ymax] {
        s += &format!(
            r#"<text x="{}" y="{:.1}" text-anchor="end">{}</text>"#,
            left - 4.0,
            sy(v) + 4.0,
            label(v)
        );
    }
    // x: every distinct x of the data on a log scale (few), else both ends.
    let mut xs: Vec<f64> = pts().map(|p| p.0).collect();
    xs.sort_by(f64::total_cmp);
    xs.dedup();
    if !panel.log_x || xs.len() > 8 {
        xs = vec![xs[0], xs[xs.len() - 1]];
    }
    for x in xs {
        s += &format!(
            r#"<text x="{:.1}" y="{}" text-anchor="middle">{}</text>"#,
            sx(x),
            bottom + 14.0,
            label(x)
        );
    }
    s += &format!(
        r#"<text x="{:.1}" y="{}" text-anchor="middle">{}</text>"#,
        (left + right) / 2.0,
        bottom + 28.0,
        esc(&panel.x_label)
    );
    for (i, series) in panel.series.iter().enumerate() {
        let Some(series) = series else { continue };
        let color = COLORS[i % COLORS.len()];
        let line: Vec<String> = series
            .points
            .iter()
            .filter(|p| p.1.is_finite())
            .map(|&(x, y)| format!("{:.1},{:.1}", sx(x), sy(y)))
            .collect();
        s += &format!(
            r#"<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{}"/>"#,
            line.join(" ")
        );
        if series.points.len() <= 12 {
            for p in &line {
                let (cx, cy) = p.split_once(',').unwrap_or(("0", "0"));
                s += &format!(r#"<circle cx="{cx}" cy="{cy}" r="2.5" fill="{color}"/>"#);
            }
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_figure_draws_every_series_in_its_colour() {
        let series = |name: &str, pts: &[(f64, f64)]| {
            Some(Series {
                name: name.into(),
                points: pts.to_vec(),
            })
        };
        let fig = Figure {
            title: "decode <tiny>".into(),
            legend: vec!["engine".into(), "mlx-lm".into()],
            panels: vec![Panel {
                title: "tok/s".into(),
                x_label: "prompt tokens".into(),
                series: vec![
                    series("engine", &[(256.0, 100.0), (1024.0, 90.0), (4096.0, 60.0)]),
                    series("mlx-lm", &[(256.0, 95.0), (4096.0, 58.0)]),
                ],
                log_x: true,
                y_from_zero: true,
            }],
        };
        let svg = svg(&fig);
        assert!(svg.starts_with("<svg ") && svg.ends_with("</svg>\n"));
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert_eq!(svg.matches("<circle").count(), 5);
        assert!(svg.contains(COLORS[0]) && svg.contains(COLORS[1]));
        assert!(svg.contains("decode &lt;tiny&gt;"), "escaped title");
        // Log x: a tick at each prompt length, 256 at the left edge, 4096 at the right.
        for t in ["256", "1024", "4096"] {
            assert!(svg.contains(&format!(">{t}</text>")), "tick {t}");
        }
        assert!(svg.contains(&format!("points=\"{:.1},", PAD)));
    }

    #[test]
    fn an_empty_panel_draws_nothing() {
        let fig = Figure {
            panels: vec![Panel::default()],
            ..Default::default()
        };
        assert!(!svg(&fig).contains("<polyline"));
    }
}
