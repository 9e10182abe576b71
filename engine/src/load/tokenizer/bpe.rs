//! A byte-pair-encoding model that tokenizes exactly as the `tokenizers` crate's `BPE`
//! (tokenizers 0.22: `BPE::merge_word`, `Word::merge_all`, `BPE::tokenize_with_cache`), built
//! from a file's vocabulary and merges without the crate's `BpeBuilder::build`. That build
//! resolves each merge through three string lookups and a formatted string, over owned
//! copies of every merge's two pieces: on Gemma 3's tokenizer (262 k pieces, 515 k merges)
//! it was 0.32 s of a 0.5 s load, the largest part of a server's ready time (issue 43). Here
//! the merges are read as borrowed text and resolved with one reused buffer.
//!
//! The math. A word starts as its characters' ids (a character missing from the vocabulary
//! becomes its `<0xHH>` byte pieces under byte fallback, else the unknown piece, runs of
//! which are fused under `fuse_unk`). Then, repeatedly, of every adjacent pair that the
//! merges list, the one of lowest rank (leftmost on a tie) is replaced by its merged piece,
//! until no adjacent pair is a merge. The queue holds (rank, position, merged id); an entry
//! whose position was merged away, or whose pair there no longer merges into the same id,
//! is skipped when it comes up, as the crate skips it.
//!
//! A model with merge dropout (random by design), or whose ids leave more holes than pieces,
//! is left to the crate: `fast.rs` has the crate's deserializer read the file. The gates: `tests/it/tokenize.rs` (ids against transformers on the
//! real tokenizers; the serialized model against the crate's on every tokenizer.json we
//! have; ids and offsets against the crate's on each, with planted
//! `FastBpeMergesByPosition` caught).

use std::borrow::Cow;
use std::collections::{BinaryHeap, HashMap};
use std::sync::RwLock;

use ahash::AHashMap;
use serde::ser::SerializeStruct;
use tokenizers::models::bpe::BpeTrainer;
use tokenizers::{Result, Token};

/// A pair of adjacent ids.
type Pair = (u32, u32);

/// `merges` (the first of rank `base`) as (pair, id of the joined piece).
fn resolve(
    vocab: &AHashMap<String, u32>,
    prefix: usize,
    merges: &[(&str, &str)],
    base: usize,
) -> std::result::Result<Vec<(Pair, u32)>, BuildError> {
    let id = |piece: &str| {
        vocab
            .get(piece)
            .copied()
            .ok_or_else(|| BuildError::MergeTokenOutOfVocabulary(piece.to_owned()))
    };
    let mut joined = String::new();
    let mut out = Vec::with_capacity(merges.len());
    for (i, &(a, b)) in merges.iter().enumerate() {
        let (a_id, b_id) = (id(a)?, id(b)?);
        let tail = tail(b, prefix, base + i)?;
        joined.clear();
        joined.push_str(a);
        joined.push_str(tail);
        out.push(((a_id, b_id), id(&joined)?));
    }
    Ok(out)
}

/// `b` past the continuing-subword prefix's `prefix` bytes (what the joined piece takes of
/// it), or the error where it is shorter or the cut is inside a character (the crate's build
/// would panic there).
fn tail(b: &str, prefix: usize, rank: usize) -> std::result::Result<&str, BuildError> {
    b.get(prefix..).ok_or_else(|| BuildError::ShortMergePiece {
        rank,
        b: b.to_owned(),
    })
}

/// Refuses a merge whose right piece cannot lose the continuing-subword prefix: for a model
/// the crate builds (with merge dropout), whose build would panic on it.
pub fn check_tails(flags: &Flags, merges: &[(&str, &str)]) -> std::result::Result<(), BuildError> {
    let prefix = flags.prefix_len();
    for (rank, &(_, b)) in merges.iter().enumerate() {
        tail(b, prefix, rank)?;
    }
    Ok(())
}

/// The crate's cache bounds: words of up to 255 bytes, 10 000 of them.
const CACHE_WORD_BYTES: usize = 256;
const CACHE_WORDS: usize = 10_000;

/// The model's flags as the file gives them (`BPEVisitor`'s fields; absent is the default).
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Flags {
    pub dropout: Option<f32>,
    pub unk_token: Option<String>,
    pub continuing_subword_prefix: Option<String>,
    pub end_of_word_suffix: Option<String>,
    pub fuse_unk: bool,
    pub byte_fallback: bool,
    pub ignore_merges: bool,
}

