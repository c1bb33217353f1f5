//! One decoder layer as a single CPU op with a hand-written backward: full fine-tuning and
//! LoRA on a frozen base, in f32, bf16 or f16.
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
//! run on the bf16 kernel measured fastest on this CPU ([`kernel_path`]: AMX tiles or the bf16
//! dot-product instruction, the other operand rounded to bf16, sums in f32, as PyTorch's
//! autocast does); where widening the weight and multiplying in f32 was faster, and for f16,
//! each product widens its weight and multiplies in f32.
//!
//! The graph path in `decoder.rs` stays the reference and covers what this op does not: GPUs. The fixture parity tests (logits, loss, every gradient, AdamW steps) run
//! through this op, and `tests/it/model_native_layer.rs` compares it with the graph path on
//! every architecture, with and without adapters and dropout.

use super::decoder::{dropout_mask, lock, lora_dropout_seed, Ctx, Layer, Linear};
use super::ops::kernel_path;
use super::ops::matmul::{sgemm, sgemm_new, sgemm_on, MatRef};
use super::ops::simd::widen_par as widen;
use super::ops::{
    contiguous_slice, cpu_storage_to_tensor, exp_shift_sum_in_place, min_rows_per_task, rms_norm,
    row_max, silu_mul, tensor_to_f32_vec,
};
use candle_core::quantized::QTensor;
use candle_core::{bail, CpuStorage, CustomOp2, DType, Layout, Result, Shape, Storage, Tensor};
use half::{bf16, f16};
use rayon::prelude::*;
use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Parameter gradients produced outside candle's graph, by HF name (merged by
/// [`super::CausalLm::backward`]).
pub(crate) type SideGrads = Arc<Mutex<HashMap<String, Tensor>>>;

/// Adds `g` to the side-table gradient of `name` (inserts it when there is none yet).
pub(crate) fn add_side_grad(
    side: &mut HashMap<String, Tensor>,
    name: &str,
    g: Tensor,
) -> Result<()> {
    let g = match side.remove(name) {
        Some(prev) => (prev + g)?,
        None => g,
    };
    side.insert(name.to_string(), g);
    Ok(())
}

const OP: &str = "native decoder layer";

/// What every native layer of one forward pass reads: rope tables and masks as `f32`.
pub(crate) struct NativeCtx {
    /// `[t, head_dim]`.
    cos: Vec<f32>,
    sin: Vec<f32>,
    /// `[mask_rows, t, t]` additive masks (`mask_rows` is 1 or the batch size).
    mask: Vec<f32>,
    sliding_mask: Option<Vec<f32>>,
    mask_rows: usize,
    /// Whether the adapters add their update ([`Ctx::adapters`]).
    adapters: bool,
}

impl NativeCtx {
    fn new(ctx: &Ctx) -> Result<Self> {
        let mask_rows = ctx.mask.dims().first().copied().unwrap_or(1);
        Ok(Self {
            cos: tensor_to_f32_vec(&ctx.cos, OP)?,
            sin: tensor_to_f32_vec(&ctx.sin, OP)?,
            mask: tensor_to_f32_vec(&ctx.mask, OP)?,
            sliding_mask: match &ctx.sliding_mask {
                Some(m) => Some(tensor_to_f32_vec(m, OP)?),
                None => None,
            },
            mask_rows,
            adapters: ctx.adapters,
        })
    }

    fn mask_for(&self, layer: &Layer) -> &[f32] {
        match (&self.sliding_mask, layer.sliding) {
            (Some(m), true) => m,
            _ => &self.mask,
        }
    }
}

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

/// The HF name of a trainable tensor of `layer` (None when it is frozen).
fn name_of<'a>(layer: &'a Layer, t: &Tensor) -> Option<&'a str> {
    layer
        .trainable
        .iter()
        .find(|(_, v)| v.id() == t.id())
        .map(|(n, _)| n.as_str())
}

/// Whether `layer` can run on `h` as one native op: CPU, f32, fused kernels on, and every
/// weight, bias, norm and adapter factor of the layer a dense `f32` CPU tensor.
pub(crate) fn applies(layer: &Layer, ctx: &Ctx, h: &Tensor) -> bool {
    if ctx.ops != super::kernels::OpsKind::Fused
        || !h.device().is_cpu()
        || h.dtype() != layer_dtype(layer)
        || h.rank() != 3
    {
        return false;
    }
    layer_qualifies(layer)
}

/// Whether every tensor of `layer` is a dense `f32` CPU tensor. Which of them are trained is
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

/// Sizes of one layer call.
#[derive(Clone, Copy)]
struct Dims {
    b: usize,
    t: usize,
    /// Tokens (`b × t`).
    n: usize,
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    eps: f32,
}

impl Dims {
    fn q_dim(&self) -> usize {
        self.heads * self.head_dim
    }
    fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }
}

/// A LoRA adapter's factors as slices: `a` is `[r, in]`, `b` is `[out, r]` (PEFT's layout).
struct LoraLin<'a> {
    a: &'a [f32],
    b: &'a [f32],
    r: usize,
    /// `alpha / r`.
    scale: f32,
    dropout: f64,
    /// Tells this layer's dropout mask apart from the others'.
    key: u64,
}

