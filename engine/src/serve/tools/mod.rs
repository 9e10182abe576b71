//! Tool calling and reasoning as mlx_lm.server 0.32.2 does them: which markers a model
//! uses (`_infer_thinking`, `_infer_tool_parser` in mlx_lm/tokenizer_utils.py), the state
//! machine that splits generated text into reasoning, tool-call text and content
//! (`machine`), the tool-call formats and their parsers (`formats`: one table, one file
//! per parsed format), the typed call (`call`), and one request's output side (`split`:
//! what each streamed chunk carries, `finish_reason: "tool_calls"`).

pub mod call;
pub mod formats;
pub mod literal;
pub mod machine;
pub mod split;
pub mod strict;
pub mod value;

#[cfg(test)]
mod cases;

use serde_json::Value;

use crate::load::tokenizer::Tokenizer;
use machine::{Machine, State};
use value::{PyValue, ValueError};

/// The tool-call formats of mlx-lm 0.32.2 (`mlx_lm/tool_parsers/`); each is a row of
/// `formats::FORMATS`, in this order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    JsonTools,
    Qwen3Coder,
    Gemma4,
    FunctionGemma,
    Mistral,
    Pythonic,
    MinimaxM2,
    Longcat,
    Glm47,
    Laguna,
    KimiK2,
    KimiK3,
    Minicpm5,
    MuseSpark,
}

impl Family {
    /// Its row in `formats::FORMATS`.
    pub fn format(self) -> &'static formats::Format {
        &formats::FORMATS[self as usize]
    }

    /// Its module name in mlx_lm.tool_parsers (tokenizer_config.json's `tool_parser_type`).
    pub fn name(self) -> &'static str {
        self.format().name
    }

    pub fn from_name(name: &str) -> Option<Self> {
        formats::FORMATS
            .iter()
            .find(|f| f.name == name)
            .map(|f| f.family)
    }

    /// The markers around a tool call (`tool_call_start`, `tool_call_end`; "" for none).
    pub fn markers(self) -> (&'static str, &'static str) {
        self.format().markers
    }

    /// Whether this engine parses the format (the others are refused when a request
    /// brings tools).
    pub fn supported(self) -> bool {
        self.format().parser.is_some()
    }

    /// The family's `parse_tool_call(text, tools)`: the calls in one tool-call text.
    pub fn parse(self, text: &str, tools: Option<&Value>) -> Result<Vec<PyValue>, ValueError> {
        match self.format().parser {
            Some(p) => p.parse(text, tools),
            None => value::err(format!(
                "the {} tool-call format is not supported by this engine",
                self.name()
            )),
        }
    }
}

/// `_is_xtml_vocab`.
fn xtml_vocab(has: &dyn Fn(&str) -> bool) -> bool {
    ["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"]
        .iter()
        .all(|t| has(t))
}

/// `_infer_tool_parser`: from the chat template's text first, then the vocabulary.
pub fn infer_family(template: Option<&str>, has: &dyn Fn(&str) -> bool) -> Option<Family> {
    if let Some(t) = template {
        let by_text = [
            (t.contains("<minimax:tool_call>"), Family::MinimaxM2),
            (
                t.contains("<|tool_call>") && t.contains("<tool_call|>"),
                Family::Gemma4,
            ),
            (t.contains("<start_function_call>"), Family::FunctionGemma),
            (t.contains("<longcat_tool_call>"), Family::Longcat),
            (t.contains("<arg_key>"), Family::Glm47),
            (
                t.contains("<|tool_list_start|>") || t.contains("<|tool_call_start|>"),
                Family::Pythonic,
            ),
            (
                t.contains("<tool_call>\\n<function=") || t.contains("<tool_call>\n<function="),
                Family::Qwen3Coder,
            ),
            (t.contains("<|tool_calls_section_begin|>"), Family::KimiK2),
            (
                t.contains("<function name=\"") && t.contains("<param name=\""),
                Family::Minicpm5,
            ),
            (t.contains("[TOOL_CALLS]"), Family::Mistral),
            (t.contains("<atem:function_calls>"), Family::MuseSpark),
            (
                t.contains("<tool_call>") && t.contains("tool_call.name"),
                Family::JsonTools,
            ),
        ];
        if let Some((_, f)) = by_text.into_iter().find(|(hit, _)| *hit) {
            return Some(f);
        }
    }
    if xtml_vocab(has) {
        Some(Family::KimiK3)
    } else if has("<|tool_call_start|>") && has("<|tool_call_end|>") {
        Some(Family::Pythonic)
    } else {
        None
    }
}

/// A model's reasoning markers (`_infer_thinking`) and their token ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Thinking {
    pub start: String,
    pub end: String,
    pub start_ids: Vec<u32>,
    pub end_ids: Vec<u32>,
}

