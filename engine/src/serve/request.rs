//! Request bodies as mlx_lm.server 0.32.2 reads them (same fields, same defaults from the
//! server's flags, same validation bounds), checked field by field so that a bad request
//! gets a 4xx naming the field instead of reaching the model.

use serde_json::{Map, Value};

use super::error::ApiError;
use crate::generate::sampler::SamplingParams;

/// Server-wide defaults a request may override (mlx_lm.server's flags).
#[derive(Debug, Clone)]
pub struct Defaults {
    pub max_tokens: usize,
    pub temp: f64,
    pub top_p: f64,
    pub top_k: i32,
    pub min_p: f64,
    /// The model's context length: prompts and max_tokens beyond it are refused.
    pub context: usize,
    /// The model's vocabulary (logits width): token ids and k's are checked against it.
    pub vocab: usize,
    /// `--chat-template-args`: template kwargs every chat request starts from.
    pub template_kwargs: Map<String, Value>,
}

/// What the prompt is: chat turns (rendered with the chat template) or raw text.
#[derive(Debug, Clone)]
pub enum Prompt {
    Chat(Box<Chat>),
    Text(String),
}

/// A chat request's conversation as mlx_lm.server hands it to `apply_chat_template`: the
/// messages as the client sent them (content parts joined into text, a missing content
/// made "", tool-call arguments given as JSON strings parsed), the tools, and the template
/// kwargs of the request (`chat_template_kwargs`, over `--chat-template-args`).
#[derive(Debug, Clone, Default)]
pub struct Chat {
    pub messages: Vec<Value>,
    /// None when absent or empty (`body.get("tools") or None`).
    pub tools: Option<Value>,
    /// apply_chat_template's own parameters, when chat_template_kwargs names them.
    pub documents: Option<Value>,
    pub continue_final_message: bool,
    pub kwargs: Map<String, Value>,
    /// `tool_choice` as sent (mlx_lm.server ignores it; strict tools read it:
    /// `tools::strict`).
    pub tool_choice: Option<Value>,
}

/// A validated generation request.
#[derive(Debug, Clone)]
pub struct GenRequest {
    pub prompt: Prompt,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    /// Per-token log-probabilities (`logprobs: true`) and how many alternatives per token.
    pub logprobs: bool,
    pub top_logprobs: usize,
    /// Drafts per verify pass with `--draft-model` (mlx_lm.server's `num_draft_tokens`;
    /// None: the server's; 0: no drafting for this request).
    pub num_draft_tokens: Option<usize>,
    /// Prompt-lookup decoding for this request (`prompt_lookup_num_tokens`, with
    /// `max_matching_ngram_size`, as transformers' generate takes them): drafts copied from
    /// the prompt and the text so far; None: plain decoding (or the server's drafter).
    pub prompt_lookup: Option<crate::generate::lookup::LookupParams>,
    /// The grammar the answer must match (`response_format`; `engine::constrain`).
    pub constraint: Option<crate::constrain::Grammar>,
}

const ROLES: [&str; 5] = ["system", "user", "assistant", "tool", "developer"];

struct Body<'a>(&'a Map<String, Value>);

impl Body<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }

    fn bool(&self, key: &str, default: bool) -> Result<bool, ApiError> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| ApiError::field(key, format!("{key} must be a boolean"))),
        }
    }

    fn int(&self, key: &str, default: i64, min: i64, max: i64) -> Result<i64, ApiError> {
        let Some(v) = self.get(key) else {
            return Ok(default);
        };
        let n = v
            .as_i64()
            .ok_or_else(|| ApiError::field(key, format!("{key} must be an integer")))?;
        if n < min {
            return Err(ApiError::field(
                key,
                format!("{key} must be at least {min}"),
            ));
        }
        if n > max {
            return Err(ApiError::field(key, format!("{key} must be at most {max}")));
        }
        Ok(n)
    }

    fn num(&self, key: &str, default: f64, min: f64, max: f64) -> Result<f64, ApiError> {
        let Some(v) = self.get(key) else {
            return Ok(default);
        };
        let x = v
            .as_f64()
            .filter(|x| x.is_finite())
            .ok_or_else(|| ApiError::field(key, format!("{key} must be a number")))?;
        if x < min {
            return Err(ApiError::field(
                key,
                format!("{key} must be at least {min}"),
            ));
        }
        if x > max {
            return Err(ApiError::field(key, format!("{key} must be at most {max}")));
        }
        Ok(x)
    }
}

