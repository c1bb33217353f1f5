//! Devices: what the machine has, how a run is spread over it, and how much
//! memory each device uses while training.
//!
//! * [`discovery`] — the CPU (always) and NVIDIA GPUs through NVML loaded at
//!   run time ([`nvml`]), with live memory, utilisation and other processes;
//!   CUDA ordinals matched to NVML devices by UUID.
//! * [`placement`] — the balanced layer split (a pure function over per-layer
//!   byte costs and device capacities; the planner's, re-exported).
//! * [`strategy`] — logical devices (N of them can share one physical CPU or
//!   GPU, so every strategy is testable without a GPU), the three strategies
//!   (single, layer split, data parallel) and the bytes each device holds.
//! * [`parallel`] — a data-parallel step: shard the batch, run each rank,
//!   all-reduce the gradients (host sum; NCCL with the `nccl` feature).
//! * [`parse`] — a `[devices]` entry (`cpu`, `cuda:1`) opened as a candle device.
//! * [`sampler`] — a background thread sampling every used device's memory at
//!   2–5 Hz for the live memory chart.
//! * [`launch`] — one rank of a run started by torchrun or Slurm: the launcher's
//!   environment, and the TCP rendezvous that hands every rank the NCCL id.
//! * [`check`] — the device checks `tunestudio devices --check` runs (on a GPU
//!   machine through `scripts/gpu-check.sh`, or on the CPU with `--cpu`).
//!
//! Nothing here needs CUDA to build: CUDA-only code is behind
//! `#[cfg(feature = "cuda")]` / `#[cfg(feature = "nccl")]`.

pub mod check;
pub mod cuda_pool;
pub mod discovery;
mod dry_run;
pub mod launch;
pub mod nvml;
pub mod parallel;
pub mod parse;
/// The balanced layer split lives with the planner (it is pure and the planner is its first
/// user); re-exported here because the trainer and the device checks place layers with it.
pub use crate::plan::placement;
pub mod sampler;
pub mod strategy;

pub use discovery::{
    discover, discover_with, driver_gpu_capacity, host_memory_bytes, match_cuda_ordinals,
    parse_local_devices, DeviceInfo, DeviceInventory, DeviceKind, DiscoveryOptions, GpuProcess,
};
pub use dry_run::{dry_run, dry_run_with_components, dry_run_with_readings};
pub use parallel::{
    data_parallel_step, split_batch, DataParallelOutput, DeviceBatch, GradientReducer, HostReducer,
};
pub use parse::{parse_device, DeviceParseError};
pub use placement::{balance_layers, LayerSplit, PlacementError, StageCosts};
pub use sampler::{MemorySample, MemorySampler, SampleTarget};
pub use strategy::{placed_bytes, Assignment, LogicalDevice, ParamBlock, PlacedBytes, Strategy};

/// Errors of device placement and multi-device execution.
#[derive(Debug, thiserror::Error)]
pub enum DevicesError {
    /// A layer split could not be computed.
    #[error(transparent)]
    Placement(#[from] PlacementError),
    /// The model failed (forward, backward, moving layers).
    #[error(transparent)]
    Model(#[from] crate::model::ModelError),
    /// A tensor operation failed (moving tensors between devices, summing gradients).
    #[error("tensor operation failed: {0}")]
    Candle(#[from] candle_core::Error),
    /// A device could not be opened.
    #[error("cannot open {device}: {reason}")]
    DeviceUnavailable {
        /// The device as the user named it ("cuda:1").
        device: String,
        /// What went wrong and how to fix it.
        reason: String,
    },
    /// The inputs do not fit together (e.g. fewer batch rows than ranks).
    #[error("{0}")]
    Input(String),
    /// NCCL failed.
    #[error("NCCL {operation} failed: {reason}")]
    Nccl {
        /// The NCCL call.
        operation: &'static str,
        /// Its error.
        reason: String,
    },
    /// The memory sampler thread could not be started.
    #[error("cannot start the memory sampler thread: {0}")]
    Sampler(std::io::Error),
    /// A sum across the processes of a launched run failed; the text names the rank.
    #[error("{0}")]
    Collective(String),
}
