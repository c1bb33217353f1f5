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
    /// Data parallel with the training state divided over the ranks (DeepSpeed ZeRO, FSDP):
    /// what each rank keeps whole and what it keeps a shard of is [`ShardMode`].
    #[serde(rename = "sharded")]
    Sharded,
}

impl Strategy {
    /// The run-config spellings, in the order the UI lists them.
    pub const NAMES: &'static [&'static str] =
        &["single", "layer-split", "data-parallel", "sharded"];

    /// Every strategy, in the order of [`Strategy::NAMES`].
    pub const ALL: [Strategy; 4] = [
        Strategy::Single,
        Strategy::LayerSplit,
        Strategy::DataParallel,
        Strategy::Sharded,
    ];

    /// Replicas that each take a micro-batch over `devices` devices: every device under data
    /// parallel (sharded or not), one otherwise. The one place this rule is written (the trainer's placement,
    /// the planner, the run config's effective batch).
    pub fn ranks(self, devices: usize) -> usize {
        match self {
            Strategy::DataParallel | Strategy::Sharded => devices.max(1),
            Strategy::Single | Strategy::LayerSplit => 1,
        }
    }

    /// The run-config spelling.
    pub fn as_str(&self) -> &'static str {
        match self {
            Strategy::Single => "single",
            Strategy::LayerSplit => "layer-split",
            Strategy::DataParallel => "data-parallel",
            Strategy::Sharded => "sharded",
        }
    }
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a [`Strategy::Sharded`] run divides over its ranks (`[devices] shard`).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize,
)]
pub enum ShardMode {
    /// ZeRO-2: each rank keeps a shard of every trainable tensor's gradient and AdamW state
    /// (and fp32 master weights); the weights stay whole on every rank.
    #[default]
    #[serde(rename = "gradients-and-optimizer")]
    GradientsAndOptimizer,
    /// ZeRO-3 / FSDP full shard: the weights too, gathered a layer at a time.
    #[serde(rename = "everything")]
    Everything,
}

impl ShardMode {
    /// The run-config spellings, in the order the UI lists them.
    pub const NAMES: &'static [&'static str] = &["gradients-and-optimizer", "everything"];

    /// Every shard mode, in the order of [`ShardMode::NAMES`].
    pub const ALL: [ShardMode; 2] = [ShardMode::GradientsAndOptimizer, ShardMode::Everything];

    /// The run-config spelling.
    pub fn as_str(&self) -> &'static str {
        match self {
            ShardMode::GradientsAndOptimizer => "gradients-and-optimizer",
            ShardMode::Everything => "everything",
        }
    }

    /// DeepSpeed's name for it, for users who know that one.
    pub fn zero_stage(&self) -> &'static str {
        match self {
            ShardMode::GradientsAndOptimizer => "ZeRO-2",
            ShardMode::Everything => "ZeRO-3",
        }
    }
}

impl fmt::Display for ShardMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A shard mode that is none of [`ShardMode::NAMES`] (nor an accepted alias).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown shard mode `{0}`: use gradients-and-optimizer (ZeRO-2) or everything (ZeRO-3)")]
pub struct UnknownShardMode(pub String);

impl FromStr for ShardMode {
    type Err = UnknownShardMode;

    /// Parses the config spelling and DeepSpeed's and FSDP's names (`zero2`, `zero-3`,
    /// `shard-grad-op`, `full-shard`), underscores for dashes, any case.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().replace('_', "-").as_str() {
            "gradients-and-optimizer" | "zero2" | "zero-2" | "shard-grad-op" => {
                Ok(ShardMode::GradientsAndOptimizer)
            }
            "everything" | "zero3" | "zero-3" | "full-shard" => Ok(ShardMode::Everything),
            _ => Err(UnknownShardMode(s.to_string())),
        }
    }
}

/// A strategy name that is none of [`Strategy::NAMES`] (nor an accepted alias).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown strategy `{0}`: use single, layer-split, data-parallel or sharded")]
pub struct UnknownStrategy(pub String);

impl FromStr for Strategy {
    type Err = UnknownStrategy;

    /// Parses the config spelling and the aliases a command line may use (`split`,
    /// `pipeline`, `dp`, `ddp`, `zero`, `fsdp`, underscores for dashes, any case).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().replace('_', "-").as_str() {
            "single" => Ok(Strategy::Single),
            "layer-split" | "split" | "pipeline" => Ok(Strategy::LayerSplit),
            "data-parallel" | "dp" | "ddp" => Ok(Strategy::DataParallel),
            "sharded" | "zero" | "fsdp" => Ok(Strategy::Sharded),
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
        assert_eq!("ZeRO".parse::<Strategy>().unwrap(), Strategy::Sharded);
        for (name, m) in ShardMode::NAMES.iter().zip(ShardMode::ALL) {
            let parsed: ShardMode = serde_json::from_str(&format!("\"{name}\"")).unwrap();
            assert_eq!(parsed, m);
            assert_eq!(name.parse::<ShardMode>().unwrap(), m);
            assert_eq!(m.as_str(), *name);
        }
        assert_eq!(
            "ZeRO_3".parse::<ShardMode>().unwrap(),
            ShardMode::Everything
        );
        let err = "zero1".parse::<ShardMode>().unwrap_err().to_string();
        assert!(err.contains("zero1") && err.contains("everything"), "{err}");
        let err = "ring".parse::<Strategy>().unwrap_err().to_string();
        assert!(err.contains("ring") && err.contains("layer-split"), "{err}");
    }
}
