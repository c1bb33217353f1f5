//! What one rank of a sharded data-parallel run holds (`[devices] strategy = "sharded"`,
//! issue #57): the terms of data parallel, each divided over the ranks as the trainer divides
//! it.
//!
//! The trainer slices every trainable tensor on its own: the flattened tensor is cut into
//! contiguous ranges, rank r of R taking `n / R` elements and the first `n % R` ranks one
//! more ([`shard_elems`]), so rank 0 is the fullest and the plan of each rank is its own sum
//! over the tensors. Under `gradients-and-optimizer` (ZeRO-2) a rank keeps, per trainable
//! tensor:
//! - the whole weights, as data parallel (every rank runs the whole forward and backward);
//! - the optimizer's copy of its slice (a flat `Var` AdamW updates): under mixed precision it
//!   is the fp32 master of the slice, counted as master weights, and no copy in the weights'
//!   dtype exists (the all-gather rounds the master); else it is in the parameter dtype,
//!   counted with the weights (a copy of weights, in their dtype);
//! - AdamW's m and v of its slice;
//! - a persistent gradient accumulator of its slice. A decoder layer whose gradients leave
//!   candle's graph as its backward ends (checkpointed, gathered or native layers,
//!   [`RankShare::streams_layer_gradients`]) has them reduce-scattered into the accumulators
//!   then, so the backward holds one layer's whole gradient at a time; the rest of the
//!   gradient (embeddings, head, plain graph layers) is whole until the backward ends and is
//!   reduce-scattered then. The optimizer step holds the accumulator only;
//! - the host collective's buffers: during the reduce-scatter one other rank's slice of one
//!   tensor at a time, and after the update the all-gather of the updated slices into the
//!   whole weights, one tensor at a time.
//!
//! Under `everything` (ZeRO-3, FSDP's full shard) the decoder layers' weights are sliced too,
//! every tensor of them (a LoRA run's frozen base included, as FSDP does), and the layer being
//! computed and the next one are gathered whole; no separate copy of a layer's slice exists
//! (the sliced weights are what AdamW updates). The embeddings, final norm and head stay whole
//! (FSDP's root unit, gathered through the step), with ZeRO-2's slice copy and all-gather
//! after the update. Every layer is recomputed (`PlanRequest::recomputes_layers`).

use super::step_model::BlockKind;
use super::{Block, StepDims};
use crate::plan::{PlanRequest, ShardMode, Strategy};

/// Elements of an `n`-element tensor that rank `rank` of `ranks` keeps: `n / ranks`, and one
/// more for the first `n % ranks` ranks (contiguous slices of the flattened tensor, earlier
/// ranks the longer). The trainer's slicing and the plan's, one rule.
pub fn shard_elems(n: u64, rank: u64, ranks: u64) -> u64 {
    let ranks = ranks.max(1);
    n / ranks + u64::from(rank < n % ranks)
}

/// The rank a device is in a sharded run, and what the run divides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RankShare {
    /// This device's rank.
    pub rank: u64,
    /// Ranks in the run (every device).
    pub ranks: u64,
    /// What is divided.
    pub mode: ShardMode,
    /// The ranks are in several processes (a launched run): their gradients are
    /// reduce-scattered after the backward, not layer by layer.
    pub across_processes: bool,
}

impl RankShare {
    /// Device `d`'s share under `req` (`None` unless the strategy is sharded).
    pub fn of(req: &PlanRequest, d: usize) -> Option<RankShare> {
        // A launched run's processes each hold `devices`, in rank order.
        let local = req.devices.len().max(1);
        (req.strategy == Strategy::Sharded).then(|| RankShare {
            rank: (req.world.rank * local + d) as u64,
            ranks: (local * req.world.size.max(1)) as u64,
            mode: req.shard,
            across_processes: req.world.size > 1,
        })
    }

    /// This rank's elements of an `n`-element tensor.
    pub fn slice(&self, n: u64) -> u64 {
        shard_elems(n, self.rank, self.ranks)
    }

    /// This rank's elements of every trainable tensor of `blocks`.
    pub fn trainable_elems(&self, blocks: &[&Block]) -> u64 {
        blocks
            .iter()
            .flat_map(|b| b.tensors.iter())
            .filter(|t| t.trainable)
            .map(|t| self.slice(t.elems))
            .sum()
    }