impl Flags {
    /// The continuing-subword prefix's length in bytes (0 without one).
    fn prefix_len(&self) -> usize {
        self.continuing_subword_prefix
            .as_deref()
            .map_or(0, str::len)
    }
}

/// Why a file's vocabulary and merges make no model.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// The crate's wording (`tokenizers::models::bpe::Error`).
    #[error("Token `{0}` out of vocabulary")]
    MergeTokenOutOfVocabulary(String),
    #[error(
        "merge {rank}: {b:?} does not start with a whole continuing-subword prefix, so the \
         pair names no merged piece"
    )]
    ShortMergePiece { rank: usize, b: String },
}

/// A symbol of a word being merged: its id, its neighbours (`usize::MAX`: none) and its
/// length in bytes of the word (0 once merged into its left neighbour).
#[derive(Clone, Copy)]
struct Symbol {
    id: u32,
    prev: usize,
    next: usize,
    len: usize,
}

const NONE: usize = usize::MAX;

/// A queued merge; `Ord` makes `BinaryHeap` pop the lowest rank, then the leftmost (one
/// rank is one pair, so one merged id).
#[derive(PartialEq, Eq)]
struct Queued {
    rank: u32,
    pos: usize,
    new_id: u32,
}

impl Ord for Queued {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (other.rank, other.pos, other.new_id).cmp(&(self.rank, self.pos, self.new_id))
    }
}

impl PartialOrd for Queued {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

/// A BPE model (see the module header).
pub struct Bpe {
    flags: Flags,
    vocab: AHashMap<String, u32>,
    /// Id → piece; `None` for an id no piece has.
    vocab_r: Vec<Option<String>>,
    /// Pair → (rank, merged id); a pair listed twice keeps its last rank, as the crate's map.
    merges: AHashMap<Pair, (u32, u32)>,
    /// Merged words, as (id, byte length) pieces.
    cache: RwLock<AHashMap<String, Vec<(u32, usize)>>>,
}

impl Bpe {
    /// The model of `vocab` and `merges` (in rank order). `None` where the ids leave more
    /// holes than pieces (the id table would be mostly empty): the caller then builds the
    /// crate's model, which keeps its ids in a map.
    pub fn build(
        flags: Flags,
        vocab: AHashMap<String, u32>,
        merges: &[(&str, &str)],
    ) -> Option<std::result::Result<Bpe, BuildError>> {
        let top = vocab.values().max().map_or(0, |&m| m as usize + 1);
        if top > 2 * vocab.len() + 1024 {
            return None;
        }
        let mut vocab_r = vec![None; top];
        for (piece, &id) in &vocab {
            vocab_r[id as usize] = Some(piece.clone());
        }
        Some(Self::merge_table(&flags, &vocab, merges).map(|merges| Bpe {
            flags,
            vocab,
            vocab_r,
            merges,
            cache: RwLock::new(AHashMap::new()),
        }))
    }

    /// Each merge's pair and (rank, id of the joined piece, the right piece losing the
    /// continuing-subword prefix), as `BpeBuilder::build` resolves them. The lookups of the
    /// second half run on a thread of their own (they only read the vocabulary); the table
    /// is filled in rank order, so a pair listed twice keeps its last rank.
    fn merge_table(
        flags: &Flags,
        vocab: &AHashMap<String, u32>,
        merges: &[(&str, &str)],
    ) -> std::result::Result<AHashMap<Pair, (u32, u32)>, BuildError> {
        let prefix = flags.prefix_len();
        let (first, second) = merges.split_at(merges.len() / 2);
        let (first, second) = std::thread::scope(|s| {
            let second = s.spawn(|| resolve(vocab, prefix, second, first.len()));
            let first = resolve(vocab, prefix, first, 0);
            let second = second
                .join()
                .unwrap_or_else(|e| std::panic::resume_unwind(e));
            (first, second)
        });
        let mut table = AHashMap::with_capacity(merges.len());
        for (rank, (pair, id)) in first?.into_iter().chain(second?).enumerate() {
            table.insert(pair, (rank as u32, id));
        }
        Ok(table)
    }

