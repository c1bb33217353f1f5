//! The device checks behind `tunestudio devices --check`: everything a GPU
//! machine must confirm about this build, in one binary, without Rust or a
//! network there (`scripts/gpu-check.sh`). With `--cpu` the same steps run on
//! the CPU, so the checks themselves are tested on every machine.
//!
//! Steps: discovery; parity with transformers' reference loss and gradients
//! (fp32 and bf16, and both again through the generic ops with activation
//! checkpointing); a layer split over two logical devices equal to one
//! device; data parallel over two logical devices equal to one device on the
//! whole batch; NCCL all-reduce (with `nccl`); the memory sampler.

use super::parallel::{data_parallel_step, DeviceBatch, HostReducer};
use super::sampler::{MemorySampler, SampleTarget};
use super::strategy::{LogicalDevice, Strategy};
use super::DevicesError;
use crate::model::{AdamW, AdamWConfig, CausalLm, Gradients, ModelConfig};
use candle_core::{DType, Device, Tensor};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod bench;
mod reference;

use bench::{step_memory_grid, step_throughput};
use reference::{
    compare_with_reference, load_reference, loss_and_mean_grads, max_grad_rel_diff,
    GradientComparison,
};

#[cfg(test)]
mod tests;

/// Where the checks run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CheckMode {
    /// On the CPU (logical devices share it).
    Cpu,
    /// On CUDA GPU 0 (logical devices share it).
    Gpu,
}

/// A training run a step plans, in the run config's terms (the layer split's fixture run, a
/// memory-grid point): what [`CheckOptions::planner`] turns into the planner's request.
#[derive(Debug, Clone, PartialEq)]
pub struct CheckRun {
    /// The model's shape.
    pub model: ModelConfig,
    /// `[training] precision`.
    pub precision: crate::settings::Precision,
    /// `[training] micro_batch` (one step, no accumulation).
    pub micro_batch: usize,
    /// `[data] max_length`: the batch's row length.
    pub seq_len: usize,
    /// `[training] activation_checkpointing`.
    pub activation_checkpointing: bool,
    /// `[devices] strategy`.
    pub strategy: Strategy,
    /// The devices the run is planned on.
    pub devices: Vec<crate::plan::DeviceSpec>,
}

/// Makes the planner's request of a [`CheckRun`]: `train::check_request`, through the one
/// run-config adapter (`train::plan_request`). `devices` sits below `train`, so the caller
/// hands it in.
pub type CheckPlanner = Arc<dyn Fn(&CheckRun) -> crate::plan::PlanRequest + Send + Sync>;

/// What to check.
#[derive(Clone)]
pub struct CheckOptions {
    /// CPU or GPU.
    pub mode: CheckMode,
    /// A fixture model folder with `reference.safetensors` (tiny-llama).
    pub fixture_dir: PathBuf,
    /// Run only the steps with these names (all when empty).
    pub only: Vec<String>,
    /// The request of each run the checks plan (`train::check_options` gives the adapter's).
    pub planner: CheckPlanner,
}

impl std::fmt::Debug for CheckOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CheckOptions")
            .field("mode", &self.mode)
            .field("fixture_dir", &self.fixture_dir)
            .field("only", &self.only)
            .finish_non_exhaustive()
    }
}

impl CheckOptions {
    /// The defaults: the shared tiny-llama fixture, every step, runs planned by `planner`.
    pub fn new(mode: CheckMode, planner: CheckPlanner) -> Self {
        CheckOptions {
            mode,
            fixture_dir: crate::paths::shared_dir()
                .join("fixtures")
                .join("tiny-llama"),
            only: Vec::new(),
            planner,
        }
    }
}

/// Outcome of one step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CheckStatus {
    /// It ran and met its tolerance.
    Passed,
    /// It ran and did not, or it errored.
    Failed,
    /// It could not run here (the detail says why).
    Skipped,
    /// It ran, but its measurement cannot judge the claim (e.g. process RSS, which holds
    /// the binary and the allocator's cache besides the step): figures only, never a pass.
    Informational,
}

