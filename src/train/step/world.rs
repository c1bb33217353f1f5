//! One rank of a launched run (torchrun, Slurm): this process trains on one device and takes
//! its share of every micro-step by global rank; the gradients, token count and loss sum are
//! summed over the processes, so every rank divides by the global count and applies the same
//! AdamW update (docs/multi-node.md).
//!
//! The sums go through the run's process group (TCP, summed in rank order: every rank gets the
//! same bits), or through NCCL between the ranks' GPUs in a build with it.

use std::sync::Arc;

use candle_core::{Device, Tensor};

use crate::devices::parallel::process_group::ProcessGroup;
use crate::devices::GradientReducer;
use crate::model::preference::PreferenceMetrics;
use crate::model::Gradients;
use crate::settings::{ShardMode, Strategy};

use super::super::config::RunConfig;
use super::super::error::{step_error, Phase, TrainError};
use super::{Accumulated, TrainingRun};

/// How a launched world of `world_size` processes trains `config` (data parallel, or ZeRO-2
/// across the processes), or why it cannot be trained across processes yet (the error's
/// message names the setting and the fix). What `tunestudio train` under torchrun or Slurm
/// checks first, and what the studio's Export panel shows beside the launch lines.
pub fn launched_training(config: &RunConfig, world_size: usize) -> Result<String, TrainError> {
    let refuse = |message: String| Err(TrainError::Placement { message });
    let w = world_size;
    let sharded = config.devices.strategy == Strategy::Sharded;
    if sharded && config.devices.shard == ShardMode::Everything {
        return refuse(format!(
            "a launched run of {w} processes shards gradients and optimizer state (ZeRO-2) but \
             not the weights yet: set `[devices] shard = \"gradients-and-optimizer\"`, or train \
             ZeRO-3 over the devices of one process"
        ));
    }
    if config.training.method.is_grpo() {
        return refuse(format!(
            "a launched run of {w} processes trains SFT and preference pairs, not GRPO yet: its \
             rollouts are sampled once per block and shared by the ranks of one process; train \
             `method = \"{}\"` in one process (strategy = \"data-parallel\" over its devices)",
            config.training.method.name()
        ));
    }
    let devices = &config.devices.devices;
    if devices.len() > 1 {
        return refuse(format!(
            "a launched run trains on one device per process, and `[devices] devices` lists {} \
             ({}): list one (\"cuda\" trains rank r on cuda:LOCAL_RANK), or train in one process \
             with strategy = \"{}\"",
            devices.len(),
            devices.join(", "),
            config.devices.strategy
        ));
    }
    Ok(if sharded {
        format!(
            "sharded data parallel (ZeRO-2) over {w} ranks: each process keeps 1/{w} of every \
             trained tensor's gradients and AdamW state, and rank 0's checkpoints gather them"
        )
    } else {
        format!(
            "data parallel over {w} ranks: every process keeps the whole model and AdamW state{}",
            if config.devices.strategy == Strategy::DataParallel {
                ""
            } else {
                " (strategy = \"sharded\" would divide the state)"
            }
        )
    })
}

/// The run config one rank of a launched world trains with, or why that run cannot be
/// trained across processes yet ([`launched_training`]). A `[devices]` GPU entry becomes the
/// rank's own GPU, `cuda:LOCAL_RANK`, as torchrun's convention is; the CPU stays the CPU.
pub(super) fn rank_config(
    mut config: RunConfig,
    world: &ProcessGroup,
) -> Result<RunConfig, TrainError> {
    launched_training(&config, world.world_size())?;
    if let Some(first) = config.devices.devices.first_mut() {
        let name = first.split('=').next().unwrap_or(first).trim();
        if name == "cuda" || name.starts_with("cuda:") {
            let capacity = first.split_once('=').map(|(_, c)| format!("={c}"));
            *first = format!(
                "cuda:{}{}",
                world.local_rank(),
                capacity.unwrap_or_default()
            );
        }
    }
    Ok(config)
}

impl TrainingRun {
    /// The launched world's ranks (1 for a run in one process).
    pub(super) fn world_size(&self) -> usize {
        self.world.as_ref().map_or(1, |w| w.world_size())
    }

    /// Whether this process writes the run's outputs (metrics, checkpoints): rank 0 of a
    /// launched world, or a run in one process. The ranks' replicas are identical, so
    /// one copy is the run's.
    pub fn writes_outputs(&self) -> bool {
        self.world.as_ref().is_none_or(|w| w.rank() == 0)
    }

    /// Data-parallel ranks over every process (this process's ranks × the world's).
    pub fn total_ranks(&self) -> usize {
        self.placement.ranks() * self.world_size()
    }

