//! One request's text, split as mlx_lm.server's `handle_completion` splits it: each
//! generated token's text goes through the state machine; reasoning, tool-call text and
//! content accumulate, and a delta goes out after a token when the machine is not inside
//! a tool call and there is something to send. A finished tool call is parsed and made a
//! `ToolCall` as `ToolCallFormatter` formats it (an id, the arguments as a JSON string, an
//! index counting the calls); each API shapes it at its edge.

use std::sync::Arc;

use serde_json::Value;

use super::call::ToolCall;
use super::machine::{Cursor, Machine, State};
use super::value::PyValue;
use super::{Family, Markers};

/// What one streamed chunk carries (and what a whole answer is the sum of).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Delta {
    pub text: String,
    pub reasoning: String,
    /// The calls finished in this chunk.
    pub tool_calls: Vec<ToolCall>,
}

impl Delta {
    pub fn is_empty(&self) -> bool {
        self.text.is_empty() && self.reasoning.is_empty() && self.tool_calls.is_empty()
    }
}

/// A version-4 UUID from the standard library's per-process random hasher keys.
fn uuid4() -> String {
    use std::hash::{BuildHasher, Hasher};
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let word = |salt: u64| {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(n);
        h.write_u64(salt);
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
        );
        h.finish()
    };
    let (a, b) = (word(1), word(2));
    format!(
        "{:08x}-{:04x}-4{:03x}-{:04x}-{:012x}",
        a >> 32,
        (a >> 16) & 0xffff,
        a & 0xfff,
        (b >> 48) & 0x3fff | 0x8000,
        b & 0xffff_ffff_ffff
    )
}

/// `ToolCallFormatter`: parses tool-call texts and formats the calls.
pub struct Formatter {
    family: Option<Family>,
    tools: Option<Value>,
    next_index: usize,
}

impl Formatter {
    pub fn new(family: Option<Family>, tools: Option<Value>) -> Self {
        Formatter {
            family,
            tools,
            next_index: 0,
        }
    }

    /// Each text's calls; a text that does not parse is left out (mlx-lm logs a warning
    /// and goes on: the text was likely cut off).
    pub fn format(&mut self, texts: &[String]) -> Vec<ToolCall> {
        let mut out = Vec::new();
        let Some(family) = self.family else {
            return out;
        };
        for text in texts {
            match family.parse(text, self.tools.as_ref()) {
                Ok(calls) => {
                    for c in calls {
                        match self.format_one(c) {
                            Ok(v) => out.push(v),
                            Err(e) => eprintln!("engine serve: warning: dropped a tool call: {e}"),
                        }
                    }
                }
                Err(e) => eprintln!(
                    "engine serve: warning: failed to parse tool call ({e}) — tool text was \
                     likely truncated mid-generation."
                ),
            }
        }
        out
    }

    fn format_one(&mut self, call: PyValue) -> Result<ToolCall, String> {
        let PyValue::Dict(mut items) = call else {
            return Err("a tool call is not an object".into());
        };
        let id = match items
            .iter()
            .position(|(k, _)| matches!(k, PyValue::Str(s) if s == "id"))
        {
            Some(i) => Some(items.remove(i).1).filter(PyValue::truthy),
            None => None,
        };
        let slot = items
            .iter_mut()
            .find(|(k, _)| matches!(k, PyValue::Str(s) if s == "arguments"))
            .ok_or("a tool call has no arguments")?;
        let arguments = slot.1.dumps().map_err(|e| e.to_string())?;
        let Value::Object(mut extra) = PyValue::Dict(items).to_json() else {
            return Err("a tool call is not an object".into());
        };
        extra.remove("arguments");
        let name = match extra.remove("name") {
            Some(Value::String(name)) => name,
            _ => return Err("a tool call has no name (a string)".into()),
        };
        let id = match id.map(|v| v.to_json()) {
            None => uuid4(),
            Some(Value::String(s)) => s,
            Some(other) => other.to_string(),
        };
        let index = self.next_index;
        self.next_index += 1;
        Ok(ToolCall {
            index,
            id,
            name,
            arguments,
            extra,
        })
    }
}

