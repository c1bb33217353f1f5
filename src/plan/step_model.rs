//! The memory model of one tunestudio training step on candle, block by block.
//!
//! Every term below corresponds to a tensor (or buffer) that the model code in
//! [`crate::model`] and candle 0.11's autograd really allocate; the comments say
//! which and why. The terms were derived by reading that code and checked with
//! the counting allocator (`examples/plan_accuracy.rs`, `tests/plan_accuracy.rs`).
//!
//! The facts that shape the model:
//!
//! * **candle keeps the whole graph.** Every op output that feeds another op is
//!   referenced by its consumer, so every intermediate tensor of the forward pass
//!   stays alive until the loss tensor is dropped (after backward), not only what
//!   backward needs. Views (reshape of a contiguous tensor, transpose, narrow)
//!   share storage; `.contiguous()` of a transposed view and a reshape of a
//!   non-contiguous tensor copy.
//! * **Backward allocates per gradient edge.** `GradStore::or_insert` creates a zero
//!   tensor and `add` allocates the sum, so accumulating one gradient costs three
//!   buffers for a moment. For `x.matmul(w.t())` with a tracked `x`, the weight
//!   gradient `x.t().matmul(grad)` is itself a *tracked* tensor, so the stored
//!   gradient of `w.t()` keeps its zero tensor and the raw product alive until the
//!   transpose node is processed, where the shadowed (still alive) gradient plus a
//!   second zero-then-add make it **five weight-sized buffers** at the peak.
//! * **The loss is one fused op** (`linear_cross_entropy`): it keeps the per-row
//!   log-sum-exp and the probabilities of the last chunk of ≤ 1024 rows,
//!   recomputes other chunks in backward, and
//!   returns an f32 `lm_head` gradient that candle again adds into a zero tensor
//!   (with native layers it goes to the side table instead, and the embedding lookup
//!   adds its rows into it in place).
//! * **Checkpointed layers** keep only their output; backward copies the input into
//!   a fresh Var, recomputes the layer (its whole graph alive again for that layer),
//!   back-propagates, and parks the parameter gradients in a side table.
//! * **AdamW** is one fused pass per tensor. f32 parameters on the CPU are updated in
//!   their own storage (no scratch); otherwise it converts the gradient and the
//!   parameter to f32 `Vec`s and builds the updated tensor, so its scratch is a few
//!   copies of the largest trainable tensor.
//! * **Native layers** (CPU, f32, full fine-tuning or LoRA: `model::native_layer`) are one
//!   op each: they keep a fixed set of activations, free them as soon as their backward
//!   ends, and write each trained tensor's gradient once (frozen base weights get none);
//!   none of the graph terms above apply.
//! * **A quantized base** (QLoRA, `model::quant`): the seven base linears of each layer are
//!   GGML blocks — Q8_0 34 bytes per 32 weights, Q4_K 144 bytes per 256 (Q5_0, 22 per 32,
//!   where the input width is not a multiple of 256), scales included — and each linear's
//!   forward and backward dequantizes its weight for the call: one weight in f32 (plus its
//!   cast in half precision) on top of the layer's transient. Such layers never run as native
//!   layer ops (the graph terms apply).

use super::{PlanRequest, Precision, Quantization};
use std::fmt;

/// A block of the model, in forward order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockKind {
    /// Token embeddings (first device).
    Embeddings,
    /// Decoder layer `i`.
    Layer(usize),
    /// Final norm, `lm_head` and the chunked loss (last device).
    Head,
}

impl fmt::Display for BlockKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BlockKind::Embeddings => f.write_str("embeddings"),
            BlockKind::Layer(i) => write!(f, "layer {i}"),
            BlockKind::Head => f.write_str("norm + lm_head + loss"),
        }
    }
}

