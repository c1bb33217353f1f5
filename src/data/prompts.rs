//! Prompt-only datasets for GRPO: each row's prompt as the model sees it (token ids and text),
//! beside the row's own columns, which the reward functions read (`answer`, `solution`, ...).
//!
//! Data flows: [`crate::data::readers`] (JSON, JSONL, CSV, Parquet; files, folders, hub ids) →
//! [`format`] (detect the format from the first row: TRL's `prompt` as text or messages,
//! `messages`, LLaMA-Factory's `instruction` + `input`, a `question`) → the chat template and
//! the tokenizer, as TRL's `GRPOTrainer` tokenises prompts → truncation to
//! `max_prompt_length` → [`lints`].
//!
//! * Conversational prompts are rendered with the chat template and the generation prompt
//!   (`apply_chat_template(prompt, add_generation_prompt=True)`), then tokenised without
//!   special tokens, as `apply_chat_template(tokenize=True)` does; a tokenizer without a
//!   template renders them with the ChatML fallback ([`PromptSet::template_is_fallback`]).
//! * Text prompts are tokenised as they are, with the tokenizer's special tokens (a BOS where
//!   the model wants one): TRL 1.x calls `processing_class(text=prompts)`.
//! * Truncation keeps a prompt's *end* (TRL truncates from the left): the question nearest the
//!   answer matters most.

pub mod format;
pub mod lints;

pub use format::{detect_prompt_format, PromptFormat};
pub use lints::answer_column_lint;

use crate::data::config::{ColumnMapping, TxtSplit};
use crate::data::lints::Lint;
use crate::data::readers::Dataset;
use crate::data::template::{ChatTemplate, TemplateTokens, FALLBACK_CHATML};
use crate::data::tokenizer::TokenizerBundle;
use crate::data::DataError;
use format::{row_prompt, unknown_format, Prompt};
use lints::{prompt_lints, PromptLintContext};
use rayon::prelude::*;
use serde_json::{Map, Value};

/// One prompt of a GRPO dataset, tokenised and truncated.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptRow {
    /// Index of the source row in its dataset.
    pub index: usize,
    /// The prompt's token ids, after truncation (its end is kept).
    pub prompt_ids: Vec<u32>,
    /// The prompt as the model sees it: the rendered chat template, or the text; when
    /// truncation cut the prompt, the kept tokens decoded (special tokens kept).
    pub prompt_text: String,
    /// Rendered with the chat template.
    pub is_chat: bool,
    /// The row's own columns (the prompt's included), for the reward functions.
    pub columns: Map<String, Value>,
    /// Tokens `max_prompt_length` removed from the prompt's start; 0 when none.
    pub cut_tokens: usize,
}

impl PromptRow {
    /// Prompt tokens the model sees.
    pub fn len(&self) -> usize {
        self.prompt_ids.len()
    }

    /// Whether the prompt has no token.
    pub fn is_empty(&self) -> bool {
        self.prompt_ids.is_empty()
    }
}

/// How prompts are read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PromptSettings {
    /// Prompt tokens kept (the end); `None` keeps them all.
    pub max_prompt_length: Option<usize>,
    /// Column names: `prompt` (TRL's prompt, or alpaca's instruction when named `instruction`
    /// or when `input` is mapped too), `input`, `messages`, `system`.
    pub columns: ColumnMapping,
}

/// A dataset's prompts, in dataset order, with the format they were read in and their lints.
#[derive(Debug, Clone)]
pub struct PromptSet {
    /// Every row's prompt (rows with an empty prompt included: the `grpo-empty-prompt` lint
    /// names them).
    pub rows: Vec<PromptRow>,
    /// The format, detected from the first row.
    pub format: PromptFormat,
    /// The tokenizer has no chat template and the ChatML fallback renders chat prompts.
    pub template_is_fallback: bool,
    /// The prompt lints, most severe first (`grpo-empty-prompt`, `grpo-prompt-truncated`,
    /// `grpo-duplicate-prompt`, `chat-without-template`); [`answer_column_lint`] adds the
    /// reward functions' own.
    pub lints: Vec<Lint>,
}

/// Reads the prompts of `path_or_spec` (a file, a folder of data files or a hub dataset id, as
/// `data.path`), `.txt` files split as `data.txt_split = "auto"` does.
pub fn read_prompts(
    path_or_spec: &str,
    tok: &TokenizerBundle,
    settings: &PromptSettings,
) -> Result<PromptSet, DataError> {
    let ds = Dataset::open(path_or_spec, TxtSplit::Auto)?;
    prompt_set_from_dataset(&ds, tok, settings)
}

