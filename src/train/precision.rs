//! The dynamic loss scaler used by fp16 mixed precision. The precision modes themselves are
//! [`crate::settings::Precision`] (shared with the planner), re-exported here.

use serde::{Deserialize, Serialize};

pub use crate::settings::{Precision, UnknownPrecision};

/// Dynamic loss scaling (as torch.amp.GradScaler): the loss is multiplied by `scale` before
/// the backward pass so small f16 gradients do not flush to zero; a step whose gradients
/// overflow is skipped and the scale halved; after `growth_interval` clean steps it doubles.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LossScaler {
    /// Current scale.
    pub scale: f64,
    /// Clean steps needed before growing.
    pub growth_interval: u64,
    /// Clean steps since the last overflow or growth.
    pub clean_steps: u64,
    /// Steps skipped so far.
    pub skipped_steps: u64,
}

/// The scale never goes below this (below 1 it would only lose precision).
const MIN_SCALE: f64 = 1.0;
/// Nor above this (f32 range safety for the gradient sums).
const MAX_SCALE: f64 = 2f64 * 1_099_511_627_776.0 * 1_099_511_627_776.0; // 2^81

impl LossScaler {
    /// A scaler starting at `initial_scale`.
    pub fn new(initial_scale: f64, growth_interval: u64) -> Self {
        LossScaler {
            scale: initial_scale,
            growth_interval: growth_interval.max(1),
            clean_steps: 0,
            skipped_steps: 0,
        }
    }

    /// Records the outcome of a step: `finite` = the gradients had no inf/NaN.
    /// Returns true when the step must be applied, false when it must be skipped.
    pub fn update(&mut self, finite: bool) -> bool {
        if finite {
            self.clean_steps += 1;
            if self.clean_steps >= self.growth_interval {
                self.scale = (self.scale * 2.0).min(MAX_SCALE);
                self.clean_steps = 0;
            }
            true
        } else {
            self.scale = (self.scale * 0.5).max(MIN_SCALE);
            self.clean_steps = 0;
            self.skipped_steps += 1;
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scaler_halves_on_overflow_and_grows_after_interval() {
        let mut s = LossScaler::new(1024.0, 3);
        assert!(!s.update(false));
        assert_eq!(s.scale, 512.0);
        assert!(s.update(true));
        assert!(s.update(true));
        assert_eq!(s.scale, 512.0);
        assert!(s.update(true));
        assert_eq!(s.scale, 1024.0);
        assert_eq!(s.skipped_steps, 1);
    }

    /// A run that overflows at every step bottoms out at scale 1 (it keeps skipping, the scale
    /// never reaches 0 and the loss never vanishes); a long clean run tops out at 2^81.
    #[test]
    fn scaler_stays_between_one_and_its_ceiling() {
        let mut s = LossScaler::new(4.0, 1);
        for _ in 0..5 {
            assert!(!s.update(false));
        }
        assert_eq!((s.scale, s.skipped_steps, s.clean_steps), (1.0, 5, 0));
        let mut s = LossScaler::new(MAX_SCALE / 2.0, 1);
        assert!(s.update(true) && s.update(true));
        assert_eq!(s.scale, 2f64.powi(81));
    }
}