/// `process_message_content`: a list of `{type: "text", text}` parts becomes their text
/// joined (any other part is refused), a missing or null content becomes "".
fn content_text(v: Option<&Value>, field: &str) -> Result<Value, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(Value::String(String::new())),
        Some(Value::String(s)) => Ok(Value::String(s.clone())),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (j, part) in parts.iter().enumerate() {
                match (part.get("type").and_then(Value::as_str), part.get("text")) {
                    (Some("text"), Some(Value::String(t))) => text.push_str(t),
                    _ => {
                        return Err(ApiError::field(
                            &format!("{field}[{j}]"),
                            "only {\"type\": \"text\", \"text\": …} content parts are supported",
                        ))
                    }
                }
            }
            Ok(Value::String(text))
        }
        Some(_) => Err(ApiError::field(
            field,
            "content must be a string or a list of text parts",
        )),
    }
}

/// An assistant message's `tool_calls`: a list of objects whose `function.arguments`, when
/// a JSON string (as OpenAI clients send them back), is parsed for the template.
fn tool_calls(v: &mut Value, field: &str) -> Result<(), ApiError> {
    let bad = |f: &str, m: &str| Err(ApiError::field(f, m.to_owned()));
    let Some(list) = v.as_array_mut() else {
        return bad(field, "tool_calls must be a list of objects");
    };
    for (j, call) in list.iter_mut().enumerate() {
        let at = format!("{field}[{j}]");
        let Some(call) = call.as_object_mut() else {
            return bad(&at, "a tool call must be an object");
        };
        let Some(function) = call.get_mut("function").filter(|f| !f.is_null()) else {
            continue;
        };
        let Some(function) = function.as_object_mut() else {
            return bad(&format!("{at}.function"), "function must be an object");
        };
        if let Some(Value::String(args)) = function.get("arguments") {
            if args.is_empty() {
                continue;
            }
            let parsed: Value = serde_json::from_str(args).map_err(|e| {
                ApiError::field(
                    &format!("{at}.function.arguments"),
                    format!("arguments is not valid JSON: {e}"),
                )
            })?;
            function.insert("arguments".into(), parsed);
        }
    }
    Ok(())
}

fn messages(v: Option<&Value>) -> Result<Vec<Value>, ApiError> {
    let list = v
        .and_then(Value::as_array)
        .ok_or_else(|| ApiError::field("messages", "messages must be a non-empty list"))?;
    if list.is_empty() {
        return Err(ApiError::field(
            "messages",
            "messages must be a non-empty list",
        ));
    }
    list.iter()
        .enumerate()
        .map(|(i, m)| {
            let mut m = m.as_object().cloned().ok_or_else(|| {
                ApiError::field(&format!("messages[{i}]"), "a message must be an object")
            })?;
            let role = m.get("role").and_then(Value::as_str).ok_or_else(|| {
                ApiError::field(&format!("messages[{i}].role"), "role must be a string")
            })?;
            if !ROLES.contains(&role) {
                return Err(ApiError::field(
                    &format!("messages[{i}].role"),
                    format!(
                        "unknown role `{role}` (expected one of {})",
                        ROLES.join(", ")
                    ),
                ));
            }
            let content = content_text(m.get("content"), &format!("messages[{i}].content"))?;
            m.insert("content".into(), content);
            for key in ["tool_call_id", "name", "reasoning_content", "reasoning"] {
                if m.get(key).is_some_and(|v| !v.is_string() && !v.is_null()) {
                    return Err(ApiError::field(
                        &format!("messages[{i}].{key}"),
                        format!("{key} must be a string"),
                    ));
                }
            }
            if let Some(calls) = m.get_mut("tool_calls").filter(|c| !c.is_null()) {
                tool_calls(calls, &format!("messages[{i}].tool_calls"))?;
            }
            Ok(Value::Object(m))
        })
        .collect()
}

