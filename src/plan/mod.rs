//! The memory planner: predicts every device's memory for a training run before
//! it starts, says where and by how much it runs out, ranks the fixes, and fits
//! the run to the devices.
//!
//! The planner holds no tensors and does no I/O in its own sources, but a CPU
//! plan reads the hardware through the kernels it models: gemm's cache geometry
//! ([`GemmGeometry::host`]) and packing rules (`model::ops::gemm_pack`), and for
//! bf16 the kernel `model::ops::kernel_path` chooses once per process (reading
//! the CPU's name and `~/.cache/tunestudio/kernel-paths.json`, and timing the
//! kernels on a cache miss). It models tunestudio's *own* training step on candle, not a
//! generic formula: which precision copies exist, that accumulated gradients
//! stay alive across micro-batches, that candle's autograd keeps every forward
//! tensor of the graph alive until the loss is dropped, that its backward
//! allocates a zero tensor per gradient edge and adds into it, that the loss is
//! computed in vocabulary chunks, and so on. See [`step_model`] for every term
//! and why it exists; the coefficients were measured with the counting
//! allocator of [`crate::mem`] (`tests/plan_accuracy.rs`).
//!
//! Data flow: [`PlanRequest`] → [`plan`] → [`Plan`] (per device: a breakdown by
//! kind of memory, the peak and its phase, the verdict) → [`auto_fit`] when it
//! does not fit. A [`DryRunReport`] checks the prediction against one real step
//! (`devices::dry_run` runs and measures it: the planner itself does no I/O).

mod change;
mod components;
mod device;
mod dry_run;
mod estimate;
mod fit;
mod generation;
mod gpu_catalog;
mod outcome;
pub mod placement;
mod process;
mod reference;
mod request;
pub mod step_model;

pub use change::{Change, Fix};
pub use components::{
    Component, ComponentReport, ComponentRow, ComponentSet, RestOfPeak, StepComponents,
    StepReadings, TensorBytes, Total,
};
pub use device::{
    format_bytes, parse_bytes, parse_devices, parse_devices_with, DeviceKind, DeviceSpec,
    GemmGeometry, MachineMemory,
};
pub use dry_run::{DryRunOutcome, DryRunReport, MeasureMethod, StepMeasured, StepMeasurement};
pub use estimate::{balance_layers, layer_costs, layer_ranges, plan, shard_elems, LayerCosts};
pub use fit::{auto_fit, relative_throughput, AutoFit};
pub use gpu_catalog::{find_gpu_model, gpu_model_by_size_text, GpuModel, GPU_CATALOG};
pub use outcome::{DevicePlan, LayerMemory, PeakMoment, PhaseBytes, Plan, StepPhase, Verdict};
pub use process::{ProcessFootprint, ProcessInputs, ProcessTerm};
pub use reference::ReferencePlan;
pub use request::{HeadLoss, LoraSpec, PlanRequest, TrainedTokens, WorldPlace};

use crate::model::{ModelConfig, OpsMode};
use std::fmt;
use std::ops::Range;

/// Everything that can stop a plan from being made.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// The request lists no device.
    #[error(
        "no devices to plan for: give at least one, e.g. --devices cpu:24GiB or --devices 2x80GiB"
    )]
    NoDevices,
    /// A device string could not be parsed.
    #[error("cannot read device `{spec}`: {reason} (examples: `2x80GiB`, `80GB,80GB`, `cpu:24GiB`, `cuda:0=80GiB`, `2xh100`)")]
    InvalidDevice {
        /// The text that was given.
        spec: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A byte size could not be parsed.
    #[error("cannot read the size `{text}`: {reason} (write e.g. `80GiB`, `80GB`, `512MiB`)")]
    InvalidSize {
        /// The text that was given.
        text: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A CUDA device cannot even hold the CUDA context.
    #[error("{device} has {capacity} but the CUDA context alone takes about {overhead}: that device cannot train anything (check its size; GiB vs MiB?)")]
    DeviceTooSmall {
        /// The device's name.
        device: String,
        /// Its capacity, formatted.
        capacity: String,
        /// The CUDA context estimate, formatted.
        overhead: String,
    },
    /// A setting has a value the planner cannot use.
    #[error("invalid setting {setting} = {value}: {fix}")]
    InvalidSetting {
        /// The setting's name as the run config / CLI spells it.
        setting: &'static str,
        /// The value given.
        value: String,
        /// How to fix it.
        fix: String,
    },
    /// The model config could not be read (unknown `model_type`, missing fields, ...).
    #[error(transparent)]
    Model(#[from] crate::model::ModelError),
    /// A run config could not be read.
    #[error("cannot use the run config {origin}: {message}")]
    RunConfig {
        /// The file.
        origin: String,
        /// What is wrong and how to fix it.
        message: String,
    },
}

/// Numeric precision and device strategy: the run config's own types, shared through
/// [`crate::settings`] (the planner imports nothing from the trainer).
pub use crate::settings::{Precision, Quantization, ShardMode, Strategy};

impl From<crate::settings::UnknownPrecision> for PlanError {
    fn from(e: crate::settings::UnknownPrecision) -> Self {
        PlanError::InvalidSetting {
            setting: "training.precision",
            value: e.0,
            fix: "use fp32, bf16-mixed, bf16 or fp16-mixed".into(),
        }
    }
}

impl From<crate::settings::UnknownShardMode> for PlanError {
    fn from(e: crate::settings::UnknownShardMode) -> Self {
        PlanError::InvalidSetting {
            setting: "devices.shard",
            value: e.0,
            fix: "use gradients-and-optimizer (ZeRO-2) or everything (ZeRO-3)".into(),
        }
    }
}

impl From<crate::settings::UnknownStrategy> for PlanError {
    fn from(e: crate::settings::UnknownStrategy) -> Self {
        PlanError::InvalidSetting {
            setting: "devices.strategy",
            value: e.0,
            fix: "use single, layer-split, data-parallel or sharded".into(),
        }
    }
}
