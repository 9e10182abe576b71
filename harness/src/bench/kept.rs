//! Every leg a suite ran, kept: each leg's named figures in the order the legs ran. A
//! stack's i-th leg of a figure ran in ABBA round i, so any figure's spread per stack and
//! its ratio to a peer's legs, paired by round (spread.rs), can be reported, stored beside
//! the median (`row_params`), and said in words (`line`).

use super::spread::{RatioInterval, Spread};

/// Legs in the order they ran: (stack, [(figure, value)]).
#[derive(Debug, Clone, Default)]
pub struct Kept {
    legs: Vec<(String, Vec<(String, f64)>)>,
}

/// A figure's name, unit, and whether a larger value is better.
pub type FigureKind<'a> = (&'a str, &'a str, bool);

impl Kept {
    /// One leg of `stack` and its figures.
    pub fn push(&mut self, stack: &str, figures: impl IntoIterator<Item = (String, f64)>) {
        self.legs
            .push((stack.to_owned(), figures.into_iter().collect()));
    }

    /// `stack`'s values of `figure`, in round order (legs without it are skipped).
    pub fn values(&self, stack: &str, figure: &str) -> Vec<f64> {
        self.legs
            .iter()
            .filter(|(s, _)| s == stack)
            .filter_map(|(_, f)| f.iter().find(|(n, _)| n == figure).map(|(_, v)| *v))
            .collect()
    }

    /// The median of `stack`'s legs of `figure` (NaN without any).
    pub fn median(&self, stack: &str, figure: &str) -> f64 {
        super::median(self.values(stack, figure))
    }

    /// `stack` / `peer` on `figure`, paired by round; None without a pair.
    pub fn interval(&self, stack: &str, peer: &str, figure: &str) -> Option<RatioInterval> {
        RatioInterval::paired(&self.values(stack, figure), &self.values(peer, figure))
    }

    /// What a results-DB row of `stack`'s `figure` keeps besides the median, merged into the
    /// suite's own `params`: every leg (`legs`) and, against `peer`, the ratio's interval
    /// (`ratio_interval`, which `harness promote` shows).
    pub fn row_params(
        &self,
        mut params: serde_json::Value,
        stack: &str,
        peer: Option<&str>,
        figure: &str,
    ) -> serde_json::Value {
        params["legs"] = serde_json::json!(self.values(stack, figure));
        if let Some(i) = peer.and_then(|p| self.interval(stack, p, figure)) {
            params["ratio_interval"] = serde_json::json!(i);
        }
        params
    }

    /// One figure in words: each stack's min / median / max and, with a peer, the ratio's
    /// interval and whether `stack` is ahead, behind or indistinguishable. None when `stack`
    /// has no leg of it.
    pub fn line(
        &self,
        (figure, unit, higher_better): FigureKind,
        stack: &str,
        peer: Option<&str>,
    ) -> Option<String> {
        let spread = |s: &str| {
            let v = self.values(s, figure);
            let sp = Spread::of(&v);
            (!v.is_empty() && !sp.median.is_nan()).then(|| {
                format!(
                    "{s} {:.1} / {:.1} / {:.1} {unit}",
                    sp.min, sp.median, sp.max
                )
            })
        };
        let mine = spread(stack)?;
        let Some(peer) = peer else {
            return Some(format!("  {figure:<15} {mine} (min / median / max)\n"));
        };
        let theirs = spread(peer).map_or(String::new(), |p| format!("; {p}"));
        let ratio = self
            .interval(stack, peer, figure)
            .map_or(String::new(), |q| {
                format!(
                    "\n  {:<15} {stack} / {peer} {}: {}",
                    "",
                    q.describe(),
                    q.verdict(higher_better)
                )
            });
        Some(format!(
            "  {figure:<15} {mine}{theirs} (min / median / max){ratio}\n"
        ))
    }

    /// `line` for each of `figures` that `stack` has.
    pub fn lines(&self, figures: &[FigureKind], stack: &str, peer: Option<&str>) -> String {
        figures
            .iter()
            .filter_map(|f| self.line(*f, stack, peer))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kept() -> Kept {
        let mut k = Kept::default();
        for (e, p) in [(110.0, 100.0), (120.0, 100.0), (130.0, 100.0)] {
            k.push("engine", [("tps".to_owned(), e)]);
            k.push(
                "peer",
                [("tps".to_owned(), p), ("only_peer".to_owned(), 1.0)],
            );
        }
        k
    }

    #[test]
    fn kept_legs_pair_by_round_and_say_the_verdict() {
        let k = kept();
        assert_eq!(k.values("engine", "tps"), [110.0, 120.0, 130.0]);
        assert!(k.values("engine", "only_peer").is_empty());
        let i = k.interval("engine", "peer", "tps").unwrap();
        assert_eq!((i.median, i.lo, i.hi, i.rounds), (1.2, 1.1, 1.3, 3));
        let line = k
            .line(("tps", "tok/s", true), "engine", Some("peer"))
            .unwrap();
        assert!(
            line.contains("engine 110.0 / 120.0 / 130.0 tok/s; peer 100.0 / 100.0 / 100.0 tok/s"),
            "{line}"
        );
        assert!(line.trim_end().ends_with("ahead"), "{line}");
        assert!(k
            .line(("only_peer", "", true), "engine", Some("peer"))
            .is_none());
        let p = k.row_params(
            serde_json::json!({"rounds": 3}),
            "engine",
            Some("peer"),
            "tps",
        );
        assert_eq!(p["legs"], serde_json::json!([110.0, 120.0, 130.0]));
        assert_eq!(p["ratio_interval"]["median"], 1.2);
        assert_eq!(p["rounds"], 3);
        assert!(
            k.row_params(serde_json::json!({}), "peer", None, "tps")["ratio_interval"].is_null()
        );
    }
}
