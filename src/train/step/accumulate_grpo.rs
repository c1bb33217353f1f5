//! A GRPO step's forward and backward: the step's rollouts first (sampled with rank 0's
//! weights, which every rank shares), then each micro-batch's rows cut into one shard of whole
//! groups per rank, each shard run in the passes of `grpo.generations_per_micro_step`, the
//! gradients summed in place and over the ranks (see `train::grpo`).

use crate::model::Gradients;

use super::super::error::{step_error, Phase, TrainError};
use super::super::grpo::batch::GrpoPasses;
use super::super::grpo::rollouts::Rollout;
use super::super::grpo::{GrpoBlock, GrpoMicroStep, GrpoRun, GrpoStepMetrics, StepRollouts};
use super::accumulate::{injected_failure, on_rank, run_rank_jobs, shard_rows};
use super::{Accumulated, TrainingRun};

/// One rank's rows of a micro-step and its accumulated gradients.
type GrpoJob<'a> = (
    &'a crate::model::CausalLm,
    Option<&'a crate::model::CausalLm>,
    Option<GrpoPasses>,
    Gradients,
);

impl TrainingRun {
    /// [`Self::accumulate`] for GRPO: `micro_batches` hold prompt indices. The count the
    /// optimizer divides by is 1: the loss is already the step's mean.
    pub(super) fn accumulate_grpo(
        &mut self,
        grpo: &GrpoRun,
        micro_batches: &[Vec<usize>],
        loss_scale: f64,
    ) -> Result<Accumulated, TrainError> {
        let step = self.step + 1;
        let settings = self.settings_summary();
        let ranks = self.placement.ranks();
        let rollouts = match grpo.reused_block(step) {
            Some(block) => {
                grpo.set_last(&block.rollouts);
                block.rollouts
            }
            None => self.sample_block(grpo, micro_batches, step, &settings)?,
        };
        let loss_settings =
            grpo.loss_settings(rollouts.trained_tokens(), micro_batches.len() * ranks);
        // The count is 1, so the backward factor is the loss scale itself (1 without fp16).
        let mut acc = Accumulated::new(loss_scale);
        self.set_dropout_seed();
        let generations = grpo.settings.num_generations;
        let mut per_rank: Vec<Gradients> = vec![Gradients::new(); ranks];
        let mut loss_metrics: Option<crate::model::grpo::GrpoLossMetrics> = None;
        let mut start = 0;
        for (i, prompts) in micro_batches.iter().enumerate() {
            let rows = &rollouts.rows[start * generations..(start + prompts.len()) * generations];
            start += prompts.len();
            let jobs = self
                .grpo_jobs(grpo, rows, prompts.len(), std::mem::take(&mut per_rank))
                .map_err(|e| step_error(Phase::Forward, step, (rows.len(), 0), e, &settings))?;
            let shape = (
                rows.len(),
                jobs.iter()
                    .filter_map(|j| j.2.as_ref())
                    .flat_map(|p| p.batches.iter().map(|b| b.seq_len))
                    .max()
                    .unwrap_or(0),
            );
            acc.shapes.push(shape);
            injected_failure(step, Phase::Forward, shape, &settings)?;
            let counter = (step << 16) + i as u64;
            let factor = acc.backward_factor;
            let concurrent = ranks > 1 && self.model.device().is_cuda();
            let models = self.rank_models();
            let results = self.streamed(&models, &mut acc.grads, || {
                run_rank_jobs(concurrent, jobs, |(model, copy, passes, mut grads)| {
                    let Some(passes) = passes else {
                        return Ok((None, grads));
                    };
                    model
                        .forward_counter
                        .store(counter, std::sync::atomic::Ordering::Relaxed);
                    grpo.micro_batch_step(model, copy, &passes, &loss_settings, factor, &mut grads)
                        .map(|out| (Some(out), grads))
                })
            });
            for (rank, result) in results.into_iter().enumerate() {
                let (out, grads): (Option<GrpoMicroStep>, Gradients) =
                    result.map_err(|(phase, e)| {
                        on_rank(step_error(phase, step, shape, e, &settings), rank, ranks)
                    })?;
                per_rank.push(grads);
                if let Some(out) = out {
                    acc.loss_sum += out.loss;
                    acc.label_tokens += out.tokens as u64;
                    loss_metrics = Some(match loss_metrics {
                        Some(m) => m.merge(&out.metrics),
                        None => out.metrics,
                    });
                }
            }
            injected_failure(step, Phase::Backward, shape, &settings)?;
            self.fold_micro_step(&mut per_rank, &mut acc)?;
        }
        acc.tokens = 1;
        acc.grpo = Some(GrpoStepMetrics {
            rollout: rollouts.metrics.clone(),
            loss: loss_metrics.unwrap_or_default(),
        });
        self.reduce_step(per_rank, &mut acc, step, &settings)?;
        Ok(acc)
    }

