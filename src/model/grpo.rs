//! GRPO's numbers as pure functions: the group advantages of the rewards, the completion mask,
//! each completion token's log-probability under a temperature, and the clipped-surrogate loss
//! with its KL term and four aggregations — exactly as TRL 1.16's `GRPOTrainer` computes them
//! (`_generate_and_score_completions`, `_get_per_token_logps_and_entropies`, `_compute_loss`).
//! No model state, no I/O; tensors on any device. `tests/it/grpo_loss.rs` holds every number
//! to `fixtures/tiny-llama-grpo`, made by TRL's own trainer.

mod advantages;
mod logps;
mod loss;

pub use advantages::{advantages, completion_mask, Advantages, ScaleRewards, ADVANTAGE_STD_EPS};
pub use logps::{completion_logps, model_completion_logps, CompletionLogps};
pub use loss::{
    grpo_loss, GrpoLoss, GrpoLossMetrics, GrpoLossSettings, GrpoLossType, MicroBatchTotals,
};

#[cfg(test)]
mod tests;
