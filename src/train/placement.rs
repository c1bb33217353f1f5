//! Where a run's model lives: the `[devices]` entries opened as logical devices, the
//! layer split the planner computes (the trainer makes exactly the split a plan
//! shows), and the data-parallel ranks.

use std::ops::Range;

use candle_core::Device;
use serde::{Deserialize, Serialize};

use crate::devices::LogicalDevice;
use crate::model::Home;
use crate::plan::Strategy;

use super::config::RunConfig;
use super::error::TrainError;

/// The decoder layers one device holds, as a run reports it (`metrics.jsonl`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceLayers {
    /// The `[devices]` entry ("cpu:1", "cuda:0").
    pub device: String,
    /// First decoder layer held.
    pub start_layer: usize,
    /// One past the last decoder layer held.
    pub end_layer: usize,
}

/// A run's devices with its strategy applied.
#[derive(Debug, Clone)]
pub struct RunPlacement {
    /// Single, layer split or data parallel (single whenever one device is listed).
    pub strategy: Strategy,
    /// The devices, in `[devices]` order (pipeline stages or ranks).
    pub devices: Vec<LogicalDevice>,
    /// Under a layer split: the decoder layers of each device, from [`crate::plan::layer_ranges`].
    pub layer_ranges: Vec<Range<usize>>,
}

impl RunPlacement {
    /// Opens the run's devices and, for a layer split, asks the planner for the ranges
    /// (the same request `tunestudio plan --config` makes, with the training split's trained
    /// tokens as it counts them, so the two cannot differ).
    pub fn open(
        config: &RunConfig,
        trained_tokens: Option<crate::plan::TrainedTokens>,
    ) -> Result<Self, TrainError> {
        let names = &config.devices.devices;
        let mut devices = Vec::with_capacity(names.len());
        for (index, name) in names.iter().enumerate() {
            devices.push(open_device(index, name, names.len())?);
        }
        if devices.is_empty() {
            devices.push(open_device(0, "cpu", 1)?);
        }
        let strategy = if devices.len() > 1 {
            config.devices.strategy
        } else {
            Strategy::Single
        };
        let layer_ranges = if strategy == Strategy::LayerSplit {
            let mut request =
                super::plan_adapter::local_plan_request(config).map_err(|e| placement_error(&e))?;
            request.trained_tokens = trained_tokens;
            crate::plan::layer_ranges(&request).map_err(|e| placement_error(&e))?
        } else {
            Vec::new()
        };
        Ok(RunPlacement {
            strategy,
            devices,
            layer_ranges,
        })
    }

    /// The device of the embeddings, rank 0 and the first pipeline stage.
    pub fn primary(&self) -> &Device {
        &self.devices[0].candle
    }

    /// Data-parallel ranks (1 unless the strategy is data parallel).
    pub fn ranks(&self) -> usize {
        self.strategy.ranks(self.devices.len())
    }

    /// The logical device of every decoder layer under a layer split (`None` otherwise).
    pub fn layer_devices(&self, num_layers: usize) -> Option<Vec<Home>> {
        if self.strategy != Strategy::LayerSplit {
            return None;
        }
        let last = self.layer_ranges.len().saturating_sub(1);
        Some(
            (0..num_layers)
                .map(|l| {
                    let d = self
                        .layer_ranges
                        .iter()
                        .position(|r| r.contains(&l))
                        .unwrap_or(last)
                        .min(self.devices.len() - 1);
                    Home {
                        index: d,
                        device: self.devices[d].candle.clone(),
                    }
                })
                .collect(),
        )
    }

    /// What each device holds, for the run's `started` event.
    pub fn describe(&self, num_layers: usize) -> Vec<DeviceLayers> {
        let entry = |d: &LogicalDevice, r: Range<usize>| DeviceLayers {
            device: d.label.clone(),
            start_layer: r.start,
            end_layer: r.end,
        };
        match self.strategy {
            Strategy::Single => vec![entry(&self.devices[0], 0..num_layers)],
            Strategy::DataParallel | Strategy::Sharded => self
                .devices
                .iter()
                .map(|d| entry(d, 0..num_layers))
                .collect(),
            Strategy::LayerSplit => self
                .devices
                .iter()
                .zip(&self.layer_ranges)
                .map(|(d, r)| entry(d, r.clone()))
                .collect(),
        }
    }
}

fn placement_error(e: &crate::plan::PlanError) -> TrainError {
    TrainError::Placement {
        message: e.to_string(),
    }
}

/// Opens one `[devices]` entry: `cpu` / `cpu:N` (logical CPU devices share the host),
/// `cuda:N` (each entry its own stream, so two entries of one GPU are two logical
/// devices), `metal:N`; an `=SIZE` suffix is the planner's and is ignored here.
fn open_device(index: usize, entry: &str, count: usize) -> Result<LogicalDevice, TrainError> {
    let name = entry.split('=').next().unwrap_or(entry).trim();
    let capacity_bytes = entry
        .split_once('=')
        .and_then(|(_, size)| crate::plan::parse_bytes(size.trim()).ok())
        .unwrap_or(0);
    let (kind, ordinal) = name.split_once(':').unwrap_or((name, "0"));
    let candle = match kind {
        "cpu" => Device::Cpu,
        // One device: the default stream, as before; several: one stream each.
        "cuda" if count > 1 => {
            let ordinal: usize = ordinal.parse().map_err(|_| TrainError::Device {
                device: entry.to_string(),
                message: format!("`{ordinal}` is not a device number"),
            })?;
            LogicalDevice::cuda(index, ordinal, capacity_bytes)
                .map_err(|e| TrainError::Device {
                    device: entry.to_string(),
                    message: e.to_string(),
                })?
                .candle
        }
        _ => crate::devices::parse_device(name).map_err(|e| TrainError::Device {
            device: e.device,
            message: e.message,
        })?,
    };
    Ok(LogicalDevice {
        index,
        candle,
        label: name.to_string(),
        capacity_bytes,
    })
}
