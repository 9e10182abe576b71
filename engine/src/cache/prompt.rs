//! The RAM prompt cache: KV caches of finished requests kept for the next request that
//! starts the same way (a chat's next turn resends the whole conversation). Entries are
//! keyed by namespace (the adapter a request uses; "" for the base model) and token
//! sequence; a lookup takes the entry with the longest usable common prefix — at most the
//! prompt length − 1, since the last prompt token must be fed to get logits — trims it to
//! that prefix and hands it over (the caller's generation mutates it). Bounded by an entry
//! count and optionally by bytes; the least recently used entry goes first.

use super::Cache;

struct Entry {
    ns: String,
    tokens: Vec<u32>,
    caches: Vec<Box<dyn Cache>>,
    bytes: usize,
    used: u64,
}

/// An entry pushed out of the RAM tier (least recently used, or too large for it): the
/// caller may spill it to the SSD tier.
pub struct Evicted {
    pub ns: String,
    pub tokens: Vec<u32>,
    pub caches: Vec<Box<dyn Cache>>,
}

/// A cache hit: caches holding the first `reused` prompt tokens.
pub struct Hit {
    pub caches: Vec<Box<dyn Cache>>,
    pub reused: usize,
}

#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct PromptCacheStats {
    pub entries: usize,
    pub bytes: usize,
    pub max_entries: usize,
    pub max_bytes: Option<usize>,
    pub hits: u64,
    pub misses: u64,
    pub reused_tokens: u64,
}

pub struct PromptCache {
    entries: Vec<Entry>,
    max_entries: usize,
    max_bytes: Option<usize>,
    clock: u64,
    hits: u64,
    misses: u64,
    reused_tokens: u64,
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl PromptCache {
    pub fn new(max_entries: usize, max_bytes: Option<usize>) -> Self {
        PromptCache {
            entries: Vec::new(),
            max_entries,
            max_bytes,
            clock: 0,
            hits: 0,
            misses: 0,
            reused_tokens: 0,
        }
    }

    /// How many tokens of `prompt` the entry can serve, if any.
    fn usable(entry: &Entry, prompt: &[u32]) -> Option<usize> {
        let n = common_prefix(&entry.tokens, prompt).min(prompt.len().saturating_sub(1));
        let trim = entry.tokens.len() - n;
        let trimmable = trim == 0 || entry.caches.iter().all(|c| c.is_trimmable());
        (n > 0 && trimmable).then_some(n)
    }

    /// Takes the entry with the longest usable prefix of `prompt`, trimmed to it.
    pub fn take(&mut self, ns: &str, prompt: &[u32]) -> Option<Hit> {
        let best = self
            .entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.ns == ns)
            .filter_map(|(i, e)| Self::usable(e, prompt).map(|n| (i, n)))
            .max_by_key(|&(_, n)| n);
        let Some((i, n)) = best else {
            self.misses += 1;
            return None;
        };
        let trim = (self.entries[i].tokens.len() - n) as i32;
        // Branching off an entry (only a prefix of it is used) takes a copy and leaves the
        // entry here for its own conversation; an entry used whole is handed over (the
        // request extends it, and puts the longer one back).
        let copies: Option<Vec<Box<dyn Cache>>> = (trim > 0)
            .then(|| {
                self.entries[i]
                    .caches
                    .iter()
                    .map(|c| super::duplicate(c.as_ref()))
                    .collect()
            })
            .flatten();
        let mut caches = match copies {
            Some(copies) => {
                self.clock += 1;
                self.entries[i].used = self.clock;
                copies
            }
            None => self.entries.swap_remove(i).caches,
        };
        for c in caches.iter_mut() {
            if c.trim(trim) != trim {
                // A cache that cannot give back exactly that much is useless here.
                self.misses += 1;
                return None;
            }
        }
        self.hits += 1;
        self.reused_tokens += n as u64;
        Some(Hit { caches, reused: n })
    }

