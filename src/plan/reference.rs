//! A DPO run's reference model as the memory plan sees it ([`PlanRequest::reference`], from
//! `[preference] reference`):
//! - **stored** (`precomputed`, `auto`; ORPO and SFT have none): nothing during the step. The
//!   stored log-probabilities are 8 bytes a pair (inside the dataset's process term), and the
//!   pass before the first step is a forward without a graph, bounded like the evaluation.
//! - **adapter-disabled**: no weights of its own; each micro-step first runs its batch through
//!   the base without a graph ([`reference_forward_bytes`]), before the policy's forward.
//! - **copy**: that forward, on a frozen copy of every weight in the compute dtype, held on
//!   each rank's devices for the whole run (under a layer split each stage holds its layers'
//!   share): [`copy_weight_bytes`] per block.

use super::step_model::StepDims;
use super::PlanRequest;

/// Where a preference run's reference comes from, as memory sees it.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "kebab-case")]
pub enum ReferencePlan {
    /// No reference weights and no reference forward during the step (SFT, ORPO,
    /// `precomputed`).
    #[default]
    Stored,
    /// The policy with its LoRA adapters switched off, a forward without a graph each
    /// micro-step.
    AdapterDisabled,
    /// A frozen copy of the starting weights, a forward without a graph each micro-step.
    Copy,
}

/// The frozen copy's bytes of a block of `parameters` dense parameters (0 unless `copy`,
/// which is full fine-tuning: nothing is quantized).
pub(crate) fn copy_weight_bytes(req: &PlanRequest, dims: &StepDims, parameters: u64) -> u64 {
    if req.reference == ReferencePlan::Copy {
        parameters * dims.weight_bytes
    } else {
        0
    }
}

/// The peak transient of the reference's forward without a graph over the blocks a device
/// holds, each given as whether it is the head and its training forward's transient: a
/// decoder block holds its input and output hidden states and at most the training forward's
/// transient; the head the norm's output and the full logits with `logits − max` and its
/// `exp` (the evaluation's preference figure, `process::evaluation_transient_bytes`). Nothing
/// of it outlives the forward but two log-probabilities a row. 0 for a stored reference.
pub(crate) fn reference_forward_bytes(
    req: &PlanRequest,
    dims: &StepDims,
    blocks: impl Iterator<Item = (bool, u64)>,
) -> u64 {
    if req.reference == ReferencePlan::Stored {
        return 0;
    }
    let hidden_state = dims.tokens * dims.hidden * dims.act_bytes;
    blocks
        .map(|(head, forward_transient)| {
            if head {
                super::process::evaluation_transient_bytes(dims)
            } else {
                2 * hidden_state + forward_transient
            }
        })
        .max()
        .unwrap_or(0)
}
