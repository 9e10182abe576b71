//! `continue_final_message` as transformers' `render_jinja_template` does it: a tag is
//! appended to the final message's text before rendering, and the rendering is cut where
//! the tag lands, so the model continues that message (no end-of-turn after it).

use serde_json::Value;

use super::LoadError;

const TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

fn error(message: impl Into<String>) -> LoadError {
    LoadError::Template(message.into())
}

/// Python's `str.isspace` (Rust's `char::is_whitespace` plus the four information
/// separators U+001C..U+001F).
pub fn is_py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

pub fn py_strip(s: &str) -> &str {
    s.trim_matches(is_py_space)
}

/// Tags the final message (its `field`, "content" unless transformers was given a field
/// name) in `messages`; returns the text it had, which the rendering must contain.
pub fn tag_final(messages: &mut [Value], field: &str, source: &str) -> Result<String, LoadError> {
    let last = messages.last_mut().ok_or_else(|| {
        error("continue_final_message is set but there are no messages to continue")
    })?;
    let final_message = match last.get_mut(field) {
        None | Some(Value::Null) => {
            return Err(error(format!(
            "continue_final_message is set but the final message has no \"{field}\" to continue!"
        )))
        }
        Some(v) => v,
    };
    if !source.contains(field) {
        return Err(error(format!(
            "continue_final_message is set to \"{field}\" but this is not an accepted field in the chat_template"
        )));
    }
    match final_message {
        Value::Array(blocks) => {
            for block in blocks.iter_mut().rev() {
                if let Some(text) = block.get_mut("text") {
                    let Value::String(s) = text else {
                        return Err(error("continue_final_message: the final text block's \"text\" is not a string"));
                    };
                    let original = s.clone();
                    s.push_str(TAG);
                    return Ok(original);
                }
            }
            Err(error(
                "continue_final_message is set but we could not find any text to continue in the final message!",
            ))
        }
        Value::String(s) => {
            let original = s.clone();
            s.push_str(TAG);
            Ok(original)
        }
        other => Err(error(format!(
            "continue_final_message: the final message's \"{field}\" is neither text nor a list of parts: {other}"
        ))),
    }
}

/// Cuts `rendered` at the tag: before it where the template kept the tag whole, else before
/// it with trailing whitespace removed (the template trimmed the message's end).
pub fn cut_at_tag(rendered: &str, final_message: &str) -> Result<String, LoadError> {
    let tag = py_strip(TAG);
    if !rendered.contains(py_strip(final_message)) || !rendered.contains(tag) {
        return Err(error(format!(
            "continue_final_message is set but the final message does not appear in the chat after \
             applying the chat template! This can happen if the chat template deletes portions of \
             the final message. Please verify the chat template and final message in your chat to \
             ensure they are compatible.Final message to continue: {}\nRendered chat:\n{rendered}",
            py_strip(final_message)
        )));
    }
    let at = rendered.rfind(tag).expect("the tag is in the rendering");
    Ok(if rendered[at..].starts_with(TAG) {
        rendered[..at].to_owned()
    } else {
        rendered[..at].trim_end_matches(is_py_space).to_owned()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_the_last_text_part_and_cuts_there() {
        let mut messages = vec![serde_json::json!({
            "role": "assistant",
            "content": [{"type": "text", "text": "a"}, {"type": "image"}, {"type": "text", "text": "Sure, "}],
        })];
        let original = tag_final(&mut messages, "content", "{{ m.content }}").unwrap();
        assert_eq!(original, "Sure, ");
        assert_eq!(
            messages[0]["content"][2]["text"],
            "Sure, CONTINUE_FINAL_MESSAGE_TAG "
        );
        assert_eq!(
            cut_at_tag("<a>Sure, CONTINUE_FINAL_MESSAGE_TAG </a>", &original).unwrap(),
            "<a>Sure, "
        );
        // A template that trims the message's end: the cut drops the trailing space too.
        assert_eq!(
            cut_at_tag("<a>Sure, CONTINUE_FINAL_MESSAGE_TAG</a>", &original).unwrap(),
            "<a>Sure,"
        );
    }

    #[test]
    fn errors_say_what_is_missing() {
        let mut none = vec![serde_json::json!({"role": "assistant", "content": null})];
        let e = tag_final(&mut none, "content", "content")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("the final message has no \"content\" to continue!"),
            "{e}"
        );
        let mut no_text = vec![serde_json::json!({"role": "user", "content": [{"type": "image"}]})];
        let e = tag_final(&mut no_text, "content", "content")
            .unwrap_err()
            .to_string();
        assert!(e.contains("could not find any text to continue"), "{e}");
        let mut fine = vec![serde_json::json!({"role": "user", "content": "x"})];
        let e = tag_final(&mut fine, "content", "{{ messages }}")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("not an accepted field in the chat_template"),
            "{e}"
        );
        let e = cut_at_tag("dropped", "hello").unwrap_err().to_string();
        assert!(e.contains("does not appear in the chat"), "{e}");
    }
}
