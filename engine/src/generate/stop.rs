//! Stop strings for streamed text. Text is released only once it cannot be the start of a
//! stop string, so a stream never shows part of one; when a stop string completes, the text
//! before it is released and generation ends. (Matching runs on decoded text, so a stop
//! string is found wherever token boundaries fall.)

use super::{Finish, Flow};
use crate::load::detok::StreamingDetokenizer;
use crate::load::tokenizer::Tokenizer;
use crate::load::LoadError;

/// What a new piece of text does to the stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopStep {
    /// Keep going; emit this (possibly empty) text now.
    Continue(String),
    /// A stop string completed; emit this final text (everything before it) and stop.
    Stop(String),
}

pub struct StopMatcher {
    stops: Vec<String>,
    pending: String,
    /// The stop string that completed (the earliest in the text; the first listed on a tie).
    matched: Option<String>,
}

impl StopMatcher {
    /// Empty stop strings are ignored.
    pub fn new(stops: impl IntoIterator<Item = String>) -> Self {
        StopMatcher {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            pending: String::new(),
            matched: None,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.stops.is_empty()
    }

    pub fn push(&mut self, piece: &str) -> StopStep {
        self.pending.push_str(piece);
        if let Some((at, i)) = self
            .stops
            .iter()
            .enumerate()
            .filter_map(|(i, s)| self.pending.find(s.as_str()).map(|at| (at, i)))
            .min()
        {
            self.matched = Some(self.stops[i].clone());
            let out = self.pending[..at].to_owned();
            self.pending.clear();
            return StopStep::Stop(out);
        }
        // Hold back the longest suffix that is a proper prefix of some stop string.
        let hold = self
            .stops
            .iter()
            .map(|s| longest_suffix_prefix(&self.pending, s))
            .max()
            .unwrap_or(0);
        let cut = self.pending.len() - hold;
        let out = self.pending[..cut].to_owned();
        self.pending.drain(..cut);
        StopStep::Continue(out)
    }

    /// The stop string that ended the text, once one has.
    pub fn matched(&self) -> Option<&str> {
        self.matched.as_deref()
    }

    /// Releases what was held back (generation ended for another reason).
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

/// Generated ids to the text a client sees: the streaming detokenizer, then the stop
/// matcher (shared by `engine generate` and the server's emitter).
pub struct TextStream<'t> {
    detok: StreamingDetokenizer<'t>,
    stops: StopMatcher,
}

impl<'t> TextStream<'t> {
    pub fn new(tokenizer: &'t Tokenizer, stops: impl IntoIterator<Item = String>) -> Self {
        TextStream {
            detok: tokenizer.detokenizer(),
            stops: StopMatcher::new(stops),
        }
    }

    /// With mlx-vlm's detokenizer spacing ([`StreamingDetokenizer::as_mlx_vlm`]).
    pub fn as_mlx_vlm(mut self) -> Self {
        self.detok = self.detok.as_mlx_vlm();
        self
    }

    /// As mlx_vlm.server streams an answer ([`StreamingDetokenizer::as_mlx_vlm_server`]).
    pub fn as_mlx_vlm_server(mut self) -> Self {
        self.detok = self.detok.as_mlx_vlm_server();
        self
    }

    /// The text released by id `id`, and Stop once a stop string completed.
    pub fn push(&mut self, id: u32) -> Result<(String, Flow), LoadError> {
        let piece = self.detok.push(id)?;
        Ok(match self.stops.push(&piece) {
            StopStep::Continue(text) => (text, Flow::Continue),
            StopStep::Stop(text) => (text, Flow::Stop),
        })
    }

    /// The stop string that ended the text, once one has.
    pub fn matched(&self) -> Option<&str> {
        self.stops.matched()
    }

    /// The text still held back once generation ended (none after a stop string).
    pub fn finish(&mut self, finish: Finish) -> Result<String, LoadError> {
        if finish == Finish::Stop {
            return Ok(String::new());
        }
        let tail = self.detok.finish()?;
        Ok(match self.stops.push(&tail) {
            StopStep::Continue(text) => text + &self.stops.finish(),
            StopStep::Stop(text) => text,
        })
    }
}

/// Length in bytes of the longest suffix of `text` that is a proper prefix of `stop`,
/// cut at character boundaries.
fn longest_suffix_prefix(text: &str, stop: &str) -> usize {
    let max = text.len().min(stop.len().saturating_sub(1));
    (1..=max)
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n)
                && stop.is_char_boundary(n)
                && text.ends_with(&stop[..n])
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()));
        let mut out = String::new();
        for p in pieces {
            match m.push(p) {
                StopStep::Continue(t) => out.push_str(&t),
                StopStep::Stop(t) => {
                    out.push_str(&t);
                    return (out, true);
                }
            }
        }
        out.push_str(&m.finish());
        (out, false)
    }

    #[test]
    fn stops_across_piece_boundaries_and_never_leaks_a_partial_stop() {
        assert_eq!(
            run(
                &["Question:"],
                &["The sky", " is blue.\nQues", "tion: What"]
            ),
            ("The sky is blue.\n".into(), true)
        );
        // A partial match that does not complete is released.
        assert_eq!(
            run(&["Question:"], &["a Que", "en b"]),
            ("a Queen b".into(), false)
        );
        // The earliest of several stops wins.
        assert_eq!(
            run(&["blue", "sky"], &["The sky is blue"]),
            ("The ".into(), true)
        );
        assert_eq!(run(&[], &["no stops"]), ("no stops".into(), false));
    }

    #[test]
    fn held_text_is_emitted_as_soon_as_it_cannot_match() {
        let mut m = StopMatcher::new(["END".to_string()]);
        assert_eq!(m.push("abcE"), StopStep::Continue("abc".into()));
        assert_eq!(m.push("x"), StopStep::Continue("Ex".into()));
        assert_eq!(m.push("ü✓E"), StopStep::Continue("ü✓".into()));
        assert_eq!(m.push("ND!"), StopStep::Stop(String::new()));
    }
}
