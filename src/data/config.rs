//! `DataConfig`: the `[data]` table of a run config.

use serde::{Deserialize, Serialize};

/// The dataset format. `Auto` detects it from the first row's columns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Format {
    /// Detect from the columns (see [`crate::data::formats::detect_format`]).
    #[default]
    Auto,
    /// One text column; every token is trained.
    Text,
    /// `instruction` / `input` / `output` (+ optional `system`, `history`),
    /// rendered through the chat template as a user/assistant exchange.
    Alpaca,
    /// Two mapped columns, prompt and completion, concatenated without a
    /// template (TRL's non-conversational prompt-completion).
    PromptCompletion,
    /// `messages: [{role, content}]`.
    Chat,
    /// `conversations: [{from, value}]` with human/gpt/system roles.
    #[serde(rename = "sharegpt")]
    ShareGpt,
    /// LLaMA-Factory v1: `messages` with typed content parts and per-turn
    /// `loss_weight`.
    #[serde(rename = "llamafactory_v1")]
    LlamaFactoryV1,
    /// `input_ids` (+ `labels`, `attention_mask`) already tokenised.
    #[serde(rename = "pretokenized")]
    Pretokenized,
}

impl Format {
    /// A short human name.
    pub fn name(self) -> &'static str {
        match self {
            Format::Auto => "auto",
            Format::Text => "text",
            Format::Alpaca => "alpaca",
            Format::PromptCompletion => "prompt_completion",
            Format::Chat => "chat",
            Format::ShareGpt => "sharegpt",
            Format::LlamaFactoryV1 => "llamafactory_v1",
            Format::Pretokenized => "pretokenized",
        }
    }

    /// Whether this format is instruction/chat data (completions-only
    /// training is the default for it).
    pub fn is_instruction(self) -> bool {
        !matches!(self, Format::Auto | Format::Text | Format::Pretokenized)
    }

    /// Every concrete format (not `Auto`).
    pub const ALL: [Format; 7] = [
        Format::Text,
        Format::Alpaca,
        Format::PromptCompletion,
        Format::Chat,
        Format::ShareGpt,
        Format::LlamaFactoryV1,
        Format::Pretokenized,
    ];
}

impl std::str::FromStr for Format {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let norm = s.trim().to_ascii_lowercase().replace('-', "_");
        std::iter::once(Format::Auto)
            .chain(Format::ALL)
            .find(|f| f.name() == norm)
            .ok_or_else(|| {
                format!(
                    "unknown format {s:?}; use one of auto, text, alpaca, prompt_completion, chat, sharegpt, llamafactory_v1, pretokenized"
                )
            })
    }
}

impl std::fmt::Display for Format {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Column names, overriding the format's defaults. Unset fields use the
/// defaults (`text`; `instruction`/`input`/`output`/`system`/`history`;
/// `prompt`/`completion`; `messages`; `conversations`).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ColumnMapping {
    /// Plain-text column.
    pub text: Option<String>,
    /// Prompt (prompt/completion) or instruction (alpaca) column.
    pub prompt: Option<String>,
    /// Alpaca's optional `input` column, appended to the instruction after "\n".
    pub input: Option<String>,
    /// Completion (prompt/completion) or output (alpaca) column.
    pub completion: Option<String>,
    /// Messages / conversations column (chat, sharegpt, v1).
    pub messages: Option<String>,
    /// Optional system-prompt column.
    pub system: Option<String>,
    /// Alpaca's optional `history` column: `[[user, assistant], ...]`.
    pub history: Option<String>,
}

/// How `.txt` files are split into documents.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TxtSplit {
    /// One document per blank-line-separated block for a single file, one
    /// per file for a folder of `.txt` files.
    #[default]
    Auto,
    /// Each file is one document.
    PerFile,
    /// Each blank-line-separated block is one document.
    BlankLine,
}

