//! The dry run: one real forward/backward/optimizer step on the longest batch
//! before training, measured against the plan's prediction.

use super::{format_bytes, ComponentReport, ComponentSet, Plan, StepReadings};
use crate::mem;
use std::fmt;
use std::time::Instant;

/// How the dry run measured memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum MeasureMethod {
    /// Peak heap bytes from [`crate::mem::CountingAllocator`] (exact for CPU tensors).
    CountingAllocator,
    /// Peak resident set size (`VmHWM`, reset before the step); includes mapped files.
    ProcessRss,
    /// Nothing to measure with (e.g. CUDA memory, or RSS unavailable off Linux).
    Unavailable,
}

impl fmt::Display for MeasureMethod {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            MeasureMethod::CountingAllocator => "counting allocator",
            MeasureMethod::ProcessRss => "peak RSS",
            MeasureMethod::Unavailable => "not measured",
        })
    }
}

/// What happened in the dry run.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub enum DryRunOutcome {
    /// The step ran.
    Completed,
    /// The plan already says the device is out of memory: the step was not run.
    PredictedOutOfMemory,
    /// The step failed with an out-of-memory error.
    OutOfMemory {
        /// The error as reported.
        message: String,
    },
    /// The step failed for another reason.
    Failed {
        /// The error as reported.
        message: String,
    },
}

/// The dry run's findings.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DryRunReport {
    /// What happened.
    pub outcome: DryRunOutcome,
    /// The device that was checked.
    pub device_name: String,
    /// The plan's peak for that device.
    pub predicted_peak_bytes: u64,
    /// The measured peak (heap or RSS), when measured.
    pub measured_peak_bytes: Option<u64>,
    /// Bytes in use when the step started (weights, optimizer states, everything else).
    pub baseline_bytes: Option<u64>,
    /// How it was measured.
    pub method: MeasureMethod,
    /// (measured − predicted) / measured, when measured.
    pub relative_error: Option<f64>,
    /// Wall time of the step.
    pub step_secs: f64,
    /// The outcome in words.
    pub summary: String,
    /// The plan's components for the device, next to the measured ones when the step
    /// measured them ([`dry_run_with_components`]); render it with
    /// [`ComponentReport::render`]. `None` when the step did not run.
    pub components: Option<ComponentReport>,
}

impl DryRunReport {
    /// Whether training may go ahead.
    pub fn ok(&self) -> bool {
        self.outcome == DryRunOutcome::Completed
    }
}

/// How this process can measure a step's peak: on the CPU the counting allocator when a binary
/// installed it, else the peak RSS where it can be reset; nothing for a GPU here.
fn measure_method(on_cpu: bool) -> MeasureMethod {
    if !on_cpu {
        MeasureMethod::Unavailable
    } else if mem::is_installed() {
        MeasureMethod::CountingAllocator
    } else if reset_peak_rss() && mem::process_rss_bytes().is_some() {
        MeasureMethod::ProcessRss
    } else {
        MeasureMethod::Unavailable
    }
}

/// Starts a measurement (the allocator's peak is reset): the bytes in use before the step.
fn start_measuring(method: MeasureMethod) -> Option<u64> {
    match method {
        MeasureMethod::CountingAllocator => {
            mem::reset_peak();
            Some(mem::current_bytes())
        }
        MeasureMethod::ProcessRss => mem::process_rss_bytes(),
        MeasureMethod::Unavailable => None,
    }
}

/// The peak since [`start_measuring`].
fn measured_peak(method: MeasureMethod) -> Option<u64> {
    match method {
        MeasureMethod::CountingAllocator => Some(mem::peak_bytes()),
        MeasureMethod::ProcessRss => mem::peak_rss_bytes(),
        MeasureMethod::Unavailable => None,
    }
}

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

/// What a [`dry_run_with_readings`] step returns: its readings, and the plan of the data it
/// ran on when the step could make one (it tokenized the data to build its run, so the plan
/// sizes the data's real batches instead of `max_length`: `None` keeps the plan given).
pub struct StepMeasured {
    /// The meter and the counted tensors.
    pub readings: StepReadings,
    /// The plan of the same run with the data's trained tokens and longest batch.
    pub plan_for_data: Option<Plan>,
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

/// The meter a dry run measures with, as the step sees it ([`dry_run_with_readings`]): the
/// counting allocator's heap, the process's resident set, or nothing (a GPU).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Meter {
    method: MeasureMethod,
}

impl Meter {
    /// What it reads.
    pub fn method(&self) -> MeasureMethod {
        self.method
    }

    /// Bytes in use now: the heap, or the resident set (`VmRSS`).
    pub fn in_use_bytes(&self) -> Option<u64> {
        match self.method {
            MeasureMethod::CountingAllocator => Some(mem::current_bytes()),
            MeasureMethod::ProcessRss => mem::process_rss_bytes(),
            MeasureMethod::Unavailable => None,
        }
    }