impl LoraLin<'_> {
    /// The dropout mask of this adapter's input in the pass seeded `seed` (None: no dropout).
    fn mask(&self, n: usize, inp: usize, seed: Option<u64>) -> Option<Vec<f32>> {
        match seed {
            Some(seed) if self.dropout > 0.0 => Some(dropout_mask(
                n * inp,
                self.dropout,
                lora_dropout_seed(seed, self.key),
            )),
            _ => None,
        }
    }

    /// `s · dropout(x) Aᵀ` `[n, r]`: the adapter's down-projection, scaled (what the
    /// forward adds through `B` and what `B`'s gradient needs).
    fn down(&self, x: &[f32], n: usize, inp: usize, mask: Option<&[f32]>) -> Result<Vec<f32>> {
        let a = MatRef::row_major(self.a, self.r, inp).t();
        let mut xs = match mask {
            Some(m) => sgemm_new(MatRef::row_major(&masked(x, m), n, inp), a)?,
            None => sgemm_new(MatRef::row_major(x, n, inp), a)?,
        };
        xs.iter_mut().for_each(|v| *v *= self.scale);
        Ok(xs)
    }
}

/// `x ⊙ mask`.
fn masked(x: &[f32], mask: &[f32]) -> Vec<f32> {
    let mut out = x.to_vec();
    out.par_chunks_mut(1 << 16)
        .zip(mask.par_chunks(1 << 16))
        .for_each(|(o, m)| o.iter_mut().zip(m).for_each(|(o, m)| *o *= m));
    out
}

/// A linear layer's tensors as slices: `w` is `[out, in]` row-major.
struct Lin<'a> {
    w: WeightRef<'a>,
    b: Option<&'a [f32]>,
    out: usize,
    inp: usize,
    /// Whether the weight (bias) is trained: a frozen one gets no gradient computed.
    train_w: bool,
    train_b: bool,
    lora: Option<LoraLin<'a>>,
}

/// The gradients of one linear layer's trained tensors.
#[derive(Default)]
struct LinGrads {
    w: Option<Vec<f32>>,
    b: Option<Vec<f32>>,
    lora_a: Option<Vec<f32>>,
    lora_b: Option<Vec<f32>>,
}

