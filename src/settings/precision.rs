//! Numeric precision of training (`[training] precision`).

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn precision_names_round_trip() {
        for name in Precision::NAMES {
            let p: Precision = serde_json::from_str(&format!("\"{name}\"")).unwrap();
            assert_eq!(p.name(), *name);
        }
    }
}
