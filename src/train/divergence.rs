//! The divergence watch: a loss that jumps well above its recent level after the warm-up is
//! the first sign that the learning rate is too high for the model (the reported case went
//! 2.05 → 10.7 in 9 steps). The watch says so as it happens (an event in the CLI,
//! `metrics.jsonl` and a marker on the studio's loss chart); with
//! `[training] on_divergence = "stop"` it ends the run, keeping the checkpoints written
//! before the spike, and suggests a tenth of the rate.

use serde::{Deserialize, Serialize};

/// What a divergence does to the run (`[training] on_divergence`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum OnDivergence {
    /// Warn and keep training.
    #[default]
    Warn,
    /// Warn and stop; the last checkpoint before the spike is the one to resume from.
    Stop,
}

/// Test switch: `STEP:FACTOR` multiplies step STEP's learning rate by FACTOR (a schedule gone
/// wrong, a rate typed with the wrong exponent), so the loss really spikes at the next step
/// and the watch is tested end to end through the CLI.
pub const INJECT_LR_SPIKE_ENV: &str = "TUNESTUDIO_INJECT_LR_SPIKE";

/// The learning-rate factor [`INJECT_LR_SPIKE_ENV`] asks for at `step` (1 otherwise).
pub(crate) fn injected_lr_factor(step: u64) -> f64 {
    let Ok(spec) = std::env::var(INJECT_LR_SPIKE_ENV) else {
        return 1.0;
    };
    let Some((at, factor)) = spec.split_once(':') else {
        return 1.0;
    };
    match (at.trim().parse::<u64>(), factor.trim().parse::<f64>()) {
        (Ok(at), Ok(factor)) if at == step && factor.is_finite() => factor,
        _ => 1.0,
    }
}

/// A loss this many times the recent median is a spike.
const SPIKE_FACTOR: f64 = 2.0;
/// Steps of recent losses the median is taken over.
const WINDOW_STEPS: usize = 20;
/// Losses needed before the median means anything.
const MIN_HISTORY_STEPS: usize = 5;

/// A spike the watch saw.
#[derive(Debug, Clone, PartialEq)]
pub struct Divergence {
    /// The step whose loss spiked.
    pub step: u64,
    /// Its loss (NaN or infinite included).
    pub loss: f64,
    /// The median of the recent losses it is compared with.
    pub median_loss: f64,
    /// A tenth of the learning rate at that step.
    pub suggested_learning_rate: f64,
}

/// Recent losses and the step the warm-up ends at.
#[derive(Debug, Clone)]
pub struct DivergenceWatch {
    warmup_steps: u64,
    recent: Vec<f64>,
}

impl DivergenceWatch {
    /// A watch that judges steps after `warmup_steps`.
    pub fn new(warmup_steps: u64) -> Self {
        DivergenceWatch {
            warmup_steps,
            recent: Vec::with_capacity(WINDOW_STEPS),
        }
    }

    /// Looks at step `step`'s loss (trained at learning rate `lr`): a non-finite loss, or one
    /// above [`SPIKE_FACTOR`] × the recent median after the warm-up, is a divergence. A
    /// spike is not added to the history, so a run that stays up keeps being reported.
    pub fn observe(&mut self, step: u64, loss: f64, lr: f64) -> Option<Divergence> {
        let median = self.median();
        let spike = !loss.is_finite()
            || (step > self.warmup_steps
                && self.recent.len() >= MIN_HISTORY_STEPS
                && loss > SPIKE_FACTOR * median);
        if spike {
            return Some(Divergence {
                step,
                loss,
                median_loss: median,
                suggested_learning_rate: lr / 10.0,
            });
        }
        if self.recent.len() == WINDOW_STEPS {
            self.recent.remove(0);
        }
        self.recent.push(loss);
        None
    }

    fn median(&self) -> f64 {
        if self.recent.is_empty() {
            return f64::NAN;
        }
        let mut sorted = self.recent.clone();
        sorted.sort_by(f64::total_cmp);
        sorted[sorted.len() / 2]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spike_after_the_warm_up_is_reported_with_a_tenth_of_the_rate() {
        let mut w = DivergenceWatch::new(3);
        // During the warm-up a high loss is expected.
        for (step, loss) in [(1, 10.0), (2, 9.0), (3, 30.0)] {
            assert_eq!(w.observe(step, loss, 1e-3), None);
        }
        for step in 4..=8 {
            assert_eq!(w.observe(step, 2.0, 1e-3), None);
        }
        let d = w.observe(9, 10.7, 1e-3).expect("a spike");
        assert_eq!(d.step, 9);
        assert!((d.suggested_learning_rate - 1e-4).abs() < 1e-12);
        assert!(d.median_loss < 10.0);
        // A run that stays up is reported again; a gentle rise is not.
        assert!(w.observe(10, 11.0, 1e-3).is_some());
        assert_eq!(w.observe(11, 2.5, 1e-3), None);
        assert!(w.observe(12, f64::NAN, 1e-3).is_some());
    }
}
