//! One device's training step as a timeline: the forward, the backward and the optimizer step
//! over the blocks the device holds, each phase's bytes by kind, and the peak.

use super::*;

/// Bytes by kind at one moment.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Parts {
    pub(super) weights: u64,
    pub(super) master: u64,
    pub(super) gradients: u64,
    pub(super) optimizer: u64,
    pub(super) activations: u64,
    pub(super) logits: u64,
    pub(super) temporaries: u64,
    pub(super) collective: u64,
}

impl Parts {
    fn total(&self) -> u64 {
        self.weights
            + self.master
            + self.gradients
            + self.optimizer
            + self.activations
            + self.logits
            + self.temporaries
            + self.collective
    }
}

/// The larger of two moments.
fn best_of(a: Parts, b: Parts) -> Parts {
    if b.total() > a.total() {
        b
    } else {
        a
    }
}

pub(super) struct Timeline {
    pub(super) phases: Vec<(StepPhase, u64)>,
    pub(super) peak: u64,
    pub(super) peak_phase: StepPhase,
    pub(super) parts: Parts,
    /// Weights, master weights, accumulated gradients and AdamW state as the optimizer step
    /// begins.
    pub(super) update_state: u64,
    /// The step's full-size components (the per-component report's predicted side).
    pub(super) components: crate::plan::StepComponents,
}

/// What a device holds through a whole step: its blocks, and the bytes under every phase.
struct Held<'a> {
    blocks: Vec<&'a Block>,
    /// Weights, master weights, optimizer states and the accumulated gradients.
    base: Parts,
    /// The gradients the step produces (what the optimizer reads).
    fresh_total: u64,
    /// Every forward tensor the graph keeps until the loss is dropped.
    kept_total: u64,
    /// The largest trainable tensor's elements (per-tensor scratch).
    largest_trainable: u64,
    /// The largest trainable tensor's elements outside the decoder layers (what ZeRO-3
    /// all-gathers after the update).
    largest_root_trainable: u64,
    /// Whether gradients are summed into an existing buffer (accumulation > 1, not sharded).
    accumulating: bool,
    /// The device's rank in a sharded run (`None`: it holds the whole state).
    share: Option<RankShare>,
}

/// The blocks `held` and what stays in memory through the step.
fn held_blocks<'a>(
    costs: &'a LayerCosts,
    dims: &StepDims,
    req: &PlanRequest,
    held: &[usize],
    tied_head_copy: bool,
    share: Option<RankShare>,
) -> Held<'a> {
    let blocks: Vec<&Block> = held.iter().map(|&i| &costs.blocks[i]).collect();
    let mut weights: u64 = blocks.iter().map(|b| b.memory.weights_bytes).sum();
    // A tied lm_head on another device than the embeddings needs its own copy of
    // the matrix (its gradient flows back through the copy).
    if tied_head_copy {
        weights += dims.vocab * dims.hidden * dims.weight_bytes;
    }
    let fresh_total: u64 = blocks.iter().map(|b| b.terms.backward_grad_bytes).sum();
    // A sharded rank's backward makes each micro-step's gradient afresh (it is then
    // reduce-scattered into the slice accumulators), so nothing is summed into a whole buffer.
    let accumulating = req.gradient_accumulation > 1 && share.is_none();
    let base = match share {
        None => Parts {
            weights,
            master: blocks.iter().map(|b| b.memory.master_weights_bytes).sum(),
            optimizer: blocks.iter().map(|b| b.memory.optimizer_states_bytes).sum(),
            gradients: if accumulating { fresh_total } else { 0 },
            ..Parts::default()
        },
        Some(s) => {
            let slice = s.trainable_elems(&blocks);
            Parts {
                weights: s.weight_bytes(&blocks, dims, weights),
                master: slice * dims.master_bytes,
                optimizer: slice * dims.optimizer_bytes,
                // The persistent accumulator of the rank's slices.
                gradients: slice * dims.grad_bytes,
                ..Parts::default()
            }
        }
    };
    Held {
        kept_total: blocks.iter().map(|b| b.terms.kept_bytes).sum(),
        largest_trainable: blocks
            .iter()
            .map(|b| b.largest_trainable_elems)
            .max()
            .unwrap_or(0),
        largest_root_trainable: blocks
            .iter()
            .filter(|b| !super::sharded::is_layer(b))
            .map(|b| b.largest_trainable_elems)
            .max()
            .unwrap_or(0),
        blocks,
        base,
        fresh_total,
        accumulating,
        share,
    }
}

