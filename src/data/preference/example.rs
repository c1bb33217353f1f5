//! Preference rows as one format-independent shape: a prompt and two answers.

use super::format::{conversation_column, detect_preference_format, PreferenceFormat};
use crate::data::config::ColumnMapping;
use crate::data::formats::{col, kind, parse_if_string, parse_messages, value_to_text};
use crate::data::template::ChatMessage;
use crate::data::DataError;
use serde_json::{Map, Value};
use std::borrow::Cow;

/// One preference row: a prompt, the preferred answer and the dispreferred one.
#[derive(Debug, Clone, PartialEq)]
pub enum PreferenceExample {
    /// Conversational: rendered with the chat template. `chosen` and `rejected` are the turns
    /// that follow the prompt (usually one assistant message each).
    Chat {
        /// The shared turns before the answers.
        prompt: Vec<ChatMessage>,
        /// The preferred continuation.
        chosen: Vec<ChatMessage>,
        /// The dispreferred continuation.
        rejected: Vec<ChatMessage>,
    },
    /// Plain text, no template (TRL's non-conversational pairs).
    Text {
        /// The prompt.
        prompt: String,
        /// The preferred completion.
        chosen: String,
        /// The dispreferred completion.
        rejected: String,
    },
}

impl PreferenceExample {
    /// Whether the prompt and answers are rendered with the chat template.
    pub fn is_chat(&self) -> bool {
        matches!(self, PreferenceExample::Chat { .. })
    }
}

/// A text cell holding a JSON message or list of messages (CSV, and Parquet exports of nested
/// columns) as that JSON; any other text stays text, so an answer that merely looks like JSON
/// (`[1, 2, 3]`) is not taken for messages.
fn messages_if_string(v: &Value) -> Cow<'_, Value> {
    let parsed = parse_if_string(v);
    let message_like = |m: &Value| {
        m.as_object()
            .is_some_and(|o| o.contains_key("role") || o.contains_key("from"))
    };
    let keep = match parsed.as_ref() {
        _ if !v.is_string() => true,
        Value::Array(items) => !items.is_empty() && items.iter().all(message_like),
        m @ Value::Object(_) => message_like(m),
        _ => false,
    };
    if keep {
        parsed
    } else {
        Cow::Borrowed(v)
    }
}

/// One row being converted, and how its errors name it.
struct Row<'a> {
    obj: &'a Map<String, Value>,
    location: &'a dyn Fn() -> String,
}

impl Row<'_> {
    fn bad(&self, message: String) -> DataError {
        DataError::BadRow {
            location: (self.location)(),
            message,
        }
    }

    /// A column renamed by `setting` (`data.columns.*`).
    fn get(&self, name: &str, setting: &str) -> Result<&Value, DataError> {
        self.obj.get(name).ok_or_else(|| DataError::MissingColumn {
            location: (self.location)(),
            column: name.to_string(),
            setting: setting.to_string(),
            available: self.obj.keys().cloned().collect(),
        })
    }

    /// A column whose name the format fixes (`chosen`, `rejected`, `chosen_messages`, ...).
    fn fixed(&self, name: &str) -> Result<&Value, DataError> {
        self.obj.get(name).ok_or_else(|| {
            let cols: Vec<&str> = self.obj.keys().map(String::as_str).collect();
            self.bad(format!(
                "column {name:?} not found; a preference row needs it (columns that exist: {})",
                cols.join(", ")
            ))
        })
    }

    /// A text column that may be missing or null.
    fn opt_text(&self, name: &str) -> Result<Option<String>, DataError> {
        match self.obj.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => value_to_text(v).map(Some).ok_or_else(|| {
                self.bad(format!("column {name:?} must be text, found {}", kind(v)))
            }),
        }
    }

    /// A list of messages (`{role, content}` or `{from, value}`, content as text or typed parts).
    fn messages(&self, name: &str, v: &Value) -> Result<Vec<ChatMessage>, DataError> {
        parse_messages(v, false, &|m| self.bad(format!("column {name:?}: {m}")))
    }

    /// One answer of a ranking row: a message object, a list of messages, or plain text (an
    /// assistant message).
    fn answer(&self, name: &str) -> Result<Vec<ChatMessage>, DataError> {
        let v = messages_if_string(self.fixed(name)?).into_owned();
        match &v {
            Value::Object(_) => self.messages(name, &Value::Array(vec![v.clone()])),
            Value::Array(_) => self.messages(name, &v),
            other => match value_to_text(other) {
                Some(t) => Ok(vec![ChatMessage::new("assistant", t)]),
                None => Err(self.bad(format!(
                    "column {name:?} must be a message, a list of messages or text, found {}",
                    kind(other)
                ))),
            },
        }
    }

    /// Puts the row's system column first, unless it is empty or a system turn leads.
    fn add_system(
        &self,
        cols: &ColumnMapping,
        prompt: &mut Vec<ChatMessage>,
    ) -> Result<(), DataError> {
        if let Some(s) = self.opt_text(col(&cols.system, "system"))? {
            if !s.is_empty() && prompt.first().is_none_or(|m| m.role != "system") {
                prompt.insert(0, ChatMessage::new("system", s));
            }
        }
        Ok(())
    }
}

