//! `POST /v1/messages` (Anthropic's Messages API) end to end over HTTP, one server per
//! model and lane (tiny-llama-trained on the serial lane behind `--api-key`,
//! tiny-qwen3-tools on the batch lane, then on the serial lane), each gate shown to fail
//! with a planted defect (switched on in a server process through ENGINE_PLANT):
//!
//! 1. shapes: every message, every stream event, the count_tokens answer and every error
//!    validate against the JSON Schemas of the official `anthropic` client's models
//!    (goldens/serve/anthropic-*, from oracles/gen_anthropic_schema.py); a greedy stream's
//!    blocks reassemble to the whole message's content (`MessagesStopReasonMisnamed`);
//! 2. stream order: message_start, ping, then blocks each opened, filled and stopped in
//!    index order, message_delta, message_stop (`MessagesEventsOutOfOrder`);
//! 3. tools: tool_use (input an object) → tool_result → the chat route's answer to the
//!    same conversation; tool_choice tool / any / none (`MessagesToolInputString`);
//! 4. thinking budget: the thinking block holds the budget's tokens, no more: it is the
//!    unbudgeted answer's thinking cut after `budget` tokens (`MessagesBudgetIgnored`);
//! 5. usage: count_tokens equals usage.input_tokens, a repeated prompt reads the prompt
//!    cache; stop_sequences and max_tokens stop as Anthropic says; bad fields are refused
//!    in Anthropic's error shape (a wrong x-api-key: 401 authentication_error).

use crate::common;

use common::server::{http_with, serve_dir_with_env, Server};
use serde_json::{json, Value};

const LLAMA: &str = "tiny-llama-trained";
const TOOLS_MODEL: &str = "tiny-qwen3-tools";
const KEY: &str = "k3y";

fn schema(name: &str) -> jsonschema::Validator {
    common::client_schema(name, "anthropic")
}

struct Schemas {
    message: jsonschema::Validator,
    event: jsonschema::Validator,
    count: jsonschema::Validator,
    error: jsonschema::Validator,
}

impl Schemas {
    fn load() -> Self {
        Schemas {
            message: schema("anthropic-message.schema.json"),
            event: schema("anthropic-stream-event.schema.json"),
            count: schema("anthropic-count-tokens.schema.json"),
            error: schema("anthropic-error.schema.json"),
        }
    }
}

fn valid(v: &jsonschema::Validator, doc: &Value, what: &str) -> Result<(), String> {
    common::client_valid(v, doc, what, "anthropic")
}

fn server(model: &str, extra: &[&str], plant: Option<&str>) -> Server {
    let env: Vec<(&str, &str)> = plant.map(|p| ("ENGINE_PLANT", p)).into_iter().collect();
    serve_dir_with_env(&common::goldens().join("models").join(model), extra, &env)
}

/// A server and the key its requests carry (None: no --api-key).
struct Api {
    port: u16,
    key: Option<&'static str>,
}

impl Api {
    fn raw(&self, path: &str, body: &Value) -> (u16, String) {
        let key = self.key.map(|k| format!("x-api-key: {k}"));
        let mut headers = vec![
            "Host: localhost",
            "Content-Type: application/json",
            "anthropic-version: 2023-06-01",
        ];
        headers.extend(key.as_deref());
        let (code, _, text) = http_with(
            self.port,
            "POST",
            path,
            &headers,
            body.to_string().as_bytes(),
        );
        (code, text)
    }

    /// A whole message (status 200 required).
    fn create(&self, body: &Value) -> Result<Value, String> {
        let (code, text) = self.raw("/v1/messages", body);
        if code != 200 {
            return Err(format!("status {code}: {text} for {body}"));
        }
        serde_json::from_str(&text).map_err(|e| format!("{e}: {text}"))
    }

    /// A streamed message's events, each `event:` line naming its data's type.
    fn stream(&self, body: &Value) -> Result<Vec<Value>, String> {
        let mut body = body.clone();
        body["stream"] = json!(true);
        let (code, text) = self.raw("/v1/messages", &body);
        if code != 200 {
            return Err(format!("status {code}: {text}"));
        }
        let (mut events, mut name) = (Vec::new(), None::<String>);
        for line in text.lines() {
            if let Some(n) = line.strip_prefix("event: ") {
                name = Some(n.to_owned());
            } else if let Some(data) = line.strip_prefix("data: ") {
                let v: Value = serde_json::from_str(data).map_err(|e| format!("{e}: {data}"))?;
                if name.take().as_deref() != v["type"].as_str() {
                    return Err(format!("the event line does not name the data's type: {v}"));
                }
                events.push(v);
            }
        }
        Ok(events)
    }

