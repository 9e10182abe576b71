//! Tool calling and reasoning through `engine serve`, end to end over HTTP, against what
//! mlx_lm.server 0.32.2 answers on the same model (goldens/models/tiny-qwen3-tools, which
//! reasons in <think> and calls get_weather in <tool_call> JSON): every request's
//! `choices[0]`, whole and streamed chunk by chunk, on the serial lane and on the batch
//! lane; `--chat-template-args` and `chat_template_kwargs`; the 400s for malformed tool
//! requests. Each planted serve defect (engine::plant, switched on in the server process
//! through ENGINE_PLANT) makes the comparison fail.

use crate::common;

use std::process::Command;

use common::server::{engine_bin, http, post, serve_dir_with_env, serve_model};
use serde_json::{json, Value};

const MODEL: &str = "tiny-qwen3-tools";

/// (name, request body, mlx_lm.server's choices[0], its streamed chunks' choices[0]) — recorded
/// from mlx_lm.server 0.32.2 serving goldens/models/tiny-qwen3-tools (tool-call ids as "ID").
pub const CASES: &[(&str, &str, &str, &str)] = &[
    (
        "tool_call_thinking_off",
        r#"{"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "tools": [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now.", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}], "chat_template_kwargs": {"enable_thinking": false}}"#,
        r#"{"index": 0, "finish_reason": "tool_calls", "message": {"role": "assistant", "content": null, "tool_calls": [{"function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}, "type": "function", "id": "ID"}]}}"#,
        r#"[{"index": 0, "finish_reason": null, "delta": {"role": "assistant", "tool_calls": [{"function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}, "type": "function", "id": "ID", "index": 0}]}}, {"index": 0, "finish_reason": "tool_calls", "delta": {"role": "assistant"}}]"#,
    ),
    (
        "tool_call_with_reasoning",
        r#"{"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "tools": [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now.", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]}"#,
        r#"{"index": 0, "finish_reason": "tool_calls", "message": {"role": "assistant", "content": "\n\n", "reasoning": "\nThe user wants the weather in Paris, so I call get_weather.\n", "tool_calls": [{"function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}, "type": "function", "id": "ID"}]}}"#,
        r#"[{"index": 0, "finish_reason": null, "delta": {"role": "assistant", "reasoning": "\n"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "reasoning": "The"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "reasoning": " user"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "reasoning": " wants"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "reasoning": " the"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "reasoning": " weather"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "reasoning": " in"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "reasoning": " Paris"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "reasoning": ","}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "reasoning": " so"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "reasoning": " I"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "reasoning": " call"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "reasoning": " get"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "reasoning": "_"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "reasoning": "weather"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "reasoning": "."}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "reasoning": "\n"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "content": "\n"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "content": "\n"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "tool_calls": [{"function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}, "type": "function", "id": "ID", "index": 0}]}}, {"index": 0, "finish_reason": "tool_calls", "delta": {"role": "assistant"}}]"#,
    ),
    (
        "answer_after_tool_result",
        r#"{"messages": [{"role": "user", "content": "What is the weather in Oslo?"}, {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]}, {"role": "tool", "tool_call_id": "call_1", "content": "{\"city\": \"Oslo\", \"sky\": \"snowy\", \"celsius\": -3}"}], "tools": [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now.", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]}"#,
        r#"{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "\n\nIt is snowy in Oslo, -3 degrees.", "reasoning": "\nThe tool says Oslo is snowy.\n"}}"#,
        r#"[{"index": 0, "finish_reason": null, "delta": {"role": "assistant", "reasoning": "\n"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "reasoning": "The"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "reasoning": " tool"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "reasoning": " says"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "reasoning": " Oslo"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "reasoning": " is"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "reasoning": " snowy"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "reasoning": "."}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "reasoning": "\n"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "content": "\n"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "content": "\n"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "content": "It"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "content": " is"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "content": " snowy"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "content": " in"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "content": " Oslo"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "content": ","}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "content": " -"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "content": "3"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "content": " degrees"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "content": "."}}, {"index": 0, "finish_reason": "stop", "delta": {"role": "assistant"}}]"#,
    ),
    (
        "reasoning_then_answer",
        r#"{"messages": [{"role": "user", "content": "Who are you?"}]}"#,
        r#"{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "\n\nI am a tiny robot that knows the weather.", "reasoning": "\nI should say what I am.\n"}}"#,
        r#"[{"index": 0, "finish_reason": null, "delta": {"role": "assistant", "reasoning": "\n"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "reasoning": "I"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "reasoning": " should"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "reasoning": " say"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "reasoning": " what"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "reasoning": " I"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "reasoning": " am"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "reasoning": "."}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "reasoning": "\n"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "content": "\n"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "content": "\n"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "content": "I"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "content": " am"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "content": " a"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "content": " tiny"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "content": " robot"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "content": " that"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "content": " knows"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "content": " the"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "content": " weather"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "content": "."}}, {"index": 0, "finish_reason": "stop", "delta": {"role": "assistant"}}]"#,
    ),
    (
        "length_inside_reasoning",
        r#"{"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "tools": [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now.", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}], "max_tokens": 12}"#,
        r#"{"index": 0, "finish_reason": "length", "message": {"role": "assistant", "content": null, "reasoning": "\nThe user wants the weather in Paris, so I"}}"#,
        r#"[{"index": 0, "finish_reason": null, "delta": {"role": "assistant", "reasoning": "\n"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "reasoning": "The"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "reasoning": " user"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "reasoning": " wants"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "reasoning": " the"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "reasoning": " weather"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "reasoning": " in"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "reasoning": " Paris"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "reasoning": ","}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "reasoning": " so"}}, {"index": 0, "finish_reason": null, "delta": {"role": "assistant", "reasoning": " I"}}, {"index": 0, "finish_reason": "length", "delta": {"role": "assistant"}}]"#,
    ),
    (
        "parts_and_non_ascii_arguments",
        r#"{"messages": [{"role": "user", "content": [{"type": "text", "text": "What is the weather in "}, {"type": "text", "text": "São Paulo?"}]}], "tools": [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now.", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}], "chat_template_kwargs": {"enable_thinking": false}}"#,
        r#"{"index": 0, "finish_reason": "tool_calls", "message": {"role": "assistant", "content": null, "tool_calls": [{"function": {"name": "get_weather", "arguments": "{\"city\": \"São Paulo\"}"}, "type": "function", "id": "ID"}]}}"#,
        r#"[{"index": 0, "finish_reason": null, "delta": {"role": "assistant", "tool_calls": [{"function": {"name": "get_weather", "arguments": "{\"city\": \"São Paulo\"}"}, "type": "function", "id": "ID", "index": 0}]}}, {"index": 0, "finish_reason": "tool_calls", "delta": {"role": "assistant"}}]"#,
    ),
];

