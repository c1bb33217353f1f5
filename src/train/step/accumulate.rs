//! Forward and backward over a step's micro-batches: each rank's shard collated on its device,
//! the gradients summed in place over the micro-batches, then over the ranks.

use candle_core::{DType, Device};

use crate::model::{CausalLm, Gradients, ModelError};

use super::super::error::{step_error, Phase, TrainError};
use super::super::loader::derive_seed;
use super::super::preference::{PairRun, PairStep};
use super::super::samples::{self, Sample};
use super::objective::SftRows;
use super::{Accumulated, TrainingRun, DROPOUT_STREAM};

impl TrainingRun {
    /// Forward + backward over the micro-batches, summing gradients and token counts, then
    /// (data parallel) summing the gradients over the ranks.
    ///
    /// Without loss scaling each micro-batch's summed loss is back-propagated as is (the
    /// optimizer divides by the step's token count). With fp16 loss scaling the summed loss is
    /// multiplied by `loss_scale / step_tokens` instead, so the scale applies to the *mean*
    /// token loss as in torch's GradScaler (a scaled sum would overflow f16 far sooner).
    ///
    /// Data parallel: each micro-batch's rows are cut into one contiguous shard per rank,
    /// each collated on its rank's device (padded to its own longest row, as a per-rank
    /// collator would); the per-rank gradients of the loss *sums* are all-reduced once per
    /// step, so dividing by the global token count gives the one-device gradient exactly.
    pub(super) fn accumulate(
        &mut self,
        micro_batches: &[Vec<usize>],
        loss_scale: f64,
    ) -> Result<Accumulated, TrainError> {
        // The objective is lent the run for the step (it needs the models, devices and
        // counters mutably), then put back whatever the step's outcome, a panic included (the
        // trainer reports a panic as the step's error and may still write a checkpoint, which
        // holds the objective's state).
        let objective = std::mem::replace(&mut self.objective, Box::new(SftRows));
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            objective.accumulate(self, micro_batches, loss_scale)
        }));
        self.objective = objective;
        result.unwrap_or_else(|payload| std::panic::resume_unwind(payload))
    }

    /// [`Self::accumulate`] for SFT ([`SftRows`]): the micro-batches index the training rows.
    pub(super) fn accumulate_rows(
        &mut self,
        micro_batches: &[Vec<usize>],
        loss_scale: f64,
    ) -> Result<Accumulated, TrainError> {
        let step = self.step + 1;
        let settings = self.settings_summary();
        let ranks = self.placement.ranks();
        let batches = self.collate_shards(&self.world_rows(micro_batches), step, &settings)?;
        let local_tokens: usize = batches
            .iter()
            .flatten()
            .flatten()
            .map(|b| b.trained_tokens)
            .sum();
        let step_tokens = self.world_tokens(local_tokens, step, &settings)?;
        let backward_factor = backward_factor(loss_scale, step_tokens);
        // Each rank's gradients, summed in place over the micro-batches (one buffer each).
        let mut per_rank: Vec<Gradients> = vec![Gradients::new(); ranks];
        let mut acc = Accumulated::new(backward_factor);
        let seed_base = self.set_dropout_seed();
        let models = self.rank_models();
        for (i, shards) in batches.iter().enumerate() {
            let live = shards.iter().flatten();
            let shape = (
                live.clone().map(|b| b.rows).sum(),
                live.map(|b| b.seq_len).max().unwrap_or(0),
            );
            acc.shapes.push(shape);
            // LoRA dropout masks derive from (seed, step, micro-batch), never from how many
            // forward passes this process made, so a resumed run draws the same masks.
            let counter = (step << 16) + i as u64;
            injected_failure(step, Phase::Forward, shape, &settings)?;
            let accs = std::mem::take(&mut per_rank);
            let results = self.streamed(&models, &mut acc.grads, || {
                run_ranks(&models, shards, accs, |model, batch, acc| {
                    micro_step(model, batch, seed_base, counter, backward_factor, acc)
                })
            });
            for (rank, result) in results.into_iter().enumerate() {
                let (loss, tokens, grads) = result.map_err(|(phase, e)| {
                    on_rank(step_error(phase, step, shape, e, &settings), rank, ranks)
                })?;
                acc.loss_sum += loss;
                acc.tokens += tokens as u64;
                acc.label_tokens += tokens as u64;
                per_rank.push(grads);
            }
            injected_failure(step, Phase::Backward, shape, &settings)?;
            self.fold_micro_step(&mut per_rank, &mut acc)?;
        }
        self.reduce_step(per_rank, &mut acc, step, &settings)?;
        Ok(acc)
    }

    /// Each micro-batch's rows cut into one shard per rank, collated on that rank's device
    /// (`None` for a rank a short batch leaves empty).
    fn collate_shards(
        &self,
        micro_batches: &[Vec<usize>],
        step: u64,
        settings: &str,
    ) -> Result<Vec<Vec<Option<samples::TensorBatch>>>, TrainError> {
        let ranks = self.placement.ranks();
        let max_length = self.config.data.max_length;
        let mut batches = Vec::with_capacity(micro_batches.len());
        for rows in micro_batches {
            let mut shards = Vec::with_capacity(ranks);
            for (rank, shard) in shard_rows(rows, ranks).into_iter().enumerate() {
                if shard.is_empty() {
                    shards.push(None);
                    continue;
                }
                let picked: Vec<&Sample> = shard.iter().map(|&r| &self.splits.train[r]).collect();
                let device = &self.placement.devices[rank].candle;
                let batch = samples::collate(&picked, self.pad_id, max_length, device)
                    .map_err(|e| step_error(Phase::Forward, step, (rows.len(), 0), e, settings))?;
                shards.push(Some(batch));
            }
            batches.push(shards);
        }
        Ok(batches)
    }

    /// Sets every rank's dropout seed base for the step and returns it.
    pub(super) fn set_dropout_seed(&mut self) -> u64 {
        let seed_base = derive_seed(self.config.training.seed, DROPOUT_STREAM, 0);
        self.model.dropout_seed_base = seed_base;
        for r in &mut self.replicas {
            r.model.dropout_seed_base = seed_base;
        }
        seed_base
    }

    /// Sums the ranks' gradients of the step into `acc` (all-reduced, one copy per rank),
    /// unless no micro-batch had a trained token; a launched rank always takes part in the
    /// sum across processes (the others wait in it), with its loss sum and counts.
    pub(super) fn reduce_step(
        &self,
        per_rank: Vec<Gradients>,
        acc: &mut Accumulated,
        step: u64,
        settings: &str,
    ) -> Result<(), TrainError> {
        if let Some(world) = &self.world {
            return self.reduce_across_processes(world, per_rank, acc, step, settings);
        }
        if per_rank.iter().all(|g| g.is_empty()) {
            return Ok(());
        }
        let shape = acc.last_shape();
        acc.grads = self
            .all_reduce(per_rank)
            .map_err(|e| step_error(Phase::Backward, step, shape, e, settings))?;
        Ok(())
    }

    /// [`Self::accumulate`] for preference pairs: each micro-batch's pairs as one batch of
    /// chosen then rejected rows, the gradient of the sum of their losses added in place; the
    /// count is the step's pairs (see `train::preference`).
    ///
    /// Data parallel: each rank takes a contiguous shard of whole pairs (a pair's chosen and
    /// rejected rows stay together on one rank), collated on its device, with its own
    /// reference (its adapters switched off, or its frozen copy); the per-rank gradients of the
    /// loss sums are all-reduced once per step, as for SFT, so dividing by the step's pairs
    /// gives the one-device gradient. A layer split runs through the model's stages as SFT.
    /// A launched run's processes each take their global rank's pairs, as for SFT rows.
    pub(super) fn accumulate_pairs(
        &mut self,
        pairs: &PairRun,
        micro_batches: &[Vec<usize>],
        loss_scale: f64,
    ) -> Result<Accumulated, TrainError> {
        let step = self.step + 1;
        let settings = self.settings_summary();
        let ranks = self.placement.ranks();
        // The step's pairs over every process (what the loss is divided by); a launched
        // process trains its global rank's share of each micro-step.
        let step_pairs: usize = micro_batches.iter().map(Vec::len).sum();
        let mut acc = Accumulated::new(backward_factor(loss_scale, step_pairs));
        self.set_dropout_seed();
        let mut per_rank: Vec<Gradients> = vec![Gradients::new(); ranks];
        for (i, rows) in self.world_rows(micro_batches).iter().enumerate() {
            let shards = self
                .pair_shards(pairs, rows)
                .map_err(|e| step_error(Phase::Forward, step, (2 * rows.len(), 0), e, &settings))?;
            let live = shards.iter().flatten();
            let shape = (
                live.clone().map(|(_, b)| b.rows).sum(),
                live.map(|(_, b)| b.seq_len).max().unwrap_or(0),
            );
            acc.shapes.push(shape);
            injected_failure(step, Phase::Forward, shape, &settings)?;
            // LoRA dropout masks derive from (seed, step, micro-batch), as for SFT.
            let counter = (step << 16) + i as u64;
            let grads = std::mem::take(&mut per_rank);
            let factor = acc.backward_factor;
            let results = self.streamed(&self.rank_models(), &mut acc.grads, || {
                self.pair_micro_step(pairs, shards, grads, counter, factor)
            });
            for (rank, result) in results.into_iter().enumerate() {
                let (out, grads) = result.map_err(|(phase, e)| {
                    on_rank(step_error(phase, step, shape, e, &settings), rank, ranks)
                })?;
                per_rank.push(grads);
                if let Some(out) = out {
                    acc.add_pairs(out);
                }
            }
            self.fold_micro_step(&mut per_rank, &mut acc)?;
        }
        self.reduce_step(per_rank, &mut acc, step, &settings)?;
        Ok(acc)
    }

    /// Forward and backward of one micro-step's pairs on every rank (with its shard, if any,
    /// its reference copy, if any, and its accumulated gradients), concurrently when every
    /// rank is a GPU. Results come back in rank order.
    fn pair_micro_step(
        &self,
        pairs: &PairRun,
        shards: Vec<Option<PairShard<'_>>>,
        per_rank: Vec<Gradients>,
        counter: u64,
        backward_factor: f64,
    ) -> Vec<PairMicroStep> {
        let models = self.rank_models();
        let concurrent = models.len() > 1 && models.iter().all(|m| m.device().is_cuda());
        let jobs: Vec<_> = models
            .iter()
            .zip(shards)
            .zip(per_rank)
            .enumerate()
            .map(|(rank, ((model, shard), grads))| {
                (*model, self.reference_copies.get(rank), shard, grads)
            })
            .collect();
        run_rank_jobs(concurrent, jobs, |(model, copy, shard, mut grads)| {
            let Some((indices, batch)) = shard else {
                return Ok((None, grads));
            };
            model
                .forward_counter
                .store(counter, std::sync::atomic::Ordering::Relaxed);
            pairs
                .micro_step(model, copy, indices, &batch, backward_factor, &mut grads)
                .map(|out| (Some(out), grads))
        })
    }

    /// A micro-step's pairs cut into one contiguous shard of whole pairs per rank, each
    /// collated on its rank's device (`None` for a rank a short batch leaves empty).
    fn pair_shards<'r>(
        &self,
        pairs: &PairRun,
        rows: &'r [usize],
    ) -> Result<Vec<Option<PairShard<'r>>>, crate::model::ModelError> {
        shard_rows(rows, self.placement.ranks())
            .into_iter()
            .enumerate()
            .map(|(rank, shard)| {
                if shard.is_empty() {
                    return Ok(None);
                }
                let device = &self.placement.devices[rank].candle;
                Ok(Some((
                    shard,
                    pairs.batch(shard, false, self.pad_id, device)?,
                )))
            })
            .collect()
    }

    /// Sums every rank's gradients and hands each rank the sum on its own device:
    /// NCCL all-reduce when built with it and every rank is a GPU, otherwise through
    /// rank 0's device (CPU logical devices share memory, so that costs nothing there).
    pub(super) fn all_reduce(
        &self,
        per_rank: Vec<Gradients>,
    ) -> Result<Vec<Gradients>, crate::devices::DevicesError> {
        use crate::devices::GradientReducer;
        if per_rank.len() == 1 {
            return Ok(per_rank);
        }
        let devices = &self.placement.devices[..per_rank.len()];
        let outputs: Vec<Device> = devices.iter().map(|d| d.candle.clone()).collect();
        #[cfg(feature = "nccl")]
        if let Some(reducer) = &self.nccl {
            return reducer.all_reduce_sum(per_rank, &outputs);
        }
        crate::devices::HostReducer.all_reduce_sum(per_rank, &outputs)
    }

    /// The run's NCCL communicators, when its ranks are distinct GPUs
    /// ([`crate::devices::parallel::choose_reducer`]); `None` runs the host reducer.
    #[cfg(feature = "nccl")]
    pub(super) fn open_nccl(
        &self,
    ) -> Result<Option<crate::devices::parallel::nccl::NcclReducer>, TrainError> {
        use crate::devices::parallel::{choose_reducer, nccl::NcclReducer, ReducerChoice};
        let ranks = self.placement.ranks();
        if ranks < 2 {
            return Ok(None);
        }
        let devices = &self.placement.devices[..ranks];
        let labels: Vec<String> = devices.iter().map(|d| d.label.clone()).collect();
        match choose_reducer(&labels, true) {
            ReducerChoice::Nccl => Ok(Some(NcclReducer::single_process(devices).map_err(|e| {
                TrainError::Device {
                    device: labels.join(","),
                    message: e.to_string(),
                }
            })?)),
            ReducerChoice::Host { .. } => Ok(None),
        }
    }
}