/// Reads the prompts of an opened dataset; errors name the file and line of the row at fault.
pub fn prompt_set_from_dataset(
    ds: &Dataset,
    tok: &TokenizerBundle,
    settings: &PromptSettings,
) -> Result<PromptSet, DataError> {
    if ds.is_empty() {
        let files: Vec<String> = ds.files().iter().map(|f| f.display().to_string()).collect();
        return Err(DataError::NothingToTrain {
            what: files.join(", "),
            message: "the dataset holds no rows, so there is no prompt to sample from".into(),
        });
    }
    let rows = ds.all_rows()?;
    build(&rows, &|i| ds.location(i), tok, settings)
}

/// Reads prompts from rows already in memory (JSON objects); errors name them `row N`.
pub fn prompt_rows_from_values(
    values: &[Value],
    tok: &TokenizerBundle,
    settings: &PromptSettings,
) -> Result<PromptSet, DataError> {
    if values.is_empty() {
        return Err(DataError::NothingToTrain {
            what: "the prompts".into(),
            message: "no rows were given, so there is no prompt to sample from".into(),
        });
    }
    build(values, &|i| format!("row {i}"), tok, settings)
}

/// The model's chat template, or the ChatML fallback (and whether it is the fallback).
fn chat_template(tok: &TokenizerBundle) -> Result<(ChatTemplate, bool), DataError> {
    let tokens = TemplateTokens {
        bos_token: tok.bos_token.clone(),
        eos_token: tok.eos_token.clone(),
        pad_token: tok.pad_token.clone(),
        unk_token: tok.unk_token.clone(),
    };
    Ok(match &tok.chat_template {
        Some(src) => (ChatTemplate::new(src, tokens)?, false),
        None => (ChatTemplate::new(FALLBACK_CHATML, tokens)?, true),
    })
}

/// Detects the format on the first row, reads every row (in parallel) and lints them.
fn build(
    values: &[Value],
    location: &(dyn Fn(usize) -> String + Sync),
    tok: &TokenizerBundle,
    settings: &PromptSettings,
) -> Result<PromptSet, DataError> {
    let first = &values[0];
    let format = detect_prompt_format(first, &settings.columns)
        .ok_or_else(|| unknown_format(first, &settings.columns, location(0)))?;
    let (template, template_is_fallback) = chat_template(tok)?;
    let reader = Reader {
        tok,
        template: &template,
        format,
        settings,
    };
    let read: Vec<(PromptRow, bool)> = values
        .par_iter()
        .enumerate()
        .map(|(i, v)| reader.row(i, v, &|| location(i)))
        .collect::<Result<_, _>>()?;
    let (rows, blank): (Vec<PromptRow>, Vec<bool>) = read.into_iter().unzip();
    let ctx = PromptLintContext {
        max_prompt_length: settings.max_prompt_length,
        no_chat_template: template_is_fallback,
    };
    let lints = prompt_lints(&rows, &blank, &ctx);
    Ok(PromptSet {
        rows,
        format,
        template_is_fallback,
        lints,
    })
}

/// What every row is read with.
struct Reader<'a> {
    tok: &'a TokenizerBundle,
    template: &'a ChatTemplate,
    format: PromptFormat,
    settings: &'a PromptSettings,
}

impl Reader<'_> {
    /// Row `index`'s prompt, tokenised and truncated, and whether its text is blank.
    fn row(
        &self,
        index: usize,
        value: &Value,
        location: &dyn Fn() -> String,
    ) -> Result<(PromptRow, bool), DataError> {
        let prompt = row_prompt(value, self.format, &self.settings.columns, location)?;
        let encode_err = |message: String| DataError::Encode {
            row: index,
            message,
        };
        let (text, mut ids) = match &prompt {
            Prompt::Text(t) => (t.clone(), self.tok.encode(t, true).map_err(encode_err)?),
            Prompt::Chat(turns) => {
                let text = self.template.render(turns, true).map_err(|message| {
                    DataError::TemplateRender {
                        location: location(),
                        message,
                    }
                })?;
                let ids = self.tok.encode(&text, false).map_err(encode_err)?;
                (text, ids)
            }
        };
        let cut_tokens = self
            .settings
            .max_prompt_length
            .map_or(0, |m| ids.len().saturating_sub(m));
        ids.drain(..cut_tokens);
        let prompt_text = if cut_tokens > 0 {
            self.tok.decode(&ids)
        } else {
            text
        };
        let row = PromptRow {
            index,
            prompt_ids: ids,
            prompt_text,
            is_chat: matches!(prompt, Prompt::Chat(_)),
            columns: value.as_object().cloned().unwrap_or_default(),
            cut_tokens,
        };
        Ok((row, prompt.is_blank()))
    }
}

#[cfg(test)]
mod tests;
