//! Step-wide scratch: gemm's per-thread workspace, summing into accumulated gradients, and the
//! optimizer's pass.

use super::*;

/// gemm's per-thread workspace on a CPU device: `threads` L2 slabs of `l2_slab_bytes`
/// ([`crate::model::ops::matmul::gemm_l2_slab_bytes`]). They live as long as the threads, so
/// they sit under every phase of every step. Measured with the counting allocator on the
/// device check's grid (tiny-llama fp32, 2 rayon threads, Sapphire Rapids, L2 2 MiB): the heap
/// peaked 4.07 and 6.01 MiB above the plan without this term (two, then all three threads had
/// packed a product), i.e. 2 MiB a thread; Zen 4's 1 MiB L2 makes it half, which is why a plan
/// tuned there was 6 % low here.
pub fn gemm_workspace_bytes(l2_slab_bytes: u64, threads: u64) -> u64 {
    l2_slab_bytes * threads
}

/// [`gemm_workspace_bytes`] for this machine: the cache size gemm reads and rayon's threads.
pub fn host_gemm_workspace_bytes() -> u64 {
    gemm_workspace_bytes(
        crate::model::ops::matmul::gemm_l2_slab_bytes(),
        crate::model::ops::matmul::gemm_workspace_threads(),
    )
}

/// Scratch of summing into the one gradient buffer while the backward starts (gradient
/// accumulation, see `CausalLm::backward_into`): one extra tensor the size of the largest
/// trainable parameter beside the buffer and every kept activation. Measured with the
/// counting allocator on the SmolLM2 shape, fp32, accumulation 2 and 4 (tests/plan_accuracy.rs):
/// the backward peak exceeds "activations + one gradient copy" by 96 MiB native and 104 MiB
/// generic, against 108 MiB for its largest parameter (the 49152 × 576 embedding).
pub fn gradient_tap_transient_bytes(d: &StepDims, largest_trainable: u64) -> u64 {
    largest_trainable * d.grad_bytes
}

/// A block's backward scratch when its gradients are summed into an existing buffer
/// (gradient accumulation) rather than created: on the native path the side table's sum
/// (`add_side_grad`) is one more tensor of the block's largest parameter; through candle's
/// store the opposite, since the first contribution no longer meets a fresh zero tensor
/// (`or_insert`) that `temporaries` (measured without accumulation) includes.
pub fn accumulated_sum_temporaries(d: &StepDims, temporaries: u64, largest_elems: u64) -> u64 {
    let tensor = largest_elems * d.grad_bytes;
    if d.generic_ops || !d.native_layers {
        temporaries.saturating_sub(tensor)
    } else {
        temporaries + tensor
    }
}

/// The head's backward transient when its weight gradient is summed into an existing
/// buffer (gradient accumulation), with `chunk` the last logits chunk:
/// - through candle's store (generic ops) the first contribution no longer meets a fresh
///   zero tensor, so the gradient, its sum and the chunk are what coexist at most;
/// - on the native path the side table sums the gradient into the buffer after the chunk
///   is freed, which needs `head − chunk` more when the head matrix is the larger.
///
/// Measured with the counting allocator, fp32, accumulation 2 and 4, against accumulation 1:
/// the SmolLM2 shape (113 MB head, 12 MB chunk) −429 MB generic and +101 MB native;
/// tiny-llama (12.6 MB head ≈ 12.4 MB chunk) no change on either path.
pub fn accumulated_head_transient(d: &StepDims, logits: u64, head_elems: u64) -> u64 {
    if d.full_logits {
        // The peak is among the logits' gradients, before the head's weight gradient exists.
        return logits;
    }
    let tensor = head_elems * d.grad_bytes;
    let rows = d.micro_batch * d.seq_len.saturating_sub(1);
    let chunk_bytes = d.loss_rows.min(rows).min(LOSS_CHUNK_ROWS) * d.vocab * 4;
    if d.generic_ops || !d.native_layers {
        if tensor == 0 {
            return logits;
        }
        return logits.saturating_sub(tensor).max(chunk_bytes + 2 * tensor);
    }
    logits + tensor.saturating_sub(chunk_bytes)
}

/// Scratch of the AdamW step for the largest trainable tensor: the gradient as an
/// f32 `Vec` (via an f32 tensor for half gradients), the parameter as an f32 `Vec`
/// (the master copy is reused instead in mixed precision), and the updated tensor
/// (plus its cast back to half precision).
pub fn optimizer_transient_bytes(d: &StepDims, largest_trainable: u64) -> u64 {
    if d.in_place_optimizer {
        return 0;
    }
    if d.host_state_bytes > 0 {
        // Offloaded (`adamw::host_update` off the CPU): the gradient and the parameter are
        // read to the host (through an f32 copy for half precision) and the updated f32
        // values come back as a new device tensor, cast to the parameter's dtype.
        let cast = if d.act_bytes == 4 { 0 } else { d.weight_bytes };
        return largest_trainable * (4 + cast);
    }
    if d.generic_ops {
        // `adamw::device_update` on the largest tensor: the scaled gradient, the decayed
        // parameter, the new moments and up to two temporaries of one expression, all f32
        // (measured 6.1 tensors on the SmolLM2 embedding with the counting allocator).
        return largest_trainable * 6 * 4;
    }
    let per_elem = match d.precision {
        Precision::Fp32 => 4 + 4 + 4,
        Precision::Bf16Mixed | Precision::Fp16Mixed => 4 + 4 + 2,
        Precision::Bf16 => 4 + 4 + 4 + 2,
    };
    largest_trainable * per_elem
}