    /// The weights this rank holds through the step: ZeRO-2, the whole weights
    /// (`whole_bytes`) and, without master weights, the optimizer's copy of its slice of the
    /// trainable ones (with them the slice is the master, counted as such); ZeRO-3,
    /// its slice of every tensor (a quantized base's blocks pro rata, rounded up), what the
    /// blocks hold besides their parameters (a DPO reference copy, kept whole), and the two
    /// largest blocks' weights whole: the layer being computed and the next one, prefetched.
    pub fn weight_bytes(&self, blocks: &[&Block], dims: &StepDims, whole_bytes: u64) -> u64 {
        match self.mode {
            ShardMode::GradientsAndOptimizer if dims.precision.master_weights() => whole_bytes,
            ShardMode::GradientsAndOptimizer => {
                whole_bytes + self.trainable_elems(blocks) * dims.weight_bytes
            }
            ShardMode::Everything => {
                let params = |b: &Block| b.tensors.iter().map(|t| t.bytes).sum::<u64>();
                let (layers, root): (Vec<&Block>, Vec<&Block>) =
                    blocks.iter().partition(|b| is_layer(b));
                let sliced: u64 = layers
                    .iter()
                    .flat_map(|b| b.tensors.iter())
                    .filter(|t| t.elems > 0)
                    .map(|t| (t.bytes * self.slice(t.elems)).div_ceil(t.elems))
                    .sum();
                // The embeddings, final norm and head stay whole (FSDP's root unit is gathered
                // through the step), with ZeRO-2's copy of their trained slices without masters.
                let root_whole: u64 = root.iter().map(|b| params(b)).sum();
                let root_copy = if dims.precision.master_weights() {
                    0
                } else {
                    self.trainable_elems(&root) * dims.weight_bytes
                };
                let besides: u64 = blocks
                    .iter()
                    .map(|b| b.memory.weights_bytes.saturating_sub(params(b)))
                    .sum();
                sliced + root_whole + root_copy + besides + self.gathered_bytes(blocks)
            }
        }
    }

    /// ZeRO-3's layers gathered whole while they run: the two largest decoder layers' weights
    /// (the layer being computed and the next, prefetched); none under ZeRO-2.
    pub fn gathered_bytes(&self, blocks: &[&Block]) -> u64 {
        if self.mode != ShardMode::Everything {
            return 0;
        }
        let mut per_layer: Vec<u64> = blocks
            .iter()
            .filter(|b| is_layer(b))
            .map(|b| b.tensors.iter().map(|t| t.bytes).sum())
            .collect();
        per_layer.sort_unstable_by(|a, b| b.cmp(a));
        per_layer.iter().take(2).sum()
    }

    /// Whether each decoder layer's gradients are reduce-scattered as its backward ends
    /// (`train::step::layer_stream`) rather than after the whole backward: the trainer
    /// streams every gradient that leaves candle's graph through the side table, which
    /// checkpointed and gathered (ZeRO-3) layers' do on any device, and native CPU layers' do.
    pub fn streams_layer_gradients(&self, dims: &StepDims) -> bool {
        // Across processes every rank would have to reach each layer's collective in the same
        // order, which a rank without rows does not: the trainer folds after the backward.
        self.ranks > 1
            && !self.across_processes
            && (dims.checkpointing
                || (dims.native_layers && dims.quantize == crate::settings::Quantization::None))
    }

    /// The reduce-scatter's staging: one other rank's slice of one tensor at a time, at most
    /// the fullest rank's slice (rank 0's) of the largest trainable tensor, in the gradients'
    /// dtype.
    pub fn reduce_scatter_bytes(&self, dims: &StepDims, largest_trainable: u64) -> u64 {
        shard_elems(largest_trainable, 0, self.ranks) * dims.grad_bytes
    }

    /// The all-gather after the update: the updated slices into the whole weights, one tensor
    /// at a time (the largest trainable tensor gathered, in the weights' dtype), with, under
    /// mixed precision, the rank's master slice of it rounded to the weights' dtype first (on
    /// the device unless the master is offloaded to host RAM). ZeRO-2 gathers every trained
    /// tensor; ZeRO-3 only those outside the decoder layers (`largest_root_trainable`), whose
    /// layers are gathered as they run instead.
    pub fn all_gather_bytes(
        &self,
        dims: &StepDims,
        largest_trainable: u64,
        largest_root_trainable: u64,
    ) -> u64 {
        let largest = match self.mode {
            ShardMode::GradientsAndOptimizer => largest_trainable,
            ShardMode::Everything => largest_root_trainable,
        };
        let rounded = if dims.master_bytes > 0 {
            self.slice(largest) * dims.weight_bytes
        } else {
            0
        };
        largest * dims.weight_bytes + rounded
    }
}

/// Whether `block` is a decoder layer (what ZeRO-3 gathers as it runs).
pub(crate) fn is_layer(block: &Block) -> bool {
    matches!(block.kind, BlockKind::Layer(_))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_cover_the_tensor_and_earlier_ranks_take_the_extra_elements() {
        for (n, ranks) in [(0u64, 2u64), (1, 2), (7, 2), (10, 3), (11, 4), (4096, 8)] {
            let lens: Vec<u64> = (0..ranks).map(|r| shard_elems(n, r, ranks)).collect();
            assert_eq!(lens.iter().sum::<u64>(), n, "{n} over {ranks}");
            assert!(lens.windows(2).all(|w| w[0] >= w[1] && w[0] - w[1] <= 1));
            assert_eq!(lens[0], n.div_ceil(ranks), "rank 0 is the fullest");
        }
        assert_eq!(shard_elems(7, 0, 2), 4);
        assert_eq!(shard_elems(7, 1, 2), 3);
    }
}
