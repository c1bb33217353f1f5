//! Dataset formats: auto-detection from a row's columns, and conversion of
//! rows into [`Example`]s (text, prompt/completion, chat messages, or
//! pre-tokenised ids).

use crate::data::config::{ColumnMapping, Format};
use crate::data::template::ChatMessage;
use crate::data::DataError;
use serde_json::{Map, Value};

/// One row, in a format-independent shape.
#[derive(Debug, Clone, PartialEq)]
pub enum Example {
    /// Plain text; every token trained.
    Text {
        /// The document.
        text: String,
    },
    /// A prompt and its completion, concatenated without a template.
    PromptCompletion {
        /// Prompt text (masked when training on completions only).
        prompt: String,
        /// Completion text.
        completion: String,
    },
    /// A conversation rendered with the chat template.
    Chat {
        /// The turns.
        messages: Vec<ChatMessage>,
    },
    /// Already tokenised.
    Pretokenized {
        /// Token ids.
        input_ids: Vec<u32>,
        /// Labels (-100 = ignored); `None` = copy of `input_ids`.
        labels: Option<Vec<i64>>,
        /// 1 = real token, 0 = padding.
        attention_mask: Option<Vec<u32>>,
    },
}

impl Example {
    /// Whether the text that would be trained is empty or whitespace.
    pub fn is_blank(&self) -> bool {
        match self {
            Example::Text { text } => text.trim().is_empty(),
            Example::PromptCompletion { completion, .. } => completion.trim().is_empty(),
            Example::Chat { messages } => {
                messages.is_empty()
                    || messages
                        .iter()
                        .filter(|m| m.role == "assistant")
                        .all(|m| m.content.trim().is_empty())
            }
            Example::Pretokenized { input_ids, .. } => input_ids.is_empty(),
        }
    }
}

pub(crate) fn col<'a>(mapped: &'a Option<String>, default: &'a str) -> &'a str {
    mapped.as_deref().unwrap_or(default)
}

/// Prompt/completion column pairs recognised without a mapping.
const PAIRS: [(&str, &str); 5] = [
    ("prompt", "completion"),
    ("prompt", "response"),
    ("question", "answer"),
    ("query", "response"),
    ("input", "output"),
];

/// Detects the format of `row` (a JSON object) given the column mapping.
/// Returns `None` when nothing matches.
pub fn detect_format(row: &Value, cols: &ColumnMapping) -> Option<Format> {
    let obj = row.as_object()?;
    if obj.contains_key("input_ids") {
        return Some(Format::Pretokenized);
    }
    let msg_col = cols.messages.as_deref();
    for name in msg_col.into_iter().chain(["messages", "conversations"]) {
        if let Some(v) = obj.get(name) {
            return Some(detect_message_style(v, name == "conversations"));
        }
        if msg_col.is_some() {
            break;
        }
    }
    let instr = col(&cols.prompt, "instruction");
    let out = col(&cols.completion, "output");
    if obj.contains_key(instr) && obj.contains_key(out) {
        // Alpaca when the instruction column is alpaca's own (or alpaca-only
        // columns are mapped); any other mapped pair is prompt/completion.
        return Some(
            if instr == "instruction" || cols.input.is_some() || cols.history.is_some() {
                Format::Alpaca
            } else {
                Format::PromptCompletion
            },
        );
    }
    if cols.text.is_none() {
        for (p, c) in PAIRS {
            if obj.contains_key(p) && obj.contains_key(c) {
                return Some(Format::PromptCompletion);
            }
        }
    }
    if obj.contains_key(col(&cols.text, "text")) {
        return Some(Format::Text);
    }
    // A single string column (e.g. `Prompt`) is plain text.
    let strings: Vec<&String> = obj
        .iter()
        .filter(|(_, v)| v.is_string())
        .map(|(k, _)| k)
        .collect();
    if strings.len() == 1 {
        return Some(Format::Text);
    }
    None
}

fn detect_message_style(v: &Value, is_conversations: bool) -> Format {
    let v = parse_if_string(v);
    let first = v
        .as_array()
        .and_then(|a| a.first())
        .and_then(Value::as_object);
    match first {
        Some(m) if m.contains_key("from") || m.contains_key("value") => Format::ShareGpt,
        Some(m)
            if m.get("content").is_some_and(Value::is_array) || m.contains_key("loss_weight") =>
        {
            // Typed parts: v1 uses {type, value}; OpenAI-style {type, text} is chat.
            let parts_have_value = m
                .get("content")
                .and_then(Value::as_array)
                .and_then(|a| a.first())
                .is_some_and(|p| p.get("value").is_some());
            if parts_have_value || m.contains_key("loss_weight") {
                Format::LlamaFactoryV1
            } else {
                Format::Chat
            }
        }
        _ if is_conversations => Format::ShareGpt,
        _ => Format::Chat,
    }
}

