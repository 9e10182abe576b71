//! The response object and its stream: one state machine reads the chat machinery's
//! deltas (reasoning, text, tool calls) and opens, fills and closes output items, writing
//! the Responses stream events as it goes. A whole (non-streamed) answer runs the same
//! machine and keeps only the final response, so both answer the same items.

use serde_json::{json, Value};

use super::super::emit::Usage;
use super::super::tools::call::ToolCall;
use super::super::tools::split::Delta;
use super::input::Echo;
use crate::plant::{self, Defect};

/// What every response object of one request carries besides its output.
pub struct Head {
    pub id: String,
    pub created_at: u64,
    pub model: String,
    pub echo: Echo,
    /// The effective sampling values (the server's defaults where the request set none).
    pub temperature: f64,
    pub top_p: f64,
}

/// The item being written.
enum Open {
    None,
    Reasoning { index: usize, text: String },
    Message { index: usize, text: String },
}

pub struct Machine {
    head: Head,
    seq: u64,
    /// The finished items, in order.
    output: Vec<Value>,
    open: Open,
    /// Whitespace-only text not yet given to a message item (a tool-calling answer's
    /// "\n\n" before its call makes no message).
    pending: String,
    /// The whole answer as the chat route has it (what the next turn's prompt holds).
    pub text: String,
    pub reasoning: String,
    /// The tool calls made.
    pub calls: Vec<ToolCall>,
}

/// `usage` in the Responses shape.
pub fn usage(u: &Usage, reasoning_tokens: usize) -> Value {
    let mut v = json!({
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    });
    let out = if plant::is(Defect::ResponsesUsageMisnamed) {
        "completion_tokens"
    } else {
        "output_tokens"
    };
    v[out] = json!(u.completion_tokens);
    v
}

impl Machine {
    pub fn new(head: Head) -> Self {
        Machine {
            head,
            seq: 0,
            output: Vec::new(),
            open: Open::None,
            pending: String::new(),
            text: String::new(),
            reasoning: String::new(),
            calls: Vec::new(),
        }
    }

    pub fn id(&self) -> &str {
        &self.head.id
    }

    pub fn head(&self) -> &Head {
        &self.head
    }

    fn event(&mut self, kind: &str, mut body: Value) -> Value {
        body["type"] = json!(kind);
        body["sequence_number"] = json!(self.seq);
        self.seq += 1;
        body
    }

    fn item_id(&self, prefix: &str) -> String {
        let base = self.head.id.trim_start_matches("resp_");
        format!("{prefix}_{base}{:02x}", self.output.len())
    }

    /// The response object: `status` with the items so far (and usage when done).
    pub fn response(&self, status: &str, usage: Option<Value>) -> Value {
        let h = &self.head;
        let e = &h.echo;
        let incomplete = if status == "incomplete" {
            json!({"reason": "max_output_tokens"})
        } else {
            Value::Null
        };
        json!({
            "id": h.id, "object": "response", "created_at": h.created_at, "status": status,
            "error": null,
            "incomplete_details": incomplete,
            "instructions": e.instructions, "max_output_tokens": e.max_output_tokens,
            "model": h.model, "output": self.output,
            "parallel_tool_calls": e.parallel_tool_calls,
            "previous_response_id": e.previous_response_id,
            "reasoning": e.reasoning, "store": e.store,
            "temperature": h.temperature, "top_p": h.top_p,
            "text": e.text, "tool_choice": e.tool_choice, "tools": e.tools,
            "truncation": e.truncation, "user": e.user, "metadata": e.metadata,
            "usage": usage,
        })
    }

    /// response.created and response.in_progress.
    pub fn start(&mut self) -> Vec<Value> {
        let r = self.response("in_progress", None);
        vec![
            self.event("response.created", json!({"response": r})),
            self.event("response.in_progress", json!({"response": r})),
        ]
    }

