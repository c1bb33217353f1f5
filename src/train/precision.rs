//! Precision modes and the dynamic loss scaler used by fp16 mixed precision.

use candle_core::DType;
use serde::{Deserialize, Serialize};

/// How weights, activations and optimizer states are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub enum Precision {
    /// Everything in f32.
    #[default]
    #[serde(rename = "fp32")]
    Fp32,
    /// bf16 compute copy of the weights; f32 master weights and optimizer states.
    #[serde(rename = "bf16-mixed")]
    Bf16Mixed,
    /// bf16 weights only (no f32 copy); the update is computed in f32 and cast back.
    #[serde(rename = "bf16")]
    Bf16,
    /// f16 compute copy, f32 master weights, dynamic loss scaling against overflow.
    #[serde(rename = "fp16-mixed")]
    Fp16Mixed,
}

impl Precision {
    /// The accepted spellings, for messages.
    pub const NAMES: &'static [&'static str] = &["fp32", "bf16-mixed", "bf16", "fp16-mixed"];

    /// Every mode, in the order the UI lists them.
    pub const ALL: [Precision; 4] = [
        Precision::Fp32,
        Precision::Bf16Mixed,
        Precision::Bf16,
        Precision::Fp16Mixed,
    ];

    /// Bytes of one element of the compute weights, activations and gradients.
    pub fn compute_bytes(self) -> u64 {
        match self {
            Precision::Fp32 => 4,
            _ => 2,
        }
    }

    /// The dtype the model computes in.
    pub fn compute_dtype(self) -> DType {
        match self {
            Precision::Fp32 => DType::F32,
            Precision::Bf16Mixed | Precision::Bf16 => DType::BF16,
            Precision::Fp16Mixed => DType::F16,
        }
    }

    /// Whether the optimizer keeps f32 master weights.
    pub fn master_weights(self) -> bool {
        matches!(self, Precision::Bf16Mixed | Precision::Fp16Mixed)
    }

    /// Whether losses are scaled (fp16 gradients underflow otherwise).
    pub fn uses_loss_scaling(self) -> bool {
        matches!(self, Precision::Fp16Mixed)
    }

    /// The name as written in the config.
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16Mixed => "bf16-mixed",
            Precision::Bf16 => "bf16",
            Precision::Fp16Mixed => "fp16-mixed",
        }
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

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

    #[test]
    fn precision_names_round_trip() {
        for name in Precision::NAMES {
            let p: Precision = serde_json::from_str(&format!("\"{name}\"")).unwrap();
            assert_eq!(p.name(), *name);
        }
    }
}

/// A precision name that is none of [`Precision::NAMES`].
#[derive(Debug, Clone, thiserror::Error)]
#[error("unknown precision `{0}`: use fp32, bf16-mixed, bf16 or fp16-mixed")]
pub struct UnknownPrecision(pub String);

impl std::str::FromStr for Precision {
    type Err = UnknownPrecision;

    /// Parses the config spelling, and the common aliases a command line may use
    /// (`f32`, `bfloat16`, `fp16`, underscores for dashes).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().replace('_', "-").as_str() {
            "fp32" | "f32" | "float32" => Ok(Precision::Fp32),
            "bf16-mixed" | "mixed-bf16" => Ok(Precision::Bf16Mixed),
            "bf16" | "bfloat16" => Ok(Precision::Bf16),
            "fp16-mixed" | "f16-mixed" | "mixed-fp16" | "fp16" | "f16" => Ok(Precision::Fp16Mixed),
            _ => Err(UnknownPrecision(s.to_string())),
        }
    }
}
