//! The per-component error report: the step's memory split into the components memory
//! estimators report (weights, optimizer state, gradients, activations, logits/loss,
//! temporaries, process baseline), predicted next to measured, so a user sees *which* part
//! of a prediction is off, not only the peak.
//!
//! Each component has one definition, shared by the prediction ([`DevicePlan::components`])
//! and by what a measuring harness records (`tests/plan_support/harness.rs` with the counting
//! allocator, the dry run with what it can see):
//!
//! | component | predicted | measured |
//! |---|---|---|
//! | weights | the compute copy of every weight the device holds (frozen base and adapters) | heap rise while the model is built (and its adapters added) |
//! | optimizer | AdamW's f32 moments, plus the f32 master copy in mixed precision | heap rise of `AdamW::new` (it allocates moments and master copies at once) |
//! | gradients | one buffer per trainable parameter, as alive at the optimizer step | Σ bytes of the tensors in `Gradients` when the last backward returned |
//! | activations | what the embeddings and decoder layers keep for backward (`kept_bytes` of those blocks) | heap after the decoder's forward (embeddings, layers, final norm) − heap when the forward started |
//! | logits/loss | what the head keeps for backward: final norm output copies, the loss op's state (per-row log-sum-exp, labels, the cached last chunk's probabilities) | heap after the loss − heap after the decoder's forward |
//! | temporaries | the rest of the step's peak: peak − the components above that are alive in the peak's phase (never negative, see below) | the same rule on the measured peak and components |
//! | baseline | the process terms besides the heap (binary, tokenizer, dataset, allocator retention, GUI) when the request has [`super::ProcessInputs`] | resident set − heap (`VmRSS` − counted heap), where both are readable |
//!
//! A process without the counting allocator (`tunestudio plan --dry-run`, the studio's dry
//! run) measures less: [`StepReadings`] are the sizes of the tensors the trainer holds
//! (weights, optimizer state, gradients: counted, on any device) and the resident set's
//! high-water mark. The resident set cannot split the rest honestly (memory the setup freed
//! stays resident; AdamW's zeroed state is not resident before its first update, which made
//! a derived baseline of −779 MiB on SmolLM2-135M), so that table
//! ([`ComponentReport::from_readings`]) totals the **process** peak, the verdict's figure:
//! weights + optimizer + gradients (counted) + the rest of the peak (activations, logits/loss,
//! temporaries and baseline together), on both sides.
//!
//! Alive in the peak's phase: forward — weights, optimizer, activations, logits/loss (and the
//! gradient buffer with accumulation); backward — all five; optimizer step — weights,
//! optimizer, gradients. A peak below the components alive in its phase (the head's backward,
//! before most layers' gradients exist: −402 MiB of "temporaries" on SmolLM2-135M before) is
//! shown as gradients not yet alive at the peak, then activations, so no row is negative and
//! the rows add up to the step's peak exactly: the peak's error is the sum of the rows' errors.

use super::{format_bytes, DevicePlan, MeasureMethod, StepPhase};
use std::fmt::Write as _;

/// One component of a step's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Component {
    /// The compute copy of the weights.
    Weights,
    /// AdamW's moments and master weights.
    Optimizer,
    /// The gradient buffers.
    Gradients,
    /// What the embeddings and decoder layers keep for backward.
    Activations,
    /// What the head (final norm, `lm_head`, the chunked loss) keeps for backward.
    LogitsAndLoss,
    /// The rest of the step's peak (short-lived buffers).
    Temporaries,
    /// The process's resident bytes besides the heap.
    Baseline,
}

impl Component {
    /// Every component, in report order.
    pub const ALL: [Component; 7] = [
        Component::Weights,
        Component::Optimizer,
        Component::Gradients,
        Component::Activations,
        Component::LogitsAndLoss,
        Component::Temporaries,
        Component::Baseline,
    ];

    /// The row's name.
    pub fn name(self) -> &'static str {
        match self {
            Component::Weights => "weights",
            Component::Optimizer => "optimizer",
            Component::Gradients => "gradients",
            Component::Activations => "activations",
            Component::LogitsAndLoss => "logits/loss",
            Component::Temporaries => "temporaries",
            Component::Baseline => "baseline",
        }
    }
}