    /// The peak since the dry run started (it resets the peak before the step closure runs).
    pub fn peak_bytes(&self) -> Option<u64> {
        measured_peak(self.method)
    }
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
        &super::DevicePlan,
        Option<u64>,
    ) -> ComponentReport,
) -> (DryRunReport, Option<Plan>) {
    let Some(dev) = plan.per_device.get(device_index) else {
        return (no_such_device(plan, device_index), None);
    };
    let predicted = dev.peak_bytes;
    let mut report = DryRunReport {
        outcome: DryRunOutcome::Completed,
        device_name: dev.device.name.clone(),
        predicted_peak_bytes: predicted,
        measured_peak_bytes: None,
        baseline_bytes: None,
        method: MeasureMethod::Unavailable,
        relative_error: None,
        step_secs: 0.0,
        summary: String::new(),
        components: None,
    };
    if !dev.fits {
        report.outcome = DryRunOutcome::PredictedOutOfMemory;
        report.summary = format!(
            "not run: {} would need {} at the {} but has {} (short by {}); apply a fix first",
            dev.device.name,
            format_bytes(predicted),
            dev.peak_moment(),
            format_bytes(dev.device.capacity_bytes),
            format_bytes(dev.shortfall_bytes)
        );
        return (report, None);
    }
    let on_cpu = dev.device.kind == super::DeviceKind::Cpu;
    let method = measure_method(on_cpu);
    let baseline = start_measuring(method);
    let start = Instant::now();
    let (result, plan_for_data) = match step(&Meter { method }) {
        Ok((measured, p)) => (Ok(measured), p),
        Err(e) => (Err(e), None),
    };
    report.step_secs = start.elapsed().as_secs_f64();
    // The plan of the step's own data, when it made one, is what the step is compared with.
    let dev = plan_for_data
        .as_ref()
        .and_then(|p| p.per_device.get(device_index))
        .unwrap_or(dev);
    let predicted = dev.peak_bytes;
    report.predicted_peak_bytes = predicted;
    report.method = method;
    report.baseline_bytes = baseline;
    report.measured_peak_bytes = measured_peak(method);
    report.components = Some(report_components(
        &dev.predicted_components(),
        result.as_ref().ok(),
        dev,
        report.measured_peak_bytes,
    ));
    report.relative_error = report
        .measured_peak_bytes
        .filter(|&m| m > 0)
        .map(|m| (m as f64 - predicted as f64) / m as f64);
    conclude(&mut report, dev, result.map(|_| ()));
    (report, plan_for_data)
}

/// The report for a device index the plan does not have.
fn no_such_device(plan: &Plan, device_index: usize) -> DryRunReport {
    DryRunReport {
        outcome: DryRunOutcome::Failed {
            message: format!(
                "the plan has {} device(s); there is no device {device_index}",
                plan.per_device.len()
            ),
        },
        device_name: String::new(),
        predicted_peak_bytes: 0,
        measured_peak_bytes: None,
        baseline_bytes: None,
        method: MeasureMethod::Unavailable,
        relative_error: None,
        step_secs: 0.0,
        summary: "dry run skipped: no such device in the plan".into(),
        components: None,
    }
}

/// The outcome and the summary line of a step that ran (or failed).
fn conclude<E: fmt::Display>(
    report: &mut DryRunReport,
    dev: &super::DevicePlan,
    result: Result<(), E>,
) {
    let predicted = report.predicted_peak_bytes;
    match result {
        Ok(()) => {
            report.summary = match (report.measured_peak_bytes, report.relative_error) {
                (Some(m), Some(e)) => format!(
                    "dry run on {}: peak {} measured ({}), {} predicted ({:+.1} %), {:.1} s",
                    dev.device.name,
                    format_bytes(m),
                    report.method,
                    format_bytes(predicted),
                    -100.0 * e,
                    report.step_secs
                ),
                _ => format!(
                    "dry run on {}: the step ran in {:.1} s ({} predicted, not measured)",
                    dev.device.name,
                    report.step_secs,
                    format_bytes(predicted)
                ),
            };
        }
        Err(e) => {
            let message = e.to_string();
            if mem::is_out_of_memory_message(&message) {
                report.summary = format!(
                    "out of memory on {} during the dry run ({} predicted of {}): {message}",
                    dev.device.name,
                    format_bytes(predicted),
                    format_bytes(dev.device.capacity_bytes)
                );
                report.outcome = DryRunOutcome::OutOfMemory { message };
            } else {
                report.summary =
                    format!("the dry run step failed on {}: {message}", dev.device.name);
                report.outcome = DryRunOutcome::Failed { message };
            }
        }
    }
}

/// Resets the kernel's peak-RSS counter (`VmHWM`) by writing 5 to
/// `/proc/self/clear_refs`; false where that is not possible.
fn reset_peak_rss() -> bool {
    #[cfg(target_os = "linux")]
    {
        std::fs::write("/proc/self/clear_refs", "5").is_ok()
    }
    #[cfg(not(target_os = "linux"))]
    {
        false
    }
}
