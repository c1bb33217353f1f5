//! What a run optimises, one implementation per objective, in the spirit of burn-train's
//! `TrainStep`: [`SftRows`] (the token loss on rows), [`PairRun`] (DPO, IPO and ORPO on
//! preference pairs) and [`GrpoRun`] (GRPO on groups sampled from prompts). The objective owns
//! its training items and says what a micro-step feeds the model, which loss it computes and
//! which metrics it emits; the run owns the models, devices, optimizer and data order and lends
//! them for the step. What the planner counts for an objective is `plan::HeadLoss`
//! (`train::plan_adapter::head_loss`), read from the run config before any run exists, so the
//! plan and the run agree on the objective's unit (`TrainingMethod::micro_batch_unit`).

use std::path::Path;

use crate::data::prompts::PromptRow;

use super::super::error::TrainError;
use super::super::grpo::{GrpoRun, StepRollouts};
use super::super::preference::PairRun;
use super::{Accumulated, TrainingRun};

/// One training objective: the data order's items are its training items (rows, pairs or
/// prompts), and a step's micro-batches index them.
pub(super) trait TrainObjective: Send {
    /// Training and validation items, in the objective's unit.
    fn split_sizes(&self, run: &TrainingRun) -> (usize, usize);

    /// Forward and backward over one step's micro-batches, the gradients summed over them
    /// and over the ranks, with the count the optimizer divides the summed loss by.
    fn accumulate(
        &self,
        run: &mut TrainingRun,
        micro_batches: &[Vec<usize>],
        loss_scale: f64,
    ) -> Result<Accumulated, TrainError>;

    /// `(loss, perplexity, count)` on the validation items (NaN where not defined).
    fn evaluate(&self, run: &TrainingRun) -> Result<(f64, f64, u64), TrainError>;

    /// Whether the plan's trained tokens are the data's (labels decide which positions the
    /// loss reads); otherwise the plan counts every position of the rows the objective
    /// builds (both sides of a pair, a rollout's completion).
    fn plans_data_trained_tokens(&self) -> bool {
        false
    }

    /// The micro-batches step `step` trains on again instead of the data order's next ones
    /// (GRPO with `num_iterations > 1`: the later steps of a block of rollouts).
    fn reused_micro_batches(&self, _step: u64) -> Option<Vec<Vec<usize>>> {
        None
    }

    /// Writes what a resume after `step` needs beside the weights and the data position into
    /// checkpoint folder `dir` (GRPO: the block of rollouts still being trained on).
    fn write_checkpoint_state(&self, _dir: &Path, _step: u64) -> Result<(), TrainError> {
        Ok(())
    }

    /// Reads what [`Self::write_checkpoint_state`] wrote.
    fn read_checkpoint_state(&self, _dir: &Path) -> Result<(), TrainError> {
        Ok(())
    }

    /// The last step's sampled groups (GRPO).
    fn last_rollouts(&self) -> Option<StepRollouts> {
        None
    }

    /// The prompts [`Self::last_rollouts`] index (GRPO).
    fn prompts(&self) -> Option<&[PromptRow]> {
        None
    }
}

/// Supervised fine-tuning: the summed token loss over the trained positions of the run's rows
/// (`TrainingRun::splits`), divided by the step's trained tokens.
pub(super) struct SftRows;

impl TrainObjective for SftRows {
    fn split_sizes(&self, run: &TrainingRun) -> (usize, usize) {
        (run.splits.train.len(), run.splits.eval.len())
    }

    fn accumulate(
        &self,
        run: &mut TrainingRun,
        micro_batches: &[Vec<usize>],
        loss_scale: f64,
    ) -> Result<Accumulated, TrainError> {
        run.accumulate_rows(micro_batches, loss_scale)
    }

    fn evaluate(&self, run: &TrainingRun) -> Result<(f64, f64, u64), TrainError> {
        run.evaluate_rows()
    }

    fn plans_data_trained_tokens(&self) -> bool {
        true
    }
}

/// Preference pairs: each micro-batch's pairs as chosen then rejected rows, the loss summed
/// over pairs and divided by the step's pairs.
impl TrainObjective for PairRun {
    fn split_sizes(&self, _run: &TrainingRun) -> (usize, usize) {
        (self.splits.train.len(), self.splits.eval.len())
    }

    fn accumulate(
        &self,
        run: &mut TrainingRun,
        micro_batches: &[Vec<usize>],
        loss_scale: f64,
    ) -> Result<Accumulated, TrainError> {
        run.accumulate_pairs(self, micro_batches, loss_scale)
    }

    fn evaluate(&self, run: &TrainingRun) -> Result<(f64, f64, u64), TrainError> {
        run.evaluate_pairs(self)
    }
}

/// GRPO: the step's prompts sampled as groups, scored, and trained on their advantages; the
/// loss is already the step's mean (the count is 1).
impl TrainObjective for GrpoRun {
    fn split_sizes(&self, _run: &TrainingRun) -> (usize, usize) {
        // No evaluation loss: every prompt is a training prompt.
        (self.prompts.len(), 0)
    }

    fn accumulate(
        &self,
        run: &mut TrainingRun,
        micro_batches: &[Vec<usize>],
        loss_scale: f64,
    ) -> Result<Accumulated, TrainError> {
        run.accumulate_grpo(self, micro_batches, loss_scale)
    }

    fn evaluate(&self, _run: &TrainingRun) -> Result<(f64, f64, u64), TrainError> {
        Ok((f64::NAN, f64::NAN, 0))
    }

    fn reused_micro_batches(&self, step: u64) -> Option<Vec<Vec<usize>>> {
        self.reused_block(step).map(|b| b.micro_batches)
    }

    fn write_checkpoint_state(&self, dir: &Path, step: u64) -> Result<(), TrainError> {
        self.write_block(dir, step)
    }

    fn read_checkpoint_state(&self, dir: &Path) -> Result<(), TrainError> {
        self.read_block(dir)
    }

    fn last_rollouts(&self) -> Option<StepRollouts> {
        GrpoRun::last_rollouts(self)
    }

    fn prompts(&self) -> Option<&[PromptRow]> {
        Some(&self.prompts)
    }
}