/// The sizes the step model needs, derived once per request.
#[derive(Debug, Clone)]
pub struct StepDims {
    /// Rows per micro-batch.
    pub micro_batch: u64,
    /// Tokens per row.
    pub seq_len: u64,
    /// micro_batch × seq_len.
    pub tokens: u64,
    /// Rows the loss computes logits for in the fullest micro-batch (both the fused and the
    /// generic op skip ignored rows): its trained tokens when the data is known
    /// ([`PlanRequest::trained_tokens`]), else every position, micro_batch × (seq_len − 1).
    pub loss_rows: u64,
    /// Residual width.
    pub hidden: u64,
    /// MLP width.
    pub intermediate: u64,
    /// Query heads × head_dim.
    pub q_dim: u64,
    /// Key/value heads × head_dim.
    pub kv_dim: u64,
    /// Query heads.
    pub heads: u64,
    /// Key/value heads.
    pub kv_heads: u64,
    /// Width of a head.
    pub head_dim: u64,
    /// Vocabulary size.
    pub vocab: u64,
    /// q/k/v biases.
    pub qkv_bias: bool,
    /// A sliding window shorter than the sequence: the forward builds a second mask.
    pub sliding_mask: bool,
    /// o_proj bias.
    pub o_bias: bool,
    /// MLP biases.
    pub mlp_bias: bool,
    /// lm_head shares the embedding matrix.
    pub tied: bool,
    /// Bytes per element of weights, activations and gradients.
    pub act_bytes: u64,
    /// Bytes per element of the compute weights.
    pub weight_bytes: u64,
    /// Bytes per element of gradients.
    pub grad_bytes: u64,
    /// Bytes per trainable element of master weights (4 in mixed precision, else 0).
    pub master_bytes: u64,
    /// Bytes per trainable element of AdamW moments (m and v in f32) on the devices.
    pub optimizer_bytes: u64,
    /// Bytes per trainable element of optimizer state (moments, master) offloaded to host RAM.
    pub host_state_bytes: u64,
    /// Precision mode.
    pub precision: Precision,
    /// Activation checkpointing.
    pub checkpointing: bool,
    /// LoRA rank and targets.
    pub lora: Option<(u64, Vec<String>)>,
    /// How the frozen base linears are stored (QLoRA; `None` without LoRA).
    pub quantize: Quantization,
    /// Whether the embedding matrix is trained.
    pub embeddings_trainable: bool,
    /// Decoder layers run as native ops (CPU; f32, bf16 or f16; full fine-tuning or LoRA; see
    /// `model::native_layer`) instead of graphs of candle ops.
    pub native_layers: bool,
    /// The embedding lookup and the lm-head gradient go through the side table
    /// (`model::native_embedding`: CPU, fused ops, embeddings trained; any float dtype).
    pub native_embedding: bool,
    /// AdamW updates parameters (and their f32 master copies) in their own storage (CPU).
    pub in_place_optimizer: bool,
    /// bf16 weights are multiplied on the CPU's bf16 dot-product instruction
    /// (`model::ops::bf16_gemm`: native kernels, bf16 weights, AVX512-BF16): packing buffers
    /// instead of each weight's f32 copy, and no f32 cast of the lm head.
    pub bf16_products: bool,
    /// The device-generic ops run (`model::ops::generic`: any GPU, or `TUNESTUDIO_OPS=generic`):
    /// the loss is the generic chunked op and AdamW's state is updated with tensor ops.
    pub generic_ops: bool,
    /// The loss takes the full logits of every row (preference training,
    /// [`super::HeadLoss::FullLogits`]): see [`full_logits_head_terms`].
    pub full_logits: bool,
}