/// Walks one training step (the last micro-batch of an accumulation cycle, the
/// worst one, then the optimizer step) over the blocks this device holds.
pub(super) fn device_timeline(
    costs: &LayerCosts,
    dims: &StepDims,
    req: &PlanRequest,
    held: &[usize],
    tied_head_copy: bool,
    share: Option<RankShare>,
) -> Timeline {
    let h = held_blocks(costs, dims, req, held, tied_head_copy, share);
    let mut moments = vec![
        (StepPhase::Forward, forward_peak(&h, dims, req)),
        (StepPhase::Backward, backward_peak(&h, dims)),
        (StepPhase::OptimizerStep, optimizer_peak(&h, dims, req)),
    ];
    if let Some(generation) = generation_peak(&h, dims, req) {
        moments.insert(0, (StepPhase::Generation, generation));
    }
    let update_state = moments
        .iter()
        .find(|(s, _)| *s == StepPhase::OptimizerStep)
        .map_or(0, |(_, p)| p.weights + p.master + p.gradients + p.optimizer);
    let phases = moments.iter().map(|(s, p)| (*s, p.total())).collect();
    let (peak_phase, parts) =
        moments
            .into_iter()
            .fold((StepPhase::Forward, Parts::default()), |best, cur| {
                if cur.1.total() > best.1.total() {
                    cur
                } else {
                    best
                }
            });
    Timeline {
        phases,
        peak: parts.total(),
        peak_phase,
        parts,
        update_state,
        components: step_components(&h, dims),
    }
}

/// GRPO's generation before the step (`plan/generation.rs`): what stays resident (no
/// gradient yet: the last step's were freed after its update) and the sampling's bytes on the
/// layers and head this device holds. `None` for a run that samples nothing.
fn generation_peak(h: &Held<'_>, dims: &StepDims, req: &PlanRequest) -> Option<Parts> {
    let layers = h
        .blocks
        .iter()
        .filter(|b| matches!(b.kind, BlockKind::Layer(_)))
        .count() as u64;
    let head = h.blocks.iter().any(|b| matches!(b.kind, BlockKind::Head));
    let bytes = crate::plan::generation::generation_bytes(req, dims, layers, head);
    (bytes > 0).then_some(Parts {
        gradients: 0,
        temporaries: bytes,
        ..h.base
    })
}

/// The forward's high-water mark: kept activations grow block by block, each block with a
/// transient on top; a live reference's forward runs without a graph before it.
fn forward_peak(h: &Held<'_>, dims: &StepDims, req: &PlanRequest) -> Parts {
    let mut best = h.base;
    let mut kept_so_far = 0u64;
    for b in &h.blocks {
        let mut p = h.base;
        p.activations = kept_so_far + b.terms.kept_bytes;
        p.temporaries = b.terms.forward_transient_bytes;
        best = best_of(best, p);
        kept_so_far += b.terms.kept_bytes;
    }
    // A live reference's forward without a graph, before the policy's (`plan/reference.rs`).
    let reference = crate::plan::reference::reference_forward_bytes(
        req,
        dims,
        h.blocks.iter().map(|b| {
            (
                matches!(b.kind, BlockKind::Head),
                b.terms.forward_transient_bytes,
            )
        }),
    );
    if reference > 0 {
        let mut p = h.base;
        p.temporaries = reference;
        best = best_of(best, p);
    }
    best
}

