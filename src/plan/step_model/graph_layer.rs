//! A decoder layer on candle's autograd graph: what its forward keeps, its backward's peak, and
//! what stays in the gradient store.

use super::*;

/// Per-layer bookkeeping of candle tensors (shapes, strides, op nodes, `Arc`s):
/// measured ≈ 11.7 KB per decoder layer, independent of sizes.
const LAYER_METADATA_BYTES: u64 = 11_720;

/// Bytes the forward graph of one (non-checkpointed) decoder layer keeps.
pub(super) fn layer_kept_full(d: &StepDims) -> u64 {
    let n = d.tokens;
    let a = d.act_bytes;
    let (h, q, kv, i) = (d.hidden, d.q_dim, d.kv_dim, d.intermediate);
    // [n, h]: input norm, o_proj, residual, post norm, down_proj, residual.
    // [n, q]: q_proj, q.contiguous() (transposed view), rope(q), probs @ v,
    //         the reshape of the transposed attention output (a copy).
    // [n, kv]: k_proj, k.contiguous(), rope(k), v_proj, v.contiguous().
    // [n, i]: gate, up, silu_mul.
    let mut kept = n * (6 * h + 5 * q + 5 * kv + 3 * i) * a;
    if d.qkv_bias {
        // broadcast_add of the bias is one more tensor per projection.
        kept += n * (q + 2 * kv) * a;
    }
    if d.o_bias {
        kept += n * h * a;
    }
    if d.mlp_bias {
        kept += n * (2 * i + h) * a;
    }
    // Attention scores [b, heads, t, t]: q·kᵀ and its scaling in the compute dtype,
    // the f32 cast (half precision only), + mask and softmax in f32, and the cast back.
    let s = d.micro_batch * d.heads * d.seq_len * d.seq_len;
    kept += if d.act_bytes == 4 {
        s * 16
    } else {
        s * (2 + 2 + 4 + 4 + 4 + 2)
    };
    // Each rope call copies the cos and sin tables to f32 vectors kept in its op.
    kept += 2 * 2 * d.seq_len * d.head_dim * 4;
    // LoRA: x·Aᵀ [n, r], its ·Bᵀ [n, out], the scaling, and the sum with the base output.
    if let Some((r, _)) = &d.lora {
        for (name, _, out, _) in d.linears() {
            if d.lora_targets(name).is_some() {
                kept += n * (r + 3 * out) * a;
            }
        }
    }
    kept + LAYER_METADATA_BYTES
}

/// Peak of one decoder layer's backward above what was stored before it, for a
/// layer whose graph is alive (normal, or recomputed under checkpointing).
pub(super) fn layer_backward_peak(d: &StepDims) -> u64 {
    let n = d.tokens;
    let a = d.act_bytes;
    let g = d.grad_bytes;
    let (h, q, kv, i) = (d.hidden, d.q_dim, d.kv_dim, d.intermediate);
    // Activation gradients in flight once the MLP's backward reaches the gate projection:
    // measured 2·[n, i] + 6·[n, h] (the gate/up output gradients, the post-norm input's
    // accumulating gradient with its zero-then-add, the residual stream's gradient; see
    // `mlp_backward_peak` for the MLP's moments in full fine-tuning).
    let acts = n * (2 * i + 6 * h) * a;
    let lora_scratch = match &d.lora {
        // Adapter gradients follow the same five-buffer pattern, on tiny matrices.
        Some((r, _)) => 5 * r * i.max(h) * g,
        None => 0,
    };
    if d.lora.is_some() {
        // The base is frozen (no weight gradients): activation gradients dominate, and at the
        // attention five score-sized f32 tensors (the probabilities' gradient, the softmax
        // backward's two, candle's zero-then-add of the scores' gradient). Measured at seq
        // 2048 (≈ 4.9 of them, 0.75 GB of a 2.6 GB peak on a 2-layer SmolLM2-width model);
        // at seq ≤ 256 they are a few MB.
        let scores = d.micro_batch * d.heads * d.seq_len * d.seq_len * 4;
        return acts + lora_scratch + 5 * scores;
    }
    // Attention: at the last of q/k/v the MLP and o_proj gradients (and the other
    // projections') are stored and q's backward holds five q-sized buffers. (Measured while
    // the recomputing rope/rms_norm backwards returned tracked gradients; since they return
    // detached ones this moment is lower: 121.3 MiB above the layer's start on the wide
    // 2-layer generic case of tests/plan_heldout.rs against 130.7 predicted, not re-derived.)
    let attn = (3 * h * i + h * q + 2 * h * kv) * g + 5 * h * q * g - h * q * g
        + 4 * d.micro_batch * d.heads * d.seq_len * d.seq_len * 4;
    mlp_backward_peak(d).max(attn + acts)
}

