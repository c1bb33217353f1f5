//! The planner's dry run of a run config, started as the trainer starts a run: the studio's
//! "Dry run" and `tunestudio plan --config run.toml --dry-run` both call [`dry_run`].

use super::config::RunConfig;
use super::step::TrainingRun;
use crate::plan::{self, DryRunReport, Meter, Plan, StepReadings};

/// Builds the run exactly as training does ([`TrainingRun::new`]: model, tokenizer, data,
/// optimizer) and takes one optimizer step with the trainer's own step code, on the longest
/// rows of the data ([`TrainingRun::step_longest`]: the plan is the longest batch's, and the
/// first batch of a run is not always the longest), measured against `plan`'s device 0.
///
/// The report's components are what the run can measure of itself: the tensors it holds
/// ([`TrainingRun::tensor_bytes`]: weights, AdamW state, gradients) and the dry run's meter
/// around the step (the resident set on a CPU, see [`plan::dry_run_with_readings`]); the
/// rest is derived, and the report says which figure is which. On several devices the
/// tensors are not attributed to device 0 and only the peak is compared.
///
/// The dry run does not evaluate: plan it with [`plan::PlanRequest::for_dry_run`]. Nothing is
/// written (no checkpoint, no metrics).
pub fn dry_run(config: RunConfig, plan: &Plan) -> DryRunReport {
    plan::dry_run_with_readings(plan, 0, move |meter: &Meter| {
        // The error as text: TrainError is large, and the report keeps its message only.
        let mut run = TrainingRun::new(config).map_err(|e| e.to_string())?;
        let in_use_before_step = meter.in_use_bytes();
        let peak_before_step = meter.peak_bytes();
        run.step_longest().map_err(|e| e.to_string())?;
        let single_device = run.placement().devices.len() == 1;
        Ok::<_, String>(StepReadings {
            method: meter.method(),
            tensors: single_device.then(|| run.tensor_bytes()),
            in_use_before_step,
            peak_before_step,
            peak_after_step: meter.peak_bytes(),
        })
    })
}
