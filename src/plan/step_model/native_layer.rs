//! The native layer op (`model::native_layer`): what it saves for its backward, its terms, the
//! context every layer op shares, and the bf16 packing of its products.

use super::*;

/// What the largest of `products` (`m × k × n`) holds besides its operands and output on the
/// bf16 path this CPU runs (`model::ops::kernel_path`, over all threads): the packing and tile
/// buffers of the AMX or dot-product kernel, or the f32 path's widened weight.
pub(super) fn bf16_pack_bytes(products: impl IntoIterator<Item = (u64, u64, u64)>) -> u64 {
    products
        .into_iter()
        .map(|(m, k, n)| {
            crate::model::ops::kernel_path::product_pack_bytes(m as usize, k as usize, n as usize)
                as u64
        })
        .max()
        .unwrap_or(0)
}

/// The largest gemm buffers of the `f32` products of a linear weight `[o, i]` on `n` rows
/// (forward `x Wᵀ`, input gradient `dy W`, weight gradient `dyᵀ x`), as this CPU's gemm runs
/// them over rayon's threads ([`crate::model::ops::gemm_pack::sgemm_pack_bytes`]): the forward
/// product alone, or with `backward` every product (the fused head computes its logits again
/// in its backward); a frozen weight (`trained` false: LoRA's base) has no weight-gradient
/// product.
pub(super) fn f32_linear_pack_bytes(n: u64, i: u64, o: u64, trained: bool, backward: bool) -> u64 {
    use crate::model::ops::gemm_pack::{sgemm_pack_bytes, Strides};
    let forward = sgemm_pack_bytes(
        n as usize,
        i as usize,
        o as usize,
        Strides::row_major(i as usize),
        Strides::transposed(i as usize),
        Strides::row_major(o as usize),
    );
    if backward {
        forward.max(f32_linear_backward_pack_bytes(n, i, o, trained))
    } else {
        forward
    }
}

/// The gemm buffers of a linear weight's backward products alone: the input gradient, and the
/// weight gradient when the weight is trained. A native layer's backward runs no forward
/// product (under checkpointing the recomputed forward comes before the backward's moments):
/// counting the forward's packing there planned QLoRA's backward 3.2 MiB (+2.7 … +3.95 %)
/// above the measured peak on a Zen 5 EPYC, where gemm pre-packs one inner block of the
/// weight for `x Wᵀ` (2.25 MiB for down_proj at 1,024 tokens) but packs nothing for `dy W`
/// (`tests/qlora_memory.rs`; now +0.75 … +1.22 %). The one case it moved the other way there
/// is checkpointed LoRA on an f32 base, −0.12 → −2.26 % (`native_lora_step_matches_the_planner`).
/// Where the backward's products pack at least as much as the forward's, nothing changes.
fn f32_linear_backward_pack_bytes(n: u64, i: u64, o: u64, trained: bool) -> u64 {
    use crate::model::ops::gemm_pack::{sgemm_pack_bytes, Strides};
    let (n, i, o) = (n as usize, i as usize, o as usize);
    let rm = Strides::row_major;
    let input_grad = sgemm_pack_bytes(n, o, i, rm(o), rm(i), rm(i));
    let weight_grad = if trained {
        sgemm_pack_bytes(o, n, i, Strides::transposed(o), rm(i), rm(i))
    } else {
        0
    };
    input_grad.max(weight_grad)
}

/// What one product of a native layer's linear weight holds besides its operands and output:
/// the packing buffers of the bf16 dot-product path, or the f32 copy of a half or quantized
/// weight (one at a time), or nothing (f32); in the forward (`backward` false) or the backward.
fn native_weight_transient_bytes(d: &StepDims, backward: bool) -> u64 {
    let n = d.tokens;
    let largest_weight = d
        .linears()
        .iter()
        .map(|(_, i, o, _)| i * o)
        .max()
        .unwrap_or(0);
    if d.bf16_products && d.quantize == Quantization::None {
        // Forward `x Wᵀ`, input gradient `dy W`, weight gradient `dyᵀ x`.
        return bf16_pack_bytes(
            d.linears()
                .iter()
                .flat_map(|&(_, i, o, _)| [(n, i, o), (n, o, i), (o, n, i)]),
        );
    }
    // The f32 products (on widened or dequantized copies too) pack through gemm.
    let packing = d
        .linears()
        .iter()
        .map(|&(_, i, o, _)| {
            let trained = d.lora.is_none();
            if backward {
                f32_linear_backward_pack_bytes(n, i, o, trained)
            } else {
                f32_linear_pack_bytes(n, i, o, trained, false)
            }
        })
        .max()
        .unwrap_or(0);
    packing
        + if d.act_bytes != 4 {
            largest_weight * 4
        } else {
            dequant_transient_bytes(d)
        }
}

/// Bytes a native layer keeps for its backward (`SavedActivations` in
/// `model/native_layer/layer_pass.rs`): the input-norm output, rotated q and k, v, the
/// attention probabilities, the attention output, the residual after attention and its norm,
/// gate and up; under LoRA also each adapter's scaled down-projection `[n, r]` (dropout masks
/// are drawn again, not kept).
fn native_saved(d: &StepDims) -> u64 {
    let (h, q, kv, i) = (d.hidden, d.q_dim, d.kv_dim, d.intermediate);
    let adapters: u64 = d
        .linears()
        .iter()
        .filter_map(|(name, ..)| d.lora_targets(name))
        .sum();
    d.tokens * (3 * h + 2 * q + 2 * kv + 2 * i + adapters) * 4
        + d.micro_batch * d.heads * d.seq_len * d.seq_len * 4
}

