//! GRPO (`[training] method = "grpo"`): the prompts, the reward functions, a step's rollouts
//! (sampled completions, their rewards and advantages) and one micro-step's loss.
//!
//! A step's work, in order ([`crate::train::TrainingRun`] drives it):
//! 1. **Rollouts** ([`rollouts`]): for each prompt of the step, `num_generations` completions
//!    sampled with the current policy (one prefill per prompt, seeded from the run's seed, the
//!    step and the prompt's row, so a resumed run samples what the uninterrupted one would);
//! 2. **Rewards**: every `[[grpo.reward]]` function scores every completion, and the weighted
//!    sum's advantage over its group is computed (TRL's `scale_rewards`);
//! 3. **Micro-steps** ([`batch`]): each micro-batch's prompts × completions, left-padded prompts
//!    and right-padded completions, run forward and backward through
//!    [`crate::model::grpo::grpo_loss`]. The loss is already the step's mean (`dapo` divides by
//!    the step's completion tokens, the others by the micro-steps), so the trainer's count for a
//!    GRPO step is 1.
//!
//! `micro_batch` counts prompts: a micro-step trains `micro_batch × num_generations` rows, in
//! `num_generations / generations_per_micro_step` passes of `micro_batch ×
//! generations_per_micro_step` rows when that is set (less memory, the same step: the rollouts
//! are sampled and scored as whole groups first, and every pass's loss divides by the whole
//! micro-batch's count).

pub mod batch;
pub mod prompts;
pub mod rollouts;

use std::sync::Mutex;

use crate::data::prompts::PromptRow;
use crate::data::TokenizerBundle;
use crate::model::grpo::{grpo_loss, model_completion_logps, GrpoLossMetrics, GrpoLossSettings};
use crate::model::{CausalLm, Gradients, ModelError};

use super::config::{GrpoSection, RunConfig};
use super::error::{Phase, TrainError};
use super::grpo_rewards::RewardSet;

pub use prompts::{load_checked_prompts, load_prompts, prompt_lints};
pub use rollouts::{Rollout, RolloutMetrics, StepRollouts};

/// Where the KL term's reference log-probabilities come from (β > 0 only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GrpoReference {
    /// β = 0: no reference, no KL term (TRL's default).
    None,
    /// LoRA: the policy with its adapters switched off (TRL's reference for a PEFT model).
    AdapterDisabled,
    /// Full fine-tuning: a frozen copy of the starting weights (TRL's `ref_model`).
    Copy,
}

impl GrpoReference {
    /// The reference `config` needs.
    pub fn of(config: &RunConfig) -> Self {
        if config.grpo.beta == 0.0 {
            GrpoReference::None
        } else if config.lora.enabled {
            GrpoReference::AdapterDisabled
        } else {
            GrpoReference::Copy
        }
    }
}

/// A GRPO run's prompts, reward functions and sampling constants.
pub struct GrpoRun {
    /// The training prompts, tokenised.
    pub prompts: Vec<PromptRow>,
    /// The reward functions (command rewards are processes started once per run).
    rewards: Mutex<RewardSet>,
    /// The run's `[grpo]` settings.
    pub settings: GrpoSection,
    /// Tokens that end a completion.
    pub eos_ids: Vec<u32>,
    /// The tokenizer (completions are decoded for the reward functions).
    tokenizer: TokenizerBundle,
    /// Where the KL reference comes from.
    pub reference: GrpoReference,
    /// The last step's completions, for the front ends.
    last: Mutex<Option<StepRollouts>>,
    /// With `num_iterations > 1`: the rollouts sampled at the first step of the current block
    /// of `num_iterations` steps, which the block's later steps train on again.
    block: Mutex<Option<GrpoBlock>>,
}

/// The rollouts `num_iterations` optimizer steps train on (TRL's buffered generation): sampled
/// at `first_step` from the prompts of `micro_batches`, each with the sampling policy's
/// log-probabilities. Saved in a checkpoint taken inside the block, so a resume continues it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GrpoBlock {
    /// The step that sampled them.
    pub first_step: u64,
    /// That step's micro-batches (prompt indices), which the block's steps train on.
    pub micro_batches: Vec<Vec<usize>>,
    /// The rollouts, with their old log-probabilities.
    pub rollouts: StepRollouts,
}

/// A checkpoint's GRPO block (`GrpoBlock`), present when it was taken inside one.
pub const BLOCK_FILE: &str = "grpo_block.json";