/// Why a rank's micro-step failed: the phase, and the model's error.
pub(super) type RankError = (Phase, ModelError);

/// What one rank's micro-step gives: loss sum, trained tokens, and its accumulated gradients.
type MicroStep = (f64, usize, Gradients);

/// Forward and backward of one rank's shard of a micro-batch (none: nothing to do), adding
/// the gradients into the rank's accumulation `acc`.
fn micro_step(
    model: &CausalLm,
    batch: Option<&samples::TensorBatch>,
    seed_base: u64,
    counter: u64,
    backward_factor: f64,
    mut acc: Gradients,
) -> Result<MicroStep, (Phase, crate::model::ModelError)> {
    let Some(batch) = batch else {
        return Ok((0.0, 0, acc));
    };
    let forward = |e| (Phase::Forward, e);
    let backward = |e| (Phase::Backward, e);
    debug_assert_eq!(model.dropout_seed_base, seed_base);
    model
        .forward_counter
        .store(counter, std::sync::atomic::Ordering::Relaxed);
    let out = model
        .loss(&batch.input_ids, Some(&batch.attention_mask), &batch.labels)
        .map_err(forward)?;
    let loss = out
        .sum
        .to_dtype(DType::F64)
        .and_then(|t| t.to_scalar::<f64>())
        .map_err(|e| forward(e.into()))?;
    if out.num_tokens == 0 {
        // Nothing to learn from (every label masked); its gradient is zero anyway.
        return Ok((loss, 0, acc));
    }
    let scaled = if backward_factor != 1.0 {
        out.sum
            .affine(backward_factor, 0.0)
            .map_err(|e| backward(e.into()))?
    } else {
        out.sum
    };
    model.backward_into(&scaled, &mut acc).map_err(backward)?;
    Ok((loss, out.num_tokens, acc))
}

