//! Fixes for plans that do not fit, and the auto-fit search.
//!
//! Auto-fit keeps the effective batch (micro-batch × accumulation × data-parallel
//! ranks) and searches strategy × precision × checkpointing × micro-batch × LoRA
//! for the settings that fit every device with ≥ 5 % headroom and have the
//! highest estimated throughput. Changes that alter what is learned rank behind
//! those that do not: pure bf16 (no f32 master weights) only when mixed precision
//! cannot fit, LoRA only when nothing full-parameter can.

use super::estimate::{plan_without_fixes, TIGHT_HEADROOM};
use super::{
    format_bytes, Change, DeviceKind, Fix, LoraSpec, Plan, PlanError, PlanRequest, Precision,
    Quantization, Strategy,
};

/// LoRA rank auto-fit proposes when nothing else fits.
pub(crate) const AUTO_LORA_RANK: usize = 16;

/// The result of [`auto_fit`].
#[derive(Debug, Clone)]
pub struct AutoFit {
    /// Whether settings were found that fit every device with ≥ 5 % headroom.
    pub found: bool,
    /// The fitted settings (the request itself when it already fits best).
    pub request: PlanRequest,
    /// Their plan.
    pub plan: Plan,
    /// Each change in words with its effect ("bf16 mixed precision: −4.0 GiB on GPU 0").
    pub changes: Vec<String>,
    /// Estimated throughput relative to the request as given (1.0 = same).
    pub relative_throughput: f64,
}

/// How much a change alters what training learns (lower is preferred).
fn quality_tier(original: &PlanRequest, r: &PlanRequest) -> u8 {
    let quantized = |q: &PlanRequest| q.lora.as_ref().is_some_and(|l| l.quantize.is_on());
    if quantized(r) && !quantized(original) {
        3
    } else if r.lora.is_some() && original.lora.is_none() {
        2
    } else if r.precision == Precision::Bf16 && original.precision != Precision::Bf16 {
        1
    } else {
        0
    }
}