/// One rank's micro-step: the loss value, its completion tokens and the loss metrics.
#[derive(Debug, Clone, Copy)]
pub struct GrpoMicroStep {
    /// The micro-batch's share of the step's loss.
    pub loss: f64,
    /// Completion tokens trained.
    pub tokens: usize,
    /// `kl`, `entropy`, `clip_ratio/…`.
    pub metrics: GrpoLossMetrics,
}

/// A GRPO step's metrics under TRL's names.
#[derive(Debug, Clone, PartialEq)]
pub struct GrpoStepMetrics {
    /// Rewards, advantages and completion lengths.
    pub rollout: RolloutMetrics,
    /// `kl`, `entropy`, `clip_ratio/…`, merged over the micro-steps.
    pub loss: GrpoLossMetrics,
}

impl GrpoStepMetrics {
    /// Every metric by its TRL name.
    pub fn named(&self) -> Vec<(String, f64)> {
        let mut out = self.rollout.named();
        out.extend(
            self.loss
                .named()
                .into_iter()
                .map(|(k, v)| (k.to_string(), v)),
        );
        out
    }
}

impl GrpoRun {
    /// The run's prompts with its reward functions started (command rewards run from the
    /// config's folder).
    pub fn new(
        config: &RunConfig,
        prompts: Vec<PromptRow>,
        tokenizer: TokenizerBundle,
        eos_ids: Vec<u32>,
    ) -> Result<Self, TrainError> {
        let rewards = RewardSet::start(&config.grpo.reward, &config.base_dir).map_err(|cause| {
            TrainError::Reward {
                step: 0,
                cause: Box::new(cause),
            }
        })?;
        Ok(GrpoRun {
            prompts,
            rewards: Mutex::new(rewards),
            settings: config.grpo.clone(),
            eos_ids,
            tokenizer,
            reference: GrpoReference::of(config),
            last: Mutex::new(None),
            block: Mutex::new(None),
        })
    }

    /// The first step of the block of `num_iterations` steps that `step` (1-based) is in.
    fn block_start(&self, step: u64) -> u64 {
        let iterations = self.settings.num_iterations.max(1) as u64;
        step - (step - 1) % iterations
    }

    /// The block `step` trains on again (`None` at a block's first step, which samples, and
    /// with `num_iterations = 1`).
    pub fn reused_block(&self, step: u64) -> Option<GrpoBlock> {
        let start = self.block_start(step);
        if start == step {
            return None;
        }
        let block = self.block.lock().ok()?;
        block.as_ref().filter(|b| b.first_step == start).cloned()
    }

    /// Keeps `block` for the later steps of its block (nothing with `num_iterations = 1`).
    pub fn start_block(&self, block: GrpoBlock) {
        if self.settings.num_iterations > 1 {
            if let Ok(mut slot) = self.block.lock() {
                *slot = Some(block);
            }
        }
    }

    /// Writes the block a checkpoint after `step` needs (one whose later steps are still to
    /// come) into checkpoint folder `dir`.
    pub fn write_block(&self, dir: &std::path::Path, step: u64) -> Result<(), TrainError> {
        let Some(block) = self.reused_block(step + 1) else {
            return Ok(());
        };
        let path = dir.join(BLOCK_FILE);
        let text = serde_json::to_string(&block).map_err(|e| TrainError::Checkpoint {
            path: path.clone(),
            message: e.to_string(),
        })?;
        std::fs::write(&path, text).map_err(|cause| TrainError::Io { path, cause })
    }

    /// Reads the block a checkpoint holds, if any, so the resumed steps train on it.
    pub fn read_block(&self, dir: &std::path::Path) -> Result<(), TrainError> {
        let path = dir.join(BLOCK_FILE);
        if !path.exists() {
            return Ok(());
        }
        let text = std::fs::read_to_string(&path).map_err(|cause| TrainError::Io {
            path: path.clone(),
            cause,
        })?;
        let block: GrpoBlock = serde_json::from_str(&text).map_err(|e| TrainError::Checkpoint {
            path: path.clone(),
            message: format!("the GRPO block of rollouts: {e}"),
        })?;
        if let Ok(mut slot) = self.block.lock() {
            *slot = Some(block);
        }
        Ok(())
    }

    /// Marks `rollouts` as the last step's, for the front ends.
    pub fn set_last(&self, rollouts: &StepRollouts) {
        if let Ok(mut last) = self.last.lock() {
            *last = Some(rollouts.clone());
        }
    }

    /// The prompts' lengths (the loader groups by them when asked).
    pub fn lengths(&self) -> Vec<usize> {
        self.prompts.iter().map(PromptRow::len).collect()
    }

