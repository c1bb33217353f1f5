//! The `[grpo]` table of `training.method = "grpo"`: TRL's `GRPOConfig` names and defaults
//! (TRL 1.16), and the reward functions (`[[grpo.reward]]`).

use serde::{Deserialize, Serialize};

pub use crate::model::grpo::{GrpoLossType, ScaleRewards};
use crate::train::error::ConfigProblem;
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
    /// Completions of each group run forward and backward together (unset: the whole group,
    /// G). A divisor of G: a micro-step's rows then go through `G / this` passes of
    /// `micro_batch × this` rows, their gradients summed, so the policy pass's memory shrinks
    /// and what is learned does not (the rollouts and the loss's normaliser stay the whole
    /// step's).
    pub generations_per_micro_step: Option<usize>,
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
            generations_per_micro_step: None,
            reward: Vec::new(),
        }
    }
}

impl GrpoSection {
    /// The upper clipping ε.
    pub fn epsilon_high(&self) -> f64 {
        self.epsilon_high.unwrap_or(self.epsilon)
    }

    /// Completions of a group per forward and backward pass (G when
    /// `generations_per_micro_step` is unset).
    pub fn generations_per_pass(&self) -> usize {
        self.generations_per_micro_step
            .unwrap_or(self.num_generations)
            .max(1)
    }

    /// Passes per micro-step: G / `generations_per_micro_step` (1 when unset, or when it does
    /// not divide G, which validation refuses).
    pub fn passes_per_micro_step(&self) -> usize {
        let per_pass = self.generations_per_pass();
        if self.num_generations.is_multiple_of(per_pass) {
            (self.num_generations / per_pass).max(1)
        } else {
            1
        }
    }
}

impl GrpoSection {
    /// Every value of `[grpo]` out of its range, beside the fields: a new setting's range goes
    /// here (`train/validate.rs` asks only under `method = "grpo"`).
    pub(crate) fn problems(&self) -> Vec<ConfigProblem> {
        let mut p = Vec::new();
        let mut bad = |field: &str, message: String| p.push(ConfigProblem::new(field, message));
        let g = self;
        if g.num_generations < 2 {
            bad(
            "grpo.num_generations",
            format!("must be ≥ 2 (got {}): advantages compare the completions of one prompt; TRL's default is 8", g.num_generations),
        );
        }
        for (field, v) in [
            ("grpo.max_prompt_length", g.max_prompt_length),
            ("grpo.max_completion_length", g.max_completion_length),
        ] {
            if v == 0 {
                bad(field, "must be ≥ 1".into());
            }
        }
        if !(g.temperature > 0.0 && g.temperature.is_finite()) {
            bad(
            "grpo.temperature",
            format!("must be > 0 (got {}): GRPO samples its completions; 1.0 samples the model as it is", g.temperature),
        );
        }
        if !(g.top_p > 0.0 && g.top_p <= 1.0) {
            bad(
                "grpo.top_p",
                format!("must be in (0, 1] (got {}); 1.0 turns it off", g.top_p),
            );
        }
        if !(g.beta >= 0.0 && g.beta.is_finite()) {
            bad(
                "grpo.beta",
                format!(
                    "must be ≥ 0 (got {}); 0 trains without a reference model",
                    g.beta
                ),
            );
        }
        if !(g.epsilon > 0.0 && g.epsilon < 1.0) {
            bad(
                "grpo.epsilon",
                format!(
                    "must be in (0, 1) (got {}); TRL's default is 0.2",
                    g.epsilon
                ),
            );
        }
        if g.epsilon_high.is_some_and(|e| !(e > 0.0 && e.is_finite())) {
            bad(
                "grpo.epsilon_high",
                "must be > 0 (DAPO uses 0.28); remove it to use epsilon".into(),
            );
        }
        if g.num_iterations == 0 {
            bad(
            "grpo.num_iterations",
            "0 trains on no sample: set 1 (TRL's default: every optimizer step samples its own completions) or more (each sampled block is trained on that many steps)".to_string(),
        );
        }
        if let Some(message) = g.generations_per_micro_step_problem() {
            bad("grpo.generations_per_micro_step", message);
        }
        if g.reward.is_empty() {
            bad(
            "grpo.reward",
            "GRPO needs at least one reward function: add a [[grpo.reward]] entry, e.g. kind = \"accuracy\" with column = \"answer\", or kind = \"format\" with a pattern".into(),
        );
        } else if let Err(e) = crate::train::grpo_rewards::validate(&g.reward) {
            bad("grpo.reward", e.to_string());
        }
        p
    }

    /// `generations_per_micro_step` splits each group into equal passes: it must divide G.
    fn generations_per_micro_step_problem(&self) -> Option<String> {
        let per_pass = self.generations_per_micro_step?;
        let group = self.num_generations;
        if per_pass >= 1 && group.is_multiple_of(per_pass) {
            return None;
        }
        let divisors: Vec<String> = (1..=group)
            .filter(|&d| group.is_multiple_of(d))
            .map(|d| d.to_string())
            .collect();
        Some(format!(
            "must divide grpo.num_generations = {group} (got {per_pass}): each pass runs an equal share of every group; use one of {} (or remove it to run the whole group at once)",
            divisors.join(", ")
        ))
    }
}
