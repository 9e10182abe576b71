//! The Message object and its stream: one state machine reads the chat machinery's
//! deltas (reasoning, text, tool calls) and opens, fills and closes content blocks
//! (`thinking`, `text`, `tool_use`), writing Anthropic's stream events as it goes
//! (`content_block_start`, `content_block_delta`, `content_block_stop`). A whole answer
//! runs the same machine and keeps only the final message, so both tell the same blocks.
//!
//! A thinking block's `signature` is the constant `SIGNATURE`: this server signs nothing,
//! and ignores the signature of thinking blocks sent back.

use serde_json::{json, Value};

use super::super::emit::Usage;
use super::super::tools::call::ToolCall;
use super::super::tools::split::Delta;
use crate::plant::{self, Defect};

/// The `signature` of every thinking block this server writes.
pub const SIGNATURE: &str = "engine-unsigned";

/// What the message carries besides its content.
pub struct Head {
    pub id: String,
    pub model: String,
    pub input_tokens: usize,
}

/// The block being written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Open {
    None,
    Thinking,
    Text,
}

pub struct Machine {
    head: Head,
    /// The finished blocks, in order.
    content: Vec<Value>,
    open: Open,
    /// The open block's text.
    text: String,
    /// Whitespace-only text not yet given to a text block (a tool-calling answer's
    /// "\n\n" before its call makes no block).
    pending: String,
    /// Whitespace-only text opens a text block at once (`sending_space`).
    sends_space: bool,
    pub calls: usize,
}

/// A tool call's id as Anthropic shapes them (`toolu_…`).
fn tool_id(call: &ToolCall) -> String {
    if call.id.starts_with("toolu_") {
        call.id.clone()
    } else {
        format!("toolu_{}", call.id.replace('-', ""))
    }
}

/// A tool call's input: the arguments as an object (a non-object under `value`).
fn tool_input(call: &ToolCall) -> Value {
    if plant::is(Defect::MessagesToolInputString) {
        return json!(call.arguments);
    }
    match serde_json::from_str::<Value>(&call.arguments) {
        Ok(v @ Value::Object(_)) => v,
        Ok(other) => json!({"value": other}),
        Err(_) => json!({"value": call.arguments}),
    }
}

/// `stop_reason` from the chat finish reason and the matched stop string.
pub fn stop_reason(finish_reason: &str, stop_sequence: Option<&str>, calls: usize) -> &'static str {
    match finish_reason {
        "length" => "max_tokens",
        _ if stop_sequence.is_some() => "stop_sequence",
        _ if calls > 0 || finish_reason == "tool_calls" => "tool_use",
        _ if plant::is(Defect::MessagesStopReasonMisnamed) => "stop",
        _ => "end_turn",
    }
}

/// `usage` in Anthropic's shape.
pub fn usage(u: &Usage) -> Value {
    json!({
        "input_tokens": u.prompt_tokens,
        "output_tokens": u.completion_tokens,
        "cache_read_input_tokens": u.cached_tokens,
        "cache_creation_input_tokens": 0,
    })
}

impl Machine {
    pub fn new(head: Head) -> Self {
        Machine {
            head,
            content: Vec::new(),
            open: Open::None,
            text: String::new(),
            pending: String::new(),
            sends_space: false,
            calls: 0,
        }
    }

    /// Whitespace-only text opens the text block as it comes, as mlx_vlm.server streams.
    pub fn sending_space(mut self) -> Self {
        self.sends_space = true;
        self
    }

    fn message(&self, content: Value, stop: Value, stop_sequence: Value, usage: Value) -> Value {
        json!({
            "id": self.head.id,
            "type": "message",
            "role": "assistant",
            "model": self.head.model,
            "content": content,
            "stop_reason": stop,
            "stop_sequence": stop_sequence,
            "usage": usage,
        })
    }

    /// The stream's first events: message_start (no content yet), then a ping.
    pub fn start(&self) -> Vec<Value> {
        let usage = json!({"input_tokens": self.head.input_tokens, "output_tokens": 0,
            "cache_read_input_tokens": null, "cache_creation_input_tokens": 0});
        vec![
            json!({"type": "message_start",
                "message": self.message(json!([]), Value::Null, Value::Null, usage)}),
            json!({"type": "ping"}),
        ]
    }

