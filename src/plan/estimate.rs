//! Assembles the per-block terms of [`super::step_model`] into per-device phase
//! timelines, balances a layer split, and produces the [`Plan`].

use super::step_model::{self, BlockKind, BlockTerms, StepDims};
use super::{
    fit, format_bytes, DeviceKind, DevicePlan, GemmGeometry, LayerMemory, PeakMoment, PhaseBytes,
    Plan, PlanError, PlanRequest, StepPhase, Strategy, Verdict,
};
use std::ops::Range;

mod resume;
mod sharded;
mod timeline;

use resume::resume_moment;
pub use sharded::shard_elems;
pub(crate) use sharded::RankShare;
use timeline::{device_timeline, Timeline};

/// Headroom below which a fitting plan is called tight (allocator fragmentation,
/// other processes, and the planner's own error eat into it).
pub(crate) const TIGHT_HEADROOM: f64 = 0.05;

/// One block of the model with its memory terms.
#[derive(Debug, Clone)]
pub(crate) struct Block {
    pub kind: BlockKind,
    pub memory: LayerMemory,
    pub terms: BlockTerms,
    /// Largest single trainable tensor (optimizer scratch is per tensor).
    pub largest_trainable_elems: u64,
    /// Its parameters tensor by tensor (what a sharded run slices).
    pub tensors: Vec<step_model::TensorSize>,
}

/// The model's blocks in forward order, each with its memory and step terms,
/// plus the totals that do not depend on placement.
#[derive(Debug, Clone)]
pub struct LayerCosts {
    pub(crate) blocks: Vec<Block>,
    /// Total parameters.
    pub parameters: u64,
    /// Parameters the optimizer updates.
    pub trainable_parameters: u64,
}

impl LayerCosts {
    /// Per-block memory (embeddings, each decoder layer, norm + head), in forward order.
    pub fn per_block(&self) -> Vec<LayerMemory> {
        self.blocks.iter().map(|b| b.memory.clone()).collect()
    }

    /// Memory one decoder layer needs at the end of backward, for balancing (index = layer).
    pub fn decoder_layer_bytes(&self) -> Vec<u64> {
        self.blocks
            .iter()
            .filter(|b| matches!(b.kind, BlockKind::Layer(_)))
            .map(|b| b.memory.total_bytes())
            .collect()
    }
}

fn validate(req: &PlanRequest) -> Result<(), PlanError> {
    if req.devices.is_empty() {
        return Err(PlanError::NoDevices);
    }
    for d in &req.devices {
        if d.kind == DeviceKind::Cuda && d.capacity_bytes <= d.overhead_bytes() {
            return Err(PlanError::DeviceTooSmall {
                device: d.name.clone(),
                capacity: format_bytes(d.capacity_bytes),
                overhead: format_bytes(d.overhead_bytes()),
            });
        }
        if d.capacity_bytes == 0 {
            return Err(PlanError::InvalidDevice {
                spec: d.name.clone(),
                reason: "its capacity is 0 bytes".into(),
            });
        }
    }
    let positive = |setting: &'static str, v: usize| {
        if v == 0 {
            Err(PlanError::InvalidSetting {
                setting,
                value: "0".into(),
                fix: "it must be at least 1".into(),
            })
        } else {
            Ok(())
        }
    };
    positive("training.micro_batch", req.micro_batch)?;
    positive("training.gradient_accumulation", req.gradient_accumulation)?;
    positive("data.max_length (sequence length)", req.seq_len)?;
    if let Some(l) = &req.lora {
        positive("lora.r", l.r)?;
        const KNOWN: [&str; 7] = crate::model::LINEAR_MODULES;
        if let Some(bad) = l
            .target_modules
            .iter()
            .find(|m| !KNOWN.contains(&m.as_str()) && m.as_str() != "all-linear")
        {
            return Err(PlanError::InvalidSetting {
                setting: "lora.target_modules",
                value: bad.clone(),
                fix: format!("use some of {}, or all-linear", KNOWN.join(", ")),
            });
        }
        if l.target_modules.is_empty() {
            return Err(PlanError::InvalidSetting {
                setting: "lora.target_modules",
                value: "[]".into(),
                fix: "name at least one linear layer, e.g. [\"q_proj\", \"v_proj\"]".into(),
            });
        }
    }
    if req.model.num_hidden_layers == 0 {
        return Err(PlanError::InvalidSetting {
            setting: "model.num_hidden_layers",
            value: "0".into(),
            fix: "the model config must have at least one decoder layer".into(),
        });
    }
    if req.strategy == Strategy::LayerSplit && req.devices.len() > req.model.num_hidden_layers {
        return Err(PlanError::InvalidSetting {
            setting: "devices.strategy",
            value: "layer-split".into(),
            fix: format!(
                "{} devices but only {} layers: use at most {} devices",
                req.devices.len(),
                req.model.num_hidden_layers,
                req.model.num_hidden_layers
            ),
        });
    }
    Ok(())
}

