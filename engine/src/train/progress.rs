//! `engine train`'s console: an indicatif bar over the iterations with each step's loss,
//! learning rate and speed, eval lines, and the dynamic-λ controller's changes.

use super::trainer::StepReport;

/// A bar over the iterations (hidden with --quiet).
pub fn bar(quiet: bool, iters: usize) -> indicatif::ProgressBar {
    let bar = if quiet {
        indicatif::ProgressBar::hidden()
    } else {
        indicatif::ProgressBar::new(iters as u64)
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} {msg} ({elapsed}<{eta})")
            .expect("valid template"),
    );
    bar
}

/// A step moves the bar and shows its loss, learning rate and speed; an eval prints a line,
/// and a λ change its own line on stdout (not with --quiet).
pub fn show(
    bar: &indicatif::ProgressBar,
    quiet: bool,
    r: &StepReport,
    eval: Option<&[(&'static str, f64)]>,
) {
    match eval {
        Some(m) => {
            let parts: Vec<String> = m.iter().map(|(k, v)| format!("{k} {v:.4}")).collect();
            bar.println(format!("step {}: eval {}", r.step, parts.join(", ")));
            // λ changes reach the console whether or not it is a terminal (the bar's own
            // lines do not when it is hidden).
            if let (Some(note), false) = (&r.note, quiet) {
                bar.suspend(|| println!("{note}"));
            }
        }
        None => {
            bar.set_position(r.step as u64);
            let note = r
                .note
                .as_deref()
                .map(|n| format!(" {n}"))
                .unwrap_or_default();
            bar.set_message(format!(
                "loss {:.4}{note} lr {:.2e} {:.0} tok/s",
                r.loss, r.lr, r.tokens_per_s
            ));
        }
    }
}