impl StepDims {
    /// Derives the sizes of a request.
    pub fn new(req: &PlanRequest) -> Self {
        let m = &req.model;
        let act = req.precision.compute_bytes();
        // Dynamic padding: the longest micro-batch of the data, when it is known.
        let seq_len = req.planned_seq_len();
        let tokens = (req.micro_batch * seq_len) as u64;
        // The CPU's native kernels run only on the CPU, and not when the generic ops
        // (the GPU's code) are forced there; everywhere else the generic ops run.
        let any_gpu = req
            .used_devices()
            .iter()
            .any(|d| d.kind != super::DeviceKind::Cpu);
        let generic_ops = req.ops == crate::model::OpsMode::Generic || any_gpu;
        let all_cpu = !generic_ops;
        // Offloading moves the moments and master weights off the GPUs (on a CPU the host
        // is the device: nothing moves).
        let offloaded = req.optimizer_offload && any_gpu;
        let master = if req.precision.master_weights() { 4 } else { 0 };
        let quantize = req.lora.as_ref().map_or(Quantization::None, |l| l.quantize);
        StepDims {
            micro_batch: req.micro_batch as u64,
            seq_len: seq_len as u64,
            tokens,
            loss_rows: req.loss_rows() as u64,
            hidden: m.hidden_size as u64,
            intermediate: m.intermediate_size as u64,
            q_dim: (m.num_attention_heads * m.head_dim) as u64,
            kv_dim: (m.num_key_value_heads * m.head_dim) as u64,
            heads: m.num_attention_heads as u64,
            kv_heads: m.num_key_value_heads as u64,
            head_dim: m.head_dim as u64,
            vocab: m.vocab_size as u64,
            qkv_bias: m.qkv_bias(),
            sliding_mask: m.sliding_window.is_some_and(|w| w < seq_len),
            o_bias: m.o_bias(),
            mlp_bias: m.mlp_bias,
            tied: m.tie_word_embeddings,
            act_bytes: act,
            weight_bytes: act,
            grad_bytes: act,
            master_bytes: if offloaded { 0 } else { master },
            optimizer_bytes: if offloaded { 0 } else { 8 },
            host_state_bytes: if offloaded { 8 + master } else { 0 },
            precision: req.precision,
            checkpointing: req.activation_checkpointing,
            lora: req
                .lora
                .as_ref()
                .map(|l| (l.r as u64, l.target_modules.clone())),
            embeddings_trainable: req.lora.is_none(),
            quantize,
            // Quantized layers run as graphs of ops (`native_layer::layer_qualifies`).
            native_layers: all_cpu,
            native_embedding: all_cpu && req.lora.is_none(),
            in_place_optimizer: all_cpu,
            bf16_products: all_cpu
                && matches!(req.precision, Precision::Bf16Mixed | Precision::Bf16)
                && crate::model::ops::bf16_gemm::available(),
            generic_ops,
            full_logits: req.head_loss == super::HeadLoss::FullLogits,
        }
    }

    fn lora_targets(&self, module: &str) -> Option<u64> {
        match &self.lora {
            // `all-linear` is PEFT's (and the run config's) name for every linear layer.
            Some((r, t)) if t.iter().any(|m| m == module || m == "all-linear") => Some(*r),
            _ => None,
        }
    }

