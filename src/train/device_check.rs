//! The device check's runs (`tunestudio devices --check`) planned through the one run-config
//! adapter: each [`CheckRun`] is written into a [`RunConfig`] and made a request by
//! [`plan_request`], as every other front end plans.
//!
//! # Why it lives in `train`
//! The checks run in `crate::devices`, below the trainer (`devices ← train`), so they cannot
//! call the adapter themselves; [`check_options`] hands it to them as
//! [`crate::devices::check::CheckOptions::planner`].

use std::sync::Arc;

use crate::devices::check::{CheckMode, CheckOptions, CheckRun};
use crate::plan::PlanRequest;

use super::config::RunConfig;
use super::plan_adapter::plan_request;

/// The checks' options for `mode` (the shared tiny-llama fixture, every step), their runs
/// planned by [`check_request`].
pub fn check_options(mode: CheckMode) -> CheckOptions {
    CheckOptions::new(mode, Arc::new(check_request))
}

/// The run config of a check's run: the run config's defaults (SFT, no LoRA, no offload)
/// with the run's settings, one micro-batch per optimizer step.
pub fn check_run_config(run: &CheckRun) -> RunConfig {
    let mut config = RunConfig::default();
    let t = &mut config.training;
    t.precision = run.precision;
    t.micro_batch = run.micro_batch;
    t.gradient_accumulation = 1;
    t.activation_checkpointing = run.activation_checkpointing;
    config.data.max_length = run.seq_len;
    config.devices.strategy = run.strategy;
    config
}

/// The planner's request of a check's run: [`plan_request`] on [`check_run_config`], without
/// the process's terms. The checks measure the training step alone (a fixture batch, random
/// tokens), with no tokenizer, dataset or mapped weights loaded, so the request plans the
/// training tensors only, as the measurement sees them.
pub fn check_request(run: &CheckRun) -> PlanRequest {
    let mut req = plan_request(
        &check_run_config(run),
        run.model.clone(),
        run.devices.clone(),
    );
    req.process = None;
    req
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{DeviceSpec, HeadLoss, ReferencePlan};
    use crate::settings::{Precision, Strategy};

    fn tiny_model() -> crate::model::ModelConfig {
        let path = crate::paths::shared_dir()
            .join("fixtures")
            .join("tiny-llama")
            .join("config.json");
        crate::model::ModelConfig::from_file(&path).unwrap()
    }

    /// The request is the run's settings and nothing else: what the checks planned when
    /// they built the request by hand (one step, no LoRA, offload, process terms or data).
    #[test]
    fn a_check_run_plans_its_settings_and_nothing_else() {
        let run = CheckRun {
            model: tiny_model(),
            precision: Precision::Bf16Mixed,
            micro_batch: 3,
            seq_len: 96,
            activation_checkpointing: true,
            strategy: Strategy::LayerSplit,
            devices: vec![DeviceSpec::cpu(1 << 30), DeviceSpec::cpu(2 << 30)],
        };
        let req = check_request(&run);
        assert_eq!(req.model, run.model);
        assert_eq!(req.precision, Precision::Bf16Mixed);
        assert_eq!(req.micro_batch, 3);
        assert_eq!(req.gradient_accumulation, 1);
        assert_eq!(req.seq_len, 96);
        assert!(req.activation_checkpointing);
        assert!(!req.optimizer_offload);
        assert_eq!(req.lora, None);
        assert_eq!(req.strategy, Strategy::LayerSplit);
        assert_eq!(req.devices, run.devices);
        assert_eq!(
            req.ops,
            crate::model::OpsMode::from_env().unwrap_or_default()
        );
        assert_eq!(req.process, None);
        assert_eq!(req.trained_tokens, None);
        assert_eq!(req.head_loss, HeadLoss::Chunked);
        assert_eq!(req.reference, ReferencePlan::Stored);
    }

    #[test]
    fn the_check_options_plan_through_the_adapter() {
        let options = check_options(CheckMode::Cpu);
        let run = CheckRun {
            model: tiny_model(),
            precision: Precision::Fp32,
            micro_batch: 2,
            seq_len: 24,
            activation_checkpointing: false,
            strategy: Strategy::Single,
            devices: vec![DeviceSpec::cpu(1 << 30)],
        };
        assert_eq!((options.planner)(&run), check_request(&run));
    }
}
