//! Which prompt-only format a GRPO row is in, told from its columns, and the prompt it holds.

use crate::data::config::ColumnMapping;
use crate::data::formats::{col, kind, parse_if_string, parse_messages, value_to_text};
use crate::data::template::ChatMessage;
use crate::data::DataError;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// A prompt-only dataset format, as users of TRL's `GRPOTrainer` and LLaMA-Factory have them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PromptFormat {
    /// TRL's `prompt` column as text: tokenised as it is, with no chat template (TRL's
    /// non-conversational data).
    PromptText,
    /// TRL's `prompt` column as a list of messages (`[{role, content}]`): rendered with the
    /// chat template and the generation prompt (TRL's conversational data).
    PromptMessages,
    /// A `messages` (or LLaMA-Factory `conversations`) column: a conversation whose trailing
    /// assistant turn, the reference answer, is dropped.
    Messages,
    /// LLaMA-Factory alpaca: `instruction`, then `input` after a "\n" when there is one, as one
    /// user message.
    Instruction,
    /// GSM8K-style `question` (or MATH-style `problem`) as one user message.
    Question,
}

impl PromptFormat {
    /// Every format, in detection order.
    pub const ALL: [PromptFormat; 5] = [
        PromptFormat::PromptText,
        PromptFormat::PromptMessages,
        PromptFormat::Messages,
        PromptFormat::Instruction,
        PromptFormat::Question,
    ];

    /// The name used in messages.
    pub fn name(self) -> &'static str {
        match self {
            PromptFormat::PromptText => "prompt_text",
            PromptFormat::PromptMessages => "prompt_messages",
            PromptFormat::Messages => "messages",
            PromptFormat::Instruction => "instruction",
            PromptFormat::Question => "question",
        }
    }

    /// Whether prompts are rendered with the chat template.
    pub fn is_chat(self) -> bool {
        self != PromptFormat::PromptText
    }
}

impl std::fmt::Display for PromptFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What one row asks the model: text (tokenised as it is) or turns (rendered by the template).
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Prompt {
    Text(String),
    Chat(Vec<ChatMessage>),
}

impl Prompt {
    /// Whether nothing but whitespace is asked (system turns aside).
    pub(crate) fn is_blank(&self) -> bool {
        match self {
            Prompt::Text(t) => t.trim().is_empty(),
            Prompt::Chat(m) => m
                .iter()
                .filter(|m| m.role != "system")
                .all(|m| m.content.trim().is_empty()),
        }
    }
}

/// A list of turns (`{role, content}` or `{from, value}`), not any list: `[1, 2]` is not one.
fn is_messages(v: &Value) -> bool {
    v.as_array().is_some_and(|items| {
        !items.is_empty()
            && items.iter().all(|m| {
                m.as_object()
                    .is_some_and(|o| o.contains_key("role") || o.contains_key("from"))
            })
    })
}

/// TRL's prompt column: messages (a JSON text of them too, as CSV cells hold them) or text.
fn prompt_kind(v: &Value) -> PromptFormat {
    if is_messages(&parse_if_string(v)) {
        PromptFormat::PromptMessages
    } else {
        PromptFormat::PromptText
    }
}

/// The conversation column: the mapped one, else `messages`, else `conversations`.
fn messages_column<'a>(obj: &Map<String, Value>, cols: &'a ColumnMapping) -> Option<&'a str> {
    match cols.messages.as_deref() {
        Some(m) => obj.contains_key(m).then_some(m),
        None => ["messages", "conversations"]
            .into_iter()
            .find(|c| obj.contains_key(*c)),
    }
}

/// The question column: `question`, else `problem`.
fn question_column(obj: &Map<String, Value>) -> Option<&'static str> {
    ["question", "problem"]
        .into_iter()
        .find(|c| obj.contains_key(*c))
}

/// Whether a mapped prompt column is alpaca's instruction rather than TRL's prompt.
fn mapped_is_instruction(name: &str, cols: &ColumnMapping) -> bool {
    name == "instruction" || cols.input.is_some()
}