/// A linear layer's weight: `f32` data read in place (and `bf16` data too, by a bf16 kernel
/// where that is this CPU's fastest path: `Lin::bf16_weight`); otherwise `bf16` / `f16`
/// data, widened for each product that reads it; or a quantized frozen base weight (QLoRA),
/// dequantized likewise. The
/// f32 copy is dropped after the product, so at most one weight's copy exists at a time, and
/// it is still in cache when gemm reads it (widening the whole layer up front held 4 bytes per
/// parameter of the layer: 870 MB for a 7B model's layer).
#[derive(Clone, Copy)]
enum WeightRef<'a> {
    Dense(&'a [f32]),
    Bf16(&'a [bf16]),
    F16(&'a [f16]),
    Quantized(&'a QTensor),
}

/// The weight data of a storage, without copying it.
fn weight_ref<'a>(cpu: &'a CpuStorage, layout: &Layout) -> Result<WeightRef<'a>> {
    Ok(match cpu {
        CpuStorage::F32(_) => WeightRef::Dense(contiguous_slice::<f32>(cpu, layout, OP)?),
        CpuStorage::BF16(_) => WeightRef::Bf16(contiguous_slice::<bf16>(cpu, layout, OP)?),
        CpuStorage::F16(_) => WeightRef::F16(contiguous_slice::<f16>(cpu, layout, OP)?),
        _ => bail!("{OP}: expected f32, bf16 or f16 weights (internal error: use the graph path)"),
    })
}

impl Lin<'_> {
    /// Runs `f` on the weight as a row-major `[out, in]` matrix.
    fn with_w<R>(&self, f: impl FnOnce(MatRef<'_>) -> Result<R>) -> Result<R> {
        match self.w {
            WeightRef::Dense(w) => f(MatRef::row_major(w, self.out, self.inp)),
            WeightRef::Bf16(w) => f(MatRef::row_major(&widen(w), self.out, self.inp)),
            WeightRef::F16(w) => f(MatRef::row_major(&widen(w), self.out, self.inp)),
            WeightRef::Quantized(q) => {
                let dense = q.dequantize(&candle_core::Device::Cpu)?;
                with_f32(&dense, |w| f(MatRef::row_major(w, self.out, self.inp)))
            }
        }
    }

    /// The weight as bf16 when its products run on a bf16 kernel (see [`kernel_path`]); None
    /// when they run in f32.
    fn bf16_weight(&self) -> Option<MatRef<'_, bf16>> {
        match self.w {
            WeightRef::Bf16(w) if kernel_path::bf16_products() => {
                Some(MatRef::row_major(w, self.out, self.inp))
            }
            _ => None,
        }
    }

    /// `x @ wᵀ (+ b) (+ s · dropout(x) Aᵀ Bᵀ)` for `n` rows; also returns the adapter's
    /// scaled down-projection `[n, r]`, which backward needs.
    fn forward(&self, x: &[f32], n: usize, seed: Option<u64>) -> Result<(Vec<f32>, LoraSaved)> {
        let x_m = MatRef::row_major(x, n, self.inp);
        let mut y = match self.bf16_weight() {
            Some(w) => kernel_path::gemm_new(x_m, w.t())?,
            None => self.with_w(|w| sgemm_new(x_m, w.t()))?,
        };
        if let Some(b) = self.b {
            y.par_chunks_mut(min_rows_per_task(self.out) * self.out)
                .for_each(|rows| {
                    for row in rows.chunks_exact_mut(self.out) {
                        for (y, b) in row.iter_mut().zip(b) {
                            *y += b;
                        }
                    }
                });
        }
        let Some(l) = &self.lora else {
            return Ok((y, None));
        };
        let mask = l.mask(n, self.inp, seed);
        let xs = l.down(x, n, self.inp, mask.as_deref())?;
        let b = MatRef::row_major(l.b, self.out, l.r).t();
        sgemm(&mut y, self.out, 1, true, MatRef::row_major(&xs, n, l.r), b)?;
        Ok((y, Some(xs)))
    }

    /// Gradients of [`Lin::forward`] given `dy`, for the trained tensors only; the input
    /// gradient (through the weight and the adapter) is added into `dx`, or becomes `dx` when
    /// it is still `None`.
    fn backward(
        &self,
        dy: &[f32],
        x: &[f32],
        xs: Option<&[f32]>,
        n: usize,
        seed: Option<u64>,
        dx: &mut Option<Vec<f32>>,
    ) -> Result<LinGrads> {
        let dy_m = MatRef::row_major(dy, n, self.out);
        let mut grads = LinGrads::default();
        let x_m = MatRef::row_major(x, n, self.inp);
        if let Some(w) = self.bf16_weight() {
            // A bf16 weight's gradient is rounded to bf16 anyway: its operands may be too.
            if self.train_w {
                grads.w = Some(kernel_path::gemm_new(dy_m.t(), x_m)?);
            }
            match dx {
                Some(dx) => kernel_path::gemm(dx, self.inp, true, dy_m, w)?,
                None => *dx = Some(kernel_path::gemm_new(dy_m, w)?),
            }
        } else {
            if self.train_w {
                grads.w = Some(sgemm_new(dy_m.t(), x_m)?);
            }
            self.with_w(|w| {
                match dx {
                    Some(dx) => sgemm(dx, self.inp, 1, true, dy_m, w)?,
                    None => *dx = Some(sgemm_new(dy_m, w)?),
                }
                Ok(())
            })?;
        }
        if self.train_b && self.b.is_some() {
            let mut s = vec![0f32; self.out];
            for row in dy.chunks_exact(self.out) {
                for (s, v) in s.iter_mut().zip(row) {
                    *s += v;
                }
            }
            grads.b = Some(s);
        }
        if let (Some(l), Some(xs), Some(dx)) = (&self.lora, xs, dx.as_mut()) {
            self.adapter_backward(l, dy, x, xs, n, seed, dx, &mut grads)?;
        }
        Ok(grads)
    }

    /// The adapter's part of the backward: `dB = dyᵀ · xs`, `dA = (s · dy B)ᵀ · dropout(x)`,
    /// and `dx += ((s · dy B) A) ⊙ mask`.
    #[allow(clippy::too_many_arguments)]
    fn adapter_backward(
        &self,
        l: &LoraLin<'_>,
        dy: &[f32],
        x: &[f32],
        xs: &[f32],
        n: usize,
        seed: Option<u64>,
        dx: &mut [f32],
        grads: &mut LinGrads,
    ) -> Result<()> {
        let dy_m = MatRef::row_major(dy, n, self.out);
        let r = l.r;
        grads.lora_b = Some(sgemm_new(dy_m.t(), MatRef::row_major(xs, n, r))?);
        let mut dys = sgemm_new(dy_m, MatRef::row_major(l.b, self.out, r))?;
        dys.iter_mut().for_each(|v| *v *= l.scale);
        let dys_m = MatRef::row_major(&dys, n, r);
        let a = MatRef::row_major(l.a, r, self.inp);
        match l.mask(n, self.inp, seed) {
            Some(mask) => {
                let xd = masked(x, &mask);
                grads.lora_a = Some(sgemm_new(dys_m.t(), MatRef::row_major(&xd, n, self.inp))?);
                drop(xd);
                let mut dxd = sgemm_new(dys_m, a)?;
                dxd.iter_mut().zip(&mask).for_each(|(g, m)| *g *= m);
                add_into(dx, &dxd);
            }
            None => {
                grads.lora_a = Some(sgemm_new(dys_m.t(), MatRef::row_major(x, n, self.inp))?);
                sgemm(dx, self.inp, 1, true, dys_m, a)?;
            }
        }
        Ok(())
    }
}

/// What a linear layer's forward keeps for backward beyond its input: the adapter's scaled
/// down-projection `[n, r]` (None without an adapter).
type LoraSaved = Option<Vec<f32>>;

/// The input gradient a chain of [`Lin::backward`] calls produced.
fn input_grad(dx: Option<Vec<f32>>) -> Result<Vec<f32>> {
    dx.ok_or_else(|| {
        candle_core::Error::Msg(format!("{OP}: input gradient missing (internal error)"))
    })
}

/// The layer's parameters as slices (storages read-locked while they are in use).
struct Params<'a> {
    norm_in: &'a [f32],
    norm_post: &'a [f32],
    /// q, k, v, o, gate, up, down.
    lin: [Lin<'a>; 7],
}

/// Every tensor of `layer` in the order [`with_params`] reads them: the two norms, the seven
/// weights, then per linear layer its bias and its adapter factors, where present.
fn layer_tensors(layer: &Layer) -> Vec<&Tensor> {
    let lins = linears(layer);
    let mut tensors = vec![&layer.input_norm, &layer.post_norm];
    tensors.extend(lins.iter().map(|l| &l.w));
    for l in lins {
        tensors.extend(l.b.as_ref());
        if let Some(f) = &l.lora {
            tensors.extend([&f.a, &f.b]);
        }
    }
    tensors
}

