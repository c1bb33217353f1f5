//! The coarse throughput model auto-fit ranks settings by.

use crate::plan::{DeviceKind, PlanRequest, Precision, ReferencePlan, ShardMode, Strategy};

/// Estimated training throughput in arbitrary units (tokens per unit time).
///
/// A coarse cost model, only used to rank settings: matmul FLOPs per token (6 × N for
/// full training, 4 × N with a frozen base, +2 × N recompute with checkpointing, plus
/// attention), device speed by precision (tensor cores make half precision ≈ 3×
/// faster on CUDA; on CPU bf16 is slower than f32), efficiency falling for small
/// micro-batches, and the strategy (data parallel scales with ranks minus the
/// all-reduce; sharded data parallel a little below it; a layer split runs one device at a
/// time).
pub fn relative_throughput(req: &PlanRequest) -> f64 {
    let m = &req.model;
    let n_params = m.num_parameters() as f64;
    let layers = m.num_hidden_layers as f64;
    let t = req.seq_len as f64;
    let attn = 12.0 * layers * t * (m.num_attention_heads * m.head_dim) as f64;
    let (fwd, bwd) = if req.lora.is_some() {
        (2.0 * n_params, 2.0 * n_params)
    } else {
        (2.0 * n_params, 4.0 * n_params)
    };
    let recompute = if req.recomputes_layers() { fwd } else { 0.0 };
    let kind = req
        .devices
        .first()
        .map(|d| d.kind)
        .unwrap_or(DeviceKind::Cpu);
    // A quantized base is dequantized once per weight and pass (forward, backward, and the
    // recomputation under checkpointing), whatever the number of tokens. Dequantizing is
    // memory-bound (≈ 0.5 byte read, 2–4 written a weight): in matmul-FLOP equivalents about
    // 256 a weight on a GPU (≈ 100 FLOP per byte of bandwidth) and 16 on a CPU, spread over
    // the micro-batch's tokens. At 512 tokens on a GPU that is ≈ 25 % slower than LoRA, in
    // line with QLoRA's reported overhead.
    let dequant = match &req.lora {
        Some(l) if l.quantize.is_on() => {
            let passes = if req.recomputes_layers() { 3.0 } else { 2.0 };
            let tokens = (req.rows_per_pass() * req.seq_len).max(1) as f64;
            let per_weight = if kind == DeviceKind::Cpu { 16.0 } else { 256.0 };
            per_weight * passes * n_params / tokens
        }
        _ => 0.0,
    };
    // A reference run each micro-step is one more forward; a stored one costs a forward per
    // pair once for the whole run (left out).
    let reference = match req.reference {
        ReferencePlan::Stored => 0.0,
        ReferencePlan::AdapterDisabled | ReferencePlan::Copy => fwd,
    };
    let flops_per_token = fwd + bwd + recompute + attn + dequant + reference;
    let speed = match (kind, req.precision) {
        (DeviceKind::Cuda, Precision::Fp32) => 1.0,
        (DeviceKind::Cuda, _) => 3.0,
        (DeviceKind::Cpu, Precision::Fp32) => 1.0,
        (DeviceKind::Cpu, _) => 0.6,
    };
    // Per forward and backward pass: a GRPO group split over passes runs smaller products,
    // as a smaller micro-batch does.
    let tokens = (req.rows_per_pass() * req.seq_len) as f64;
    let half_efficiency_tokens = match kind {
        DeviceKind::Cuda => 512.0,
        DeviceKind::Cpu => 64.0,
    };
    let efficiency = tokens / (tokens + half_efficiency_tokens);
    let parallel = match req.strategy {
        Strategy::Single => 1.0,
        Strategy::LayerSplit => {
            if req.devices.len() > 1 {
                0.95
            } else {
                1.0
            }
        }
        Strategy::DataParallel | Strategy::Sharded => {
            let r = req.devices.len().max(1) as f64;
            if r > 1.0 {
                r * 0.9 * sharding_cost(req)
            } else {
                1.0
            }
        }
    };
    // Offloaded optimizer state: every step copies each gradient to the host and each
    // updated parameter back, and the update runs on the CPU (a coarse 0.7: ZeRO-Offload
    // reports most of a GPU's throughput kept at large batches, less at small ones).
    let offload = if req.optimizer_offload && kind != DeviceKind::Cpu {
        0.7
    } else {
        1.0
    };
    1e12 * speed * efficiency * parallel * offload / flops_per_token
}

/// Sharded data parallel's speed relative to data parallel's on the same ranks (an assumed
/// figure, not measured: the trainer's sharded step has not run on GPUs yet). A ring
/// all-reduce is a reduce-scatter then an all-gather, so ZeRO-2 moves the same gradient bytes
/// as data parallel; what it adds here is the host collectives' own round trips, one tensor
/// at a time, and an all-gather of the weights that waits for the optimizer step instead of
/// overlapping the backward: 0.9. ZeRO-3 gathers every layer's weights again in the forward
/// and the backward (1.5 × data parallel's traffic, as DeepSpeed documents): 0.8.
fn sharding_cost(req: &PlanRequest) -> f64 {
    match (req.strategy, req.shard) {
        (Strategy::Sharded, ShardMode::GradientsAndOptimizer) => 0.9,
        (Strategy::Sharded, ShardMode::Everything) => 0.8,
        _ => 1.0,
    }
}
