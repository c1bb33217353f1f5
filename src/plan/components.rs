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
//! | temporaries | the rest of the step's peak: peak − the components above that are alive in the peak's phase (signed) | the same rule on the measured peak and components |
//! | baseline | the process terms besides the heap (binary, tokenizer, dataset, allocator retention, GUI) when the request has [`super::ProcessInputs`] | resident set − heap (`VmRSS` − counted heap), where both are readable |
//!
//! Alive in the peak's phase: forward — weights, optimizer, activations, logits/loss (and the
//! gradient buffer with accumulation); backward — all five (gradients counted whole: most
//! exist by the backward's peak, and the rest shows as a negative temporary); optimizer step
//! — weights, optimizer, gradients. With one rule on both sides the rows add up to the step's
//! peak exactly, so the peak's error is the sum of the rows' errors.

use super::{format_bytes, DevicePlan, StepPhase};
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
    /// The rest of the peak: peak − the components alive in the peak's phase (signed).
    pub fn temporaries_bytes(&self) -> i64 {
        self.peak_bytes as i64 - self.step.alive_in(self.peak_phase) as i64
    }

    /// One component's bytes (`None`: not known on this side).
    pub fn value(&self, c: Component) -> Option<i64> {
        let s = &self.step;
        Some(match c {
            Component::Weights => s.weights_bytes as i64,
            Component::Optimizer => s.optimizer_bytes as i64,
            Component::Gradients => s.gradients_bytes as i64,
            Component::Activations => s.activations_bytes as i64,
            Component::LogitsAndLoss => s.logits_and_loss_bytes as i64,
            Component::Temporaries => self.temporaries_bytes(),
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

/// One row: a component predicted and measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct ComponentRow {
    /// The component.
    pub component: Component,
    /// Predicted bytes (`None`: not modelled for this request).
    pub predicted: Option<i64>,
    /// Measured bytes (`None`: not measured).
    pub measured: Option<i64>,
}

impl ComponentRow {
    /// (predicted − measured) / |measured| in percent, when both are known and measured ≠ 0.
    pub fn error_pct(&self) -> Option<f64> {
        match (self.predicted, self.measured) {
            (Some(p), Some(m)) if m != 0 => Some(100.0 * (p - m) as f64 / (m as f64).abs()),
            _ => None,
        }
    }

    /// predicted − measured, when both are known.
    pub fn error_bytes(&self) -> Option<i64> {
        Some(self.predicted? - self.measured?)
    }
}

/// Predicted against measured, component by component, with the step's peak.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ComponentReport {
    /// One row per [`Component`], in [`Component::ALL`] order.
    pub rows: Vec<ComponentRow>,
    /// The predicted step peak and its phase.
    pub predicted_peak: (u64, StepPhase),
    /// The measured step peak and its phase, when measured.
    pub measured_peak: Option<(u64, StepPhase)>,
}

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
                })
                .collect(),
            predicted_peak: (predicted.peak_bytes, predicted.peak_phase),
            measured_peak: measured.map(|m| (m.peak_bytes, m.peak_phase)),
        }
    }

    /// The row of one component.
    pub fn row(&self, c: Component) -> Option<&ComponentRow> {
        self.rows.iter().find(|r| r.component == c)
    }

    /// The table in text, one line per component and one for the step's peak.
    pub fn render(&self) -> String {
        let mut out = format!(
            "{:<12} {:>11} {:>11} {:>11} {:>8}\n",
            "component", "predicted", "measured", "error", "error %"
        );
        let cell = |v: Option<i64>| match v {
            Some(b) if b < 0 => format!("-{}", format_bytes(b.unsigned_abs())),
            Some(b) => format_bytes(b as u64),
            None => "—".to_string(),
        };
        let signed = |v: Option<i64>| match v {
            Some(b) if b < 0 => format!("-{}", format_bytes(b.unsigned_abs())),
            Some(b) => format!("+{}", format_bytes(b as u64)),
            None => "—".to_string(),
        };
        let pct = |v: Option<f64>| v.map_or("—".to_string(), |e| format!("{e:+.1}"));
        for r in &self.rows {
            let _ = writeln!(
                out,
                "{:<12} {:>11} {:>11} {:>11} {:>8}",
                r.component.name(),
                cell(r.predicted),
                cell(r.measured),
                signed(r.error_bytes()),
                pct(r.error_pct())
            );
        }
        let (pp, pphase) = self.predicted_peak;
        let peak = ComponentRow {
            component: Component::Temporaries,
            predicted: Some(pp as i64),
            measured: self.measured_peak.map(|(m, _)| m as i64),
        };
        let phases = match self.measured_peak {
            Some((_, m)) => format!("predicted at the {pphase}, measured at the {m}"),
            None => format!("predicted at the {pphase}"),
        };
        let _ = writeln!(
            out,
            "{:<12} {:>11} {:>11} {:>11} {:>8}  ({phases})",
            "step peak",
            cell(peak.predicted),
            cell(peak.measured),
            signed(peak.error_bytes()),
            pct(peak.error_pct())
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(peak: u64, phase: StepPhase) -> ComponentSet {
        ComponentSet {
            step: StepComponents {
                weights_bytes: 100,
                optimizer_bytes: 200,
                gradients_bytes: 100,
                activations_bytes: 50,
                logits_and_loss_bytes: 10,
                accumulating: false,
            },
            peak_bytes: peak,
            peak_phase: phase,
            baseline_bytes: None,
        }
    }

    #[test]
    fn rows_add_up_to_the_peak_in_every_phase() {
        for phase in [
            StepPhase::Forward,
            StepPhase::Backward,
            StepPhase::OptimizerStep,
        ] {
            let s = set(500, phase);
            let sum: i64 = Component::ALL
                .iter()
                .filter(|&&c| c != Component::Baseline)
                .filter(|&&c| match phase {
                    StepPhase::Forward => c != Component::Gradients,
                    StepPhase::Backward => true,
                    StepPhase::OptimizerStep => {
                        !matches!(c, Component::Activations | Component::LogitsAndLoss)
                    }
                })
                .map(|&c| s.value(c).unwrap_or(0))
                .sum();
            assert_eq!(sum, 500, "{phase}");
        }
        // The backward counts every gradient: the rest may be negative.
        assert_eq!(set(400, StepPhase::Backward).temporaries_bytes(), -60);
    }

    #[test]
    fn report_has_a_row_per_component_and_errors() {
        let mut m = set(520, StepPhase::Backward);
        m.step.activations_bytes = 40;
        let r = ComponentReport::new(&set(500, StepPhase::Backward), &m);
        assert_eq!(r.rows.len(), Component::ALL.len());
        let a = r.row(Component::Activations).unwrap();
        assert_eq!(a.error_pct(), Some(25.0));
        assert_eq!(r.row(Component::Baseline).unwrap().error_pct(), None);
        let text = r.render();
        for c in Component::ALL {
            assert!(text.contains(c.name()), "{text}");
        }
        assert!(text.contains("step peak"), "{text}");
    }
}