/// Converts one row into a [`PreferenceExample`]; `format` `None` detects it from the row.
/// `location` names the row in errors.
pub fn to_preference_example(
    row: &Value,
    format: Option<PreferenceFormat>,
    cols: &ColumnMapping,
    location: &dyn Fn() -> String,
) -> Result<PreferenceExample, DataError> {
    let obj = row.as_object().ok_or_else(|| DataError::BadRow {
        location: location(),
        message: "a row must be a JSON object".into(),
    })?;
    let format = match format {
        Some(f) => f,
        None => detect_preference_format(row, cols).ok_or_else(|| {
            DataError::UnknownPreferenceFormat {
                location: location(),
                columns: obj.keys().cloned().collect(),
            }
        })?,
    };
    let r = Row { obj, location };
    match format {
        PreferenceFormat::Trl => trl_example(&r, cols),
        PreferenceFormat::ShareGptRanking => sharegpt_example(&r, cols),
        PreferenceFormat::AlpacaRanking => alpaca_example(&r, cols),
        PreferenceFormat::LlamaFactoryV1 => v1_example(&r, cols),
    }
}

/// TRL: explicit prompt (text or messages), or implicit (the shared start of the answers).
fn trl_example(r: &Row, cols: &ColumnMapping) -> Result<PreferenceExample, DataError> {
    let chosen_v = messages_if_string(r.fixed("chosen")?).into_owned();
    let rejected_v = messages_if_string(r.fixed("rejected")?).into_owned();
    let prompt_name = col(&cols.prompt, "prompt");
    let conversational = match (chosen_v.is_array(), rejected_v.is_array()) {
        (true, true) => true,
        (false, false) => false,
        _ => {
            return Err(r.bad(
                "`chosen` and `rejected` must both be text or both be lists of messages".into(),
            ))
        }
    };
    let Some(prompt_v) = r.obj.get(prompt_name).filter(|v| !v.is_null()) else {
        return implicit_example(r, cols, &chosen_v, &rejected_v, conversational);
    };
    let prompt_v = messages_if_string(prompt_v).into_owned();
    if conversational {
        if !prompt_v.is_array() {
            return Err(r.bad(format!(
                "`chosen` and `rejected` are lists of messages, so column {prompt_name:?} must be one too (found {}); e.g. [{{\"role\": \"user\", \"content\": \"...\"}}]",
                kind(&prompt_v)
            )));
        }
        let mut prompt = r.messages(prompt_name, &prompt_v)?;
        r.add_system(cols, &mut prompt)?;
        return Ok(PreferenceExample::Chat {
            prompt,
            chosen: r.messages("chosen", &chosen_v)?,
            rejected: r.messages("rejected", &rejected_v)?,
        });
    }
    let text = |name: &str, v: &Value| {
        value_to_text(v)
            .ok_or_else(|| r.bad(format!("column {name:?} must be text, found {}", kind(v))))
    };
    Ok(PreferenceExample::Text {
        prompt: text(prompt_name, &prompt_v)?,
        chosen: text("chosen", &chosen_v)?,
        rejected: text("rejected", &rejected_v)?,
    })
}

/// TRL's implicit prompt: the longest shared start of `chosen` and `rejected`.
fn implicit_example(
    r: &Row,
    cols: &ColumnMapping,
    chosen_v: &Value,
    rejected_v: &Value,
    conversational: bool,
) -> Result<PreferenceExample, DataError> {
    if conversational {
        let chosen = r.messages("chosen", chosen_v)?;
        let rejected = r.messages("rejected", rejected_v)?;
        return split_conversations(r, cols, chosen, rejected, "chosen", "rejected");
    }
    let (Some(chosen), Some(rejected)) = (value_to_text(chosen_v), value_to_text(rejected_v))
    else {
        return Err(r.bad("`chosen` and `rejected` must be text or lists of messages".into()));
    };
    let cut = shared_text_prefix(&chosen, &rejected);
    if cut == 0 {
        return Err(r.bad(
            "there is no `prompt` column and `chosen` and `rejected` share no leading text to take as the prompt; add a `prompt` column".into(),
        ));
    }
    Ok(PreferenceExample::Text {
        prompt: chosen[..cut].to_string(),
        chosen: chosen[cut..].to_string(),
        rejected: rejected[cut..].to_string(),
    })
}

