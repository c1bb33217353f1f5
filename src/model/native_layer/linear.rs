//! One linear layer with its LoRA adapter, on slices: `x @ wᵀ (+ b) (+ s · dropout(x) Aᵀ
//! Bᵀ)`, its backward for the trained tensors only, and the weight read in its stored dtype.

use super::super::layer_weights::{dropout_mask, lora_dropout_seed};
use super::super::ops::kernel_path;
use super::super::ops::matmul::{sgemm, sgemm_new, MatRef};
use super::super::ops::simd::widen_par as widen;
use super::super::ops::{contiguous_slice, min_rows_per_task};
use super::f32_data::{add_into, masked, with_f32};
use super::OP_NAME;
use candle_core::quantized::QTensor;
use candle_core::{bail, CpuStorage, Layout, Result};
use half::{bf16, f16};
use rayon::prelude::*;

/// A LoRA adapter's factors as slices: `a` is `[rank, in]`, `b` is `[out, rank]` (PEFT's
/// layout).
pub(super) struct LoraWeights<'a> {
    pub a: &'a [f32],
    pub b: &'a [f32],
    /// The adapter's rank `r`.
    pub rank: usize,
    /// `alpha / r`.
    pub scale: f32,
    /// Dropout probability on the adapter's input.
    pub dropout: f64,
    /// Tells this layer's dropout mask apart from the others'.
    pub dropout_key: u64,
}

impl LoraWeights<'_> {
    /// The dropout mask of this adapter's input in the pass seeded `seed` (None: no dropout).
    fn mask(&self, n: usize, inp: usize, seed: Option<u64>) -> Option<Vec<f32>> {
        match seed {
            Some(seed) if self.dropout > 0.0 => Some(dropout_mask(
                n * inp,
                self.dropout,
                lora_dropout_seed(seed, self.dropout_key),
            )),
            _ => None,
        }
    }

    /// `s · dropout(x) Aᵀ` `[n, r]`: the adapter's down-projection, scaled (what the
    /// forward adds through `B` and what `B`'s gradient needs).
    fn down(&self, x: &[f32], n: usize, inp: usize, mask: Option<&[f32]>) -> Result<Vec<f32>> {
        let a = MatRef::row_major(self.a, self.rank, inp).t();
        let mut xs = match mask {
            Some(m) => sgemm_new(MatRef::row_major(&masked(x, m), n, inp), a)?,
            None => sgemm_new(MatRef::row_major(x, n, inp), a)?,
        };
        xs.iter_mut().for_each(|v| *v *= self.scale);
        Ok(xs)
    }
}

/// A linear layer's tensors as slices: `weight` is `[out_dim, in_dim]` row-major.
pub(super) struct LinearWeights<'a> {
    pub weight: WeightRef<'a>,
    pub bias: Option<&'a [f32]>,
    pub out_dim: usize,
    pub in_dim: usize,
    /// Whether the weight (bias) is trained: a frozen one gets no gradient computed.
    pub trains_weight: bool,
    pub trains_bias: bool,
    /// The adapter (None without one, or while the adapters are switched off).
    pub lora: Option<LoraWeights<'a>>,
}

/// The gradients of one linear layer's trained tensors (None: frozen, or absent).
#[derive(Default)]
pub(super) struct LinearGrads {
    pub weight: Option<Vec<f32>>,
    pub bias: Option<Vec<f32>>,
    pub lora_a: Option<Vec<f32>>,
    pub lora_b: Option<Vec<f32>>,
}