/// CSV cells holding JSON lists (messages) arrive as strings.
pub(crate) fn parse_if_string(v: &Value) -> std::borrow::Cow<'_, Value> {
    if let Value::String(s) = v {
        let t = s.trim_start();
        if t.starts_with('[') || t.starts_with('{') {
            if let Ok(parsed) = serde_json::from_str::<Value>(s) {
                return std::borrow::Cow::Owned(parsed);
            }
        }
    }
    std::borrow::Cow::Borrowed(v)
}

/// Converts one row into an [`Example`]. `location` names the row in errors.
pub fn to_example(
    row: &Value,
    format: Format,
    cols: &ColumnMapping,
    location: &dyn Fn() -> String,
) -> Result<Example, DataError> {
    let obj = row.as_object().ok_or_else(|| DataError::BadRow {
        location: location(),
        message: "a row must be a JSON object".into(),
    })?;
    let r = Row { obj, location };
    match format {
        Format::Auto => {
            let f = detect_format(row, cols).ok_or_else(|| DataError::UnknownFormat {
                location: location(),
                columns: obj.keys().cloned().collect(),
            })?;
            to_example(row, f, cols, location)
        }
        Format::Text => text_example(&r, cols),
        Format::PromptCompletion => prompt_completion_example(&r, cols),
        Format::Alpaca => alpaca_example(&r, cols),
        Format::Chat | Format::ShareGpt | Format::LlamaFactoryV1 => chat_example(&r, cols, format),
        Format::Pretokenized => pretokenized_example(&r),
    }
}

/// One row being converted: its columns, and how its errors name it.
struct Row<'a> {
    obj: &'a serde_json::Map<String, Value>,
    location: &'a dyn Fn() -> String,
}

impl Row<'_> {
    /// A malformed row.
    fn bad(&self, message: String) -> DataError {
        DataError::BadRow {
            location: (self.location)(),
            message,
        }
    }

    /// A column the format needs is not there; `setting` is the one that renames it.
    fn missing(&self, column: &str, setting: &str) -> DataError {
        DataError::MissingColumn {
            location: (self.location)(),
            column: column.to_string(),
            setting: setting.to_string(),
            available: self.obj.keys().cloned().collect(),
        }
    }

    /// A column that must be there, as text.
    fn get_str(&self, name: &str, setting: &str) -> Result<String, DataError> {
        match self.obj.get(name) {
            None => Err(self.missing(name, setting)),
            Some(v) => value_to_text(v).ok_or_else(|| {
                self.bad(format!("column {name:?} must be text, found {}", kind(v)))
            }),
        }
    }

    /// A column that may be missing or null, as text.
    fn opt_str(&self, name: &str) -> Result<Option<String>, DataError> {
        match self.obj.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => value_to_text(v).map(Some).ok_or_else(|| {
                self.bad(format!("column {name:?} must be text, found {}", kind(v)))
            }),
        }
    }

    /// Puts the row's system column first in `msgs`, unless empty or a system turn leads.
    fn add_system(
        &self,
        cols: &ColumnMapping,
        msgs: &mut Vec<ChatMessage>,
    ) -> Result<(), DataError> {
        let name = col(&cols.system, "system");
        if let Some(s) = self.opt_str(name)? {
            if !s.is_empty() && msgs.first().is_none_or(|m| m.role != "system") {
                msgs.insert(0, ChatMessage::new("system", s));
            }
        }
        Ok(())
    }
}

/// `text`: the mapped column, else `text`, else the row's only string column.
fn text_example(r: &Row, cols: &ColumnMapping) -> Result<Example, DataError> {
    let name = match &cols.text {
        Some(t) => t.clone(),
        None if r.obj.contains_key("text") => "text".into(),
        None => {
            let strings: Vec<&String> = r
                .obj
                .iter()
                .filter(|(_, v)| v.is_string())
                .map(|(k, _)| k)
                .collect();
            match strings.as_slice() {
                [only] => (*only).clone(),
                _ => "text".into(),
            }
        }
    };
    Ok(Example::Text {
        text: r.get_str(&name, "data.columns.text")?,
    })
}