/// A step's full-size components (see the module docs for each definition).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct StepComponents {
    /// Compute copy of the weights.
    pub weights_bytes: u64,
    /// AdamW moments plus master weights.
    pub optimizer_bytes: u64,
    /// The gradient buffers (one per trainable parameter).
    pub gradients_bytes: u64,
    /// Kept by the embeddings and decoder layers.
    pub activations_bytes: u64,
    /// Kept by the head and the loss.
    pub logits_and_loss_bytes: u64,
    /// Gradient accumulation (the gradient buffer is alive in the forward too).
    pub accumulating: bool,
}

impl StepComponents {
    /// Bytes of the components alive in `phase` (the rule of the module docs).
    pub fn alive_in(&self, phase: StepPhase) -> u64 {
        let resident = self.weights_bytes + self.optimizer_bytes;
        let forward = self.activations_bytes + self.logits_and_loss_bytes;
        match phase {
            StepPhase::Generation => resident,
            StepPhase::Forward => {
                resident
                    + forward
                    + if self.accumulating {
                        self.gradients_bytes
                    } else {
                        0
                    }
            }
            StepPhase::Backward => resident + forward + self.gradients_bytes,
            StepPhase::OptimizerStep => resident + self.gradients_bytes,
        }
    }
}

/// One side of the report: the components, the step's peak and its phase, and the process
/// baseline when known.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct ComponentSet {
    /// The full-size components.
    pub step: StepComponents,
    /// The step's peak (training tensors, no process terms).
    pub peak_bytes: u64,
    /// The phase of that peak.
    pub peak_phase: StepPhase,
    /// Resident bytes besides the heap, when known.
    pub baseline_bytes: Option<u64>,
}

impl ComponentSet {
    /// The rest of the peak: peak − the components alive in the peak's phase, never negative
    /// (a peak below them shows as gradients not yet allocated, see [`Self::value`]).
    pub fn temporaries_bytes(&self) -> u64 {
        self.peak_bytes
            .saturating_sub(self.step.alive_in(self.peak_phase))
    }

    /// How far the components alive in the peak's phase exceed the peak: gradients counted
    /// whole in the backward that are not yet allocated at its peak (the head's backward,
    /// before most layers have theirs).
    fn deficit_bytes(&self) -> u64 {
        self.step
            .alive_in(self.peak_phase)
            .saturating_sub(self.peak_bytes)
    }

    /// Gradients, activations and logits/loss as alive at the step's peak: their full sizes,
    /// less the [`Self::deficit_bytes`] taken from the gradients first (then the activations,
    /// then the head's part) among those alive in the peak's phase. With it the rows of the
    /// phase add up to the peak and none is negative.
    fn alive_at_peak(&self) -> (u64, u64, u64) {
        let s = &self.step;
        let mut deficit = self.deficit_bytes();
        let mut take = |bytes: u64, alive: bool| {
            let taken = if alive { deficit.min(bytes) } else { 0 };
            deficit -= taken;
            bytes - taken
        };
        let sampling = self.peak_phase == StepPhase::Generation;
        let forward = self.peak_phase != StepPhase::OptimizerStep && !sampling;
        let gradients = take(
            s.gradients_bytes,
            !sampling && (self.peak_phase != StepPhase::Forward || s.accumulating),
        );
        let activations = take(s.activations_bytes, forward);
        let logits = take(s.logits_and_loss_bytes, forward);
        (gradients, activations, logits)
    }

    /// One component's bytes (`None`: not known on this side); never negative.
    pub fn value(&self, c: Component) -> Option<i64> {
        let s = &self.step;
        Some(match c {
            Component::Weights => s.weights_bytes as i64,
            Component::Optimizer => s.optimizer_bytes as i64,
            Component::Gradients => self.alive_at_peak().0 as i64,
            Component::Activations => self.alive_at_peak().1 as i64,
            Component::LogitsAndLoss => self.alive_at_peak().2 as i64,
            Component::Temporaries => self.temporaries_bytes() as i64,
            Component::Baseline => return self.baseline_bytes.map(|b| b as i64),
        })
    }
}