/// `_infer_thinking`: single-token pairs found in the vocabulary first, then Gemma 4's
/// channel markers and the xtml ones (several tokens each, as the tokenizer encodes them).
pub fn infer_thinking(tokenizer: &Tokenizer) -> Option<Thinking> {
    for (start, end) in [
        ("<think>", "</think>"),
        ("<longcat_think>", "</longcat_think>"),
        ("<|think:start|>", "<|think:end|>"),
    ] {
        if let (Some(s), Some(e)) = (tokenizer.token_to_id(start), tokenizer.token_to_id(end)) {
            return Some(Thinking {
                start: start.into(),
                end: end.into(),
                start_ids: vec![s],
                end_ids: vec![e],
            });
        }
    }
    let has = |t: &str| tokenizer.token_to_id(t).is_some();
    let (start, end) = if has("<|channel>") && has("<channel|>") {
        ("<|channel>thought", "<channel|>")
    } else if xtml_vocab(&has) {
        ("<|open|>think<|sep|>", "<|close|>think<|sep|>")
    } else {
        return None;
    };
    let ids = |t: &str| tokenizer.encode(t, false).unwrap_or_default();
    Some(Thinking {
        start: start.into(),
        end: end.into(),
        start_ids: ids(start),
        end_ids: ids(end),
    })
}

/// Why a model's markers could not be worked out.
#[derive(Debug, thiserror::Error)]
pub enum MarkerError {
    #[error(
        "tokenizer_config.json names tool_parser_type `{0}`, which is not one of mlx-lm \
         0.32.2's tool parsers"
    )]
    UnknownParser(String),
}

/// What a model emits around reasoning and tool calls, worked out once at load.
#[derive(Debug, Clone, Default)]
pub struct Markers {
    pub thinking: Option<Thinking>,
    pub tools: Option<Family>,
    /// `_infer_structural_markers` (xtml vocabularies): cut out of the content.
    pub structural: Vec<&'static str>,
}

impl Markers {
    /// A request's sampler on the model thread (either lane): its settings, its grammar,
    /// and its thinking budget over these thinking markers (none when the model has none:
    /// then it writes no thinking block to close).
    pub fn sampler(
        &self,
        request: &super::request::GenRequest,
        tokenizer: &std::sync::Arc<crate::load::tokenizer::Tokenizer>,
    ) -> Result<crate::generate::sampler::Sampler, String> {
        use crate::generate::budget::ThinkBudget;
        let s = crate::generate::sampler::Sampler::new(request.sampling.clone())
            .map_err(|e| e.to_string())?;
        let s = crate::generate::sampler::constrain(s, tokenizer, request.constraint.as_ref())?;
        let budget = request.think_budget.zip(self.thinking.as_ref());
        Ok(s.with_budget(budget.map(|(budget, t)| ThinkBudget {
            start_ids: t.start_ids.clone(),
            end_ids: t.end_ids.clone(),
            budget: budget.max(1),
        })))
    }

    /// As mlx-lm's tokenizer `load` works them out: `tool_parser_type` from
    /// tokenizer_config.json, else inferred from `template` (the one chat template
    /// transformers exposes as a string: `--chat-template`, or the model's only one).
    pub fn detect(tokenizer: &Tokenizer, template: Option<&str>) -> Result<Self, MarkerError> {
        let has = |t: &str| tokenizer.token_to_id(t).is_some();
        let tools = match tokenizer
            .config
            .get("tool_parser_type")
            .and_then(Value::as_str)
        {
            Some(name) => Some(
                Family::from_name(name).ok_or_else(|| MarkerError::UnknownParser(name.into()))?,
            ),
            None => infer_family(template, &has),
        };
        let structural = if xtml_vocab(&has) {
            vec![
                "<|open|>response<|sep|>",
                "<|close|>response<|sep|>",
                "<|close|>message<|sep|>",
            ]
        } else {
            Vec::new()
        };
        Ok(Markers {
            thinking: infer_thinking(tokenizer),
            tools,
            structural,
        })
    }

    /// The template's thinking switch (`enable_thinking`) defaults to whether the model
    /// has thinking markers, as TokenizerWrapper.apply_chat_template passes it.
    pub fn thinking_default(&self) -> bool {
        self.thinking.is_some()
    }

    /// `make_text_state_machine` (without stop words: the stop matcher before it cuts
    /// them).
    pub fn machine(&self) -> Machine {
        let mut normal: Vec<(String, State)> = Vec::new();
        let mut reasoning: Vec<(String, State)> = Vec::new();
        let mut tool: Vec<(String, State)> = Vec::new();
        if let Some(t) = &self.thinking {
            normal.push((t.start.clone(), State::Reasoning));
            reasoning.push((t.end.clone(), State::Normal));
        }
        if let Some(f) = self.tools {
            let (start, end) = f.markers();
            normal.push((start.into(), State::Tool));
            if self.thinking.is_some() {
                reasoning.push((start.into(), State::Tool));
            }
            if !end.is_empty() {
                tool.push((end.into(), State::Normal));
            }
        }
        for w in &self.structural {
            normal.push(((*w).into(), State::Normal));
        }
        Machine::new(&[
            (State::Normal, normal),
            (State::Reasoning, reasoning),
            (State::Tool, tool),
        ])
    }

    /// The state generation starts in: reasoning when the prompt's last thinking start
    /// comes after its last thinking end (the template opened a think block).
    pub fn initial_state(&self, prompt: &[u32]) -> State {
        let Some(t) = &self.thinking else {
            return State::Normal;
        };
        let rfind = |seq: &[u32]| -> Option<usize> {
            if seq.is_empty() || seq.len() > prompt.len() {
                return None;
            }
            (0..=prompt.len() - seq.len())
                .rev()
                .find(|&i| prompt[i..].starts_with(seq))
        };
        match (rfind(&t.start_ids), rfind(&t.end_ids)) {
            (Some(_), None) => State::Reasoning,
            (Some(s), Some(e)) if s > e => State::Reasoning,
            _ => State::Normal,
        }
    }
}