/// `adapters` false (the adapters switched off) leaves every adapter out of the products.
fn with_params<R>(
    layer: &Layer,
    adapters: bool,
    f: impl FnOnce(&Params<'_>) -> Result<R>,
) -> Result<R> {
    let lins = linears(layer);
    let tensors = layer_tensors(layer);
    let guards: Vec<_> = tensors.iter().map(|t| t.storage_and_layout()).collect();
    let mut cows = Vec::with_capacity(guards.len());
    let mut weights = Vec::with_capacity(7);
    for (k, (storage, layout)) in guards.iter().enumerate() {
        let Storage::Cpu(cpu) = &**storage else {
            bail!("{OP}: runs on the CPU only (internal error: use the graph path)")
        };
        if (2..9).contains(&k) {
            // The seven weights stay in their dtype: each product widens its own (or reads a
            // bf16 one as it is).
            weights.push(weight_ref(cpu, layout)?);
            cows.push(Cow::Borrowed(&[][..]));
        } else {
            cows.push(as_f32(cpu, layout)?);
        }
    }
    let slices: Vec<&[f32]> = cows.iter().map(|c| c.as_ref()).collect();
    let mut rest = slices[9..].iter().copied();
    let mut next = || {
        rest.next().ok_or_else(|| {
            candle_core::Error::Msg(format!("{OP}: a tensor of the layer is missing"))
        })
    };
    let mut lin = Vec::with_capacity(7);
    for (i, l) in lins.iter().enumerate() {
        let (out, inp) = weight_dims(l)?;
        let b = match l.b {
            Some(_) => Some(next()?),
            None => None,
        };
        let lora = match &l.lora {
            Some(_) if !adapters => {
                // Read past the factors: the slices are in order.
                next()?;
                next()?;
                None
            }
            Some(f) => Some(LoraLin {
                a: next()?,
                b: next()?,
                r: f.a.dim(0)?,
                scale: f.scale as f32,
                dropout: f.dropout,
                key: l.key,
            }),
            None => None,
        };
        lin.push(Lin {
            w: match (&l.quant, weights.get(i)) {
                (Some(q), _) => WeightRef::Quantized(q),
                (None, Some(w)) => *w,
                (None, None) => bail!("{OP}: a weight of the layer is missing"),
            },
            b,
            out,
            inp,
            train_w: name_of(layer, &l.w).is_some(),
            train_b: l.b.as_ref().is_some_and(|b| name_of(layer, b).is_some()),
            lora,
        });
    }
    let Ok(lin) = <[Lin<'_>; 7]>::try_from(lin) else {
        bail!("{OP}: expected seven linear layers")
    };
    f(&Params {
        norm_in: slices[0],
        norm_post: slices[1],
        lin,
    })
}

/// What forward keeps for backward.
struct Saved {
    /// Input-norm output `[n, hidden]`.
    x1: Vec<f32>,
    /// Rotated queries `[n, heads·head_dim]`, rotated keys and values `[n, kv_heads·head_dim]`.
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    /// Attention probabilities `[b, heads, t, t]`.
    probs: Vec<f32>,
    /// Keys per causal block (see [`block_key_cols`]).
    key_cols: Vec<usize>,
    /// Attention output before `o_proj` `[n, heads·head_dim]`.
    o: Vec<f32>,
    /// Residual stream after attention, and its post-norm output `[n, hidden]`.
    h2: Vec<f32>,
    x2: Vec<f32>,
    /// Gate and up projections `[n, intermediate]`.
    g: Vec<f32>,
    u: Vec<f32>,
    /// Per linear layer (q, k, v, o, gate, up, down): the adapter's scaled down-projection
    /// `[n, r]` (LoRA only). The dropout masks are drawn again from their seed instead of
    /// kept: `n × in` floats each would be the largest thing LoRA keeps.
    lora: [LoraSaved; 7],
}

/// Rotates (or, with `backward`, un-rotates) every head of token-major rows `[n, heads, d]`.
fn rope_rows(
    x: &mut [f32],
    heads: usize,
    d: usize,
    t: usize,
    cos: &[f32],
    sin: &[f32],
    backward: bool,
) {
    let half = d / 2;
    let width = heads * d;
    if width == 0 {
        return;
    }
    x.par_chunks_mut(width)
        .with_min_len(min_rows_per_task(width))
        .enumerate()
        .for_each(|(row, xr)| {
            let pos = row % t;
            let (c, s) = (&cos[pos * d..(pos + 1) * d], &sin[pos * d..(pos + 1) * d]);
            let (c1, c2) = c.split_at(half);
            let (s1, s2) = s.split_at(half);
            for head in xr.chunks_exact_mut(d) {
                let (x1, x2) = head.split_at_mut(half);
                for j in 0..half {
                    let (a, b) = (x1[j], x2[j]);
                    if backward {
                        x1[j] = a * c1[j] + b * s2[j];
                        x2[j] = b * c2[j] - a * s1[j];
                    } else {
                        x1[j] = a * c1[j] - b * s1[j];
                        x2[j] = b * c2[j] + a * s2[j];
                    }
                }
            }
        });
}

/// Query rows per block of the causal attention: block `[r0, r1)` only meets keys `< r1`
/// (the mask always hides later keys), which skips about 40 % of the score matrix at t = 256.
const CAUSAL_BLOCK: usize = 64;

/// The keys each causal block of each batch row attends to: `r1` normally; all `t` when a
/// query row of the block is fully masked (left padding), because its softmax is then uniform
/// over every key, as in transformers (all scores equal the mask's minimum).
fn block_key_cols(d: &Dims, mask: &[f32], mask_rows: usize) -> Vec<usize> {
    let t = d.t;
    let mut cols = Vec::new();
    for bi in 0..d.b {
        let m = &mask[(if mask_rows == 1 { 0 } else { bi }) * t * t..][..t * t];
        for r0 in (0..t).step_by(CAUSAL_BLOCK) {
            let r1 = (r0 + CAUSAL_BLOCK).min(t);
            let fully_masked =
                (r0..r1).any(|i| m[i * t..=i * t + i].iter().all(|&x| x <= f32::MIN / 2.0));
            cols.push(if fully_masked { t } else { r1 });
        }
    }
    cols
}

/// Softmax attention of every (batch, head): returns probabilities `[b, heads, t, t]` (zero
/// above the diagonal blocks) and the output `[n, heads·head_dim]`.
fn attention_forward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    d: &Dims,
    mask: &[f32],
    mask_rows: usize,
    key_cols: &[usize],
) -> Result<(Vec<f32>, Vec<f32>)> {
    let (t, hd) = (d.t, d.head_dim);
    let (qd, kvd) = (d.q_dim(), d.kv_dim());
    let rep = d.heads / d.kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let mut probs = vec![0f32; d.b * d.heads * t * t];
    let outs: Vec<Vec<f32>> = probs
        .par_chunks_mut(t * t)
        .enumerate()
        .map(|(bh, p)| -> Result<Vec<f32>> {
            let (bi, hi) = (bh / d.heads, bh % d.heads);
            let kvh = hi / rep;
            let m = &mask[(if mask_rows == 1 { 0 } else { bi }) * t * t..][..t * t];
            let mut oh = vec![0f32; t * hd];
            let blocks = t.div_ceil(CAUSAL_BLOCK);
            for (blk, r0) in (0..t).step_by(CAUSAL_BLOCK).enumerate() {
                let rows = (r0 + CAUSAL_BLOCK).min(t) - r0;
                let r1 = key_cols[bi * blocks + blk];
                let qb = block_view(q, d, bi, r0, rows, hi * hd, qd);
                let kb = block_view(k, d, bi, 0, r1, kvh * hd, kvd);
                let vb = block_view(v, d, bi, 0, r1, kvh * hd, kvd);
                let pb = &mut p[r0 * t..];
                sgemm_on(pb, t, 1, false, qb, kb.t(), false)?;
                for (i, row) in pb.chunks_mut(t).take(rows).enumerate() {
                    let row = &mut row[..r1];
                    for (s, m) in row.iter_mut().zip(&m[(r0 + i) * t..]) {
                        *s = *s * scale + m;
                    }
                    let max = row_max(row);
                    if max == f32::NEG_INFINITY {
                        row.fill(0.0);
                        continue;
                    }
                    let inv = 1.0 / exp_shift_sum_in_place(row, max);
                    for s in row.iter_mut() {
                        *s *= inv;
                    }
                }
                let pm = prob_block(&p[r0 * t..], rows, r1, t);
                sgemm_on(&mut oh[r0 * hd..], hd, 1, false, pm, vb, false)?;
            }
            Ok(oh)
        })
        .collect::<Result<_>>()?;
    let mut o = vec![0f32; d.n * qd];
    for (bh, oh) in outs.iter().enumerate() {
        let (bi, hi) = (bh / d.heads, bh % d.heads);
        for (i, src) in oh.chunks_exact(hd).enumerate() {
            let at = (bi * t + i) * qd + hi * hd;
            o[at..at + hd].copy_from_slice(src);
        }
    }
    Ok((probs, o))
}

