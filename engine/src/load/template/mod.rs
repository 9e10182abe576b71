//! Chat templates rendered as transformers' `apply_chat_template` renders them: the model's
//! Jinja template (`Tokenizer::chat_template`, or a named one) in minijinja configured like
//! transformers' sandbox (trim_blocks, lstrip_blocks, loop controls, Python string methods,
//! `raise_exception`, `strftime_now`, its `tojson`, Python's `str()` of printed values), with
//! the same context: the tokenizer's special tokens, the template kwargs over them, then
//! `messages`, `tools`, `documents` (None when not given) and `add_generation_prompt`.
//!
//! The clock `strftime_now` reads is the local time, or the one pinned by
//! [`ChatTemplate::with_now`] (the template gate pins it, as its oracle does).

mod continuation;
pub mod pyjson;
mod special;

use minijinja::value::{Kwargs, Rest};
use minijinja::{Environment, Error, ErrorKind, State, Value};
use serde::Serialize;

use super::tokenizer::Tokenizer;
use super::LoadError;

/// The time [`ChatTemplate::with_now`] pins (chrono's naive local date and time).
pub use chrono::NaiveDateTime;
pub use special::special_tokens_map;

#[derive(Debug, Clone, Serialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Self {
        Message {
            role: role.to_owned(),
            content: content.to_owned(),
        }
    }
}

/// What apply_chat_template takes besides the template and the messages.
#[derive(Debug, Default, Clone)]
pub struct RenderArgs {
    /// A JSON list of tool schemas (OpenAI "tools" shape), passed as given; None when absent.
    pub tools: Option<serde_json::Value>,
    /// A JSON list of documents (dicts), passed as given; None when absent.
    pub documents: Option<serde_json::Value>,
    pub add_generation_prompt: bool,
    /// Leave the final message open (its "content"): no end-of-turn after it.
    pub continue_final_message: bool,
    /// chat_template_kwargs (enable_thinking, …): template variables over the special tokens.
    pub kwargs: serde_json::Map<String, serde_json::Value>,
}

pub struct ChatTemplate {
    env: Environment<'static>,
    /// The template as the model ships it (continue_final_message looks for its field here).
    source: String,
    /// The special-token variables (bos_token, eos_token, …) in transformers' order.
    special_tokens: Vec<(String, String)>,
}

fn invalid(message: impl Into<String>) -> Error {
    Error::new(ErrorKind::InvalidOperation, message.into())
}

fn template_error(e: Error) -> LoadError {
    let mut message = e.to_string();
    if let Some(detail) = std::error::Error::source(&e) {
        message.push_str(&format!(": {detail}"));
    }
    LoadError::Template(message)
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(invalid(message))
}

/// `datetime.strftime(format)` of a naive local time, as Python's (glibc's) strftime for
/// the directives chrono shares with it.
fn strftime(now: NaiveDateTime, format: &str) -> Result<String, Error> {
    use chrono::format::{Item, StrftimeItems};
    use std::fmt::Write;
    let items: Vec<Item> = StrftimeItems::new(format).collect();
    if items.iter().any(|i| matches!(i, Item::Error)) {
        return Err(invalid(format!(
            "strftime_now: unsupported format {format:?}"
        )));
    }
    let mut out = String::new();
    write!(out, "{}", now.format_with_items(items.into_iter()))
        .map_err(|_| invalid(format!("strftime_now: {format:?} needs a time zone")))?;
    Ok(out)
}

/// Python's `str.strip/lstrip/rstrip(chars=None)`: whitespace as Python defines it.
fn py_strip(s: &str, method: &str, chars: Option<&str>) -> String {
    let set: Vec<char> = chars.map(|c| c.chars().collect()).unwrap_or_default();
    let strip = |c: char| match chars {
        Some(_) => set.contains(&c),
        None => continuation::is_py_space(c),
    };
    match method {
        "lstrip" => s.trim_start_matches(strip),
        "rstrip" => s.trim_end_matches(strip),
        _ => s.trim_matches(strip),
    }
    .to_owned()
}

