//! Routes each building block to the fused kernels of [`super::ops`] or to the composite
//! reference ops of [`super::reference_ops`], and implements the frozen-weight matmul.

use super::error::ModelError;
use super::ops;
use super::reference_ops as r;
use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Storage, Tensor};

/// Whether the fused kernels exist in this build.
pub(crate) const FUSED_AVAILABLE: bool = true;
/// Whether new models use them.
pub(crate) const FUSED_DEFAULT: bool = FUSED_AVAILABLE;

pub(crate) fn rms_norm(
    x: &Tensor,
    w: &Tensor,
    eps: f64,
    fused: bool,
) -> Result<Tensor, ModelError> {
    if fused {
        Ok(ops::rms_norm(x, w, eps)?)
    } else {
        Ok(r::rms_norm(x, w, eps)?)
    }
}

pub(crate) fn rope(
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    fused: bool,
) -> Result<Tensor, ModelError> {
    if fused {
        Ok(ops::rope(x, cos, sin)?)
    } else {
        Ok(r::rope(x, cos, sin)?)
    }
}

pub(crate) fn softmax_last_dim(x: &Tensor, fused: bool) -> Result<Tensor, ModelError> {
    if fused {
        Ok(ops::softmax_last_dim(x)?)
    } else {
        Ok(r::softmax_last_dim(x)?)
    }
}

pub(crate) fn silu_mul(g: &Tensor, u: &Tensor, fused: bool) -> Result<Tensor, ModelError> {
    if fused {
        Ok(ops::silu_mul(g, u)?)
    } else {
        Ok(r::silu_mul(g, u)?)
    }
}

/// `x @ w^T` for a frozen `w` (`[out, in]`): the backward pass computes the gradient of
/// `x` only. (candle's own matmul backward always computes both operands' gradients,
/// which for a frozen weight is a wasted matmul and a weight-sized buffer.)
pub(crate) fn frozen_linear(x: &Tensor, w: &Tensor, fused: bool) -> Result<Tensor, ModelError> {
    if fused {
        return Ok(ops::frozen_linear(x, w, None)?);
    }
    if !x.device().is_cpu() {
        // Off the CPU the custom op has no kernel; a detached weight still blocks the
        // parameter update (its gradient is computed and dropped).
        return Ok(x.matmul(&w.detach().t()?)?);
    }
    // The custom op reads its input as one contiguous block.
    Ok(x.contiguous()?.apply_op1(FrozenLinear { w: w.detach() })?)
}

struct FrozenLinear {
    w: Tensor,
}

/// A tensor holding a copy of the data a storage/layout pair describes.
pub(crate) fn tensor_from_cpu(s: &CpuStorage, l: &Layout) -> candle_core::Result<Tensor> {
    let dev = candle_core::Device::Cpu;
    let dims = l.shape().dims().to_vec();
    let Some((start, end)) = l.contiguous_offsets() else {
        candle_core::bail!("expected a contiguous input (internal error: call .contiguous() first)")
    };
    match s {
        CpuStorage::F32(v) => Tensor::from_slice(&v[start..end], dims, &dev),
        CpuStorage::BF16(v) => Tensor::from_slice(&v[start..end], dims, &dev),
        CpuStorage::F16(v) => Tensor::from_slice(&v[start..end], dims, &dev),
        CpuStorage::F64(v) => Tensor::from_slice(&v[start..end], dims, &dev),
        _ => candle_core::bail!("unsupported dtype for a frozen/checkpointed op"),
    }
}

/// The CPU storage of a contiguous tensor starting at offset 0 (copied out).
pub(crate) fn cpu_storage_of(t: &Tensor) -> candle_core::Result<(CpuStorage, Shape)> {
    let t = if t.is_contiguous() && t.layout().start_offset() == 0 {
        t.clone()
    } else {
        t.copy()?
    };
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(c) => {
            let n = layout.shape().elem_count();
            let out = match c {
                CpuStorage::F32(v) => CpuStorage::F32(v[..n].to_vec()),
                CpuStorage::BF16(v) => CpuStorage::BF16(v[..n].to_vec()),
                CpuStorage::F16(v) => CpuStorage::F16(v[..n].to_vec()),
                CpuStorage::F64(v) => CpuStorage::F64(v[..n].to_vec()),
                other => other.clone(),
            };
            Ok((out, layout.shape().clone()))
        }
        _ => candle_core::bail!("expected a CPU tensor"),
    }
}

impl CustomOp1 for FrozenLinear {
    fn name(&self) -> &'static str {
        "frozen-linear"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = tensor_from_cpu(s, l)?;
        let y = x.matmul(&self.w.t()?)?;
        cpu_storage_of(&y)
    }

    fn bwd(
        &self,
        _arg: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(grad.matmul(&self.w)?))
    }
}

pub(crate) fn cross_entropy_rows(logits: &Tensor, labels: &Tensor) -> Result<Tensor, ModelError> {
    Ok(r::cross_entropy_rows(logits, labels)?)
}