/// A request's splitter: the machine's cursor and what waits to be sent.
pub struct Splitter {
    machine: Arc<Machine>,
    cur: Cursor,
    prev: State,
    pending: Delta,
    tool_text: String,
    /// Finished tool-call texts, not yet parsed.
    finished: Vec<String>,
    made_tool_call: bool,
    formatter: Formatter,
}

impl Splitter {
    pub fn new(
        markers: &Markers,
        machine: Arc<Machine>,
        tools: Option<Value>,
        initial: State,
    ) -> Self {
        Splitter {
            cur: machine.start(initial),
            machine,
            prev: initial,
            pending: Delta::default(),
            tool_text: String::new(),
            finished: Vec::new(),
            made_tool_call: false,
            formatter: Formatter::new(markers.tools, tools),
        }
    }

    fn collect(&mut self, segments: Vec<(State, String)>) {
        for (state, text) in segments {
            match state {
                State::Reasoning if crate::plant::is(crate::plant::Defect::ReasoningInContent) => {
                    self.pending.text.push_str(&text)
                }
                State::Reasoning => self.pending.reasoning.push_str(&text),
                State::Tool => self.tool_text.push_str(&text),
                State::Normal => {
                    if self.prev == State::Tool {
                        self.finished.push(std::mem::take(&mut self.tool_text));
                        self.made_tool_call = true;
                    }
                    self.pending.text.push_str(&text);
                }
            }
            self.prev = state;
        }
    }

    /// What goes out after a token: everything pending, unless inside a tool call or
    /// there is nothing.
    fn release(&mut self) -> Option<Delta> {
        if self.cur.state == State::Tool || (self.pending.is_empty() && self.finished.is_empty()) {
            return None;
        }
        let mut delta = std::mem::take(&mut self.pending);
        delta.tool_calls = self.formatter.format(&std::mem::take(&mut self.finished));
        if crate::plant::is(crate::plant::Defect::ToolCallTextInContent)
            && !delta.tool_calls.is_empty()
        {
            delta.text.push_str("<tool_call>");
        }
        Some(delta)
    }

    /// One token's text.
    pub fn push(&mut self, text: &str) -> Option<Delta> {
        let segments = self.machine.split(&mut self.cur, text);
        self.collect(segments);
        self.release()
    }

    /// The last token's text when the answer reached its length: split, then what is
    /// held back released.
    pub fn push_last(&mut self, text: &str) -> Option<Delta> {
        let mut segments = self.machine.split(&mut self.cur, text);
        segments.push((self.cur.state, self.machine.flush(&mut self.cur)));
        self.collect(segments);
        self.release()
    }