/// The `[data]` table of a run config.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DataConfig {
    /// A file, a folder of data files, or a hub dataset id (`org/name`,
    /// optionally `org/name@revision`).
    pub path: String,
    /// A separate validation file/folder/hub id.
    pub validation_path: Option<String>,
    /// Fraction of `path`'s rows held out for validation (seeded, ignored
    /// when `validation_path` is set). 0 = no validation split.
    pub validation_ratio: f64,
    /// The format (auto-detected by default).
    pub format: Format,
    /// Column names.
    pub columns: ColumnMapping,
    /// Maximum sequence length in tokens; longer samples are truncated at
    /// the end (the prompt's start is kept).
    pub max_length: usize,
    /// Pack several samples per sequence of `max_length` tokens.
    pub packing: bool,
    /// Mask prompt/system/user tokens. `None` = on for instruction and chat
    /// data, off for plain text.
    pub train_on_completions_only: Option<bool>,
    /// Batch samples of similar length together (seeded).
    pub group_by_length: bool,
    /// Seed for the validation split, shuffling and length grouping.
    pub seed: u64,
    /// How `.txt` files split into documents.
    pub txt_split: TxtSplit,
    /// Error-level lints to train despite, by name (`["labels-mismatch"]`): an expert's
    /// explicit override, recorded in the run's `metrics.jsonl`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub allow: Vec<String>,
}

impl Default for DataConfig {
    fn default() -> Self {
        DataConfig {
            path: String::new(),
            validation_path: None,
            validation_ratio: 0.0,
            format: Format::Auto,
            columns: ColumnMapping::default(),
            max_length: 2048,
            packing: false,
            train_on_completions_only: None,
            group_by_length: false,
            seed: 42,
            txt_split: TxtSplit::Auto,
            allow: Vec::new(),
        }
    }
}

impl DataConfig {
    /// A config reading `path` with every other setting at its default.
    pub fn new(path: impl Into<String>) -> Self {
        DataConfig {
            path: path.into(),
            ..DataConfig::default()
        }
    }

    /// Checks ranges; the error names the setting and the allowed values.
    pub fn validate(&self) -> Result<(), crate::data::DataError> {
        use crate::data::DataError;
        if self.path.trim().is_empty() {
            return Err(DataError::Config {
                setting: "data.path".into(),
                message: "is empty; set it to a data file, a folder or a hub dataset id".into(),
            });
        }
        if let Some(bad) = self
            .allow
            .iter()
            .find(|a| crate::data::lints::LintKind::from_id(a).is_none())
        {
            let names: Vec<&str> = crate::data::lints::LintKind::ALL
                .iter()
                .map(|k| k.id())
                .collect();
            return Err(DataError::Config {
                setting: "data.allow".into(),
                message: format!(
                    "`{bad}` is not a lint name; use some of {}",
                    names.join(", ")
                ),
            });
        }
        if !(0.0..1.0).contains(&self.validation_ratio) || self.validation_ratio.is_nan() {
            return Err(DataError::Config {
                setting: "data.validation_ratio".into(),
                message: format!(
                    "{} is outside [0, 1); use e.g. 0.05 for 5% or 0 for none",
                    self.validation_ratio
                ),
            });
        }
        if self.max_length < 2 {
            return Err(DataError::Config {
                setting: "data.max_length".into(),
                message: format!(
                    "{} is too small; use at least 2 tokens (e.g. 2048)",
                    self.max_length
                ),
            });
        }
        Ok(())
    }

    /// Whether prompt tokens are masked for `format` (the explicit setting,
    /// else on for instruction/chat data).
    pub fn completions_only_for(&self, format: Format) -> bool {
        self.train_on_completions_only
            .unwrap_or_else(|| format.is_instruction())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn toml_roundtrip() {
        let mut cfg = DataConfig::new("data.jsonl");
        cfg.format = Format::ShareGpt;
        cfg.columns.prompt = Some("q".into());
        cfg.train_on_completions_only = Some(false);
        let text = toml::to_string(&cfg).unwrap();
        let back: DataConfig = toml::from_str(&text).unwrap();
        assert_eq!(back, cfg);
        assert_eq!(
            "LlamaFactory-v1".parse::<Format>(),
            Ok(Format::LlamaFactoryV1)
        );
    }
}