impl DevicePlan {
    /// The plan's side of the component report for this device.
    pub fn predicted_components(&self) -> ComponentSet {
        // A CUDA device's runtime overhead (context, workspaces) is its baseline, not a
        // tensor of the step.
        let baseline = match &self.process {
            Some(p) => Some(p.baseline_bytes() + self.overhead_bytes),
            None => (self.overhead_bytes > 0).then_some(self.overhead_bytes),
        };
        ComponentSet {
            step: self.components,
            peak_bytes: self
                .training_tensors_bytes
                .saturating_sub(self.overhead_bytes),
            peak_phase: self.peak_phase,
            baseline_bytes: baseline,
        }
    }
}

/// Component sizes counted from the tensors themselves, on any device and without the
/// counting allocator: what a trainer can report of its run (the trainer's
/// `TrainingRun::tensor_bytes`). Definitions as in the module docs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct TensorBytes {
    /// Σ bytes of the model's weights as allocated (parameters, adapters, a quantized base).
    pub weights_bytes: u64,
    /// Σ bytes of AdamW's state (moments, and master copies in mixed precision).
    pub optimizer_bytes: u64,
    /// Σ bytes of the gradient store when the last step's backward returned (`None` before a
    /// step, or after one without a trained token).
    pub gradients_bytes: Option<u64>,
}

/// What a dry run reads of a step it cannot look inside (`devices::dry_run_with_readings`):
/// the counted tensors and the meter (heap or resident set) around the step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct StepReadings {
    /// What the meter reads ([`crate::mem::Meter::method`]).
    pub method: MeasureMethod,
    /// The tensors of the checked device (`None`: they cannot be told apart from other
    /// devices' tensors, e.g. a run on several devices).
    pub tensors: Option<TensorBytes>,
    /// The meter just before the step (bytes in use: heap or `VmRSS`).
    pub in_use_before_step: Option<u64>,
    /// The meter's peak just before the step (the setup's: loading, tokenising).
    pub peak_before_step: Option<u64>,
    /// The meter's peak after the step.
    pub peak_after_step: Option<u64>,
}

/// `(predicted − measured) / |measured|` in percent, when both are known and measured ≠ 0.
fn error_pct(predicted: Option<i64>, measured: Option<i64>) -> Option<f64> {
    match (predicted, measured) {
        (Some(p), Some(m)) if m != 0 => Some(100.0 * (p - m) as f64 / (m as f64).abs()),
        _ => None,
    }
}

/// One row: a component predicted and measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct ComponentRow {
    /// The component.
    pub component: Component,
    /// Predicted bytes (`None`: not modelled for this request).
    pub predicted: Option<i64>,
    /// Measured bytes (`None`: not measured).
    pub measured: Option<i64>,
    /// How the measured figure was obtained, when not as the module docs define it (counted
    /// from the tensors, derived from other figures); `None`: as defined.
    pub how: Option<&'static str>,
}

impl ComponentRow {
    /// (predicted − measured) / |measured| in percent, when both are known and measured ≠ 0.
    pub fn error_pct(&self) -> Option<f64> {
        error_pct(self.predicted, self.measured)
    }

    /// predicted − measured, when both are known.
    pub fn error_bytes(&self) -> Option<i64> {
        Some(self.predicted? - self.measured?)
    }
}

/// Activations, logits/loss and temporaries as one figure: the step's peak minus weights,
/// optimizer state and gradients, on both sides (for a measurement that cannot tell the three
/// apart, see [`ComponentReport::from_readings`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct RestOfPeak {
    /// Predicted bytes.
    pub predicted: Option<i64>,
    /// Measured (derived) bytes.
    pub measured: Option<i64>,
}

/// Predicted against measured, component by component, with the step's peak.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ComponentReport {
    /// One row per [`Component`], in [`Component::ALL`] order.
    pub rows: Vec<ComponentRow>,
    /// Activations, logits/loss and temporaries measured together, when they were.
    pub rest_of_peak: Option<RestOfPeak>,
    /// The predicted step peak and its phase.
    pub predicted_peak: (u64, StepPhase),
    /// The measured step peak, when measured, and its phase when known.
    pub measured_peak: Option<(u64, Option<StepPhase>)>,
    /// How the measured peak was obtained, when not by the allocator's high-water mark.
    pub peak_how: Option<&'static str>,
    /// What the last row totals: the step's training tensors, or the whole process.
    pub total: Total,
    /// What to keep in mind reading the measured column, when something.
    pub note: Option<&'static str>,
}