/// Estimated training throughput in arbitrary units (tokens per unit time).
///
/// A coarse cost model, only used to rank settings: matmul FLOPs per token (6 × N for
/// full training, 4 × N with a frozen base, +2 × N recompute with checkpointing, plus
/// attention), device speed by precision (tensor cores make half precision ≈ 3×
/// faster on CUDA; on CPU bf16 is slower than f32), efficiency falling for small
/// micro-batches, and the strategy (data parallel scales with ranks minus the
/// all-reduce; a layer split runs one device at a time).
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
    let recompute = if req.activation_checkpointing {
        fwd
    } else {
        0.0
    };
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
            let passes = if req.activation_checkpointing {
                3.0
            } else {
                2.0
            };
            let tokens = (req.micro_batch * req.seq_len).max(1) as f64;
            let per_weight = if kind == DeviceKind::Cpu { 16.0 } else { 256.0 };
            per_weight * passes * n_params / tokens
        }
        _ => 0.0,
    };
    let flops_per_token = fwd + bwd + recompute + attn + dequant;
    let speed = match (kind, req.precision) {
        (DeviceKind::Cuda, Precision::Fp32) => 1.0,
        (DeviceKind::Cuda, _) => 3.0,
        (DeviceKind::Cpu, Precision::Fp32) => 1.0,
        (DeviceKind::Cpu, _) => 0.6,
    };
    let tokens = (req.micro_batch * req.seq_len) as f64;
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
        Strategy::DataParallel => {
            let r = req.devices.len().max(1) as f64;
            if r > 1.0 {
                r * 0.9
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

fn max_peak(p: &Plan) -> u64 {
    p.per_device.iter().map(|d| d.peak_bytes).max().unwrap_or(0)
}

fn fits_with_headroom(p: &Plan) -> bool {
    p.per_device
        .iter()
        .all(|d| d.fits && d.headroom_fraction() >= TIGHT_HEADROOM)
}

/// The worst device's name and peak.
fn worst(p: &Plan) -> (String, u64) {
    p.per_device
        .iter()
        .max_by_key(|d| d.peak_bytes)
        .map(|d| (d.device.name.clone(), d.peak_bytes))
        .unwrap_or_default()
}

/// Single changes worth trying on a request.
fn candidate_changes(req: &PlanRequest) -> Vec<Change> {
    let mut out = Vec::new();
    if req.devices.len() > 1 {
        for s in [Strategy::LayerSplit, Strategy::DataParallel] {
            if s != req.strategy {
                out.push(Change::Strategy(s));
            }
        }
    }
    for p in [Precision::Bf16Mixed, Precision::Bf16] {
        let fp16_already_mixed = p == Precision::Bf16Mixed && req.precision == Precision::Fp16Mixed;
        if p != req.precision && !fp16_already_mixed {
            out.push(Change::Precision(p));
        }
    }
    if !req.activation_checkpointing {
        out.push(Change::ActivationCheckpointing);
    }
    if req.micro_batch > 1 {
        let mut mbs = vec![1];
        if req.micro_batch.is_multiple_of(2) && req.micro_batch > 2 {
            mbs.push(req.micro_batch / 2);
        }
        for mb in mbs {
            if req.micro_batch.is_multiple_of(mb) {
                out.push(Change::MicroBatch {
                    micro_batch: mb,
                    gradient_accumulation: req.gradient_accumulation * (req.micro_batch / mb),
                });
            }
        }
    }
    if req.lora.is_none() {
        out.push(Change::Lora(LoraSpec::all_linear(AUTO_LORA_RANK)));
    }
    if req
        .lora
        .as_ref()
        .is_none_or(|l| l.quantize != Quantization::Q4K)
    {
        out.push(Change::Quantize(Quantization::Q4K));
    }
    let on_gpu = req.used_devices().iter().any(|d| d.kind != DeviceKind::Cpu);
    if on_gpu && !req.optimizer_offload {
        out.push(Change::OptimizerOffload);
    }
    out
}

/// Ranks single-change fixes for a plan that does not fit (or is tight): those that
/// make it fit alone first (least quality impact, then fastest), then the rest by saving.
pub(crate) fn rank_fixes(req: &PlanRequest, plan: &Plan) -> Vec<Fix> {
    let (worst_name, worst_peak) = worst(plan);
    let base_speed = relative_throughput(req);
    let mut fixes: Vec<(u8, Fix)> = Vec::new();
    for change in candidate_changes(req) {
        let r = change.apply(req);
        let Ok(p) = plan_without_fixes(&r) else {
            continue;
        };
        let after = max_peak(&p);
        let saving = worst_peak.saturating_sub(after);
        if saving == 0 {
            continue;
        }
        let fits_alone = p.fits();
        let speed = relative_throughput(&r) / base_speed.max(f64::MIN_POSITIVE);
        let description = format!(
            "{}: −{} on {}{}",
            change.describe(req),
            format_bytes(saving),
            worst_name,
            if fits_alone {
                format!(" → fits ({:.0} % of the speed)", 100.0 * speed)
            } else {
                " (not enough alone)".to_string()
            }
        );
        fixes.push((
            quality_tier(req, &r),
            Fix {
                description,
                saving_bytes: saving,
                fits_alone,
                relative_throughput: speed,
                change,
            },
        ));
    }
    fixes.sort_by(|(ta, a), (tb, b)| {
        b.fits_alone
            .cmp(&a.fits_alone)
            .then(if a.fits_alone {
                ta.cmp(tb).then(
                    b.relative_throughput
                        .partial_cmp(&a.relative_throughput)
                        .unwrap_or(std::cmp::Ordering::Equal),
                )
            } else {
                std::cmp::Ordering::Equal
            })
            .then(b.saving_bytes.cmp(&a.saving_bytes))
    });
    fixes.into_iter().map(|(_, f)| f).collect()
}

fn divisors(n: usize) -> Vec<usize> {
    (1..=n).filter(|d| n.is_multiple_of(*d)).collect()
}

/// Finds settings that fit every device with ≥ 5 % headroom, keeping the effective
/// batch, with the highest estimated throughput (see the module docs for the order
/// of preference), and explains each change.
#[allow(clippy::too_many_lines)] // the search in its order of preference (module docs); to split
pub fn auto_fit(req: &PlanRequest) -> Result<AutoFit, PlanError> {
    // Validates the request (errors such as zero devices surface here).
    let original_plan = super::plan(req)?;
    let effective = req.effective_batch();
    let base_speed = relative_throughput(req);

    let mut strategies = vec![req.strategy];
    if req.devices.len() > 1 {
        for s in [Strategy::LayerSplit, Strategy::DataParallel] {
            if !strategies.contains(&s) {
                strategies.push(s);
            }
        }
    }
    let mut precisions = vec![req.precision];
    for p in [Precision::Bf16Mixed, Precision::Bf16] {
        let fp16_already_mixed = p == Precision::Bf16Mixed && req.precision == Precision::Fp16Mixed;
        if !precisions.contains(&p) && !fp16_already_mixed {
            precisions.push(p);
        }
    }
    let checkpointing = if req.activation_checkpointing {
        vec![true]
    } else {
        vec![false, true]
    };
    // QLoRA 4-bit last: it changes what is learned the most (tier 3).
    let loras = match &req.lora {
        Some(l) if l.quantize.is_on() => vec![Some(l.clone())],
        Some(l) => vec![
            Some(l.clone()),
            Some(l.clone().quantized(Quantization::Q4K)),
        ],
        None => vec![
            None,
            Some(LoraSpec::all_linear(AUTO_LORA_RANK)),
            Some(LoraSpec::all_linear(AUTO_LORA_RANK).quantized(Quantization::Q4K)),
        ],
    };

    // (tier, throughput, number of changes, request, plan)
    let mut best: Option<(u8, f64, usize, PlanRequest, Plan)> = None;
    // Fallback when nothing fits: the candidate with the smallest worst-device fill.
    let mut least_bad: Option<(f64, PlanRequest, Plan)> = None;
    for &strategy in &strategies {
        let ranks = if strategy == Strategy::DataParallel {
            req.devices.len()
        } else {
            1
        };
        if !effective.is_multiple_of(ranks) {
            continue;
        }
        let per_rank = effective / ranks;
        for &precision in &precisions {
            for &ckpt in &checkpointing {
                for lora in &loras {
                    for mb in divisors(per_rank) {
                        let mut r = req.clone();
                        r.strategy = strategy;
                        r.precision = precision;
                        r.activation_checkpointing = ckpt;
                        r.lora = lora.clone();
                        r.micro_batch = mb;
                        r.gradient_accumulation = per_rank / mb;
                        let Ok(p) = plan_without_fixes(&r) else {
                            continue;
                        };
                        let fill = p
                            .per_device
                            .iter()
                            .map(|d| d.peak_bytes as f64 / d.device.capacity_bytes.max(1) as f64)
                            .fold(0.0, f64::max);
                        if least_bad.as_ref().is_none_or(|(f, _, _)| fill < *f) {
                            least_bad = Some((fill, r.clone(), p.clone()));
                        }
                        if !fits_with_headroom(&p) {
                            continue;
                        }
                        let tier = quality_tier(req, &r);
                        let speed = relative_throughput(&r);
                        let n_changes = count_changes(req, &r);
                        let better = match &best {
                            None => true,
                            Some((bt, bs, bn, _, _)) => {
                                tier < *bt
                                    || (tier == *bt
                                        && (speed > bs * 1.02
                                            || (speed > bs * 0.98 && n_changes < *bn)))
                            }
                        };
                        if better {
                            best = Some((tier, speed, n_changes, r, p));
                        }
                    }
                }
            }
        }
    }
    match best {
        Some((_, speed, _, r, p)) => {
            let changes = explain_changes(req, &original_plan, &r);
            Ok(AutoFit {
                found: true,
                relative_throughput: speed / base_speed.max(f64::MIN_POSITIVE),
                request: r,
                plan: p,
                changes,
            })
        }
        None => {
            let (_, r, p) = least_bad.unwrap_or((0.0, req.clone(), original_plan.clone()));
            let mut changes = explain_changes(req, &original_plan, &r);
            changes.push(format!(
                "nothing fits these devices with {:.0} % headroom, even with QLoRA 4-bit r={}: use larger or more devices, or shorter sequences",
                100.0 * TIGHT_HEADROOM,
                AUTO_LORA_RANK
            ));
            Ok(AutoFit {
                found: false,
                relative_throughput: relative_throughput(&r) / base_speed.max(f64::MIN_POSITIVE),
                request: r,
                plan: p,
                changes,
            })
        }
    }
}

fn count_changes(a: &PlanRequest, b: &PlanRequest) -> usize {
    usize::from(a.strategy != b.strategy)
        + usize::from(a.precision != b.precision)
        + usize::from(a.activation_checkpointing != b.activation_checkpointing)
        + usize::from(a.micro_batch != b.micro_batch)
        + usize::from(a.lora != b.lora)
        + usize::from(a.optimizer_offload != b.optimizer_offload)
}

/// Applies the differences from `from` to `to` one at a time, in the order of
/// preference, and says what each saved on the device that was fullest before it.
fn explain_changes(from: &PlanRequest, from_plan: &Plan, to: &PlanRequest) -> Vec<String> {
    let mut steps: Vec<Change> = Vec::new();
    if from.strategy != to.strategy {
        steps.push(Change::Strategy(to.strategy));
    }
    if from.precision != to.precision {
        steps.push(Change::Precision(to.precision));
    }
    if to.activation_checkpointing && !from.activation_checkpointing {
        steps.push(Change::ActivationCheckpointing);
    }
    let quantize = |r: &PlanRequest| r.lora.as_ref().map_or(Quantization::None, |l| l.quantize);
    if let (Some(l), None) = (&to.lora, &from.lora) {
        steps.push(Change::Lora(l.clone().quantized(Quantization::None)));
    }
    if quantize(to) != quantize(from) {
        steps.push(Change::Quantize(quantize(to)));
    }
    if to.optimizer_offload && !from.optimizer_offload {
        steps.push(Change::OptimizerOffload);
    }
    let mut cur = from.clone();
    let mut cur_plan = from_plan.clone();
    let mut out = Vec::new();
    for change in steps {
        let mut next = change.apply(&cur);
        if let Change::Strategy(_) = change {
            // The micro-batch split is explained separately below.
            next.micro_batch = cur.micro_batch;
            next.gradient_accumulation = cur.gradient_accumulation;
            let ranks = next.data_parallel_ranks();
            if from
                .effective_batch()
                .is_multiple_of(ranks * next.micro_batch)
            {
                next.gradient_accumulation = from.effective_batch() / (ranks * next.micro_batch);
            }
        }
        out.push(describe_step(&change, &cur, &cur_plan, &next));
        if let Ok(p) = plan_without_fixes(&next) {
            cur_plan = p;
        }
        cur = next;
    }
    if cur.micro_batch != to.micro_batch || cur.gradient_accumulation != to.gradient_accumulation {
        let change = Change::MicroBatch {
            micro_batch: to.micro_batch,
            gradient_accumulation: to.gradient_accumulation,
        };
        let next = change.apply(&cur);
        out.push(describe_step(&change, &cur, &cur_plan, &next));
        cur = next;
    }
    if out.is_empty() {
        out.push("the requested settings already fit with headroom; nothing changed".into());
    }
    debug_assert_eq!(cur.effective_batch(), to.effective_batch());
    out
}

fn describe_step(
    change: &Change,
    cur: &PlanRequest,
    cur_plan: &Plan,
    next: &PlanRequest,
) -> String {
    let (name, before) = worst(cur_plan);
    let words = change.describe(cur);
    match plan_without_fixes(next) {
        Ok(p) => {
            let after = p
                .per_device
                .iter()
                .find(|d| d.device.name == name)
                .map(|d| d.peak_bytes)
                .unwrap_or_else(|| max_peak(&p));
            let speed = relative_throughput(next) / relative_throughput(cur).max(f64::MIN_POSITIVE);
            let delta = if after <= before {
                format!("−{}", format_bytes(before - after))
            } else {
                format!("+{}", format_bytes(after - before))
            };
            format!("{words}: {delta} on {name} (speed ×{speed:.2})")
        }
        Err(e) => format!("{words}: {e}"),
    }
}
