//! A Responses body into the one internal request: the messages the template gets, and the
//! fields refusals name (the HTTP gate `responses::hostile_bodies_are_refused_by_field`
//! covers the rest through the server).

use serde_json::{json, Value};

use super::translate;
use crate::serve::request::{Defaults, Prompt};
use crate::serve::responses::store::Store;

fn messages(body: Value) -> Vec<Value> {
    let t = translate(&body, &Store::default(), &Defaults::for_tests()).unwrap_or_else(|r| {
        panic!("{body}: refused: {}", r.error.message);
    });
    match t.request.prompt {
        Prompt::Chat(c) => c.messages,
        Prompt::Text(_) => panic!("a Responses request is a chat"),
    }
}

#[test]
fn items_become_chat_messages_with_arguments_parsed_for_the_template() {
    let m = messages(json!({"instructions": "be brief", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        // A reasoning item replayed as OpenAI sends it: its content is no text parts.
        {"type": "reasoning", "id": "rs_1", "summary": [],
            "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{\"x\": 1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "42"},
    ]}));
    assert_eq!(m[0], json!({"role": "system", "content": "be brief"}));
    assert_eq!(m[1], json!({"role": "user", "content": "ab"}));
    assert_eq!(
        m[2]["tool_calls"][0]["function"]["arguments"],
        json!({"x": 1})
    );
    assert_eq!(
        m[3],
        json!({"role": "tool", "tool_call_id": "c1", "content": "42"})
    );
    assert_eq!(m.len(), 4);
}

#[test]
fn refusals_name_the_responses_field() {
    for (body, param) in [
        (
            json!({"input": "x", "max_output_tokens": 0}),
            "max_output_tokens",
        ),
        (json!({"input": "x", "frobnicate": 1}), "frobnicate"),
        (json!({"input": "x", "text": {"colour": 1}}), "text.colour"),
        (
            json!({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}),
            "input[0].content[0].image_url",
        ),
        (
            json!({"input": [{"type": "function_call_output", "call_id": "c"}]}),
            "input[0].output",
        ),
        (
            json!({"input": "x", "tool_choice": {"type": "function"}}),
            "tool_choice.name",
        ),
        (
            json!({"input": "x", "tools": [{"type": "function", "name": 5}]}),
            "tools[0].name",
        ),
    ] {
        let e = match translate(&body, &Store::default(), &Defaults::for_tests()) {
            Ok(_) => panic!("{body}: accepted"),
            Err(r) => r.error,
        };
        assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
    }
}
