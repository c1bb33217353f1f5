//! Numerically stable softmax over the last dimension, with a backward.

use super::{
    composite, contiguous_slice, cpu_storage_to_tensor, dispatch_float, exp_shift_sum_in_place,
    min_rows_per_task, row_max, use_fused, with_cpu, Elem,
};
use candle_core::{bail, CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

const OP: &str = "softmax_last_dim";

/// Softmax over the last dimension, computed in `f32` (max-subtracted), returned in the input
/// dtype. A row whose entries are all `-inf` (a query that a padding or sliding-window mask hides
/// completely) yields zeros — not NaN — and a zero gradient.
///
/// Backward: `grad_x = y * (g - sum(g * y, -1))`.
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    if x.rank() == 0 {
        bail!("softmax_last_dim: the input is a scalar; it needs at least one dimension");
    }
    if !use_fused(&[x]) {
        return composite::softmax_last_dim(x);
    }
    x.contiguous()?.apply_op1(Softmax)
}

struct Softmax;

fn forward<T: Elem>(x: &[T], n: usize) -> Vec<T> {
    let mut out = vec![T::ZERO; x.len()];
    if n == 0 {
        return out;
    }
    let per_task = min_rows_per_task(n) * n;
    out.par_chunks_mut(per_task)
        .zip(x.par_chunks(per_task))
        .for_each_init(
            || vec![0f32; n],
            |buf, (o_rows, x_rows)| {
                for (o, xr) in o_rows.chunks_exact_mut(n).zip(x_rows.chunks_exact(n)) {
                    for (b, v) in buf.iter_mut().zip(xr) {
                        *b = v.f();
                    }
                    let max = row_max(buf);
                    if max == f32::NEG_INFINITY {
                        // Fully masked row: `o` is already zero.
                        continue;
                    }
                    let sum = exp_shift_sum_in_place(buf, max);
                    let inv = 1.0 / sum;
                    for (o, &b) in o.iter_mut().zip(buf.iter()) {
                        *o = T::of(b * inv);
                    }
                }
            },
        );
    out
}

fn backward<T: Elem>(y: &[T], g: &[T], n: usize) -> Vec<T> {
    let mut out = vec![T::ZERO; y.len()];
    if n == 0 {
        return out;
    }
    let per_task = min_rows_per_task(n) * n;
    out.par_chunks_mut(per_task)
        .zip(y.par_chunks(per_task))
        .zip(g.par_chunks(per_task))
        .for_each(|((o_rows, y_rows), g_rows)| {
            for ((o, yr), gr) in o_rows
                .chunks_exact_mut(n)
                .zip(y_rows.chunks_exact(n))
                .zip(g_rows.chunks_exact(n))
            {
                let mut acc = [0f32; 8];
                let mut i = 0;
                while i + 8 <= n {
                    for l in 0..8 {
                        acc[l] += yr[i + l].f() * gr[i + l].f();
                    }
                    i += 8;
                }
                let mut dot: f32 = acc.iter().sum();
                while i < n {
                    dot += yr[i].f() * gr[i].f();
                    i += 1;
                }
                for ((o, yv), gv) in o.iter_mut().zip(yr).zip(gr) {
                    *o = T::of(yv.f() * (gv.f() - dot));
                }
            }
        });
    out
}

impl CustomOp1 for Softmax {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let n = layout.shape().dims().last().copied().unwrap_or(1);
        fn run<T: Elem>(s: &CpuStorage, l: &Layout, n: usize) -> Result<CpuStorage> {
            let x = contiguous_slice::<T>(s, l, OP)?;
            Ok(T::to_cpu_storage_owned(forward::<T>(x, n)))
        }
        let out = dispatch_float!(storage, OP, run::<T>(storage, layout, n))?;
        Ok((out, layout.shape().clone()))
    }

    fn bwd(&self, arg: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let grad = grad.contiguous()?;
        let res = res.contiguous()?;
        let n = arg.dims().last().copied().unwrap_or(1);
        let gx = with_cpu(&res, OP, |ys, yl| {
            with_cpu(&grad, OP, |gs, gl| {
                fn run<T: Elem>(
                    ys: &CpuStorage,
                    yl: &Layout,
                    gs: &CpuStorage,
                    gl: &Layout,
                    n: usize,
                ) -> Result<CpuStorage> {
                    let y = contiguous_slice::<T>(ys, yl, OP)?;
                    let g = contiguous_slice::<T>(gs, gl, OP)?;
                    if y.len() != g.len() {
                        bail!(
                            "softmax backward: gradient has {} elements, output {}",
                            g.len(),
                            y.len()
                        );
                    }
                    Ok(T::to_cpu_storage_owned(backward::<T>(y, g, n)))
                }
                dispatch_float!(ys, OP, run::<T>(ys, yl, gs, gl, n))
            })
        })?;
        Ok(Some(cpu_storage_to_tensor(gx, arg.shape())?))
    }
}