/// Rows `[r0, r0 + rows)` of one head of token-major rows of width `width`.
fn block_view<'a>(
    data: &'a [f32],
    d: &Dims,
    batch: usize,
    r0: usize,
    rows: usize,
    col: usize,
    width: usize,
) -> MatRef<'a> {
    MatRef {
        data: &data[(batch * d.t + r0) * width + col..],
        rows,
        cols: d.head_dim,
        row_stride: width,
        col_stride: 1,
    }
}

/// The `rows × cols` top-left block of a row-major matrix with `stride` columns.
fn prob_block(data: &[f32], rows: usize, cols: usize, stride: usize) -> MatRef<'_> {
    MatRef {
        data,
        rows,
        cols,
        row_stride: stride,
        col_stride: 1,
    }
}

/// Gradients of [`attention_forward`] w.r.t. the rotated queries, keys and values.
fn attention_backward(s: &Saved, d_o: &[f32], d: &Dims) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
    let (t, hd) = (d.t, d.head_dim);
    let (qd, kvd) = (d.q_dim(), d.kv_dim());
    let rep = d.heads / d.kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    // Per (batch, head): dq of the head and its contributions to dk and dv of its kv head.
    let parts: Vec<[Vec<f32>; 3]> = (0..d.b * d.heads)
        .into_par_iter()
        .map(|bh| -> Result<[Vec<f32>; 3]> {
            let (bi, hi) = (bh / d.heads, bh % d.heads);
            let kvh = hi / rep;
            let p = &s.probs[bh * t * t..][..t * t];
            let mut dp = vec![0f32; CAUSAL_BLOCK.min(t) * t];
            let mut dq = vec![0f32; t * hd];
            let mut dk = vec![0f32; t * hd];
            let mut dv = vec![0f32; t * hd];
            let blocks = t.div_ceil(CAUSAL_BLOCK);
            for (blk, r0) in (0..t).step_by(CAUSAL_BLOCK).enumerate() {
                let rows = (r0 + CAUSAL_BLOCK).min(t) - r0;
                let r1 = s.key_cols[bi * blocks + blk];
                let dob = block_view(d_o, d, bi, r0, rows, hi * hd, qd);
                let qb = block_view(&s.q, d, bi, r0, rows, hi * hd, qd);
                let kb = block_view(&s.k, d, bi, 0, r1, kvh * hd, kvd);
                let vb = block_view(&s.v, d, bi, 0, r1, kvh * hd, kvd);
                let pm = prob_block(&p[r0 * t..], rows, r1, t);
                // dP = dO Vᵀ and dV += Pᵀ dO.
                sgemm_on(&mut dp, r1, 1, false, dob, vb.t(), false)?;
                sgemm_on(&mut dv, hd, 1, true, pm.t(), dob, false)?;
                // Softmax backward, then the 1/√d scaling of the scores.
                for (i, dr) in dp.chunks_exact_mut(r1).take(rows).enumerate() {
                    let pr = &p[(r0 + i) * t..][..r1];
                    let dot: f32 = dr.iter().zip(pr).map(|(a, b)| a * b).sum();
                    for (g, &y) in dr.iter_mut().zip(pr) {
                        *g = y * (*g - dot) * scale;
                    }
                }
                let ds = MatRef::row_major(&dp[..rows * r1], rows, r1);
                // dQ = dS K and dK += dSᵀ Q.
                sgemm_on(&mut dq[r0 * hd..], hd, 1, false, ds, kb, false)?;
                sgemm_on(&mut dk, hd, 1, true, ds.t(), qb, false)?;
            }
            Ok([dq, dk, dv])
        })
        .collect::<Result<_>>()?;
    let mut dq = vec![0f32; d.n * qd];
    let mut dk = vec![0f32; d.n * kvd];
    let mut dv = vec![0f32; d.n * kvd];
    for (bh, [pq, pk, pv]) in parts.iter().enumerate() {
        let (bi, hi) = (bh / d.heads, bh % d.heads);
        let kvh = hi / rep;
        for i in 0..t {
            let row = bi * t + i;
            let src = i * hd..(i + 1) * hd;
            let qa = row * qd + hi * hd;
            dq[qa..qa + hd].copy_from_slice(&pq[src.clone()]);
            let ka = row * kvd + kvh * hd;
            for ((k, v), (a, b)) in dk[ka..ka + hd]
                .iter_mut()
                .zip(&mut dv[ka..ka + hd])
                .zip(pk[src.clone()].iter().zip(&pv[src]))
            {
                *k += a;
                *v += b;
            }
        }
    }
    Ok((dq, dk, dv))
}

