//! The rollout preview: before the first step, a few prompts' groups sampled with the run's
//! model and settings and scored by every reward function, so a user sees a reward that is
//! always 0 (a format regex that never matches, an answer column never found) before spending
//! an hour on a run that cannot learn.

use candle_core::Device;

use crate::data::lints::Lint;
use crate::data::{token_spans, TokenSpan};
use crate::infer::InferModel;

use super::config::RunConfig;
use super::error::TrainError;
use super::grpo::{prompt_lints, GrpoRun, StepRollouts};
use super::samples;

/// One previewed completion.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct PreviewCompletion {
    /// The completion's text (special tokens left out, as the reward functions read it).
    pub text: String,
    /// Its tokens, in order (the EOS shown as itself), as the previews' chips: every one
    /// trained.
    pub tokens: Vec<TokenSpan>,
    /// Each reward function's value, in `[[grpo.reward]]` order.
    pub rewards: Vec<f32>,
    /// The weighted sum.
    pub reward: f32,
    /// Its advantage over its group.
    pub advantage: f32,
    /// It hit `max_completion_length` without an EOS.
    pub truncated: bool,
}

/// One prompt's group.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct PreviewGroup {
    /// The prompt's dataset row.
    pub row: usize,
    /// The prompt as the model sees it (template applied).
    pub prompt: String,
    /// Its prompt tokens.
    pub prompt_tokens: usize,
    /// The sampled completions.
    pub completions: Vec<PreviewCompletion>,
}

/// What `tunestudio preview` and the studio show of a GRPO run before it starts.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RolloutPreview {
    /// The prompts of the training data.
    pub num_prompts: usize,
    /// The reward functions' names.
    pub reward_names: Vec<String>,
    /// The previewed groups.
    pub groups: Vec<PreviewGroup>,
    /// TRL's metrics of them (`reward`, `rewards/<name>/mean`, `frac_reward_zero_std`, …).
    pub metrics: Vec<(String, f64)>,
    /// The prompts', the rewards' and the settings' findings, and the zero-advantage one.
    pub lints: Vec<Lint>,
}

/// Samples `num_generations` completions for each of `prompts` prompts from the `first` with
/// the run's model (its weights as the run starts: pretrained, or random from the seed; LoRA
/// adapters added but untrained) on the CPU, and scores them.
pub fn rollout_preview(
    config: &RunConfig,
    first: usize,
    prompts: usize,
) -> Result<RolloutPreview, TrainError> {
    let located = samples::locate_model(config)?;
    let tok = samples::load_tokenizer(&located.dir)?;
    let set = super::grpo::load_prompts(config, &tok)?;
    let mut lints = prompt_lints(config, &set, located.has_weights);
    let model_config = crate::model::ModelConfig::from_file(&located.config).map_err(|cause| {
        TrainError::Model {
            context: format!("cannot read `{}`", located.config.display()),
            cause,
        }
    })?;
    let eos_ids = crate::infer::generator::eos_ids(&model_config, &[located.dir.as_path()], &tok);
    let first = first.min(set.rows.len().saturating_sub(1));
    let shown: Vec<usize> = (first..(first + prompts).min(set.rows.len())).collect();
    let num_prompts = set.rows.len();
    let run = GrpoRun::new(config, set.rows, tok.clone(), eos_ids)?;
    let (model, _) = super::step::build_model(config, &Device::Cpu)?;
    let infer = InferModel::from_causal_lm(&model).map_err(|cause| TrainError::Rollout {
        step: 0,
        context: "viewing the model's weights for sampling".into(),
        cause: Box::new(cause),
    })?;
    let rollouts = run.rollouts(&infer, &shown, config.training.seed, 0)?;
    lints.extend(zero_advantage_lint(&rollouts));
    Ok(RolloutPreview {
        num_prompts,
        reward_names: rollouts.reward_names.clone(),
        groups: groups(&run, &tok, &rollouts),
        metrics: rollouts.metrics.named(),
        lints,
    })
}

/// The rollouts grouped by prompt, with each completion's token texts.
fn groups(
    run: &GrpoRun,
    tok: &crate::data::TokenizerBundle,
    rollouts: &StepRollouts,
) -> Vec<PreviewGroup> {
    let g = run.settings.num_generations.max(1);
    rollouts
        .rows
        .chunks(g)
        .map(|group| {
            let p = &run.prompts[group[0].prompt];
            PreviewGroup {
                row: p.index,
                prompt: p.prompt_text.clone(),
                prompt_tokens: p.prompt_ids.len(),
                completions: group
                    .iter()
                    .map(|r| PreviewCompletion {
                        text: r.text.clone(),
                        tokens: token_spans(
                            tok,
                            &r.completion_ids,
                            &labels_of(&r.completion_ids),
                            None,
                        ),
                        rewards: r.rewards.clone(),
                        reward: r.reward,
                        advantage: r.advantage,
                        truncated: r.truncated,
                    })
                    .collect(),
            }
        })
        .collect()
}

/// Every token of a completion is trained: its label is itself.
fn labels_of(ids: &[u32]) -> Vec<i64> {
    ids.iter().map(|&id| i64::from(id)).collect()
}

/// Every previewed group had equal rewards: every advantage is 0, so nothing would be learned
/// from these prompts.
fn zero_advantage_lint(rollouts: &StepRollouts) -> Option<Lint> {
    if rollouts.rows.is_empty() || rollouts.metrics.frac_reward_zero_std < 1.0 {
        return None;
    }
    let value = rollouts.rows[0].reward;
    Some(crate::data::lints::grpo_zero_advantage(
        rollouts.rows.len(),
        f64::from(value),
        &rollouts.reward_names,
    ))
}
