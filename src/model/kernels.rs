//! Routes each building block to the CPU fused kernels of [`super::ops`], to the device-generic
//! ops of [`super::ops::generic`] (what a GPU runs), or to the composite reference ops of
//! [`super::reference_ops`], and implements the frozen-weight matmul.

use super::error::ModelError;
use super::ops;
use super::ops::generic;
use super::reference_ops as r;
use candle_core::{CpuStorage, Shape, Storage, Tensor};

/// Whether the fused kernels exist in this build.
pub(crate) const FUSED_AVAILABLE: bool = true;

/// Which implementation of the decoder's building blocks a model runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OpsKind {
    /// The CPU fused kernels where the tensor is on the CPU; the generic ops elsewhere.
    Fused,
    /// The device-generic ops on every device (`TUNESTUDIO_OPS=generic`).
    Generic,
    /// The composite reference ops (parity tests; they keep more intermediates alive).
    Reference,
}

impl OpsKind {
    /// The implementation that runs on `x`'s device.
    fn on(self, x: &Tensor) -> OpsKind {
        match self {
            OpsKind::Fused if !x.device().is_cpu() => OpsKind::Generic,
            other => other,
        }
    }
}

pub(crate) fn rms_norm(
    x: &Tensor,
    w: &Tensor,
    eps: f64,
    kind: OpsKind,
) -> Result<Tensor, ModelError> {
    Ok(match kind.on(x) {
        OpsKind::Fused => ops::rms_norm(x, w, eps)?,
        OpsKind::Generic => generic::rms_norm(x, w, eps)?,
        OpsKind::Reference => r::rms_norm(x, w, eps)?,
    })
}

pub(crate) fn rope(
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    kind: OpsKind,
) -> Result<Tensor, ModelError> {
    Ok(match kind.on(x) {
        OpsKind::Fused => ops::rope(x, cos, sin)?,
        OpsKind::Generic => generic::rope(x, cos, sin)?,
        OpsKind::Reference => r::rope(x, cos, sin)?,
    })
}

pub(crate) fn softmax_last_dim(x: &Tensor, kind: OpsKind) -> Result<Tensor, ModelError> {
    Ok(match kind.on(x) {
        OpsKind::Fused => ops::softmax_last_dim(x)?,
        OpsKind::Generic => generic::softmax_last_dim(x)?,
        OpsKind::Reference => r::softmax_last_dim(x)?,
    })
}

pub(crate) fn silu_mul(g: &Tensor, u: &Tensor, kind: OpsKind) -> Result<Tensor, ModelError> {
    Ok(match kind.on(g) {
        OpsKind::Fused => ops::silu_mul(g, u)?,
        OpsKind::Generic => generic::silu_mul(g, u)?,
        OpsKind::Reference => r::silu_mul(g, u)?,
    })
}

/// `x @ w^T` for a frozen `w` (`[out, in]`): the backward pass computes the gradient of `x`
/// only. (candle's own matmul backward always computes both operands' gradients, which for a
/// frozen weight is a wasted matmul and a weight-sized buffer.)
pub(crate) fn frozen_linear(x: &Tensor, w: &Tensor, kind: OpsKind) -> Result<Tensor, ModelError> {
    match kind.on(x) {
        OpsKind::Fused => Ok(ops::frozen_linear(x, w, None)?),
        OpsKind::Generic => Ok(generic::frozen_linear(x, w)?),
        // The reference: candle's matmul on a detached weight (its gradient is computed and
        // dropped; the parameter is not updated).
        OpsKind::Reference => Ok(x.matmul(&w.detach().t()?)?),
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

pub(crate) fn cross_entropy_rows(logits: &Tensor, labels: &Tensor) -> Result<Tensor, ModelError> {
    Ok(r::cross_entropy_rows(logits, labels)?)
}