    /// The pieces (id, byte length) of one word, merged.
    fn merge_word(&self, word: &str) -> Result<Vec<(u32, usize)>> {
        let mut symbols: Vec<Symbol> = Vec::with_capacity(word.len());
        let mut push = |id: u32, len: usize| {
            let at = symbols.len();
            if let Some(last) = symbols.last_mut() {
                last.next = at;
            }
            let prev = if at == 0 { NONE } else { at - 1 };
            symbols.push(Symbol {
                id,
                prev,
                next: NONE,
                len,
            });
        };
        let f = &self.flags;
        let mut unk: Option<(u32, usize)> = None;
        let mut chars = word.char_indices().peekable();
        while let Some((start, c)) = chars.next() {
            let end = start + c.len_utf8();
            let len = end - start;
            let mut piece = Cow::Borrowed(&word[start..end]);
            if start > 0 {
                if let Some(prefix) = &f.continuing_subword_prefix {
                    piece = format!("{prefix}{piece}").into();
                }
            }
            if chars.peek().is_none() {
                if let Some(suffix) = &f.end_of_word_suffix {
                    piece = format!("{piece}{suffix}").into();
                }
            }
            if let Some(&id) = self.vocab.get(piece.as_ref()) {
                if let Some((unk_id, unk_len)) = unk.take() {
                    push(unk_id, unk_len);
                }
                push(id, len);
                continue;
            }
            if f.byte_fallback {
                let bytes: Option<Vec<u32>> = piece
                    .bytes()
                    .map(|b| self.vocab.get(&format!("<{b:#04X}>")).copied())
                    .collect();
                if let Some(bytes) = bytes {
                    // One byte of the word each, as the crate counts them.
                    for id in bytes {
                        push(id, 1);
                    }
                    continue;
                }
            }
            if let Some(unk_token) = &f.unk_token {
                let unk_id = || {
                    // The crate's wording.
                    (self.vocab.get(unk_token).copied()).ok_or_else(|| {
                        format!("Unk token `{unk_token}` not found in the vocabulary")
                    })
                };
                unk = Some(match (unk, f.fuse_unk) {
                    (Some((id, fused)), true) => (id, fused + len),
                    (Some(previous), false) => {
                        push(previous.0, previous.1);
                        (unk_id()?, len)
                    }
                    (None, _) => (unk_id()?, len),
                });
            }
        }
        if let Some((id, len)) = unk {
            push(id, len);
        }
        self.merge_all(&mut symbols);
        Ok(symbols
            .iter()
            .filter(|s| s.len != 0)
            .map(|s| (s.id, s.len))
            .collect())
    }

    /// Applies the merges to `symbols` (see the module header).
    fn merge_all(&self, symbols: &mut [Symbol]) {
        let planted = crate::plant::is(crate::plant::Defect::FastBpeMergesByPosition);
        let queued = |rank: u32, pos: usize, new_id: u32| Queued {
            // Planted: every merge ranks alike, so the leftmost pair merges first.
            rank: if planted { 0 } else { rank },
            pos,
            new_id,
        };
        let mut queue: BinaryHeap<Queued> = symbols
            .windows(2)
            .enumerate()
            .filter_map(|(pos, w)| {
                let &(rank, new_id) = self.merges.get(&(w[0].id, w[1].id))?;
                Some(queued(rank, pos, new_id))
            })
            .collect();
        while let Some(top) = queue.pop() {
            let here = symbols[top.pos];
            if here.len == 0 || here.next == NONE {
                continue;
            }
            let right = symbols[here.next];
            // A stale entry: its pair was merged away, or no longer joins into its id.
            match self.merges.get(&(here.id, right.id)) {
                Some(&(_, id)) if id == top.new_id => {}
                _ => continue,
            }
            symbols[here.next].len = 0;
            if right.next != NONE {
                symbols[right.next].prev = top.pos;
            }
            let merged = &mut symbols[top.pos];
            merged.id = top.new_id;
            merged.len += right.len;
            merged.next = right.next;
            let merged = *merged;
            if merged.prev != NONE {
                let left = symbols[merged.prev];
                if let Some(&(rank, id)) = self.merges.get(&(left.id, merged.id)) {
                    queue.push(queued(rank, merged.prev, id));
                }
            }
            if merged.next != NONE {
                let next = symbols[merged.next];
                if let Some(&(rank, id)) = self.merges.get(&(merged.id, next.id)) {
                    queue.push(queued(rank, top.pos, id));
                }
            }
        }
    }