    /// A block's rollouts, sampled at its first step with rank 0's weights (which every rank
    /// shares); with `num_iterations > 1` each carries the sampling policy's log-probabilities
    /// and the block is kept for its later steps.
    fn sample_block(
        &self,
        grpo: &GrpoRun,
        micro_batches: &[Vec<usize>],
        step: u64,
        settings: &str,
    ) -> Result<StepRollouts, TrainError> {
        let prompts: Vec<usize> = micro_batches.iter().flatten().copied().collect();
        let infer = crate::infer::InferModel::from_causal_lm(&self.model).map_err(|cause| {
            TrainError::Rollout {
                step,
                context: "viewing the policy's weights for sampling".into(),
                cause: Box::new(cause),
            }
        })?;
        let mut rollouts = grpo.rollouts(&infer, &prompts, self.config.training.seed, step)?;
        drop(infer);
        if grpo.settings.num_iterations > 1 {
            self.fill_old_logps(grpo, micro_batches, &mut rollouts)
                .map_err(|e| {
                    step_error(Phase::Forward, step, (rollouts.rows.len(), 0), e, settings)
                })?;
            grpo.start_block(GrpoBlock {
                first_step: step,
                micro_batches: micro_batches.to_vec(),
                rollouts: rollouts.clone(),
            });
        }
        Ok(rollouts)
    }

    /// The sampling policy's per-token log-probabilities of every rollout (TRL's
    /// `old_per_token_logps`): forwards without a graph or dropout on rank 0, under the
    /// sampling temperature, one per micro-batch's pass of rows (`generations_per_micro_step`).
    fn fill_old_logps(
        &self,
        grpo: &GrpoRun,
        micro_batches: &[Vec<usize>],
        rollouts: &mut StepRollouts,
    ) -> Result<(), crate::model::ModelError> {
        let generations = grpo.settings.num_generations;
        let per_pass = grpo.settings.generations_per_pass();
        let mut start = 0;
        for prompts in micro_batches {
            let rows_per_pass = (prompts.len() * per_pass).max(1);
            let micro_batch_end = start + prompts.len() * generations;
            while start < micro_batch_end {
                let end = (start + rows_per_pass).min(micro_batch_end);
                self.fill_old_logps_of(grpo, &mut rollouts.rows[start..end])?;
                start = end;
            }
        }
        Ok(())
    }

    /// [`Self::fill_old_logps`] for one pass of `rows`.
    fn fill_old_logps_of(
        &self,
        grpo: &GrpoRun,
        rows: &mut [Rollout],
    ) -> Result<(), crate::model::ModelError> {
        let picked: Vec<&Rollout> = rows.iter().collect();
        let batch = grpo.batch(&picked, self.pad_id, self.model.device())?;
        let logps = crate::model::grpo::model_completion_logps(
            &self.model,
            &batch.prompt_ids,
            &batch.prompt_mask,
            &batch.completion_ids,
            &batch.completion_mask,
            grpo.settings.temperature,
            false,
        )?
        .logps
        .to_dtype(candle_core::DType::F32)?
        .to_vec2::<f32>()?;
        for (row, values) in rows.iter_mut().zip(logps) {
            row.old_logps = values[..row.completion_ids.len()].to_vec();
        }
        Ok(())
    }

    /// One micro-step's rows (`prompts` groups of rollouts) cut into one shard of whole groups
    /// per rank, each cut into its passes and collated on its rank's device, with the rank's
    /// model, reference copy and gradients. Whole groups stay on one rank whatever the passes.
    fn grpo_jobs<'a>(
        &'a self,
        grpo: &GrpoRun,
        rows: &[Rollout],
        prompts: usize,
        per_rank: Vec<Gradients>,
    ) -> Result<Vec<GrpoJob<'a>>, candle_core::Error> {
        let generations = grpo.settings.num_generations;
        let groups: Vec<usize> = (0..prompts).collect();
        let models = self.rank_models();
        let mut jobs = Vec::with_capacity(models.len());
        for ((rank, shard), grads) in shard_rows(&groups, models.len())
            .into_iter()
            .enumerate()
            .zip(per_rank)
        {
            let batch = if shard.is_empty() {
                None
            } else {
                let picked: Vec<&Rollout> = shard
                    .iter()
                    .flat_map(|&g| &rows[g * generations..(g + 1) * generations])
                    .collect();
                let device = &self.placement.devices[rank].candle;
                Some(grpo.passes(&picked, shard.len(), self.pad_id, device)?)
            };
            jobs.push((models[rank], self.reference_copies.get(rank), batch, grads));
        }
        Ok(jobs)
    }
}

/// The rollouts of the last step, for the front ends (`None` before the first GRPO step).
pub fn last_rollouts(run: &TrainingRun) -> Option<StepRollouts> {
    run.objective.last_rollouts()
}

/// The GRPO run's prompt rows (`None` for other methods), which `last_rollouts` index.
pub fn last_prompts(run: &TrainingRun) -> Option<&[crate::data::prompts::PromptRow]> {
    run.objective.prompts()
}
