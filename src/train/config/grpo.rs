//! The `[grpo]` table of `training.method = "grpo"`: TRL's `GRPOConfig` names and defaults
//! (TRL 1.16), and the reward functions (`[[grpo.reward]]`).

use serde::{Deserialize, Serialize};

pub use crate::model::grpo::{GrpoLossType, ScaleRewards};
use crate::train::grpo_rewards::RewardSpec;

/// `[grpo]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GrpoSection {
    /// G: completions sampled per prompt (a group); the advantages compare them.
    pub num_generations: usize,
    /// Prompt tokens kept, from the prompt's end.
    pub max_prompt_length: usize,
    /// Most tokens sampled per completion; the memory plan is sized by it, since a completion
    /// this long will come.
    pub max_completion_length: usize,
    /// The sampling temperature; every log-probability divides the logits by it too.
    pub temperature: f64,
    /// Nucleus sampling (1.0 = off).
    pub top_p: f64,
    /// Top-k sampling (0 = off).
    pub top_k: usize,
    /// The KL coefficient β (0 = no reference model, TRL's default since 0.19).
    pub beta: f64,
    /// ε: the lower clipping bound `1 − ε` (and the upper one unless `epsilon_high` is set).
    pub epsilon: f64,
    /// DAPO's "clip higher" upper bound `1 + ε_high` (unset: ε).
    pub epsilon_high: Option<f64>,
    /// How the per-token losses are aggregated.
    pub loss_type: GrpoLossType,
    /// How advantages are scaled.
    pub scale_rewards: ScaleRewards,
    /// Optimizer steps taken on each generation batch (1: every step samples anew).
    pub num_iterations: usize,
    /// Completions that hit `max_completion_length` without an EOS are not trained on.
    pub mask_truncated_completions: bool,
    /// The reward functions, summed with their weights.
    pub reward: Vec<RewardSpec>,
}

impl Default for GrpoSection {
    fn default() -> Self {
        GrpoSection {
            num_generations: 8,
            max_prompt_length: 512,
            max_completion_length: 256,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            beta: 0.0,
            epsilon: 0.2,
            epsilon_high: None,
            loss_type: GrpoLossType::Dapo,
            scale_rewards: ScaleRewards::Group,
            num_iterations: 1,
            mask_truncated_completions: false,
            reward: Vec::new(),
        }
    }
}

impl GrpoSection {
    /// The upper clipping ε.
    pub fn epsilon_high(&self) -> f64 {
        self.epsilon_high.unwrap_or(self.epsilon)
    }
}