    /// The linear layers of a decoder layer: (short name, in, out, bias).
    pub fn linears(&self) -> [(&'static str, u64, u64, bool); 7] {
        [
            ("q_proj", self.hidden, self.q_dim, self.qkv_bias),
            ("k_proj", self.hidden, self.kv_dim, self.qkv_bias),
            ("v_proj", self.hidden, self.kv_dim, self.qkv_bias),
            ("o_proj", self.q_dim, self.hidden, self.o_bias),
            ("gate_proj", self.hidden, self.intermediate, self.mlp_bias),
            ("up_proj", self.hidden, self.intermediate, self.mlp_bias),
            ("down_proj", self.intermediate, self.hidden, self.mlp_bias),
        ]
    }
}

/// Parameter counts of one block.
#[derive(Debug, Clone, Copy, Default)]
pub struct BlockParams {
    /// Every parameter (frozen base + adapters).
    pub total: u64,
    /// Parameters the optimizer updates.
    pub trainable: u64,
    /// Elements of the largest trainable tensor.
    pub largest_trainable: u64,
    /// Weight bytes that are not `total × weight_bytes` (none today).
    pub extra_weight_bytes: u64,
    /// Parameters stored quantized (QLoRA base linears), counted in `total`.
    pub quantized: u64,
    /// Their bytes in the quantized formats, block scales included.
    pub quantized_bytes: u64,
}

impl BlockParams {
    /// Bytes of the block's weights: dense parameters in the compute dtype, quantized ones in
    /// their blocks.
    pub fn weight_bytes(&self, d: &StepDims) -> u64 {
        (self.total - self.quantized) * d.weight_bytes
            + self.quantized_bytes
            + self.extra_weight_bytes
    }
}

/// The transient of dequantizing a layer's largest quantized weight for one call: f32, plus
/// its cast to the compute dtype in half precision on the graph path (the native layer op
/// multiplies in f32); 0 when nothing is quantized.
pub fn dequant_transient_bytes(d: &StepDims) -> u64 {
    let cast = if d.weight_bytes == 4 || d.native_layers {
        0
    } else {
        d.weight_bytes
    };
    let per_elem = 4 + cast;
    d.linears()
        .iter()
        .filter(|(_, i, _, _)| d.quantize.format_for(*i).is_some())
        .map(|(_, i, o, _)| i * o * per_elem)
        .max()
        .unwrap_or(0)
}

/// Packing buffers of the largest of `products` (`m × k × n`) on the bf16 dot-product path
/// (`model::ops::bf16_gemm`, over all threads).
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

fn bf16_pack_bytes(products: impl IntoIterator<Item = (u64, u64, u64)>) -> u64 {
    products
        .into_iter()
        .map(|(m, k, n)| {
            crate::model::ops::bf16_gemm::product_pack_bytes(m as usize, k as usize, n as usize)
                as u64
        })
        .max()
        .unwrap_or(0)
}

/// What one product of a native layer's linear weight holds besides its operands and output:
/// the packing buffers of the bf16 dot-product path, or the f32 copy of a half or quantized
/// weight (one at a time), or nothing (f32).
fn native_weight_transient_bytes(d: &StepDims) -> u64 {
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
    if d.act_bytes != 4 {
        largest_weight * 4
    } else {
        dequant_transient_bytes(d)
    }
}

/// Parameters of a block (LoRA adapters included, trainable flags applied).
pub fn block_parameters(d: &StepDims, kind: BlockKind) -> BlockParams {
    let full = d.lora.is_none();
    match kind {
        BlockKind::Embeddings => {
            let n = d.vocab * d.hidden;
            BlockParams {
                total: n,
                trainable: if full { n } else { 0 },
                largest_trainable: if full { n } else { 0 },
                ..BlockParams::default()
            }
        }
        BlockKind::Head => {
            let head = if d.tied { 0 } else { d.vocab * d.hidden };
            let n = head + d.hidden;
            BlockParams {
                total: n,
                trainable: if full { n } else { 0 },
                largest_trainable: if full { head.max(d.hidden) } else { 0 },
                ..BlockParams::default()
            }
        }
        BlockKind::Layer(_) => {
            let mut p = BlockParams::default();
            for (name, i, o, bias) in d.linears() {
                let base = i * o + if bias { o } else { 0 };
                p.total += base;
                if let (false, Some(f)) = (full, d.quantize.format_for(i)) {
                    p.quantized += i * o;
                    p.quantized_bytes += f.matrix_bytes(i, o);
                }
                if full {
                    p.trainable += base;
                    p.largest_trainable = p.largest_trainable.max(i * o);
                } else if let Some(r) = d.lora_targets(name) {
                    let adapters = r * (i + o);
                    p.total += adapters;
                    p.trainable += adapters;
                    p.largest_trainable = p.largest_trainable.max(r * i.max(o));
                }
            }
            let norms = 2 * d.hidden;
            p.total += norms;
            if full {
                p.trainable += norms;
            }
            p
        }
    }
}

/// A block's memory during the step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BlockTerms {
    /// Forward tensors kept alive by the autograd graph until the loss is dropped.
    pub kept_bytes: u64,
    /// Extra bytes at the block's forward high-water mark, freed before the next block.
    pub forward_transient_bytes: u64,
    /// Extra bytes at the block's backward high-water mark, above everything kept and
    /// everything stored before the block's backward started (includes the block's
    /// own gradients as they are produced).
    pub backward_transient_bytes: u64,
    /// Gradient bytes that appear in this block's backward and persist (the block's
    /// parameter gradients; for a tied head, the shared matrix's gradient).
    pub backward_grad_bytes: u64,
    /// Bytes that stay in the gradient store after this block's backward until
    /// backward returns, without being a parameter gradient (e.g. the gradient candle
    /// stores for the attention mask, which nothing consumes).
    pub residue_bytes: u64,
    /// Kept bytes this block's backward releases (the loss's cached last chunk).
    pub freed_kept_bytes: u64,
}