    fn open_item(&mut self, item: Value, part: Option<Value>) -> Vec<Value> {
        let index = self.output.len();
        let id = item["id"].clone();
        let mut out = vec![self.event(
            "response.output_item.added",
            json!({"output_index": index, "item": item}),
        )];
        if let Some(part) = part {
            out.push(self.event(
                "response.content_part.added",
                json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}),
            ));
        }
        out
    }

    fn open_message(&mut self) -> Vec<Value> {
        let mut out = self.close(false);
        let id = self.item_id("msg");
        let item = json!({"type": "message", "id": id, "status": "in_progress",
            "role": "assistant", "content": []});
        let part = json!({"type": "output_text", "text": "", "annotations": [], "logprobs": []});
        out.extend(self.open_item(item, Some(part)));
        self.open = Open::Message {
            index: self.output.len(),
            text: String::new(),
        };
        out
    }

    fn open_reasoning(&mut self) -> Vec<Value> {
        let mut out = self.close(false);
        let id = self.item_id("rs");
        let item = json!({"type": "reasoning", "id": id, "status": "in_progress",
            "summary": [], "content": []});
        out.extend(self.open_item(item, Some(json!({"type": "reasoning_text", "text": ""}))));
        self.open = Open::Reasoning {
            index: self.output.len(),
            text: String::new(),
        };
        out
    }

    /// Closes the open item (its done events); `cut`: the answer hit its token limit.
    fn close(&mut self, cut: bool) -> Vec<Value> {
        let status = if cut { "incomplete" } else { "completed" };
        let (index, text, reasoning) = match std::mem::replace(&mut self.open, Open::None) {
            Open::None => return Vec::new(),
            Open::Reasoning { index, text } => (index, text, true),
            Open::Message { index, text } => (index, text, false),
        };
        let id = self.item_id(if reasoning { "rs" } else { "msg" });
        let (done, part, item) = if reasoning {
            let part = json!({"type": "reasoning_text", "text": text});
            let item = json!({"type": "reasoning", "id": id, "status": status,
                "summary": [], "content": [part]});
            ("response.reasoning_text.done", part, item)
        } else {
            let part =
                json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []});
            let item = json!({"type": "message", "id": id, "status": status,
                "role": "assistant", "content": [part]});
            ("response.output_text.done", part, item)
        };
        let mut text_done =
            json!({"item_id": id, "output_index": index, "content_index": 0, "text": text});
        if !reasoning {
            text_done["logprobs"] = json!([]);
        }
        let out = vec![
            self.event(done, text_done),
            self.event(
                "response.content_part.done",
                json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}),
            ),
            self.event(
                "response.output_item.done",
                json!({"output_index": index, "item": item}),
            ),
        ];
        self.output.push(item);
        out
    }

    /// One delta of the chat machinery: its events.
    pub fn delta(&mut self, d: &Delta) -> Vec<Value> {
        let mut out = Vec::new();
        if !d.reasoning.is_empty() {
            self.reasoning.push_str(&d.reasoning);
            if !matches!(self.open, Open::Reasoning { .. }) {
                out.extend(self.open_reasoning());
            }
            out.extend(self.append(&d.reasoning, "response.reasoning_text.delta"));
        }
        if !d.text.is_empty() {
            self.text.push_str(&d.text);
            if matches!(self.open, Open::Message { .. }) {
                out.extend(self.append(&d.text, "response.output_text.delta"));
            } else {
                self.pending.push_str(&d.text);
                if !self.pending.trim().is_empty() {
                    out.extend(self.open_message());
                    let text = std::mem::take(&mut self.pending);
                    out.extend(self.append(&text, "response.output_text.delta"));
                }
            }
        }
        for call in &d.tool_calls {
            out.extend(self.call(call));
        }
        out
    }

    /// Text into the open item (`kind`: the delta event).
    fn append(&mut self, delta: &str, kind: &str) -> Vec<Value> {
        let index = match &mut self.open {
            Open::Reasoning { index, text } | Open::Message { index, text } => {
                text.push_str(delta);
                *index
            }
            Open::None => return Vec::new(),
        };
        let prefix = if kind.contains("reasoning") {
            "rs"
        } else {
            "msg"
        };
        let item_id = self.item_id(prefix);
        let mut body = json!({"item_id": item_id, "output_index": index, "content_index": 0,
            "delta": delta});
        if prefix == "msg" {
            body["logprobs"] = json!([]);
        }
        vec![self.event(kind, body)]
    }

    /// A whole tool call as a function_call item.
    fn call(&mut self, call: &ToolCall) -> Vec<Value> {
        let mut out = self.close(false);
        let (call_id, name, arguments) = (&call.id, &call.name, &call.arguments);
        self.calls.push(call.clone());
        let id = self.item_id("fc");
        let index = self.output.len();
        let item = |arguments: &str, status: &str| {
            json!({"type": "function_call", "id": id, "call_id": call_id, "name": name,
                "arguments": arguments, "status": status})
        };
        out.extend(self.open_item(item("", "in_progress"), None));
        out.push(self.event(
            "response.function_call_arguments.delta",
            json!({"item_id": id, "output_index": index, "delta": arguments}),
        ));
        out.push(self.event(
            "response.function_call_arguments.done",
            json!({"item_id": id, "output_index": index, "arguments": arguments, "name": name}),
        ));
        let done = item(arguments, "completed");
        out.push(self.event(
            "response.output_item.done",
            json!({"output_index": index, "item": done}),
        ));
        self.output.push(done);
        out
    }

    /// The answer ended (`finish_reason` as the chat route has it): the open item closed,
    /// held whitespace given to a message when the answer has nothing else, then
    /// response.completed (response.incomplete at the token limit).
    pub fn finish(&mut self, finish_reason: &str, usage: Value) -> (Vec<Value>, Value) {
        let cut = finish_reason == "length";
        let mut out = Vec::new();
        let nothing = self.output.is_empty() && matches!(self.open, Open::None);
        if (!self.pending.is_empty() && self.calls.is_empty()) || nothing {
            if !matches!(self.open, Open::Message { .. }) {
                out.extend(self.open_message());
            }
            let text = std::mem::take(&mut self.pending);
            if !text.is_empty() {
                out.extend(self.append(&text, "response.output_text.delta"));
            }
        }
        out.extend(self.close(cut));
        let status = if cut { "incomplete" } else { "completed" };
        let response = self.response(status, Some(usage));
        let kind = if cut {
            "response.incomplete"
        } else {
            "response.completed"
        };
        out.push(self.event(kind, json!({"response": response})));
        (out, response)
    }

    /// An error after the stream started: the `error` event.
    pub fn error(&mut self, e: &super::super::error::ApiError) -> Value {
        self.event(
            "error",
            json!({"code": null, "message": e.message, "param": e.param}),
        )
    }

    /// The assistant turn as the chat route takes it back (what the next turn continues).
    pub fn assistant_message(&self) -> Value {
        let mut m = json!({"role": "assistant", "content": self.text});
        if !self.calls.is_empty() {
            // Kept in the chat API's shape: the next turn's template reads it as a chat
            // message.
            m["tool_calls"] = self.calls.iter().map(|c| c.chat_json(false)).collect();
        }
        m
    }
}