/// One step's result.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CheckStep {
    /// Step name ("parity-fp32").
    pub name: String,
    /// Outcome.
    pub status: CheckStatus,
    /// Measured figures and tolerances, or the error.
    pub detail: String,
    /// Wall time.
    pub secs: f64,
    /// Machine-readable figures (e.g. `tokens_per_sec`), for scripts.
    pub metrics: BTreeMap<String, f64>,
}

/// Every step's result.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CheckReport {
    /// Where the checks ran.
    pub mode: CheckMode,
    /// The steps, in order.
    pub steps: Vec<CheckStep>,
}

impl CheckReport {
    /// True when no step failed.
    pub fn passed(&self) -> bool {
        self.steps.iter().all(|s| s.status != CheckStatus::Failed)
    }
}

/// The memory grid's bound on |measured − predicted| / measured for an exact measurement.
pub const MEMORY_GRID_TOLERANCE: f64 = 0.05;

/// The step names, in order.
pub const STEPS: [&str; 11] = [
    "discovery",
    "parity-fp32",
    "parity-bf16",
    "parity-generic",
    "parity-generic-bf16",
    "layer-split",
    "data-parallel",
    "nccl",
    "memory-sampler",
    "memory-grid",
    "throughput",
];

enum Outcome {
    Pass(String),
    Fail(String),
    Skip(String),
    /// Passed, with figures for scripts.
    PassWith(String, BTreeMap<String, f64>),
    /// Failed, with the figures measured.
    FailWith(String, BTreeMap<String, f64>),
    /// Ran, with figures that cannot pass or fail the check.
    InformWith(String, BTreeMap<String, f64>),
}

/// Runs the checks; never panics on a failing step (it is reported).
pub fn run_checks(options: &CheckOptions) -> CheckReport {
    let mut steps = Vec::new();
    for name in STEPS {
        if !options.only.is_empty() && !options.only.iter().any(|o| o == name) {
            continue;
        }
        let started = Instant::now();
        let outcome = match run_step(name, options) {
            Ok(o) => o,
            Err(err) => Outcome::Fail(format!("error: {err}")),
        };
        let (status, detail, metrics) = match outcome {
            Outcome::Pass(d) => (CheckStatus::Passed, d, BTreeMap::new()),
            Outcome::Fail(d) => (CheckStatus::Failed, d, BTreeMap::new()),
            Outcome::Skip(d) => (CheckStatus::Skipped, d, BTreeMap::new()),
            Outcome::PassWith(d, m) => (CheckStatus::Passed, d, m),
            Outcome::FailWith(d, m) => (CheckStatus::Failed, d, m),
            Outcome::InformWith(d, m) => (CheckStatus::Informational, d, m),
        };
        steps.push(CheckStep {
            name: name.to_string(),
            status,
            detail,
            secs: started.elapsed().as_secs_f64(),
            metrics,
        });
    }
    CheckReport {
        mode: options.mode,
        steps,
    }
}

fn run_step(name: &str, o: &CheckOptions) -> Result<Outcome, DevicesError> {
    match name {
        "discovery" => Ok(step_discovery(o)),
        "parity-fp32" => step_parity(o, DType::F32, false),
        "parity-bf16" => step_parity(o, DType::BF16, false),
        "parity-generic" => step_parity(o, DType::F32, true),
        "parity-generic-bf16" => step_parity(o, DType::BF16, true),
        "layer-split" => step_layer_split(o),
        "data-parallel" => step_data_parallel(o),
        "nccl" => step_nccl(o),
        "memory-sampler" => step_sampler(o),
        "memory-grid" => step_memory_grid(o),
        "throughput" => step_throughput(o),
        other => Ok(Outcome::Fail(format!("unknown step {other}"))),
    }
}