    fn count(&self, body: &Value) -> Result<Value, String> {
        let (code, text) = self.raw("/v1/messages/count_tokens", body);
        if code != 200 {
            return Err(format!("count_tokens: status {code}: {text}"));
        }
        serde_json::from_str(&text).map_err(|e| format!("{e}: {text}"))
    }
}

fn user(text: &str) -> Value {
    json!([{"role": "user", "content": text}])
}

fn weather_tool() -> Value {
    json!({"name": "get_weather", "description": "The weather in a city now.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
            "required": ["city"]}})
}

/// Gate 2: the stream's order, as Anthropic sends it; returns the message the events tell
/// (its content rebuilt from the deltas).
fn replay(events: &[Value]) -> Result<Value, String> {
    let kinds: Vec<&str> = events
        .iter()
        .map(|e| e["type"].as_str().unwrap_or("?"))
        .collect();
    let n = kinds.len();
    if n < 4 || kinds[0] != "message_start" || kinds[1] != "ping" {
        return Err(format!(
            "the stream does not open with message_start, ping: {kinds:?}"
        ));
    }
    if kinds[n - 2] != "message_delta" || kinds[n - 1] != "message_stop" {
        return Err(format!(
            "the stream does not end with message_delta, message_stop: {kinds:?}"
        ));
    }
    let mut message = events[0]["message"].clone();
    let mut content: Vec<Value> = Vec::new();
    let mut open = false;
    let mut partial = String::new();
    for e in &events[2..n - 2] {
        let index = e["index"].as_u64().map(|i| i as usize);
        match e["type"].as_str() {
            Some("content_block_start") if !open && index == Some(content.len()) => {
                content.push(e["content_block"].clone());
                open = true;
            }
            Some("content_block_delta") if open && index == Some(content.len() - 1) => {
                let b = content.last_mut().unwrap();
                let d = &e["delta"];
                match d["type"].as_str() {
                    Some("text_delta") => {
                        b["text"] = json!(format!(
                            "{}{}",
                            b["text"].as_str().unwrap_or(""),
                            d["text"].as_str().unwrap_or("")
                        ))
                    }
                    Some("thinking_delta") => {
                        b["thinking"] = json!(format!(
                            "{}{}",
                            b["thinking"].as_str().unwrap_or(""),
                            d["thinking"].as_str().unwrap_or("")
                        ))
                    }
                    Some("signature_delta") => b["signature"] = d["signature"].clone(),
                    Some("input_json_delta") => {
                        partial.push_str(d["partial_json"].as_str().unwrap_or(""))
                    }
                    _ => return Err(format!("unknown delta {e}")),
                }
            }
            Some("content_block_stop") if open && index == Some(content.len() - 1) => {
                let b = content.last_mut().unwrap();
                if b["type"] == "tool_use" {
                    b["input"] = serde_json::from_str(&std::mem::take(&mut partial))
                        .map_err(|err| format!("input_json_delta is no JSON: {err}"))?;
                }
                open = false;
            }
            _ => return Err(format!("event out of order: {e} in {kinds:?}")),
        }
    }
    if open {
        return Err(format!("a block was left open: {kinds:?}"));
    }
    let delta = &events[n - 2];
    message["content"] = Value::Array(content);
    message["stop_reason"] = delta["delta"]["stop_reason"].clone();
    message["stop_sequence"] = delta["delta"]["stop_sequence"].clone();
    message["usage"]["output_tokens"] = delta["usage"]["output_tokens"].clone();
    message["usage"]["cache_read_input_tokens"] = delta["usage"]["cache_read_input_tokens"].clone();
    Ok(message)
}