/// Computes every block's memory and step terms for a request (independent of devices).
pub fn layer_costs(req: &PlanRequest) -> LayerCosts {
    let dims = StepDims::new(req);
    let mut blocks = Vec::with_capacity(req.model.num_hidden_layers + 2);
    let mut parameters = 0u64;
    let mut trainable = 0u64;
    let kinds = std::iter::once(BlockKind::Embeddings)
        .chain((0..req.model.num_hidden_layers).map(BlockKind::Layer))
        .chain(std::iter::once(BlockKind::Head));
    for kind in kinds {
        let params = step_model::block_parameters(&dims, kind);
        let grad_bytes = params.trainable * dims.grad_bytes;
        let terms = step_model::block_terms(&dims, kind);
        // One gradient buffer per parameter: with accumulation each micro-batch's backward
        // sums into it (`CausalLm::backward_into`), so no second copy ever exists.
        let memory = LayerMemory {
            name: kind.to_string(),
            parameters: params.total,
            weights_bytes: params.weight_bytes(&dims)
                + super::reference::copy_weight_bytes(req, &dims, params.total),
            master_weights_bytes: params.trainable * dims.master_bytes,
            gradients_bytes: grad_bytes,
            optimizer_states_bytes: params.trainable * dims.optimizer_bytes,
            activations_bytes: terms.kept_bytes,
        };
        parameters += params.total;
        trainable += params.trainable;
        blocks.push(Block {
            kind,
            memory,
            terms,
            largest_trainable_elems: params.largest_trainable,
            tensors: step_model::block_tensors(&dims, kind),
        });
    }
    LayerCosts {
        blocks,
        parameters,
        trainable_parameters: trainable,
    }
}

/// Splits the decoder layers into one contiguous range per device so that the
/// fullest device (relative to its capacity) is as empty as possible — with
/// [`super::placement::balance_layers_with_fixed`], the one split rule the
/// trainer, the studio's bars and the device checks use too.
///
/// Costs are the planner's per-layer memory at the end of backward (weights,
/// master copy, gradients incl. the accumulation buffer, moments, kept
/// activations), not parameter counts: activations and gradients differ per
/// precision and checkpointing. The embeddings weigh on the first device, the
/// final norm, `lm_head` and the loss on the last, and every device pays its
/// runtime overhead (CUDA context) and the largest in-layer transient once.
pub fn balance_layers(costs: &LayerCosts, req: &PlanRequest) -> Vec<Range<usize>> {
    let n_layers = req.model.num_hidden_layers;
    let n_dev = req.devices.len().clamp(1, n_layers.max(1));
    if n_dev == 1 {
        #[allow(clippy::single_range_in_vec_init)] // one range per device: a Vec is right
        return vec![0..n_layers];
    }
    let last = costs.blocks.last();
    let stage = super::placement::StageCosts {
        embeddings_bytes: costs
            .blocks
            .first()
            .map(|b| b.memory.total_bytes())
            .unwrap_or(0),
        layer_bytes: costs.decoder_layer_bytes(),
        head_bytes: last
            .map(|b| b.memory.total_bytes() + b.terms.transient_bytes())
            .unwrap_or(0),
    };
    let layer_transient = costs
        .blocks
        .iter()
        .filter(|b| matches!(b.kind, BlockKind::Layer(_)))
        .map(|b| b.terms.transient_bytes())
        .max()
        .unwrap_or(0);
    let devices = &req.devices[..n_dev];
    let capacities: Vec<u64> = devices.iter().map(|d| d.capacity_bytes.max(1)).collect();
    let fixed: Vec<u64> = devices
        .iter()
        .map(|d| d.overhead_bytes() + layer_transient)
        .collect();
    match super::placement::balance_layers_with_fixed(&stage, &capacities, &fixed) {
        Ok(split) => split.ranges,
        // Only without layers (validated away before): one device holds everything.
        Err(_) => even_split(n_layers, n_dev),
    }
}