/// A linear layer's weight: `f32` data read in place (and `bf16` data too, by a bf16 kernel
/// where that is this CPU's fastest path: `LinearWeights::bf16_weight`); otherwise `bf16` /
/// `f16` data, widened for each product that reads it; or a quantized frozen base weight
/// (QLoRA), dequantized likewise. The f32 copy is dropped after the product, so at most one weight's copy exists at a time, and
/// it is still in cache when gemm reads it (widening the whole layer up front held 4 bytes per
/// parameter of the layer: 870 MB for a 7B model's layer).
#[derive(Clone, Copy)]
pub(super) enum WeightRef<'a> {
    Dense(&'a [f32]),
    Bf16(&'a [bf16]),
    F16(&'a [f16]),
    Quantized(&'a QTensor),
}

/// The weight data of a storage, without copying it.
pub(super) fn weight_ref<'a>(cpu: &'a CpuStorage, layout: &Layout) -> Result<WeightRef<'a>> {
    Ok(match cpu {
        CpuStorage::F32(_) => WeightRef::Dense(contiguous_slice::<f32>(cpu, layout, OP_NAME)?),
        CpuStorage::BF16(_) => WeightRef::Bf16(contiguous_slice::<bf16>(cpu, layout, OP_NAME)?),
        CpuStorage::F16(_) => WeightRef::F16(contiguous_slice::<f16>(cpu, layout, OP_NAME)?),
        _ => bail!(
            "{OP_NAME}: expected f32, bf16 or f16 weights (internal error: use the graph path)"
        ),
    })
}

impl LinearWeights<'_> {
    /// Runs `f` on the weight as a row-major `[out, in]` matrix.
    fn with_f32_weight<R>(&self, f: impl FnOnce(MatRef<'_>) -> Result<R>) -> Result<R> {
        match self.weight {
            WeightRef::Dense(w) => f(MatRef::row_major(w, self.out_dim, self.in_dim)),
            WeightRef::Bf16(w) => f(MatRef::row_major(&widen(w), self.out_dim, self.in_dim)),
            WeightRef::F16(w) => f(MatRef::row_major(&widen(w), self.out_dim, self.in_dim)),
            WeightRef::Quantized(q) => {
                let dense = q.dequantize(&candle_core::Device::Cpu)?;
                with_f32(&dense, |w| {
                    f(MatRef::row_major(w, self.out_dim, self.in_dim))
                })
            }
        }
    }

    /// The weight as bf16 when its products run on a bf16 kernel (see [`kernel_path`]); None
    /// when they run in f32.
    fn bf16_weight(&self) -> Option<MatRef<'_, bf16>> {
        match self.weight {
            WeightRef::Bf16(w) if kernel_path::bf16_products() => {
                Some(MatRef::row_major(w, self.out_dim, self.in_dim))
            }
            _ => None,
        }
    }

    /// `x @ wᵀ (+ b) (+ s · dropout(x) Aᵀ Bᵀ)` for `n` rows; also returns the adapter's
    /// scaled down-projection `[n, r]`, which backward needs.
    pub(super) fn forward(
        &self,
        x: &[f32],
        n: usize,
        seed: Option<u64>,
    ) -> Result<(Vec<f32>, LoraDown)> {
        let x_m = MatRef::row_major(x, n, self.in_dim);
        let mut y = match self.bf16_weight() {
            Some(w) => kernel_path::gemm_new(x_m, w.t())?,
            None => self.with_f32_weight(|w| sgemm_new(x_m, w.t()))?,
        };
        if let Some(b) = self.bias {
            y.par_chunks_mut(min_rows_per_task(self.out_dim) * self.out_dim)
                .for_each(|rows| {
                    for row in rows.chunks_exact_mut(self.out_dim) {
                        for (y, b) in row.iter_mut().zip(b) {
                            *y += b;
                        }
                    }
                });
        }
        let Some(l) = &self.lora else {
            return Ok((y, None));
        };
        let mask = l.mask(n, self.in_dim, seed);
        let xs = l.down(x, n, self.in_dim, mask.as_deref())?;
        let b = MatRef::row_major(l.b, self.out_dim, l.rank).t();
        sgemm(
            &mut y,
            self.out_dim,
            1,
            true,
            MatRef::row_major(&xs, n, l.rank),
            b,
        )?;
        Ok((y, Some(xs)))
    }

    /// Gradients of [`LinearWeights::forward`] given `dy`, for the trained tensors only; the
    /// input gradient (through the weight and the adapter) is added into `dx`, or becomes `dx`
    /// when it is still `None`.
    pub(super) fn backward(
        &self,
        dy: &[f32],
        x: &[f32],
        xs: Option<&[f32]>,
        n: usize,
        seed: Option<u64>,
        dx: &mut Option<Vec<f32>>,
    ) -> Result<LinearGrads> {
        let dy_m = MatRef::row_major(dy, n, self.out_dim);
        let mut grads = LinearGrads::default();
        let x_m = MatRef::row_major(x, n, self.in_dim);
        if let Some(w) = self.bf16_weight() {
            // A bf16 weight's gradient is rounded to bf16 anyway: its operands may be too.
            if self.trains_weight {
                grads.weight = Some(kernel_path::gemm_new(dy_m.t(), x_m)?);
            }
            match dx {
                Some(dx) => kernel_path::gemm(dx, self.in_dim, true, dy_m, w)?,
                None => *dx = Some(kernel_path::gemm_new(dy_m, w)?),
            }
        } else {
            if self.trains_weight {
                grads.weight = Some(sgemm_new(dy_m.t(), x_m)?);
            }
            self.with_f32_weight(|w| {
                match dx {
                    Some(dx) => sgemm(dx, self.in_dim, 1, true, dy_m, w)?,
                    None => *dx = Some(sgemm_new(dy_m, w)?),
                }
                Ok(())
            })?;
        }
        if self.trains_bias && self.bias.is_some() {
            let mut s = vec![0f32; self.out_dim];
            for row in dy.chunks_exact(self.out_dim) {
                for (s, v) in s.iter_mut().zip(row) {
                    *s += v;
                }
            }
            grads.bias = Some(s);
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
        l: &LoraWeights<'_>,
        dy: &[f32],
        x: &[f32],
        xs: &[f32],
        n: usize,
        seed: Option<u64>,
        dx: &mut [f32],
        grads: &mut LinearGrads,
    ) -> Result<()> {
        let dy_m = MatRef::row_major(dy, n, self.out_dim);
        let r = l.rank;
        grads.lora_b = Some(sgemm_new(dy_m.t(), MatRef::row_major(xs, n, r))?);
        let mut dys = sgemm_new(dy_m, MatRef::row_major(l.b, self.out_dim, r))?;
        dys.iter_mut().for_each(|v| *v *= l.scale);
        let dys_m = MatRef::row_major(&dys, n, r);
        let a = MatRef::row_major(l.a, r, self.in_dim);
        match l.mask(n, self.in_dim, seed) {
            Some(mask) => {
                let xd = masked(x, &mask);
                grads.lora_a = Some(sgemm_new(
                    dys_m.t(),
                    MatRef::row_major(&xd, n, self.in_dim),
                )?);
                drop(xd);
                let mut dxd = sgemm_new(dys_m, a)?;
                dxd.iter_mut().zip(&mask).for_each(|(g, m)| *g *= m);
                add_into(dx, &dxd);
            }
            None => {
                grads.lora_a = Some(sgemm_new(dys_m.t(), MatRef::row_major(x, n, self.in_dim))?);
                sgemm(dx, self.in_dim, 1, true, dys_m, a)?;
            }
        }
        Ok(())
    }
}

/// What a linear layer's forward keeps for backward beyond its input: the adapter's scaled
/// down-projection `[n, r]` (None without an adapter).
pub(super) type LoraDown = Option<Vec<f32>>;
