//! `POST /v1/responses` end to end over HTTP, in five gates, each shown to fail with a
//! planted defect (switched on in the server process through ENGINE_PLANT):
//!
//! 1. shapes: every non-streamed response and every streamed event validates against the
//!    JSON Schemas of the official `openai` client's models (goldens/serve/responses-*,
//!    from oracles/gen_responses_schema.py), and a stream tells the same answer as the
//!    whole response (`ResponsesUsageMisnamed`);
//! 2. multi-turn: `previous_response_id` continues the kept conversation, the second turn's
//!    prompt is the whole conversation (same prompt length and same greedy answer as the
//!    chat route given the same messages) and it reuses the prompt cache
//!    (`ResponsesPreviousDropped`);
//! 3. tools: a function_call item from tiny-qwen3-tools, then a function_call_output item
//!    continues the exchange as the chat route does, and as mlx_lm.server answered
//!    (`ResponsesToolOutputDropped`);
//! 4. `text.format` json_schema answers parse and validate; an invalid schema is a 400
//!    (`ResponsesFormatIgnored`);
//! 5. hostile bodies: each is a 400 naming its field, and the server keeps serving
//!    (`ResponsesMetadataUnchecked`).

use crate::common;

use common::server::{http, post, serve_dir_with_env, serve_model, Server};
use serde_json::{json, Value};

const LLAMA: &str = "tiny-llama-trained";
const TOOLS_MODEL: &str = "tiny-qwen3-tools";
const SKY: &str = "What color is the sky?";

fn schema(name: &str) -> jsonschema::Validator {
    common::client_schema(name, "openai")
}

struct Schemas {
    response: jsonschema::Validator,
    event: jsonschema::Validator,
}

impl Schemas {
    fn load() -> Self {
        Schemas {
            response: schema("responses-response.schema.json"),
            event: schema("responses-stream-event.schema.json"),
        }
    }
}

fn valid(v: &jsonschema::Validator, doc: &Value, what: &str) -> Result<(), String> {
    common::client_valid(v, doc, what, "openai")
}

fn server(model: &str, plant: Option<&str>) -> Server {
    match plant {
        None => serve_model(model, &[]),
        Some(d) => serve_dir_with_env(
            &common::goldens().join("models").join(model),
            &[],
            &[("ENGINE_PLANT", d)],
        ),
    }
}

/// A whole response (status 200 required).
fn create(port: u16, body: &Value) -> Result<Value, String> {
    let (status, v) = post(port, "/v1/responses", body);
    if status != 200 {
        return Err(format!("status {status}: {v} for {body}"));
    }
    Ok(v)
}

/// A streamed response's events, each checked: its `event:` line names its type, the
/// sequence numbers count from 0.
fn stream(port: u16, body: &Value) -> Result<Vec<Value>, String> {
    let mut body = body.clone();
    body["stream"] = json!(true);
    let (status, text) = http(port, "POST", "/v1/responses", body.to_string().as_bytes());
    if status != 200 {
        return Err(format!("status {status}: {text}"));
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
            if v["sequence_number"] != json!(events.len()) {
                return Err(format!(
                    "sequence_number out of order at {}: {v}",
                    events.len()
                ));
            }
            events.push(v);
        }
    }
    Ok(events)
}

/// The final response of a stream (from response.completed / response.incomplete).
fn final_response(events: &[Value]) -> Result<Value, String> {
    let last = events.last().ok_or("no events")?;
    match last["type"].as_str() {
        Some("response.completed" | "response.incomplete") => Ok(last["response"].clone()),
        _ => Err(format!("the stream did not end with the response: {last}")),
    }
}

/// The assistant's text of a response (its message items' output_text parts).
fn text_of(r: &Value) -> String {
    let mut out = String::new();
    for item in r["output"].as_array().into_iter().flatten() {
        if item["type"] == "message" {
            for part in item["content"].as_array().into_iter().flatten() {
                out.push_str(part["text"].as_str().unwrap_or_default());
            }
        }
    }
    out
}

