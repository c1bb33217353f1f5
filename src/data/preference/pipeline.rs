//! Reading a dataset's rows as tokenised pairs: the format (detected from the first row, or
//! given), the chat template, and the truncation lengths shared by every row.

use super::example::to_preference_example;
use super::format::{detect_preference_format, PreferenceFormat};
use super::lints::PairLintContext;
use super::tokenize::{tokenize_pair, PairContext, PairLimits, PreferencePair};
use crate::data::config::ColumnMapping;
use crate::data::readers::Dataset;
use crate::data::template::{ChatTemplate, TemplateTokens, FALLBACK_CHATML};
use crate::data::tokenizer::TokenizerBundle;
use crate::data::DataError;
use rayon::prelude::*;
use serde_json::Value;

/// Format, template and truncation decisions shared by every pair of a dataset.
pub struct PreferencePipeline<'a> {
    /// The tokenizer.
    pub tok: &'a TokenizerBundle,
    /// The resolved format.
    pub format: PreferenceFormat,
    /// Column names (the prompt/instruction, input, system, history and messages columns).
    pub columns: ColumnMapping,
    /// The chat template (the model's, or the ChatML fallback).
    pub template: ChatTemplate,
    /// The tokenizer has no template and the fallback is in use.
    pub template_is_fallback: bool,
    /// Truncation lengths.
    pub limits: PairLimits,
}

impl<'a> PreferencePipeline<'a> {
    /// Resolves the format from `first_row` when `format` is `None`, and compiles the chat
    /// template.
    pub fn new(
        tok: &'a TokenizerBundle,
        format: Option<PreferenceFormat>,
        columns: ColumnMapping,
        limits: PairLimits,
        first_row: &Value,
        first_location: &str,
    ) -> Result<Self, DataError> {
        let format = match format {
            Some(f) => f,
            None => detect_preference_format(first_row, &columns).ok_or_else(|| {
                DataError::UnknownPreferenceFormat {
                    location: first_location.to_string(),
                    columns: first_row
                        .as_object()
                        .map(|o| o.keys().cloned().collect())
                        .unwrap_or_default(),
                }
            })?,
        };
        let tokens = TemplateTokens {
            bos_token: tok.bos_token.clone(),
            eos_token: tok.eos_token.clone(),
            pad_token: tok.pad_token.clone(),
            unk_token: tok.unk_token.clone(),
        };
        let (template, template_is_fallback) = match &tok.chat_template {
            Some(src) => (ChatTemplate::new(src, tokens)?, false),
            None => (ChatTemplate::new(FALLBACK_CHATML, tokens)?, true),
        };
        Ok(PreferencePipeline {
            tok,
            format,
            columns,
            template,
            template_is_fallback,
            limits,
        })
    }

    /// Opens the pipeline on `ds`'s first row.
    pub fn for_dataset(
        tok: &'a TokenizerBundle,
        ds: &Dataset,
        format: Option<PreferenceFormat>,
        columns: ColumnMapping,
        limits: PairLimits,
    ) -> Result<Self, DataError> {
        let first = ds.row(0)?;
        Self::new(tok, format, columns, limits, &first, &ds.location(0))
    }

    /// The tokeniser's context.
    pub fn context(&self) -> PairContext<'_> {
        PairContext {
            tok: self.tok,
            template: Some(&self.template),
            limits: self.limits,
        }
    }

    /// Tokenises one row (dataset index `row`); `location` names it in errors.
    pub fn pair(
        &self,
        row: usize,
        value: &Value,
        location: &dyn Fn() -> String,
    ) -> Result<PreferencePair, DataError> {
        let ex = to_preference_example(value, Some(self.format), &self.columns, location)?;
        tokenize_pair(row, &ex, &self.context(), location)
    }

    /// Reads and tokenises rows `indices` of `ds`, in parallel; the first bad row's error.
    pub fn pairs(&self, ds: &Dataset, indices: &[usize]) -> Result<Vec<PreferencePair>, DataError> {
        let rows = if indices.len() == ds.len() && indices.iter().enumerate().all(|(k, &i)| k == i)
        {
            ds.all_rows()?
        } else {
            ds.rows_at(indices)?
        };
        indices
            .par_iter()
            .zip(rows.par_iter())
            .map(|(&i, v)| self.pair(i, v, &|| ds.location(i)))
            .collect()
    }

    /// Dataset-level lint facts.
    pub fn lint_context(&self) -> PairLintContext {
        PairLintContext {
            limits: self.limits,
            no_chat_template: self.template_is_fallback,
        }
    }
}
