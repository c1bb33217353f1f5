//! The bridge to [`crate::data`]: tokenizer, prepared splits and padded batches as tensors.

use std::path::Path;

use candle_core::{Device, Tensor};

use crate::data::{CollateOptions, TokenizerBundle};

use super::config::RunConfig;
use super::error::TrainError;

/// The run's model folder, its `config.json` and whether it has weights, without reading them
/// ([`crate::model::locate_model`] with the run config's source).
pub(crate) fn locate_model(config: &RunConfig) -> Result<crate::model::ModelLocation, TrainError> {
    let source = config.model_source();
    crate::model::locate_model(&source).map_err(|cause| TrainError::Model {
        context: format!("cannot find the model `{source}` (model.source)"),
        cause,
    })
}

/// A tokenised, labelled sample.
pub type Sample = crate::data::TokenizedSample;

/// The prepared training and validation samples.
#[derive(Debug, Clone, Default)]
pub struct Splits {
    /// Training samples.
    pub train: Vec<Sample>,
    /// Validation samples (empty = no evaluation).
    pub eval: Vec<Sample>,
    /// Things the user should know about the data (lints, ignored settings).
    pub warnings: Vec<String>,
    /// The lints of both splits (error-level ones stop the run unless allowed).
    pub lints: Vec<crate::data::lints::Lint>,
}

/// A micro-batch on the device.
#[derive(Debug)]
pub struct TensorBatch {
    /// `[b, t]` u32.
    pub input_ids: Tensor,
    /// `[b, t]` u32, 1 = real token.
    pub attention_mask: Tensor,
    /// `[b, t]` i64, -100 = ignored (unshifted; the model shifts).
    pub labels: Tensor,
    /// Rows.
    pub rows: usize,
    /// Padded length.
    pub seq_len: usize,
    /// Label tokens the loss sees.
    pub trained_tokens: usize,
}

/// Loads the model folder's tokenizer.
pub fn load_tokenizer(model_dir: &Path) -> Result<TokenizerBundle, TrainError> {
    TokenizerBundle::load(model_dir).map_err(|e| TrainError::Data {
        context: format!("cannot load the tokenizer of `{}`", model_dir.display()),
        message: e.to_string(),
    })
}

/// Fails when the tokenizer can produce ids the model has no embedding row for.
pub fn check_vocab(
    tok: &TokenizerBundle,
    model_dir: &Path,
    model_vocab: usize,
) -> Result<(), TrainError> {
    let tokenizer_vocab = tok.vocab_size();
    if tokenizer_vocab > model_vocab {
        return Err(TrainError::VocabMismatch {
            tokenizer: tok.origin.join("tokenizer.json"),
            tokenizer_vocab,
            model_config: model_dir.join("config.json"),
            model_vocab,
        });
    }
    Ok(())
}

/// Reads, splits, tokenises and labels the run's data.
pub fn load_splits(config: &RunConfig, tok: &TokenizerBundle) -> Result<Splits, TrainError> {
    let data_cfg = config.resolved_data();
    let prepared = crate::data::prepare_dataset(&data_cfg, tok, config.training.micro_batch)
        .map_err(|e| TrainError::Data {
            context: format!("cannot prepare the dataset `{}` (data.path)", data_cfg.path),
            message: e.to_string(),
        })?;
    let mut warnings: Vec<String> = prepared
        .lints
        .iter()
        .chain(prepared.validation_lints.iter())
        .filter(|l| l.severity != crate::data::lints::Severity::Info)
        .map(|l| l.message.clone())
        .collect();
    if prepared.train.iter().any(|s| s.weights.is_some()) {
        warnings.push(
            "some rows carry per-turn loss weights other than 0 and 1; the trainer trains every labelled token with weight 1"
                .into(),
        );
    }
    Ok(Splits {
        train: prepared.train,
        eval: prepared.validation,
        warnings,
        lints: prepared
            .lints
            .into_iter()
            .chain(prepared.validation_lints)
            .collect(),
    })
}

/// The run's splits, with the settings lints beside the data's: an error-level lint that
/// `[data] allow` does not name, or no training row, stops the run here, before the weights
/// load.
pub fn load_checked_splits(
    config: &RunConfig,
    tok: &TokenizerBundle,
    has_weights: bool,
) -> Result<Splits, TrainError> {
    let mut splits = load_splits(config, tok)?;
    let settings = super::settings_lints::settings_lints(
        config,
        &settings_context(config, has_weights, &splits.train),
    );
    splits.warnings.extend(settings_warnings(&settings));
    splits.lints.extend(settings);
    let blocking = crate::data::lints::blocking(&splits.lints, &config.data.allow);
    if !blocking.is_empty() {
        return Err(TrainError::Lints {
            lints: blocking.into_iter().cloned().collect(),
        });
    }
    if splits.train.is_empty() {
        return Err(TrainError::EmptyDataset(format!(
            "`{}` gave 0 training rows",
            config.data.path
        )));
    }
    Ok(splits)
}