    fn index(&self) -> usize {
        self.content.len()
    }

    /// Closes the open block (a thinking block gets its signature first).
    fn close(&mut self, out: &mut Vec<Value>) {
        let index = self.index();
        let text = std::mem::take(&mut self.text);
        let block = match self.open {
            Open::None => return,
            Open::Thinking => {
                out.push(json!({"type": "content_block_delta", "index": index,
                    "delta": {"type": "signature_delta", "signature": SIGNATURE}}));
                json!({"type": "thinking", "thinking": text, "signature": SIGNATURE})
            }
            Open::Text => json!({"type": "text", "text": text}),
        };
        out.push(json!({"type": "content_block_stop", "index": index}));
        self.content.push(block);
        self.open = Open::None;
    }

    /// Opens a block of `kind` (closing another) and adds `piece` to it.
    fn write(&mut self, kind: Open, piece: &str, out: &mut Vec<Value>) {
        if self.open != kind {
            self.close(out);
            let block = match kind {
                Open::Thinking => json!({"type": "thinking", "thinking": "", "signature": ""}),
                _ => json!({"type": "text", "text": ""}),
            };
            out.push(json!({"type": "content_block_start", "index": self.index(),
                "content_block": block}));
            self.open = kind;
        }
        self.text.push_str(piece);
        let delta = match kind {
            Open::Thinking => json!({"type": "thinking_delta", "thinking": piece}),
            _ => json!({"type": "text_delta", "text": piece}),
        };
        out.push(json!({"type": "content_block_delta", "index": self.index(), "delta": delta}));
    }

    /// One delta's events.
    pub fn delta(&mut self, d: &Delta) -> Vec<Value> {
        let mut out = Vec::new();
        if !d.reasoning.is_empty() {
            self.write(Open::Thinking, &d.reasoning, &mut out);
        }
        if !d.text.is_empty() {
            if self.open != Open::Text && !self.sends_space && d.text.trim().is_empty() {
                self.pending.push_str(&d.text);
            } else {
                let piece = std::mem::take(&mut self.pending) + &d.text;
                self.write(Open::Text, &piece, &mut out);
            }
        }
        for call in &d.tool_calls {
            self.close(&mut out);
            self.pending.clear();
            let index = self.index();
            let (id, input) = (tool_id(call), tool_input(call));
            out.push(json!({"type": "content_block_start", "index": index,
                "content_block": {"type": "tool_use", "id": id, "name": call.name,
                    "input": {}}}));
            let partial = match &input {
                Value::String(s) => s.clone(),
                v => v.to_string(),
            };
            out.push(json!({"type": "content_block_delta", "index": index,
                "delta": {"type": "input_json_delta", "partial_json": partial}}));
            out.push(json!({"type": "content_block_stop", "index": index}));
            self.content
                .push(json!({"type": "tool_use", "id": id, "name": call.name,
                "input": input}));
            self.calls += 1;
        }
        out
    }

    /// The last events (the open block closed, message_delta, message_stop) and the
    /// whole message.
    pub fn finish(
        &mut self,
        finish_reason: &str,
        stop_sequence: Option<&str>,
        u: &Usage,
    ) -> (Vec<Value>, Value) {
        let mut out = Vec::new();
        self.close(&mut out);
        let reason = stop_reason(finish_reason, stop_sequence, self.calls);
        let delta = json!({"type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": stop_sequence},
            "usage": usage(u)});
        if plant::is(Defect::MessagesEventsOutOfOrder) && !out.is_empty() {
            let at = out.len() - 1;
            out.insert(at, delta);
        } else {
            out.push(delta);
        }
        out.push(json!({"type": "message_stop"}));
        let message = self.message(
            Value::Array(self.content.clone()),
            json!(reason),
            json!(stop_sequence),
            usage(u),
        );
        (out, message)
    }
}