/// Byte length of the shared start of two texts, on a character boundary, without a trailing
/// space (TRL's `extract_prompt` leaves the space before the first differing word to the
/// completions).
fn shared_text_prefix(a: &str, b: &str) -> usize {
    let mut end = 0;
    for ((i, ca), cb) in a.char_indices().zip(b.chars()) {
        if ca != cb {
            break;
        }
        end = i + ca.len_utf8();
    }
    if end < a.len().min(b.len()) && a[..end].ends_with(' ') {
        end -= 1;
    }
    end
}

/// Two whole conversations → the shared leading turns (the prompt) and each one's rest.
fn split_conversations(
    r: &Row,
    cols: &ColumnMapping,
    mut chosen: Vec<ChatMessage>,
    mut rejected: Vec<ChatMessage>,
    chosen_name: &str,
    rejected_name: &str,
) -> Result<PreferenceExample, DataError> {
    let mut shared = chosen
        .iter()
        .zip(&rejected)
        .take_while(|(c, r)| same_turn(c, r))
        .count();
    if shared == chosen.len() && shared == rejected.len() {
        // Two identical conversations: the last turn stays the (identical) answer, so the
        // pair lints report the pair as identical rather than as two empty completions.
        shared -= 1;
    }
    if shared == 0 {
        return Err(r.bad(format!(
            "`{chosen_name}` and `{rejected_name}` share no leading turn, so there is no prompt; both must start with the same prompt turns (system, user, ...) and differ in the answer"
        )));
    }
    let mut prompt: Vec<ChatMessage> = chosen.drain(..shared).collect();
    rejected.drain(..shared);
    r.add_system(cols, &mut prompt)?;
    Ok(PreferenceExample::Chat {
        prompt,
        chosen,
        rejected,
    })
}

/// Two turns are the same prompt turn when role and text agree (a loss weight is about
/// training, not about what the model reads).
fn same_turn(a: &ChatMessage, b: &ChatMessage) -> bool {
    a.role == b.role && a.content == b.content && a.extra == b.extra
}

/// LLaMA-Factory sharegpt ranking: `conversations` is the prompt.
fn sharegpt_example(r: &Row, cols: &ColumnMapping) -> Result<PreferenceExample, DataError> {
    let name = conversation_column(r.obj, cols).unwrap_or(col(&cols.messages, "conversations"));
    let v = r.get(name, "data.columns.messages")?;
    let mut prompt = parse_messages(v, true, &|m| r.bad(format!("column {name:?}: {m}")))?;
    if prompt.is_empty() {
        return Err(r.bad(format!(
            "column {name:?} holds no turn; the prompt is empty"
        )));
    }
    r.add_system(cols, &mut prompt)?;
    Ok(PreferenceExample::Chat {
        prompt,
        chosen: r.answer("chosen")?,
        rejected: r.answer("rejected")?,
    })
}

/// LLaMA-Factory alpaca ranking: instruction (+ input) after the history's turns.
fn alpaca_example(r: &Row, cols: &ColumnMapping) -> Result<PreferenceExample, DataError> {
    let iname = col(&cols.prompt, "instruction");
    let iv = r.get(iname, "data.columns.prompt")?;
    let instruction = value_to_text(iv)
        .ok_or_else(|| r.bad(format!("column {iname:?} must be text, found {}", kind(iv))))?;
    let input = r.opt_text(col(&cols.input, "input"))?.unwrap_or_default();
    let mut prompt = Vec::new();
    if let Some(h) = r.obj.get(col(&cols.history, "history")) {
        history_turns(r, &parse_if_string(h), &mut prompt)?;
    }
    let user = if input.is_empty() {
        instruction
    } else {
        format!("{instruction}\n{input}")
    };
    prompt.push(ChatMessage::new("user", user));
    r.add_system(cols, &mut prompt)?;
    Ok(PreferenceExample::Chat {
        prompt,
        chosen: r.answer("chosen")?,
        rejected: r.answer("rejected")?,
    })
}