/// Peak of the MLP's backward in full fine-tuning on the graph path, above what was stored
/// before the layer's backward (its incoming gradient excluded, as in
/// [`layer_backward_peak`]).
///
/// candle processes `down`, `down_proj.t()`, `silu_mul`, `up`, `up_proj.t()`, `gate`,
/// `gate_proj.t()` in that order, and two facts set the buffers alive at each node:
///
/// * **A gradient computed from a tracked operand is itself tracked**, so the sum
///   `or_insert` stores keeps its zero tensor and its addend (and whatever those reference)
///   alive until the node it belongs to is processed. A linear's input gradient
///   `grad.matmul(w.t().t())` is tracked (the weight is a Var), so `silu_mul`'s output keeps
///   zero, product and sum (3 × `[n, i]`) and the `[n, h]` gradient they read; the weight
///   gradient `x.t().matmul(grad)` gives the five weight-sized buffers of the module docs.
/// * **`silu_mul`'s backward (`generic::SiluMul`) is analytic**, in f32 tensor ops on
///   detached inputs, one op at a time: at most three `[n, i]` f32 temporaries (sigmoid,
///   and an operand and result of the next product) plus, in half precision, the f32 casts
///   of `g` and of `u` or the incoming gradient. It hands back two plain, untracked
///   gradients, so candle's zero-then-add leaves one `[n, i]` each; while candle adds them
///   into the store, the two returned gradients, `g`'s sum, and `u`'s zero and sum are
///   alive (5 × `[n, i]`).
///
/// Measured with the counting allocator on the wide 2-layer model of tests/plan_heldout.rs
/// (hidden 1152, MLP 3072, micro-batch 2 × 256, fp32, `TUNESTUDIO_OPS=generic`), printing
/// the heap on entry to and exit from every generic op's backward and the peak between
/// them: `silu_mul`'s backward peaked 18.0 MiB (3 × `[n, i]`) above its entry and left
/// 12.0 MiB (its two gradients), and each layer's MLP peaked at the gate projection's
/// transpose, 120.0 MiB above the layer's start (predicted here to the 0.01 MiB). With the
/// recomputing backward the tracked inner graph made `silu_mul` the peak, 192 MiB there
/// (26 × `[n, i]` inside, 17 × `[n, i]` kept until the projections ran): the step's peak
/// fell from 823.5 to 752.8 MiB.
fn mlp_backward_peak(d: &StepDims) -> u64 {
    let (n, h, i) = (d.tokens, d.hidden, d.intermediate);
    let weight = h * i * d.grad_bytes;
    let act_i = n * i * d.act_bytes;
    let act_h = n * h * d.act_bytes;
    // The residual stream's gradient, stored while the whole MLP runs.
    let residual = act_h;
    // After down_proj: its weight gradient, and the tracked gradient of `silu_mul`'s
    // output (zero, product, sum) with the `[n, h]` gradient it read.
    let after_down = residual + weight + 3 * act_i + act_h;
    // Inside `silu_mul`'s backward, per `[n, i]` element: three f32 temporaries and, in half
    // precision, two f32 casts of inputs; then candle's accumulation of what it returns
    // (both gradients, g's sum, u's zero and sum).
    let cast = if d.act_bytes == 4 { 0 } else { 4 };
    let silu_inner = (n * i * (3 * 4 + 2 * cast)).max(5 * act_i);
    let silu = after_down + silu_inner;
    // What `silu_mul` hands back: one untracked gradient each for g and u.
    let (g_grad, u_grad) = (act_i, act_i);
    // up_proj's matmul: the tracked input gradient into x's store (gradient, zero, sum) and
    // three weight-sized buffers.
    let up_matmul = residual + weight + g_grad + u_grad + 3 * act_h + 3 * weight;
    // up_proj's transpose: u's gradient, which x's tracked input gradient reads; two more
    // weight-sized buffers.
    let x_store = 3 * act_h;
    let up_t = residual + weight + g_grad + u_grad + x_store + 5 * weight;
    // gate_proj's matmul and transpose: the last moment, down's and up's gradients stored,
    // x's store summing a second gradient (which reads g's).
    let gate_matmul = residual + 2 * weight + g_grad + u_grad + x_store + 2 * act_h + 3 * weight;
    let gate_t = residual + 2 * weight + g_grad + u_grad + x_store + 2 * act_h + 5 * weight;
    silu.max(up_matmul).max(up_t).max(gate_matmul).max(gate_t)
}

/// Gradients candle leaves in the store for operands that are not part of the graph:
/// `Add`'s backward calls `or_insert` on both operands without checking whether they
/// track gradients, so the broadcast attention mask gets an f32 gradient of the full
/// score shape `[b, heads, t, t]` that nothing consumes (as do frozen biases under
/// LoRA). They live until backward returns.
pub(super) fn layer_residue(d: &StepDims) -> u64 {
    let mut r = d.micro_batch * d.heads * d.seq_len * d.seq_len * 4;
    if d.lora.is_some() {
        if d.qkv_bias {
            r += d.tokens * (d.q_dim + 2 * d.kv_dim) * d.act_bytes;
        }
        if d.o_bias {
            r += d.tokens * d.hidden * d.act_bytes;
        }
        if d.mlp_bias {
            r += d.tokens * (2 * d.intermediate + d.hidden) * d.act_bytes;
        }
    }
    r
}