fn even_split(n_layers: usize, n_dev: usize) -> Vec<Range<usize>> {
    let mut out = Vec::with_capacity(n_dev);
    let mut start = 0;
    for d in 0..n_dev {
        let len = n_layers / n_dev + usize::from(d < n_layers % n_dev);
        out.push(start..start + len);
        start += len;
    }
    out
}

/// The decoder layers each device holds under the request's strategy (all of
/// them on every device for single and data parallel): what the trainer places.
pub fn layer_ranges(req: &PlanRequest) -> Result<Vec<Range<usize>>, PlanError> {
    validate(req)?;
    let costs = layer_costs(req);
    Ok(placement(&costs, req).into_iter().map(|(r, _)| r).collect())
}

/// Which blocks (by index into `LayerCosts::blocks`) each used device holds.
fn placement(costs: &LayerCosts, req: &PlanRequest) -> Vec<(Range<usize>, Vec<usize>)> {
    let n_blocks = costs.blocks.len();
    match req.strategy {
        Strategy::Single | Strategy::DataParallel | Strategy::Sharded => {
            let n = if req.strategy == Strategy::Single {
                1
            } else {
                req.devices.len()
            };
            (0..n)
                .map(|_| (0..req.model.num_hidden_layers, (0..n_blocks).collect()))
                .collect()
        }
        Strategy::LayerSplit => {
            let ranges = balance_layers(costs, req);
            let last = ranges.len().saturating_sub(1);
            ranges
                .into_iter()
                .enumerate()
                .map(|(d, r)| {
                    let mut idx: Vec<usize> = Vec::new();
                    if d == 0 {
                        idx.push(0);
                    }
                    // Block i + 1 is decoder layer i.
                    idx.extend(r.clone().map(|l| l + 1));
                    if d == last {
                        idx.push(n_blocks - 1);
                    }
                    (r, idx)
                })
                .collect()
        }
    }
}

/// Plans a request: per-device breakdown, peak and phase, verdict, ranked fixes.
pub fn plan(req: &PlanRequest) -> Result<Plan, PlanError> {
    let mut p = plan_without_fixes(req)?;
    if !p.fits() || p.verdict == Verdict::Tight {
        p.fixes = fit::rank_fixes(req, &p);
    }
    Ok(p)
}

/// What the process's heap holds at its peak when several logical CPU devices (`cpu:0,cpu:1`)
/// share it: they run in turn on the same cores (`train::step::run_ranks`), in one heap.
#[derive(Debug, Clone, PartialEq)]
struct ProcessScope {
    /// The blocks of one rank in the process: the first CPU device's, and under a layer split
    /// every CPU stage's.
    blocks: Vec<usize>,
    /// Data-parallel ranks on CPU devices (each a replica of `blocks`); 1 otherwise.
    replicas: u64,
}

/// The process scope of a plan (see [`ProcessScope`]). Measured on the demo with
/// `examples/rss_breakdown.rs` (heap peak): a layer split over `cpu:0,cpu:1` is the one-device
/// step over all its blocks (119.1 MiB both ways; a tied head needs no copy there, as moving a
/// tensor to the CPU it is on shares its storage); data parallel adds the replica's weights
/// and AdamW state and the gradients of the rank that ran first (171.1 MiB).
fn process_scope(req: &PlanRequest, placed: &[(Range<usize>, Vec<usize>)]) -> ProcessScope {
    let cpus: Vec<usize> = (0..placed.len())
        .filter(|&d| req.devices[d].kind == DeviceKind::Cpu)
        .collect();
    let Some(&first) = cpus.first() else {
        return ProcessScope {
            blocks: Vec::new(),
            replicas: 1,
        };
    };
    match req.strategy {
        Strategy::LayerSplit => ProcessScope {
            blocks: cpus
                .iter()
                .flat_map(|&d| placed[d].1.iter().copied())
                .collect(),
            replicas: 1,
        },
        Strategy::DataParallel | Strategy::Sharded => ProcessScope {
            blocks: placed[first].1.clone(),
            replicas: cpus.len() as u64,
        },
        Strategy::Single => ProcessScope {
            blocks: placed[first].1.clone(),
            replicas: 1,
        },
    }
}

