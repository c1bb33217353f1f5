//! `[training] method` and the `[preference]` table: what a run learns, and DPO's and ORPO's
//! settings (the loss, β, the reference, the pairs' truncation lengths). GRPO's are in
//! `config/grpo.rs`.

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

    /// What `[training] micro_batch` counts under this method, in the plural: SFT's rows,
    /// DPO's and ORPO's pairs (each two rows), GRPO's prompts (each `num_generations` rows).
    /// Every front end labels the micro-batch with it.
    pub fn micro_batch_unit(self) -> &'static str {
        match self {
            TrainingMethod::Sft => "rows",
            TrainingMethod::Dpo | TrainingMethod::Orpo => "pairs",
            TrainingMethod::Grpo => "prompts",
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::RunConfig;

    /// Switching a DPO run with the IPO loss and label smoothing to ORPO leaves settings ORPO
    /// accepts; switching back keeps them (a user's later choice).
    #[test]
    fn switching_to_orpo_resets_what_orpo_refuses() {
        let mut c = RunConfig::default();
        c.set_method(TrainingMethod::Dpo);
        c.preference.loss = DpoLoss::Ipo;
        c.preference.label_smoothing = 0.1;
        c.set_method(TrainingMethod::Orpo);
        assert_eq!(c.training.method, TrainingMethod::Orpo);
        assert_eq!(c.preference.loss, DpoLoss::Sigmoid);
        assert_eq!(c.preference.label_smoothing, 0.0);
        c.preference.label_smoothing = 0.0;
        c.set_method(TrainingMethod::Grpo);
        assert_eq!(c.training.method.micro_batch_unit(), "prompts");
        assert_eq!(
            c.effective_batch(),
            c.training.micro_batch * c.training.gradient_accumulation
        );
    }
}