    /// This process's rows of each micro-step: the contiguous share of global rank `rank`
    /// (earlier ranks take the extra rows of a short batch, which may leave a rank none).
    pub(super) fn world_rows(&self, micro_batches: &[Vec<usize>]) -> Vec<Vec<usize>> {
        let Some(world) = &self.world else {
            return micro_batches.to_vec();
        };
        micro_batches
            .iter()
            .map(|rows| {
                super::accumulate::shard_rows(rows, world.world_size())[world.rank()].to_vec()
            })
            .collect()
    }

    /// The step's trained tokens over every process (the count fp16's loss scaling divides by
    /// before the backward); `local` in a run of one process.
    pub(super) fn world_tokens(
        &self,
        local: usize,
        step: u64,
        settings: &str,
    ) -> Result<usize, TrainError> {
        let Some(world) = &self.world else {
            return Ok(local);
        };
        let sum = world
            .all_reduce_f64("step's token count", &[local as f64])
            .map_err(|e| step_error(Phase::Forward, step, (0, 0), e, settings))?;
        Ok(sum.first().copied().unwrap_or(0.0) as usize)
    }

    /// A launched rank's sum of the step over every process: its gradients (zeros for a
    /// rank whose rows had no trained token, which must still take part in the sum the
    /// others wait in), then its loss sum and counts, so every rank divides by the global
    /// count.
    pub(super) fn reduce_across_processes(
        &self,
        world: &Arc<ProcessGroup>,
        per_rank: Vec<Gradients>,
        acc: &mut Accumulated,
        step: u64,
        settings: &str,
    ) -> Result<(), TrainError> {
        let shape = acc.last_shape();
        let fail = |e| step_error(Phase::Backward, step, shape, e, settings);
        // Sharded: each micro-step's gradients were reduce-scattered over the processes as
        // they were folded (`fold_micro_step`); `acc.grads` holds this rank's ranges.
        if self.sharded.is_none() {
            let grads = per_rank.into_iter().next().unwrap_or_default();
            let grads = self.every_trainable(grads).map_err(fail)?;
            let device: Device = self.placement.devices[0].candle.clone();
            let reducer: &dyn GradientReducer = match self.world_nccl() {
                Some(nccl) => nccl,
                None => world.as_ref(),
            };
            acc.grads = reducer
                .all_reduce_sum(vec![grads], &[device])
                .map_err(fail)?;
        }
        let counts = [acc.loss_sum, acc.tokens as f64, acc.label_tokens as f64];
        let sums = world
            .all_reduce_f64("step's loss sum and token count", &counts)
            .map_err(fail)?;
        if let [loss_sum, tokens, label_tokens] = sums[..] {
            acc.loss_sum = loss_sum;
            acc.tokens = tokens as u64;
            acc.label_tokens = label_tokens as u64;
        }
        if self.config.training.method.is_preference() {
            // Every process's pairs in the logged rewards and accuracies, as one process's.
            acc.preference = merge_across_processes(world, acc.preference).map_err(fail)?;
        }
        Ok(())
    }

    /// `grads` with a zero gradient for every trainable parameter it lacks, sorted by name:
    /// every rank sends the same tensors in the same order.
    pub(super) fn every_trainable(
        &self,
        grads: Gradients,
    ) -> Result<Gradients, crate::devices::DevicesError> {
        let mut pairs: Vec<(String, Tensor)> = grads.into_pairs().collect();
        for p in self.model.params().iter().filter(|p| p.trainable) {
            if !pairs.iter().any(|(name, _)| *name == p.name) {
                let zeros = Tensor::zeros(p.var.dims(), p.var.dtype(), p.var.device())?;
                pairs.push((p.name.clone(), zeros));
            }
        }
        pairs.sort_by(|a, b| a.0.cmp(&b.0));
        let mut sorted = Gradients::new();
        for (name, g) in pairs {
            sorted.insert(&name, g);
        }
        Ok(sorted)
    }

    /// NCCL between the launched ranks' GPUs, when this build has it and the rank trains on
    /// a GPU; `None` sums through the process group.
    #[cfg(feature = "nccl")]
    fn world_nccl(&self) -> Option<&dyn GradientReducer> {
        self.nccl
            .as_ref()
            .map(|n| n.as_ref() as &dyn GradientReducer)
            .filter(|_| self.world.is_some())
    }

    #[cfg(not(feature = "nccl"))]
    fn world_nccl(&self) -> Option<&dyn GradientReducer> {
        None
    }

    /// A launched rank's NCCL communicator on its GPU, made from the rendezvous's id
    /// (`ncclCommInitRank`); `None` on the CPU.
    #[cfg(feature = "nccl")]
    pub(super) fn open_world_nccl(
        &self,
        world: &ProcessGroup,
    ) -> Result<Option<crate::devices::parallel::nccl::NcclReducer>, TrainError> {
        use crate::devices::parallel::nccl::{NcclId, NcclReducer};
        let device = &self.placement.devices[0];
        if !device.is_cuda() {
            return Ok(None);
        }
        let id = NcclId(*world.run_id());
        NcclReducer::from_rank(device, world.rank(), world.world_size(), id)
            .map(Some)
            .map_err(|e| TrainError::Device {
                device: device.label.clone(),
                message: e.to_string(),
            })
    }
}