/// The process's footprint: its heap holds `scope`, and one rank's training step peaks at
/// `rank_peak` (the process device's own step, or under a layer split the step over every
/// CPU stage). Data-parallel ranks run in turn, so while the last one is at its peak each
/// earlier one holds its weights, AdamW state and finished gradients.
fn process_footprint(
    inputs: &super::ProcessInputs,
    costs: &LayerCosts,
    dims: &StepDims,
    scope: &ProcessScope,
    rank_peak: u64,
    untouched_workspace_bytes: u64,
) -> super::ProcessFootprint {
    let held: Vec<&Block> = scope.blocks.iter().map(|&i| &costs.blocks[i]).collect();
    let weights: u64 = held.iter().map(|b| b.memory.weights_bytes).sum();
    let state: u64 = held
        .iter()
        .map(|b| b.memory.master_weights_bytes + b.memory.optimizer_states_bytes)
        .sum();
    let gradients: u64 = held.iter().map(|b| b.terms.backward_grad_bytes).sum();
    let others = scope.replicas - 1;
    let tensors_peak = rank_peak + others * (weights + state + gradients);
    super::process::footprint(
        inputs,
        dims,
        scope.replicas * (weights + state),
        scope.replicas * weights,
        tensors_peak,
        untouched_workspace_bytes,
    )
}

/// The plan without the fix search (the fix search plans each candidate with this).
pub(crate) fn plan_without_fixes(req: &PlanRequest) -> Result<Plan, PlanError> {
    validate(req)?;
    let costs = layer_costs(req);
    let dims = StepDims::new(req);
    let placed = placement(&costs, req);
    let n_used = placed.len();
    let mut per_device = Vec::with_capacity(n_used);
    let tied_split =
        req.model.tie_word_embeddings && req.strategy == Strategy::LayerSplit && n_used > 1;
    // The process's own terms ride on the first CPU device (logical CPU devices share one
    // process).
    let process_device = req.process.as_ref().and_then(|_| {
        req.devices[..n_used]
            .iter()
            .position(|d| d.kind == DeviceKind::Cpu)
    });
    let scope = process_scope(req, &placed);
    for (d, (layers, blocks)) in placed.into_iter().enumerate() {
        let device = req.devices[d].clone();
        let share = RankShare::of(req, d);
        let dp = device_timeline(
            &costs,
            &dims,
            req,
            &blocks,
            d == n_used - 1 && tied_split,
            share,
        );
        let overhead = device.overhead_bytes();
        let workspace = gemm_workspace_on(req, n_used, d);
        let tensors_peak = dp.peak + overhead + workspace;
        let process = match (&req.process, process_device == Some(d)) {
            (Some(inputs), true) => {
                let rank_peak = if scope.blocks == blocks {
                    tensors_peak
                } else {
                    device_timeline(&costs, &dims, req, &scope.blocks, false, share).peak
                        + overhead
                        + workspace
                };
                let untouched = workspace - resident_gemm_workspace_on(req, n_used, d);
                Some(process_footprint(
                    inputs, &costs, &dims, &scope, rank_peak, untouched,
                ))
            }
            _ => None,
        };
        let resume = resume_moment(&costs, &dims, &blocks, &dp, overhead);
        // The resume lies below the step's peak with the streaming loader (the step holds
        // every gradient); the max keeps the peak honest should that ever change.
        let peak = process
            .as_ref()
            .map_or(tensors_peak, |p| p.peak_bytes)
            .max(resume.peak_bytes);
        let fits = peak <= device.capacity_bytes;
        let phases: Vec<PhaseBytes> = dp
            .phases
            .iter()
            .map(|(phase, b)| PhaseBytes {
                phase: *phase,
                bytes: b + overhead + workspace,
            })
            .collect();
        let first_oom_phase = phases
            .iter()
            .find(|p| p.bytes > device.capacity_bytes)
            .map(|p| p.phase);
        per_device.push(DevicePlan {
            layers,
            holds_embeddings: blocks.first() == Some(&0),
            holds_head: blocks.last() == Some(&(costs.blocks.len() - 1)),
            weights_bytes: dp.parts.weights,
            master_weights_bytes: dp.parts.master,
            gradients_bytes: dp.parts.gradients,
            optimizer_states_bytes: dp.parts.optimizer,
            update_state_bytes: dp.update_state,
            activations_bytes: dp.parts.activations,
            logits_and_loss_bytes: dp.parts.logits,
            // gemm's per-thread workspace is a temporary that never goes away.
            temporaries_bytes: dp.parts.temporaries + workspace,
            collective_bytes: dp.parts.collective,
            overhead_bytes: overhead,
            peak_bytes: peak,
            training_tensors_bytes: tensors_peak,
            resume_peak_bytes: resume.peak_bytes,
            resume_transient_bytes: resume.transient_bytes,
            process,
            peak_phase: dp.peak_phase,
            components: dp.components,
            phases,
            first_oom_phase,
            fits,
            headroom_bytes: device.capacity_bytes.saturating_sub(peak),
            shortfall_bytes: peak.saturating_sub(device.capacity_bytes),
            device,
        });
    }
    Ok(finish_plan(req, &costs, &dims, per_device))
}