/// The backward's high-water mark: the graph (all kept tensors) stays alive until the loss is
/// dropped; gradients appear block by block from the head down; each block's backward has its
/// own transient on top of what is stored.
fn backward_peak(h: &Held<'_>, dims: &StepDims) -> Parts {
    let mut best = h.base;
    best.activations = h.kept_total;
    // With accumulation the buffer is handed to the backward first (gradient taps):
    // every gradient already exists, and each new contribution is summed into it.
    if h.accumulating {
        let mut p = h.base;
        p.activations = h.kept_total;
        p.temporaries = step_model::gradient_tap_transient_bytes(dims, h.largest_trainable);
        best = best_of(best, p);
    }
    let mut end = h.base;
    end.activations = h.kept_total;
    let mut residue = 0u64;
    for b in h.blocks.iter().rev() {
        let mut p = end;
        if matches!(b.kind, BlockKind::Head) {
            p.logits = b.terms.backward_transient_bytes;
            p.temporaries = residue;
        } else {
            p.temporaries = residue + b.terms.backward_transient_bytes;
        }
        if h.accumulating {
            summed_into_buffer(h, dims, b, &mut p);
        }
        best = best_of(best, p);
        let streamed = h
            .share
            .filter(|s| s.streams_layer_gradients(dims) && super::sharded::is_layer(b));
        if let Some(s) = streamed {
            // The layer's whole gradient exists only while each rank's range of it is added
            // into that rank's accumulator, one range at a time.
            let mut scatter = end;
            scatter.temporaries = residue + b.terms.backward_grad_bytes;
            scatter.collective = s.reduce_scatter_bytes(dims, b.largest_trainable_elems);
            best = best_of(best, scatter);
        } else if !h.accumulating {
            end.gradients += b.terms.backward_grad_bytes;
        }
        residue += b.terms.residue_bytes;
        end.activations = end.activations.saturating_sub(b.terms.freed_kept_bytes);
    }
    end.temporaries = residue;
    if let Some(s) = h.share {
        // Right after the backward the whole gradient is reduce-scattered into the slice
        // accumulators: another rank's slice of one tensor at a time arrives.
        end.collective = s.reduce_scatter_bytes(dims, h.largest_trainable);
    }
    best_of(best, end)
}

/// A block's backward moment `p` when its gradients are summed into the existing buffer (a tied
/// head's into the embeddings').
fn summed_into_buffer(h: &Held<'_>, dims: &StepDims, b: &Block, p: &mut Parts) {
    match b.kind {
        BlockKind::Head => {
            let elems = if dims.tied {
                h.blocks
                    .iter()
                    .find(|b| matches!(b.kind, BlockKind::Embeddings))
                    .map_or(0, |b| b.largest_trainable_elems)
            } else {
                b.largest_trainable_elems
            };
            p.logits = step_model::accumulated_head_transient(dims, p.logits, elems);
        }
        _ => {
            p.temporaries = step_model::accumulated_sum_temporaries(
                dims,
                p.temporaries,
                b.largest_trainable_elems,
            )
        }
    }
}

/// The optimizer step: one gradient set (the accumulated one), moments, master weights, and
/// the update's per-tensor scratch.
fn optimizer_peak(h: &Held<'_>, dims: &StepDims, req: &PlanRequest) -> Parts {
    let mut opt = h.base;
    if let Some(s) = h.share {
        // No layer is gathered then (ZeRO-3).
        opt.weights = opt.weights.saturating_sub(s.gathered_bytes(&h.blocks));
        // The whole gradient is gone: the update reads the slice accumulators (in the base),
        // its scratch is per slice, and the all-gather of the updated slices follows it.
        opt.temporaries = step_model::optimizer_transient_bytes(dims, s.slice(h.largest_trainable));
        let mut gather = opt;
        gather.temporaries = 0;
        gather.collective = s.all_gather_bytes(dims, h.largest_trainable, h.largest_root_trainable);
        return best_of(opt, gather);
    }
    opt.gradients = h.fresh_total;
    opt.temporaries = step_model::optimizer_transient_bytes(dims, h.largest_trainable);
    if req.strategy == Strategy::DataParallel && req.devices.len() > 1 {
        // The all-reduce stages one gradient tensor at a time.
        opt.collective = h.largest_trainable * dims.grad_bytes;
    }
    opt
}

/// The step's full-size components as the per-component report counts them.
fn step_components(h: &Held<'_>, dims: &StepDims) -> crate::plan::StepComponents {
    let kept_by = |head: bool| -> u64 {
        h.blocks
            .iter()
            .filter(|b| matches!(b.kind, BlockKind::Head) == head)
            .map(|b| b.terms.kept_bytes)
            .sum()
    };
    // The final norm's output counts as the decoder's (a measuring harness reads the heap
    // after `hidden_states`, which ends with the norm); the head keeps the rest.
    let norm_out = if h.blocks.iter().any(|b| matches!(b.kind, BlockKind::Head)) {
        dims.tokens * dims.hidden * dims.act_bytes
    } else {
        0
    };
    // A sharded rank's whole gradient and its slice accumulators coexist after the backward.
    let accumulators = if h.share.is_some() {
        h.base.gradients
    } else {
        0
    };
    crate::plan::StepComponents {
        weights_bytes: h.base.weights,
        optimizer_bytes: h.base.master + h.base.optimizer,
        gradients_bytes: h.fresh_total + accumulators,
        activations_bytes: kept_by(false) + norm_out,
        logits_and_loss_bytes: kept_by(true).saturating_sub(norm_out),
        accumulating: h.accumulating,
    }
}
