//! Preference pairs for DPO, IPO and ORPO: a prompt with a chosen and a rejected answer.
//!
//! Data flows as for SFT, one pair per row: [`crate::data::readers`] (JSON, JSONL, CSV,
//! Parquet) → [`format`] (detect TRL, LLaMA-Factory sharegpt/alpaca ranking or v1) →
//! [`example`] ([`PreferenceExample`]) → [`tokenize`] (chat template, prompt and completion
//! tokens, truncation: [`PreferencePair`]) → [`lints`] and [`collate`] (one padded batch,
//! chosen rows then rejected rows). [`pipeline`] ties them to a dataset; [`preview`] is what
//! `tunestudio preview` shows of it.
//!
//! The losses that consume the batches are [`crate::model::preference`].

pub mod collate;
pub mod example;
pub mod format;
pub mod lints;
pub mod pipeline;
pub mod preview;
pub mod tokenize;

pub use collate::collate_pairs;
pub use example::{to_preference_example, PreferenceExample};
pub use format::{detect_preference_format, PreferenceFormat};
pub use lints::{lint_pairs, PairLintContext};
pub use pipeline::PreferencePipeline;
pub use preview::{
    is_preference_data, preview_pairs_opened, PairPreview, PairStats, PartPreview,
    PreferencePreview,
};
pub use tokenize::{
    tokenize_pair, PairCompletion, PairContext, PairLimits, PairSide, PreferencePair,
};