/// A message with its tool ids (fresh per answer) blanked.
fn digest(m: &Value) -> Value {
    let mut m = m.clone();
    for b in m["content"].as_array_mut().into_iter().flatten() {
        if b["type"] == "tool_use" {
            b["id"] = json!("toolu_");
        }
    }
    json!({"content": m["content"], "stop_reason": m["stop_reason"],
        "stop_sequence": m["stop_sequence"], "output_tokens": m["usage"]["output_tokens"]})
}

/// Gate 1 (and 2): each body whole and streamed, every document against the schemas, the
/// stream's message the whole one's. Returns how many documents were validated.
fn shape_gate(api: &Api, bodies: &[Value], s: &Schemas) -> Result<usize, String> {
    let mut n = 0;
    for body in bodies {
        let whole = api.create(body)?;
        valid(&s.message, &whole, "a message")?;
        let events = api.stream(body)?;
        for e in &events {
            // A ping is the one event the client's types leave out: its stream skips them.
            if e != &json!({"type": "ping"}) {
                valid(&s.event, e, "a stream event")?;
            }
        }
        n += 1 + events.len();
        let told = replay(&events)?;
        if digest(&told) != digest(&whole) {
            return Err(format!(
                "the stream tells another message:\n{told}\nwhole: {whole}"
            ));
        }
        if !whole["id"].as_str().is_some_and(|i| i.starts_with("msg_")) {
            return Err(format!("id: {whole}"));
        }
    }
    Ok(n)
}

fn llama_bodies() -> Vec<Value> {
    vec![
        json!({"model": "claude-sonnet-4-5", "max_tokens": 20, "messages": user("What color is the sky?")}),
        json!({"model": "m", "max_tokens": 3, "system": [{"type": "text", "text": "Be brief."}],
            "metadata": {"user_id": "u1"}, "messages": user("What color is the sky?")}),
        json!({"model": "m", "max_tokens": 20, "stop_sequences": ["blue"],
            "messages": user("What color is the sky?")}),
    ]
}

