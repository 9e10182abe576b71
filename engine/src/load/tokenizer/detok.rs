//! Streaming detokenizers, as mlx-lm 0.32.2 streams text (`tokenizer_utils.py`): what
//! `mlx_lm.generate` prints and `mlx_lm.server` sends, piece by piece. The kind follows the
//! tokenizer's `decoder` as mlx-lm chooses it:
//!
//! - **byte-level BPE** (`ByteLevel` decoder): each token's string is appended, its GPT-2
//!   byte characters turned back into bytes; text is released unless it ends in half a
//!   character or the token is a lone space; the stream's first leading space is dropped;
//!   special tokens show as their text; ids past the tokenizer (a model's padded vocabulary)
//!   show as "!".
//! - **SentencePiece** (`Replace ▁→␣, ByteFallback, Fuse, Strip` decoders): token bytes
//!   (`<0xNN>` tokens as that byte), released unless they end in half a character; the
//!   leading space dropped unless the decoder keeps it.
//! - **anything else**: the tokenizer's own decode of the current line (special tokens
//!   included), released up to a trailing half character (and a trailing space where the
//!   tokenizer cleans up spaces), committed at each newline.

use std::collections::HashMap;

use serde_json::{json, Value};

use super::Tokenizer;
use crate::load::LoadError;

/// Which of mlx-lm's detokenizers a tokenizer gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Bpe,
    Spm { trim_space: bool },
    Naive,
}

impl Kind {
    /// mlx-lm's choice from `tokenizer.json`'s decoder.
    pub fn of_decoder(decoder: &Value) -> Kind {
        let mut spm = json!({"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
        ]});
        let no_space = spm.clone();
        spm["decoders"]
            .as_array_mut()
            .expect("array")
            .push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
        if decoder == &spm {
            Kind::Spm { trim_space: true }
        } else if decoder == &no_space {
            Kind::Spm { trim_space: false }
        } else if decoder.get("type").and_then(Value::as_str) == Some("ByteLevel") {
            Kind::Bpe
        } else {
            Kind::Naive
        }
    }
}

/// GPT-2's byte ↔ printable-character table, character → byte.
fn byte_decoder() -> &'static HashMap<char, u8> {
    static TABLE: std::sync::OnceLock<HashMap<char, u8>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
        let mut map = HashMap::new();
        let mut shifted = 0;
        for b in 0..=255u32 {
            let c = if printable(b) {
                b
            } else {
                shifted += 1;
                255 + shifted
            };
            map.insert(char::from_u32(c).expect("valid"), b as u8);
        }
        map
    })
}

/// What a detokenizer looks tokens up in, built once per tokenizer (`Tokenizer::detok_table`)
/// and shared by every stream: each id's token string (HF's `convert_ids_to_tokens`, for
/// ids below `len(tokenizer)`), or for SentencePiece its bytes.
pub enum Table {
    Bpe(Vec<String>),
    Spm(Vec<Vec<u8>>),
    Naive,
}

impl Table {
    pub fn build(tokenizer: &Tokenizer) -> Table {
        let strings = || {
            (0..tokenizer.vocab_size() as u32)
                .map(|id| tokenizer.id_to_token(id).unwrap_or_default())
        };
        match tokenizer.detokenizer_kind() {
            Kind::Bpe => Table::Bpe(strings().collect()),
            Kind::Spm { .. } => Table::Spm(
                strings()
                    .map(|t| {
                        // Byte tokens carry their value in hex: as mlx-lm reads them, any
                        // token starting "<0x" is the byte of its next two characters.
                        let hex = t.strip_prefix("<0x").and_then(|h| h.get(..2));
                        match hex.map(|h| u8::from_str_radix(h, 16)) {
                            Some(Ok(b)) => vec![b],
                            _ => t.into_bytes(),
                        }
                    })
                    .collect(),
            ),
            Kind::Naive => Table::Naive,
        }
    }
}

enum State<'t> {
    Bpe {
        tokens: &'t [String],
        unflushed: String,
    },
    Spm {
        tokens: &'t [Vec<u8>],
        trim_space: bool,
        unflushed: Vec<u8>,
    },
    Naive {
        clean_spaces: bool,
        line: Vec<u32>,
        line_text: String,
    },
}

/// Turns a stream of ids into text pieces, as mlx-lm's detokenizer for this tokenizer does.
pub struct StreamingDetokenizer<'t> {
    tokenizer: &'t Tokenizer,
    state: State<'t>,
    /// The text released so far (mlx-lm's `text`) and how much of it was handed out.
    text: String,
    offset: usize,
    /// The BPE stream drops its first leading space (mlx-lm); mlx-vlm's keeps it.
    bpe_trims: bool,
    /// mlx-vlm's BPE stream: held until a token that starts with a space, the rest decoded
    /// at the end with invalid bytes dropped (see [`Self::as_mlx_vlm`]).
    bpe_words: bool,
    /// mlx_vlm.server's per-token text (see [`Self::as_mlx_vlm_server`]).
    per_token: Option<PerToken>,
}

