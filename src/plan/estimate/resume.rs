//! A device's memory while a resume (or an out-of-memory refit) loads a checkpoint.

use super::*;

/// A device's memory at the resume from a checkpoint (or an out-of-memory refit's).
pub(super) struct ResumeMoment {
    pub(super) peak_bytes: u64,
    pub(super) transient_bytes: u64,
}

/// What exists when `TrainingRun::resume` loads a checkpoint onto a device: the runtime
/// overhead, the weights (a tied head's copy included) and the optimizer's own state (AdamW
/// allocates its moments and master copy before the load), plus one trainable tensor on its
/// way in (`checkpoint::TensorFile` reads one at a time; on a GPU it is placed, then copied
/// into its parameter). The moments need nothing more: each parameter's old state is freed
/// before its saved one is read (`AdamW::load_state_from`). No gradients, activations or
/// gemm workspace exist yet.
pub(super) fn resume_moment(
    costs: &LayerCosts,
    dims: &StepDims,
    held: &[usize],
    dp: &Timeline,
    overhead: u64,
) -> ResumeMoment {
    let largest_trainable = held
        .iter()
        .map(|&i| costs.blocks[i].largest_trainable_elems)
        .max()
        .unwrap_or(0);
    let transient_bytes = largest_trainable * dims.weight_bytes;
    let steady = dp.components.weights_bytes + dp.components.optimizer_bytes;
    ResumeMoment {
        peak_bytes: overhead + steady + transient_bytes,
        transient_bytes,
    }
}