    /// `pieces` as tokens: each id's piece, at its byte offsets in the word.
    fn tokens(&self, pieces: &[(u32, usize)]) -> Vec<Token> {
        let mut at = 0;
        pieces
            .iter()
            .map(|&(id, len)| {
                let piece = self.id_to_piece(id).unwrap_or_default().to_owned();
                at += len;
                Token::new(id, piece, (at - len, at))
            })
            .collect()
    }

    fn id_to_piece(&self, id: u32) -> Option<&str> {
        self.vocab_r.get(id as usize)?.as_deref()
    }

    pub fn flags(&self) -> &Flags {
        &self.flags
    }
}

impl tokenizers::Model for Bpe {
    type Trainer = BpeTrainer;

    fn tokenize(&self, sequence: &str) -> Result<Vec<Token>> {
        if sequence.is_empty() {
            return Ok(vec![]);
        }
        if self.flags.ignore_merges {
            if let Some(&id) = self.vocab.get(sequence) {
                return Ok(vec![Token::new(
                    id,
                    sequence.to_owned(),
                    (0, sequence.len()),
                )]);
            }
        }
        // A busy cache is skipped, as the crate's `Cache` skips it.
        if let Some(hit) = self
            .cache
            .try_read()
            .ok()
            .and_then(|c| c.get(sequence).cloned())
        {
            return Ok(self.tokens(&hit));
        }
        let pieces = self.merge_word(sequence)?;
        let tokens = self.tokens(&pieces);
        if sequence.len() < CACHE_WORD_BYTES {
            if let Ok(mut cache) = self.cache.try_write() {
                if cache.len() < CACHE_WORDS {
                    cache.insert(sequence.to_owned(), pieces);
                }
            }
        }
        Ok(tokens)
    }

    fn token_to_id(&self, token: &str) -> Option<u32> {
        self.vocab.get(token).copied()
    }

    fn id_to_token(&self, id: u32) -> Option<String> {
        self.id_to_piece(id).map(str::to_owned)
    }

    fn get_vocab(&self) -> HashMap<String, u32> {
        self.vocab.iter().map(|(k, &v)| (k.clone(), v)).collect()
    }

    fn get_vocab_size(&self) -> usize {
        self.vocab.len()
    }

    fn save(
        &self,
        _folder: &std::path::Path,
        _prefix: Option<&str>,
    ) -> Result<Vec<std::path::PathBuf>> {
        Err(
            "the engine's BPE model is not saved as vocab.json and merges.txt: \
             serialize the whole tokenizer to tokenizer.json instead"
                .into(),
        )
    }

    fn get_trainer(&self) -> BpeTrainer {
        BpeTrainer::default()
    }
}

/// As the crate's `BPE` serializes: the flags, the vocabulary in id order, the merges in
/// rank order as pairs of pieces.
impl serde::Serialize for Bpe {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let f = &self.flags;
        let mut model = s.serialize_struct("BPE", 10)?;
        model.serialize_field("type", "BPE")?;
        model.serialize_field("dropout", &f.dropout)?;
        model.serialize_field("unk_token", &f.unk_token)?;
        model.serialize_field("continuing_subword_prefix", &f.continuing_subword_prefix)?;
        model.serialize_field("end_of_word_suffix", &f.end_of_word_suffix)?;
        model.serialize_field("fuse_unk", &f.fuse_unk)?;
        model.serialize_field("byte_fallback", &f.byte_fallback)?;
        model.serialize_field("ignore_merges", &f.ignore_merges)?;
        let vocab: Vec<(&str, u32)> = (self.vocab_r.iter().enumerate())
            .filter_map(|(id, piece)| Some((piece.as_deref()?, id as u32)))
            .collect();
        model.serialize_field("vocab", &OrderedMap(&vocab))?;
        let mut merges: Vec<(&Pair, u32)> = self
            .merges
            .iter()
            .map(|(p, &(rank, _))| (p, rank))
            .collect();
        merges.sort_unstable_by_key(|m| m.1);
        let piece = |id: u32| self.id_to_piece(id).unwrap_or_default();
        let merges: Vec<(&str, &str)> = merges
            .into_iter()
            .map(|(&(a, b), _)| (piece(a), piece(b)))
            .collect();
        model.serialize_field("merges", &merges)?;
        model.end()
    }
}

/// A map serialized in the order of its entries.
struct OrderedMap<'a>(&'a [(&'a str, u32)]);

impl serde::Serialize for OrderedMap<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_map(self.0.iter().map(|&(k, v)| (k, v)))
    }
}
