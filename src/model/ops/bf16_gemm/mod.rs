//! Products of bf16 operands on the CPU, accumulated in f32: one packed-GEMM driver
//! ([`driver`]: threads, blocking, packing buffers, the loops over tiles) and two tile kernels,
//! the AVX512-BF16 dot-product kernel ([`avx512_tile`], `vdpbf16ps`) and the AMX tile kernel
//! ([`amx_tile`], `tdpbf16ps`), which share the right operand's packing ([`pack`]). Both are
//! checked against the same f64 product of the rounded operands (`bf16_gemm::tests`), and
//! `kernel_path` measures them against the f32 path (gemm's kernels on widened operands),
//! the reference that always runs.
//!
//! Half-precision layers used to widen their bf16 weights and multiply in f32 with gemm's
//! kernels. The numerics here are PyTorch's CPU autocast's: each operand is rounded to bf16
//! (round to nearest even; bf16 weights are already), the products are exact in f32 and summed
//! in f32, and the instructions treat subnormal inputs and outputs as zero.
//!
//! The layout is the classic packed GEMM: the right operand is packed per thread into panels of
//! 32 columns holding bf16 pairs `(b[2p][j], b[2p+1][j])` (one `u32` per column and pair of
//! rows), the left one into the kernel's panels, and the kernel's tile keeps its block of the
//! destination in registers (AVX-512: 12 × 32 in 24 of the 32 vector registers) or tiles
//! (AMX: 32 × 32 in four accumulator tiles). Operands are read through strided views, so
//! transposed operands cost nothing extra, and `f32` operands are rounded while they are
//! packed.

mod amx_tile;
mod avx512_tile;
mod driver;
mod pack;

pub(crate) use amx_tile::AmxTile;
pub(crate) use avx512_tile::Avx512Tile;
pub(crate) use driver::{product_pack_bytes, TileKernel};

use super::f32_to_bf16;
use super::matmul::{check_dims, MatRef};
use candle_core::{bail, Result};
use half::bf16;

/// An element that can be handed to the bf16 product: rounded to bf16 when it is packed.
pub(crate) trait PackElem: Copy + Send + Sync {
    /// Whether the value is an `f32` (rounded when packed) rather than bf16 bits.
    const IS_F32: bool;
    /// The bf16 bits of this value (rounded to nearest even).
    fn bf16_bits(self) -> u16;
    /// The values as `f32` (borrowed for `f32`, widened for bf16): the f32 path's operands.
    fn as_f32(data: &[Self]) -> std::borrow::Cow<'_, [f32]>;
}

impl PackElem for f32 {
    const IS_F32: bool = true;
    #[inline(always)]
    fn bf16_bits(self) -> u16 {
        f32_to_bf16(self).to_bits()
    }
    fn as_f32(data: &[Self]) -> std::borrow::Cow<'_, [f32]> {
        std::borrow::Cow::Borrowed(data)
    }
}

impl PackElem for bf16 {
    const IS_F32: bool = false;
    #[inline(always)]
    fn bf16_bits(self) -> u16 {
        self.to_bits()
    }
    fn as_f32(data: &[Self]) -> std::borrow::Cow<'_, [f32]> {
        std::borrow::Cow::Owned(super::simd::widen_par(data))
    }
}

/// `lhs @ rhs` on kernel `K` as a new row-major `lhs.rows × rhs.cols` buffer, operands rounded
/// to bf16 (multithreaded). An error when the CPU lacks the kernel (check
/// [`TileKernel::available`]).
///
/// The buffer is not zero-filled first: every tile is stored whole when the product does not
/// accumulate (the lm head's `vocab × hidden` gradient is 113 MB on SmolLM2-135M).
pub(crate) fn gemm_new<K: TileKernel, A: PackElem, B: PackElem>(
    lhs: MatRef<'_, A>,
    rhs: MatRef<'_, B>,
) -> Result<Vec<f32>> {
    let (m, n) = (lhs.rows, rhs.cols);
    check::<K, _, _>(lhs, rhs)?;
    let len = m * n;
    let mut out: Vec<f32> = Vec::with_capacity(len);
    // Test builds poison the buffer, so an element the kernel failed to write shows up as NaN.
    #[cfg(debug_assertions)]
    out.resize(len, f32::NAN);
    // SAFETY: the views were checked and the CPU has the kernel; `out` has room for the
    // row-major `m × n` destination and does not alias the inputs. Without `accumulate` every
    // element is written (each tile stores its rows and columns whole, and `k = 0` stores
    // zeros) and none is read; only then is the length set.
    unsafe {
        driver::product::<K, A, B>(out.as_mut_ptr(), n, false, lhs, rhs);
        out.set_len(len);
    }
    Ok(out)
}

/// `dst = lhs @ rhs` (or `dst += lhs @ rhs` when `accumulate`) on kernel `K`, `dst` being
/// row-major with `dst_row_stride` elements between rows; operands rounded to bf16, sums in
/// f32. Splits the product across rayon's threads. An error when the CPU lacks the kernel.
pub(crate) fn gemm<K: TileKernel, A: PackElem, B: PackElem>(
    dst: &mut [f32],
    dst_row_stride: usize,
    accumulate: bool,
    lhs: MatRef<'_, A>,
    rhs: MatRef<'_, B>,
) -> Result<()> {
    check::<K, _, _>(lhs, rhs)?;
    let (m, n) = (lhs.rows, rhs.cols);
    if m == 0 || n == 0 {
        return Ok(());
    }
    if dst_row_stride < n || dst.len() < (m - 1) * dst_row_stride + n {
        bail!(
            "{}: the destination does not hold a {m}x{n} matrix with row stride {dst_row_stride}",
            K::NAME
        );
    }
    // SAFETY: checked views, a checked destination (a unique borrow, so no aliasing), and the
    // CPU has the kernel (`check`).
    unsafe { driver::product::<K, A, B>(dst.as_mut_ptr(), dst_row_stride, accumulate, lhs, rhs) };
    Ok(())
}

/// An error unless the CPU (and OS) runs kernel `K`, the inner dimensions agree and both views
/// lie inside their buffers.
fn check<K: TileKernel, A, B>(lhs: MatRef<'_, A>, rhs: MatRef<'_, B>) -> Result<()> {
    if !K::available() {
        bail!(
            "{}: {} (internal error: check `available`)",
            K::NAME,
            K::MISSING
        );
    }
    check_dims(lhs, rhs)
}

#[cfg(test)]
mod tests;
