//! The preview model both the CLI and the GUI render: every token of the
//! chosen rows with its text, id, label and class, plus stats and lints.

use crate::data::collate::{padded_len, CollateOptions};
use crate::data::config::{DataConfig, Format};
use crate::data::labels::{DropReason, LabelledRow, IGNORE_INDEX};
use crate::data::lints::{has_errors, lint_rows, Lint};
use crate::data::prepare::{label_dataset, open_data, OpenedData, Pipeline};
use crate::data::stats::{compute_stats, DataStats};
use crate::data::tokenizer::{PadToken, TokenizerBundle};
use crate::data::DataError;
use crate::text::{group_tokens, TokenGroup};
use serde::{Deserialize, Serialize};

/// How a token takes part in training.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenClass {
    /// Trained: the label equals the token.
    Trained,
    /// Trained, but the label differs from the token (a data bug, see the
    /// `LabelsMismatch` lint).
    Mismatch,
    /// Label -100: context only.
    Masked,
    /// Added by the collator.
    Padding,
}

/// One token.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenSpan {
    /// The text it contributes ("" for a byte that only completes with the
    /// next token).
    pub text: String,
    /// Token id.
    pub id: u32,
    /// Label (-100 = ignored).
    pub label: i64,
    /// Class.
    pub class: TokenClass,
    /// Loss weight (1 trained, 0 masked, other values from `loss_weight`).
    pub weight: f32,
    /// The bytes the token stands for: part of a character where byte-level BPE split
    /// one (see [`RowPreview::groups`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub bytes: Vec<u8>,
    /// A special token of the tokenizer (`<|im_end|>`): shown as one unit, never reordered
    /// inside.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub special: bool,
}

/// Token spans of `ids` with their label classes (`labels[i]`: −100 masked, the id itself
/// trained, anything else a mismatch) and loss weights (`weights`, else 1 trained and 0
/// masked): what every preview (SFT rows, preference pairs, GRPO completions) draws as chips.
pub fn token_spans(
    tok: &TokenizerBundle,
    ids: &[u32],
    labels: &[i64],
    weights: Option<&[f32]>,
) -> Vec<TokenSpan> {
    let texts = tok.token_texts(ids);
    let bytes = tok.token_bytes(ids);
    ids.iter()
        .zip(labels)
        .zip(texts.into_iter().zip(bytes))
        .enumerate()
        .map(|(i, ((&id, &label), (text, bytes)))| {
            let class = if label == IGNORE_INDEX {
                TokenClass::Masked
            } else if label != i64::from(id) {
                TokenClass::Mismatch
            } else {
                TokenClass::Trained
            };
            let weight = match weights {
                Some(w) => w[i],
                None if class == TokenClass::Masked => 0.0,
                None => 1.0,
            };
            TokenSpan {
                text,
                id,
                label,
                class,
                weight,
                bytes,
                special: tok.is_special(id),
            }
        })
        .collect()
}

impl TokenSpan {
    /// The token's bytes, or its text where the tokenizer gave none (an id outside the
    /// vocabulary in pre-tokenised data).
    pub fn shown_bytes(&self) -> &[u8] {
        if self.bytes.is_empty() {
            self.text.as_bytes()
        } else {
            &self.bytes
        }
    }
}

/// Which split a row belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SplitName {
    /// Training.
    Train,
    /// Held out by `validation_ratio`.
    Validation,
}

/// One previewed row.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RowPreview {
    /// Row index in `data.path`.
    pub index: usize,
    /// "file line N" / "file row N".
    pub location: String,
    /// Train or held-out validation.
    pub split: SplitName,
    /// The rendered text (template output / concatenated prompt+completion).
    pub text: Option<String>,
    /// Tokens, padded to the length of the batch this row would be in.
    pub tokens: Vec<TokenSpan>,
    /// Real tokens (after truncation).
    pub num_tokens: usize,
    /// Tokens the loss sees.
    pub num_trained: usize,
    /// Tokens before truncation.
    pub full_len: usize,
    /// Cut at `max_length`.
    pub truncated: bool,
    /// Trained tokens were cut.
    pub completion_truncated: bool,
    /// Why it is not trained on, if dropped.
    pub dropped: Option<DropReason>,
}

impl RowPreview {
    /// The first `limit` tokens grouped into whole characters: a token holding part of a
    /// character is shown with the tokens that complete it.
    pub fn groups(&self, limit: usize) -> Vec<TokenGroup> {
        let shown = &self.tokens[..limit.min(self.tokens.len())];
        let bytes: Vec<&[u8]> = shown.iter().map(TokenSpan::shown_bytes).collect();
        group_tokens(&bytes)
    }
}

/// The whole preview.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DataPreview {
    /// The resolved format.
    pub format: Format,
    /// Whether prompts are masked.
    pub completions_only: bool,
    /// Rows in `data.path`.
    pub num_rows: usize,
    /// Training rows / held-out rows.
    pub num_train_rows: usize,
    /// Held-out or separate validation rows.
    pub num_validation_rows: usize,
    /// The previewed rows.
    pub rows: Vec<RowPreview>,
    /// Stats of the scanned training rows.
    pub stats: DataStats,
    /// Whether stats/lints cover every training row (else only the previewed ones).
    pub full_scan: bool,
    /// Lints, worst first.
    pub lints: Vec<Lint>,
    /// Pad token used.
    pub pad_id: u32,
    /// Pad is the EOS fallback.
    pub pad_is_fallback: bool,
    /// Where the chat template came from (None: no template / not chat).
    pub chat_template_origin: Option<String>,
    /// `max_length`.
    pub max_length: usize,
    /// Batch size assumed for padding.
    pub batch_size: usize,
}

