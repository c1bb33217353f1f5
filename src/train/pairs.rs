//! The run's preference pairs (`[training] method = "dpo" | "orpo"`), read, tokenized and
//! linted: what the preference step trains on (`train::preference`) and what the memory plan
//! sizes a pair batch by (`train::samples::trained_tokens`). Both import it; it imports
//! neither.

use crate::data::lints::Lint;
use crate::data::preference::{is_preference_data, lint_pairs, PreferencePair, PreferencePipeline};

use super::config::RunConfig;
use super::error::TrainError;

/// The tokenized pairs of the run's splits.
#[derive(Debug, Clone, Default)]
pub struct PairSplits {
    /// Training pairs.
    pub train: Vec<PreferencePair>,
    /// Validation pairs (empty: no evaluation).
    pub eval: Vec<PreferencePair>,
    /// The pair lints of the training split.
    pub lints: Vec<Lint>,
}

/// Reads the run's data as preference pairs (detected from the first row, as `tunestudio
/// preview` does), tokenized with `[preference]`'s lengths; an error-level pair lint that
/// `[data] allow` does not name, or no training pair, stops the run here.
pub fn load_pair_splits(
    config: &RunConfig,
    tok: &crate::data::TokenizerBundle,
) -> Result<PairSplits, TrainError> {
    let data_cfg = config.resolved_data();
    let data_error = |e: crate::data::DataError| TrainError::Data {
        context: format!(
            "cannot read the preference pairs of `{}` (data.path)",
            data_cfg.path
        ),
        message: e.to_string(),
    };
    let opened = crate::data::open_data(&data_cfg).map_err(data_error)?;
    if !is_preference_data(&data_cfg, &opened).map_err(data_error)? {
        return Err(TrainError::Data {
            context: format!(
                "training.method = \"{}\" trains on preference pairs",
                config.training.method.name()
            ),
            message: format!(
                "the first row of `{}` is not a pair: give `prompt`/`chosen`/`rejected` (TRL), \
                 `conversations` + `chosen` + `rejected` or `instruction` + `chosen` + `rejected` \
                 (LLaMA-Factory ranking), or `chosen_messages`/`rejected_messages` (LLaMA-Factory \
                 v1), with data.format = \"auto\"; or set training.method = \"sft\"",
                data_cfg.path
            ),
        });
    }
    let limits = config.preference.limits();
    let columns = data_cfg.columns.clone();
    let pipe = PreferencePipeline::for_dataset(tok, &opened.main, None, columns.clone(), limits)
        .map_err(data_error)?;
    let train = pipe
        .pairs(&opened.main, &opened.train_indices)
        .map_err(data_error)?;
    let mut eval = pipe
        .pairs(&opened.main, &opened.heldout_indices)
        .map_err(data_error)?;
    if let Some(v) = opened
        .separate_validation
        .as_ref()
        .filter(|v| !v.is_empty())
    {
        let vpipe =
            PreferencePipeline::for_dataset(tok, v, None, columns, limits).map_err(data_error)?;
        let all: Vec<usize> = (0..v.len()).collect();
        eval.extend(vpipe.pairs(v, &all).map_err(data_error)?);
    }
    let lints = lint_pairs(&train, &pipe.lint_context());
    let blocking = crate::data::lints::blocking(&lints, &config.data.allow);
    if !blocking.is_empty() {
        return Err(TrainError::Lints {
            lints: blocking.into_iter().cloned().collect(),
        });
    }
    if train.is_empty() {
        return Err(TrainError::EmptyDataset(format!(
            "`{}` gave 0 training pairs",
            config.data.path
        )));
    }
    Ok(PairSplits { train, eval, lints })
}