/// The total of a [`ComponentReport`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Total {
    /// The step's peak of training tensors (the baseline apart).
    StepPeak,
    /// The process's peak (the verdict's figure): every row, the baseline included.
    ProcessPeak,
}

impl Total {
    /// The row's name.
    pub fn name(self) -> &'static str {
        match self {
            Total::StepPeak => "step peak",
            Total::ProcessPeak => "process peak",
        }
    }
}

/// How [`ComponentReport::from_readings`] obtained each figure.
const COUNTED_WEIGHTS: &str = "counted: Σ bytes of the model's weights";
const COUNTED_OPTIMIZER: &str = "counted: Σ bytes of AdamW's state";
const COUNTED_GRADIENTS: &str = "counted: Σ bytes of the gradients after backward";
const IN_REST: &str = "in the rest of the peak";
const DERIVED_REST: &str =
    "derived: process peak − weights − optimizer − gradients (the rows above it, and the baseline)";
const PROCESS_PEAK: &str = "the resident set's high-water mark (VmHWM), as in the verdict";
const RSS_NOTE: &str = "Measured with the resident set, which cannot split the rest of the peak: \
memory the setup freed (the\ntokenizer's, the data's) stays resident and the step reuses some of \
it, and AdamW's zeroed state is not resident\nuntil its first update. Weights, optimizer state and \
gradients are counted; the rest is exact as a whole.";

impl ComponentReport {
    /// Both sides known.
    pub fn new(predicted: &ComponentSet, measured: &ComponentSet) -> Self {
        Self::with_measured(predicted, Some(measured))
    }

    /// The prediction, with what was measured (`None`: nothing).
    pub fn with_measured(predicted: &ComponentSet, measured: Option<&ComponentSet>) -> Self {
        ComponentReport {
            rows: Component::ALL
                .iter()
                .map(|&c| ComponentRow {
                    component: c,
                    predicted: predicted.value(c),
                    measured: measured.and_then(|m| m.value(c)),
                    how: None,
                })
                .collect(),
            rest_of_peak: None,
            predicted_peak: (predicted.peak_bytes, predicted.peak_phase),
            measured_peak: measured.map(|m| (m.peak_bytes, Some(m.peak_phase))),
            peak_how: None,
            total: Total::StepPeak,
            note: None,
        }
    }

    /// The prediction next to a dry run's readings, as a table of the process's peak whose
    /// rows are real, non-negative quantities that add up on both sides: weights, optimizer
    /// state and gradients as counted (full size on both sides), and the rest of the process
    /// peak (activations, logits/loss, temporaries and the baseline together: the resident
    /// set cannot tell them apart, since memory the setup freed stays resident and AdamW's
    /// zeroed state is not resident until its first update). Their total is the process peak
    /// of the verdict and the summary line: `predicted_process_bytes` (the plan's peak) and
    /// `measured_process_bytes` (the meter's peak). The predicted split of the rest is shown
    /// beside it, its measured column marked as part of the rest.
    pub fn from_readings(
        predicted: &ComponentSet,
        readings: &StepReadings,
        predicted_process_bytes: u64,
        measured_process_bytes: Option<u64>,
    ) -> Self {
        let t = readings.tensors;
        let gradients = t.and_then(|t| t.gradients_bytes);
        let counted = t
            .zip(gradients)
            .map(|(t, g)| t.weights_bytes + t.optimizer_bytes + g);
        let s = &predicted.step;
        let predicted_rest = predicted_process_bytes as i64
            - (s.weights_bytes + s.optimizer_bytes + s.gradients_bytes) as i64;
        let measured_rest = measured_process_bytes
            .zip(counted)
            .map(|(m, c)| m as i64 - c as i64);
        let non_negative = |v: Option<i64>| v.filter(|&b| b >= 0);
        let measured = |c: Component| -> (Option<i64>, Option<&'static str>) {
            let counted = |v: Option<u64>, how| (v.map(|b| b as i64), v.map(|_| how));
            match c {
                Component::Weights => counted(t.map(|t| t.weights_bytes), COUNTED_WEIGHTS),
                Component::Optimizer => counted(t.map(|t| t.optimizer_bytes), COUNTED_OPTIMIZER),
                Component::Gradients => counted(gradients, COUNTED_GRADIENTS),
                _ => (None, measured_rest.map(|_| IN_REST)),
            }
        };
        let predicted_value = |c: Component| match c {
            // Full size, as counted: the total is the process's peak, not the step's phase.
            Component::Gradients => Some(s.gradients_bytes as i64),
            _ => predicted.value(c),
        };
        ComponentReport {
            rows: Component::ALL
                .iter()
                .map(|&c| {
                    let (value, how) = measured(c);
                    ComponentRow {
                        component: c,
                        predicted: predicted_value(c),
                        measured: value,
                        how,
                    }
                })
                .collect(),
            rest_of_peak: Some(RestOfPeak {
                predicted: non_negative(Some(predicted_rest)),
                measured: non_negative(measured_rest),
            }),
            predicted_peak: (predicted_process_bytes, predicted.peak_phase),
            measured_peak: measured_process_bytes.map(|p| (p, None)),
            peak_how: Some(PROCESS_PEAK),
            total: Total::ProcessPeak,
            note: (readings.method == MeasureMethod::ProcessRss && measured_rest.is_some())
                .then_some(RSS_NOTE),
        }
    }