/// `prompt-completion`: the mapped pair, else the first known pair of column names; lists of
/// messages on both sides make it chat.
fn prompt_completion_example(r: &Row, cols: &ColumnMapping) -> Result<Example, DataError> {
    let (p, c) = match (&cols.prompt, &cols.completion) {
        (Some(p), Some(c)) => (p.clone(), c.clone()),
        _ => PAIRS
            .iter()
            .find(|(p, c)| r.obj.contains_key(*p) && r.obj.contains_key(*c))
            .map(|(p, c)| (p.to_string(), c.to_string()))
            .unwrap_or_else(|| {
                (
                    col(&cols.prompt, "prompt").to_string(),
                    col(&cols.completion, "completion").to_string(),
                )
            }),
    };
    let pv = r
        .obj
        .get(&p)
        .ok_or_else(|| r.missing(&p, "data.columns.prompt"))?;
    let cv = r
        .obj
        .get(&c)
        .ok_or_else(|| r.missing(&c, "data.columns.completion"))?;
    // Conversational prompt/completion (lists of messages) is chat.
    if pv.is_array() && cv.is_array() {
        let bad = |m| r.bad(m);
        let mut msgs = parse_messages(pv, false, &bad)?;
        msgs.extend(parse_messages(cv, false, &bad)?);
        return Ok(Example::Chat { messages: msgs });
    }
    Ok(Example::PromptCompletion {
        prompt: r.get_str(&p, "data.columns.prompt")?,
        completion: r.get_str(&c, "data.columns.completion")?,
    })
}

/// `alpaca`: instruction (+ input) → output, after the history's turns, with the system column.
fn alpaca_example(r: &Row, cols: &ColumnMapping) -> Result<Example, DataError> {
    let instruction = r.get_str(col(&cols.prompt, "instruction"), "data.columns.prompt")?;
    let input = r.opt_str(col(&cols.input, "input"))?.unwrap_or_default();
    let output = r.get_str(col(&cols.completion, "output"), "data.columns.completion")?;
    let mut msgs = Vec::new();
    if let Some(h) = r.obj.get(col(&cols.history, "history")) {
        alpaca_history(r, &parse_if_string(h), &mut msgs)?;
    }
    let user = if input.is_empty() {
        instruction
    } else {
        format!("{instruction}\n{input}")
    };
    msgs.push(ChatMessage::new("user", user));
    msgs.push(ChatMessage::new("assistant", output));
    r.add_system(cols, &mut msgs)?;
    Ok(Example::Chat { messages: msgs })
}

/// An alpaca `history` (a list of `[user, assistant]` pairs, or null) as chat turns.
fn alpaca_history(r: &Row, h: &Value, msgs: &mut Vec<ChatMessage>) -> Result<(), DataError> {
    match h {
        Value::Null => {}
        Value::Array(turns) => {
            for t in turns {
                let pair = t.as_array().filter(|p| p.len() == 2).ok_or_else(|| {
                    r.bad("`history` must be a list of [user, assistant] pairs".into())
                })?;
                let (Some(u), Some(a)) = (value_to_text(&pair[0]), value_to_text(&pair[1])) else {
                    return Err(r.bad("`history` pairs must hold text".into()));
                };
                msgs.push(ChatMessage::new("user", u));
                msgs.push(ChatMessage::new("assistant", a));
            }
        }
        other => {
            return Err(r.bad(format!(
                "`history` must be a list of [user, assistant] pairs, found {}",
                kind(other)
            )))
        }
    }
    Ok(())
}

/// `chat`, `sharegpt` and LLaMA-Factory v1: a list of messages, with the system column.
fn chat_example(r: &Row, cols: &ColumnMapping, format: Format) -> Result<Example, DataError> {
    let default = if format == Format::ShareGpt && !r.obj.contains_key("messages") {
        "conversations"
    } else {
        "messages"
    };
    let name = col(&cols.messages, default);
    let v = r
        .obj
        .get(name)
        .ok_or_else(|| r.missing(name, "data.columns.messages"))?;
    let mut msgs = parse_messages(v, format == Format::ShareGpt, &|m| r.bad(m))?;
    r.add_system(cols, &mut msgs)?;
    Ok(Example::Chat { messages: msgs })
}

/// `pretokenized`: `input_ids`, with optional `labels` and `attention_mask` of the same length.
fn pretokenized_example(r: &Row) -> Result<Example, DataError> {
    let bad = |m| r.bad(m);
    let ids_v = r
        .obj
        .get("input_ids")
        .ok_or_else(|| r.missing("input_ids", "data.format = \"pretokenized\""))?;
    let input_ids = int_list(ids_v, "input_ids", &bad)?
        .into_iter()
        .map(|x| {
            u32::try_from(x).map_err(|_| {
                bad(format!(
                    "input_ids holds {x}, which is not a token id (0..2^32)"
                ))
            })
        })
        .collect::<Result<Vec<u32>, _>>()?;
    let labels = match r.obj.get("labels") {
        None | Some(Value::Null) => None,
        Some(v) => Some(int_list(v, "labels", &bad)?),
    };
    let attention_mask = match r.obj.get("attention_mask") {
        None | Some(Value::Null) => None,
        Some(v) => Some(
            int_list(v, "attention_mask", &bad)?
                .into_iter()
                .map(|x| u32::from(x != 0))
                .collect::<Vec<u32>>(),
        ),
    };
    for (name, n) in [
        ("labels", labels.as_ref().map(Vec::len)),
        ("attention_mask", attention_mask.as_ref().map(Vec::len)),
    ] {
        if let Some(n) = n {
            if n != input_ids.len() {
                return Err(bad(format!(
                    "{name} has {n} entries but input_ids has {}; they must be the same length",
                    input_ids.len()
                )));
            }
        }
    }
    Ok(Example::Pretokenized {
        input_ids,
        labels,
        attention_mask,
    })
}

