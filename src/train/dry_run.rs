//! The planner's dry run of a run config, started as the trainer starts a run: the studio's
//! "Dry run" and `tunestudio plan --config run.toml --dry-run` both call [`dry_run`].

use super::config::RunConfig;
use super::step::TrainingRun;
use crate::mem::Meter;
use crate::plan::{self, DryRunReport, Plan, PlanRequest, StepMeasured, StepReadings};

/// Builds the run exactly as training does ([`TrainingRun::new`]: model, tokenizer, data,
/// optimizer) and takes one optimizer step with the trainer's own step code, on the longest
/// rows of the data ([`TrainingRun::step_longest`]: the plan is the longest batch's, and the
/// first batch of a run is not always the longest), measured against `plan`'s device 0.
///
/// The report's components are what the run can measure of itself: the tensors it holds
/// ([`TrainingRun::tensor_bytes`]: weights, AdamW state, gradients) and the dry run's meter
/// around the step (the resident set on a CPU, see [`crate::devices::dry_run_with_readings`]); the
/// rest is derived, and the report says which figure is which. On several devices the
/// tensors are not attributed to device 0 and only the peak is compared.
///
/// The plan compared with is `request`'s for a dry run ([`plan::PlanRequest::for_dry_run`]:
/// the dry run does not evaluate), and once the run has tokenized its data, that plan for the
/// rows the step runs on: their trained tokens and longest row (the run's own samples: the data
/// is not tokenized twice). The plan of the whole data sizes its loss for the rows with the most
/// trained tokens, which need not be the longest rows stepped on: compared with that bound, the
/// demo trained on completions measured +6.2 % on an AVX2 EPYC, +7.9 % in the headless build
/// (its binary 2–3 MiB smaller); with the step's own rows, −0.5 %. The plan compared with is returned with the report. Nothing is written
/// (no checkpoint, no metrics).
pub fn dry_run(
    config: RunConfig,
    request: &PlanRequest,
) -> Result<(DryRunReport, Plan), plan::PlanError> {
    let request = request.for_dry_run();
    let upper_bound = plan::plan(&request)?;
    let (report, plan_for_data) =
        crate::devices::dry_run_with_readings(&upper_bound, 0, move |meter: &Meter| {
            // The error as text: TrainError is large, and the report keeps its message only.
            let mut run = TrainingRun::new(config).map_err(|e| e.to_string())?;
            let in_use_before_step = meter.in_use_bytes();
            let peak_before_step = meter.peak_bytes();
            let plan_for_data = run.longest_step_trained_tokens().and_then(|tokens| {
                let mut req = request.clone();
                req.trained_tokens = Some(tokens);
                plan::plan(&req).ok()
            });
            run.step_longest().map_err(|e| e.to_string())?;
            let single_device = run.placement().devices.len() == 1;
            Ok::<_, String>(StepMeasured {
                readings: StepReadings {
                    method: meter.method(),
                    tensors: single_device.then(|| run.tensor_bytes()),
                    in_use_before_step,
                    peak_before_step,
                    peak_after_step: meter.peak_bytes(),
                },
                plan_for_data,
            })
        });
    Ok((report, plan_for_data.unwrap_or(upper_bound)))
}
