//! The pair preview both front ends render: for a few pairs, the prompt, the chosen and the
//! rejected completion as tokens with their label classes, their lengths and what truncation
//! cut; then pair stats and the pair lints over the training rows.

use super::format::{detect_preference_format, PreferenceFormat};
use super::lints::lint_pairs;
use super::pipeline::PreferencePipeline;
use super::tokenize::{PairCompletion, PairLimits, PairSide, PreferencePair};
use crate::data::config::{DataConfig, Format};
use crate::data::labels::IGNORE_INDEX;
use crate::data::lints::Lint;
use crate::data::prepare::OpenedData;
use crate::data::preview::{token_spans, PreviewOptions, RowSelection, SplitName, TokenSpan};
use crate::data::tokenizer::TokenizerBundle;
use crate::data::DataError;
use crate::text::{group_tokens, TokenGroup};
use serde::{Deserialize, Serialize};

/// One part of a pair (the prompt, or a completion) as tokens.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PartPreview {
    /// Its tokens after truncation (the prompt's all masked).
    pub tokens: Vec<TokenSpan>,
    /// Tokens before truncation.
    pub full_len: usize,
    /// Tokens truncation dropped: from the prompt's start, from a completion's end.
    pub cut: usize,
    /// Tokens the loss scores (0 for the prompt).
    pub num_trained: usize,
    /// EOS was appended because nothing closed the answer (completions only).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub eos_appended: bool,
    /// The rendered conversation with this answer does not start with the prompt's tokens.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub prompt_differs: bool,
}

impl PartPreview {
    /// Tokens after truncation.
    pub fn num_tokens(&self) -> usize {
        self.tokens.len()
    }

    /// The tokens grouped into whole characters (see [`crate::data::RowPreview::groups`]).
    pub fn groups(&self) -> Vec<TokenGroup> {
        let bytes: Vec<&[u8]> = self.tokens.iter().map(TokenSpan::shown_bytes).collect();
        group_tokens(&bytes)
    }
}

/// One previewed pair.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PairPreview {
    /// Row index in `data.path`.
    pub index: usize,
    /// "file line N" / "file row N".
    pub location: String,
    /// Train or held-out validation.
    pub split: SplitName,
    /// The prompt (masked).
    pub prompt: PartPreview,
    /// The preferred completion.
    pub chosen: PartPreview,
    /// The dispreferred completion.
    pub rejected: PartPreview,
}

impl PairPreview {
    /// One of the completions.
    pub fn completion(&self, side: PairSide) -> &PartPreview {
        match side {
            PairSide::Chosen => &self.chosen,
            PairSide::Rejected => &self.rejected,
        }
    }
}

/// Length and truncation figures over the scanned training pairs.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PairStats {
    /// Pairs scanned.
    pub num_pairs: usize,
    /// Mean prompt tokens (after truncation).
    pub mean_prompt: f64,
    /// Longest prompt (after truncation).
    pub max_prompt: usize,
    /// Mean chosen completion tokens (after truncation).
    pub mean_chosen: f64,
    /// Mean rejected completion tokens (after truncation).
    pub mean_rejected: f64,
    /// Longest `prompt + completion` sequence (what a batch pads to).
    pub max_sequence: usize,
    /// Pairs whose prompt lost tokens from its start.
    pub num_prompt_cut: usize,
    /// Pairs with a completion that lost tokens from its end.
    pub num_completion_cut: usize,
}

impl PairStats {
    fn of(pairs: &[PreferencePair]) -> Self {
        let n = pairs.len().max(1) as f64;
        let sum = |f: &dyn Fn(&PreferencePair) -> usize| pairs.iter().map(f).sum::<usize>() as f64;
        PairStats {
            num_pairs: pairs.len(),
            mean_prompt: sum(&|p| p.prompt_ids.len()) / n,
            max_prompt: pairs.iter().map(|p| p.prompt_ids.len()).max().unwrap_or(0),
            mean_chosen: sum(&|p| p.chosen.ids.len()) / n,
            mean_rejected: sum(&|p| p.rejected.ids.len()) / n,
            max_sequence: pairs.iter().map(PreferencePair::len).max().unwrap_or(0),
            num_prompt_cut: pairs.iter().filter(|p| p.prompt_cut() > 0).count(),
            num_completion_cut: pairs
                .iter()
                .filter(|p| p.chosen.is_truncated() || p.rejected.is_truncated())
                .count(),
        }
    }
}