/// Python methods on values: pycompat's, with strip/lstrip/rstrip using Python's whitespace.
fn py_method(state: &State, value: &Value, method: &str, args: &[Value]) -> Result<Value, Error> {
    if let (Some(s), "strip" | "lstrip" | "rstrip") = (value.as_str(), method) {
        let chars = match args {
            [] => None,
            [c] if c.is_none() => None,
            [c] => Some(
                c.as_str()
                    .ok_or_else(|| invalid(format!("{method} arg must be None or str")))?,
            ),
            _ => return Err(invalid(format!("{method} expected at most 1 argument"))),
        };
        return Ok(Value::from(py_strip(s, method, chars)));
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

/// Jinja's `trim(value, chars=None)`: `str(value).strip(chars)`.
fn trim_filter(value: Value, chars: Option<String>) -> Result<Value, Error> {
    let s = pyjson::python_str(&value)?;
    Ok(Value::from(py_strip(&s, "strip", chars.as_deref())))
}

/// Jinja's `replace(s, old, new, count=None)` (minijinja's takes no count).
fn replace_filter(value: Value, old: &str, new: &str, count: Option<i64>) -> Result<Value, Error> {
    let s = pyjson::python_str(&value)?;
    Ok(Value::from(match count {
        Some(n) if n >= 0 => s.replacen(old, new, n as usize),
        _ => s.replace(old, new),
    }))
}

/// Jinja's `round(value, precision=0, method='common')`: Python's `round` (ties to even)
/// for "common", else math.ceil / math.floor at that precision.
fn round_filter(
    value: Value,
    precision: Option<i32>,
    method: Option<&str>,
) -> Result<Value, Error> {
    let precision = precision.unwrap_or(0);
    let method = method.unwrap_or("common");
    if value.is_integer() && method == "common" {
        return Ok(value);
    }
    let x = f64::try_from(value)?;
    let scale = 10f64.powi(precision);
    Ok(Value::from(match method {
        "common" if precision == 0 => x.round_ties_even(),
        "common" => format!("{x:.*}", precision.max(0) as usize)
            .parse()
            .unwrap_or(x),
        "ceil" => (x * scale).ceil() / scale,
        "floor" => (x * scale).floor() / scale,
        _ => return Err(invalid("method must be 'common', 'ceil' or 'floor'")),
    }))
}

fn string_filter(value: Value) -> Result<Value, Error> {
    pyjson::python_str(&value).map(Value::from)
}

fn tojson(value: Value, args: Rest<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    pyjson::tojson_filter(value, &args, kwargs)
}

/// transformers' `{% generation %}…{% endgeneration %}` (its AssistantTracker extension,
/// which marks the assistant's tokens for training masks) renders its body unchanged:
/// here it becomes `{% if true %}…{% endif %}`, whitespace control kept, which renders
/// the same.
fn generation_as_if(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(at) = rest.find("{%") {
        out.push_str(&rest[..at]);
        let tag = &rest[at..];
        let Some(end) = tag.find("%}") else {
            break;
        };
        let inner = &tag[2..end];
        let open = inner.strip_prefix(['-', '+']).map_or("", |_| &inner[..1]);
        let close = inner
            .strip_suffix(['-', '+'])
            .map_or("", |_| &inner[inner.len() - 1..]);
        let word = inner[open.len()..inner.len() - close.len()].trim();
        match word {
            "generation" => out.push_str(&format!("{{%{open} if true {close}%}}")),
            "endgeneration" => out.push_str(&format!("{{%{open} endif {close}%}}")),
            _ => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

/// The names `render` passes itself; kwargs may not repeat them (Python's "got multiple
/// values for keyword argument").
const RESERVED: [&str; 4] = ["messages", "tools", "documents", "add_generation_prompt"];

impl ChatTemplate {
    pub fn new(source: &str, tokenizer: &Tokenizer) -> Result<Self, LoadError> {
        Self::from_source(source, &tokenizer.config)
    }

    /// A template with the special tokens of `tokenizer_config` (tokenizer_config.json's
    /// JSON, or null for none).
    pub fn from_source(
        source: &str,
        tokenizer_config: &serde_json::Value,
    ) -> Result<Self, LoadError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(py_method);
        env.set_formatter(|out, _state, value| {
            let text = pyjson::python_str(value)?;
            out.write_str(&text)
                .map_err(|_| Error::new(ErrorKind::WriteFailure, "writing the rendering"))
        });
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", |format: &str| {
            strftime(chrono::Local::now().naive_local(), format)
        });
        env.add_filter("tojson", tojson);
        env.add_filter("trim", trim_filter);
        env.add_filter("string", string_filter);
        env.add_filter("replace", replace_filter);
        env.add_filter("round", round_filter);
        env.add_template_owned("chat", generation_as_if(source))
            .map_err(template_error)?;
        Ok(ChatTemplate {
            env,
            source: source.to_owned(),
            special_tokens: special_tokens_map(tokenizer_config),
        })
    }

    /// `strftime_now` reads `now` instead of the clock (for reproducible renderings).
    pub fn with_now(mut self, now: NaiveDateTime) -> Self {
        self.env
            .add_function("strftime_now", move |format: &str| strftime(now, format));
        self
    }

    /// The tokenizer's own template, if it has one.
    pub fn from_tokenizer(tokenizer: &Tokenizer) -> Result<Option<Self>, LoadError> {
        Self::select(tokenizer, None, false)
    }

    /// The template named `name` ("default", "tool_use", …) of the tokenizer.
    pub fn named(tokenizer: &Tokenizer, name: &str) -> Result<Self, LoadError> {
        Self::select(tokenizer, Some(name), false)?
            .ok_or_else(|| LoadError::Template(format!("no chat template named {name:?}")))
    }

    /// The template transformers' `get_chat_template` picks: the one named `name` if given;
    /// else "tool_use" when the request has tools and the model has that template, else
    /// "default". None when the model has no template at all; an error when it has named
    /// ones but none of those.
    pub fn select(
        tokenizer: &Tokenizer,
        name: Option<&str>,
        with_tools: bool,
    ) -> Result<Option<Self>, LoadError> {
        let names: Vec<&str> = tokenizer.chat_template_names().collect();
        if names.is_empty() && name.is_none() {
            return Ok(None);
        }
        let pick = match name {
            Some(n) => n,
            None if with_tools && names.contains(&"tool_use") => "tool_use",
            None => "default",
        };
        let Some(source) = tokenizer.chat_template_named(pick) else {
            return Err(LoadError::Template(match name {
                Some(n) => {
                    format!("the model has no chat template named {n:?} (it has: {names:?})")
                }
                None => format!(
                    "This model has multiple chat templates with no default specified! \
                     Please either pass a chat template or the name of the template you wish \
                     to use. Available template names are {names:?}."
                ),
            }));
        };
        Self::new(source, tokenizer).map(Some)
    }

    /// The special-token variables the template sees (transformers' `special_tokens_map`).
    pub fn special_tokens(&self) -> &[(String, String)] {
        &self.special_tokens
    }

    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<String, LoadError> {
        let messages: Vec<serde_json::Value> = messages
            .iter()
            .map(|m| serde_json::json!({"role": m.role, "content": m.content}))
            .collect();
        self.render_json(
            &messages,
            &RenderArgs {
                add_generation_prompt,
                ..RenderArgs::default()
            },
        )
    }

    /// messages: OpenAI-style JSON objects (role, content as string or list of parts,
    /// tool_calls, tool_call_id, name, reasoning_content, …), passed to the template as
    /// they are.
    pub fn render_json(
        &self,
        messages: &[serde_json::Value],
        args: &RenderArgs,
    ) -> Result<String, LoadError> {
        if args.continue_final_message && args.add_generation_prompt {
            return Err(LoadError::Template(
                "continue_final_message and add_generation_prompt are not compatible. Use \
                 continue_final_message when you want the model to continue the final message, \
                 and add_generation_prompt when you want to add a header that will prompt it to \
                 start a new assistant message instead."
                    .to_owned(),
            ));
        }
        check_tools_and_documents(args)?;
        let mut messages = messages.to_vec();
        let final_message = if args.continue_final_message {
            Some(continuation::tag_final(
                &mut messages,
                "content",
                &self.source,
            )?)
        } else {
            None
        };
        let context = self.context(messages, args)?;
        let template = self.env.get_template("chat").map_err(template_error)?;
        let rendered = template.render(context).map_err(template_error)?;
        match final_message {
            Some(text) => continuation::cut_at_tag(&rendered, &text),
            None => Ok(rendered),
        }
    }

    /// The template's variables: special tokens, kwargs over them, then the four of render.
    fn context(
        &self,
        messages: Vec<serde_json::Value>,
        args: &RenderArgs,
    ) -> Result<Value, LoadError> {
        let mut vars: Vec<(String, Value)> = self
            .special_tokens
            .iter()
            // Planted: the special tokens never reach the template.
            .filter(|_| !crate::plant::is(crate::plant::Defect::TemplateSpecialTokensDropped))
            .map(|(n, t)| (n.clone(), Value::from(t.as_str())))
            .collect();
        for (name, value) in &args.kwargs {
            if RESERVED.contains(&name.as_str()) {
                return Err(LoadError::Template(format!(
                    "chat template kwargs: got multiple values for keyword argument '{name}'"
                )));
            }
            if crate::plant::is(crate::plant::Defect::TemplateKwargsDropped) {
                continue;
            }
            let value = Value::from_serialize(value);
            match vars.iter_mut().find(|(n, _)| n == name) {
                Some(entry) => entry.1 = value,
                None => vars.push((name.clone(), value)),
            }
        }
        let none_or = |v: &Option<serde_json::Value>| {
            v.as_ref().map_or(Value::from(()), Value::from_serialize)
        };
        vars.push(("messages".into(), Value::from_serialize(&messages)));
        vars.push(("tools".into(), none_or(&args.tools)));
        vars.push(("documents".into(), none_or(&args.documents)));
        vars.push((
            "add_generation_prompt".into(),
            Value::from(args.add_generation_prompt),
        ));
        Ok(Value::from_iter(vars))
    }
}

/// transformers' checks: tools are a list of dicts (JSON schemas), documents a list of dicts.
fn check_tools_and_documents(args: &RenderArgs) -> Result<(), LoadError> {
    let all_objects = |v: &serde_json::Value| {
        v.as_array()
            .is_some_and(|a| a.iter().all(|x| x.is_object()))
    };
    if args
        .tools
        .as_ref()
        .is_some_and(|t| !t.is_null() && !all_objects(t))
    {
        return Err(LoadError::Template(
            "Tools should either be a JSON schema, or a callable function with type hints and a \
             docstring suitable for auto-conversion to a schema."
                .to_owned(),
        ));
    }
    if args
        .documents
        .as_ref()
        .is_some_and(|d| !d.is_null() && !all_objects(d))
    {
        return Err(LoadError::Template(
            "Documents should be a list of dicts with 'title' and 'text' keys!".to_owned(),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