/// The main device of the mode.
fn main_device(mode: CheckMode) -> Result<Device, DevicesError> {
    match mode {
        CheckMode::Cpu => Ok(Device::Cpu),
        CheckMode::Gpu => Ok(LogicalDevice::cuda(0, 0, 0)?.candle),
    }
}

/// Two logical devices on the mode's one physical device.
fn two_logical(mode: CheckMode) -> Result<Vec<LogicalDevice>, DevicesError> {
    match mode {
        CheckMode::Cpu => Ok(LogicalDevice::cpus(2)),
        CheckMode::Gpu => {
            let mut a = LogicalDevice::cuda(0, 0, 1 << 40)?;
            let mut b = LogicalDevice::cuda(1, 0, 1 << 40)?;
            a.label = "cuda:0#0".into();
            b.label = "cuda:0#1".into();
            Ok(vec![a, b])
        }
    }
}

fn step_discovery(o: &CheckOptions) -> Outcome {
    let inv = super::discover();
    let gpus: Vec<String> = inv
        .gpus()
        .map(|g| {
            format!(
                "{} [{}] {}",
                g.label(),
                g.name,
                crate::units::format_bytes(g.total_bytes)
            )
        })
        .collect();
    match o.mode {
        CheckMode::Cpu => match inv.cpu() {
            Some(cpu) => Outcome::Pass(format!(
                "cpu: {} ({} cores, {}); GPUs: {}{}",
                cpu.name,
                cpu.cores.unwrap_or(0),
                crate::units::format_bytes(cpu.total_bytes),
                if gpus.is_empty() {
                    "none".to_string()
                } else {
                    gpus.join(", ")
                },
                if inv.notes.is_empty() {
                    String::new()
                } else {
                    format!("; notes: {}", inv.notes.join("; "))
                }
            )),
            None => Outcome::Fail("the CPU is not listed".into()),
        },
        CheckMode::Gpu => {
            if inv.gpu_by_cuda_ordinal(0).is_some() {
                Outcome::Pass(format!(
                    "driver {}; {}",
                    inv.driver_version.clone().unwrap_or_default(),
                    gpus.join(", ")
                ))
            } else {
                Outcome::Fail(format!(
                    "no GPU matched to cuda:0 (found: {}; notes: {})",
                    if gpus.is_empty() {
                        "none".to_string()
                    } else {
                        gpus.join(", ")
                    },
                    inv.notes.join("; ")
                ))
            }
        }
    }
}

/// Loss and gradients of the fixture batch against transformers'. `generic`: the device-generic
/// ops (forced on the CPU; what CUDA runs anyway) with activation checkpointing on, so the
/// GPU's checkpointing and generic loss are held to the same reference.
fn step_parity(o: &CheckOptions, dtype: DType, generic: bool) -> Result<Outcome, DevicesError> {
    let device = main_device(o.mode)?;
    let (batch, reference) = load_reference(&o.fixture_dir)?;
    let mut model = CausalLm::load(&o.fixture_dir, dtype, &device)?;
    if generic {
        model.set_ops_mode(crate::model::OpsMode::Generic);
        model.set_activation_checkpointing(true);
    }
    let (loss, grads) = loss_and_mean_grads(&model, &batch.to_device(&device)?)?;
    let ref_loss = reference
        .get("loss")
        .ok_or_else(|| DevicesError::Input("reference has no `loss`".into()))?
        .to_dtype(DType::F64)?
        .flatten_all()?
        .to_vec1::<f64>()?
        .first()
        .copied()
        .unwrap_or(f64::NAN);
    let loss_rel = (loss - ref_loss).abs() / ref_loss.abs().max(1e-12);
    let tolerance = ParityTolerance::of(dtype, o.mode);
    let grads = compare_with_reference(&grads, &reference)?;
    let detail = format!(
        "{dtype:?}{} on {}: loss {loss:.6} vs reference {ref_loss:.6} (rel {loss_rel:.2e}, tol {:.0e}); {}",
        if generic { " generic ops + checkpointing" } else { "" },
        if o.mode == CheckMode::Cpu { "cpu" } else { "cuda:0" },
        tolerance.loss_rel,
        grads.describe(&tolerance),
    );
    Ok(if tolerance.admits(loss_rel, &grads) {
        Outcome::Pass(detail)
    } else {
        Outcome::Fail(detail)
    })
}