fn add_into(dst: &mut [f32], src: &[f32]) {
    dst.par_chunks_mut(1 << 16)
        .zip(src.par_chunks(1 << 16))
        .for_each(|(d, s)| {
            for (d, s) in d.iter_mut().zip(s) {
                *d += s;
            }
        });
}

/// The layer's forward pass on `h` `[n, hidden]`: returns the output and what backward needs.
/// `seed` seeds the adapters' dropout masks (None: no dropout).
fn forward(
    p: &Params<'_>,
    d: &Dims,
    h: &[f32],
    nc: &NativeCtx,
    mask: &[f32],
    seed: Option<u64>,
) -> Result<(Vec<f32>, Saved)> {
    let [lq, lk, lv, lo, lg, lu, ld] = &p.lin;
    let n = d.n;
    let x1 = rms_norm::forward::<f32>(h, p.norm_in, d.eps);
    let (mut q, sq) = lq.forward(&x1, n, seed)?;
    let (mut k, sk) = lk.forward(&x1, n, seed)?;
    let (v, sv) = lv.forward(&x1, n, seed)?;
    rope_rows(&mut q, d.heads, d.head_dim, d.t, &nc.cos, &nc.sin, false);
    rope_rows(&mut k, d.kv_heads, d.head_dim, d.t, &nc.cos, &nc.sin, false);
    let key_cols = block_key_cols(d, mask, nc.mask_rows);
    let (probs, o) = attention_forward(&q, &k, &v, d, mask, nc.mask_rows, &key_cols)?;
    let (mut h2, so) = lo.forward(&o, n, seed)?;
    add_into(&mut h2, h);
    let x2 = rms_norm::forward::<f32>(&h2, p.norm_post, d.eps);
    let (g, sg) = lg.forward(&x2, n, seed)?;
    let (u, su) = lu.forward(&x2, n, seed)?;
    let a = silu_mul::forward::<f32>(&g, &u);
    let (mut out, sd) = ld.forward(&a, n, seed)?;
    drop(a);
    add_into(&mut out, &h2);
    Ok((
        out,
        Saved {
            x1,
            q,
            k,
            v,
            probs,
            key_cols,
            o,
            h2,
            x2,
            g,
            u,
            lora: [sq, sk, sv, so, sg, su, sd],
        },
    ))
}

/// Which tensor of the layer a gradient belongs to.
#[derive(Clone, Copy)]
enum Slot {
    NormIn,
    NormPost,
    /// Weight, bias, adapter A and adapter B of linear layer `i` (q, k, v, o, gate, up, down).
    Weight(usize),
    Bias(usize),
    LoraA(usize),
    LoraB(usize),
}

/// A parameter gradient on its way to the side table.
struct ParamGrad {
    slot: Slot,
    grad: Vec<f32>,
}

/// Collects the gradients of the layer's trained tensors as backward produces them.
#[derive(Default)]
struct GradList(Vec<ParamGrad>);

impl GradList {
    fn push(&mut self, slot: Slot, grad: Option<Vec<f32>>) {
        if let Some(grad) = grad {
            self.0.push(ParamGrad { slot, grad });
        }
    }

    fn push_lin(&mut self, i: usize, g: LinGrads) {
        self.push(Slot::Weight(i), g.w);
        self.push(Slot::Bias(i), g.b);
        self.push(Slot::LoraA(i), g.lora_a);
        self.push(Slot::LoraB(i), g.lora_b);
    }
}

