//! The dry run's report: one real forward/backward/optimizer step on the longest batch before
//! training, measured (by `devices::dry_run`, which runs it) against the plan's prediction.

use super::{format_bytes, ComponentReport, DevicePlan, Plan, StepReadings};
use crate::mem;
use std::fmt;

/// How the dry run measured memory (the meter is [`crate::mem::Meter`]).
pub use crate::mem::MeasureMethod;

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
    /// measured them (`devices::dry_run_with_components`); render it with
    /// [`ComponentReport::render`]. `None` when the step did not run.
    pub components: Option<ComponentReport>,
}

impl DryRunReport {
    /// Whether training may go ahead.
    pub fn ok(&self) -> bool {
        self.outcome == DryRunOutcome::Completed
    }

    /// The report for a device index the plan does not have.
    pub fn no_such_device(plan: &Plan, device_index: usize) -> Self {
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

    /// The report of a step not run because the plan already says `dev` is out of memory (a
    /// CPU allocation failure aborts the process, it cannot be caught); `None` when it fits.
    pub fn predicted_out_of_memory(dev: &DevicePlan) -> Option<Self> {
        if dev.fits {
            return None;
        }
        let mut report = DryRunReport::unmeasured(dev);
        report.outcome = DryRunOutcome::PredictedOutOfMemory;
        report.summary = format!(
            "not run: {} would need {} at the {} but has {} (short by {}); apply a fix first",
            dev.device.name,
            format_bytes(dev.peak_bytes),
            dev.peak_moment(),
            format_bytes(dev.device.capacity_bytes),
            format_bytes(dev.shortfall_bytes)
        );
        Some(report)
    }

    /// The report of a step that ran on `dev` (or failed with `result`'s error), measured as
    /// `measured`, with the component report made of what it measured.
    pub fn measured<E: fmt::Display>(
        dev: &DevicePlan,
        measured: StepMeasurement,
        components: ComponentReport,
        result: Result<(), E>,
    ) -> Self {
        let mut report = DryRunReport::unmeasured(dev);
        report.step_secs = measured.step_secs;
        report.method = measured.method;
        report.baseline_bytes = measured.baseline_bytes;
        report.measured_peak_bytes = measured.peak_bytes;
        report.components = Some(components);
        report.relative_error = measured
            .peak_bytes
            .filter(|&m| m > 0)
            .map(|m| (m as f64 - dev.peak_bytes as f64) / m as f64);
        conclude(&mut report, dev, result);
        report
    }

    /// A completed report for `dev` with nothing measured yet.
    fn unmeasured(dev: &DevicePlan) -> Self {
        DryRunReport {
            outcome: DryRunOutcome::Completed,
            device_name: dev.device.name.clone(),
            predicted_peak_bytes: dev.peak_bytes,
            measured_peak_bytes: None,
            baseline_bytes: None,
            method: MeasureMethod::Unavailable,
            relative_error: None,
            step_secs: 0.0,
            summary: String::new(),
            components: None,
        }
    }
}

/// What the layer that ran a dry run's step measured around it (the meter's readings and the
/// wall time), for [`DryRunReport::measured`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepMeasurement {
    /// What the meter read.
    pub method: MeasureMethod,
    /// Bytes in use when the step started.
    pub baseline_bytes: Option<u64>,
    /// The peak during the step.
    pub peak_bytes: Option<u64>,
    /// Wall time of the step.
    pub step_secs: f64,
}

/// What a `devices::dry_run_with_readings` step returns: its readings, and the plan of the data it
/// ran on when the step could make one (it tokenized the data to build its run, so the plan
/// sizes the data's real batches instead of `max_length`: `None` keeps the plan given).
pub struct StepMeasured {
    /// The meter and the counted tensors.
    pub readings: StepReadings,
    /// The plan of the same run for the batch the step ran on (its rows' trained tokens and
    /// longest row).
    pub plan_for_data: Option<Plan>,
}

/// The outcome and the summary line of a step that ran (or failed).
fn conclude<E: fmt::Display>(report: &mut DryRunReport, dev: &DevicePlan, result: Result<(), E>) {
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