    /// The answer ended (`stopped`: at EOS or a stop string, where held-back text is
    /// dropped). The last chunk's delta, and whether a tool call was made.
    pub fn finish(&mut self, stopped: bool) -> (Delta, bool) {
        if stopped {
            self.machine.discard(&mut self.cur);
            self.collect(vec![(self.cur.state, String::new())]);
        }
        if self.prev == State::Tool && !self.tool_text.is_empty() {
            self.finished.push(std::mem::take(&mut self.tool_text));
            self.made_tool_call = true;
        }
        let mut delta = std::mem::take(&mut self.pending);
        delta.tool_calls = self.formatter.format(&std::mem::take(&mut self.finished));
        let made =
            self.made_tool_call && !crate::plant::is(crate::plant::Defect::ToolCallFinishStaysStop);
        (delta, made)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qwen_markers() -> Markers {
        Markers {
            thinking: Some(super::super::Thinking {
                start: "<think>".into(),
                end: "</think>".into(),
                start_ids: vec![1],
                end_ids: vec![2],
            }),
            tools: Some(Family::JsonTools),
            structural: Vec::new(),
        }
    }

    fn splitter(m: &Markers, initial: State) -> Splitter {
        Splitter::new(m, Arc::new(m.machine()), None, initial)
    }

    fn names(d: &Delta) -> Vec<(String, u64)> {
        d.tool_calls
            .iter()
            .map(|c| (c.name.clone(), c.index as u64))
            .collect()
    }

    #[test]
    fn text_before_a_tool_call_waits_for_it_and_calls_count_up() {
        let m = qwen_markers();
        let mut s = splitter(&m, State::Normal);
        assert_eq!(
            s.push("Let me check. <tool").unwrap().text,
            "Let me check. "
        );
        // Inside the call: nothing goes out.
        assert_eq!(s.push("_call>{\"name\": \"a\", \"arguments\": {}}"), None);
        let d = s
            .push("</tool_call><tool_call>{\"name\": \"b\", \"arguments\": {\"x\": 1}}</tool_call>")
            .unwrap();
        assert_eq!(names(&d), [("a".to_owned(), 0), ("b".to_owned(), 1)]);
        assert_eq!(d.tool_calls[1].arguments, "{\"x\": 1}");
        let (last, made) = s.finish(true);
        assert!(made && last.is_empty());
    }

    #[test]
    fn a_call_cut_off_at_eos_is_still_parsed_and_held_text_is_dropped() {
        let m = qwen_markers();
        let mut s = splitter(&m, State::Reasoning);
        assert_eq!(s.push("hmm</think>").unwrap().reasoning, "hmm");
        assert_eq!(
            s.push("<tool_call>{\"name\": \"f\", \"arguments\": {}}"),
            None
        );
        let (last, made) = s.finish(true);
        assert!(made);
        assert_eq!(names(&last), [("f".to_owned(), 0)]);
        // A marker's start held at EOS is dropped; at the limit it is released.
        let mut s = splitter(&m, State::Normal);
        assert_eq!(s.push("ok <").unwrap().text, "ok ");
        assert_eq!(s.finish(true).0, Delta::default());
        let mut s = splitter(&m, State::Normal);
        assert_eq!(s.push("ok ").unwrap().text, "ok ");
        assert_eq!(s.push_last("<").unwrap().text, "<");
    }

    #[test]
    fn an_unparsable_call_is_dropped_but_its_chunk_still_goes_out() {
        let m = qwen_markers();
        let mut s = splitter(&m, State::Normal);
        assert_eq!(s.push("<tool_call>{broken"), None);
        // mlx_lm.server sends the (now empty) chunk: the raw call text was pending.
        assert_eq!(s.push("</tool_call>"), Some(Delta::default()));
        assert!(
            s.finish(true).1,
            "a tool call was made, even if it did not parse"
        );
    }

    #[test]
    fn mistral_calls_run_to_the_end_of_the_answer() {
        let m = Markers {
            tools: Some(Family::Mistral),
            ..Markers::default()
        };
        let mut s = splitter(&m, State::Normal);
        assert_eq!(s.push("[TOOL_CALLS]get_weather[ARGS]{\"city\": "), None);
        assert_eq!(s.push("\"Oslo\"}"), None);
        let (last, made) = s.finish(true);
        assert!(made);
        assert_eq!(last.tool_calls[0].arguments, "{\"city\": \"Oslo\"}");
    }

    #[test]
    fn the_reasoning_state_starts_where_the_prompt_left_a_think_block_open() {
        let m = qwen_markers();
        assert_eq!(m.initial_state(&[5, 1, 6]), State::Reasoning);
        assert_eq!(m.initial_state(&[1, 6, 2, 7]), State::Normal);
        assert_eq!(m.initial_state(&[1, 2, 1]), State::Reasoning);
        assert_eq!(m.initial_state(&[5, 6]), State::Normal);
        assert_eq!(Markers::default().initial_state(&[1]), State::Normal);
    }
}