    /// The caches of the entry holding exactly `tokens`, if it is still here.
    pub fn peek(&self, ns: &str, tokens: &[u32]) -> Option<&[Box<dyn Cache>]> {
        self.entries
            .iter()
            .find(|e| e.ns == ns && e.tokens == tokens)
            .map(|e| e.caches.as_slice())
    }

    /// Stores caches holding `tokens`. Entries of the same namespace that are a prefix of
    /// `tokens` are superseded; an entry larger than the byte cap is refused; then the
    /// least recently used entries go until the caps hold. Returns what was pushed out
    /// (a refused entry included), for a colder tier.
    #[must_use = "evicted entries are dropped unless spilled"]
    pub fn put(&mut self, ns: &str, tokens: Vec<u32>, caches: Vec<Box<dyn Cache>>) -> Vec<Evicted> {
        let bytes: usize = caches.iter().map(|c| c.nbytes()).sum();
        if tokens.is_empty() {
            return Vec::new();
        }
        if self.max_entries == 0 || self.max_bytes.is_some_and(|m| bytes > m) {
            let ns = ns.to_owned();
            return vec![Evicted { ns, tokens, caches }];
        }
        self.entries.retain(|e| {
            !(e.ns == ns && e.tokens.len() <= tokens.len() && tokens.starts_with(&e.tokens))
        });
        self.clock += 1;
        self.entries.push(Entry {
            ns: ns.to_owned(),
            tokens,
            caches,
            bytes,
            used: self.clock,
        });
        let mut evicted = Vec::new();
        while self.entries.len() > self.max_entries
            || self.max_bytes.is_some_and(|m| self.total_bytes() > m)
        {
            evicted.push(self.evict_oldest());
        }
        evicted
    }

    /// Evicts the least recently used entries until the entries' bytes, each counted with
    /// `slack` more (its buffers' unfilled tail), are at most `max` (a memory budget's
    /// room). Returns what was pushed out, for a colder tier.
    #[must_use = "evicted entries are dropped unless spilled"]
    pub fn evict_to(&mut self, max: u64, slack: u64) -> Vec<Evicted> {
        let mut evicted = Vec::new();
        let held = |c: &Self| c.total_bytes() as u64 + slack * c.entries.len() as u64;
        while !self.entries.is_empty() && held(self) > max {
            evicted.push(self.evict_oldest());
        }
        evicted
    }

    /// Takes out the least recently used entry (there is one).
    fn evict_oldest(&mut self) -> Evicted {
        let oldest = (0..self.entries.len())
            .min_by_key(|&i| self.entries[i].used)
            .expect("non-empty while over a cap");
        let e = self.entries.swap_remove(oldest);
        Evicted {
            ns: e.ns,
            tokens: e.tokens,
            caches: e.caches,
        }
    }

    fn total_bytes(&self) -> usize {
        self.entries.iter().map(|e| e.bytes).sum()
    }