fn int_list(
    v: &Value,
    name: &str,
    bad: &dyn Fn(String) -> DataError,
) -> Result<Vec<i64>, DataError> {
    let v = parse_if_string(v);
    let arr = v.as_array().ok_or_else(|| {
        bad(format!(
            "{name} must be a list of integers, found {}",
            kind(&v)
        ))
    })?;
    arr.iter()
        .map(|x| {
            x.as_i64()
                .or_else(|| x.as_f64().filter(|f| f.fract() == 0.0).map(|f| f as i64))
                .ok_or_else(|| bad(format!("{name} must hold integers, found {x}")))
        })
        .collect()
}

/// Text from a string, number or bool cell (CSV numbers arrive as strings;
/// Parquet/JSON numbers are accepted as their text).
pub(crate) fn value_to_text(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        Value::Bool(b) => Some(b.to_string()),
        Value::Null => Some(String::new()),
        _ => None,
    }
}

pub(crate) fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "text",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

fn sharegpt_role(from: &str) -> String {
    match from {
        "human" | "user" => "user",
        "gpt" | "assistant" | "model" | "bot" | "chatgpt" | "bing" | "bard" | "function_call" => {
            "assistant"
        }
        "system" => "system",
        "observation" | "function" | "tool" => "tool",
        other => other,
    }
    .to_string()
}

/// Parses a list of messages: `{role, content}` (content a string, null,
/// or typed parts `{type: "text", text|value}`), or ShareGPT `{from, value}`.
pub(crate) fn parse_messages(
    v: &Value,
    sharegpt: bool,
    bad: &dyn Fn(String) -> DataError,
) -> Result<Vec<ChatMessage>, DataError> {
    let v = parse_if_string(v);
    let list = v.as_array().ok_or_else(|| {
        bad(format!(
            "messages must be a list of turns, found {}",
            kind(&v)
        ))
    })?;
    let mut out = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let m = m
            .as_object()
            .ok_or_else(|| bad(format!("turn {i} must be an object, found {}", kind(m))))?;
        let role_raw = m
            .get("role")
            .or_else(|| m.get("from"))
            .and_then(Value::as_str)
            .ok_or_else(|| bad(format!("turn {i} has no `role` (or ShareGPT `from`)")))?;
        let role = if sharegpt || m.contains_key("from") {
            sharegpt_role(role_raw)
        } else {
            role_raw.to_string()
        };
        let content_v = m
            .get("content")
            .or_else(|| m.get("value"))
            .unwrap_or(&Value::Null);
        let content =
            content_text(content_v).map_err(|why| bad(format!("turn {i} ({role}): {why}")))?;
        let loss_weight = match m.get("loss_weight") {
            None | Some(Value::Null) => None,
            Some(w) => Some(
                w.as_f64()
                    .filter(|w| *w >= 0.0 && w.is_finite())
                    .ok_or_else(|| {
                        bad(format!(
                            "turn {i}: loss_weight must be a non-negative number, found {w}"
                        ))
                    })? as f32,
            ),
        };
        let mut extra = Map::new();
        for (k, val) in m {
            if !matches!(
                k.as_str(),
                "role" | "from" | "content" | "value" | "loss_weight"
            ) {
                extra.insert(k.clone(), val.clone());
            }
        }
        out.push(ChatMessage {
            role,
            content,
            loss_weight,
            extra,
        });
    }
    Ok(out)
}

fn content_text(v: &Value) -> Result<String, String> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Null => Ok(String::new()),
        Value::Array(parts) => {
            let mut s = String::new();
            for p in parts {
                match p {
                    Value::String(t) => s.push_str(t),
                    Value::Object(o) => {
                        let ty = o.get("type").and_then(Value::as_str).unwrap_or("text");
                        if ty != "text" {
                            return Err(format!(
                                "content part of type {ty:?} is not supported (text only)"
                            ));
                        }
                        let t = o
                            .get("value")
                            .or_else(|| o.get("text"))
                            .and_then(Value::as_str)
                            .ok_or("a text part needs `value` or `text`")?;
                        s.push_str(t);
                    }
                    _ => return Err("content parts must be objects".into()),
                }
            }
            Ok(s)
        }
        other => Err(format!(
            "content must be text or a list of parts, found {}",
            kind(other)
        )),
    }
}

#[cfg(test)]
mod tests;