/// `choices[0]` with each tool call's id checked (a UUID, or the model's) and set to "ID".
fn normalized(mut choice: Value) -> Result<Value, String> {
    let msg = if choice.get("message").is_some() {
        "message"
    } else {
        "delta"
    };
    if let Some(calls) = choice[msg]
        .get_mut("tool_calls")
        .and_then(Value::as_array_mut)
    {
        for c in calls {
            let id = c["id"].as_str().unwrap_or_default();
            if id.len() != 36 || id.matches('-').count() != 4 {
                return Err(format!("tool call id {id:?} is not a UUID"));
            }
            c["id"] = json!("ID");
        }
    }
    Ok(choice)
}

/// One request, whole: its normalized choices[0].
fn ask_whole(port: u16, body: &Value) -> Result<Value, String> {
    let (status, v) = post(port, "/v1/chat/completions", body);
    if status != 200 {
        return Err(format!("status {status}: {v}"));
    }
    normalized(v["choices"][0].clone())
}

/// One request, streamed: each chunk's normalized choices[0] (the usage-only chunk has none).
fn ask_streamed(port: u16, body: &Value) -> Result<Vec<Value>, String> {
    let mut body = body.clone();
    body["stream"] = json!(true);
    let (status, text) = http(
        port,
        "POST",
        "/v1/chat/completions",
        body.to_string().as_bytes(),
    );
    if status != 200 {
        return Err(format!("status {status}: {text}"));
    }
    let mut out = Vec::new();
    for line in text.lines() {
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            continue;
        }
        let chunk: Value = serde_json::from_str(data).map_err(|e| format!("{e}: {data}"))?;
        if let Some(choice) = chunk["choices"].get(0) {
            out.push(normalized(choice.clone())?);
        }
    }
    Ok(out)
}