/// How far a parity step's loss and gradients may be from transformers'.
#[derive(Debug, Clone, Copy, PartialEq)]
struct ParityTolerance {
    /// |loss − reference| / |reference|.
    loss_rel: f64,
    /// Per tensor, max |g − reference| / max |reference|: the gradients' size, not only their
    /// direction (a bf16 gradient twice too large has cosine 1).
    grad_rel: f64,
    /// The smallest cosine between a gradient and its reference.
    cosine: f64,
}

impl ParityTolerance {
    // fp32: the CPU matches transformers to float rounding; cuBLAS reorders sums.
    // bf16 (8 mantissa bits): measured on the CPU against the fp32 reference, worst gradient
    // 9.4e-3 (native) and 2.2e-2 (generic ops + checkpointing), cosine ≥ 0.9998; 0.1 leaves
    // ~4× and fails a gradient 10 % off in size. The GPU has not run this step yet (cuBLAS
    // rounds its bf16 outputs and orders sums its own way): 0.25 until it has, which still
    // fails a gradient a quarter off (a doubled one is 1.0 off).
    fn of(dtype: DType, mode: CheckMode) -> Self {
        let (loss_rel, grad_rel, cosine) = match (dtype, mode) {
            (DType::F32, CheckMode::Cpu) => (1e-5, 1e-3, 0.0),
            (DType::F32, CheckMode::Gpu) => (1e-4, 5e-3, 0.0),
            (_, CheckMode::Cpu) => (3e-2, 1e-1, 0.99),
            (_, CheckMode::Gpu) => (3e-2, 2.5e-1, 0.99),
        };
        Self {
            loss_rel,
            grad_rel,
            cosine,
        }
    }

    /// Every gradient transformers has is here, and each is near it in size and direction.
    fn admits(&self, loss_rel: f64, grads: &GradientComparison) -> bool {
        grads.compared > 0
            && grads.missing.is_empty()
            && loss_rel <= self.loss_rel
            && grads.worst_rel <= self.grad_rel
            && grads.worst_cosine >= self.cosine
    }
}

fn step_layer_split(o: &CheckOptions) -> Result<Outcome, DevicesError> {
    let device = main_device(o.mode)?;
    let (batch, _) = load_reference(&o.fixture_dir)?;
    let single = CausalLm::load(&o.fixture_dir, DType::F32, &device)?;
    let (loss1, grads1) = loss_and_mean_grads(&single, &batch.to_device(&device)?)?;
    drop(single);

    let devices = two_logical(o.mode)?;
    let mut split = CausalLm::load(&o.fixture_dir, DType::F32, &devices[0].candle)?;
    // The trainer's split rule (`plan::layer_ranges`), on the request the check would train.
    let ranges = split_ranges(o, &devices)?;
    let homes: Vec<crate::model::Home> = (0..split.config().num_hidden_layers)
        .map(|layer| {
            let stage = ranges
                .iter()
                .position(|r| r.contains(&layer))
                .unwrap_or(ranges.len().saturating_sub(1))
                .min(devices.len() - 1);
            crate::model::Home {
                index: stage,
                device: devices[stage].candle.clone(),
            }
        })
        .collect();
    split.set_layer_devices(&homes)?;
    let (loss2, grads2) = loss_and_mean_grads(&split, &batch.to_device(&devices[0].candle)?)?;
    let described: Vec<String> = devices
        .iter()
        .zip(&ranges)
        .map(|(d, r)| format!("{}: layers {}..{}", d.label, r.start, r.end))
        .collect();
    let loss_diff = (loss1 - loss2).abs();
    let (grad_rel, worst, n) = max_grad_rel_diff(&grads2, &grads1)?;
    let tol = if o.mode == CheckMode::Cpu { 1e-6 } else { 1e-5 };
    let detail = format!(
        "{}; loss {loss2:.7} vs {loss1:.7} on one device (|diff| {loss_diff:.1e}); {n} gradients: \
         worst rel diff {grad_rel:.1e} ({worst}); tol {tol:.0e}",
        described.join(" | ")
    );
    Ok(if loss_diff <= tol && grad_rel <= tol {
        Outcome::Pass(detail)
    } else {
        Outcome::Fail(detail)
    })
}