/// `tools`: a list of `{"type": "function", "function": {"name", "description",
/// "parameters"}}`; None when absent or empty, as mlx_lm.server reads it.
fn tools(v: Option<&Value>) -> Result<Option<Value>, ApiError> {
    let Some(v) = v else {
        return Ok(None);
    };
    let list = v
        .as_array()
        .ok_or_else(|| ApiError::field("tools", "tools must be a list of tool objects"))?;
    for (i, tool) in list.iter().enumerate() {
        let at = format!("tools[{i}]");
        let tool = tool
            .as_object()
            .ok_or_else(|| ApiError::field(&at, "a tool must be an object"))?;
        if let Some(t) = tool.get("type") {
            if t.as_str() != Some("function") {
                return Err(ApiError::field(
                    &format!("{at}.type"),
                    "only tools of type \"function\" are supported",
                ));
            }
        }
        let function = tool
            .get("function")
            .and_then(Value::as_object)
            .ok_or_else(|| {
                ApiError::field(&format!("{at}.function"), "function must be an object")
            })?;
        if !function.get("name").is_some_and(Value::is_string) {
            return Err(ApiError::field(
                &format!("{at}.function.name"),
                "the function's name must be a string",
            ));
        }
        if function
            .get("parameters")
            .is_some_and(|p| !p.is_object() && !p.is_null())
        {
            return Err(ApiError::field(
                &format!("{at}.function.parameters"),
                "parameters must be a JSON Schema object",
            ));
        }
    }
    Ok((!list.is_empty()).then(|| v.clone()))
}

/// `tool_choice`: read and ignored, as mlx_lm.server ignores it (the model decides).
fn tool_choice(v: Option<&Value>) -> Result<(), ApiError> {
    match v {
        None | Some(Value::Object(_)) => Ok(()),
        Some(Value::String(s)) if ["auto", "none", "required"].contains(&s.as_str()) => Ok(()),
        Some(_) => Err(ApiError::field(
            "tool_choice",
            "tool_choice must be \"auto\", \"none\", \"required\" or an object",
        )),
    }
}

/// The template kwargs: `--chat-template-args`, then the request's `chat_template_kwargs`
/// over them; apply_chat_template's own `documents` and `continue_final_message` are taken
/// out, and the names it passes itself are refused.
fn template_kwargs(
    chat: &mut Chat,
    v: Option<&Value>,
    defaults: &Map<String, Value>,
) -> Result<(), ApiError> {
    let field = "chat_template_kwargs";
    let mut kwargs = defaults.clone();
    match v {
        None => {}
        Some(Value::Object(o)) => kwargs.extend(o.clone()),
        Some(_) => {
            return Err(ApiError::field(
                field,
                "chat_template_kwargs must be an object",
            ))
        }
    }
    for reserved in [
        "messages",
        "conversation",
        "tools",
        "add_generation_prompt",
        "tokenize",
        "chat_template",
    ] {
        if kwargs.contains_key(reserved) {
            return Err(ApiError::field(
                field,
                format!("chat_template_kwargs may not set `{reserved}` (the server passes it)"),
            ));
        }
    }
    chat.documents = kwargs.remove("documents").filter(|d| !d.is_null());
    chat.continue_final_message = match kwargs.remove("continue_final_message") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => b,
        Some(_) => {
            return Err(ApiError::field(
                field,
                "continue_final_message must be a boolean",
            ))
        }
    };
    chat.kwargs = kwargs;
    Ok(())
}

fn stop_words(v: Option<&Value>) -> Result<Vec<String>, ApiError> {
    match v {
        None => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![s.clone()]),
        Some(Value::Array(items)) => items
            .iter()
            .map(|s| {
                s.as_str().map(str::to_owned).ok_or_else(|| {
                    ApiError::field("stop", "stop must be a string or a list of strings")
                })
            })
            .collect(),
        Some(_) => Err(ApiError::field(
            "stop",
            "stop must be a string or a list of strings",
        )),
    }
}

fn logit_bias(v: Option<&Value>) -> Result<Vec<(u32, f32)>, ApiError> {
    let Some(v) = v else {
        return Ok(Vec::new());
    };
    let map = v.as_object().ok_or_else(|| {
        ApiError::field("logit_bias", "logit_bias must be a dict of int to float")
    })?;
    map.iter()
        .map(|(k, b)| {
            let id = k.parse::<u32>().ok();
            let bias = b.as_f64().filter(|x| x.is_finite());
            match (id, bias) {
                (Some(id), Some(bias)) => Ok((id, bias as f32)),
                _ => Err(ApiError::field(
                    "logit_bias",
                    "logit_bias must be a dict of int to float",
                )),
            }
        })
        .collect()
}

