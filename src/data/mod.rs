//! Datasets, chat templates, label masks, lints and the token preview.
//!
//! Data flows: [`DataConfig`] → [`readers`] (files, folders, hub datasets;
//! rows as JSON objects) → [`formats`] (detect the format, turn rows into
//! [`Example`]s) → [`labels`] (render the chat template, tokenise, mask,
//! truncate) → [`lints`] + [`stats`] → [`collate`] (padded [`Batch`]es for
//! the trainer) or [`preview`] (token spans for the CLI and the GUI).
//! Preference pairs (DPO, IPO, ORPO) take the same readers through
//! [`preference`]: formats, pair tokenisation, pair lints and pair batches.
//!
//! Entry points:
//! * [`TokenizerBundle::load`] / [`TokenizerBundle::from_source`]
//! * [`prepare_dataset`] → [`PreparedData`] (samples, stats, lints)
//! * [`preview_dataset`] → [`DataPreview`]
//! * [`collate`] / [`batch_indices`] → [`Batch`] → [`Batch::to_tensors`]
//!
//! Nothing here prints.

pub mod collate;
pub mod config;
pub mod error;
pub mod formats;
pub mod hub;
pub mod labels;
pub mod lints;
pub mod preference;
pub mod prepare;
pub mod preview;
pub mod prompts;
pub mod readers;
pub mod stats;
pub mod template;
pub mod tokenizer;

pub use collate::{batch_indices, collate, padded_len, Batch, CollateOptions};
pub use config::{ColumnMapping, DataConfig, Format, TxtSplit};
pub use error::DataError;
pub use formats::{detect_format, to_example, Example};
pub use labels::{
    label_example, pack, DropReason, LabelContext, LabelledRow, TokenizedSample, IGNORE_INDEX,
};
pub use lints::{has_errors, lint_rows, Lint, LintKind, Severity};
pub use prepare::{
    label_dataset, open_data, open_data_with_cache, prepare_dataset, prepare_opened, split_indices,
    OpenedData, Pipeline, PreparedData,
};
pub use preview::{
    preview_dataset, preview_opened, token_spans, DataPreview, PreviewOptions, RowPreview,
    RowSelection, SplitName, TokenClass, TokenSpan,
};
pub use readers::{Dataset, FileKind, ResolvedSource};
pub use stats::{largest_trained_counts, DataStats, LengthHistogram};
pub use template::{ChatMessage, ChatTemplate, TemplateTokens};
pub use tokenizer::{PadToken, TokenizerBundle, TokenizerPaths};