/// Detects the prompt format of `row` (a JSON object); `None` when it holds no prompt, or a
/// mapped column is missing.
///
/// A mapped column comes first (`data.columns.prompt`: TRL's prompt, or alpaca's instruction
/// when it is named `instruction` or `data.columns.input` is mapped beside it;
/// `data.columns.messages`); then TRL's `prompt`, a conversation, an alpaca `instruction`,
/// and a `question` or `problem`.
pub fn detect_prompt_format(row: &Value, cols: &ColumnMapping) -> Option<PromptFormat> {
    let obj = row.as_object()?;
    if let Some(p) = cols.prompt.as_deref() {
        let v = obj.get(p)?;
        return Some(if mapped_is_instruction(p, cols) {
            PromptFormat::Instruction
        } else {
            prompt_kind(v)
        });
    }
    if cols.messages.is_some() {
        return messages_column(obj, cols).map(|_| PromptFormat::Messages);
    }
    if let Some(v) = obj.get("prompt") {
        return Some(prompt_kind(v));
    }
    if messages_column(obj, cols).is_some() {
        return Some(PromptFormat::Messages);
    }
    if obj.contains_key("instruction") {
        return Some(PromptFormat::Instruction);
    }
    question_column(obj).map(|_| PromptFormat::Question)
}

/// The error for a first row whose format cannot be told: the mapped column that is missing,
/// or the columns found and the ones a GRPO dataset needs.
pub(crate) fn unknown_format(row: &Value, cols: &ColumnMapping, location: String) -> DataError {
    let available: Vec<String> = row
        .as_object()
        .map(|o| o.keys().cloned().collect())
        .unwrap_or_default();
    for (mapped, setting) in [
        (&cols.prompt, "data.columns.prompt"),
        (&cols.messages, "data.columns.messages"),
    ] {
        if let Some(name) = mapped
            .as_deref()
            .filter(|n| !available.iter().any(|a| a == n))
        {
            return DataError::MissingColumn {
                location,
                column: name.to_string(),
                setting: setting.to_string(),
                available,
            };
        }
    }
    let found = if row.is_object() {
        format!("columns [{}]", available.join(", "))
    } else {
        format!("{} instead of a JSON object", kind(row))
    };
    DataError::BadRow {
        location,
        message: format!(
            "cannot find a GRPO prompt in {found}; a GRPO dataset needs a `prompt` column (text or messages), `messages`, `instruction` or `question` (answer columns such as `answer` or `solution` may sit beside it), or name yours with `data.columns.prompt`"
        ),
    }
}

/// One row being read, and how its errors name it.
struct Row<'a> {
    obj: &'a Map<String, Value>,
    format: PromptFormat,
    location: &'a dyn Fn() -> String,
}

