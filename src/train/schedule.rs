//! Learning-rate schedules with linear warm-up, as transformers' `get_*_schedule_with_warmup`
//! computes them (so curves are comparable with runs made there).

use serde::{Deserialize, Serialize};

/// The shape of the learning rate after warm-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum ScheduleKind {
    /// Stays at the peak.
    #[serde(rename = "constant")]
    Constant,
    /// Falls linearly to 0 at the last step.
    #[serde(rename = "linear")]
    Linear,
    /// Half a cosine from the peak to 0 at the last step.
    #[default]
    #[serde(rename = "cosine")]
    Cosine,
}

/// A concrete schedule: peak, warm-up and total steps.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LrSchedule {
    /// The shape.
    pub kind: ScheduleKind,
    /// Peak learning rate.
    pub peak_lr: f64,
    /// Warm-up steps.
    pub warmup_steps: u64,
    /// Total optimizer steps of the run.
    pub total_steps: u64,
}

impl LrSchedule {
    /// The schedule for a run of `total_steps`; `warmup_ratio` is used when `warmup_steps` is 0.
    pub fn new(
        kind: ScheduleKind,
        peak_lr: f64,
        warmup_steps: u64,
        warmup_ratio: f64,
        total_steps: u64,
    ) -> Self {
        let warmup_steps = if warmup_steps > 0 {
            warmup_steps
        } else {
            (warmup_ratio * total_steps as f64).ceil() as u64
        };
        LrSchedule {
            kind,
            peak_lr,
            warmup_steps,
            total_steps,
        }
    }

    /// The learning rate of the optimizer step with 0-based index `step`
    /// (transformers' `lr_lambda(current_step)` × peak).
    pub fn lr_at(&self, step: u64) -> f64 {
        let s = step as f64;
        if step < self.warmup_steps {
            return self.peak_lr * s / (self.warmup_steps.max(1) as f64);
        }
        let decay_steps = self.total_steps.saturating_sub(self.warmup_steps).max(1) as f64;
        let progress = ((s - self.warmup_steps as f64) / decay_steps).clamp(0.0, 1.0);
        let factor = match self.kind {
            ScheduleKind::Constant => 1.0,
            ScheduleKind::Linear => 1.0 - progress,
            ScheduleKind::Cosine => 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()),
        };
        self.peak_lr * factor.max(0.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_linear_decay() {
        let s = LrSchedule::new(ScheduleKind::Linear, 1.0, 2, 0.0, 10);
        assert_eq!(s.lr_at(0), 0.0);
        assert_eq!(s.lr_at(1), 0.5);
        assert_eq!(s.lr_at(2), 1.0);
        assert!((s.lr_at(6) - 0.5).abs() < 1e-12);
        assert_eq!(s.lr_at(10), 0.0);
    }

    #[test]
    fn cosine_and_ratio() {
        let s = LrSchedule::new(ScheduleKind::Cosine, 2.0, 0, 0.1, 100);
        assert_eq!(s.warmup_steps, 10);
        assert!((s.lr_at(10) - 2.0).abs() < 1e-12);
        assert!((s.lr_at(55) - 1.0).abs() < 1e-12);
        let c = LrSchedule::new(ScheduleKind::Constant, 3.0, 0, 0.0, 5);
        assert_eq!(c.lr_at(0), 3.0);
        assert_eq!(c.lr_at(4), 3.0);
    }
}