/// mlx_vlm.server's streamer state (`_ServerTokenStreamer`): the bytes of an incomplete
/// UTF-8 sequence, and whether any text went out yet.
#[derive(Default)]
struct PerToken {
    pending: Vec<u8>,
    started: bool,
}

impl PerToken {
    /// Python's incremental UTF-8 decoder with `errors="replace"`: `bytes` after the held
    /// ones, each invalid sequence as U+FFFD at once, an incomplete one at the end held
    /// (`final`: as U+FFFD too).
    fn decode(&mut self, bytes: &[u8], last: bool) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        let mut rest: &[u8] = &self.pending;
        while !rest.is_empty() {
            let chunk = match std::str::from_utf8(rest) {
                Ok(all) => all.len(),
                Err(e) => e.valid_up_to(),
            };
            let (valid, after) = rest.split_at(chunk);
            out.push_str(std::str::from_utf8(valid).unwrap_or_default());
            rest = after;
            match std::str::from_utf8(rest).err().map(|e| e.error_len()) {
                None => break,
                Some(Some(n)) => {
                    out.push('\u{FFFD}');
                    rest = &rest[n..];
                }
                Some(None) if last => {
                    out.push('\u{FFFD}');
                    rest = &[];
                }
                Some(None) => break,
            }
        }
        self.pending = rest.to_vec();
        out
    }

    /// `_emit_text`: the stream's first leading space dropped where the detokenizer trims.
    fn emit(&mut self, mut text: String, trim_space: bool) -> String {
        if !self.started && trim_space && text.starts_with(' ') {
            text.remove(0);
        }
        self.started |= !text.is_empty();
        text
    }
}

impl<'t> StreamingDetokenizer<'t> {
    /// As mlx-vlm's detokenizer for this tokenizer: the same, but its BPE one
    /// (mlx_vlm/tokenizer_utils.py `BPEStreamingDetokenizer`) keeps the stream's leading
    /// space (`trim_space=False`), releases the held text (invalid UTF-8 replaced) only when
    /// a token starting with a space comes, and at the end DROPS invalid UTF-8 (`finalize`:
    /// `errors="ignore"`, where mlx-lm replaces).
    pub fn as_mlx_vlm(mut self) -> Self {
        self.bpe_trims = false;
        self.bpe_words = true;
        self
    }

    /// As mlx_vlm.server 0.7.10 streams an answer (mlx_vlm/tokenizer_utils.py
    /// `_ServerTokenStreamer`), for a byte-level BPE or SentencePiece tokenizer: each token's
    /// text at once — its bytes (BPE: the token's byte characters; SentencePiece: a `<0xNN>`
    /// token's byte) through an incremental UTF-8 decoder that replaces what can never be
    /// valid and holds an incomplete sequence for the next token; a SentencePiece token's
    /// other pieces as text with `▁` as a space; the first leading space dropped only where
    /// the SentencePiece decoder strips it (BPE keeps it). Other tokenizers: mlx-vlm's
    /// detokenizer, as [`Self::as_mlx_vlm`]. (A SentencePiece byte token below 0x80 is taken
    /// as text, where mlx-vlm decodes it: the same unless a sequence is incomplete.)
    pub fn as_mlx_vlm_server(self) -> Self {
        let mut d = self.as_mlx_vlm();
        if !matches!(d.state, State::Naive { .. }) {
            d.per_token = Some(PerToken::default());
        }
        d
    }

    /// One id's text in [`Self::as_mlx_vlm_server`]'s way.
    fn push_per_token(&mut self, id: u32) -> Result<String, LoadError> {
        let Some(stream) = self.per_token.as_mut() else {
            return Ok(String::new());
        };
        let (text, trim) = match &self.state {
            State::Bpe { tokens, .. } => {
                let table = byte_decoder();
                let bytes = tokens.get(id as usize).and_then(|t| {
                    t.chars()
                        .map(|c| table.get(&c).copied())
                        .collect::<Option<Vec<u8>>>()
                });
                match bytes {
                    Some(bytes) => (stream.decode(&bytes, false), false),
                    // Outside the table: the tokenizer's own decode of the id (`_fallback_decode`).
                    None => (
                        self.tokenizer
                            .decode_with_special(&[id])
                            .unwrap_or_default(),
                        false,
                    ),
                }
            }
            State::Spm {
                tokens, trim_space, ..
            } => match tokens.get(id as usize).map(Vec::as_slice) {
                Some(&[b]) if b >= 0x80 => (stream.decode(&[b], false), *trim_space),
                Some(piece) => (
                    String::from_utf8_lossy(piece).replace('\u{2581}', " "),
                    *trim_space,
                ),
                None => (
                    self.tokenizer
                        .decode_with_special(&[id])
                        .unwrap_or_default(),
                    *trim_space,
                ),
            },
            State::Naive { .. } => (String::new(), false),
        };
        let stream = self.per_token.as_mut().expect("checked above");
        let text = stream.emit(text, trim);
        self.text.push_str(&text);
        Ok(self.segment())
    }