/// The warning-level settings lints, as the run's warnings (an error-level one stops the run
/// or, allowed by name, is reported as allowed).
pub(super) fn settings_warnings(lints: &[crate::data::Lint]) -> Vec<String> {
    lints
        .iter()
        .filter(|l| l.severity == crate::data::lints::Severity::Warning)
        .map(|l| l.message.clone())
        .collect()
}

/// What the settings lints need to know of the model and the data.
pub fn settings_context(
    config: &RunConfig,
    has_weights: bool,
    train: &[Sample],
) -> super::settings_lints::SettingsContext {
    super::settings_lints::SettingsContext::new(
        config,
        has_weights,
        train.len(),
        train.iter().map(Sample::len).max().unwrap_or(0),
    )
}

/// The trained tokens of the run's data for the memory plan (`PlanRequest::trained_tokens`):
/// loads the model's tokenizer and tokenizes the dataset as the trainer does before its first
/// step, then [`split_trained_tokens`]; for preference training (`[training] method =
/// "dpo" | "orpo"`) the pairs, then [`pair_trained_tokens`].
pub fn trained_tokens(
    config: &RunConfig,
) -> Result<Option<crate::plan::TrainedTokens>, TrainError> {
    let tok = load_tokenizer(&locate_model(config)?.dir)?;
    if config.training.method.is_preference() {
        let pairs = super::pairs::load_pair_splits(config, &tok)?;
        return Ok(Some(pair_trained_tokens(config, &pairs.train)));
    }
    let splits = load_splits(config, &tok)?;
    Ok(split_trained_tokens(config, &splits.train))
}

/// The trained tokens of the training split's samples: the rows the loss (fused or generic) computes
/// logits for. Every front end derives them the same way (the studio from its Preview scan of
/// the same rows), so they plan the same layer split: the training split only (evaluation
/// batches are taken to be no fuller), and `None` with packing (the studio's scan is not
/// packed; a packed sequence trains nearly every position anyway).
pub fn split_trained_tokens(
    config: &RunConfig,
    train: &[Sample],
) -> Option<crate::plan::TrainedTokens> {
    rows_trained_tokens(config, train.iter())
}

/// The trained tokens and longest row of `rows` (a split, or the rows of one step); `None` with
/// packing, as [`split_trained_tokens`].
pub fn rows_trained_tokens<'a>(
    config: &RunConfig,
    rows: impl Iterator<Item = &'a Sample> + Clone,
) -> Option<crate::plan::TrainedTokens> {
    (!config.data.packing).then(|| {
        crate::plan::TrainedTokens::from_counts(
            config.data.max_length,
            rows.clone().map(Sample::len).max().unwrap_or(0),
            crate::data::largest_trained_counts(rows),
        )
    })
}

/// What a preference run's plan needs of its pairs: the longest pair (prompt + the longer
/// completion, after truncation), which bounds every micro-batch's padded length. A
/// preference step's loss takes the full logits of every position
/// ([`crate::plan::HeadLoss::FullLogits`]), so no trained-token counts are kept.
pub fn pair_trained_tokens(
    config: &RunConfig,
    pairs: &[crate::data::preference::PreferencePair],
) -> crate::plan::TrainedTokens {
    let p = &config.preference;
    crate::plan::TrainedTokens::from_counts(
        p.max_prompt_length + p.max_completion_length,
        pairs
            .iter()
            .map(crate::data::preference::PreferencePair::len)
            .max()
            .unwrap_or(0),
        std::iter::empty(),
    )
}

/// Pads `samples` into a batch and moves it to `device`.
pub fn collate(
    samples: &[&Sample],
    pad_id: u32,
    max_length: usize,
    device: &Device,
) -> Result<TensorBatch, candle_core::Error> {
    let batch = crate::data::collate(samples, &CollateOptions::new(pad_id, max_length));
    TensorBatch::from_batch(&batch, device)
}

impl TensorBatch {
    /// A collated batch moved to `device`.
    pub fn from_batch(
        batch: &crate::data::Batch,
        device: &Device,
    ) -> Result<TensorBatch, candle_core::Error> {
        let (input_ids, attention_mask, labels) = batch.to_tensors(device)?;
        Ok(TensorBatch {
            input_ids,
            attention_mask,
            labels,
            rows: batch.batch_size,
            seq_len: batch.seq_len,
            trained_tokens: batch.num_trained_tokens,
        })
    }
}