/// The layer ranges the trainer would use for the fixture over `devices` (fp32, the
/// reference batch's shape), from the planner's one split rule on the request the run config
/// adapter makes ([`CheckOptions::planner`]).
fn split_ranges(
    o: &CheckOptions,
    devices: &[LogicalDevice],
) -> Result<Vec<std::ops::Range<usize>>, DevicesError> {
    use crate::plan::DeviceSpec;
    let config = ModelConfig::from_file(&o.fixture_dir.join("config.json"))?;
    let (batch, _) = load_reference(&o.fixture_dir)?;
    let (rows, seq) = batch.input_ids.dims2()?;
    let spec = |d: &LogicalDevice| match o.mode {
        CheckMode::Cpu => DeviceSpec::cpu(d.capacity_bytes),
        CheckMode::Gpu => DeviceSpec::cuda(0, d.capacity_bytes),
    };
    let req = (o.planner)(&CheckRun {
        model: config,
        precision: crate::settings::Precision::Fp32,
        micro_batch: rows,
        seq_len: seq,
        activation_checkpointing: false,
        strategy: Strategy::LayerSplit,
        devices: devices.iter().map(spec).collect(),
    });
    crate::plan::layer_ranges(&req).map_err(|e| DevicesError::Input(format!("planner: {e}")))
}

fn step_data_parallel(o: &CheckOptions) -> Result<Outcome, DevicesError> {
    let device = main_device(o.mode)?;
    let (batch, _) = load_reference(&o.fixture_dir)?;
    let model = CausalLm::load(&o.fixture_dir, DType::F32, &device)?;
    let (loss1, grads1) = loss_and_mean_grads(&model, &batch.to_device(&device)?)?;
    let devices = two_logical(o.mode)?;
    let (out, replicas_note) = match o.mode {
        // One model serves both CPU ranks in turn.
        CheckMode::Cpu => (
            data_parallel_step(&[&model], &devices, &batch, &HostReducer)?,
            "shared model",
        ),
        // A replica per logical GPU device, run concurrently.
        CheckMode::Gpu => {
            let r0 = CausalLm::load(&o.fixture_dir, DType::F32, &devices[0].candle)?;
            let r1 = CausalLm::load(&o.fixture_dir, DType::F32, &devices[1].candle)?;
            (
                data_parallel_step(&[&r0, &r1], &devices, &batch, &HostReducer)?,
                "2 replicas",
            )
        }
    };
    let loss_diff = (out.mean_loss() - loss1).abs();
    let mut worst = (0.0f64, String::new(), 0usize);
    for g in &out.grads {
        let w = max_grad_rel_diff(g, &grads1)?;
        if w.0 >= worst.0 {
            worst = w;
        }
    }
    let tol = 1e-5;
    let ranks: Vec<String> = out
        .per_rank
        .iter()
        .map(|r| format!("{}: {} rows/{} tokens", r.device, r.rows, r.num_tokens))
        .collect();
    let detail = format!(
        "2 ranks ({replicas_note}; {}); loss {:.7} vs {loss1:.7} (|diff| {loss_diff:.1e}); {} gradients: \
         worst rel diff {:.1e} ({}); tol {tol:.0e}",
        ranks.join(", "),
        out.mean_loss(),
        worst.2,
        worst.0,
        worst.1
    );
    Ok(if loss_diff <= tol && worst.0 <= tol {
        Outcome::Pass(detail)
    } else {
        Outcome::Fail(detail)
    })
}