    pub fn new(tokenizer: &'t Tokenizer) -> Self {
        let state = match (tokenizer.detokenizer_kind(), tokenizer.detok_table()) {
            (Kind::Spm { trim_space }, Table::Spm(tokens)) => State::Spm {
                tokens,
                trim_space,
                unflushed: Vec::new(),
            },
            (_, Table::Bpe(tokens)) => State::Bpe {
                tokens,
                unflushed: String::new(),
            },
            _ => State::Naive {
                clean_spaces: tokenizer.cleans_up_spaces(),
                line: Vec::new(),
                line_text: String::new(),
            },
        };
        StreamingDetokenizer {
            tokenizer,
            state,
            text: String::new(),
            offset: 0,
            bpe_trims: true,
            bpe_words: false,
            per_token: None,
        }
    }

    /// The stream's first leading space is dropped (mlx-lm's `_maybe_trim_space`).
    fn release(&mut self, mut piece: String) {
        if self.bpe_trims && self.text.is_empty() && piece.starts_with(' ') {
            piece.remove(0);
        }
        self.text.push_str(&piece);
    }

    /// The text released since the last call (mlx-lm's `last_segment`).
    fn segment(&mut self) -> String {
        let visible = match &self.state {
            State::Naive { line_text, .. } => format!("{}{line_text}", self.text),
            _ => self.text.clone(),
        };
        let piece = visible.get(self.offset..).unwrap_or_default().to_owned();
        self.offset = visible.len();
        piece
    }

    /// Adds one id; returns the newly released text (possibly empty).
    pub fn push(&mut self, id: u32) -> Result<String, LoadError> {
        if self.per_token.is_some() {
            return self.push_per_token(id);
        }
        match &mut self.state {
            State::Bpe { tokens, unflushed } => {
                // mlx-lm's fallback for ids past the tokenizer: a padded vocabulary.
                let token = tokens.get(id as usize).map_or("!", String::as_str);
                if self.bpe_words {
                    let spaced = token.chars().next().and_then(|c| byte_decoder().get(&c));
                    if spaced == Some(&b' ') {
                        let text = bpe_bytes(unflushed, false);
                        *unflushed = token.to_owned();
                        self.release(text);
                    } else {
                        unflushed.push_str(token);
                    }
                    return Ok(self.segment());
                }
                unflushed.push_str(token);
                let text = bpe_bytes(unflushed, true);
                let lone_space = {
                    let mut chars = token.chars();
                    matches!((chars.next(), chars.next()), (Some(c), None) if byte_decoder().get(&c) == Some(&b' '))
                };
                if !text.ends_with('\u{FFFD}') && !lone_space {
                    unflushed.clear();
                    self.release(text);
                }
            }
            State::Spm {
                tokens, unflushed, ..
            } => {
                if let Some(bytes) = tokens.get(id as usize) {
                    unflushed.extend_from_slice(bytes);
                }
                self.flush_spm(false);
            }
            State::Naive {
                clean_spaces,
                line,
                line_text,
            } => {
                line.push(id);
                let mut text = self.tokenizer.decode_with_special(line)?;
                if text.ends_with('\u{FFFD}') {
                    text = text.trim_end_matches('\u{FFFD}').to_owned();
                } else if *clean_spaces && text.ends_with(' ') {
                    text.pop();
                }
                if text.ends_with('\n') {
                    self.text.push_str(&text);
                    line.clear();
                    line_text.clear();
                } else {
                    *line_text = text;
                }
            }
        }
        Ok(self.segment())
    }

    fn flush_spm(&mut self, force: bool) {
        let State::Spm {
            unflushed,
            trim_space,
            ..
        } = &mut self.state
        else {
            return;
        };
        let spaced = String::from_utf8_lossy(unflushed).replace('\u{2581}', " ");
        if !force && spaced.ends_with('\u{FFFD}') {
            return;
        }
        let mut text = spaced;
        // Planted: the leading space is kept where mlx-lm trims it.
        let trim = *trim_space && !crate::plant::is(crate::plant::Defect::SpmKeepsLeadingSpace);
        if self.text.is_empty() && trim && text.starts_with(' ') {
            text.remove(0);
        }
        unflushed.clear();
        self.text.push_str(&text);
    }

