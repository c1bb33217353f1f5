//! Which preference format a row is in, told from its columns.

use crate::data::config::ColumnMapping;
use crate::data::formats::col;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// A preference-pair dataset format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PreferenceFormat {
    /// TRL's `prompt` / `chosen` / `rejected`: three strings (no template, as TRL does for
    /// non-conversational data), or lists of messages rendered with the chat template. Without
    /// a `prompt` column the prompt is implicit: the longest shared start of `chosen` and
    /// `rejected` (TRL's `extract_prompt`).
    Trl,
    /// LLaMA-Factory's sharegpt ranking format: `conversations` (the prompt's turns,
    /// `{from, value}`) with one `chosen` and one `rejected` message object.
    #[serde(rename = "sharegpt_ranking")]
    ShareGptRanking,
    /// LLaMA-Factory's alpaca ranking format: `instruction` (+ `input`, `system`, `history`)
    /// with `chosen` and `rejected` answers.
    AlpacaRanking,
    /// LLaMA-Factory v1: `chosen_messages` / `rejected_messages`, two whole conversations
    /// (typed content parts, per-turn `loss_weight`) whose shared leading turns are the prompt.
    #[serde(rename = "llamafactory_v1")]
    LlamaFactoryV1,
}

impl PreferenceFormat {
    /// Every format.
    pub const ALL: [PreferenceFormat; 4] = [
        PreferenceFormat::Trl,
        PreferenceFormat::ShareGptRanking,
        PreferenceFormat::AlpacaRanking,
        PreferenceFormat::LlamaFactoryV1,
    ];

    /// The name used in settings and messages.
    pub fn name(self) -> &'static str {
        match self {
            PreferenceFormat::Trl => "trl",
            PreferenceFormat::ShareGptRanking => "sharegpt_ranking",
            PreferenceFormat::AlpacaRanking => "alpaca_ranking",
            PreferenceFormat::LlamaFactoryV1 => "llamafactory_v1",
        }
    }
}

impl std::fmt::Display for PreferenceFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for PreferenceFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let norm = s.trim().to_ascii_lowercase().replace('-', "_");
        PreferenceFormat::ALL
            .into_iter()
            .find(|f| f.name() == norm)
            .ok_or_else(|| {
                format!(
                    "unknown preference format {s:?}; use one of trl, sharegpt_ranking, alpaca_ranking, llamafactory_v1"
                )
            })
    }
}

/// The message-list column of a sharegpt ranking row: the mapped one, else `conversations`,
/// else `messages`.
pub(crate) fn conversation_column<'a>(
    obj: &serde_json::Map<String, Value>,
    cols: &'a ColumnMapping,
) -> Option<&'a str> {
    match cols.messages.as_deref() {
        Some(m) => obj.contains_key(m).then_some(m),
        None => ["conversations", "messages"]
            .into_iter()
            .find(|c| obj.contains_key(*c)),
    }
}

/// Detects the preference format of `row` (a JSON object); `None` when it holds no pair.
///
/// The order matters only for rows that carry several formats' columns: v1's
/// `chosen_messages` first (no other format has it), then a message list beside
/// `chosen`/`rejected` (sharegpt ranking), then an alpaca `instruction`, and otherwise TRL
/// (with or without a `prompt` column).
pub fn detect_preference_format(row: &Value, cols: &ColumnMapping) -> Option<PreferenceFormat> {
    let obj = row.as_object()?;
    if obj.contains_key("chosen_messages") && obj.contains_key("rejected_messages") {
        return Some(PreferenceFormat::LlamaFactoryV1);
    }
    if !(obj.contains_key("chosen") && obj.contains_key("rejected")) {
        return None;
    }
    if conversation_column(obj, cols).is_some() {
        return Some(PreferenceFormat::ShareGptRanking);
    }
    // A mapped prompt column is TRL's prompt, unless alpaca's `input` is mapped beside it.
    let mapped_alpaca = cols.input.is_some() && obj.contains_key(col(&cols.prompt, "instruction"));
    if obj.contains_key("instruction") || mapped_alpaca {
        return Some(PreferenceFormat::AlpacaRanking);
    }
    Some(PreferenceFormat::Trl)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn det(v: Value) -> Option<PreferenceFormat> {
        detect_preference_format(&v, &ColumnMapping::default())
    }

    #[test]
    fn detection() {
        use PreferenceFormat::*;
        assert_eq!(
            det(json!({"prompt": "a", "chosen": "b", "rejected": "c"})),
            Some(Trl)
        );
        assert_eq!(det(json!({"chosen": [], "rejected": []})), Some(Trl));
        assert_eq!(
            det(json!({"conversations": [], "chosen": {}, "rejected": {}})),
            Some(ShareGptRanking)
        );
        assert_eq!(
            det(json!({"instruction": "a", "input": "", "chosen": "b", "rejected": "c"})),
            Some(AlpacaRanking)
        );
        assert_eq!(
            det(json!({"chosen_messages": [], "rejected_messages": []})),
            Some(LlamaFactoryV1)
        );
        assert_eq!(det(json!({"prompt": "a", "completion": "b"})), None);
        assert_eq!(det(json!({"chosen": "b"})), None);
        for f in PreferenceFormat::ALL {
            assert_eq!(f.name().parse::<PreferenceFormat>(), Ok(f));
        }
    }
}
