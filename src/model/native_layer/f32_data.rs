//! The layer's data as `f32`: storages read (borrowed, or widened from a half type), results
//! rounded back to the layer's dtype, and the element-wise steps between products.

use super::super::ops::contiguous_slice;
use super::super::ops::cpu_storage_to_tensor;
use super::super::ops::simd::widen_par as widen;
use super::OP_NAME;
use candle_core::{bail, CpuStorage, DType, Layout, Result, Shape, Storage, Tensor};
use half::{bf16, f16};
use rayon::prelude::*;
use std::borrow::Cow;

/// `x ⊙ mask`.
pub(super) fn masked(x: &[f32], mask: &[f32]) -> Vec<f32> {
    let mut out = x.to_vec();
    out.par_chunks_mut(1 << 16)
        .zip(mask.par_chunks(1 << 16))
        .for_each(|(o, m)| o.iter_mut().zip(m).for_each(|(o, m)| *o *= m));
    out
}

/// `dst += src`.
pub(super) fn add_into(dst: &mut [f32], src: &[f32]) {
    dst.par_chunks_mut(1 << 16)
        .zip(src.par_chunks(1 << 16))
        .for_each(|(d, s)| {
            for (d, s) in d.iter_mut().zip(s) {
                *d += s;
            }
        });
}

/// The contiguous data of a CPU storage as `f32`: borrowed when it is `f32`, widened from
/// `bf16` / `f16` otherwise (half-precision layers compute in f32 on the half values: the
/// weights and the layer input are exactly what the graph path reads, and the layer output
/// and every gradient are rounded back to the half type).
pub(super) fn as_f32<'a>(cpu: &'a CpuStorage, layout: &Layout) -> Result<Cow<'a, [f32]>> {
    Ok(match cpu {
        CpuStorage::F32(_) => Cow::Borrowed(contiguous_slice::<f32>(cpu, layout, OP_NAME)?),
        CpuStorage::BF16(_) => Cow::Owned(widen(contiguous_slice::<bf16>(cpu, layout, OP_NAME)?)),
        CpuStorage::F16(_) => Cow::Owned(widen(contiguous_slice::<f16>(cpu, layout, OP_NAME)?)),
        _ => {
            bail!("{OP_NAME}: expected f32, bf16 or f16 data (internal error: use the graph path)")
        }
    })
}

/// `v` as a CPU storage of `dtype` (f32 moved, half types rounded to nearest even).
pub(super) fn narrow(v: Vec<f32>, dtype: DType) -> Result<CpuStorage> {
    use super::super::ops::simd::narrow_par as round;
    Ok(match dtype {
        DType::F32 => CpuStorage::F32(v),
        DType::BF16 => CpuStorage::BF16(round(&v)),
        DType::F16 => CpuStorage::F16(round(&v)),
        other => bail!("{OP_NAME}: cannot produce {other:?} (internal error)"),
    })
}

/// `v` as a CPU tensor of `dtype` and `shape`.
pub(super) fn narrow_tensor(v: Vec<f32>, dtype: DType, shape: &Shape) -> Result<Tensor> {
    cpu_storage_to_tensor(narrow(v, dtype)?, shape)
}

/// Runs `f` on the data of a contiguous CPU tensor, as `f32`.
pub(super) fn with_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> Result<R>) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        bail!("{OP_NAME}: runs on the CPU only (internal error: use the graph path)")
    };
    f(&as_f32(cpu, layout)?)
}