impl Row<'_> {
    fn bad(&self, message: String) -> DataError {
        DataError::BadRow {
            location: (self.location)(),
            message,
        }
    }

    /// A column the format reads; `setting` is the mapping that renames it.
    fn get(&self, name: &str, setting: &str) -> Result<&Value, DataError> {
        self.obj.get(name).ok_or_else(|| DataError::MissingColumn {
            location: (self.location)(),
            column: name.to_string(),
            setting: setting.to_string(),
            available: self.obj.keys().cloned().collect(),
        })
    }

    fn text(&self, name: &str, v: &Value) -> Result<String, DataError> {
        value_to_text(v)
            .ok_or_else(|| self.bad(format!("column {name:?} must be text, found {}", kind(v))))
    }

    /// A text column that may be missing or null.
    fn opt_text(&self, name: &str) -> Result<Option<String>, DataError> {
        match self.obj.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => self.text(name, v).map(Some),
        }
    }

    fn messages(&self, name: &str, v: &Value) -> Result<Vec<ChatMessage>, DataError> {
        parse_messages(v, false, &|m| self.bad(format!("column {name:?}: {m}")))
    }

    /// The row's system column first, unless it is empty or a system turn leads.
    fn chat(&self, cols: &ColumnMapping, mut turns: Vec<ChatMessage>) -> Result<Prompt, DataError> {
        if let Some(s) = self.opt_text(col(&cols.system, "system"))? {
            if !s.is_empty() && turns.first().is_none_or(|m| m.role != "system") {
                turns.insert(0, ChatMessage::new("system", s));
            }
        }
        Ok(Prompt::Chat(turns))
    }

    /// The question (or problem) as one user message.
    fn question(&self, cols: &ColumnMapping) -> Result<Prompt, DataError> {
        let Some(name) = question_column(self.obj) else {
            let cols: Vec<&str> = self.obj.keys().map(String::as_str).collect();
            return Err(self.bad(format!(
                "column \"question\" (or \"problem\") not found, though the first row has it; columns that exist: {}",
                cols.join(", ")
            )));
        };
        let text = self.text(name, &self.obj[name])?;
        self.chat(cols, vec![ChatMessage::new("user", text)])
    }

    /// TRL's prompt column, in the shape the first row set.
    fn trl_prompt(&self, cols: &ColumnMapping) -> Result<Prompt, DataError> {
        let name = col(&cols.prompt, "prompt");
        let v = self.get(name, "data.columns.prompt")?;
        let parsed = parse_if_string(v);
        match (self.format, is_messages(&parsed)) {
            (PromptFormat::PromptMessages, true) => {
                let turns = self.messages(name, &parsed)?;
                self.chat(cols, turns)
            }
            (PromptFormat::PromptMessages, false) => Err(self.bad(format!(
                "column {name:?} is {} here but a list of messages in the first row; every prompt must be a list of messages, e.g. [{{\"role\": \"user\", \"content\": \"...\"}}]",
                kind(v)
            ))),
            (_, true) => Err(self.bad(format!(
                "column {name:?} is a list of messages here but text in the first row; every prompt must be text, or every prompt a list of messages"
            ))),
            (_, false) => Ok(Prompt::Text(self.text(name, v)?)),
        }
    }

    /// A conversation without its trailing assistant turn (the reference answer).
    fn conversation(&self, cols: &ColumnMapping) -> Result<Prompt, DataError> {
        let name = messages_column(self.obj, cols).unwrap_or(col(&cols.messages, "messages"));
        let mut turns = self.messages(name, self.get(name, "data.columns.messages")?)?;
        if turns.last().is_some_and(|m| m.role == "assistant") {
            turns.pop();
        }
        if turns.is_empty() {
            return Err(self.bad(format!(
                "column {name:?} holds no turn before the answer; the prompt is empty (it needs at least a user turn)"
            )));
        }
        self.chat(cols, turns)
    }

    /// Alpaca: instruction, then input after "\n" when it is not empty (LLaMA-Factory's join).
    fn instruction(&self, cols: &ColumnMapping) -> Result<Prompt, DataError> {
        let iname = col(&cols.prompt, "instruction");
        let instruction = self.text(iname, self.get(iname, "data.columns.prompt")?)?;
        let input = self
            .opt_text(col(&cols.input, "input"))?
            .unwrap_or_default();
        let user = if input.is_empty() {
            instruction
        } else {
            format!("{instruction}\n{input}")
        };
        self.chat(cols, vec![ChatMessage::new("user", user)])
    }
}

/// The prompt of one row in `format` (the first row's). `location` names the row in errors.
pub(crate) fn row_prompt(
    row: &Value,
    format: PromptFormat,
    cols: &ColumnMapping,
    location: &dyn Fn() -> String,
) -> Result<Prompt, DataError> {
    let obj = row.as_object().ok_or_else(|| DataError::BadRow {
        location: location(),
        message: format!("a row must be a JSON object, found {}", kind(row)),
    })?;
    let r = Row {
        obj,
        format,
        location,
    };
    match format {
        PromptFormat::PromptText | PromptFormat::PromptMessages => r.trl_prompt(cols),
        PromptFormat::Messages => r.conversation(cols),
        PromptFormat::Instruction => r.instruction(cols),
        PromptFormat::Question => r.question(cols),
    }
}
