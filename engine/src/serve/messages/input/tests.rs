//! The Messages body's translation, without a model: what the template receives, and the
//! refusals by field.

use serde_json::{json, Value};

use super::{translate, Purpose};
use crate::serve::request::{Defaults, Prompt};
use crate::serve::tools::Markers;

fn chat(
    body: Value,
) -> (
    Vec<Value>,
    Option<Value>,
    Option<usize>,
    serde_json::Map<String, Value>,
) {
    let t = translate(
        &body,
        &Defaults::for_tests(),
        &Markers::default(),
        Purpose::Create,
    )
    .unwrap_or_else(|e| panic!("{}: {body}", e.message));
    let Prompt::Chat(c) = t.request.prompt else {
        panic!("not a chat prompt")
    };
    (c.messages, c.tools, t.request.think_budget, c.kwargs)
}

fn refused(body: Value) -> (String, String) {
    let e = translate(
        &body,
        &Defaults::for_tests(),
        &Markers::default(),
        Purpose::Create,
    )
    .err()
    .unwrap_or_else(|| panic!("accepted: {body}"));
    assert_eq!(e.status, 400);
    (e.param.unwrap_or_default(), e.message)
}

#[test]
fn blocks_become_the_templates_messages() {
    let (m, tools, budget, kwargs) = chat(json!({
    "model": "claude-x", "max_tokens": 50,
    "system": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
    "tools": [{"name": "get_weather", "description": "d",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
    "thinking": {"type": "enabled", "budget_tokens": 8},
    "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Use the tool.", "signature": "x"},
            {"type": "redacted_thinking", "data": "zz"},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1",
                "content": [{"type": "text", "text": "sunny"}]},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": "down",
                "is_error": true},
            {"type": "text", "text": "Thanks."}]},
    ]}));
    assert_eq!(
        m,
        vec![
            json!({"role": "system", "content": "Be brief.\n\nBe kind."}),
            json!({"role": "user", "content": "Weather in Paris?"}),
            json!({"role": "assistant", "content": "", "reasoning_content": "Use the tool.",
                "tool_calls": [{"id": "toolu_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}),
            json!({"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"}),
            json!({"role": "tool", "tool_call_id": "toolu_2", "content": "ERROR: down"}),
            json!({"role": "user", "content": "Thanks."}),
        ]
    );
    assert_eq!(
        tools.unwrap()[0]["function"]["parameters"]["properties"]["city"],
        json!({"type": "string"})
    );
    assert_eq!(budget, Some(8));
    assert_eq!(kwargs["enable_thinking"], json!(true));
}

#[test]
fn bad_fields_are_refused_by_name() {
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let cases = [
        (json!({"messages": msgs}), "max_tokens"),
        (
            json!({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}),
            "messages[0].role",
        ),
        (
            json!({"max_tokens": 5, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "data": "", "media_type": "image/png"}}]}]}),
            "messages[0].content[0]",
        ),
        (
            json!({"max_tokens": 5, "messages": msgs, "tool_choice": {"type": "sometimes"}}),
            "tool_choice.type",
        ),
        (
            json!({"max_tokens": 5, "messages": msgs, "bogus": 1}),
            "bogus",
        ),
        (
            json!({"max_tokens": 5, "messages": msgs,
            "thinking": {"type": "enabled", "budget_tokens": 5}}),
            "thinking.budget_tokens",
        ),
        (
            json!({"max_tokens": 5, "messages": msgs,
            "tools": [{"type": "web_search_20250305", "name": "web_search"}],
            "tool_choice": {"type": "tool", "name": "web_search"}}),
            "tool_choice",
        ),
        (json!({"max_tokens": 5, "messages": []}), "messages"),
        (json!({"max_tokens": 0, "messages": msgs}), "max_tokens"),
    ];
    for (body, field) in cases {
        let (param, message) = refused(body.clone());
        assert_eq!(param, field, "{message} for {body}");
    }
    let (_, m) = refused(
        json!({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "document", "source": {}}]}]}),
    );
    assert!(m.contains("send the content as text"), "{m}");
}

#[test]
fn count_tokens_needs_no_max_tokens_and_a_last_assistant_message_is_continued() {
    let body = json!({"messages": [{"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hel"}]});
    let t = translate(
        &body,
        &Defaults::for_tests(),
        &Markers::default(),
        Purpose::Count,
    )
    .unwrap_or_else(|e| panic!("{}", e.message));
    let Prompt::Chat(c) = t.request.prompt else {
        panic!()
    };
    assert!(c.continue_final_message);
    // A max_tokens past the context is the context (the test defaults: 2048).
    let big = json!({"max_tokens": 32000, "messages": [{"role": "user", "content": "hi"}]});
    let t = translate(
        &big,
        &Defaults::for_tests(),
        &Markers::default(),
        Purpose::Create,
    )
    .unwrap_or_else(|e| panic!("{}", e.message));
    assert_eq!(t.request.max_tokens, 2048);
}