/// The whole pair preview.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PreferencePreview {
    /// The resolved pair format.
    pub format: PreferenceFormat,
    /// Rows (pairs) in `data.path`.
    pub num_rows: usize,
    /// Training rows.
    pub num_train_rows: usize,
    /// Held-out or separate validation rows.
    pub num_validation_rows: usize,
    /// The truncation lengths.
    pub limits: PairLimits,
    /// Where the chat template came from.
    pub chat_template_origin: String,
    /// The previewed pairs.
    pub pairs: Vec<PairPreview>,
    /// Figures over the scanned training pairs.
    pub stats: PairStats,
    /// Whether stats and lints cover every training pair (else only the shown ones).
    pub full_scan: bool,
    /// The pair lints, worst first.
    pub lints: Vec<Lint>,
}

/// Whether `data` is read as preference pairs: the format is `auto` and the first row is a
/// preference row (TRL, LLaMA-Factory ranking or v1).
pub fn is_preference_data(cfg: &DataConfig, data: &OpenedData) -> Result<bool, DataError> {
    if cfg.format != Format::Auto || data.main.is_empty() {
        return Ok(false);
    }
    let first = data.main.row(0)?;
    Ok(detect_preference_format(&first, &cfg.columns).is_some())
}

/// Builds the pair preview of already opened data.
pub fn preview_pairs_opened(
    cfg: &DataConfig,
    tok: &TokenizerBundle,
    data: &OpenedData,
    opts: &PreviewOptions,
    limits: PairLimits,
) -> Result<PreferencePreview, DataError> {
    let n = data.main.len();
    let indices = shown_indices(&opts.rows, n)?;
    let pipe = PreferencePipeline::for_dataset(tok, &data.main, None, cfg.columns.clone(), limits)?;
    let shown = pipe.pairs(&data.main, &indices)?;
    let (scanned, full_scan) = if opts.full_scan {
        (pipe.pairs(&data.main, &data.train_indices)?, true)
    } else {
        (shown.clone(), false)
    };
    let pairs = shown
        .iter()
        .map(|p| PairPreview {
            index: p.row,
            location: data.main.location(p.row),
            split: if data.is_heldout(p.row) {
                SplitName::Validation
            } else {
                SplitName::Train
            },
            prompt: prompt_part(tok, p),
            chosen: completion_part(tok, &p.chosen),
            rejected: completion_part(tok, &p.rejected),
        })
        .collect();
    Ok(PreferencePreview {
        format: pipe.format,
        num_rows: n,
        num_train_rows: data.train_indices.len(),
        num_validation_rows: data.heldout_indices.len()
            + data.separate_validation.as_ref().map_or(0, |v| v.len()),
        limits,
        chat_template_origin: if pipe.template_is_fallback {
            "built-in ChatML fallback".into()
        } else {
            tok.chat_template_origin
                .clone()
                .unwrap_or_else(|| "the tokenizer's".into())
        },
        pairs,
        stats: PairStats::of(&scanned),
        full_scan,
        lints: lint_pairs(&scanned, &pipe.lint_context()),
    })
}

/// The row indices to show; an index past the end is a `--row` error.
fn shown_indices(rows: &RowSelection, n: usize) -> Result<Vec<usize>, DataError> {
    match rows {
        RowSelection::First(k) => Ok((0..(*k).min(n)).collect()),
        RowSelection::Indices(v) => match v.iter().find(|&&i| i >= n) {
            Some(bad) => Err(DataError::Config {
                setting: "--row".into(),
                message: format!(
                    "row {bad} is out of range: the dataset has {n} rows (0..{})",
                    n.saturating_sub(1)
                ),
            }),
            None => Ok(v.clone()),
        },
    }
}

fn prompt_part(tok: &TokenizerBundle, p: &PreferencePair) -> PartPreview {
    let labels = vec![IGNORE_INDEX; p.prompt_ids.len()];
    PartPreview {
        tokens: token_spans(tok, &p.prompt_ids, &labels, None),
        full_len: p.prompt_full_len,
        cut: p.prompt_cut(),
        num_trained: 0,
        eos_appended: false,
        prompt_differs: false,
    }
}

fn completion_part(tok: &TokenizerBundle, c: &PairCompletion) -> PartPreview {
    PartPreview {
        tokens: token_spans(tok, &c.ids, &c.labels, None),
        full_len: c.full_len,
        cut: c.cut(),
        num_trained: c.num_trained(),
        eos_appended: c.eos_appended,
        prompt_differs: c.prompt_differs,
    }
}