    /// The row of one component.
    pub fn row(&self, c: Component) -> Option<&ComponentRow> {
        self.rows.iter().find(|r| r.component == c)
    }

    /// The table in text, one line per component (and the rest of the peak, when measured
    /// together) and one for the step's peak; a last column says how a figure was measured
    /// when it was not as the module docs define it.
    pub fn render(&self) -> String {
        let notes = self.peak_how.is_some() || self.rows.iter().any(|r| r.how.is_some());
        let mut out = String::new();
        line_header(&mut out, notes.then_some("measured how"));
        let mut line = |name: &str, p: Option<i64>, m: Option<i64>, how: Option<&str>| {
            let error = match (p, m) {
                (Some(p), Some(m)) => signed_cell(p - m),
                _ => "—".to_string(),
            };
            let pct = error_pct(p, m).map_or("—".to_string(), |e| format!("{e:+.1}"));
            let row = format!(
                "{name:<12} {:>11} {:>11} {error:>11} {pct:>8}  {}",
                bytes_cell(p),
                bytes_cell(m),
                how.unwrap_or("")
            );
            let _ = writeln!(out, "{}", row.trim_end());
        };
        for r in &self.rows {
            line(r.component.name(), r.predicted, r.measured, r.how);
        }
        if let Some(rest) = &self.rest_of_peak {
            line(
                "rest of peak",
                rest.predicted,
                rest.measured,
                Some(DERIVED_REST),
            );
        }
        let (pp, pphase) = self.predicted_peak;
        let phases = match self.measured_peak {
            Some((_, Some(m))) => format!("predicted at the {pphase}, measured at the {m}"),
            _ => format!("predicted at the {pphase}"),
        };
        let how = match self.peak_how {
            Some(h) => format!("{h} ({phases})"),
            None => format!("({phases})"),
        };
        line(
            self.total.name(),
            Some(pp as i64),
            self.measured_peak.map(|(m, _)| m as i64),
            Some(&how),
        );
        if let Some(note) = self.note {
            let _ = writeln!(out, "{note}");
        }
        out
    }
}

/// The table's header line (with the "how" column when some row has a note).
fn line_header(out: &mut String, how: Option<&str>) {
    let row = format!(
        "{:<12} {:>11} {:>11} {:>11} {:>8}  {}",
        "component",
        "predicted",
        "measured",
        "error",
        "error %",
        how.unwrap_or("")
    );
    let _ = writeln!(out, "{}", row.trim_end());
}

/// Bytes in a cell, signed when negative, `—` when unknown.
fn bytes_cell(v: Option<i64>) -> String {
    match v {
        Some(b) if b < 0 => format!("-{}", format_bytes(b.unsigned_abs())),
        Some(b) => format_bytes(b as u64),
        None => "—".to_string(),
    }
}

/// A difference in bytes, always signed.
fn signed_cell(b: i64) -> String {
    if b < 0 {
        format!("-{}", format_bytes(b.unsigned_abs()))
    } else {
        format!("+{}", format_bytes(b as u64))
    }
}

#[cfg(test)]
mod tests;