/// Gate 5's error cases: each refused with its status, in Anthropic's shape.
fn refusals(api: &Api, s: &Schemas) -> Result<usize, String> {
    let sky = user("What color is the sky?");
    let cases = [
        (json!({"model": "m", "messages": sky}), 400, "max_tokens"),
        (
            json!({"max_tokens": 5, "messages": [{"role": "robot", "content": "x"}]}),
            400,
            "role",
        ),
        (
            json!({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image",
            "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]}),
            400,
            "image",
        ),
        (
            json!({"max_tokens": 5, "messages": sky, "tool_choice": {"type": "always"}}),
            400,
            "tool_choice",
        ),
        (
            json!({"max_tokens": 5, "messages": sky, "tools": [weather_tool()],
            "tool_choice": {"type": "tool", "name": "nope"}}),
            400,
            "nope",
        ),
        (
            json!({"max_tokens": 5, "messages": sky, "frobnicate": true}),
            400,
            "frobnicate",
        ),
        (
            json!({"max_tokens": 5, "messages": sky,
            "thinking": {"type": "enabled", "budget_tokens": 9}}),
            400,
            "budget_tokens",
        ),
    ];
    for (body, status, names) in &cases {
        let (code, text) = api.raw("/v1/messages", body);
        let v: Value = serde_json::from_str(&text).map_err(|e| format!("{e}: {text}"))?;
        valid(&s.error, &v, "an error")?;
        if code != *status
            || v["error"]["type"] != "invalid_request_error"
            || !v["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains(names))
        {
            return Err(format!("{body}: {code} {v}"));
        }
    }
    let wrong = Api {
        port: api.port,
        key: Some("wrong"),
    };
    for path in ["/v1/messages", "/v1/messages/count_tokens"] {
        let (code, text) = wrong.raw(path, &llama_bodies()[0]);
        let v: Value = serde_json::from_str(&text).map_err(|e| format!("{e}: {text}"))?;
        valid(&s.error, &v, "an error")?;
        if code != 401 || v["error"]["type"] != "authentication_error" {
            return Err(format!("a wrong x-api-key on {path}: {code} {v}"));
        }
    }
    let (code, text) = api.raw("/v1/messages/batches", &json!({}));
    let v: Value = serde_json::from_str(&text).map_err(|e| format!("{e}: {text}"))?;
    if code != 404 || v["error"]["type"] != "not_found_error" {
        return Err(format!("an unknown path: {code} {v}"));
    }
    Ok(cases.len() + 3)
}

/// Structured outputs: an `output_config.format` answer is JSON valid under its schema
/// (the untrained answer, "The sky is blue.", is not); a format of another type is a 400
/// naming `output_config.format.type`.
fn format_gate(api: &Api) -> Result<(), String> {
    let schema = json!({"type": "object", "properties": {"sky": {"enum": ["blue", "grey"]}},
        "required": ["sky"], "additionalProperties": false});
    let body = json!({"model": "m", "max_tokens": 64, "messages": user("What color is the sky?"),
        "output_config": {"format": {"type": "json_schema", "schema": schema}}});
    let m = api.create(&body)?;
    let text = m["content"][0]["text"].as_str().unwrap_or_default();
    let doc: Value = serde_json::from_str(text).map_err(|e| format!("not JSON ({e}): {m}"))?;
    if !jsonschema::is_valid(&schema, &doc) {
        return Err(format!("the answer does not match its schema: {text}"));
    }
    let mut bad = body.clone();
    bad["output_config"]["format"]["type"] = json!("regex");
    let (code, text) = api.raw("/v1/messages", &bad);
    if code != 400 || !text.contains("output_config.format.type") {
        return Err(format!("a regex format: status {code}: {text}"));
    }
    Ok(())
}

#[test]
fn messages_and_stream_events_match_the_anthropic_client_schemas() {
    let s = Schemas::load();
    let llama = server(LLAMA, &["--api-key", KEY], None);
    let api = Api {
        port: llama.port,
        key: Some(KEY),
    };
    let n = shape_gate(&api, &llama_bodies(), &s).unwrap();
    let m = api.create(&llama_bodies()[0]).unwrap();
    assert_eq!(
        m["content"],
        json!([{"type": "text", "text": "The sky is blue."}]),
        "{m}"
    );
    assert_eq!(
        (m["stop_reason"].as_str(), m["model"].as_str()),
        (Some("end_turn"), Some("claude-sonnet-4-5"))
    );
    let cut = api.create(&llama_bodies()[1]).unwrap();
    assert_eq!(cut["stop_reason"], "max_tokens", "{cut}");
    assert_eq!(cut["usage"]["output_tokens"], 3, "{cut}");
    let stop = api.create(&llama_bodies()[2]).unwrap();
    assert_eq!(
        (
            &stop["stop_reason"],
            &stop["stop_sequence"],
            &stop["content"][0]["text"]
        ),
        (
            &json!("stop_sequence"),
            &json!("blue"),
            &json!("The sky is ")
        ),
        "{stop}"
    );
    // count_tokens is the prompt a request renders; a repeated prompt reads the cache.
    let counted = api
        .count(&json!({"model": "m", "messages": user("What color is the sky?")}))
        .unwrap();
    valid(&s.count, &counted, "count_tokens").unwrap();
    assert_eq!(
        counted["input_tokens"], m["usage"]["input_tokens"],
        "{counted} vs {m}"
    );
    assert!(
        m["usage"]["cache_read_input_tokens"].as_u64().unwrap() > 0,
        "{m}"
    );
    // Claude Code's way in: Authorization: Bearer works as well as x-api-key.
    let (code, _, _) = http_with(
        llama.port,
        "POST",
        "/v1/messages",
        &[
            "Host: localhost",
            "Content-Type: application/json",
            "Authorization: Bearer k3y",
        ],
        llama_bodies()[0].to_string().as_bytes(),
    );
    assert_eq!(code, 200);
    let e = refusals(&api, &s).unwrap();
    println!("shape gate: {n} documents, {e} refusals valid against anthropic's schemas");
    format_gate(&api).unwrap();
    drop(llama);
    let planted = server(
        LLAMA,
        &[],
        Some("MessagesStopReasonMisnamed,MessagesEventsOutOfOrder,MessagesOutputFormatIgnored"),
    );
    let api = Api {
        port: planted.port,
        key: None,
    };
    let caught = shape_gate(&api, &llama_bodies()[..1], &s);
    println!("planted MessagesStopReasonMisnamed: {caught:?}");
    assert!(
        caught.as_ref().is_err_and(|e| e.contains("stop_reason")),
        "the shape gate missed the misnamed stop_reason"
    );
    let events = api.stream(&llama_bodies()[0]).unwrap();
    let caught = replay(&events);
    println!("planted MessagesEventsOutOfOrder: {caught:?}");
    assert!(
        caught.is_err(),
        "the order check missed message_delta before content_block_stop"
    );
    let caught = format_gate(&api);
    println!("planted MessagesOutputFormatIgnored: {caught:?}");
    assert!(
        caught.is_err(),
        "the format gate missed an output_config.format that never reached the sampler"
    );
}

/// Gate 3: a tool_use block, its tool_result sent back, answered as the chat route answers
/// the same conversation; tool_choice tool / any / none.
fn tool_gate(api: &Api, s: &Schemas) -> Result<Value, String> {
    let tools = json!([weather_tool()]);
    let ask = "What is the weather in Paris?";
    let r1 = api
        .create(&json!({"model": "m", "max_tokens": 80, "messages": user(ask), "tools": tools}))?;
    valid(&s.message, &r1, "a message")?;
    let call = r1["content"]
        .as_array()
        .and_then(|c| c.iter().find(|b| b["type"] == "tool_use"))
        .ok_or_else(|| format!("no tool_use block: {r1}"))?
        .clone();
    if call["name"] != "get_weather"
        || call["input"] != json!({"city": "Paris"})
        || r1["stop_reason"] != "tool_use"
    {
        return Err(format!("unexpected call {r1}"));
    }
    if !call["id"].as_str().is_some_and(|i| i.starts_with("toolu_")) {
        return Err(format!("tool_use id {call}"));
    }
    let result = "{\"city\": \"Paris\", \"sky\": \"sunny\", \"celsius\": 21}";
    // Sent back as Claude Code sends it (thinking included), and without the thinking (as
    // the chat route, which reads no reasoning_content, is given it).
    let exchange = |assistant: Value| {
        json!({"model": "m", "max_tokens": 80, "tools": tools,
        "messages": [{"role": "user", "content": ask}, {"role": "assistant", "content": assistant},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call["id"],
                "content": [{"type": "text", "text": result}]}]}]})
    };
    let with_thinking = api.count(&exchange(r1["content"].clone()))?;
    let bare = exchange(json!([call.clone()]));
    let without = api.count(&bare)?;
    if with_thinking["input_tokens"].as_u64() <= without["input_tokens"].as_u64() {
        return Err(format!(
            "the thinking block sent back did not reach the template: {with_thinking} vs {without}"
        ));
    }
    let r2 = api.create(&bare)?;
    valid(&s.message, &r2, "a message")?;
    let (code, c) = common::server::post(
        api.port,
        "/v1/chat/completions",
        &json!({
        "max_tokens": 80,
        "tools": [{"type": "function", "function": {"name": "get_weather",
            "description": "The weather in a city now.", "parameters": weather_tool()["input_schema"]}}],
        "messages": [
            {"role": "user", "content": ask},
            {"role": "assistant", "content": "", "tool_calls": [{"id": call["id"],
                "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "tool_call_id": call["id"], "content": result}]}),
    );
    let msg = &c["choices"][0]["message"];
    let text: String = r2["content"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|b| b["type"] == "text")
        .map(|b| b["text"].as_str().unwrap_or(""))
        .collect();
    let reasoning: String = r2["content"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|b| b["type"] == "thinking")
        .map(|b| b["thinking"].as_str().unwrap_or(""))
        .collect();
    if code != 200
        || text.trim() != msg["content"].as_str().unwrap_or("").trim()
        || reasoning != msg["reasoning"].as_str().unwrap_or("")
        || r2["usage"]["input_tokens"] != c["usage"]["prompt_tokens"]
    {
        return Err(format!("after the tool result: {r2}\n chat route: {c}"));
    }
    // tool_choice: a named tool is called at once; any calls; none offers no tools.
    let off = json!({"type": "disabled"});
    let named = api.create(&json!({"model": "m", "max_tokens": 60, "tools": tools, "thinking": off,
        "tool_choice": {"type": "tool", "name": "get_weather"}, "messages": user("What is the weather in Oslo?")}))?;
    if named["content"][0]["type"] != "tool_use"
        || named["content"][0]["input"] != json!({"city": "Oslo"})
    {
        return Err(format!("tool_choice tool: {named}"));
    }
    let any = api.create(&json!({"model": "m", "max_tokens": 80, "tools": tools,
        "tool_choice": {"type": "any"}, "messages": user(ask)}))?;
    if any["stop_reason"] != "tool_use" {
        return Err(format!("tool_choice any: {any}"));
    }
    let none = api.create(&json!({"model": "m", "max_tokens": 60, "tools": tools,
        "tool_choice": {"type": "none"}, "messages": user(ask)}))?;
    if none["stop_reason"] == "tool_use"
        || none["content"]
            .as_array()
            .is_none_or(|c| c.iter().any(|b| b["type"] == "tool_use"))
    {
        return Err(format!("tool_choice none: {none}"));
    }
    Ok(r2)
}

/// Gate 4: with a budget of `budget` tokens, the thinking block is the free answer's
/// thinking cut after `budget` tokens (what a max_tokens of budget + 1, the opener
/// included, leaves), and the answer goes on after it.
fn budget_gate(api: &Api, budget: u64) -> Result<(String, String), String> {
    let ask = user("Who are you?");
    let thinking = |m: &Value| -> String {
        m["content"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|b| b["type"] == "thinking")
            .map(|b| b["thinking"].as_str().unwrap_or("").to_owned())
            .collect()
    };
    let free = api.create(&json!({"model": "m", "max_tokens": 80, "messages": ask,
        "thinking": {"type": "adaptive"}}))?;
    let cut = api.create(
        &json!({"model": "m", "max_tokens": budget + 1, "messages": ask,
        "thinking": {"type": "adaptive"}}),
    )?;
    let held = api.create(&json!({"model": "m", "max_tokens": 80, "messages": ask,
        "thinking": {"type": "enabled", "budget_tokens": budget}}))?;
    let (f, c, h) = (thinking(&free), thinking(&cut), thinking(&held));
    if f.len() <= c.len() {
        return Err(format!(
            "the free thinking is no longer than the budget: {free}"
        ));
    }
    if h != c {
        return Err(format!("the budget did not hold: thinking {h:?}, the first {budget} tokens are {c:?} (free: {f:?})"));
    }
    if held["stop_reason"] != "end_turn" || held["content"].as_array().is_none_or(|c| c.len() < 2) {
        return Err(format!(
            "the answer did not go on after the thinking: {held}"
        ));
    }
    Ok((h, f))
}

#[test]
fn tool_exchanges_and_thinking_budgets_hold_on_both_lanes() {
    let s = Schemas::load();
    let tools = server(TOOLS_MODEL, &["--batch", "2"], None);
    let api = Api {
        port: tools.port,
        key: None,
    };
    let r2 = tool_gate(&api, &s).unwrap();
    println!("tool gate: after the tool result {r2}");
    let n = shape_gate(
        &api,
        &[
            json!({"model": "m", "max_tokens": 60, "tools": [weather_tool()],
        "messages": user("What is the weather in Paris?")}),
        ],
        &s,
    )
    .unwrap();
    let (held, free) = budget_gate(&api, 3).unwrap();
    println!("budget gate, batch lane: thinking {held:?} under a budget of 3 (free: {free:?}); {n} streamed documents valid");
    drop(tools);
    // The serial lane, with the tool input planted: the budget holds there too.
    let planted = server(TOOLS_MODEL, &[], Some("MessagesToolInputString"));
    let api = Api {
        port: planted.port,
        key: None,
    };
    let caught = tool_gate(&api, &s);
    println!("planted MessagesToolInputString: {caught:?}");
    assert!(
        caught.is_err(),
        "the tool gate missed the input sent as a string"
    );
    let (held, _) = budget_gate(&api, 5).unwrap();
    println!("budget gate, serial lane: thinking {held:?} under a budget of 5");
    drop(planted);
    let planted = server(TOOLS_MODEL, &[], Some("MessagesBudgetIgnored"));
    let api = Api {
        port: planted.port,
        key: None,
    };
    let caught = budget_gate(&api, 3);
    println!("planted MessagesBudgetIgnored: {caught:?}");
    assert!(
        caught.as_ref().is_err_and(|e| e.contains("did not hold")),
        "the budget gate missed the ignored budget"
    );
}