/// A preference step's metrics over every process: each field's pair-weighted sum, divided by
/// the pairs of all processes (a process without pairs gives zeros); `None` when no process
/// had a pair.
fn merge_across_processes(
    world: &ProcessGroup,
    mine: Option<PreferenceMetrics>,
) -> Result<Option<PreferenceMetrics>, crate::devices::DevicesError> {
    let m = mine.unwrap_or_default();
    let w = m.pairs as f64;
    let optional = |x: Option<f64>| [w * x.unwrap_or(0.0), if x.is_some() { w } else { 0.0 }];
    let mut values = vec![
        w,
        w * m.loss,
        w * m.rewards_chosen,
        w * m.rewards_rejected,
        w * m.rewards_accuracies,
        w * m.rewards_margins,
        w * m.logps_chosen,
        w * m.logps_rejected,
    ];
    for x in [m.log_odds_ratio, m.log_odds_chosen, m.nll_loss] {
        values.extend(optional(x));
    }
    let sums = world.all_reduce_f64("step's preference metrics", &values)?;
    let pairs = sums.first().copied().unwrap_or(0.0);
    if pairs <= 0.0 {
        return Ok(None);
    }
    let mean = |i: usize| sums.get(i).copied().unwrap_or(0.0) / pairs;
    let optional = |i: usize| {
        let weight = sums.get(i + 1).copied().unwrap_or(0.0);
        (weight > 0.0).then(|| sums.get(i).copied().unwrap_or(0.0) / weight)
    };
    Ok(Some(PreferenceMetrics {
        pairs: pairs.round() as usize,
        loss: mean(1),
        rewards_chosen: mean(2),
        rewards_rejected: mean(3),
        rewards_accuracies: mean(4),
        rewards_margins: mean(5),
        logps_chosen: mean(6),
        logps_rejected: mean(7),
        log_odds_ratio: optional(8),
        log_odds_chosen: optional(10),
        nll_loss: optional(12),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::parallel::process_group::GroupPlace;
    use crate::train::config::TrainingMethod;

    /// Rank 0 of a world of one whose GPU is `cuda:3` (no connection needed).
    fn world() -> ProcessGroup {
        let place = GroupPlace {
            rank: 0,
            local_rank: 3,
            world_size: 1,
        };
        ProcessGroup::new(
            place,
            [0; 128],
            Vec::new(),
            std::time::Duration::from_secs(1),
        )
        .unwrap()
    }

    fn with_devices(devices: &[&str]) -> RunConfig {
        let mut config = RunConfig::default();
        config.devices.devices = devices.iter().map(ToString::to_string).collect();
        config
    }

    /// A GPU entry becomes the rank's own GPU (its capacity kept), the CPU stays; two devices,
    /// ZeRO-3 and GRPO are refused by name (ZeRO-2 and DPO train).
    #[test]
    fn a_rank_trains_on_its_local_gpu_and_refuses_what_is_not_wired() {
        let w = world();
        for (given, taken) in [
            ("cuda", "cuda:3"),
            ("cuda:0", "cuda:3"),
            ("cuda:1=40GiB", "cuda:3=40GiB"),
            ("cpu", "cpu"),
        ] {
            let config = rank_config(with_devices(&[given]), &w).unwrap();
            assert_eq!(config.devices.devices, vec![taken.to_string()], "{given}");
        }
        let err = rank_config(with_devices(&["cuda:0", "cuda:1"]), &w)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("one device per process") && err.contains("cuda:0, cuda:1"),
            "{err}"
        );
        let mut zero3 = with_devices(&["cpu"]);
        zero3.devices.strategy = Strategy::Sharded;
        zero3.devices.shard = ShardMode::Everything;
        let err = rank_config(zero3, &w).unwrap_err().to_string();
        assert!(
            err.contains("ZeRO-2") && err.contains("gradients-and-optimizer"),
            "{err}"
        );
        let mut zero2 = with_devices(&["cuda"]);
        zero2.devices.strategy = Strategy::Sharded;
        assert_eq!(rank_config(zero2, &w).unwrap().devices.devices, ["cuda:3"]);
        let mut dpo = with_devices(&["cpu"]);
        dpo.training.method = TrainingMethod::Dpo;
        assert!(rank_config(dpo, &w).is_ok());
        let mut grpo = with_devices(&["cpu"]);
        grpo.training.method = TrainingMethod::Grpo;
        let err = rank_config(grpo, &w).unwrap_err().to_string();
        assert!(
            err.contains("not GRPO") && err.contains("\"grpo\""),
            "{err}"
        );
    }
}
