//! Which implementation of the training ops a model runs: the CPU native kernels, or the
//! device-generic ops a GPU runs (which the test suite can force on the CPU).

use super::error::ModelError;
use std::fmt;
use std::str::FromStr;

/// The environment variable that chooses the ops path of every model a process loads.
pub const OPS_ENV: &str = "TUNESTUDIO_OPS";

/// The training-ops path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OpsMode {
    /// Native CPU kernels (fused ops, native layers) where a tensor is on the CPU, the
    /// device-generic ops on every other device. The default.
    #[default]
    Auto,
    /// The same as `Auto`, named for benchmarks that compare it with `Generic`.
    Native,
    /// The device-generic ops everywhere, the CPU included: what a GPU runs, measurable here.
    Generic,
}

impl OpsMode {
    /// The mode `TUNESTUDIO_OPS` asks for (`Auto` when unset or empty).
    pub fn from_env() -> Result<Self, ModelError> {
        match std::env::var(OPS_ENV) {
            Ok(v) if !v.trim().is_empty() => v.parse(),
            _ => Ok(OpsMode::Auto),
        }
    }
}

impl FromStr for OpsMode {
    type Err = ModelError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(OpsMode::Auto),
            "native" => Ok(OpsMode::Native),
            "generic" => Ok(OpsMode::Generic),
            other => Err(ModelError::Input(format!(
                "unknown ops mode `{other}` (from {OPS_ENV} or --ops): use auto, native or generic"
            ))),
        }
    }
}

impl fmt::Display for OpsMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            OpsMode::Auto => "auto",
            OpsMode::Native => "native",
            OpsMode::Generic => "generic",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::OpsMode;

    #[test]
    fn parses_the_three_modes_and_names_the_choices_on_a_typo() {
        assert_eq!("generic".parse::<OpsMode>().unwrap(), OpsMode::Generic);
        assert_eq!(" Native ".parse::<OpsMode>().unwrap(), OpsMode::Native);
        assert_eq!("auto".parse::<OpsMode>().unwrap(), OpsMode::Auto);
        let err = "gpu".parse::<OpsMode>().unwrap_err().to_string();
        assert!(err.contains("auto, native or generic"), "{err}");
    }
}
