//! Sharded data parallel's gradient path through a step: each micro-step's decoder-layer
//! gradients reduce-scattered as the backward makes them (`layer_stream`), the rest right after
//! the backward, through the run's collectives (the host's, NCCL's, or a launched world's).

use std::sync::Arc;

use candle_core::Device;

use crate::devices::GradientReducer;
use crate::model::{CausalLm, Gradients, ModelError};

use super::super::error::{step_error, Phase, TrainError};
use super::accumulate::RankError;
use super::layer_stream::with_layer_stream;
use super::{Accumulated, TrainingRun};

impl TrainingRun {
    /// Sharded data parallel: reduce-scatters a micro-step's whole gradients (`per_rank`,
    /// emptied for the next micro-step) into the step's gradient ranges (`acc.grads`, one set
    /// per rank), so no rank holds a whole gradient beyond its own micro-step's. Any other
    /// strategy keeps summing whole gradients per rank until [`Self::reduce_step`].
    ///
    /// What reaches here is what candle's backward returned at its end: the gradients of the
    /// embeddings, final norm and head, and of any layer that did not stream its own
    /// ([`Self::streamed`]).
    pub(super) fn fold_micro_step(
        &self,
        per_rank: &mut Vec<Gradients>,
        acc: &mut Accumulated,
    ) -> Result<(), TrainError> {
        let Some(sharded) = &self.sharded else {
            return Ok(());
        };
        if self.world.is_some() {
            // Every process takes part in every tensor's collective, a rank whose rows had no
            // trained token with zeros.
            for grads in per_rank.iter_mut() {
                *grads = self.every_trainable(std::mem::take(grads)).map_err(|e| {
                    step_error(
                        Phase::Backward,
                        self.step + 1,
                        acc.last_shape(),
                        e,
                        &self.settings_summary(),
                    )
                })?;
            }
        } else if per_rank.iter().all(Gradients::is_empty) {
            return Ok(());
        }
        let ranks = per_rank.len();
        let devices: Vec<Device> = self.placement.devices[..ranks]
            .iter()
            .map(|d| d.candle.clone())
            .collect();
        let whole = std::mem::replace(per_rank, vec![Gradients::new(); ranks]);
        sharded.reduce_scatter_into(
            whole,
            &mut acc.grads,
            &devices,
            self.shard_reducer().as_ref(),
        )
    }

    /// Runs one micro-step of every rank (`micro_step`); under sharded data parallel each
    /// decoder layer's gradients are reduce-scattered into the step's ranges (`sums`) as the
    /// backward produces them (`layer_stream`), the rest by [`Self::fold_micro_step`] after.
    pub(super) fn streamed<T>(
        &self,
        models: &[&CausalLm],
        sums: &mut Vec<Gradients>,
        micro_step: impl FnOnce() -> Vec<Result<T, RankError>>,
    ) -> Vec<Result<T, RankError>> {
        match &self.sharded {
            Some(sharded) if self.world.is_none() => with_layer_stream(
                sharded.layout(),
                self.shard_reducer(),
                models,
                sums,
                micro_step,
                |e| {
                    (
                        Phase::Backward,
                        ModelError::Input(format!("reduce-scatter: {e}")),
                    )
                },
            ),
            _ => micro_step(),
        }
    }

    /// The collectives of a sharded run in this process: NCCL's when the run opened
    /// communicators (its ranks distinct GPUs, a build with the `nccl` feature), else the
    /// host's.
    pub(super) fn shard_reducer(&self) -> Arc<dyn GradientReducer + Send + Sync> {
        #[cfg(feature = "nccl")]
        if let Some(nccl) = &self.nccl {
            return nccl.clone();
        }
        // A launched run without NCCL: the process group over TCP.
        if let Some(world) = &self.world {
            return world.clone();
        }
        Arc::new(crate::devices::HostReducer)
    }
}
