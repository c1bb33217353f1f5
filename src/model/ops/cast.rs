//! `bf16` / `f16` → `f32` as an op that converts on every thread, with a backward that rounds
//! the gradient back the same way. candle's `to_dtype` does both on one thread: the fused loss
//! casts the whole lm-head with it in half precision (49,152 × 576 values on SmolLM2-135M, in
//! forward and again for the gradient in backward). The values are candle's bit for bit
//! (`bf16_to_f32` / `f32_to_bf16` match `half`'s conversions).

use super::simd::{narrow_par, widen_par};
use super::{contiguous_slice, cpu_storage_to_tensor, with_cpu};
use candle_core::{bail, CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};
use half::{bf16, f16};

const OP: &str = "cast to f32";

/// `t` as `f32`: the multithreaded op for a contiguous half-precision CPU tensor, candle's
/// `to_dtype` otherwise (an `f32` tensor comes back as itself).
pub(crate) fn to_f32(t: &Tensor) -> Result<Tensor> {
    let half = matches!(t.dtype(), DType::BF16 | DType::F16);
    if !half || !t.device().is_cpu() || !t.is_contiguous() {
        return t.to_dtype(DType::F32);
    }
    t.apply_op1(ToF32)
}

struct ToF32;

impl CustomOp1 for ToF32 {
    fn name(&self) -> &'static str {
        "to-f32-par"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let v = match s {
            CpuStorage::BF16(_) => widen_par(contiguous_slice::<bf16>(s, l, OP)?),
            CpuStorage::F16(_) => widen_par(contiguous_slice::<f16>(s, l, OP)?),
            _ => bail!("{OP}: expected bf16 or f16 (internal error)"),
        };
        Ok((CpuStorage::F32(v), l.shape().clone()))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let g = grad.to_dtype(DType::F32)?.contiguous()?;
        let narrowed = with_cpu(&g, OP, |s, l| {
            let v = contiguous_slice::<f32>(s, l, OP)?;
            Ok(match arg.dtype() {
                DType::BF16 => CpuStorage::BF16(narrow_par::<bf16>(v)),
                DType::F16 => CpuStorage::F16(narrow_par::<f16>(v)),
                other => bail!("{OP}: cannot round a gradient to {other:?} (internal error)"),
            })
        })?;
        Ok(Some(cpu_storage_to_tensor(narrowed, g.shape())?))
    }
}