    pub fn stats(&self) -> PromptCacheStats {
        PromptCacheStats {
            entries: self.entries.len(),
            bytes: self.total_bytes(),
            max_entries: self.max_entries,
            max_bytes: self.max_bytes,
            hits: self.hits,
            misses: self.misses,
            reused_tokens: self.reused_tokens,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::{kv_of, AttentionCache, KvCache};

    fn caches_with(n: i32) -> Vec<Box<dyn Cache>> {
        let mut c = KvCache::new();
        let k = mlx_rs::ops::ones::<f32>(&[1, 1, n, 4]).unwrap();
        c.update_and_fetch(k.clone(), k).unwrap();
        vec![Box::new(c)]
    }

    #[test]
    fn longest_usable_prefix_is_taken_and_trimmed() {
        let mut pc = PromptCache::new(10, None);
        let _ = pc.put("", vec![1, 2, 3], caches_with(3));
        let _ = pc.put("", vec![1, 2, 9, 9, 9], caches_with(5));
        let _ = pc.put("other", vec![1, 2, 3, 4, 5, 6], caches_with(6));
        // Prompt 1 2 3 4: the first entry shares 3 tokens, the second 2.
        let hit = pc.take("", &[1, 2, 3, 4]).unwrap();
        assert_eq!(hit.reused, 3);
        assert_eq!(hit.caches[0].offset(), 3);
        assert_eq!(pc.stats().entries, 2, "used whole: handed over");
        // The same prompt as an entry: only length − 1 is usable, so it is trimmed by one.
        let _ = pc.put("", vec![7, 8, 9], caches_with(3));
        let hit = pc.take("", &[7, 8, 9]).unwrap();
        assert_eq!((hit.reused, hit.caches[0].offset()), (2, 2));
        // Used in part: a trimmed copy; the entry stays, whole.
        assert_eq!(pc.stats().entries, 3);
        assert_eq!(pc.peek("", &[7, 8, 9]).unwrap()[0].offset(), 3);
        // Namespaces do not mix; no common prefix is a miss.
        assert!(pc.take("", &[5, 5]).is_none());
        let s = pc.stats();
        assert_eq!((s.hits, s.misses, s.entries), (2, 1, 3));
    }

    /// A copy handed out for a branch shares the entry's buffers; writing into the copy must
    /// not change the entry (MLX copies a shared buffer before a slice update).
    #[test]
    fn a_branch_copy_never_writes_into_the_entry() {
        let mut pc = PromptCache::new(10, None);
        let _ = pc.put("", vec![1, 2, 3, 4, 5], caches_with(5));
        let mut hit = pc.take("", &[1, 2, 3, 9, 9]).unwrap();
        assert_eq!(hit.reused, 3);
        let twos = mlx_rs::ops::full::<f32>(&[1, 1, 1, 4], mlx_rs::Array::from_f32(2.0)).unwrap();
        let kv = kv_of(hit.caches[0].as_mut())
            .unwrap()
            .update_and_fetch(twos.clone(), twos)
            .unwrap();
        let crate::cache::Kv::Dense(k, _) = kv else {
            panic!("dense")
        };
        let k = k.as_dtype(mlx_rs::Dtype::Float32).unwrap();
        k.eval().unwrap();
        assert_eq!(k.as_slice::<f32>()[12..16], [2.0; 4]);
        let entry = &pc.peek("", &[1, 2, 3, 4, 5]).unwrap()[0];
        let state = entry.state()[0].as_dtype(mlx_rs::Dtype::Float32).unwrap();
        state.eval().unwrap();
        assert_eq!(state.as_slice::<f32>()[..20], [1.0; 20]);
    }

    #[test]
    fn caps_evict_least_recently_used_and_prefixes_are_superseded() {
        let mut pc = PromptCache::new(2, None);
        assert!(pc.put("", vec![1, 2], caches_with(2)).is_empty());
        // Supersedes [1, 2] (not an eviction: the new entry serves all it served).
        assert!(pc.put("", vec![1, 2, 3], caches_with(3)).is_empty());
        assert_eq!(pc.stats().entries, 1);
        assert!(pc.put("", vec![4, 5], caches_with(2)).is_empty());
        // Evicts [1, 2, 3], the oldest, and hands it back for spilling.
        let out = pc.put("", vec![6, 7], caches_with(2));
        assert_eq!(out.len(), 1);
        assert_eq!(
            (out[0].tokens.as_slice(), out[0].caches[0].offset()),
            (&[1, 2, 3][..], 3)
        );
        assert!(pc.take("", &[1, 2, 3, 4]).is_none());
        assert!(pc.peek("", &[4, 5]).is_some() && pc.peek("", &[4]).is_none());
        let one = caches_with(2)[0].nbytes();
        let mut capped = PromptCache::new(10, Some(one));
        // 300 positions take two 256-position blocks: larger than the cap, refused.
        let refused = capped.put("", (0..300).collect(), caches_with(300));
        assert_eq!((capped.stats().entries, refused.len()), (0, 1));
        let _ = capped.put("", vec![1, 2], caches_with(2));
        assert_eq!(capped.stats().entries, 1);
    }
}