/// Parses and validates a body for `/v1/chat/completions` (`chat`) or `/v1/completions`.
pub fn parse(body: &Value, chat: bool, d: &Defaults) -> Result<GenRequest, ApiError> {
    let map = body
        .as_object()
        .ok_or_else(|| ApiError::invalid("the request body must be a JSON object"))?;
    let b = Body(map);
    let prompt = if chat {
        let mut c = Chat {
            messages: messages(b.get("messages"))?,
            tools: tools(b.get("tools"))?,
            ..Chat::default()
        };
        tool_choice(b.get("tool_choice"))?;
        c.tool_choice = b.get("tool_choice").cloned();
        template_kwargs(&mut c, b.get("chat_template_kwargs"), &d.template_kwargs)?;
        Prompt::Chat(Box::new(c))
    } else {
        match b.get("prompt") {
            Some(Value::String(s)) => Prompt::Text(s.clone()),
            _ => return Err(ApiError::field("prompt", "prompt must be a string")),
        }
    };
    let ctx = d.context as i64;
    let max_key = if b.get("max_completion_tokens").is_some() {
        "max_completion_tokens"
    } else {
        "max_tokens"
    };
    let max_tokens = b.int(max_key, d.max_tokens as i64, 1, ctx)? as usize;
    let penalty = |key: &str, min: f64| -> Result<Option<f64>, ApiError> {
        let x = b.num(key, 0.0, min, f64::MAX)?;
        Ok((x != 0.0).then_some(x))
    };
    let sampling = SamplingParams {
        temp: b.num("temperature", d.temp, 0.0, f64::MAX)?,
        top_p: b.num("top_p", d.top_p, 0.0, 1.0)?,
        top_k: b.int("top_k", d.top_k as i64, 0, i32::MAX as i64)? as i32,
        min_p: b.num("min_p", d.min_p, 0.0, 1.0)?,
        seed: b.int("seed", 0, 0, i64::MAX)? as u64,
        logit_bias: logit_bias(b.get("logit_bias"))?,
        repetition_penalty: penalty("repetition_penalty", 0.0)?,
        repetition_context_size: b.int("repetition_context_size", 20, 0, ctx)? as usize,
        presence_penalty: penalty("presence_penalty", f64::MIN)?,
        presence_context_size: b.int("presence_context_size", 20, 0, ctx)? as usize,
        frequency_penalty: penalty("frequency_penalty", f64::MIN)?,
        frequency_context_size: b.int("frequency_context_size", 20, 0, ctx)? as usize,
        ..SamplingParams::default()
    };
    sampling
        .check(d.vocab)
        .map_err(|e| ApiError::field(e.field, e.message))?;
    // One choice per request, as mlx_lm.server answers; more would be silently dropped.
    if b.int("n", 1, 1, i64::MAX)? != 1 {
        return Err(ApiError::field(
            "n",
            "only n = 1 is supported: send one request per completion",
        ));
    }
    let include_usage = match b.get("stream_options") {
        None => false,
        Some(Value::Object(o)) => Body(o).bool("include_usage", false)?,
        Some(_) => {
            return Err(ApiError::field(
                "stream_options",
                "stream_options must be an object",
            ))
        }
    };
    if let Some(m) = b.get("model") {
        if !m.is_string() {
            return Err(ApiError::field("model", "model must be a string"));
        }
    }
    // OpenAI's chat API takes `logprobs: bool` + `top_logprobs: 0..=20`; its completions
    // API takes `logprobs: int`. Both map onto (per-token logprob, alternatives).
    let (logprobs, top_logprobs) = match b.get("logprobs") {
        Some(Value::Number(n)) if !chat => {
            let k = n
                .as_u64()
                .filter(|k| *k <= 10)
                .ok_or_else(|| ApiError::field("logprobs", "logprobs must be an integer 0–10"))?;
            (true, k as usize)
        }
        _ => (
            b.bool("logprobs", false)?,
            b.int("top_logprobs", 0, 0, 10)? as usize,
        ),
    };
    if top_logprobs > d.vocab {
        return Err(ApiError::field(
            "top_logprobs",
            format!("at most the vocabulary size, {}", d.vocab),
        ));
    }
    let (num_draft_tokens, prompt_lookup) = drafting(&b, &sampling)?;
    let constraint = crate::constrain::openai::response_format(b.get("response_format"))
        .map_err(|(f, m)| ApiError::field(f, m))?;
    Ok(GenRequest {
        prompt,
        max_tokens,
        sampling,
        stop: stop_words(b.get("stop"))?,
        stream: b.bool("stream", false)?,
        include_usage,
        logprobs: logprobs || top_logprobs > 0,
        top_logprobs,
        num_draft_tokens,
        prompt_lookup,
        constraint,
    })
}

