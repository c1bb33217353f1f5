//! One decoder layer as a single CPU op with a hand-written backward: full fine-tuning and
//! LoRA on a frozen base, in f32, bf16 or f16.
//!
//! Layout: [`linear`] is one linear layer with its LoRA adapter (forward, backward, the weight
//! in its stored dtype); [`attention`] the rotary embedding and the causal softmax attention
//! (forward, backward); [`layer_pass`] the whole layer's forward and backward, and what the
//! forward saves for the backward; [`layer_slices`] reads the layer's tensors as slices;
//! [`custom_op`] is the candle custom op that puts the layer in the graph; [`pass_tables`] the
//! rope tables and masks one forward pass shares; [`dims`] a call's sizes; [`f32_data`] reads
//! data as `f32` and rounds results back. This file says which layers qualify.
//!
//! Through candle's autograd a layer's backward allocates a zero tensor and a sum for every
//! gradient edge (weights included), copies the transposed weight gradients of `x @ wᵀ` into
//! contiguous ones, and runs a few dozen small element-wise ops on candle's pool; the profile of
//! the SmolLM2-135M step put about a third of the step there (memset, memmove and
//! `binary_map_vec_par` next to gemm). Here every matmul goes to `gemm` with the strides it
//! needs (weights are read in place, attention heads are strided views of the projections), each
//! weight gradient is written once, into the buffer the optimizer reads, and the element-wise
//! work is the fused kernels of [`super::ops`].
//!
//! Under LoRA the base weights are frozen: the op computes no gradient for them (a third of a
//! full fine-tuning step's products), only the input gradient through them, plus the adapter
//! path `s · dropout(x) Aᵀ Bᵀ` and the gradients of `A` and `B`. Per adapted linear layer it
//! keeps only the `[n, r]` down-projection; dropout masks are drawn again from their seed.
//!
//! Half-precision layers compute in f32 on their half values (input widened once per call,
//! output and gradients rounded back). candle's CPU matmul in bf16 ran the SmolLM2-135M step
//! at ≈ 20 tokens/s against ≈ 150 in f32 (issue #23's table). The products of a bf16 weight
//! run on the bf16 kernel measured fastest on this CPU ([`super::ops::kernel_path`]: AMX tiles
//! or the bf16 dot-product instruction, the other operand rounded to bf16, sums in f32, as
//! PyTorch's autocast does); where widening the weight and multiplying in f32 was faster, and
//! for f16, each product widens its weight and multiplies in f32.
//!
//! The graph path (`decoder/layer.rs`) stays the reference and covers what this op does not:
//! GPUs. The fixture parity tests (logits, loss, every gradient, AdamW steps) run through this
//! op, and `tests/it/model_native_layer.rs` compares it with the graph path on every
//! architecture, with and without adapters and dropout. The op reads the decoder's layer types
//! from [`super::layer_weights`] and imports nothing from the decoder (`tests/it/layering.rs`).

mod attention;
mod custom_op;
mod dims;
mod f32_data;
mod layer_pass;
mod layer_slices;
mod linear;
mod pass_tables;

pub(crate) use custom_op::run;
pub(crate) use pass_tables::PassTables;

use super::kernels::OpsKind;
use super::layer_weights::{Layer, Linear};
use candle_core::{DType, Tensor};

/// The op's name in its error messages.
const OP_NAME: &str = "native decoder layer";

/// The seven linear layers of `layer` in the order the op reads them: q, k, v, o, gate, up,
/// down.
fn linears(layer: &Layer) -> [&Linear; 7] {
    [
        &layer.q,
        &layer.k,
        &layer.v,
        &layer.o,
        &layer.gate,
        &layer.up,
        &layer.down,
    ]
}

/// Whether `t` is a contiguous CPU tensor of `dtype`.
fn dense(t: &Tensor, dtype: DType) -> bool {
    t.dtype() == dtype && t.device().is_cpu() && t.is_contiguous()
}

/// The dtype of the layer's tensors (they all share it when the layer qualifies).
fn layer_dtype(layer: &Layer) -> DType {
    layer.input_norm.dtype()
}

/// Whether `layer` can run on `h` as one native op: CPU, fused kernels on (`ops`), and every
/// weight, bias, norm and adapter factor of the layer a dense CPU tensor of `h`'s dtype.
pub(crate) fn applies(layer: &Layer, ops: OpsKind, h: &Tensor) -> bool {
    if ops != OpsKind::Fused
        || !h.device().is_cpu()
        || h.dtype() != layer_dtype(layer)
        || h.rank() != 3
    {
        return false;
    }
    layer_qualifies(layer)
}

/// Whether every tensor of `layer` is a dense CPU tensor of one dtype the fused kernels take
/// (f32, bf16, f16), a quantized base weight excepted (it must sit on the CPU). Which of them are trained is
/// free: full fine-tuning trains all of them; LoRA trains only the adapter factors, and the
/// op then computes no gradient for the frozen weights at all (only the input gradient through
/// them).
pub(crate) fn layer_qualifies(layer: &Layer) -> bool {
    let mut tensors = vec![&layer.input_norm, &layer.post_norm];
    for l in linears(layer) {
        match &l.quant {
            // A quantized base weight is dequantized on the CPU for each product.
            Some(q) if !q.device().is_cpu() => return false,
            Some(_) => {}
            None => tensors.push(&l.w),
        }
        tensors.extend(l.b.as_ref());
        if let Some(f) = &l.lora {
            tensors.push(&f.a);
            tensors.push(&f.b);
        }
    }
    let dtype = layer_dtype(layer);
    super::ops::fused_dtype(dtype) && tensors.iter().all(|t| dense(t, dtype))
}
