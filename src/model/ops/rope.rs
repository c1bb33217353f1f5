//! Rotary position embedding (HF `rotate_half` convention) with a backward for the input.

use super::{
    composite, contiguous_slice, cpu_storage_to_tensor, dispatch_float, min_rows_per_task,
    tensor_to_f32_vec, use_fused, with_cpu, Elem,
};
use candle_core::{bail, CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};
use rayon::prelude::*;
use std::sync::Arc;

const OP: &str = "rope";

/// `x * cos + rotate_half(x) * sin` with `rotate_half(x) = cat(-x2, x1)` (x1/x2: first/second half
/// of the last dimension), exactly like HF's `apply_rotary_pos_emb`.
///
/// - `x`: `[b, heads, t, d]` (`d` even);
/// - `cos`, `sin`: `[t, d]` (shared by the batch) or `[b, t, d]` (positions per sequence), full
///   width, i.e. HF's `emb = cat(freqs, freqs)`. Any float dtype; they are read as `f32`.
///
/// Differentiable w.r.t. `x` only (`cos`/`sin` are treated as constants).
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (b, _heads, t, d) = match x.dims() {
        &[b, h, t, d] => (b, h, t, d),
        dims => bail!("rope: input must be [batch, heads, seq, head_dim], got shape {dims:?}"),
    };
    if d % 2 != 0 {
        bail!("rope: head_dim {d} must be even");
    }
    let per_batch = match cos.dims() {
        [ct, cd] if *ct == t && *cd == d => false,
        [cb, ct, cd] if *cb == b && *ct == t && *cd == d => true,
        dims => bail!(
            "rope: cos has shape {dims:?}; expected [{t}, {d}] or [{b}, {t}, {d}] for an input of shape {:?}",
            x.dims()
        ),
    };
    if sin.dims() != cos.dims() {
        bail!(
            "rope: sin has shape {:?} but cos has {:?}; they must match",
            sin.dims(),
            cos.dims()
        );
    }
    if !use_fused(&[x, cos, sin]) {
        return composite::rope(x, cos, sin);
    }
    let x = x.contiguous()?;
    let op = Rope {
        cos: Arc::new(tensor_to_f32_vec(cos, OP)?),
        sin: Arc::new(tensor_to_f32_vec(sin, OP)?),
        t,
        d,
        per_batch,
        rows_per_batch: x.dims()[1] * t,
    };
    x.apply_op1(op)
}

struct Rope {
    cos: Arc<Vec<f32>>,
    sin: Arc<Vec<f32>>,
    t: usize,
    d: usize,
    per_batch: bool,
    /// heads × t: rows of length `d` per batch element.
    rows_per_batch: usize,
}

impl Rope {
    /// Applies the rotation (`backward = false`) or its transpose (`backward = true`).
    fn run<T: Elem>(&self, x: &[T], backward: bool) -> Vec<T> {
        let d = self.d;
        let half = d / 2;
        let mut out = vec![T::ZERO; x.len()];
        if d == 0 {
            return out;
        }
        let rows_per_task = min_rows_per_task(d);
        out.par_chunks_mut(rows_per_task * d)
            .zip(x.par_chunks(rows_per_task * d))
            .enumerate()
            .for_each(|(task, (o_rows, x_rows))| {
                let first_row = task * rows_per_task;
                for (i, (o, xr)) in o_rows
                    .chunks_exact_mut(d)
                    .zip(x_rows.chunks_exact(d))
                    .enumerate()
                {
                    let row = first_row + i;
                    let ti = row % self.t;
                    let cs_row = if self.per_batch {
                        (row / self.rows_per_batch) * self.t + ti
                    } else {
                        ti
                    };
                    let c = &self.cos[cs_row * d..(cs_row + 1) * d];
                    let s = &self.sin[cs_row * d..(cs_row + 1) * d];
                    let (x1, x2) = xr.split_at(half);
                    let (o1, o2) = o.split_at_mut(half);
                    let (c1, c2) = c.split_at(half);
                    let (s1, s2) = s.split_at(half);
                    if !backward {
                        // out1 = x1*c1 - x2*s1 ; out2 = x2*c2 + x1*s2
                        for j in 0..half {
                            let (a, bb) = (x1[j].f(), x2[j].f());
                            o1[j] = T::of(a * c1[j] - bb * s1[j]);
                            o2[j] = T::of(bb * c2[j] + a * s2[j]);
                        }
                    } else {
                        // Transpose of the map above:
                        // gx1 = g1*c1 + g2*s2 ; gx2 = g2*c2 - g1*s1
                        for j in 0..half {
                            let (g1, g2) = (x1[j].f(), x2[j].f());
                            o1[j] = T::of(g1 * c1[j] + g2 * s2[j]);
                            o2[j] = T::of(g2 * c2[j] - g1 * s1[j]);
                        }
                    }
                }
            });
        out
    }
}

impl CustomOp1 for Rope {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        fn run<T: Elem>(op: &Rope, s: &CpuStorage, l: &Layout) -> Result<CpuStorage> {
            let x = contiguous_slice::<T>(s, l, OP)?;
            Ok(T::to_cpu_storage_owned(op.run::<T>(x, false)))
        }
        let out = dispatch_float!(storage, OP, run::<T>(self, storage, layout))?;
        Ok((out, layout.shape().clone()))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let grad = grad.contiguous()?;
        let gx = with_cpu(&grad, OP, |s, l| {
            fn run<T: Elem>(op: &Rope, s: &CpuStorage, l: &Layout) -> Result<CpuStorage> {
                let g = contiguous_slice::<T>(s, l, OP)?;
                Ok(T::to_cpu_storage_owned(op.run::<T>(g, true)))
            }
            dispatch_float!(s, OP, run::<T>(self, s, l))
        })?;
        Ok(Some(cpu_storage_to_tensor(gx, arg.shape())?))
    }
}
