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
use std::time::{Duration, Instant};

/// Where the checks run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CheckMode {
    /// On the CPU (logical devices share it).
    Cpu,
    /// On CUDA GPU 0 (logical devices share it).
    Gpu,
}

/// What to check.
#[derive(Debug, Clone)]
pub struct CheckOptions {
    /// CPU or GPU.
    pub mode: CheckMode,
    /// A fixture model folder with `reference.safetensors` (tiny-llama).
    pub fixture_dir: PathBuf,
    /// Run only the steps with these names (all when empty).
    pub only: Vec<String>,
}

impl CheckOptions {
    /// The defaults: the shared tiny-llama fixture.
    pub fn new(mode: CheckMode) -> Self {
        CheckOptions {
            mode,
            fixture_dir: crate::paths::shared_dir()
                .join("fixtures")
                .join("tiny-llama"),
            only: Vec::new(),
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

/// The fixture batch (`input_ids`, `attention_mask`, `labels`) and references.
fn load_reference(dir: &Path) -> Result<(DeviceBatch, HashMap<String, Tensor>), DevicesError> {
    let path = dir.join("reference.safetensors");
    if !path.exists() {
        return Err(DevicesError::Input(format!(
            "{} not found: point --fixtures at a fixture model folder (e.g. ../shared/fixtures/tiny-llama) \
             or set TUNESTUDIO_SHARED",
            path.display()
        )));
    }
    let tensors = candle_core::safetensors::load(&path, &Device::Cpu)?;
    let get = |k: &str| {
        tensors
            .get(k)
            .cloned()
            .ok_or_else(|| DevicesError::Input(format!("{} has no tensor `{k}`", path.display())))
    };
    let batch = DeviceBatch {
        input_ids: get("input_ids")?.to_dtype(DType::U32)?,
        attention_mask: Some(get("attention_mask")?.to_dtype(DType::U32)?),
        labels: get("labels")?.to_dtype(DType::I64)?,
    };
    Ok((batch, tensors))
}

/// Mean loss and gradients of the mean (grads of the sum scaled by 1/tokens).
fn loss_and_mean_grads(
    model: &CausalLm,
    batch: &DeviceBatch,
) -> Result<(f64, Gradients), DevicesError> {
    let out = model.loss(
        &batch.input_ids,
        batch.attention_mask.as_ref(),
        &batch.labels,
    )?;
    let mean = out.mean()?;
    let mut grads = model.backward(&out.sum)?;
    if out.num_tokens > 0 {
        grads.scale(1.0 / out.num_tokens as f64)?;
    }
    Ok((mean, grads))
}

/// max |a − b| and max |b| over two tensors (compared in f32 on the CPU).
fn diff(a: &Tensor, b: &Tensor) -> Result<(f64, f64), DevicesError> {
    let a = a
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .flatten_all()?;
    let b = b
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .flatten_all()?;
    let d = (&a - &b)?.abs()?.max(0)?.to_scalar::<f32>()? as f64;
    let m = b.abs()?.max(0)?.to_scalar::<f32>()? as f64;
    Ok((d, m))
}

/// Cosine similarity of two tensors.
fn cosine(a: &Tensor, b: &Tensor) -> Result<f64, DevicesError> {
    let a = a
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F64)?
        .flatten_all()?;
    let b = b
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F64)?
        .flatten_all()?;
    let dot = (&a * &b)?.sum_all()?.to_scalar::<f64>()?;
    let na = a.sqr()?.sum_all()?.to_scalar::<f64>()?.sqrt();
    let nb = b.sqr()?.sum_all()?.to_scalar::<f64>()?.sqrt();
    Ok(if na == 0.0 || nb == 0.0 {
        1.0
    } else {
        dot / (na * nb)
    })
}

/// Largest relative gradient difference over every name both sets have:
/// max |a − b| / max |b| per tensor.
fn max_grad_rel_diff(a: &Gradients, b: &Gradients) -> Result<(f64, String, usize), DevicesError> {
    let mut worst = (0.0, String::new(), 0usize);
    for (name, gb) in b.iter() {
        let Some(ga) = a.get(name) else {
            return Err(DevicesError::Input(format!("gradient of {name} missing")));
        };
        let (d, m) = diff(ga, gb)?;
        let rel = d / m.max(1e-12);
        worst.2 += 1;
        if rel > worst.0 {
            worst.0 = rel;
            worst.1 = name.to_string();
        }
    }
    Ok(worst)
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
    // fp32: the CPU matches transformers to float rounding; cuBLAS reorders
    // sums. bf16: 8 mantissa bits, compared by relative loss and gradient direction.
    let (loss_tol, grad_tol, cos_tol) = match (dtype, o.mode) {
        (DType::F32, CheckMode::Cpu) => (1e-5, 1e-3, 0.0),
        (DType::F32, CheckMode::Gpu) => (1e-4, 5e-3, 0.0),
        _ => (3e-2, f64::INFINITY, 0.99),
    };
    let mut worst_rel = 0.0f64;
    let mut worst_name = String::new();
    let mut worst_cos = 1.0f64;
    let mut compared = 0;
    let mut missing = Vec::new();
    for (key, ref_grad) in &reference {
        let Some(name) = key.strip_prefix("grad.") else {
            continue;
        };
        // A parameter transformers trained and this model did not is a failure, not a skip.
        let Some(g) = grads.get(name) else {
            missing.push(name.to_string());
            continue;
        };
        let (d, m) = diff(g, ref_grad)?;
        let rel = d / m.max(1e-12);
        if rel > worst_rel {
            worst_rel = rel;
            worst_name = name.to_string();
        }
        worst_cos = worst_cos.min(cosine(g, ref_grad)?);
        compared += 1;
    }
    let detail = format!(
        "{dtype:?}{} on {}: loss {loss:.6} vs reference {ref_loss:.6} (rel {loss_rel:.2e}, tol {loss_tol:.0e}); \
         {compared} gradients: worst rel diff {worst_rel:.2e} (tol {grad_tol:.0e}, {worst_name}), min cosine {worst_cos:.5}{}",
        if generic { " generic ops + checkpointing" } else { "" },
        if o.mode == CheckMode::Cpu { "cpu" } else { "cuda:0" },
        if missing.is_empty() {
            String::new()
        } else {
            format!("; no gradient for {}", missing.join(", "))
        }
    );
    Ok(
        if compared > 0
            && missing.is_empty()
            && loss_rel <= loss_tol
            && worst_rel <= grad_tol
            && worst_cos >= cos_tol
        {
            Outcome::Pass(detail)
        } else {
            Outcome::Fail(detail)
        },
    )
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
/// reference batch's shape), from the planner's one split rule.
fn split_ranges(
    o: &CheckOptions,
    devices: &[LogicalDevice],
) -> Result<Vec<std::ops::Range<usize>>, DevicesError> {
    use crate::plan::{self, DeviceSpec, PlanRequest};
    let config = ModelConfig::from_file(&o.fixture_dir.join("config.json"))?;
    let (batch, _) = load_reference(&o.fixture_dir)?;
    let (rows, seq) = batch.input_ids.dims2()?;
    let spec = |i: usize| match o.mode {
        CheckMode::Cpu => DeviceSpec::cpu(devices[i].capacity_bytes),
        CheckMode::Gpu => DeviceSpec::cuda(0, devices[i].capacity_bytes),
    };
    let req = PlanRequest {
        model: config,
        precision: crate::settings::Precision::Fp32,
        micro_batch: rows,
        gradient_accumulation: 1,
        seq_len: seq,
        activation_checkpointing: false,
        optimizer_offload: false,
        lora: None,
        strategy: Strategy::LayerSplit,
        devices: (0..devices.len()).map(spec).collect(),
        ops: crate::model::OpsMode::from_env().unwrap_or_default(),
        process: None,
        trained_tokens: None,
        head_loss: Default::default(),
        reference: Default::default(),
    };
    plan::layer_ranges(&req).map_err(|e| DevicesError::Input(format!("planner: {e}")))
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
    g.insert("w", t.clone());
    g.insert("b", t.to_dtype(DType::BF16)?);
    let out = reducer.all_reduce_sum(vec![g], std::slice::from_ref(&device.candle))?;
    let (d, _) = diff(out[0].get("w").unwrap_or(&t), &t)?;
    let (db, _) = diff(out[0].get("b").unwrap_or(&t), &t)?;
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

/// A batch of random tokens (labels = inputs, nothing ignored).
fn random_batch(
    vocab: usize,
    rows: usize,
    seq: usize,
    device: &Device,
    seed: u64,
) -> Result<DeviceBatch, DevicesError> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let ids: Vec<u32> = (0..rows * seq)
        .map(|_| rng.gen_range(0..vocab as u32))
        .collect();
    let input_ids = Tensor::from_vec(ids, (rows, seq), device)?;
    let labels = input_ids.to_dtype(DType::I64)?;
    Ok(DeviceBatch {
        input_ids,
        attention_mask: None,
        labels,
    })
}

/// One training step as the trainer takes it: loss sum, backward, AdamW with
/// token normalisation. Returns the mean loss.
fn train_step(model: &CausalLm, opt: &mut AdamW, batch: &DeviceBatch) -> Result<f64, DevicesError> {
    let out = model.loss(
        &batch.input_ids,
        batch.attention_mask.as_ref(),
        &batch.labels,
    )?;
    let mean = out.mean()?;
    let tokens = out.num_tokens.max(1);
    let grads = model.backward(&out.sum)?;
    drop(out);
    opt.step(&grads, 1e-4, 1.0 / tokens as f64)?;
    Ok(mean)
}

/// The model shape the performance steps use: SmolLM2-135M on a GPU, the
/// tiny fixture's shape on the CPU (so `--cpu` stays quick).
fn bench_config(o: &CheckOptions) -> Result<(ModelConfig, String), DevicesError> {
    let path = match o.mode {
        CheckMode::Gpu => crate::paths::shared_dir()
            .join("model-configs")
            .join("smollm2-135m.json"),
        CheckMode::Cpu => o.fixture_dir.join("config.json"),
    };
    let config = ModelConfig::from_file(&path)?;
    Ok((config, path.display().to_string()))
}

fn synchronize(device: &Device) -> Result<(), DevicesError> {
    device.synchronize()?;
    Ok(())
}

fn step_throughput(o: &CheckOptions) -> Result<Outcome, DevicesError> {
    let device = main_device(o.mode)?;
    let (config, origin) = bench_config(o)?;
    // GPU: pure bf16 (as `model.to(torch.bfloat16)` + torch AdamW, the
    // PyTorch run gpu-check.sh compares with); CPU: f32.
    let (dtype, rows, seq, steps) = match o.mode {
        CheckMode::Gpu => (DType::BF16, 8, 512, 10),
        CheckMode::Cpu => (DType::F32, 2, 64, 3),
    };
    let model = CausalLm::random_init(&config, 0, dtype, &device)?;
    let mut opt = AdamW::new(model.params(), AdamWConfig::default(), false)?;
    let batch = random_batch(config.vocab_size, rows, seq, &device, 1)?;
    // Warm-up: kernels load, pools fill, moments are allocated.
    let first_loss = train_step(&model, &mut opt, &batch)?;
    synchronize(&device)?;
    let mut times = Vec::with_capacity(steps);
    let mut last_loss = first_loss;
    for _ in 0..steps {
        let started = Instant::now();
        last_loss = train_step(&model, &mut opt, &batch)?;
        synchronize(&device)?;
        times.push(started.elapsed().as_secs_f64());
    }
    times.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    let median = times[times.len() / 2];
    let tokens = (rows * seq) as f64;
    let tokens_per_sec = tokens / median;
    let params = config.num_parameters() as f64;
    let mut metrics = BTreeMap::new();
    metrics.insert("tokens_per_sec".to_string(), tokens_per_sec);
    metrics.insert("median_step_secs".to_string(), median);
    metrics.insert("tokens_per_step".to_string(), tokens);
    metrics.insert("parameters".to_string(), params);
    let detail = format!(
        "{origin} ({:.1} M parameters) {dtype:?}, batch {rows} × seq {seq}: median step {median:.4} s,          {tokens_per_sec:.0} tokens/s, {:.1} TFLOP/s (6·N·T); loss {first_loss:.3} → {last_loss:.3}",
        params / 1e6,
        6.0 * params * tokens_per_sec / 1e12
    );
    // Repeating one batch must lower its loss; anything else means the step is broken.
    Ok(if last_loss < first_loss && tokens_per_sec.is_finite() {
        Outcome::PassWith(detail, metrics)
    } else {
        Outcome::FailWith(detail, metrics)
    })
}

/// One configuration of the memory grid.
struct GridPoint {
    precision: crate::plan::Precision,
    micro_batch: usize,
    seq_len: usize,
    checkpointing: bool,
}

/// The plan request of one memory-grid point: the step alone (no process terms, no data).
fn grid_point_request(
    config: &ModelConfig,
    g: &GridPoint,
    spec: &crate::plan::DeviceSpec,
) -> crate::plan::PlanRequest {
    crate::plan::PlanRequest {
        model: config.clone(),
        precision: g.precision,
        micro_batch: g.micro_batch,
        gradient_accumulation: 1,
        seq_len: g.seq_len,
        activation_checkpointing: g.checkpointing,
        optimizer_offload: false,
        lora: None,
        strategy: Strategy::Single,
        devices: vec![spec.clone()],
        ops: crate::model::OpsMode::from_env().unwrap_or_default(),
        process: None,
        trained_tokens: None,
        head_loss: Default::default(),
        reference: Default::default(),
    }
}

fn step_memory_grid(o: &CheckOptions) -> Result<Outcome, DevicesError> {
    use crate::plan::{self, DeviceSpec};
    let device = main_device(o.mode)?;
    let (config, origin) = bench_config(o)?;
    let inv = super::discover();
    let grid = memory_grid(o.mode);
    let spec = match o.mode {
        CheckMode::Gpu => DeviceSpec::cuda(
            0,
            inv.gpu_by_cuda_ordinal(0)
                .map(|g| g.total_bytes)
                .unwrap_or(80 << 30),
        ),
        CheckMode::Cpu => DeviceSpec::cpu(inv.cpu().map(|c| c.total_bytes).unwrap_or(8 << 30)),
    };
    let mut lines = Vec::new();
    let mut metrics = BTreeMap::new();
    let mut worst_error = 0.0f64;
    let mut zero_reading = false;
    let mut measured_any = false;
    // How the CPU peak was measured (the GPU's is the CUDA pool's, exact).
    let mut cpu_method = String::new();
    for (i, g) in grid.iter().enumerate() {
        let req = grid_point_request(&config, g, &spec);
        let the_plan =
            plan::plan(&req).map_err(|e| DevicesError::Input(format!("planner: {e}")))?;
        let Some(dp) = the_plan.per_device.first() else {
            continue;
        };
        let predicted = dp.peak_bytes.saturating_sub(dp.overhead_bytes);
        let measured = match measure_point(o.mode, &config, &device, g, &the_plan, &mut cpu_method)?
        {
            Ok(m) => m,
            Err(summary) => return Ok(Outcome::Fail(format!("dry run failed: {summary}"))),
        };
        let label = format!(
            "{} mb{}×{}{}",
            g.precision,
            g.micro_batch,
            g.seq_len,
            if g.checkpointing { " ckpt" } else { "" }
        );
        match measured {
            Some(m) => {
                measured_any = true;
                // A reading of 0 (an allocator pool that was never asked) is a broken
                // measurement, not a perfect prediction.
                zero_reading |= m == 0;
                let err = (m as f64 - predicted as f64) / (m.max(1) as f64);
                if err.abs() > worst_error.abs() {
                    worst_error = err;
                }
                metrics.insert(format!("grid{i}_predicted_bytes"), predicted as f64);
                metrics.insert(format!("grid{i}_measured_bytes"), m as f64);
                lines.push(format!(
                    "{label}: predicted {} measured {} ({:+.1} %)",
                    crate::units::format_bytes(predicted),
                    crate::units::format_bytes(m),
                    -100.0 * err
                ));
            }
            None => lines.push(format!(
                "{label}: predicted {} (not measurable here)",
                crate::units::format_bytes(predicted)
            )),
        }
    }
    metrics.insert("worst_relative_error".to_string(), worst_error);
    let exact = o.mode == CheckMode::Gpu
        || cpu_method == crate::plan::MeasureMethod::CountingAllocator.to_string();
    let detail = format!(
        "{origin}: {}{}",
        lines.join("; "),
        if exact {
            String::new()
        } else {
            format!(" [measured by {cpu_method}: includes the process's own baseline; informational, not a pass]")
        }
    );
    // An exact measurement (the CUDA pool, the counting allocator) judges the planner:
    // more than 5 % off in either direction fails (under-prediction makes a run that
    // "fits" run out of memory; over-prediction makes auto-fit give away speed). A
    // process-RSS measurement also holds the executable, the allocator's cache and
    // page rounding, so it is reported as figures only.
    Ok(if !measured_any {
        Outcome::Skip(format!("nothing measurable: {detail}"))
    } else if !exact {
        Outcome::InformWith(detail, metrics)
    } else if zero_reading {
        Outcome::FailWith(format!("a measured peak of 0 bytes: {detail}"), metrics)
    } else if worst_error.abs() <= MEMORY_GRID_TOLERANCE {
        Outcome::PassWith(detail, metrics)
    } else {
        Outcome::FailWith(detail, metrics)
    })
}

/// The memory grid of a mode: precisions, batch shapes and checkpointing that a GPU holds
/// easily, and two small points on the CPU.
fn memory_grid(mode: CheckMode) -> Vec<GridPoint> {
    use crate::plan::Precision;
    match mode {
        CheckMode::Gpu => vec![
            GridPoint {
                precision: Precision::Fp32,
                micro_batch: 1,
                seq_len: 256,
                checkpointing: false,
            },
            GridPoint {
                precision: Precision::Fp32,
                micro_batch: 4,
                seq_len: 512,
                checkpointing: false,
            },
            GridPoint {
                precision: Precision::Fp32,
                micro_batch: 4,
                seq_len: 512,
                checkpointing: true,
            },
            GridPoint {
                precision: Precision::Bf16Mixed,
                micro_batch: 4,
                seq_len: 512,
                checkpointing: false,
            },
            GridPoint {
                precision: Precision::Bf16Mixed,
                micro_batch: 8,
                seq_len: 1024,
                checkpointing: false,
            },
            GridPoint {
                precision: Precision::Bf16Mixed,
                micro_batch: 8,
                seq_len: 1024,
                checkpointing: true,
            },
        ],
        CheckMode::Cpu => vec![
            GridPoint {
                precision: Precision::Fp32,
                micro_batch: 1,
                seq_len: 64,
                checkpointing: false,
            },
            GridPoint {
                precision: Precision::Fp32,
                micro_batch: 2,
                seq_len: 128,
                checkpointing: true,
            },
        ],
    }
}

/// The measured peak of one grid point's training step, in bytes beyond what was in use
/// before (`None`: not measurable here); on the CPU `cpu_method` says how it was measured.
/// `Ok(Err(summary))` when the CPU dry run failed.
fn measure_point(
    mode: CheckMode,
    config: &ModelConfig,
    device: &Device,
    g: &GridPoint,
    the_plan: &crate::plan::Plan,
    cpu_method: &mut String,
) -> Result<Result<Option<u64>, String>, DevicesError> {
    use crate::plan::Precision;
    let (dtype, master) = match g.precision {
        Precision::Fp32 => (DType::F32, false),
        Precision::Bf16 => (DType::BF16, false),
        Precision::Bf16Mixed => (DType::BF16, true),
        Precision::Fp16Mixed => (DType::F16, true),
    };
    let build = || -> Result<(CausalLm, AdamW, DeviceBatch), DevicesError> {
        let mut model = CausalLm::random_init(config, 0, dtype, device)?;
        model.set_activation_checkpointing(g.checkpointing);
        let opt = AdamW::new(model.params(), AdamWConfig::default(), master)?;
        let batch = random_batch(config.vocab_size, g.micro_batch, g.seq_len, device, 2)?;
        Ok((model, opt, batch))
    };
    let measured = match mode {
        CheckMode::Gpu => {
            synchronize(device)?;
            let before = super::cuda_pool::used_bytes(0)?;
            super::cuda_pool::reset_peak(0)?;
            let (model, mut opt, batch) = build()?;
            train_step(&model, &mut opt, &batch)?;
            synchronize(device)?;
            let peak = super::cuda_pool::peak_used_bytes(0)?;
            drop((model, opt, batch));
            synchronize(device)?;
            Some(peak.saturating_sub(before))
        }
        CheckMode::Cpu => {
            // The planner's dry run measures the step (allocator or RSS);
            // weights and moments exist before it, as in a real run.
            let (model, mut opt, batch) = build()?;
            let report = crate::plan::dry_run(the_plan, 0, || {
                train_step(&model, &mut opt, &batch).map(|_| ())
            });
            if !report.ok() {
                return Ok(Err(report.summary));
            }
            *cpu_method = report.method.to_string();
            report.measured_peak_bytes
        }
    };
    Ok(Ok(measured))
}