/// What a response answered, without its ids: each item's type, text, name, arguments.
fn digest(r: &Value) -> Value {
    let items: Vec<Value> = r["output"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|i| {
            json!({"type": i["type"], "status": i["status"], "content": i["content"],
                "name": i["name"], "arguments": i["arguments"]})
        })
        .collect();
    json!({"status": r["status"], "output": items,
        "output_tokens": r["usage"]["output_tokens"]})
}

/// The stream's own consistency: the text deltas of each item add up to its done text and
/// to the final response's item; item ids match.
fn check_stream_text(events: &[Value], fin: &Value) -> Result<(), String> {
    let mut deltas = std::collections::BTreeMap::<String, String>::new();
    for e in events {
        let kind = e["type"].as_str().unwrap_or_default();
        let id = e["item_id"].as_str().unwrap_or_default().to_owned();
        if kind.ends_with("_text.delta") || kind.ends_with("arguments.delta") {
            deltas
                .entry(id)
                .or_default()
                .push_str(e["delta"].as_str().unwrap_or_default());
        } else if kind.ends_with("_text.done") || kind.ends_with("arguments.done") {
            let whole = e["text"]
                .as_str()
                .or(e["arguments"].as_str())
                .unwrap_or_default();
            if deltas.get(&id).map(String::as_str).unwrap_or_default() != whole {
                return Err(format!(
                    "{id}: deltas {:?} != done {whole:?}",
                    deltas.get(&id)
                ));
            }
        }
    }
    for item in fin["output"].as_array().into_iter().flatten() {
        let id = item["id"].as_str().unwrap_or_default();
        let whole = match item["type"].as_str() {
            Some("function_call") => item["arguments"].as_str().unwrap_or_default().to_owned(),
            _ => item["content"][0]["text"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
        };
        if deltas.get(id).cloned().unwrap_or_default() != whole {
            return Err(format!("item {id}: the stream's deltas differ from {item}"));
        }
    }
    Ok(())
}

fn weather_tool() -> Value {
    json!({"type": "function", "name": "get_weather", "description": "The weather in a city now.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
            "required": ["city"]}})
}

/// The same tool as the chat route takes it.
fn chat_weather_tool() -> Value {
    let t = weather_tool();
    json!({"type": "function", "function": {"name": t["name"], "description": t["description"],
        "parameters": t["parameters"]}})
}

/// Gate 1 on one server: each body whole and streamed, every document against the schemas,
/// the stream's answer the whole one's. Returns how many documents were validated.
fn shape_gate(port: u16, bodies: &[Value], s: &Schemas) -> Result<usize, String> {
    let mut n = 0;
    for body in bodies {
        let whole = create(port, body)?;
        valid(&s.response, &whole, "the response")?;
        n += 1;
        let events = stream(port, body)?;
        for e in &events {
            valid(&s.event, e, &format!("event {}", e["type"]))?;
            n += 1;
        }
        let fin = final_response(&events)?;
        valid(&s.response, &fin, "the streamed response")?;
        check_stream_text(&events, &fin)?;
        if digest(&fin) != digest(&whole) {
            return Err(format!(
                "the stream answered otherwise than the whole response:\n{}\n{}",
                digest(&fin),
                digest(&whole)
            ));
        }
        for (i, e) in events.iter().take(2).enumerate() {
            let want = ["response.created", "response.in_progress"][i];
            if e["type"] != want {
                return Err(format!("event {i} is {} (want {want})", e["type"]));
            }
        }
    }
    Ok(n)
}

fn llama_bodies() -> Vec<Value> {
    vec![
        json!({"model": "m", "input": SKY}),
        json!({"input": [{"role": "user", "content": SKY}], "max_output_tokens": 3,
            "metadata": {"run": "shape"}}),
        json!({"input": [{"type": "message", "role": "user",
            "content": [{"type": "input_text", "text": SKY}]}],
            "instructions": "Answer in JSON.", "temperature": 0,
            "text": {"format": {"type": "json_schema", "name": "sky", "strict": true,
                "schema": {"type": "object", "properties": {"sky": {"enum": ["blue", "grey"]}},
                    "required": ["sky"], "additionalProperties": false}}}}),
    ]
}

