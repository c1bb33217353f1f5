//! How a run spreads its model over the devices (`[devices] strategy`).

use std::fmt;
use std::str::FromStr;

/// How the model is spread over the devices (`[devices] strategy`).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize,
)]
pub enum Strategy {
    /// Everything on the first device.
    #[default]
    #[serde(rename = "single")]
    Single,
    /// Consecutive layers on each device (pipeline without overlap).
    #[serde(rename = "layer-split")]
    LayerSplit,
    /// A full replica per device, each on its own micro-batch, gradients all-reduced.
    #[serde(rename = "data-parallel")]
    DataParallel,
}

impl Strategy {
    /// The run-config spellings, in the order the UI lists them.
    pub const NAMES: &'static [&'static str] = &["single", "layer-split", "data-parallel"];

    /// Every strategy, in the order of [`Strategy::NAMES`].
    pub const ALL: [Strategy; 3] = [
        Strategy::Single,
        Strategy::LayerSplit,
        Strategy::DataParallel,
    ];

    /// Replicas that each take a micro-batch over `devices` devices: every device under data
    /// parallel, one otherwise. The one place this rule is written (the trainer's placement,
    /// the planner, the run config's effective batch).
    pub fn ranks(self, devices: usize) -> usize {
        match self {
            Strategy::DataParallel => devices.max(1),
            Strategy::Single | Strategy::LayerSplit => 1,
        }
    }

    /// The run-config spelling.
    pub fn as_str(&self) -> &'static str {
        match self {
            Strategy::Single => "single",
            Strategy::LayerSplit => "layer-split",
            Strategy::DataParallel => "data-parallel",
        }
    }
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A strategy name that is none of [`Strategy::NAMES`] (nor an accepted alias).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown strategy `{0}`: use single, layer-split or data-parallel")]
pub struct UnknownStrategy(pub String);

impl FromStr for Strategy {
    type Err = UnknownStrategy;

    /// Parses the config spelling and the aliases a command line may use (`split`,
    /// `pipeline`, `dp`, `ddp`, underscores for dashes, any case).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().replace('_', "-").as_str() {
            "single" => Ok(Strategy::Single),
            "layer-split" | "split" | "pipeline" => Ok(Strategy::LayerSplit),
            "data-parallel" | "dp" | "ddp" => Ok(Strategy::DataParallel),
            _ => Err(UnknownStrategy(s.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_through_serde_and_from_str() {
        for (name, s) in Strategy::NAMES.iter().zip(Strategy::ALL) {
            let parsed: Strategy = serde_json::from_str(&format!("\"{name}\"")).unwrap();
            assert_eq!(parsed, s);
            assert_eq!(name.parse::<Strategy>().unwrap(), s);
            assert_eq!(s.as_str(), *name);
        }
        assert_eq!("DDP".parse::<Strategy>().unwrap(), Strategy::DataParallel);
        let err = "ring".parse::<Strategy>().unwrap_err().to_string();
        assert!(err.contains("ring") && err.contains("layer-split"), "{err}");
    }
}