impl DataPreview {
    /// Whether an error-level lint fired (the CLI exits non-zero).
    pub fn has_errors(&self) -> bool {
        has_errors(&self.lints)
    }
}

/// Which rows to show.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RowSelection {
    /// The first `n` rows.
    First(usize),
    /// These row indices.
    Indices(Vec<usize>),
}

/// Preview settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreviewOptions {
    /// Rows to show.
    pub rows: RowSelection,
    /// Batch size for padding display and the padding-waste stat.
    pub batch_size: usize,
    /// Tokenise every training row for stats and lints (fast: ~0.1 ms per
    /// row); `false` reads only the shown rows (huge JSONL files).
    pub full_scan: bool,
}

impl Default for PreviewOptions {
    fn default() -> Self {
        PreviewOptions {
            rows: RowSelection::First(5),
            batch_size: 8,
            full_scan: true,
        }
    }
}

/// Builds the preview for `cfg`.
pub fn preview_dataset(
    cfg: &DataConfig,
    tok: &TokenizerBundle,
    opts: &PreviewOptions,
) -> Result<DataPreview, DataError> {
    let data = open_data(cfg)?;
    preview_opened(cfg, tok, &data, opts)
}

/// [`preview_dataset`] on already opened data.
pub fn preview_opened(
    cfg: &DataConfig,
    tok: &TokenizerBundle,
    data: &OpenedData,
    opts: &PreviewOptions,
) -> Result<DataPreview, DataError> {
    let n = data.main.len();
    let indices: Vec<usize> = match &opts.rows {
        RowSelection::First(k) => (0..(*k).min(n)).collect(),
        RowSelection::Indices(v) => {
            if let Some(bad) = v.iter().find(|&&i| i >= n) {
                return Err(DataError::Config {
                    setting: "--row".into(),
                    message: format!(
                        "row {bad} is out of range: the dataset has {n} rows (0..{})",
                        n.saturating_sub(1)
                    ),
                });
            }
            v.clone()
        }
    };
    let first = data.main.row(0)?;
    let pipe = Pipeline::new(cfg, tok, &first, &data.main.location(0))?;
    let shown = label_dataset(&pipe, &data.main, &indices, true)?;
    let (stats_rows, full_scan) = if opts.full_scan {
        (
            label_dataset(&pipe, &data.main, &data.train_indices, false)?,
            true,
        )
    } else {
        (shown.clone(), false)
    };
    let lints = lint_rows(&stats_rows, &pipe.lint_context());
    let stats = compute_stats(&stats_rows, opts.batch_size, cfg.max_length);
    let pad = tok.pad();
    let rows = row_previews(tok, &shown, data, pad, opts.batch_size, cfg.max_length);
    Ok(DataPreview {
        format: pipe.format,
        completions_only: pipe.completions_only,
        num_rows: n,
        num_train_rows: data.train_indices.len(),
        num_validation_rows: data.heldout_indices.len()
            + data.separate_validation.as_ref().map_or(0, |v| v.len()),
        rows,
        stats,
        full_scan,
        lints,
        pad_id: pad.id,
        pad_is_fallback: pad.is_fallback,
        chat_template_origin: if pipe.is_chat() {
            Some(
                tok.chat_template_origin
                    .clone()
                    .unwrap_or_else(|| "built-in ChatML fallback".into()),
            )
        } else {
            None
        },
        max_length: cfg.max_length,
        batch_size: opts.batch_size,
    })
}

/// Token spans of labelled rows, each padded to the length of the batch it
/// falls in (consecutive groups of `batch_size` of the shown rows).
pub fn row_previews(
    tok: &TokenizerBundle,
    rows: &[LabelledRow],
    data: &OpenedData,
    pad: PadToken,
    batch_size: usize,
    max_length: usize,
) -> Vec<RowPreview> {
    let opts = CollateOptions::new(pad.id, max_length);
    let pad_text = tok.token_texts(&[pad.id]).pop().unwrap_or_default();
    let pad_bytes = tok.token_bytes(&[pad.id]).pop().unwrap_or_default();
    let mut out = Vec::with_capacity(rows.len());
    for group in rows.chunks(batch_size.max(1)) {
        let longest = group
            .iter()
            .filter(|r| r.dropped.is_none())
            .map(|r| r.sample.len())
            .max()
            .unwrap_or(0);
        let width = padded_len(longest, &opts);
        for r in group {
            let s = &r.sample;
            let mut tokens = token_spans(tok, &s.input_ids, &s.labels, s.weights.as_deref());
            if r.dropped.is_none() {
                for _ in s.len()..width {
                    tokens.push(TokenSpan {
                        text: pad_text.clone(),
                        id: pad.id,
                        label: IGNORE_INDEX,
                        class: TokenClass::Padding,
                        weight: 0.0,
                        bytes: pad_bytes.clone(),
                        special: tok.is_special(pad.id),
                    });
                }
            }
            out.push(RowPreview {
                index: s.row,
                location: data.main.location(s.row),
                split: if data.is_heldout(s.row) {
                    SplitName::Validation
                } else {
                    SplitName::Train
                },
                text: r.text.clone(),
                tokens,
                num_tokens: s.len(),
                num_trained: s.num_trained(),
                full_len: r.full_len,
                truncated: r.truncated,
                completion_truncated: r.completion_truncated,
                dropped: r.dropped,
            });
        }
    }
    out
}