/// Case `i` against mlx_lm.server's answers, whole and streamed.
fn check_case(port: u16, i: usize) -> Result<(), String> {
    let (name, body, whole, streamed) = CASES[i];
    let body: Value = serde_json::from_str(body).unwrap();
    let want: Value = serde_json::from_str(whole).unwrap();
    let got = ask_whole(port, &body)?;
    if got != want {
        return Err(format!(
            "{name}: the answer differs from mlx_lm.server's\n ours: {got}\n mlx:  {want}"
        ));
    }
    let want: Vec<Value> = serde_json::from_str(streamed).unwrap();
    let got = ask_streamed(port, &body)?;
    if got != want {
        return Err(format!(
            "{name}: the stream differs from mlx_lm.server's\n ours: {}\n mlx:  {}",
            Value::from(got),
            Value::from(want)
        ));
    }
    Ok(())
}

/// Every case, one after another.
fn check_all(port: u16) -> Result<(), String> {
    (0..CASES.len()).try_for_each(|i| check_case(port, i))
}

#[test]
fn tool_calls_and_reasoning_match_mlx_lm_server() {
    let s = serve_model(MODEL, &[]);
    check_all(s.port).unwrap();
}

#[test]
fn the_batch_lane_splits_and_parses_the_same() {
    let s = serve_model(MODEL, &["--batch", "4"]);
    let port = s.port;
    // All cases at once, so that they share batch steps.
    let threads: Vec<_> = (0..CASES.len())
        .map(|i| std::thread::spawn(move || check_case(port, i)))
        .collect();
    for t in threads {
        t.join().unwrap().unwrap();
    }
    let st = common::server::stats(port);
    assert!(
        st["lanes"]["batch_slots"].as_u64() == Some(4),
        "batch lane not in use: {st}"
    );
}