impl BlockTerms {
    /// The larger of the two transients.
    pub fn transient_bytes(&self) -> u64 {
        self.forward_transient_bytes
            .max(self.backward_transient_bytes)
    }
}

/// Rows per loss chunk (`LOSS_CHUNK_TOKENS` of the model).
const LOSS_CHUNK_ROWS: u64 = 1024;
/// Per-layer bookkeeping of candle tensors (shapes, strides, op nodes, `Arc`s):
/// measured ≈ 11.7 KB per decoder layer, independent of sizes.
const LAYER_METADATA_BYTES: u64 = 11_720;

/// Bytes the forward graph of one (non-checkpointed) decoder layer keeps.
fn layer_kept_full(d: &StepDims) -> u64 {
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
fn layer_backward_peak(d: &StepDims) -> u64 {
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
fn layer_residue(d: &StepDims) -> u64 {
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

/// Bytes a native layer keeps for its backward (`Saved` in `model::native_layer`): the
/// input-norm output, rotated q and k, v, the attention probabilities, the attention
/// output, the residual after attention and its norm, gate and up; under LoRA also each
/// adapter's scaled down-projection `[n, r]` (dropout masks are drawn again, not kept).
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
fn native_layer_terms(d: &StepDims, params: &BlockParams) -> BlockTerms {
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
    let jit = native_weight_transient_bytes(d);
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
    let bwd = m1.max(m2).max(m3).max(m4) + if half { widened + n * h * 4 } else { 0 } + jit;
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

/// The tables one forward pass shares with its native layers (`NativeCtx` in
/// `model::native_layer`), kept by every layer op until the loss is dropped: the additive
/// attention mask as f32 `[rows, t, t]` — rows = micro-batch, since the trainer always passes
/// the padding mask (`train/step.rs`) — a second one for a sliding window shorter than the
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

/// Memory terms of a block (see the module docs for why each exists).
pub fn block_terms(d: &StepDims, kind: BlockKind) -> BlockTerms {
    let n = d.tokens;
    let a = d.act_bytes;
    let g = d.grad_bytes;
    let (h, v) = (d.hidden, d.vocab);
    let full = d.lora.is_none();
    match kind {
        BlockKind::Embeddings => {
            // index_select output [n, h] (the first layer's input), the native layers' tables.
            let kept = n * h * a + native_ctx_bytes(d);
            if !full {
                // Frozen embeddings: the lookup is not part of the graph.
                return BlockTerms {
                    kept_bytes: kept,
                    ..BlockTerms::default()
                };
            }
            let e = v * h * g;
            if d.native_embedding {
                // The native lookup adds its rows into the side-table gradient in place:
                // tied, into the head's gradient; untied, into one fresh zeroed matrix.
                return BlockTerms {
                    kept_bytes: kept,
                    backward_grad_bytes: if d.tied { 0 } else { e },
                    ..BlockTerms::default()
                };
            }
            BlockTerms {
                kept_bytes: kept,
                forward_transient_bytes: 0,
                // index_add allocates a new [vocab, hidden] tensor while the old sum
                // (tied: the head's gradient; untied: a fresh zero tensor) is alive.
                backward_transient_bytes: if d.tied { e } else { 2 * e } + n * h * a,
                backward_grad_bytes: if d.tied { 0 } else { e },
                residue_bytes: 0,
                freed_kept_bytes: 0,
            }
        }
        BlockKind::Layer(_) if d.native_layers => native_layer_terms(d, &block_parameters(d, kind)),
        BlockKind::Layer(_) => {
            let full_kept = layer_kept_full(d);
            let own_grads = block_parameters(d, kind).trainable * g;
            let dequant = dequant_transient_bytes(d);
            let peak = layer_backward_peak(d) + dequant;
            if d.checkpointing {
                // Kept: the layer's output copy (its input is the previous output).
                let kept = n * h * a + 512;
                // Forward: the layer's graph exists until its output is copied out.
                let fwd = full_kept + n * h * a + dequant;
                // Backward: input copied into a Var, the layer's graph rebuilt,
                // out·grad seeded, then the normal layer backward.
                let bwd = n * h * a + full_kept + n * h * a + peak;
                BlockTerms {
                    kept_bytes: kept,
                    forward_transient_bytes: fwd,
                    backward_transient_bytes: bwd,
                    backward_grad_bytes: own_grads,
                    residue_bytes: 0,
                    freed_kept_bytes: 0,
                }
            } else {
                BlockTerms {
                    kept_bytes: full_kept,
                    forward_transient_bytes: dequant,
                    backward_transient_bytes: peak,
                    backward_grad_bytes: own_grads,
                    residue_bytes: layer_residue(d),
                    freed_kept_bytes: 0,
                }
            }
        }
        BlockKind::Head if d.full_logits => full_logits_head_terms(d),
        BlockKind::Head if d.generic_ops => generic_head_terms(d),
        BlockKind::Head => fused_head_terms(d),
    }
}

/// Logits-sized f32 tensors a preference step's backward adds above the three its graph keeps
/// (see [`full_logits_head_terms`]).
pub(crate) const FULL_LOGITS_BACKWARD_TENSORS: u64 = 7;

/// The bytes of one micro-batch's f32 logits, every position of every row (the unit of the
/// preference head's terms).
pub fn full_logits_bytes(d: &StepDims) -> u64 {
    d.tokens * d.vocab * 4
}

/// The head of a preference step (DPO, IPO, ORPO: `model::preference::model_sequence_logps`
/// on the 2 × micro-batch rows of chosen and rejected answers), the same on the native and
/// the generic path: the final norm's output `[n, h]` goes through the head as it is (a view,
/// no shifted copy), and the logits of **every** position exist at once in f32 — nothing is
/// chunked, and ignored rows are not skipped.
///
/// * Kept until the loss is dropped (candle's graph): the logits (in half precision the
///   head's product in the compute dtype too, and its f32 cast is the logits), `logits − max`
///   and its `exp` (the log-sum-exp's operands), and per position the few `[rows, t]` values
///   of the log-softmax at the target (max, sum, its log, the log-sum-exp, the gathered
///   logit, their difference, the masked product, targets and mask); per pair the stored
///   reference's two log-probabilities as tensors. (The reference for the whole run is 8
///   bytes a pair in a `Vec`: inside the dataset's process term.)
/// * Backward: [`FULL_LOGITS_BACKWARD_TENSORS`] more logits-sized f32 tensors at its peak,
///   candle's zero-then-add on every logits-sized gradient edge (the gather's scatter into a
///   zero tensor, the sum's broadcast gradient, `exp`'s product, both operands of the
///   subtraction, the reshape before the head product). The subtraction's right operand is
///   the detached max broadcast to the logits' shape: its full-size gradient is no graph
///   node, so it stays in candle's store until backward returns (the residue). Measured with the counting allocator
///   (demo model, LoRA r 8, fp32, 2 × 384 and 1 × 256 pairs × tokens): the step's heap
///   peaked 10.11 and 10.09 logits above the weights on the native path, 10.40 and 10.31
///   with `TUNESTUDIO_OPS=generic`, of which 3.11 / 3.09 (3.40 / 3.31) were kept after the
///   forward — the decoder's activations the rest.
/// * A trained head (full fine-tuning): its weight gradient arrives when the logits'
///   gradient is the only logits-sized one left besides the kept three and the max's, as five
///   weight-sized buffers (the module docs).
fn full_logits_head_terms(d: &StepDims) -> BlockTerms {
    let n = d.tokens;
    let (a, g, h, v) = (d.act_bytes, d.grad_bytes, d.hidden, d.vocab);
    let logits = full_logits_bytes(d);
    let half_product = if a == 4 { 0 } else { n * v * a };
    let pairs = d.micro_batch.div_ceil(2);
    let kept = n * h * a + half_product + 3 * logits + n * 9 * 4 + pairs * 2 * 4;
    let full = d.lora.is_none();
    let weight = if full { v * h * g } else { 0 };
    let backward = (FULL_LOGITS_BACKWARD_TENSORS * logits).max(2 * logits + 5 * weight);
    BlockTerms {
        kept_bytes: kept,
        forward_transient_bytes: 0,
        backward_transient_bytes: backward,
        backward_grad_bytes: if full { (v * h + h) * g } else { 0 },
        residue_bytes: logits,
        freed_kept_bytes: 0,
    }
}

/// The head on the fused CPU path (`ops::linear_cross_entropy`).
fn fused_head_terms(d: &StepDims) -> BlockTerms {
    let n = d.tokens;
    let (a, g, h, v) = (d.act_bytes, d.grad_bytes, d.hidden, d.vocab);
    let full = d.lora.is_none();
    let rows = d.micro_batch * d.seq_len.saturating_sub(1);
    // Logits exist for the trained rows only, chunk by chunk.
    let active = d.loss_rows.min(rows);
    let chunk = active.min(LOSS_CHUNK_ROWS);
    let mut kept = n * h * a; // final norm output
    if d.micro_batch > 1 {
        // hidden[:, :-1] is not contiguous for b > 1: the reshape copies it.
        kept += rows * h * a;
    }
    if a != 4 {
        // The fused loss works in f32: casts of the hidden rows and of lm_head (a bf16 head
        // on the bf16 dot-product path is multiplied as it is).
        kept += rows * h * 4 + if d.bf16_products { 0 } else { v * h * 4 };
    }
    // The bf16 path's packing buffers, while a chunk's logits (forward) or its gradients
    // (backward) are computed.
    let packing = if d.bf16_products {
        bf16_pack_bytes([(chunk, h, v), (chunk, v, h), (v, chunk, h)])
    } else {
        0
    };
    // Loss op state: labels (i64) and active rows (usize) copies, per-row
    // log-sum-exp and loss (f32), and the last chunk's probabilities (each
    // chunk's logits are a buffer of exactly its rows). Another micro-batch of
    // fewer trained rows may leave a larger last chunk, so past one chunk the
    // plan keeps a whole one.
    let last_rows = if active == 0 {
        0
    } else if active > LOSS_CHUNK_ROWS && d.loss_rows < rows {
        chunk
    } else {
        active - (active.div_ceil(chunk) - 1) * chunk
    };
    let last_chunk = last_rows * v * 4;
    kept += rows * (8 + 8 + 4 + 4) + last_chunk;
    // Backward of the fused loss: while it runs, its f32 weight and hidden
    // gradients next to the cached last chunk (kept); once it returns the chunk
    // is gone and candle adds each gradient it receives into a zero tensor. With
    // native layers the weight gradient goes to the side table instead (one
    // weight-sized buffer, not three).
    // A frozen head (LoRA) gets no weight gradient at all.
    let head_w = if full { v * h * 4 } else { 0 };
    let in_op = head_w + rows * h * 4 + rows * 8 + chunk * h * 4 + packing;
    let weight_bufs = if d.native_embedding { 1 } else { 3 };
    // In half precision the side table gets the gradient rounded inside the op, while
    // its f32 original is still alive.
    let rounded = if d.native_embedding && g != 4 && full {
        v * h * g
    } else {
        0
    };
    let f32_head =
        in_op.max((weight_bufs * head_w + rounded + 2 * rows * h * 4).saturating_sub(last_chunk));
    // Earlier chunks are recomputed in full-size buffers once the cached last one is
    // consumed.
    let multi_chunk_extra = (chunk - last_rows) * v * 4;
    // Half precision: the f32 gradients flow back through the casts
    // (f32 sum + half cast + zero + sum), after the chunk is freed.
    let cast_back = if a != 4 && full && !d.native_embedding {
        (v * h * (4 + 3 * g)).saturating_sub(last_chunk)
    } else {
        0
    };
    // The norm's and lm_head's gradients appear here; with tied embeddings the
    // shared matrix's gradient first appears here too.
    let head_grads = if full { (v * h + h) * g } else { 0 };
    BlockTerms {
        kept_bytes: kept,
        forward_transient_bytes: packing,
        backward_transient_bytes: f32_head.max(cast_back) + multi_chunk_extra,
        backward_grad_bytes: head_grads,
        residue_bytes: 0,
        freed_kept_bytes: last_chunk,
    }
}

/// The head on the generic path (`ops::generic::linear_cross_entropy`): between forward and
/// backward the loss keeps one log-sum-exp (and label) per row; each chunk's `[rows × vocab]`
/// f32 logits exist only inside the op.
fn generic_head_terms(d: &StepDims) -> BlockTerms {
    let n = d.tokens;
    let (a, g, h, v) = (d.act_bytes, d.grad_bytes, d.hidden, d.vocab);
    let rows = d.micro_batch * d.seq_len.saturating_sub(1);
    // Only the rows that carry a label go through the head (`loss::causal_lm_loss` selects
    // them first when some are ignored).
    let active = d.loss_rows.min(rows);
    let selected = active < rows;
    let chunk = active.min(LOSS_CHUNK_ROWS);
    let full = d.lora.is_none();
    // Final norm output; log-sum-exp and target per active row.
    let mut kept = n * h * a + active * (4 + 4);
    if d.micro_batch > 1 {
        // hidden[:, :-1] is not contiguous for b > 1: the reshape copies it.
        kept += rows * h * a;
    }
    if selected {
        // The selected rows (a copy, the op's input) and their indices.
        kept += active * (h * a + 4);
    }
    // Forward of a chunk: the logits, logits − max and their exp live until the
    // log-sum-exp statement ends (f32; in half precision the matmul output is cast first).
    let logits_f32 = chunk * v * 4;
    let forward = (3 * logits_f32).max(chunk * v * (a + 4));
    // Backward of a chunk: the same three while the probabilities are formed, then at most
    // two (probabilities and their gradient). The rows' gradient is assembled from its
    // chunks (a cat), and candle adds it into a zero tensor.
    let rows_grad = active * h * a;
    // In half precision the chunk's matmul output lives until its f32 cast's statement ends.
    let half_logits = if a == 4 { 0 } else { chunk * v * a };
    let chunk_peak = 3 * logits_f32 + half_logits + rows_grad;
    let mut rows_end = 3 * rows_grad;
    if selected {
        // The selection's backward adds the rows' gradient into a zero tensor of every row
        // (`index_add`: the zeros and the sum, next to the selected rows' gradient).
        rows_end = rows_end.max(rows_grad + 2 * rows * h * a);
    }
    // A trained head: its gradient per chunk (summed over chunks), then candle's zero-then-add
    // into the store, three weight-sized buffers at once.
    let weight = if full { 3 * v * h * g } else { 0 };
    let head_grads = if full { (v * h + h) * g } else { 0 };
    BlockTerms {
        kept_bytes: kept,
        forward_transient_bytes: forward,
        backward_transient_bytes: chunk_peak.max(rows_end).max(weight + rows_grad),
        backward_grad_bytes: head_grads,
        residue_bytes: 0,
        freed_kept_bytes: 0,
    }
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
