//! `[training]`: what every method shares (precision, batch, optimizer, schedule, loss
//! scaling), its defaults and the range of each value.

use serde::{Deserialize, Serialize};

use super::super::error::ConfigProblem;
use super::super::precision::Precision;
use super::super::schedule::ScheduleKind;
use super::TrainingMethod;
use crate::model::OptimizerOffload;

/// `[training]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainingSection {
    /// Numeric precision mode.
    pub precision: Precision,
    /// Rows per forward/backward pass.
    pub micro_batch: usize,
    /// Micro-batches accumulated into one optimizer step.
    pub gradient_accumulation: usize,
    /// Passes over the training split (ignored when `max_steps` is set).
    pub epochs: u32,
    /// Optimizer steps to run; overrides `epochs` when set.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_steps: Option<u64>,
    /// Peak learning rate.
    pub learning_rate: f64,
    /// Learning-rate schedule after warm-up.
    pub schedule: ScheduleKind,
    /// Linear warm-up steps (exclusive with `warmup_ratio`).
    pub warmup_steps: u64,
    /// Warm-up as a fraction of the total steps (exclusive with `warmup_steps`).
    pub warmup_ratio: f64,
    /// Decoupled AdamW weight decay.
    pub weight_decay: f64,
    /// Clip the global gradient norm to this value; 0 turns clipping off.
    pub max_grad_norm: f64,
    /// Recompute each layer's activations in the backward pass (less memory, ~30 % more time).
    pub activation_checkpointing: bool,
    /// Keep AdamW's state in host RAM instead of on the GPU (`"none"` or `"host"`).
    pub optimizer_offload: OptimizerOffload,
    /// Seed of everything random: initialisation, data order, dropout.
    pub seed: u64,
    /// AdamW β₁.
    pub adam_beta1: f64,
    /// AdamW β₂.
    pub adam_beta2: f64,
    /// AdamW ε.
    pub adam_epsilon: f64,
    /// Apply weight decay to norm weights and biases too (transformers' Trainer does not).
    pub decay_norms_and_biases: bool,
    /// fp16-mixed: the loss scale at the start.
    pub initial_loss_scale: f64,
    /// fp16-mixed: double the loss scale after this many steps without overflow.
    pub loss_scale_growth_interval: u64,
    /// What a loss spike after the warm-up does: `"warn"` or `"stop"` (see `train::divergence`).
    pub on_divergence: super::super::divergence::OnDivergence,
    /// What is learned: `"sft"` (next tokens of the data), `"dpo"` or `"orpo"` (preference
    /// pairs; see `[preference]`), `"grpo"` (rewards of sampled completions; see `[grpo]`).
    pub method: TrainingMethod,
}

impl TrainingSection {
    /// Samples per optimizer step over `ranks` data-parallel ranks, in the method's unit
    /// ([`TrainingMethod::micro_batch_unit`]): micro-batch × accumulation × ranks. The one
    /// place this product is written outside the planner (which counts rows).
    pub fn effective_batch(&self, ranks: usize) -> usize {
        self.micro_batch * self.gradient_accumulation * ranks
    }
}

impl Default for TrainingSection {
    fn default() -> Self {
        TrainingSection {
            precision: Precision::Fp32,
            micro_batch: 1,
            gradient_accumulation: 1,
            epochs: 1,
            max_steps: None,
            learning_rate: 1e-4,
            schedule: ScheduleKind::Cosine,
            warmup_steps: 0,
            warmup_ratio: 0.0,
            weight_decay: 0.0,
            max_grad_norm: 1.0,
            activation_checkpointing: false,
            optimizer_offload: OptimizerOffload::None,
            seed: 42,
            adam_beta1: 0.9,
            adam_beta2: 0.999,
            adam_epsilon: 1e-8,
            decay_norms_and_biases: false,
            initial_loss_scale: 65536.0,
            loss_scale_growth_interval: 200,
            on_divergence: super::super::divergence::OnDivergence::Warn,
            method: TrainingMethod::Sft,
        }
    }
}

impl TrainingSection {
    /// Every value of `[training]` out of its range (batch, length, optimizer and loss-scale
    /// settings), beside the fields: a new setting's range goes here.
    pub(crate) fn problems(&self) -> Vec<ConfigProblem> {
        let mut p = Vec::new();
        let mut bad = |field: &str, message: String| p.push(ConfigProblem::new(field, message));
        let t = self;
        if t.micro_batch < 1 {
            bad(
                "training.micro_batch",
                format!("must be ≥ 1 (got {})", t.micro_batch),
            );
        }
        if t.gradient_accumulation < 1 {
            bad(
                "training.gradient_accumulation",
                format!("must be ≥ 1 (got {})", t.gradient_accumulation),
            );
        }
        match t.max_steps {
            Some(0) => bad(
                "training.max_steps",
                "must be ≥ 1 (got 0); remove it to train by epochs".into(),
            ),
            Some(_) => {}
            None if t.epochs < 1 => bad(
                "training.epochs",
                format!("must be ≥ 1 (got {}), or set training.max_steps", t.epochs),
            ),
            None => {}
        }
        if !(t.learning_rate.is_finite() && t.learning_rate > 0.0) {
            bad(
                "training.learning_rate",
                format!("must be a positive number (got {})", t.learning_rate),
            );
        } else if t.learning_rate > 1.0 {
            bad(
                "training.learning_rate",
                format!(
                    "{} is far too large for AdamW; typical values are 1e-5 … 1e-3",
                    t.learning_rate
                ),
            );
        }
        if !(0.0..1.0).contains(&t.warmup_ratio) {
            bad(
                "training.warmup_ratio",
                format!("must be in [0, 1) (got {})", t.warmup_ratio),
            );
        }
        if t.warmup_steps > 0 && t.warmup_ratio > 0.0 {
            bad(
                "training.warmup_ratio",
                format!(
                    "set either warmup_steps ({}) or warmup_ratio ({}), not both",
                    t.warmup_steps, t.warmup_ratio
                ),
            );
        }
        if !(t.weight_decay.is_finite() && t.weight_decay >= 0.0) {
            bad(
                "training.weight_decay",
                format!("must be ≥ 0 (got {})", t.weight_decay),
            );
        }
        if !(t.max_grad_norm.is_finite() && t.max_grad_norm >= 0.0) {
            bad(
                "training.max_grad_norm",
                format!("must be ≥ 0, 0 = no clipping (got {})", t.max_grad_norm),
            );
        }
        for (field, v) in [
            ("training.adam_beta1", t.adam_beta1),
            ("training.adam_beta2", t.adam_beta2),
        ] {
            if !(0.0..1.0).contains(&v) {
                bad(field, format!("must be in [0, 1) (got {v})"));
            }
        }
        if !(t.adam_epsilon.is_finite() && t.adam_epsilon > 0.0) {
            bad(
                "training.adam_epsilon",
                format!("must be > 0 (got {})", t.adam_epsilon),
            );
        }
        if t.precision == Precision::Fp16Mixed {
            if !(t.initial_loss_scale.is_finite() && t.initial_loss_scale >= 1.0) {
                bad(
                    "training.initial_loss_scale",
                    format!("must be ≥ 1 (got {})", t.initial_loss_scale),
                );
            }
            if t.loss_scale_growth_interval < 1 {
                bad(
                    "training.loss_scale_growth_interval",
                    "must be ≥ 1 (got 0)".to_string(),
                );
            }
        }
        p
    }
}
