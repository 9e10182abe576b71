//! The typed bodies' contract: what is accepted, what is refused and which field the
//! refusal names (the HTTP gates in engine/tests/it cover the same through the server).

use serde_json::{json, Value};

use super::parse;
use crate::serve::error::ApiError;
use crate::serve::request::{Defaults, GenRequest, Prompt};

fn chat(extra: Value) -> Result<GenRequest, ApiError> {
    let mut body = json!({"messages": [{"role": "user", "content": "hi"}]});
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    parse(&body, true, &Defaults::for_tests())
}

fn refused_at(r: Result<GenRequest, ApiError>) -> String {
    let e = r.expect_err("refused");
    assert_eq!(e.status, 400, "{}", e.message);
    assert!(!e.message.is_empty());
    e.param.unwrap_or_default()
}

#[test]
fn nulls_read_as_absent() {
    let r = chat(
        json!({"max_tokens": null, "temperature": null, "stop": null,
        "tools": null, "tool_choice": null, "stream_options": null, "logprobs": null}),
    )
    .unwrap();
    assert_eq!(r.max_tokens, 512);
    assert!(r.stop.is_empty() && !r.stream && !r.logprobs);
}

#[test]
fn refusals_name_the_field() {
    for (extra, param) in [
        (json!({"max_tokens": "ten"}), "max_tokens"),
        (json!({"max_tokens": 0}), "max_tokens"),
        (json!({"top_p": 1.5}), "top_p"),
        (json!({"stream": "yes"}), "stream"),
        (json!({"stop": 3}), "stop"),
        (json!({"stop": ["a", 3]}), "stop[1]"),
        (json!({"logit_bias": {"abc": 1}}), "logit_bias"),
        (json!({"model": 7}), "model"),
        (json!({"messages": []}), "messages"),
        // A derived struct would take an array of its fields by position (`Obj` refuses it).
        (
            json!({"messages": [["user", "hi", null, null, null, null, null]]}),
            "messages[0]",
        ),
        (json!({"messages": [{"content": "hi"}]}), "messages[0].role"),
        (json!({"messages": [{"role": "bot"}]}), "messages[0].role"),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
            "messages[0].content[0].image_url",
        ),
        (
            json!({"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{x"}}]}]}),
            "messages[0].tool_calls[0].function.arguments",
        ),
        (json!({"tools": [{"type": "web"}]}), "tools[0].type"),
        (
            json!({"tools": [{"function": {}}]}),
            "tools[0].function.name",
        ),
        (json!({"tool_choice": "always"}), "tool_choice"),
        (
            json!({"chat_template_kwargs": {"tools": []}}),
            "chat_template_kwargs",
        ),
        (
            json!({"stream_options": {"include_usage": 1}}),
            "stream_options.include_usage",
        ),
    ] {
        assert_eq!(refused_at(chat(extra.clone())), param, "{extra}");
    }
}

#[test]
fn type_errors_say_what_the_field_must_be() {
    let e = chat(json!({"prompt_lookup_num_tokens": "4"})).unwrap_err();
    assert!(e.message.contains("must be an integer"), "{}", e.message);
    let e = chat(json!({"stream": "yes"})).unwrap_err();
    assert!(
        e.message.contains("stream must be a boolean"),
        "{}",
        e.message
    );
    let e = chat(json!({"seed": u64::MAX})).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("seed"));
    assert!(e.message.contains("within ±2^63"), "{}", e.message);
}

#[test]
fn messages_keep_their_keys_with_content_as_text_and_arguments_parsed() {
    let r = chat(json!({"messages": [
        {"role": "user", "x": 1, "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{\"k\": 2}"}}]},
    ]}))
    .unwrap();
    let Prompt::Chat(c) = r.prompt else { panic!() };
    assert_eq!(
        c.messages[0],
        json!({"role": "user", "x": 1, "content": "ab"})
    );
    let keys: Vec<_> = c.messages[0].as_object().unwrap().keys().cloned().collect();
    assert_eq!(
        keys,
        ["role", "x", "content"],
        "the client's key order is kept"
    );
    assert_eq!(c.messages[1]["content"], "");
    assert_eq!(
        c.messages[1]["tool_calls"][0]["function"]["arguments"],
        json!({"k": 2})
    );
}

#[test]
fn completions_read_a_prompt_and_a_logprobs_count() {
    let d = Defaults::for_tests();
    let r = parse(&json!({"prompt": "p", "logprobs": 3}), false, &d).unwrap();
    assert!(r.logprobs && r.top_logprobs == 3);
    assert!(matches!(r.prompt, Prompt::Text(ref t) if t == "p"));
    assert_eq!(
        refused_at(parse(&json!({"prompt": 12}), false, &d)),
        "prompt"
    );
    assert_eq!(refused_at(parse(&json!({}), false, &d)), "prompt");
    assert_eq!(
        refused_at(parse(&json!({"prompt": "p", "logprobs": 11}), false, &d)),
        "logprobs"
    );
    assert!(parse(&json!([1]), false, &d).unwrap_err().param.is_none());
}

#[test]
fn an_unknown_field_of_a_strict_body_is_named() {
    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Strict {
        a: Option<i64>,
        inner: Option<Box<super::Obj<Strict>>>,
    }
    let e = super::read::<Strict>(&json!({"a": 1, "frob": 2})).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("frob"), "{}", e.message);
    assert_eq!(e.message, "unknown parameter `frob`");
    let e = super::read::<Strict>(&json!({"inner": {"zap": 1}})).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("inner.zap"), "{}", e.message);
}
