//! The dry run: runs one real step before training and measures it with the process's meter
//! ([`crate::mem::Meter`]); the planner turns what was measured into its report.

use crate::mem::Meter;
use crate::plan::{
    ComponentReport, ComponentSet, DeviceKind, DevicePlan, DryRunReport, Plan, StepMeasured,
    StepMeasurement,
};
use std::fmt;
use std::time::Instant;

/// Runs `step` (one forward/backward/optimizer step on the run's longest batch, built
/// exactly as the trainer builds its steps) and compares its memory peak with the
/// prediction of `plan` for device `device_index`.
///
/// When the plan already predicts that device to be out of memory the step is not
/// run (a CPU allocation failure aborts the process, it cannot be caught) and the
/// report says so. On CPU the peak is the counting allocator's when a binary installed
/// it (see [`crate::mem`]), else the peak RSS; CUDA memory is not measured here.
pub fn dry_run<E: fmt::Display>(
    plan: &Plan,
    device_index: usize,
    step: impl FnOnce() -> Result<(), E>,
) -> DryRunReport {
    dry_run_with_components(plan, device_index, || step().map(|()| None))
}

/// [`dry_run`] with a step that may measure its own components (weights, optimizer state,
/// gradients, activations, logits/loss, as defined in `plan::components`): the report's
/// [`DryRunReport::components`] then shows them next to the plan's, so a user sees which
/// part of the prediction is off. A step that returns `None` gets the predicted column only.
pub fn dry_run_with_components<E: fmt::Display>(
    plan: &Plan,
    device_index: usize,
    step: impl FnOnce() -> Result<Option<ComponentSet>, E>,
) -> DryRunReport {
    dry_run_measuring(
        plan,
        device_index,
        |_| step().map(|set| (set, None)),
        |predicted, measured, _, _| {
            ComponentReport::with_measured(predicted, measured.and_then(Option::as_ref))
        },
    )
    .0
}

/// [`dry_run`] with a step that cannot measure its components inside it (no hooks, no
/// counting allocator: a whole `TrainingRun`), but reads the dry run's [`Meter`] around its
/// step and counts the tensors it holds: the report's components are then those readings,
/// the rest derived from them ([`ComponentReport::from_readings`]).
///
/// `plan` decides whether the step runs (a predicted out-of-memory is not run); when the step
/// returns [`StepMeasured::plan_for_data`], that plan is the one compared with, and returned.
pub fn dry_run_with_readings<E: fmt::Display>(
    plan: &Plan,
    device_index: usize,
    step: impl FnOnce(&Meter) -> Result<StepMeasured, E>,
) -> (DryRunReport, Option<Plan>) {
    dry_run_measuring(
        plan,
        device_index,
        |meter| step(meter).map(|m| (m.readings, m.plan_for_data)),
        |predicted, readings, dev, measured_peak| match readings {
            Some(r) => ComponentReport::from_readings(predicted, r, dev.peak_bytes, measured_peak),
            None => ComponentReport::with_measured(predicted, None),
        },
    )
}

/// The dry run, with what the step returns turned into the component report by `report`;
/// the step may return a plan of its own data to compare with (returned with the report).
fn dry_run_measuring<T, E: fmt::Display>(
    plan: &Plan,
    device_index: usize,
    step: impl FnOnce(&Meter) -> Result<(T, Option<Plan>), E>,
    report_components: impl FnOnce(
        &ComponentSet,
        Option<&T>,
        &DevicePlan,
        Option<u64>,
    ) -> ComponentReport,
) -> (DryRunReport, Option<Plan>) {
    let Some(dev) = plan.per_device.get(device_index) else {
        return (DryRunReport::no_such_device(plan, device_index), None);
    };
    if let Some(report) = DryRunReport::predicted_out_of_memory(dev) {
        return (report, None);
    }
    let meter = Meter::for_step(dev.device.kind == DeviceKind::Cpu);
    let baseline_bytes = meter.start();
    let start = Instant::now();
    let (result, plan_for_data) = match step(&meter) {
        Ok((measured, p)) => (Ok(measured), p),
        Err(e) => (Err(e), None),
    };
    let step_secs = start.elapsed().as_secs_f64();
    // The plan of the step's own data, when it made one, is what the step is compared with.
    let dev = plan_for_data
        .as_ref()
        .and_then(|p| p.per_device.get(device_index))
        .unwrap_or(dev);
    let measured = StepMeasurement {
        method: meter.method(),
        baseline_bytes,
        peak_bytes: meter.peak_bytes(),
        step_secs,
    };
    let components = report_components(
        &dev.predicted_components(),
        result.as_ref().ok(),
        dev,
        measured.peak_bytes,
    );
    let report = DryRunReport::measured(dev, measured, components, result.map(|_| ()));
    (report, plan_for_data)
}