    /// Whatever is still held back (mlx-lm's `finalize`, then `last_segment`).
    pub fn finish(&mut self) -> Result<String, LoadError> {
        if let Some(stream) = self.per_token.as_mut() {
            let trim = matches!(
                self.state,
                State::Spm {
                    trim_space: true,
                    ..
                }
            );
            let tail = stream.decode(&[], true);
            let text = stream.emit(tail, trim);
            self.text.push_str(&text);
            return Ok(self.segment());
        }
        match &mut self.state {
            State::Bpe { unflushed, .. } => {
                let text = match self.bpe_words {
                    true => valid_utf8(&bpe_raw(unflushed, false)),
                    false => bpe_bytes(unflushed, false),
                };
                unflushed.clear();
                self.release(text);
            }
            State::Spm { .. } => self.flush_spm(true),
            State::Naive {
                line, line_text, ..
            } => {
                let text = self.tokenizer.decode_with_special(line)?;
                line.clear();
                line_text.clear();
                self.text.push_str(&text);
            }
        }
        Ok(self.segment())
    }
}

/// The bytes a run of byte-level token characters stands for, as UTF-8 text (invalid
/// sequences replaced). mlx-lm's streaming path treats a character that maps to byte 0 like
/// one outside the table (its own UTF-8 bytes) — `if res:` — and its finalize does not; both
/// kept.
fn bpe_bytes(chars: &str, streaming: bool) -> String {
    String::from_utf8_lossy(&bpe_raw(chars, streaming)).into_owned()
}

/// The bytes of [`bpe_bytes`], undecoded.
fn bpe_raw(chars: &str, streaming: bool) -> Vec<u8> {
    let table = byte_decoder();
    let mut bytes = Vec::with_capacity(chars.len());
    for c in chars.chars() {
        match table.get(&c) {
            Some(&b) if b != 0 || !streaming => bytes.push(b),
            _ => bytes.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
        }
    }
    bytes
}

/// `bytes.decode("utf-8", errors="ignore")`: the valid UTF-8, each invalid sequence dropped.
fn valid_utf8(bytes: &[u8]) -> String {
    bytes.utf8_chunks().map(|c| c.valid()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mlx_vlms_end_drops_invalid_utf8_that_a_word_break_would_replace() {
        assert_eq!(valid_utf8(b"gain\xc4\xe6agght"), "gainagght");
        assert_eq!(
            String::from_utf8_lossy(b"gain\xc4\xe6agght"),
            "gain\u{FFFD}\u{FFFD}agght"
        );
        assert_eq!(valid_utf8("é!".as_bytes()), "é!");
    }

    #[test]
    fn mlx_vlm_servers_decoder_replaces_at_once_and_holds_an_incomplete_sequence() {
        let mut d = PerToken::default();
        // An impossible byte at once; "é" split over two tokens held, then whole.
        assert_eq!(d.decode(b"a\xff", false), "a\u{FFFD}");
        assert_eq!(d.decode(b"\xc3", false), "");
        assert_eq!(d.decode(b"\xa9b", false), "\u{e9}b");
        // Not completed: replaced in front of what follows, or at the end.
        assert_eq!(d.decode(b"\xe2\x96", false), "");
        assert_eq!(d.decode(b"x", false), "\u{FFFD}x");
        assert_eq!(d.decode(b"\xe2", false), "");
        assert_eq!(d.decode(b"", true), "\u{FFFD}");
        assert_eq!(d.emit(" hi".into(), false), " hi");
        let mut d = PerToken::default();
        assert_eq!(
            (d.emit(String::new(), true), d.emit(" a".into(), true)),
            ("".into(), "a".into())
        );
    }

    #[test]
    fn the_byte_table_is_gpt2s() {
        let t = byte_decoder();
        assert_eq!(t.len(), 256);
        assert_eq!(t[&'!'], b'!');
        assert_eq!(t[&'Ġ'], b' ');
        assert_eq!(t[&'Ċ'], b'\n');
        assert_eq!(t[&'Ā'], 0);
    }

    #[test]
    fn decoders_pick_the_kind_mlx_lm_picks() {
        assert_eq!(
            Kind::of_decoder(&json!({"type": "ByteLevel", "add_prefix_space": true})),
            Kind::Bpe
        );
        let spm = json!({"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ]});
        assert_eq!(Kind::of_decoder(&spm), Kind::Spm { trim_space: true });
        let mut no_space = spm.clone();
        no_space["decoders"].as_array_mut().unwrap().pop();
        assert_eq!(Kind::of_decoder(&no_space), Kind::Spm { trim_space: false });
        assert_eq!(Kind::of_decoder(&json!({"type": "WordPiece"})), Kind::Naive);
        assert_eq!(Kind::of_decoder(&Value::Null), Kind::Naive);
    }
}