/// The layer's backward pass: returns the input gradient and the gradient of every trained
/// tensor (frozen weights get none).
fn backward(
    p: &Params<'_>,
    d: &Dims,
    h: &[f32],
    s: &Saved,
    dout: &[f32],
    nc: &NativeCtx,
    seed: Option<u64>,
) -> Result<(Vec<f32>, Vec<ParamGrad>)> {
    let [lq, lk, lv, lo, lg, lu, ld] = &p.lin;
    let n = d.n;
    let sv = |i: usize| s.lora[i].as_deref();
    let mut grads = GradList::default();
    // MLP: out = h2 + down(silu(gate(x2)) * up(x2)).
    let a = silu_mul::forward::<f32>(&s.g, &s.u);
    let mut da = None;
    grads.push_lin(6, ld.backward(dout, &a, sv(6), n, seed, &mut da)?);
    drop(a);
    let (dg, du) = silu_mul::backward::<f32>(&s.g, &s.u, &input_grad(da)?);
    let mut dx2 = None;
    grads.push_lin(4, lg.backward(&dg, &s.x2, sv(4), n, seed, &mut dx2)?);
    grads.push_lin(5, lu.backward(&du, &s.x2, sv(5), n, seed, &mut dx2)?);
    drop((dg, du));
    let (mut dh2, dw_post) =
        rms_norm::backward::<f32>(&s.h2, &input_grad(dx2)?, p.norm_post, d.eps);
    grads.push(Slot::NormPost, Some(dw_post));
    add_into(&mut dh2, dout);
    // Attention: h2 = h + o_proj(attention(rope(q(x1)), rope(k(x1)), v(x1))).
    let mut d_o = None;
    grads.push_lin(3, lo.backward(&dh2, &s.o, sv(3), n, seed, &mut d_o)?);
    let (mut dq, mut dk, dv) = attention_backward(s, &input_grad(d_o)?, d)?;
    rope_rows(&mut dq, d.heads, d.head_dim, d.t, &nc.cos, &nc.sin, true);
    rope_rows(&mut dk, d.kv_heads, d.head_dim, d.t, &nc.cos, &nc.sin, true);
    let mut dx1 = None;
    grads.push_lin(0, lq.backward(&dq, &s.x1, sv(0), n, seed, &mut dx1)?);
    grads.push_lin(1, lk.backward(&dk, &s.x1, sv(1), n, seed, &mut dx1)?);
    grads.push_lin(2, lv.backward(&dv, &s.x1, sv(2), n, seed, &mut dx1)?);
    drop((dq, dk, dv));
    let (mut dh, dw_in) = rms_norm::backward::<f32>(h, &input_grad(dx1)?, p.norm_in, d.eps);
    grads.push(Slot::NormIn, Some(dw_in));
    add_into(&mut dh, &dh2);
    Ok((dh, grads.0))
}

/// The decoder layer op: forward ran before the op was applied; backward runs the native
/// backward (recomputing forward first when activations were not kept).
struct NativeLayerOp {
    layer: Arc<Layer>,
    nc: Arc<NativeCtx>,
    dims: Dims,
    /// The forward output; `cpu_fwd` hands it over once.
    out: Mutex<Option<Vec<f32>>>,
    /// Activations for backward (None under activation checkpointing: recomputed).
    saved: Mutex<Option<Saved>>,
    side: SideGrads,
    /// The layer's dtype: its output and gradients are rounded to it.
    dtype: DType,
    /// Seeds the adapters' dropout masks (None: no dropout).
    dropout_seed: Option<u64>,
}

/// Runs `layer` on `h` `[b, t, hidden]` as one native op. With `keep_activations` false
/// (activation checkpointing) only the input stays alive and backward recomputes the layer.
pub(crate) fn native_layer(
    layer: &Arc<Layer>,
    nc: &Arc<NativeCtx>,
    h: &Tensor,
    side: &SideGrads,
    keep_activations: bool,
    dropout_seed: Option<u64>,
) -> Result<Tensor> {
    let (b, t, hidden) = h.dims3()?;
    let dims = Dims {
        b,
        t,
        n: b * t,
        hidden,
        heads: layer.num_heads,
        kv_heads: layer.num_kv_heads,
        head_dim: layer.head_dim,
        eps: layer.eps as f32,
    };
    check_dims(layer, &dims)?;
    let h = h.contiguous()?;
    let (out, saved) = with_f32(&h, |hs| {
        with_params(layer, nc.adapters, |p| {
            forward(p, &dims, hs, nc, nc.mask_for(layer), dropout_seed)
        })
    })?;
    let op = NativeLayerOp {
        layer: layer.clone(),
        nc: nc.clone(),
        dims,
        out: Mutex::new(Some(out)),
        saved: Mutex::new(keep_activations.then_some(saved)),
        side: side.clone(),
        dtype: layer_dtype(layer),
        dropout_seed,
    };
    // The anchor (a zero Var) puts the node in the graph even when `h` carries no gradient.
    h.apply_op2(layer.anchor.as_tensor(), op)
}

/// The per-forward-pass tables the native layers read.
pub(crate) fn native_ctx(ctx: &Ctx) -> Result<Arc<NativeCtx>> {
    Ok(Arc::new(NativeCtx::new(ctx)?))
}