fn tools_bodies() -> Vec<Value> {
    vec![
        json!({"input": "What is the weather in Paris?", "tools": [weather_tool()],
            "tool_choice": "auto"}),
        json!({"input": "Who are you?"}),
    ]
}

#[test]
fn responses_and_stream_events_match_the_openai_client_schemas() {
    let s = Schemas::load();
    let llama = server(LLAMA, None);
    let n = shape_gate(llama.port, &llama_bodies(), &s).unwrap();
    let r = create(llama.port, &llama_bodies()[0]).unwrap();
    assert_eq!(text_of(&r), "The sky is blue.", "{r}");
    assert_eq!(r["status"], "completed");
    assert_eq!(r["object"], "response");
    assert!(r["id"].as_str().unwrap().starts_with("resp_"), "{r}");
    assert_eq!(r["usage"]["input_tokens"], 14, "{r}");
    assert_eq!(r["usage"]["output_tokens"], 6, "{r}");
    let cut = create(llama.port, &llama_bodies()[1]).unwrap();
    assert_eq!(cut["status"], "incomplete", "{cut}");
    assert_eq!(cut["incomplete_details"]["reason"], "max_output_tokens");
    assert_eq!(cut["metadata"], json!({"run": "shape"}));
    let (status, alias) = post(llama.port, "/responses", &llama_bodies()[0]);
    assert_eq!((status, text_of(&alias)), (200, "The sky is blue.".into()));
    drop(llama);
    let tools = server(TOOLS_MODEL, None);
    let m = shape_gate(tools.port, &tools_bodies(), &s).unwrap();
    let r = create(tools.port, &tools_bodies()[0]).unwrap();
    let kinds: Vec<&str> = r["output"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["type"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["reasoning", "function_call"], "{r}");
    assert!(
        r["usage"]["output_tokens_details"]["reasoning_tokens"]
            .as_u64()
            .unwrap()
            > 0
    );
    println!(
        "shape gate: {} documents valid against openai's schemas",
        n + m
    );
    drop(tools);
    let planted = server(LLAMA, Some("ResponsesUsageMisnamed"));
    let caught = shape_gate(planted.port, &llama_bodies(), &s);
    println!("planted ResponsesUsageMisnamed: {caught:?}");
    assert!(
        caught.is_err(),
        "the shape gate missed the misnamed usage field"
    );
}

fn chat(port: u16, body: &Value) -> Result<Value, String> {
    let (status, v) = post(port, "/v1/chat/completions", body);
    if status != 200 {
        return Err(format!("chat: status {status}: {v}"));
    }
    Ok(v)
}

/// Turn 2 through previous_response_id against the chat route with the same messages:
/// same prompt length, same answer, and (for `cached`) a prompt-cache hit.
fn same_as_chat(port: u16, r: &Value, messages: Value, cached: bool) -> Result<(), String> {
    let c = chat(port, &json!({"messages": messages}))?;
    let want = c["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default();
    if r["usage"]["input_tokens"] != c["usage"]["prompt_tokens"] {
        return Err(format!(
            "the prompt is not the conversation: {} input tokens, the chat route's {}",
            r["usage"]["input_tokens"], c["usage"]["prompt_tokens"]
        ));
    }
    if text_of(r) != want {
        return Err(format!(
            "answer {:?}, the chat route's {want:?}",
            text_of(r)
        ));
    }
    let hit = r["usage"]["input_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    if cached && hit == 0 {
        return Err(format!(
            "the continued turn reused no cached tokens: {}",
            r["usage"]
        ));
    }
    Ok(())
}

/// Gate 2: three turns (the third with instructions, which the fourth does not inherit).
fn multi_turn_gate(port: u16) -> Result<u64, String> {
    let r1 = create(port, &json!({"input": SKY}))?;
    let a1 = text_of(&r1);
    let grass = "What color is the grass?";
    let r2 = create(
        port,
        &json!({"input": grass, "previous_response_id": r1["id"]}),
    )?;
    if r2["previous_response_id"] != r1["id"] {
        return Err(format!("previous_response_id not echoed: {r2}"));
    }
    let a2 = text_of(&r2);
    let turns = json!([
        {"role": "user", "content": SKY}, {"role": "assistant", "content": a1},
        {"role": "user", "content": grass},
    ]);
    same_as_chat(port, &r2, turns.clone(), true)?;
    let cached = r2["usage"]["input_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    let sun = "And the sun?";
    let r3 = create(
        port,
        &json!({"input": [{"role": "user", "content": sun}], "previous_response_id": r2["id"],
            "instructions": "You are terse."}),
    )?;
    let mut with_system = vec![json!({"role": "system", "content": "You are terse."})];
    let mut t3 = turns.as_array().unwrap().clone();
    t3.push(json!({"role": "assistant", "content": a2}));
    t3.push(json!({"role": "user", "content": sun}));
    with_system.extend(t3.iter().cloned());
    same_as_chat(port, &r3, Value::Array(with_system), false)?;
    let r4 = create(
        port,
        &json!({"input": "Bye.", "previous_response_id": r3["id"]}),
    )?;
    t3.push(json!({"role": "assistant", "content": text_of(&r3)}));
    t3.push(json!({"role": "user", "content": "Bye."}));
    same_as_chat(port, &r4, Value::Array(t3), false)?;
    Ok(cached)
}

#[test]
fn previous_response_id_continues_the_conversation_from_the_prompt_cache() {
    let s = server(LLAMA, None);
    let cached = multi_turn_gate(s.port).unwrap();
    println!("multi-turn gate: turn 2 reused {cached} cached tokens");
    // An unknown id, and a response sent with store: false, are not found.
    let (status, e) = post(
        s.port,
        "/v1/responses",
        &json!({"input": "hi", "previous_response_id": "resp_nope"}),
    );
    assert_eq!(status, 404, "{e}");
    assert_eq!(e["error"]["param"], "previous_response_id", "{e}");
    assert_eq!(e["error"]["type"], "invalid_request_error", "{e}");
    assert_eq!(e["error"]["code"], "previous_response_not_found", "{e}");
    let r = create(s.port, &json!({"input": SKY, "store": false})).unwrap();
    assert_eq!(r["store"], false);
    let (status, _) = post(
        s.port,
        "/v1/responses",
        &json!({"input": "hi", "previous_response_id": r["id"]}),
    );
    assert_eq!(status, 404, "a store: false response was kept");
    // A streamed turn is kept too.
    let events = stream(s.port, &json!({"input": SKY})).unwrap();
    let fin = final_response(&events).unwrap();
    let r2 = create(
        s.port,
        &json!({"input": "What color is the grass?", "previous_response_id": fin["id"]}),
    )
    .unwrap();
    assert!(
        r2["usage"]["input_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 0
    );
    drop(s);
    let planted = server(LLAMA, Some("ResponsesPreviousDropped"));
    let caught = multi_turn_gate(planted.port);
    println!("planted ResponsesPreviousDropped: {caught:?}");
    assert!(
        caught.is_err(),
        "the multi-turn gate missed the dropped conversation"
    );
}

/// Gate 3: the model's call as a function_call item, its output sent back (through
/// previous_response_id, and as explicit items), answered as the chat route answers.
fn tool_gate(port: u16) -> Result<String, String> {
    let tools = json!([weather_tool()]);
    let ask = "What is the weather in Paris?";
    let r1 = create(port, &json!({"input": ask, "tools": tools}))?;
    let call = r1["output"]
        .as_array()
        .and_then(|o| o.iter().find(|i| i["type"] == "function_call"))
        .ok_or_else(|| format!("no function_call item: {r1}"))?
        .clone();
    if call["name"] != "get_weather" || call["arguments"] != "{\"city\": \"Paris\"}" {
        return Err(format!("unexpected call {call}"));
    }
    if call["status"] != "completed" || !call["id"].as_str().is_some_and(|i| i.starts_with("fc_")) {
        return Err(format!("call item shape {call}"));
    }
    let result = "{\"city\": \"Paris\", \"sky\": \"sunny\", \"celsius\": 21}";
    let r2 = create(
        port,
        &json!({"previous_response_id": r1["id"], "tools": tools, "input": [
            {"type": "function_call_output", "call_id": call["call_id"], "output": result}]}),
    )?;
    let c = chat(
        port,
        &json!({"tools": [chat_weather_tool()], "messages": [
            {"role": "user", "content": ask},
            {"role": "assistant", "content": "\n\n", "tool_calls": [{"id": call["call_id"],
                "type": "function", "function": {"name": "get_weather",
                "arguments": call["arguments"]}}]},
            {"role": "tool", "tool_call_id": call["call_id"], "content": result},
        ]}),
    )?;
    let want = c["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default();
    if text_of(&r2) != want || r2["usage"]["input_tokens"] != c["usage"]["prompt_tokens"] {
        return Err(format!("after the tool result: {r2}\n chat route: {c}"));
    }
    // The items sent by hand (no stored state): as mlx_lm.server answered the same chat
    // (engine/tests/it/serve_tools.rs, answer_after_tool_result).
    let r3 = create(
        port,
        &json!({"tools": tools, "input": [
            {"role": "user", "content": "What is the weather in Oslo?"},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                "arguments": "{\"city\": \"Oslo\"}"},
            {"type": "function_call_output", "call_id": "call_1",
                "output": "{\"city\": \"Oslo\", \"sky\": \"snowy\", \"celsius\": -3}"}]}),
    )?;
    if text_of(&r3) != "\n\nIt is snowy in Oslo, -3 degrees." {
        return Err(format!(
            "the Oslo answer differs from mlx_lm.server's: {r3}"
        ));
    }
    Ok(text_of(&r2))
}

#[test]
fn a_function_call_item_and_its_output_continue_the_exchange() {
    let s = server(TOOLS_MODEL, None);
    let answer = tool_gate(s.port).unwrap();
    println!("tool gate: answer after the tool result {answer:?}");
    // Streamed: the call comes as function_call_arguments events.
    let events = stream(
        s.port,
        &json!({"input": "What is the weather in Paris?", "tools": [weather_tool()],
            "chat_template_kwargs": {"enable_thinking": false}}),
    )
    .unwrap();
    let kinds: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert!(
        kinds.contains(&"response.function_call_arguments.delta")
            && kinds.contains(&"response.function_call_arguments.done"),
        "{kinds:?}"
    );
    let fin = final_response(&events).unwrap();
    assert_eq!(fin["output"].as_array().unwrap().len(), 1, "{fin}");
    assert_eq!(fin["output"][0]["type"], "function_call", "{fin}");
    drop(s);
    let planted = server(TOOLS_MODEL, Some("ResponsesToolOutputDropped"));
    let caught = tool_gate(planted.port);
    println!("planted ResponsesToolOutputDropped: {caught:?}");
    assert!(
        caught.is_err(),
        "the tool gate missed the dropped tool output"
    );
}

fn judge(schema: &Value, text: &str) -> Result<(), String> {
    let doc: Value = serde_json::from_str(text).map_err(|e| format!("not JSON ({e}): {text:?}"))?;
    jsonschema::validator_for(schema)
        .map_err(|e| e.to_string())?
        .validate(&doc)
        .map_err(|e| format!("invalid ({e}): {text}"))
}

/// Gate 4: json_schema answers (whole and streamed, greedy and sampled) validate.
fn format_gate(port: u16) -> Result<usize, String> {
    let schemas = [
        json!({"type": "object", "properties": {"sky": {"enum": ["blue", "grey"]}},
            "required": ["sky"], "additionalProperties": false}),
        json!({"type": "object", "properties": {"n": {"type": "integer"},
            "ok": {"type": "boolean"}}, "required": ["n", "ok"], "additionalProperties": false}),
    ];
    let mut n = 0;
    for (i, sch) in schemas.iter().enumerate() {
        for temp in [0.0, 0.8] {
            let body = json!({"input": SKY, "temperature": temp, "seed": i, "max_output_tokens": 128,
                "text": {"format": {"type": "json_schema", "name": "a", "schema": sch,
                    "strict": true}}});
            let r = create(port, &body)?;
            if r["status"] != "completed" {
                return Err(format!("not completed: {r}"));
            }
            judge(sch, &text_of(&r))?;
            let fin = final_response(&stream(port, &body)?)?;
            judge(sch, &text_of(&fin))?;
            n += 2;
        }
    }
    let r = create(
        port,
        &json!({"input": SKY, "max_output_tokens": 128, "text": {"format": {"type": "json_object"}}}),
    )?;
    // Greedy json_object on this tiny model may run to the limit (as in
    // engine/tests/it/constrained.rs): a finished answer is an object, a cut one opens one.
    let text = text_of(&r);
    let ok = if r["status"] == "completed" {
        serde_json::from_str::<Value>(&text).is_ok_and(|v| v.is_object())
    } else {
        text.starts_with('{')
    };
    if !ok {
        return Err(format!("json_object answer is no object: {r}"));
    }
    Ok(n + 1)
}

#[test]
fn text_format_json_schema_answers_validate_and_a_bad_schema_is_refused() {
    let s = server(LLAMA, None);
    let n = format_gate(s.port).unwrap();
    println!("format gate: {n} answers valid");
    let bad = json!({"input": SKY, "text": {"format": {"type": "json_schema", "name": "x",
        "schema": {"type": "object", "properties": {"a": {"type": "frobnicate"}}}}}});
    let (status, e) = post(s.port, "/v1/responses", &bad);
    assert_eq!(status, 400, "{e}");
    assert_eq!(e["error"]["param"], "text.format", "{e}");
    println!("invalid schema: {}", e["error"]["message"]);
    drop(s);
    let planted = server(LLAMA, Some("ResponsesFormatIgnored"));
    let caught = format_gate(planted.port);
    println!("planted ResponsesFormatIgnored: {caught:?}");
    assert!(
        caught.is_err(),
        "the format gate missed the ignored text.format"
    );
}

/// (body, the param the 400 must name; None: no param).
fn hostile() -> Vec<(String, Option<&'static str>)> {
    let many: serde_json::Map<String, Value> =
        (0..17).map(|i| (format!("k{i}"), json!("v"))).collect();
    let j = |v: Value| v.to_string();
    vec![
        ("{not json".into(), None),
        (j(json!([1, 2])), None),
        (j(json!({})), Some("input")),
        (j(json!({"input": 5})), Some("input")),
        (j(json!({"input": []})), Some("input")),
        (j(json!({"input": [3]})), Some("input[0]")),
        (
            j(json!({"input": [{"type": "bogus"}]})),
            Some("input[0].type"),
        ),
        (
            j(json!({"input": [{"content": "x"}]})),
            Some("input[0].type"),
        ),
        (
            j(json!({"input": [{"role": "tool", "content": "x"}]})),
            Some("input[0].role"),
        ),
        (
            j(json!({"input": [{"role": 7, "content": "x"}]})),
            Some("input[0].role"),
        ),
        (
            j(json!({"input": [{"role": "user", "content": 7}]})),
            Some("input[0].content"),
        ),
        (
            j(
                json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}),
            ),
            Some("input[0].content[0]"),
        ),
        (
            j(json!({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]})),
            Some("input[0].call_id"),
        ),
        (
            j(
                json!({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{oops"}]}),
            ),
            Some("input[0].arguments"),
        ),
        (
            j(json!({"input": [{"type": "function_call_output", "call_id": "c", "output": 7}]})),
            Some("input[0].output"),
        ),
        (
            j(json!({"input": "x", "instructions": ["a"]})),
            Some("instructions"),
        ),
        (
            j(json!({"input": "x", "previous_response_id": 5})),
            Some("previous_response_id"),
        ),
        (j(json!({"input": "x", "tools": {}})), Some("tools")),
        (j(json!({"input": "x", "tools": [5]})), Some("tools[0]")),
        (
            j(json!({"input": "x", "tools": [{"type": "web_search"}]})),
            Some("tools[0].type"),
        ),
        (
            j(json!({"input": "x", "tools": [chat_weather_tool()]})),
            Some("tools[0].function"),
        ),
        (
            j(json!({"input": "x", "tools": [{"type": "function"}]})),
            Some("tools[0].name"),
        ),
        (
            j(json!({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": 3}]})),
            Some("tools[0].parameters"),
        ),
        (
            j(json!({"input": "x", "tool_choice": 5})),
            Some("tool_choice"),
        ),
        (j(json!({"input": "x", "text": "json"})), Some("text")),
        (
            j(json!({"input": "x", "text": {"format": {"type": "xml"}}})),
            Some("text.format.type"),
        ),
        (
            j(json!({"input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}})),
            Some("text.format.schema"),
        ),
        (
            j(json!({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}})),
            Some("text.format.name"),
        ),
        (
            j(json!({"input": "x", "max_output_tokens": 0})),
            Some("max_output_tokens"),
        ),
        (
            j(json!({"input": "x", "max_output_tokens": -1})),
            Some("max_output_tokens"),
        ),
        (
            j(json!({"input": "x", "max_output_tokens": "10"})),
            Some("max_output_tokens"),
        ),
        (
            j(json!({"input": "x", "max_output_tokens": 1e12})),
            Some("max_output_tokens"),
        ),
        (
            j(json!({"input": "x", "temperature": "hot"})),
            Some("temperature"),
        ),
        (j(json!({"input": "x", "top_p": 2})), Some("top_p")),
        (j(json!({"input": "x", "stream": "yes"})), Some("stream")),
        (j(json!({"input": "x", "store": "no"})), Some("store")),
        (
            j(json!({"input": "x", "parallel_tool_calls": 1})),
            Some("parallel_tool_calls"),
        ),
        (j(json!({"input": "x", "metadata": 5})), Some("metadata")),
        (
            j(json!({"input": "x", "metadata": {"a": 1}})),
            Some("metadata"),
        ),
        (j(json!({"input": "x", "metadata": many})), Some("metadata")),
        (
            j(json!({"input": "x", "metadata": {"k": "v".repeat(513)}})),
            Some("metadata"),
        ),
        (
            j(json!({"input": "x", "reasoning": "high"})),
            Some("reasoning"),
        ),
        (j(json!({"input": "x", "include": "all"})), Some("include")),
        (
            j(json!({"input": "x", "truncation": "sometimes"})),
            Some("truncation"),
        ),
        (
            j(json!({"input": "x", "background": true})),
            Some("background"),
        ),
        (j(json!({"input": "x", "model": 3})), Some("model")),
        (
            j(json!({"input": "x", "frobnicate": 1})),
            Some("frobnicate"),
        ),
    ]
}

/// Gate 5: every hostile body is a 400 naming its field; the server still answers.
fn hostile_gate(port: u16) -> Result<usize, String> {
    let cases = hostile();
    for (body, param) in &cases {
        let (status, text) = http(port, "POST", "/v1/responses", body.as_bytes());
        let v: Value = serde_json::from_str(&text).map_err(|e| format!("{e}: {text}"))?;
        let message = v["error"]["message"].as_str().unwrap_or_default();
        if status != 400 || message.is_empty() || v["error"]["param"].as_str() != *param {
            return Err(format!(
                "{body}: status {status}, {v} (want 400 naming {param:?})"
            ));
        }
    }
    let r = create(port, &json!({"input": SKY}))?;
    if text_of(&r) != "The sky is blue." {
        return Err(format!("after the hostile bodies: {r}"));
    }
    Ok(cases.len())
}

#[test]
fn hostile_bodies_are_refused_by_field() {
    let s = server(LLAMA, None);
    let n = hostile_gate(s.port).unwrap();
    println!("hostile gate: {n} bodies refused with a 400 naming the field");
    drop(s);
    let planted = server(LLAMA, Some("ResponsesMetadataUnchecked"));
    let caught = hostile_gate(planted.port);
    println!("planted ResponsesMetadataUnchecked: {caught:?}");
    assert!(
        caught.is_err(),
        "the hostile gate missed the unchecked metadata"
    );
}
