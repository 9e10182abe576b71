//! A parsed tool call as the server keeps it (`ToolCall`), until an API formats it at its
//! edge: the chat API's `tool_calls` entry here (`chat_json`), the Responses API's
//! `function_call` item in `responses::events`.

use serde_json::{json, Map, Value};

/// One tool call the model made.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    /// Counts the request's calls from 0 (the chat stream's `index`).
    pub index: usize,
    /// The model's own id when its call held a truthy one (a non-string id as its JSON
    /// text), else a fresh uuid4, as mlx-lm's `ToolCallFormatter` makes it.
    pub id: String,
    pub name: String,
    /// The arguments as a JSON document in a string (mlx-lm's `json.dumps`).
    pub arguments: String,
    /// Any other keys of the parsed call (json_tools passes the model's object on whole),
    /// kept in `function` as mlx_lm.server sends them.
    pub extra: Map<String, Value>,
}

impl ToolCall {
    /// The chat API's shape: `{"function": {"name", "arguments", …}, "type": "function",
    /// "id"}`, with the `index` in a streamed chunk (not in a whole answer).
    pub fn chat_json(&self, with_index: bool) -> Value {
        let mut function = Map::new();
        function.insert("name".into(), json!(self.name));
        function.insert("arguments".into(), json!(self.arguments));
        function.extend(self.extra.clone());
        let mut call = json!({"function": function, "type": "function", "id": self.id});
        if with_index {
            call["index"] = json!(self.index);
        }
        call
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_chat_shape_has_the_index_only_when_streamed() {
        let c = ToolCall {
            index: 2,
            id: "call_1".into(),
            name: "f".into(),
            arguments: "{\"x\": 1}".into(),
            extra: Map::new(),
        };
        assert_eq!(
            c.chat_json(true),
            json!({"function": {"name": "f", "arguments": "{\"x\": 1}"},
                "type": "function", "id": "call_1", "index": 2})
        );
        assert!(c.chat_json(false).get("index").is_none());
    }
}
