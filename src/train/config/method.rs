//! `[training] method` and the `[preference]` table: what a run learns, and DPO's and ORPO's
//! settings (the loss, β, the reference, the pairs' truncation lengths). GRPO's are in
//! [`super::grpo`].

use serde::{Deserialize, Serialize};

/// `[training] method`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TrainingMethod {
    /// Supervised fine-tuning: the causal-LM loss on the trained tokens.
    #[default]
    Sft,
    /// Direct preference optimisation (`[preference] loss = "sigmoid"` or `"ipo"`) against a
    /// reference model.
    Dpo,
    /// Odds-ratio preference optimisation: the chosen answers' NLL plus an odds-ratio term;
    /// no reference model.
    Orpo,
    /// Group relative policy optimisation: the model samples `[grpo] num_generations`
    /// completions per prompt, reward functions score them, and each completion's tokens
    /// learn from its advantage over its group (see `[grpo]`).
    Grpo,
}

impl TrainingMethod {
    /// Whether the method trains on preference pairs.
    pub fn is_preference(self) -> bool {
        matches!(self, TrainingMethod::Dpo | TrainingMethod::Orpo)
    }

    /// Whether the method samples completions and learns from their rewards.
    pub fn is_grpo(self) -> bool {
        self == TrainingMethod::Grpo
    }

    /// The config spelling.
    pub fn name(self) -> &'static str {
        match self {
            TrainingMethod::Sft => "sft",
            TrainingMethod::Dpo => "dpo",
            TrainingMethod::Orpo => "orpo",
            TrainingMethod::Grpo => "grpo",
        }
    }
}

/// `[preference] loss` (for DPO).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DpoLoss {
    /// TRL's `sigmoid`: −log σ(β·margin), with cDPO's `label_smoothing`.
    #[default]
    Sigmoid,
    /// IPO: (margin of mean log-probabilities − 1/(2β))².
    Ipo,
}

/// `[preference] reference`: where DPO's reference log-probabilities come from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ReferenceMode {
    /// `precomputed`, for LoRA and full fine-tuning alike: the same numbers as TRL's default
    /// reference (a fresh adapter adds nothing), at the least cost (see `train::preference`).
    #[default]
    Auto,
    /// One pass over the data before the first step stores each pair's reference
    /// log-probabilities (the model as loaded: the base, since a fresh LoRA adapter adds
    /// nothing), so no second copy of the weights is held. Stored in the run folder for resume.
    Precomputed,
    /// The base with the adapters switched off, computed each micro-step without a graph
    /// (LoRA and QLoRA only; TRL's reference for a PEFT model with no `ref_model`).
    AdapterDisabled,
    /// A frozen copy of the starting weights on every rank's devices, run each micro-step
    /// without a graph (full fine-tuning only; TRL's `ref_model`).
    Copy,
}

/// `[preference]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PreferenceSection {
    /// DPO's loss.
    pub loss: DpoLoss,
    /// DPO's β (the reward scale; TRL's default 0.1); ORPO's λ, as in TRL.
    pub beta: f64,
    /// cDPO's ε: the probability that a pair's labels are flipped, in `[0, 0.5)`.
    pub label_smoothing: f64,
    /// Where the reference log-probabilities come from (DPO).
    pub reference: ReferenceMode,
    /// Prompt tokens kept, from the prompt's end (TRL's `max_prompt_length`).
    pub max_prompt_length: usize,
    /// Tokens kept of each completion, from its start.
    pub max_completion_length: usize,
}

impl Default for PreferenceSection {
    fn default() -> Self {
        let limits = crate::data::preference::PairLimits::default();
        PreferenceSection {
            loss: DpoLoss::Sigmoid,
            beta: 0.1,
            label_smoothing: 0.0,
            reference: ReferenceMode::Auto,
            max_prompt_length: limits.max_prompt_length.unwrap_or(512),
            max_completion_length: limits.max_completion_length.unwrap_or(512),
        }
    }
}

impl PreferenceSection {
    /// The pair tokeniser's truncation lengths.
    pub fn limits(&self) -> crate::data::preference::PairLimits {
        crate::data::preference::PairLimits {
            max_prompt_length: Some(self.max_prompt_length),
            max_completion_length: Some(self.max_completion_length),
        }
    }
}
