//! RMS normalisation (HF `LlamaRMSNorm`) with a backward for the input and the weight.

use super::{
    composite, contiguous_slice, cpu_storage_to_tensor, dispatch_float, min_rows_per_task,
    rows_per_reduce_task, sum_sq, tensor_to_f32_vec, use_fused, with_cpu, Elem,
};
use candle_core::{bail, CpuStorage, CustomOp2, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

const OP: &str = "rms_norm";

/// `x * rsqrt(mean(x², -1) + eps) * weight` over the last dimension, with HF `LlamaRMSNorm`
/// semantics: the statistics are taken in `f32`, the normalised value is rounded to the input
/// dtype before the weight multiply, and the result has the input dtype.
///
/// `x`: `[.., h]`, `weight`: `[h]`. Differentiable w.r.t. both `x` and `weight`.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let h = x.dim(candle_core::D::Minus1)?;
    if weight.dims() != [h] {
        bail!(
            "rms_norm: weight has shape {:?} but the input's last dimension is {h}; the norm weight must be [{h}]",
            weight.dims()
        );
    }
    if !use_fused(&[x, weight]) || !weight.device().same_device(x.device()) {
        return composite::rms_norm(x, weight, eps);
    }
    let x = x.contiguous()?;
    let weight = weight.contiguous()?;
    x.apply_op2(&weight, RmsNorm { eps: eps as f32 })
}

struct RmsNorm {
    eps: f32,
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let w = super::to_f32_vec(s2, l2, OP)?;
        fn run<T: Elem>(s: &CpuStorage, l: &Layout, w: &[f32], eps: f32) -> Result<CpuStorage> {
            let x = contiguous_slice::<T>(s, l, OP)?;
            Ok(T::to_cpu_storage_owned(forward::<T>(x, w, eps)))
        }
        let out = dispatch_float!(s1, OP, run::<T>(s1, l1, &w, self.eps))?;
        Ok((out, l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        weight: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = grad.contiguous()?;
        let w = tensor_to_f32_vec(weight, OP)?;
        let h = w.len();
        let eps = self.eps;
        let (gx, gw) = with_cpu(x, OP, |xs, xl| {
            with_cpu(&grad, OP, |gs, gl| {
                fn run<T: Elem>(
                    xs: &CpuStorage,
                    xl: &Layout,
                    gs: &CpuStorage,
                    gl: &Layout,
                    w: &[f32],
                    eps: f32,
                ) -> Result<(CpuStorage, Vec<f32>)> {
                    let x = contiguous_slice::<T>(xs, xl, OP)?;
                    let g = contiguous_slice::<T>(gs, gl, OP)?;
                    if g.len() != x.len() {
                        bail!(
                            "rms_norm backward: gradient has {} elements, input {}",
                            g.len(),
                            x.len()
                        );
                    }
                    let (gx, gw) = backward::<T>(x, g, w, eps);
                    Ok((T::to_cpu_storage_owned(gx), gw))
                }
                dispatch_float!(xs, OP, run::<T>(xs, xl, gs, gl, &w, eps))
            })
        })?;
        let gx = cpu_storage_to_tensor(gx, x.shape())?;
        let gw = Tensor::from_vec(gw, h, x.device())?.to_dtype(weight.dtype())?;
        Ok((Some(gx), Some(gw)))
    }
}

pub(crate) fn forward<T: Elem>(x: &[T], w: &[f32], eps: f32) -> Vec<T> {
    let h = w.len();
    let mut out = vec![T::ZERO; x.len()];
    if h == 0 {
        return out;
    }
    let inv_h = 1.0 / h as f32;
    let per_task = min_rows_per_task(h) * h;
    out.par_chunks_mut(per_task)
        .zip(x.par_chunks(per_task))
        .for_each(|(o_rows, x_rows)| {
            for (o, xr) in o_rows.chunks_exact_mut(h).zip(x_rows.chunks_exact(h)) {
                let inv = 1.0 / (sum_sq(xr) * inv_h + eps).sqrt();
                for ((o, &xv), &wv) in o.iter_mut().zip(xr).zip(w) {
                    // Round x̂ to the input dtype first, as HF does (exact no-op for f32).
                    *o = T::of(T::of(xv.f() * inv).f() * wv);
                }
            }
        });
    out
}

/// Returns (grad_x in T, grad_w in f32).
pub(crate) fn backward<T: Elem>(x: &[T], g: &[T], w: &[f32], eps: f32) -> (Vec<T>, Vec<f32>) {
    let h = w.len();
    let mut gx = vec![T::ZERO; x.len()];
    if h == 0 {
        return (gx, Vec::new());
    }
    let rows = x.len() / h;
    let inv_h = 1.0 / h as f32;
    let per_task = rows_per_reduce_task(rows, h) * h;
    let gw = gx
        .par_chunks_mut(per_task)
        .zip(x.par_chunks(per_task))
        .zip(g.par_chunks(per_task))
        .map(|((gx_rows, x_rows), g_rows)| {
            let mut gw_part = vec![0f32; h];
            for ((gxr, xr), gr) in gx_rows
                .chunks_exact_mut(h)
                .zip(x_rows.chunks_exact(h))
                .zip(g_rows.chunks_exact(h))
            {
                let inv = 1.0 / (sum_sq(xr) * inv_h + eps).sqrt();
                // dot = mean_j(g_j * w_j * x̂_j)
                let mut acc = [0f32; 8];
                let mut i = 0;
                while i + 8 <= h {
                    for l in 0..8 {
                        acc[l] += gr[i + l].f() * w[i + l] * xr[i + l].f();
                    }
                    i += 8;
                }
                let mut dot: f32 = acc.iter().sum();
                while i < h {
                    dot += gr[i].f() * w[i] * xr[i].f();
                    i += 1;
                }
                let dot = dot * inv * inv_h;
                for j in 0..h {
                    let xhat = xr[j].f() * inv;
                    let gj = gr[j].f();
                    gxr[j] = T::of(inv * (gj * w[j] - xhat * dot));
                    gw_part[j] += gj * xhat;
                }
            }
            gw_part
        })
        .reduce_with(|mut a, b| {
            for (x, y) in a.iter_mut().zip(&b) {
                *x += y;
            }
            a
        })
        .unwrap_or_else(|| vec![0f32; h]);
    (gx, gw)
}