/// Runs `work` for every rank (with its shard, if any, and its accumulated gradients):
/// concurrently (a thread per rank) when every rank is a GPU, in turn on the CPU, whose
/// logical devices share the same cores. Results come back in rank order.
fn run_ranks<T: Send>(
    models: &[&CausalLm],
    shards: &[Option<samples::TensorBatch>],
    accs: Vec<Gradients>,
    work: impl Fn(&CausalLm, Option<&samples::TensorBatch>, Gradients) -> T + Sync,
) -> Vec<T> {
    let concurrent = models.len() > 1 && models.iter().all(|m| m.device().is_cuda());
    let jobs = models.iter().zip(shards).zip(accs).enumerate();
    let work = |rank: usize, m: &CausalLm, b: Option<&samples::TensorBatch>, acc| {
        crate::mem::ranks::on_rank(rank, || work(m, b, acc))
    };
    if !concurrent {
        return jobs
            .map(|(rank, ((m, b), acc))| work(rank, m, b.as_ref(), acc))
            .collect();
    }
    std::thread::scope(|scope| {
        let work = &work;
        let handles: Vec<_> = jobs
            .map(|(rank, ((m, b), acc))| scope.spawn(move || work(rank, m, b.as_ref(), acc)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    })
}

/// One rank's pairs of a micro-step (their indices) and their batch on its device.
type PairShard<'r> = (&'r [usize], samples::TensorBatch);

/// What one rank's micro-step on pairs gives: its output (none for an empty shard) and its
/// accumulated gradients.
type PairMicroStep = Result<(Option<PairStep>, Gradients), (Phase, crate::model::ModelError)>;

/// [`run_ranks`]'s schedule for any per-rank job: a thread per rank when `concurrent` (every
/// rank a GPU), in turn otherwise. Results come back in rank order.
pub(super) fn run_rank_jobs<J: Send, T: Send>(
    concurrent: bool,
    jobs: Vec<J>,
    work: impl Fn(J) -> T + Sync,
) -> Vec<T> {
    let work = |rank: usize, job: J| crate::mem::ranks::on_rank(rank, || work(job));
    if !concurrent {
        return jobs
            .into_iter()
            .enumerate()
            .map(|(rank, job)| work(rank, job))
            .collect();
    }
    std::thread::scope(|scope| {
        let work = &work;
        let handles: Vec<_> = jobs
            .into_iter()
            .enumerate()
            .map(|(rank, job)| scope.spawn(move || work(rank, job)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    })
}

/// Cuts a micro-step's rows into `ranks` contiguous shards, earlier ranks taking the
/// extra rows (a short last batch may leave later ranks empty).
pub(super) fn shard_rows(rows: &[usize], ranks: usize) -> Vec<&[usize]> {
    let ranks = ranks.max(1);
    let mut out = Vec::with_capacity(ranks);
    let mut start = 0;
    for r in 0..ranks {
        let len = rows.len() / ranks + usize::from(r < rows.len() % ranks);
        out.push(&rows[start..start + len]);
        start += len;
    }
    out
}

/// `factor` × each micro-batch's summed loss is back-propagated: 1 without loss scaling (the
/// optimizer divides by the step's count), else `loss_scale / count`, so the scale applies to
/// the *mean* loss as in torch's GradScaler.
fn backward_factor(loss_scale: f64, count: usize) -> f64 {
    if loss_scale != 1.0 {
        loss_scale / count.max(1) as f64
    } else {
        1.0
    }
}

/// The failure a test injects at `phase` of `step` ([`super::super::oom::injected_failure`]),
/// as the step error it stands for.
pub(super) fn injected_failure(
    step: u64,
    phase: Phase,
    shape: (usize, usize),
    settings: &str,
) -> Result<(), TrainError> {
    match super::super::oom::injected_failure(step, phase) {
        Some(message) => Err(step_error(phase, step, shape, message, settings)),
        None => Ok(()),
    }
}

/// A step error of data-parallel rank `rank` (of `ranks`) names the rank.
pub(super) fn on_rank(mut err: TrainError, rank: usize, ranks: usize) -> TrainError {
    if let TrainError::Step { device, .. } = &mut err {
        *device = (ranks > 1).then_some(rank);
    }
    err
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Data parallel over 3 ranks: 7 rows go 3 + 2 + 2 (the earlier ranks take the extra row),
    /// in order, every row once; 2 rows leave the last rank empty; one rank takes everything.
    #[test]
    fn rows_are_sharded_contiguously_with_the_extra_rows_first() {
        let rows: Vec<usize> = (10..17).collect();
        let shards = shard_rows(&rows, 3);
        assert_eq!(shards, vec![&[10, 11, 12][..], &[13, 14], &[15, 16]]);
        assert_eq!(shard_rows(&rows[..2], 3), vec![&[10][..], &[11], &[]]);
        assert_eq!(shard_rows(&rows, 1), vec![&rows[..]]);
        assert_eq!(shard_rows(&rows, 0), vec![&rows[..]]);
    }

    /// Without loss scaling the summed loss is back-propagated as it is (the optimizer divides
    /// by the step's count); with fp16's scale 1024 over 8 tokens each token's loss carries 128,
    /// the scale of the mean loss as torch's GradScaler applies it.
    #[test]
    fn the_backward_factor_scales_the_mean_loss() {
        assert_eq!(backward_factor(1.0, 8), 1.0);
        assert_eq!(backward_factor(1024.0, 8), 128.0);
        assert_eq!(backward_factor(1024.0, 0), 1024.0);
    }
}