    /// The last step's rollouts (prompts, completions, rewards, advantages).
    pub fn last_rollouts(&self) -> Option<StepRollouts> {
        self.last.lock().ok().and_then(|l| l.clone())
    }

    /// The loss settings of a step with `step_tokens` completion tokens over `micro_steps`
    /// micro-batches (× ranks).
    pub fn loss_settings(&self, step_tokens: usize, micro_steps: usize) -> GrpoLossSettings {
        let g = &self.settings;
        GrpoLossSettings {
            loss_type: g.loss_type,
            beta: g.beta,
            epsilon_low: g.epsilon,
            epsilon_high: g.epsilon_high(),
            max_completion_length: g.max_completion_length,
            step_completion_tokens: step_tokens as f64,
            accumulation_steps: micro_steps,
            bias_correction_kl: true,
            micro_batch: None,
        }
    }

    /// Forward and backward of one rank's micro-batch, pass after pass (see
    /// [`batch::GrpoPasses`]), adding `backward_factor ×` each pass's loss's gradient into
    /// `grads`: the passes' losses divide by the micro-batch's rows and tokens, so their sum,
    /// gradient and merged metrics are the micro-batch's in one pass.
    pub fn micro_batch_step(
        &self,
        model: &CausalLm,
        copy: Option<&CausalLm>,
        passes: &batch::GrpoPasses,
        settings: &GrpoLossSettings,
        backward_factor: f64,
        grads: &mut Gradients,
    ) -> Result<GrpoMicroStep, (Phase, ModelError)> {
        let settings = GrpoLossSettings {
            micro_batch: passes.totals,
            ..settings.clone()
        };
        let mut merged: Option<GrpoMicroStep> = None;
        for batch in &passes.batches {
            let out = self.micro_step(model, copy, batch, &settings, backward_factor, grads)?;
            merged = Some(match merged {
                Some(m) => GrpoMicroStep {
                    loss: m.loss + out.loss,
                    tokens: m.tokens + out.tokens,
                    metrics: m.metrics.merge(&out.metrics),
                },
                None => out,
            });
        }
        merged.ok_or_else(|| {
            (
                Phase::Forward,
                ModelError::Input("a GRPO micro-batch with no rows".into()),
            )
        })
    }

    /// Forward and backward of one rank's micro-batch, adding `backward_factor ×` its loss's
    /// gradient into `grads`. `copy` is the rank's frozen reference ([`GrpoReference::Copy`]).
    pub fn micro_step(
        &self,
        model: &CausalLm,
        copy: Option<&CausalLm>,
        batch: &batch::GrpoBatch,
        settings: &GrpoLossSettings,
        backward_factor: f64,
        grads: &mut Gradients,
    ) -> Result<GrpoMicroStep, (Phase, ModelError)> {
        let forward = |e| (Phase::Forward, e);
        let temperature = self.settings.temperature;
        let logps_of = |m: &CausalLm, train: bool| {
            model_completion_logps(
                m,
                &batch.prompt_ids,
                &batch.prompt_mask,
                &batch.completion_ids,
                &batch.completion_mask,
                temperature,
                train,
            )
        };
        let reference = match (self.reference, copy) {
            (GrpoReference::None, _) => None,
            (GrpoReference::AdapterDisabled, _) => Some(
                model
                    .without_adapters(|m| logps_of(m, false))
                    .map_err(forward)?,
            ),
            (GrpoReference::Copy, Some(c)) => Some(logps_of(c, false).map_err(forward)?),
            (GrpoReference::Copy, None) => {
                return Err(forward(ModelError::Input(
                    "grpo.beta > 0 with full fine-tuning needs the frozen reference copy".into(),
                )))
            }
        };
        let policy = logps_of(model, true).map_err(forward)?;
        let loss = grpo_loss(
            &policy.logps,
            batch.old_logps.as_ref(),
            reference.as_ref().map(|r| &r.logps),
            &batch.advantages,
            &batch.completion_mask,
            settings,
        )
        .map_err(forward)?;
        let metrics = loss.metrics(&policy.entropies).map_err(forward)?;
        let value = loss
            .loss
            .to_dtype(candle_core::DType::F64)
            .and_then(|t| t.to_scalar::<f64>())
            .map_err(|e| forward(e.into()))?;
        let scaled = loss
            .loss
            .affine(backward_factor, 0.0)
            .map_err(|e| (Phase::Backward, e.into()))?;
        model
            .backward_into(&scaled, grads)
            .map_err(|e| (Phase::Backward, e))?;
        Ok(GrpoMicroStep {
            loss: value,
            tokens: metrics.tokens as usize,
            metrics,
        })
    }
}
