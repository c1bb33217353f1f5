//! A linear layer whose weight is frozen: backward returns only the input gradient.

use super::matmul::{sgemm, MatRef};
use super::{
    composite, contiguous_slice, cpu_storage_to_tensor, dispatch_float, tensor_to_f32_vec,
    use_fused, with_cpu, Elem,
};
use candle_core::{bail, CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};
use std::borrow::Cow;

const OP: &str = "frozen_linear";

/// `x @ weight^T + bias` where `weight` (`[out, in]`) and `bias` (`[out]`) are constants: the
/// backward computes only `grad_x = grad @ weight` — no weight gradient is computed or stored
/// (candle's own matmul backward always computes both sides). Meant for LoRA's frozen base layer.
///
/// `x`: `[.., in]`; result `[.., out]` in `x`'s dtype. `weight` may be a transposed view of an
/// `[in, out]` tensor (used without a copy on the CPU). Computed in `f32` (half-precision
/// operands are widened per call, as candle's bf16 matmul does).
pub fn frozen_linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let in_dim = x.dim(candle_core::D::Minus1)?;
    let (out_dim, w_in) = weight.dims2().map_err(|_| {
        candle_core::Error::Msg(format!(
            "frozen_linear: weight must be [out_features, in_features], got shape {:?}",
            weight.dims()
        ))
    })?;
    if w_in != in_dim {
        bail!(
            "frozen_linear: input's last dimension is {in_dim} but the weight is [{out_dim}, {w_in}]; the weight must be [out_features, in_features]"
        );
    }
    if let Some(b) = bias {
        if b.dims() != [out_dim] {
            bail!(
                "frozen_linear: bias has shape {:?}; expected [{out_dim}]",
                b.dims()
            );
        }
    }
    let mut all = vec![x, weight];
    all.extend(bias);
    if !use_fused(&all) {
        return composite::frozen_linear(x, weight, bias);
    }
    let mut weight = weight.detach();
    if !(weight.is_contiguous() || weight.t()?.is_contiguous()) {
        weight = weight.contiguous()?;
    }
    let bias = match bias {
        Some(b) => Some(tensor_to_f32_vec(b, OP)?),
        None => None,
    };
    x.contiguous()?.apply_op1(FrozenLinear { weight, bias })
}

struct FrozenLinear {
    /// `[out, in]`, detached; row-major or a transposed view of a row-major `[in, out]`.
    weight: Tensor,
    bias: Option<Vec<f32>>,
}

/// The weight's storage as an `f32` view in `[out, in]` index space (widened if half precision).
fn weight_f32<'a>(
    storage: &'a CpuStorage,
    layout: &Layout,
) -> Result<(Cow<'a, [f32]>, usize, usize)> {
    let (out_dim, in_dim) = layout.shape().dims2()?;
    let stride = layout.stride();
    let start = layout.start_offset();
    let len = out_dim * in_dim;
    fn dense<T: Elem>(s: &CpuStorage, start: usize, len: usize) -> Result<Cow<'_, [f32]>> {
        let data = s.as_slice::<T>()?;
        let Some(slice) = data.get(start..start + len) else {
            bail!("frozen_linear: weight layout out of bounds")
        };
        // f32 is borrowed as is; the half types are widened once per call.
        Ok(T::widen_slice(slice))
    }
    let data = dispatch_float!(storage, OP, dense::<T>(storage, start, len))?;
    let (rs, cs) = if out_dim > 1 && in_dim > 1 {
        (stride[0], stride[1])
    } else if out_dim == 1 {
        (in_dim, 1)
    } else {
        (1, 1)
    };
    Ok((data, rs, cs))
}

impl CustomOp1 for FrozenLinear {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let dims = layout.shape().dims();
        let in_dim = dims.last().copied().unwrap_or(1);
        let m = layout.shape().elem_count() / in_dim.max(1);
        let out = with_cpu(&self.weight, OP, |ws, wl| {
            let (w, w_rs, w_cs) = weight_f32(ws, wl)?;
            let out_dim = wl.shape().dims2()?.0;
            let w = MatRef {
                data: &w,
                rows: out_dim,
                cols: in_dim,
                row_stride: w_rs,
                col_stride: w_cs,
            };
            fn run<T: Elem>(
                s: &CpuStorage,
                l: &Layout,
                m: usize,
                in_dim: usize,
                w: MatRef<'_>,
                bias: Option<&[f32]>,
            ) -> Result<CpuStorage> {
                let x = contiguous_slice::<T>(s, l, OP)?;
                let x32 = T::widen_slice(x);
                let out_dim = w.rows;
                // Start from the bias (then accumulate) so no zero-fill-then-add is needed.
                let (mut y, acc) = match bias {
                    Some(b) => {
                        let mut y = Vec::with_capacity(m * out_dim);
                        for _ in 0..m {
                            y.extend_from_slice(b);
                        }
                        (y, true)
                    }
                    None => (vec![0f32; m * out_dim], false),
                };
                sgemm(
                    &mut y,
                    out_dim,
                    1,
                    acc,
                    MatRef::row_major(&x32, m, in_dim),
                    w.t(),
                )?;
                Ok(T::to_cpu_storage_owned(T::narrow_vec(y)))
            }
            dispatch_float!(
                storage,
                OP,
                run::<T>(storage, layout, m, in_dim, w, self.bias.as_deref())
            )
        })?;
        let mut out_dims = dims.to_vec();
        if let Some(last) = out_dims.last_mut() {
            *last = self.weight.dims()[0];
        }
        Ok((out, Shape::from(out_dims)))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let grad = grad.contiguous()?;
        let in_dim = arg.dim(candle_core::D::Minus1)?;
        let out_dim = self.weight.dims()[0];
        let m = arg.elem_count() / in_dim.max(1);
        let gx = with_cpu(&self.weight, OP, |ws, wl| {
            let (w, w_rs, w_cs) = weight_f32(ws, wl)?;
            let w = MatRef {
                data: &w,
                rows: out_dim,
                cols: in_dim,
                row_stride: w_rs,
                col_stride: w_cs,
            };
            with_cpu(&grad, OP, |gs, gl| {
                fn run<T: Elem>(
                    gs: &CpuStorage,
                    gl: &Layout,
                    m: usize,
                    out_dim: usize,
                    w: MatRef<'_>,
                ) -> Result<CpuStorage> {
                    let g = contiguous_slice::<T>(gs, gl, OP)?;
                    let g32 = T::widen_slice(g);
                    let in_dim = w.cols;
                    let mut gx = vec![0f32; m * in_dim];
                    // grad_x = grad @ W
                    sgemm(
                        &mut gx,
                        in_dim,
                        1,
                        false,
                        MatRef::row_major(&g32, m, out_dim),
                        w,
                    )?;
                    Ok(T::to_cpu_storage_owned(T::narrow_vec(gx)))
                }
                dispatch_float!(gs, OP, run::<T>(gs, gl, m, out_dim, w))
            })
        })?;
        Ok(Some(cpu_storage_to_tensor(gx, arg.shape())?))
    }
}
