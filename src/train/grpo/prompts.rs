//! The run's GRPO prompts, read and linted as the trainer starts, with the reward functions'
//! own findings (an accuracy reward whose answer column the rows lack) beside the data's.

use crate::data::lints::Lint;
use crate::data::prompts::{answer_column_lint, read_prompts, PromptSet, PromptSettings};
use crate::model::ModelLocation;
use crate::train::grpo_rewards::RewardKind;

use super::super::config::RunConfig;
use super::super::error::TrainError;
use super::super::samples::Splits;
use super::GrpoRun;

/// Reads the run's prompts (`data.path`) as the trainer and `tunestudio preview` do.
pub fn load_prompts(
    config: &RunConfig,
    tok: &crate::data::TokenizerBundle,
) -> Result<PromptSet, TrainError> {
    let data_cfg = config.resolved_data();
    let settings = PromptSettings {
        max_prompt_length: Some(config.grpo.max_prompt_length),
        columns: data_cfg.columns.clone(),
    };
    read_prompts(&data_cfg.path, tok, &settings).map_err(|e| TrainError::Data {
        context: format!(
            "cannot read the GRPO prompts of `{}` (data.path)",
            data_cfg.path
        ),
        message: e.to_string(),
    })
}

/// The lints of a GRPO run: the prompts', each accuracy reward's answer column, and the
/// settings lints.
pub fn prompt_lints(config: &RunConfig, set: &PromptSet, has_weights: bool) -> Vec<Lint> {
    let mut lints = set.lints.clone();
    for spec in &config.grpo.reward {
        if spec.kind == RewardKind::Accuracy {
            lints.extend(answer_column_lint(&set.rows, spec.column(), &spec.name()));
        }
    }
    let ctx = super::super::settings_lints::SettingsContext::new(
        config,
        has_weights,
        set.rows.len(),
        set.rows.iter().map(|r| r.len()).max().unwrap_or(0),
    );
    lints.extend(super::super::settings_lints::settings_lints(config, &ctx));
    lints
}

/// The prompts with every lint; an error-level one that `[data] allow` does not name, or no
/// prompt, stops the run here, before the weights load. Then the reward functions start.
pub fn load_checked_prompts(
    config: &RunConfig,
    tok: &crate::data::TokenizerBundle,
    located: &ModelLocation,
) -> Result<(Splits, GrpoRun), TrainError> {
    let set = load_prompts(config, tok)?;
    let lints = prompt_lints(config, &set, located.has_weights);
    let blocking = crate::data::lints::blocking(&lints, &config.data.allow);
    if !blocking.is_empty() {
        return Err(TrainError::Lints {
            lints: blocking.into_iter().cloned().collect(),
        });
    }
    if set.rows.is_empty() {
        return Err(TrainError::EmptyDataset(format!(
            "`{}` gave 0 prompts",
            config.data.path
        )));
    }
    let warnings = lints
        .iter()
        .filter(|l| l.severity != crate::data::lints::Severity::Info)
        .map(|l| l.message.clone())
        .collect();
    let model_config = crate::model::ModelConfig::from_file(&located.config).map_err(|cause| {
        TrainError::Model {
            context: format!("cannot read `{}`", located.config.display()),
            cause,
        }
    })?;
    let eos_ids = crate::infer::generator::eos_ids(&model_config, &[located.dir.as_path()], tok);
    let splits = Splits {
        train: Vec::new(),
        eval: Vec::new(),
        warnings,
        lints,
    };
    let run = GrpoRun::new(config, set.rows, tok.clone(), eos_ids)?;
    Ok((splits, run))
}