fn check_dims(layer: &Layer, d: &Dims) -> Result<()> {
    let want = [
        (d.q_dim(), d.hidden),
        (d.kv_dim(), d.hidden),
        (d.kv_dim(), d.hidden),
        (d.hidden, d.q_dim()),
    ];
    let inter = weight_dims(&layer.gate)?.0;
    let want = [
        want[0],
        want[1],
        want[2],
        want[3],
        (inter, d.hidden),
        (inter, d.hidden),
        (d.hidden, inter),
    ];
    for (l, (out, inp)) in linears(layer).iter().zip(want) {
        let got = weight_dims(l)?;
        if got != (out, inp) {
            bail!(
                "{OP}: weight of shape {got:?} where [{out}, {inp}] was expected (config and weights disagree)"
            );
        }
    }
    if d.kv_heads == 0 || !d.heads.is_multiple_of(d.kv_heads) || !d.head_dim.is_multiple_of(2) {
        bail!(
            "{OP}: {} heads over {} kv heads of width {} cannot be grouped",
            d.heads,
            d.kv_heads,
            d.head_dim
        );
    }
    Ok(())
}

/// `(out, in)` of a linear layer's weight, dense or quantized.
fn weight_dims(l: &Linear) -> Result<(usize, usize)> {
    match &l.quant {
        Some(q) => q.shape().dims2(),
        None => l.w.dims2(),
    }
}

/// The tensor of `layer` a gradient slot stands for.
fn slot_tensor(layer: &Layer, slot: Slot) -> Option<&Tensor> {
    let lins = linears(layer);
    match slot {
        Slot::NormIn => Some(&layer.input_norm),
        Slot::NormPost => Some(&layer.post_norm),
        Slot::Weight(i) => Some(&lins.get(i)?.w),
        Slot::Bias(i) => lins.get(i)?.b.as_ref(),
        Slot::LoraA(i) => lins.get(i)?.lora.as_ref().map(|f| &f.a),
        Slot::LoraB(i) => lins.get(i)?.lora.as_ref().map(|f| &f.b),
    }
}

/// The contiguous data of a CPU storage as `f32`: borrowed when it is `f32`, widened from
/// `bf16` / `f16` otherwise (half-precision layers compute in f32 on the half values: the
/// weights and the layer input are exactly what the graph path reads, and the layer output
/// and every gradient are rounded back to the half type).
fn as_f32<'a>(cpu: &'a CpuStorage, layout: &Layout) -> Result<Cow<'a, [f32]>> {
    Ok(match cpu {
        CpuStorage::F32(_) => Cow::Borrowed(contiguous_slice::<f32>(cpu, layout, OP)?),
        CpuStorage::BF16(_) => Cow::Owned(widen(contiguous_slice::<bf16>(cpu, layout, OP)?)),
        CpuStorage::F16(_) => Cow::Owned(widen(contiguous_slice::<f16>(cpu, layout, OP)?)),
        _ => bail!("{OP}: expected f32, bf16 or f16 data (internal error: use the graph path)"),
    })
}

/// `v` as a CPU storage of `dtype` (f32 moved, half types rounded to nearest even).
fn narrow(v: Vec<f32>, dtype: DType) -> Result<CpuStorage> {
    use super::ops::simd::narrow_par as round;
    Ok(match dtype {
        DType::F32 => CpuStorage::F32(v),
        DType::BF16 => CpuStorage::BF16(round(&v)),
        DType::F16 => CpuStorage::F16(round(&v)),
        other => bail!("{OP}: cannot produce {other:?} (internal error)"),
    })
}

/// `v` as a CPU tensor of `dtype` and `shape`.
fn narrow_tensor(v: Vec<f32>, dtype: DType, shape: &Shape) -> Result<Tensor> {
    cpu_storage_to_tensor(narrow(v, dtype)?, shape)
}

/// Runs `f` on the data of a contiguous CPU tensor, as `f32`.
fn with_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> Result<R>) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        bail!("{OP}: runs on the CPU only (internal error: use the graph path)")
    };
    f(&as_f32(cpu, layout)?)
}

impl CustomOp2 for NativeLayerOp {
    fn name(&self) -> &'static str {
        "native-decoder-layer"
    }

    fn cpu_fwd(
        &self,
        _s1: &CpuStorage,
        l1: &Layout,
        _s2: &CpuStorage,
        _l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        match lock(&self.out).take() {
            Some(out) => Ok((narrow(out, self.dtype)?, l1.shape().clone())),
            None => bail!("{OP}: forward ran twice (internal error)"),
        }
    }

    fn bwd(
        &self,
        arg: &Tensor,
        _anchor: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let d = self.dims;
        let layer = &self.layer;
        let arg = arg.contiguous()?;
        let grad = grad.contiguous()?;
        let saved = lock(&self.saved).take();
        let (dh, grads) = with_f32(&arg, |h| {
            with_f32(&grad, |g| {
                with_params(layer, self.nc.adapters, |p| {
                    let recomputed;
                    let s = match &saved {
                        Some(s) => s,
                        None => {
                            let mask = self.nc.mask_for(layer);
                            recomputed = forward(p, &d, h, &self.nc, mask, self.dropout_seed)?.1;
                            &recomputed
                        }
                    };
                    backward(p, &d, h, s, g, &self.nc, self.dropout_seed)
                })
            })
        })?;
        drop(saved);
        let mut side = lock(&self.side);
        for ParamGrad { slot, grad } in grads {
            let Some(t) = slot_tensor(layer, slot) else {
                bail!("{OP}: gradient for a tensor the layer does not have (internal error)")
            };
            // Gradients of frozen norms are computed with the input gradient but not kept.
            let Some(name) = name_of(layer, t) else {
                continue;
            };
            let g = narrow_tensor(grad, t.dtype(), t.shape())?;
            add_side_grad(&mut side, name, g)?;
        }
        drop(side);
        let dh = narrow_tensor(dh, arg.dtype(), arg.shape())?;
        Ok((Some(dh), None))
    }
}
