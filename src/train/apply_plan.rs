//! The one edit from the planner back to a run config: [`apply_plan_request`] writes a
//! [`PlanRequest`]'s settings into a [`RunConfig`], the inverse of [`super::plan_request`].
//!
//! Every way a plan's answer becomes settings goes through it: a fix the studio applies
//! ([`apply_fix`]), auto-fit's settings (the studio's "Apply", `AutoFit::request`), and the
//! out-of-memory refit (`train::oom`, which first refuses the changes a checkpoint cannot
//! resume into).
//!
//! # Why the compiler keeps it complete
//! A fix ([`crate::plan::Change`]) changes fields of the request; [`apply_plan_request`]
//! destructures the request with no `..`, so a new field (what a new kind of fix changes)
//! does not compile until it is written here or named as one no fix changes. Each field is
//! written back as [`super::plan_request`] reads it: a preference run's micro-batch counts
//! pairs where the request counts rows, its sequence length is the prompt plus the
//! completion, and a quantized base (`[model] quantize`, QLoRA) exists only under LoRA.

use crate::model::OptimizerOffload;
use crate::plan::{Change, LoraSpec, PlanRequest, ReferencePlan};
use crate::settings::{Precision, Quantization};

use super::config::{ModelDtype, ReferenceMode, RunConfig, TrainingMethod};
use super::plan_adapter::{plan_reference, planned_seq_len, rows_per_sample};

/// Writes the settings `req` plans into `config`, so that [`super::plan_request`] of the
/// edited config gives back the same settings (precision, micro-batch and accumulation,
/// sequence length, checkpointing, optimizer offload, LoRA and its quantized base, strategy and
/// shard mode, a DPO run's reference, a GRPO run's generations per pass). What the request only describes (the model, the devices, the ops
/// path, the process and the data) is left as it is.
pub fn apply_plan_request(config: &mut RunConfig, req: &PlanRequest) {
    let PlanRequest {
        // What is trained and where: no fix changes them.
        model: _,
        devices: _,
        ops: _,
        process: _,
        // The launcher's, not a setting.
        world: _,
        trained_tokens: _,
        // Follows `[training] method`, which no fix changes, and for GRPO the completion
        // length, which `set_seq_len` writes with the sequence length.
        head_loss: _,
        precision,
        micro_batch,
        gradient_accumulation,
        seq_len,
        activation_checkpointing,
        optimizer_offload,
        lora,
        strategy,
        shard,
        reference,
        generations_per_micro_step,
    } = req;
    write_precision(config, *precision);
    config.training.micro_batch = (micro_batch / rows_per_sample(config)).max(1);
    config.training.gradient_accumulation = *gradient_accumulation;
    config.training.activation_checkpointing = *activation_checkpointing;
    config.training.optimizer_offload = if *optimizer_offload {
        OptimizerOffload::Host
    } else {
        OptimizerOffload::None
    };
    set_seq_len(config, *seq_len);
    write_lora(config, lora.as_ref());
    config.devices.strategy = *strategy;
    // The adapter reads `shard` under `sharded` only: another strategy keeps the config's.
    if *strategy == crate::settings::Strategy::Sharded {
        config.devices.shard = *shard;
    }
    write_reference(config, *reference);
    // The adapter reads it under GRPO only: another method keeps the config's.
    if config.training.method.is_grpo() {
        config.grpo.generations_per_micro_step = *generations_per_micro_step;
    }
}

/// Applies one fix to `config`: `change` on the request it was ranked for (`planned`, the
/// request of `config`), written back with [`apply_plan_request`].
pub fn apply_fix(config: &mut RunConfig, planned: &PlanRequest, change: &Change) {
    apply_plan_request(config, &change.apply(planned));
}

/// The precision, and `[model] dtype` back to `auto` when it names another compute dtype
/// (validation rejects a dtype that disagrees with the precision).
fn write_precision(config: &mut RunConfig, precision: Precision) {
    config.training.precision = precision;
    let dtype = config.model.dtype.to_dtype();
    if dtype.is_some_and(|d| d != precision.compute_dtype()) {
        config.model.dtype = ModelDtype::Auto;
    }
}

/// Sets the tokens a row is cut at, as the planner's `seq_len`: `[data] max_length`, or a
/// preference run's prompt and completion lengths (the completion takes what the prompt
/// leaves; the prompt is halved when the row is shorter than it). `tunestudio plan --seq-len`
/// writes it too.
pub fn set_seq_len(config: &mut RunConfig, seq_len: usize) {
    if planned_seq_len(config) == seq_len {
        return;
    }
    let method = config.training.method;
    let (prompt, completion) = if method.is_preference() {
        let p = &mut config.preference;
        (&mut p.max_prompt_length, &mut p.max_completion_length)
    } else if method.is_grpo() {
        let g = &mut config.grpo;
        (&mut g.max_prompt_length, &mut g.max_completion_length)
    } else {
        config.data.max_length = seq_len;
        return;
    };
    if seq_len <= *prompt {
        *prompt = seq_len / 2;
    }
    *completion = seq_len - *prompt;
}

/// `[lora]` and `[model] quantize`: a quantized base exists only under LoRA.
fn write_lora(config: &mut RunConfig, lora: Option<&LoraSpec>) {
    match lora {
        Some(l) => {
            config.lora.enabled = true;
            config.lora.r = l.r;
            config.lora.target_modules = l.target_modules.clone();
            config.model.quantize = l.quantize;
        }
        None => {
            config.lora.enabled = false;
            config.model.quantize = Quantization::None;
        }
    }
}

/// `[preference] reference` for a DPO run, left as it is when it already plans as
/// `reference` (`auto` stays `auto`). ORPO reads none, but validation still holds its value
/// to LoRA's rule (`copy` is full fine-tuning's, `adapter-disabled` LoRA's): it follows LoRA.
fn write_reference(config: &mut RunConfig, reference: ReferencePlan) {
    let mode = &mut config.preference.reference;
    if config.training.method != TrainingMethod::Dpo {
        *mode = match (*mode, config.lora.enabled) {
            (ReferenceMode::Copy, true) => ReferenceMode::AdapterDisabled,
            (ReferenceMode::AdapterDisabled, false) => ReferenceMode::Copy,
            (other, _) => other,
        };
        return;
    }
    if plan_reference(config) == reference {
        return;
    }
    config.preference.reference = match reference {
        ReferencePlan::Stored => ReferenceMode::Precomputed,
        ReferencePlan::AdapterDisabled => ReferenceMode::AdapterDisabled,
        ReferencePlan::Copy => ReferenceMode::Copy,
    };
}
