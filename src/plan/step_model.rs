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
//!
//! Layout: this file holds the step's dimensions, the blocks' parameters and [`block_terms`];
//! the terms are in `graph_layer`, `native_layer`, `head` and `transients`.

use super::{PlanRequest, Precision, Quantization, ShardMode, Strategy};
use std::fmt;

mod graph_layer;
mod head;
mod native_layer;
mod tensors;
mod transients;

pub(crate) use head::f32_head_pack_bytes;
pub use head::full_logits_bytes;
pub(crate) use head::full_logits_tensors;
pub use native_layer::native_ctx_bytes;
pub use tensors::{block_tensors, TensorSize};
pub use transients::{
    accumulated_head_transient, accumulated_sum_temporaries, gemm_workspace_bytes,
    gradient_tap_transient_bytes, host_gemm_workspace_bytes, optimizer_transient_bytes,
};

use graph_layer::{layer_backward_peak, layer_kept_full, layer_residue};
use head::{completions_head_terms, full_logits_head_terms, fused_head_terms, generic_head_terms};
use native_layer::{bf16_pack_bytes, native_layer_terms};

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
    /// Rows per forward and backward pass: the micro-batch, or a GRPO pass's share of it
    /// ([`PlanRequest::rows_per_pass`]).
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
    /// bf16 weights are multiplied on one of the CPU's bf16 kernels (`model::ops::bf16_gemm`:
    /// native kernels, bf16 weights, AVX512-BF16 dot products or AMX tiles): packing buffers
    /// instead of each weight's f32 copy, and no f32 cast of the lm head.
    pub bf16_products: bool,
    /// The device-generic ops run (`model::ops::generic`: any GPU, or `TUNESTUDIO_OPS=generic`):
    /// the loss is the generic chunked op and AdamW's state is updated with tensor ops.
    pub generic_ops: bool,
    /// The loss takes the full logits of every row (preference training,
    /// [`super::HeadLoss::FullLogits`]): see [`full_logits_head_terms`].
    pub full_logits: bool,
    /// Positions (rows × positions per row) whose f32 logits a full-logits head holds:
    /// every token for preference pairs, the completions' for GRPO.
    pub logit_positions: u64,
    /// GRPO's head ([`super::HeadLoss::Completions`]): the completion positions' hidden rows
    /// are cut out (a copy), divided by the temperature, and go through the loss's chunked
    /// op (see `head::completions_head_terms`).
    pub sampled_logits: bool,
}

impl StepDims {
    /// Derives the sizes of a request.
    pub fn new(req: &PlanRequest) -> Self {
        let m = &req.model;
        let act = req.precision.compute_bytes();
        // Dynamic padding: the longest micro-batch of the data, when it is known.
        let seq_len = req.planned_seq_len();
        // A GRPO micro-batch split by `generations_per_micro_step` runs a pass at a time: the
        // activations and the head are a pass's.
        let rows = req.rows_per_pass();
        let tokens = (rows * seq_len) as u64;
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
            micro_batch: rows as u64,
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
            checkpointing: req.recomputes_layers(),
            lora: req
                .lora
                .as_ref()
                .map(|l| (l.r as u64, l.target_modules.clone())),
            embeddings_trainable: req.lora.is_none(),
            quantize,
            // Quantized layers run as graphs of ops (`native_layer::layer_qualifies`), and so
            // do ZeRO-3's gathered layers.
            native_layers: all_cpu
                && !(req.strategy == Strategy::Sharded && req.shard == ShardMode::Everything),
            native_embedding: all_cpu && req.lora.is_none(),
            in_place_optimizer: all_cpu,
            bf16_products: all_cpu
                && matches!(req.precision, Precision::Bf16Mixed | Precision::Bf16)
                && crate::model::ops::kernel_path::bf16_products(),
            generic_ops,
            full_logits: req.head_loss.is_full_logits(),
            logit_positions: (rows * req.head_loss.logit_positions(seq_len)) as u64,
            sampled_logits: matches!(req.head_loss, super::HeadLoss::Completions { .. }),
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
        BlockKind::Head if d.sampled_logits => completions_head_terms(d),
        BlockKind::Head if d.full_logits => full_logits_head_terms(d),
        BlockKind::Head if d.generic_ops => generic_head_terms(d),
        BlockKind::Head => fused_head_terms(d),
    }
}