/// An alpaca `history` (a list of `[user, assistant]` pairs, or null) as chat turns.
fn history_turns(r: &Row, h: &Value, out: &mut Vec<ChatMessage>) -> Result<(), DataError> {
    let turns = match h {
        Value::Null => return Ok(()),
        Value::Array(turns) => turns,
        other => {
            return Err(r.bad(format!(
                "`history` must be a list of [user, assistant] pairs, found {}",
                kind(other)
            )))
        }
    };
    for t in turns {
        let pair = t
            .as_array()
            .filter(|p| p.len() == 2)
            .ok_or_else(|| r.bad("`history` must be a list of [user, assistant] pairs".into()))?;
        let (Some(u), Some(a)) = (value_to_text(&pair[0]), value_to_text(&pair[1])) else {
            return Err(r.bad("`history` pairs must hold text".into()));
        };
        out.push(ChatMessage::new("user", u));
        out.push(ChatMessage::new("assistant", a));
    }
    Ok(())
}

/// LLaMA-Factory v1: two whole conversations sharing their prompt turns.
fn v1_example(r: &Row, cols: &ColumnMapping) -> Result<PreferenceExample, DataError> {
    let cv = r.fixed("chosen_messages")?;
    let rv = r.fixed("rejected_messages")?;
    let chosen = r.messages("chosen_messages", cv)?;
    let rejected = r.messages("rejected_messages", rv)?;
    split_conversations(
        r,
        cols,
        chosen,
        rejected,
        "chosen_messages",
        "rejected_messages",
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ex(v: Value) -> Result<PreferenceExample, DataError> {
        to_preference_example(&v, None, &ColumnMapping::default(), &|| {
            "f.jsonl line 3".into()
        })
    }

    #[test]
    fn shared_text_prefix_backs_off_a_space() {
        assert_eq!(
            shared_text_prefix("Q: sky? A: blue", "Q: sky? A: green"),
            10
        );
        assert_eq!(shared_text_prefix("été", "étà"), "ét".len());
        assert_eq!(shared_text_prefix("x", "y"), 0);
    }

    #[test]
    fn trl_text_and_implicit() {
        let e = ex(json!({"prompt": "P", "chosen": "a", "rejected": "b"})).unwrap();
        assert_eq!(
            e,
            PreferenceExample::Text {
                prompt: "P".into(),
                chosen: "a".into(),
                rejected: "b".into()
            }
        );
        let e = ex(json!({"chosen": "The sky is blue.", "rejected": "The sky is green."})).unwrap();
        let PreferenceExample::Text { prompt, chosen, .. } = e else {
            panic!()
        };
        assert_eq!((prompt.as_str(), chosen.as_str()), ("The sky is", " blue."));
        let e = ex(json!({
            "chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
            "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "b"}],
        }))
        .unwrap();
        let PreferenceExample::Chat {
            prompt,
            chosen,
            rejected,
        } = e
        else {
            panic!()
        };
        assert_eq!((prompt.len(), chosen.len(), rejected.len()), (1, 1, 1));
        assert_eq!(rejected[0].content, "b");
    }

    #[test]
    fn errors_name_the_row() {
        for bad in [
            json!({"chosen": [{"role": "user", "content": "q"}], "rejected": "x"}),
            json!({"prompt": "p", "chosen": [], "rejected": []}),
            json!({"chosen": [{"role": "user", "content": "q"}], "rejected": [{"role": "user", "content": "r"}]}),
            json!({"chosen": "abc", "rejected": "xyz"}),
            json!({"a": 1}),
        ] {
            let e = ex(bad).unwrap_err().to_string();
            assert!(e.contains("f.jsonl line 3"), "{e}");
        }
    }

    #[test]
    fn text_that_looks_like_json_stays_text() {
        let e = ex(json!({"prompt": "List?", "chosen": "[1, 2, 3]", "rejected": "{}"})).unwrap();
        let PreferenceExample::Text { chosen, .. } = e else {
            panic!()
        };
        assert_eq!(chosen, "[1, 2, 3]");
        let msgs = r#"[{"role": "assistant", "content": "a"}]"#;
        let e = ex(json!({"prompt": r#"[{"role": "user", "content": "q"}]"#, "chosen": msgs, "rejected": msgs}))
            .unwrap();
        assert!(e.is_chat());
    }

    #[test]
    fn ranking_formats() {
        let e = ex(json!({
            "conversations": [{"from": "human", "value": "q"}],
            "chosen": {"from": "gpt", "value": "a"},
            "rejected": {"from": "gpt", "value": "b"},
            "system": "S",
        }))
        .unwrap();
        let PreferenceExample::Chat { prompt, chosen, .. } = e else {
            panic!()
        };
        assert_eq!(prompt[0].role, "system");
        assert_eq!(prompt[1].role, "user");
        assert_eq!(chosen[0].role, "assistant");
        let e = ex(json!({"instruction": "Do", "input": "this", "chosen": "a", "rejected": "b"}))
            .unwrap();
        let PreferenceExample::Chat { prompt, .. } = e else {
            panic!()
        };
        assert_eq!(prompt[0].content, "Do\nthis");
    }
}