/// A native layer's terms: its saved activations are freed as soon as its backward ends,
/// and its trained tensors' gradients are written once (no zero-then-add).
pub(super) fn native_layer_terms(d: &StepDims, params: &BlockParams) -> BlockTerms {
    let n = d.tokens;
    let (h, q, kv, i) = (d.hidden, d.q_dim, d.kv_dim, d.intermediate);
    let saved = native_saved(d);
    let out = n * h * d.act_bytes;
    // Half precision: the op widens the layer's tensors and its input (backward: and the
    // incoming gradient) to f32 for the call, builds the output in f32 before rounding it,
    // and collects the gradients in f32 before rounding each to the parameter dtype.
    let half = d.act_bytes != 4;
    // The seven weights are not widened up front: each product widens (or dequantizes) its
    // own, one weight's f32 copy at a time, in forward and in backward; the bf16 dot-product
    // path packs instead (`native_weight_transient_bytes`).
    let weight_elems: u64 = d.linears().iter().map(|(_, i, o, _)| i * o).sum();
    let widened = if half {
        params.total.saturating_sub(weight_elems) * 4 + n * h * 4
    } else {
        0
    };
    let jit = native_weight_transient_bytes(d, false);
    let jit_bwd = native_weight_transient_bytes(d, true);
    let own_grads = params.trainable * d.grad_bytes;
    let own_grads_f32 = params.trainable * 4;
    // Forward scratch: the per-head attention outputs before they are interleaved, or the
    // SwiGLU product feeding down_proj.
    // While the layers run, the forward's `Ctx` holds the masks and rope tables as tensors
    // too (the rope tables in the compute dtype) next to the native copies.
    let ctx_tensors = native_ctx_bytes(d) - 2 * d.seq_len * d.head_dim * (4 - d.act_bytes);
    let fwd_scratch =
        n * q.max(i) * 4 + widened + if half { n * h * 4 } else { 0 } + ctx_tensors + jit;
    // Backward moments (bytes above what was stored before the layer, own gradients
    // included as they appear): SwiGLU backward (da, dgate, dup + down's gradient), the
    // gate/up backward, the attention backward (per-head parts and the assembled dq, dk,
    // dv next to dh2 and d_o), and the end (every own gradient, dh, dh2 and candle's
    // zero-then-add of the input gradient).
    // Under LoRA the frozen weights get no gradient: the moments hold activation gradients
    // and the (small) adapter gradients only.
    let wg = u64::from(d.lora.is_none());
    let m1 = (3 * n * i + wg * h * i) * 4;
    let m2 = (2 * n * i + n * h) * 4 + wg * 3 * h * i * 4;
    let m3 = wg * (3 * h * i + h + h * q) * 4 + (2 * n * h + 5 * n * q + 2 * n * kv) * 4;
    let m4 = own_grads_f32 + 3 * n * h * 4;
    let bwd = m1.max(m2).max(m3).max(m4) + if half { widened + n * h * 4 } else { 0 } + jit_bwd;
    if d.checkpointing {
        BlockTerms {
            kept_bytes: out + NATIVE_LAYER_METADATA_BYTES,
            forward_transient_bytes: saved + fwd_scratch,
            // Backward recomputes the layer's forward first.
            backward_transient_bytes: saved + bwd,
            backward_grad_bytes: own_grads,
            residue_bytes: 0,
            freed_kept_bytes: 0,
        }
    } else {
        BlockTerms {
            kept_bytes: saved + out + NATIVE_LAYER_METADATA_BYTES,
            forward_transient_bytes: fwd_scratch,
            backward_transient_bytes: bwd,
            backward_grad_bytes: own_grads,
            residue_bytes: 0,
            freed_kept_bytes: saved,
        }
    }
}

/// The tables one forward pass shares with its native layers (`PassTables` in
/// `model/native_layer/pass_tables.rs`), kept by every layer op until the loss is dropped: the
/// additive attention mask as f32 `[rows, t, t]` — rows = micro-batch, since the trainer always
/// passes the padding mask (`train/step.rs`) — a second one for a sliding window shorter than the
/// sequence, and the rope cos/sin tables `[t, head_dim]` as f32 (0 without native layers).
/// Measured on tiny-llama at seq 3072 (tests/plan_heldout.rs): the activations were 37 MiB
/// (one 3072² f32 mask) above the plan without it; at seq ≤ 256 it is ≤ 1 MiB, hidden in
/// the SmolLM2 grid.
pub fn native_ctx_bytes(d: &StepDims) -> u64 {
    if !d.native_layers {
        return 0;
    }
    let masks = 1 + u64::from(d.sliding_mask);
    masks * d.micro_batch * d.seq_len * d.seq_len * 4 + 2 * d.seq_len * d.head_dim * 4
}

/// Per-layer bookkeeping of a native layer (op node, output tensor, saved `Vec` headers).
const NATIVE_LAYER_METADATA_BYTES: u64 = 2_048;