/// The plan around its per-device figures: verdict, summary and totals.
fn finish_plan(
    req: &PlanRequest,
    costs: &LayerCosts,
    dims: &StepDims,
    per_device: Vec<DevicePlan>,
) -> Plan {
    let verdict = if per_device.iter().any(|d| !d.fits) {
        Verdict::OutOfMemory
    } else if per_device
        .iter()
        .any(|d| d.headroom_fraction() < TIGHT_HEADROOM)
    {
        Verdict::Tight
    } else {
        Verdict::Fits
    };
    let summary = summarize(&per_device, verdict);
    Plan {
        per_device,
        verdict,
        summary,
        fixes: Vec::new(),
        per_layer: costs.per_block(),
        parameters: costs.parameters,
        trainable_parameters: costs.trainable_parameters,
        effective_batch: req.effective_batch(),
        settings: req.settings_summary(),
        host_offload_bytes: costs.trainable_parameters * dims.host_state_bytes,
    }
}

/// gemm's per-thread workspace on device `d` of the `n_used` devices: the process's, so the
/// first CPU device carries it (logical CPU devices share the threads); none on a GPU.
fn gemm_workspace_on(req: &PlanRequest, n_used: usize, d: usize) -> u64 {
    gemm_geometry_on(req, n_used, d).map_or(0, |g| g.workspace_bytes())
}

/// The resident part of [`gemm_workspace_on`] (what `VmRSS` sees of it).
fn resident_gemm_workspace_on(req: &PlanRequest, n_used: usize, d: usize) -> u64 {
    gemm_geometry_on(req, n_used, d).map_or(0, |g| g.resident_workspace_bytes())
}

fn gemm_geometry_on(req: &PlanRequest, n_used: usize, d: usize) -> Option<GemmGeometry> {
    let first_cpu = req.devices[..n_used]
        .iter()
        .position(|dev| dev.kind == DeviceKind::Cpu);
    (first_cpu == Some(d)).then(|| req.devices[d].gemm.unwrap_or_else(GemmGeometry::host))
}

fn summarize(per_device: &[DevicePlan], verdict: Verdict) -> String {
    match verdict {
        Verdict::OutOfMemory => per_device
            .iter()
            .filter(|d| !d.fits)
            .map(|d| {
                let first = match d.first_oom_phase {
                    Some(p) if PeakMoment::Step(p) != d.peak_moment() => {
                        format!("; it already overflows in the {p}")
                    }
                    _ => String::new(),
                };
                format!(
                    "{} is out of memory at the {}: needs {}, has {} (short by {}){}",
                    d.device.name,
                    d.peak_moment(),
                    format_bytes(d.peak_bytes),
                    format_bytes(d.device.capacity_bytes),
                    format_bytes(d.shortfall_bytes),
                    first
                )
            })
            .collect::<Vec<_>>()
            .join("; "),
        Verdict::Tight | Verdict::Fits => {
            let worst = per_device.iter().min_by(|a, b| {
                a.headroom_fraction()
                    .partial_cmp(&b.headroom_fraction())
                    .unwrap_or(std::cmp::Ordering::Equal)
            });
            match worst {
                Some(w) => format!(
                    "{}: peak {} of {} on {} at the {} ({} headroom, {:.0} %)",
                    if verdict == Verdict::Tight {
                        "fits, but tight"
                    } else {
                        "fits"
                    },
                    format_bytes(w.peak_bytes),
                    format_bytes(w.device.capacity_bytes),
                    w.device.name,
                    w.peak_moment(),
                    format_bytes(w.headroom_bytes),
                    100.0 * w.headroom_fraction()
                ),
                None => "no device".into(),
            }
        }
    }
}