/// A request's drafting fields: `num_draft_tokens`, and prompt lookup's (`prompt_lookup`).
fn drafting(
    b: &Body<'_>,
    sampling: &SamplingParams,
) -> Result<(Option<usize>, Option<crate::generate::lookup::LookupParams>), ApiError> {
    let num_draft_tokens = match b.get("num_draft_tokens") {
        None => None,
        Some(_) => Some(b.int("num_draft_tokens", 0, 0, 64)? as usize),
    };
    Ok((
        num_draft_tokens,
        prompt_lookup(b, sampling, num_draft_tokens)?,
    ))
}

/// `prompt_lookup_num_tokens` (0 or absent: off) and `max_matching_ngram_size`, checked:
/// not with logits processors (the verify pass samples every position at once) nor with
/// `num_draft_tokens` above 0 (one drafter per request).
fn prompt_lookup(
    b: &Body<'_>,
    sampling: &SamplingParams,
    num_draft_tokens: Option<usize>,
) -> Result<Option<crate::generate::lookup::LookupParams>, ApiError> {
    use crate::generate::lookup::{LookupParams, MAX_NGRAM, MAX_NUM_TOKENS};
    const KEY: &str = "prompt_lookup_num_tokens";
    const NGRAM: &str = "max_matching_ngram_size";
    let n = b.int(KEY, 0, 0, MAX_NUM_TOKENS as i64)? as usize;
    let ngram = match b.get(NGRAM) {
        None => None,
        Some(_) => Some(b.int(NGRAM, 0, 1, MAX_NGRAM as i64)? as usize),
    };
    if n == 0 {
        return match ngram {
            Some(_) => Err(ApiError::field(
                NGRAM,
                format!(
                    "{NGRAM} applies to prompt-lookup decoding: set {KEY} too (1–{MAX_NUM_TOKENS})"
                ),
            )),
            None => Ok(None),
        };
    }
    let processors = !sampling.logit_bias.is_empty()
        || sampling.repetition_penalty.is_some()
        || sampling.presence_penalty.is_some()
        || sampling.frequency_penalty.is_some();
    if processors {
        return Err(ApiError::field(
            KEY,
            format!(
                "{KEY}: prompt-lookup decoding does not run logits processors (logit_bias, \
                 repetition, presence or frequency penalties); drop them or {KEY}"
            ),
        ));
    }
    if num_draft_tokens.is_some_and(|g| g > 0) {
        return Err(ApiError::field(
            KEY,
            format!(
                "{KEY} and num_draft_tokens both ask for drafting: set one of them (0 turns \
                 the draft model off)"
            ),
        ));
    }
    LookupParams::new(n, ngram)
        .map(Some)
        .map_err(|e| ApiError::field(KEY, e.message))
}

/// Refuses a prompt holding ids the model cannot read (a tokenizer whose added tokens lie
/// past the model's embedding): MLX's gather does not check its indices.
pub fn check_ids(ids: &[u32], vocab: usize, field: &str) -> Result<(), ApiError> {
    match ids.iter().find(|&&id| id as usize >= vocab) {
        None => Ok(()),
        Some(id) => Err(ApiError::field(
            field,
            format!(
                "the prompt encodes to token id {id}, outside this model's vocabulary of \
                 {vocab}: the tokenizer does not match the model"
            ),
        )),
    }
}
