//! Chat templates: the model's Jinja template (`Tokenizer::chat_template`), rendered with minijinja
//! configured like transformers' sandbox (trim_blocks, lstrip_blocks, loop controls,
//! Python string methods, `raise_exception`) so the text equals `apply_chat_template`'s.

use minijinja::{Environment, ErrorKind, Value};
use serde::Serialize;

use super::tokenizer::Tokenizer;
use super::LoadError;

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

pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

fn raise_exception(message: String) -> Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
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

impl ChatTemplate {
    pub fn new(source: &str, tokenizer: &Tokenizer) -> Result<Self, LoadError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned("chat", generation_as_if(source))
            .map_err(|e| LoadError::Template(e.to_string()))?;
        Ok(ChatTemplate {
            env,
            bos_token: tokenizer.bos_token.clone(),
            eos_token: tokenizer.eos_token.clone(),
        })
    }

    /// The tokenizer's own template, if it has one.
    pub fn from_tokenizer(tokenizer: &Tokenizer) -> Result<Option<Self>, LoadError> {
        tokenizer
            .chat_template()
            .map(|source| Self::new(source, tokenizer))
            .transpose()
    }

    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<String, LoadError> {
        let template = self
            .env
            .get_template("chat")
            .map_err(|e| LoadError::Template(e.to_string()))?;
        template
            .render(minijinja::context! {
                messages => messages,
                // As apply_chat_template passes them without tools or documents: None, so
                // `tools is not none` is false (an undefined value is not none).
                tools => Value::from(()),
                documents => Value::from(()),
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos_token,
                eos_token => self.eos_token,
            })
            .map_err(|e| LoadError::Template(e.to_string()))
    }
}