#[test]
fn chat_template_args_set_the_default_and_requests_override_it() {
    let s = serve_model(
        MODEL,
        &["--chat-template-args", r#"{"enable_thinking": false}"#],
    );
    let case = |name: &str| CASES.iter().find(|c| c.0 == name).unwrap();
    // The thinking request without kwargs now renders with thinking off…
    let (_, body, _, _) = case("tool_call_with_reasoning");
    let (_, _, off, _) = case("tool_call_thinking_off");
    let body: Value = serde_json::from_str(body).unwrap();
    assert_eq!(
        ask_whole(s.port, &body).unwrap(),
        serde_json::from_str::<Value>(off).unwrap()
    );
    // …and a request's chat_template_kwargs win.
    let mut on = body.clone();
    on["chat_template_kwargs"] = json!({"enable_thinking": true});
    let (_, _, with_reasoning, _) = case("tool_call_with_reasoning");
    assert_eq!(
        ask_whole(s.port, &on).unwrap(),
        serde_json::from_str::<Value>(with_reasoning).unwrap()
    );
    drop(s);
    let dir = common::goldens().join("models").join(MODEL);
    let out = Command::new(engine_bin())
        .args(["serve", "--model", dir.to_str().unwrap(), "--port", "0"])
        .args(["--chat-template-args", "[1]"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("--chat-template-args must be a JSON object"),
        "{err}"
    );
}

#[test]
fn planted_serve_defects_fail_the_comparison() {
    for defect in [
        "ToolCallTextInContent",
        "ToolCallFinishStaysStop",
        "ReasoningInContent",
    ] {
        let s = serve_dir_with_env(
            &common::goldens().join("models").join(MODEL),
            &[],
            &[("ENGINE_PLANT", defect)],
        );
        match check_all(s.port) {
            Ok(()) => panic!("planted {defect} was not caught"),
            Err(e) => eprintln!(
                "planted {defect} caught: {}",
                e.lines().next().unwrap_or("")
            ),
        }
    }
}

#[test]
fn malformed_tool_requests_are_400s_naming_the_field() {
    let s = serve_model(MODEL, &[]);
    let user = json!([{"role": "user", "content": "hi"}]);
    let cases = [
        (json!({"messages": user, "tools": {"a": 1}}), "tools"),
        (json!({"messages": user, "tools": [1]}), "tools[0]"),
        (
            json!({"messages": user, "tools": [{"type": "function"}]}),
            "tools[0].function",
        ),
        (
            json!({"messages": user, "tools": [{"type": "function", "function": {"description": "x"}}]}),
            "tools[0].function.name",
        ),
        (
            json!({"messages": user, "tools": [{"type": "retrieval", "function": {"name": "f"}}]}),
            "tools[0].type",
        ),
        (json!({"messages": user, "tool_choice": 3}), "tool_choice"),
        (
            json!({"messages": user, "chat_template_kwargs": "x"}),
            "chat_template_kwargs",
        ),
        (
            json!({"messages": user, "chat_template_kwargs": {"tools": []}}),
            "chat_template_kwargs",
        ),
        (
            json!({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]}),
            "messages[0].tool_calls[0].function.arguments",
        ),
        (
            json!({"messages": [{"role": "assistant", "tool_calls": "x"}]}),
            "messages[0].tool_calls",
        ),
        (
            json!({"messages": [{"role": "tool", "content": "r", "tool_call_id": 5}]}),
            "messages[0].tool_call_id",
        ),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}),
            "messages[0].content[0]",
        ),
    ];
    for (body, field) in cases {
        let (status, v) = post(s.port, "/v1/chat/completions", &body);
        assert_eq!(status, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], json!(field), "{body}: {v}");
    }
    // tool_choice is read and ignored (as mlx_lm.server ignores it); empty tools are none.
    let mut ok = serde_json::from_str::<Value>(CASES[0].1).unwrap();
    ok["tool_choice"] = json!("required");
    assert_eq!(
        ask_whole(s.port, &ok).unwrap(),
        serde_json::from_str::<Value>(CASES[0].2).unwrap()
    );
    let (status, _) = post(
        s.port,
        "/v1/chat/completions",
        &json!({"messages": user, "tools": [], "max_tokens": 2}),
    );
    assert_eq!(status, 200);
}

#[test]
fn tools_for_a_format_we_cannot_parse_are_refused() {
    // A template naming <atem:function_calls> makes mlx-lm pick its muse_spark parser,
    // which we do not have.
    let template = "{% for m in messages %}{{ m.content }}{% endfor %}<atem:function_calls>";
    let s = serve_model(MODEL, &["--chat-template", template]);
    let tools = json!([{"type": "function", "function": {"name": "f"}}]);
    let user = json!([{"role": "user", "content": "hi"}]);
    let (status, v) = post(
        s.port,
        "/v1/chat/completions",
        &json!({"messages": user, "tools": tools}),
    );
    assert_eq!(status, 400, "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("muse_spark") && msg.contains("not supported"),
        "{msg}"
    );
    let (status, _) = post(
        s.port,
        "/v1/chat/completions",
        &json!({"messages": user, "max_tokens": 2}),
    );
    assert_eq!(status, 200);
    drop(s);
    // <arg_key> picks glm47 (GLM-4.5 … 4.7), which we parse: the same tools are taken.
    let template = "{% for m in messages %}{{ m.content }}{% endfor %}<arg_key>";
    let s = serve_model(MODEL, &["--chat-template", template]);
    let (status, v) = post(
        s.port,
        "/v1/chat/completions",
        &json!({"messages": user, "tools": tools, "max_tokens": 2}),
    );
    assert_eq!(status, 200, "{v}");
}