#[cfg(feature = "nccl")]
fn step_nccl(o: &CheckOptions) -> Result<Outcome, DevicesError> {
    use super::parallel::nccl::{NcclId, NcclReducer};
    use super::parallel::GradientReducer;
    if o.mode == CheckMode::Cpu {
        return Ok(Outcome::Skip(
            "NCCL needs a GPU (the CPU path uses the host reducer)".into(),
        ));
    }
    // One GPU: a world of one rank through ncclCommInitRank (the multi-node
    // bootstrap path); the all-reduce of one rank is the identity.
    let device = LogicalDevice::cuda(0, 0, 0)?;
    let id = NcclId::new()?;
    let id = NcclId::from_hex(&id.to_hex())?;
    let reducer = NcclReducer::from_rank(&device, 0, 1, id)?;
    let mut g = Gradients::new();
    let t = Tensor::arange(0f32, 1024f32, &device.candle)?.reshape((32, 32))?;
    // What was sent is the reference: bf16 rounds 0..1024 to steps of up to 4 (a comparison
    // with the f32 values read a max diff of 2.0 on the first H200 run).
    let tb = t.to_dtype(DType::BF16)?;
    g.insert("w", t.clone());
    g.insert("b", tb.clone());
    let out = reducer.all_reduce_sum(vec![g], std::slice::from_ref(&device.candle))?;
    let (d, _) = reference::diff(out[0].get("w").unwrap_or(&t), &t)?;
    let (db, _) = reference::diff(out[0].get("b").unwrap_or(&t), &tb)?;
    let detail =
        format!("ncclCommInitRank world 1 + ncclAllReduce f32/bf16: max diff {d:.1e}/{db:.1e}");
    Ok(if d == 0.0 && db == 0.0 {
        Outcome::Pass(detail)
    } else {
        Outcome::Fail(detail)
    })
}

#[cfg(not(feature = "nccl"))]
fn step_nccl(_: &CheckOptions) -> Result<Outcome, DevicesError> {
    Ok(Outcome::Skip(
        "this build has no NCCL support (`--features nccl`)".into(),
    ))
}

fn step_sampler(o: &CheckOptions) -> Result<Outcome, DevicesError> {
    let inv = super::discover();
    let devices = match o.mode {
        CheckMode::Cpu => LogicalDevice::cpus(1),
        CheckMode::Gpu => vec![LogicalDevice::cuda(0, 0, 0)?],
    };
    let targets = SampleTarget::for_devices(&devices, &inv);
    if targets.is_empty() {
        return Ok(Outcome::Fail(
            "no device to sample (GPU not matched to NVML?)".into(),
        ));
    }
    let (sampler, rx) = MemorySampler::with_channel(targets, Duration::from_millis(200))?;
    let first = rx.recv_timeout(Duration::from_secs(3));
    let second = rx.recv_timeout(Duration::from_secs(3));
    sampler.stop();
    match (first, second) {
        (Ok(a), Ok(b)) if a.used_bytes > 0 && a.capacity_bytes > 0 => Ok(Outcome::Pass(format!(
            "{}: {} used of {} (then {} after {:.2} s)",
            a.label,
            crate::units::format_bytes(a.used_bytes),
            crate::units::format_bytes(a.capacity_bytes),
            crate::units::format_bytes(b.used_bytes),
            b.t_secs - a.t_secs
        ))),
        (a, b) => Ok(Outcome::Fail(format!("samples: {a:?}, {b:?}"))),
    }
}
