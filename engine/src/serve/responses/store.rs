//! The responses the server produced, kept so that a request naming one in
//! `previous_response_id` continues its conversation: each entry is the whole conversation
//! as chat messages (its input, the previous turns it continued, and its answer), never
//! its `instructions` (OpenAI does not carry those over). Bounded by count and by bytes,
//! least recently used out first; `store: false` responses are not kept.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use serde_json::Value;

/// Responses kept at most.
pub const MAX_ENTRIES: usize = 256;
/// Bytes of conversation JSON kept at most (all entries together).
pub const MAX_BYTES: usize = 64 << 20;

#[derive(Default)]
struct Inner {
    map: HashMap<String, (Arc<Vec<Value>>, usize)>,
    /// Least recently used first.
    order: VecDeque<String>,
    bytes: usize,
}

/// The kept conversations, shared by the HTTP handlers.
#[derive(Default)]
pub struct Store {
    inner: Mutex<Inner>,
}

impl Store {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The conversation response `id` ended with (now the most recently used one).
    pub fn get(&self, id: &str) -> Option<Arc<Vec<Value>>> {
        let mut inner = self.lock();
        let found = inner.map.get(id).map(|(c, _)| c.clone())?;
        if let Some(at) = inner.order.iter().position(|k| k == id) {
            inner.order.remove(at);
        }
        inner.order.push_back(id.to_owned());
        Some(found)
    }

    /// Keeps `conversation` under `id`, dropping the least recently used entries past the
    /// bounds (a conversation bigger than the whole budget is not kept).
    pub fn put(&self, id: String, conversation: Vec<Value>) {
        let size: usize = conversation.iter().map(|m| m.to_string().len()).sum();
        if size > MAX_BYTES {
            return;
        }
        let mut inner = self.lock();
        if let Some((_, old)) = inner.map.remove(&id) {
            inner.bytes -= old;
            inner.order.retain(|k| k != &id);
        }
        while inner.map.len() >= MAX_ENTRIES || inner.bytes + size > MAX_BYTES {
            let Some(oldest) = inner.order.pop_front() else {
                break;
            };
            if let Some((_, n)) = inner.map.remove(&oldest) {
                inner.bytes -= n;
            }
        }
        inner.bytes += size;
        inner.order.push_back(id.clone());
        inner.map.insert(id, (Arc::new(conversation), size));
    }

    /// How many responses are kept.
    pub fn len(&self) -> usize {
        self.lock().map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn least_recently_used_goes_first() {
        let s = Store::default();
        for i in 0..MAX_ENTRIES {
            s.put(
                format!("r{i}"),
                vec![json!({"role": "user", "content": "x"})],
            );
        }
        assert!(s.get("r0").is_some(), "r0 is now the most recent");
        s.put("new".into(), vec![]);
        assert_eq!(s.len(), MAX_ENTRIES);
        assert!(s.get("r1").is_none(), "r1 was the least recently used");
        assert!(s.get("r0").is_some() && s.get("new").is_some());
    }
}
