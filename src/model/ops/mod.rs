//! Fused CPU kernels for training, each with a forward AND a backward pass.
//!
//! candle-nn's own fused ops (`softmax_last_dim`, `rms_norm`, `rope`) record no backward, so
//! gradients silently stop at them. The ops here are candle custom ops (`Tensor::apply_op1/2`)
//! whose backward is implemented, so they can sit anywhere in a training graph.
//!
//! Every op:
//! - accepts `f32`, `bf16` and `f16` inputs, computes in `f32` internally and returns the input
//!   dtype (the losses always return `f32`, like transformers does);
//! - makes non-contiguous inputs contiguous first;
//! - splits rows over rayon's pool when there are enough of them to pay for the split;
//! - falls back to a composite of differentiable candle ops ([`composite`]) on non-CPU devices
//!   and for other dtypes, so callers never need a device check of their own.

pub(crate) mod bf16_gemm;
mod cast;
pub mod composite;
mod cross_entropy;
mod frozen_linear;
pub(crate) mod gemm_pack;
pub(crate) mod generic;
pub mod kernel_path;
pub(crate) mod matmul;
pub(crate) mod rms_norm;
mod rope;
pub(crate) mod silu_mul;
pub(crate) mod simd;
mod softmax;

pub(crate) use cast::to_f32;
pub use cross_entropy::{cross_entropy_rows, linear_cross_entropy, IGNORE_INDEX};
pub(crate) use cross_entropy::{
    linear_cross_entropy_fused, linear_cross_entropy_with_sink, EntropySink, WeightGradSink,
};
pub use frozen_linear::frozen_linear;
pub use rms_norm::rms_norm;
pub use rope::rope;
pub use silu_mul::silu_mul;
pub use softmax::softmax_last_dim;

use candle_core::{bail, CpuStorage, DType, Layout, Result, Shape, Storage, Tensor, WithDType};
use half::{bf16, f16};
use std::borrow::Cow;

/// Locks a mutex, recovering the data if another thread panicked while holding it.
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Below this many elements per rayon task, splitting costs more than it saves (waking a rayon
/// worker takes tens of microseconds; 64k elements of a vectorised loop take about that long).
const PAR_MIN_ELEMS: usize = 64 * 1024;

/// Element types the fused kernels read and write; arithmetic always happens in `f32`.
pub(crate) trait Elem: WithDType + Copy + Send + Sync {
    const ZERO: Self;
    /// Widen to `f32`.
    fn f(self) -> f32;
    /// Narrow from `f32` (round to nearest even for the half types).
    fn of(v: f32) -> Self;
    /// The slice as `f32`: borrowed for `f32`, widened otherwise.
    fn widen_slice(s: &[Self]) -> Cow<'_, [f32]> {
        Cow::Owned(s.iter().map(|v| v.f()).collect())
    }
    /// An `f32` vector as `Self`: moved for `f32`, narrowed otherwise.
    fn narrow_vec(v: Vec<f32>) -> Vec<Self> {
        v.into_iter().map(Self::of).collect()
    }
}

impl Elem for f32 {
    const ZERO: Self = 0.0;
    #[inline(always)]
    fn f(self) -> f32 {
        self
    }
    #[inline(always)]
    fn of(v: f32) -> Self {
        v
    }
    fn widen_slice(s: &[Self]) -> Cow<'_, [f32]> {
        Cow::Borrowed(s)
    }
    fn narrow_vec(v: Vec<f32>) -> Vec<Self> {
        v
    }
}

impl Elem for bf16 {
    const ZERO: Self = bf16::ZERO;
    #[inline(always)]
    fn f(self) -> f32 {
        bf16_to_f32(self)
    }
    #[inline(always)]
    fn of(v: f32) -> Self {
        f32_to_bf16(v)
    }
}

/// `bf16 → f32` with `half`'s result bit for bit (NaNs made quiet), without a branch, so the
/// loops that widen weights and activations vectorise.
#[inline(always)]
pub(crate) fn bf16_to_f32(x: bf16) -> f32 {
    let i = x.to_bits();
    let w = u32::from(i) << 16;
    let nan = (i & 0x7FFF) > 0x7F80;
    f32::from_bits(if nan { w | 0x0040_0000 } else { w })
}

/// `f32 → bf16` rounding to nearest even, with `half`'s result bit for bit (NaNs keep their
/// top mantissa bits and are made quiet), without a branch: on the SmolLM2-135M bf16-mixed
/// step the gradients, outputs and parameters rounded this way are ≈ 300 M values.
#[inline(always)]
pub(crate) fn f32_to_bf16(v: f32) -> bf16 {
    let b = v.to_bits();
    let nan = (b & 0x7FFF_FFFF) > 0x7F80_0000;
    let r = if nan {
        b | 0x0040_0000
    } else {
        b.wrapping_add(0x7FFF + ((b >> 16) & 1))
    };
    bf16::from_bits((r >> 16) as u16)
}

impl Elem for f16 {
    const ZERO: Self = f16::ZERO;
    #[inline(always)]
    fn f(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn of(v: f32) -> Self {
        f32_to_f16(v)
    }
}

/// `f32 → f16` rounding to nearest even, with `half`'s result bit for bit (overflow to
/// infinity, subnormals, NaNs made quiet with their top mantissa bits), without a branch or a
/// call, so loops over it vectorise. `half` converts one value per call: the fp16-mixed AdamW
/// update of the SmolLM2-135M shape (which rounds every parameter from its master copy) took
/// 0.75 s of a 3.1 s step that way.
///
/// Normal results add the exponent rebias and the rounding bias to the bits and shift; a
/// subnormal result comes from an f32 addition that aligns the 10 mantissa bits at the bottom
/// (the FPU rounds it to nearest even).
#[inline(always)]
pub(crate) fn f32_to_f16(v: f32) -> f16 {
    /// 2^16: from here on the result is infinite (or NaN).
    const OVERFLOW: u32 = (127 + 16) << 23;
    /// 2^-14, f16's smallest normal: below it the result is subnormal or zero.
    const SMALLEST_NORMAL: u32 = 113 << 23;
    /// 0.5: adding it leaves `x · 2^24` in the low mantissa bits, rounded to nearest even.
    const SUBNORMAL_MAGIC: u32 = 126 << 23;
    let b = v.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let abs = b & 0x7FFF_FFFF;
    let odd = (abs >> 13) & 1;
    // Exponent bias 127 → 15 (wrapping: −112 · 2^23), then round half to even.
    let normal = abs.wrapping_add(0xC800_0FFF).wrapping_add(odd) >> 13;
    let subnormal = (f32::from_bits(abs) + f32::from_bits(SUBNORMAL_MAGIC))
        .to_bits()
        .wrapping_sub(SUBNORMAL_MAGIC);
    let special = if abs > 0x7F80_0000 {
        0x7E00 | ((abs >> 13) & 0x3FF)
    } else {
        0x7C00
    };
    let r = if abs >= OVERFLOW {
        special
    } else if abs < SMALLEST_NORMAL {
        subnormal
    } else {
        normal
    };
    f16::from_bits(r as u16 | sign)
}

/// True when the fused CPU kernels handle this dtype.
pub(crate) fn fused_dtype(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::BF16 | DType::F16)
}

/// True when every tensor lives on the CPU with a dtype the fused kernels handle.
pub(crate) fn use_fused(tensors: &[&Tensor]) -> bool {
    tensors
        .iter()
        .all(|t| t.device().is_cpu() && fused_dtype(t.dtype()))
}

/// How many rows of `row_len` elements one rayon task should at least get.
#[inline]
pub(crate) fn min_rows_per_task(row_len: usize) -> usize {
    PAR_MIN_ELEMS.div_ceil(row_len.max(1)).max(1)
}

/// Rows per task when tasks also produce a partial reduction (a few tasks per thread, never
/// fewer rows than [`min_rows_per_task`]).
pub(crate) fn rows_per_reduce_task(rows: usize, row_len: usize) -> usize {
    let threads = rayon::current_num_threads().max(1);
    rows.div_ceil(4 * threads)
        .max(min_rows_per_task(row_len))
        .max(1)
}

/// The contiguous slice a storage/layout pair describes.
pub(crate) fn contiguous_slice<'a, T: Elem>(
    storage: &'a CpuStorage,
    layout: &Layout,
    op: &'static str,
) -> Result<&'a [T]> {
    let Some((start, end)) = layout.contiguous_offsets() else {
        bail!("{op}: expected a contiguous input (internal error: call .contiguous() first)")
    };
    let data = storage.as_slice::<T>()?;
    match data.get(start..end) {
        Some(s) => Ok(s),
        None => bail!("{op}: layout {layout:?} is out of bounds of its storage"),
    }
}

/// Copies a contiguous storage of any float dtype into an `f32` vector.
pub(crate) fn to_f32_vec(
    storage: &CpuStorage,
    layout: &Layout,
    op: &'static str,
) -> Result<Vec<f32>> {
    fn widen<T: Elem>(s: &CpuStorage, l: &Layout, op: &'static str) -> Result<Vec<f32>> {
        Ok(contiguous_slice::<T>(s, l, op)?
            .iter()
            .map(|v| v.f())
            .collect())
    }
    match storage {
        CpuStorage::F32(_) => widen::<f32>(storage, layout, op),
        CpuStorage::BF16(_) => widen::<bf16>(storage, layout, op),
        CpuStorage::F16(_) => widen::<f16>(storage, layout, op),
        CpuStorage::F64(v) => {
            let Some((start, end)) = layout.contiguous_offsets() else {
                bail!("{op}: expected a contiguous input")
            };
            Ok(v[start..end].iter().map(|&x| x as f32).collect())
        }
        other => bail!(
            "{op}: dtype {:?} is not a float type; convert the tensor with .to_dtype(DType::F32)",
            storage_dtype(other)
        ),
    }
}

/// The dtype of a CPU storage (for error messages).
pub(crate) fn storage_dtype(s: &CpuStorage) -> DType {
    match s {
        CpuStorage::U8(_) => DType::U8,
        CpuStorage::U32(_) => DType::U32,
        CpuStorage::I16(_) => DType::I16,
        CpuStorage::I32(_) => DType::I32,
        CpuStorage::I64(_) => DType::I64,
        CpuStorage::BF16(_) => DType::BF16,
        CpuStorage::F16(_) => DType::F16,
        CpuStorage::F32(_) => DType::F32,
        CpuStorage::F64(_) => DType::F64,
        _ => DType::U8,
    }
}

/// Runs `f` on the CPU storage and layout of `t` (read-locked for the duration).
pub(crate) fn with_cpu<R>(
    t: &Tensor,
    op: &'static str,
    f: impl FnOnce(&CpuStorage, &Layout) -> Result<R>,
) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(s) => f(s, layout),
        _ => bail!("{op}: the fused kernel runs on the CPU only (internal error: non-CPU tensors use the composite path)"),
    }
}

/// Copies a small tensor (weights, cos/sin tables, biases) into an `f32` vector.
pub(crate) fn tensor_to_f32_vec(t: &Tensor, op: &'static str) -> Result<Vec<f32>> {
    let t = t.contiguous()?;
    with_cpu(&t, op, |s, l| to_f32_vec(s, l, op))
}

/// Wraps an owned CPU storage as a tensor of the given shape.
pub(crate) fn cpu_storage_to_tensor(s: CpuStorage, shape: &Shape) -> Result<Tensor> {
    let dev = candle_core::Device::Cpu;
    match s {
        CpuStorage::F32(v) => Tensor::from_vec(v, shape, &dev),
        CpuStorage::BF16(v) => Tensor::from_vec(v, shape, &dev),
        CpuStorage::F16(v) => Tensor::from_vec(v, shape, &dev),
        CpuStorage::F64(v) => Tensor::from_vec(v, shape, &dev),
        other => bail!(
            "internal error: unexpected {:?} gradient storage",
            storage_dtype(&other)
        ),
    }
}

/// Dispatches a generic kernel over the storage's float element type.
macro_rules! dispatch_float {
    ($storage:expr, $op:expr, $kernel:ident :: < T > ( $($arg:expr),* $(,)? )) => {
        match $storage {
            candle_core::CpuStorage::F32(_) => $kernel::<f32>($($arg),*),
            candle_core::CpuStorage::BF16(_) => $kernel::<half::bf16>($($arg),*),
            candle_core::CpuStorage::F16(_) => $kernel::<half::f16>($($arg),*),
            other => candle_core::bail!(
                "{}: dtype {:?} is not supported by the fused kernel; use f32, bf16 or f16",
                $op,
                $crate::model::ops::storage_dtype(other)
            ),
        }
    };
}
pub(crate) use dispatch_float;

/// Sum of squares of a row, accumulated in `f32` over 8 lanes so it vectorises.
#[inline]
pub(crate) fn sum_sq<T: Elem>(row: &[T]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = row.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for (a, v) in acc.iter_mut().zip(c) {
            let f = v.f();
            *a += f * f;
        }
    }
    let mut s: f32 = acc.iter().sum();
    for v in rest {
        let f = v.f();
        s += f * f;
    }
    s
}

/// Maximum of a row (`-inf` for an empty or fully `-inf` row; NaN propagates as "not greater").
#[inline]
pub(crate) fn row_max(row: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 8];
    let chunks = row.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a = if v > *a { v } else { *a };
        }
    }
    let mut m = f32::NEG_INFINITY;
    for &v in acc.iter().chain(rest) {
        if v > m {
            m = v;
        }
    }
    m
}

simd::wide_fn!(
    /// Replaces every `v` of `row` by `exp(v - shift)` and returns their sum (8 lanes,
    /// vectorises; one AVX2 vector where the CPU has it, with the same per-lane sums as the
    /// baseline build's two SSE2 vectors, so the bits do not depend on the CPU).
    pub(crate) fn exp_shift_sum_in_place<>(row: &mut [f32], shift: f32) -> f32 => exp_shift_sum_in_place_body
);

/// [`exp_shift_sum_in_place`]'s loop, inlined into the build for the CPU's vector width.
#[inline(always)]
pub(crate) fn exp_shift_sum_in_place_body(row: &mut [f32], shift: f32) -> f32 {
    let mut acc = [0f32; 8];
    let mut chunks = row.chunks_exact_mut(8);
    for c in &mut chunks {
        for (a, v) in acc.iter_mut().zip(c.iter_mut()) {
            let e = fast_exp(*v - shift);
            *v = e;
            *a += e;
        }
    }
    let mut s: f32 = acc.iter().sum();
    for v in chunks.into_remainder() {
        let e = fast_exp(*v - shift);
        *v = e;
        s += e;
    }
    s
}

/// `(Σ e, Σ e·d)` over `row` with `d = v − shift` and `e = exp(d)`; with `write` each `v`
/// becomes its `e`. The two sums give a row's entropy without another pass over its logits:
/// `H = −Σ p log p = ln Σe − (Σ e·d) / Σe`, as `log p = d − ln Σe`.
#[inline]
pub(crate) fn exp_shift_sum_dot(row: &mut [f32], shift: f32, write: bool) -> (f32, f32) {
    let (mut sums, mut dots) = ([0f32; 8], [0f32; 8]);
    let mut chunks = row.chunks_exact_mut(8);
    for c in &mut chunks {
        for ((s, t), v) in sums.iter_mut().zip(dots.iter_mut()).zip(c.iter_mut()) {
            let d = *v - shift;
            let e = fast_exp(d);
            *s += e;
            *t += e * d;
            if write {
                *v = e;
            }
        }
    }
    let (mut sum, mut dot): (f32, f32) = (sums.iter().sum(), dots.iter().sum());
    for v in chunks.into_remainder() {
        let d = *v - shift;
        let e = fast_exp(d);
        sum += e;
        dot += e * d;
        if write {
            *v = e;
        }
    }
    (sum, dot)
}

/// `sum(exp(v - shift))` over `row` without writing (8 lanes, vectorises).
#[inline]
pub(crate) fn exp_shift_sum(row: &[f32], shift: f32) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = row.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += fast_exp(v - shift);
        }
    }
    let mut s: f32 = acc.iter().sum();
    for &v in rest {
        s += fast_exp(v - shift);
    }
    s
}

/// `exp` for `f32`, accurate to about 2 ulp, written branch-free so loops over it vectorise
/// (std's `expf` is a scalar libm call and dominated the softmax/cross-entropy kernels).
/// Inputs below about -87.3 return 0 and above 88.7 return `inf`; NaN returns NaN.
#[inline(always)]
pub(crate) fn fast_exp(x: f32) -> f32 {
    const FLUSH_BELOW: f32 = -86.0;
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split into a part exact in f32 and a small correction (Cody-Waite).
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Round-to-nearest through the 1.5 * 2^23 trick: `f32::round` is a libm call on baseline
    // x86-64 (no SSE4.1) and would stop the loop from vectorising.
    const SHIFTER: f32 = 12_582_912.0;
    // The lower clamp keeps every intermediate a normal float: at -87.5 the scale factors
    // below produce subnormals, and subnormal multiplies are ~50x slower on x86 (masked
    // attention scores hit this for half of every score matrix; measured 7.4 vs 1.7 ns per
    // element of a masked softmax row).
    let xc = x.clamp(FLUSH_BELOW, 88.75);
    let t = xc * LOG2E + SHIFTER;
    let n = t - SHIFTER;
    let r = xc - n * LN2_HI - n * LN2_LO;
    // Minimax polynomial for e^r on |r| <= ln2/2 (Cephes expf coefficients).
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_6e-1;
    p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    // 2^n by building the exponent bits; n in [-127, 128] after the clamp. Split in two factors
    // so n = -127 / 128 stay representable (subnormal / overflow to inf handled by the multiply).
    let ni = (t.to_bits() as i32) - (SHIFTER.to_bits() as i32);
    let n1 = ni >> 1;
    let n2 = ni - n1;
    let s1 = f32::from_bits(((n1 + 127) as u32) << 23);
    let s2 = f32::from_bits(((n2 + 127) as u32) << 23);
    let out = y * s1 * s2;
    // Below the clamp the true value is < 4.5e-38: flush to exactly 0 so masked scores vanish.
    let out = if x < FLUSH_BELOW { 0.0 } else { out };
    let out = if x > 88.75 { f32::INFINITY } else { out };
    if x.is_nan() {
        x
    } else {
        out
    }
}

#[cfg(test)]
mod tests {
    use super::{bf16, bf16_to_f32, f16, f32_to_bf16, f32_to_f16, fast_exp};

    /// Pseudo-random 32-bit patterns (xorshift) from `seed`.
    fn random_bits(mut state: u64) -> impl Iterator<Item = u32> {
        std::iter::repeat_with(move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u32
        })
    }

    /// Every upper half of the f32 bit patterns, each with the low halves that decide the
    /// rounding (ties, just below and above them, odd and even results), and random values.
    #[test]
    fn branch_free_f16_rounding_matches_half_bit_for_bit() {
        let lows = [0u32, 0x0FFF, 0x1000, 0x1001, 0x1FFF, 0x2000, 0x3000, 0xFFFF];
        let patterns = (0..=u16::MAX)
            .flat_map(|hi| lows.iter().map(move |lo| (u32::from(hi) << 16) | lo))
            .chain(random_bits(0x2545_F491_4F6C_DD1D).take(1_000_000));
        for b in patterns {
            let v = f32::from_bits(b);
            assert_eq!(
                f32_to_f16(v).to_bits(),
                f16::from_f32(v).to_bits(),
                "{b:#010x} ({v:e})"
            );
        }
    }

    #[test]
    fn branch_free_bf16_conversions_match_half_bit_for_bit() {
        for i in 0..=u16::MAX {
            let x = bf16::from_bits(i);
            assert_eq!(bf16_to_f32(x).to_bits(), x.to_f32().to_bits(), "{i:#06x}");
        }
        let specials = [
            0u32,
            0x8000_0000,
            0x7F80_0000,
            0xFF80_0000,
            0x7F80_0001,
            0x7FC0_0000,
            0xFFFF_FFFF,
            0x7F7F_FFFF,
            0x0000_8000,
            0x0001_8000,
            0x3F80_8000,
            0x3F81_8000,
            0x3F80_8001,
        ];
        for b in specials
            .into_iter()
            .chain(random_bits(0x9E37_79B9_7F4A_7C15).take(2_000_000))
        {
            let v = f32::from_bits(b);
            assert_eq!(
                f32_to_bf16(v).to_bits(),
                bf16::from_f32(v).to_bits(),
                "{b:#010x}"
            );
        }
    }

    #[test]
    fn fast_exp_matches_std_exp() {
        let mut x = -90.0f32;
        while x < 89.0 {
            let want = x.exp();
            let got = fast_exp(x);
            if x < -86.0 {
                // Flushed: the true value is below 4.5e-38.
                assert_eq!(got, 0.0, "exp({x})");
            } else if want == 0.0 || want.is_infinite() {
                assert!(got == want || got.abs() < 1e-37 || (want.is_infinite() && got > 1e38));
            } else if want > f32::MIN_POSITIVE {
                let rel = ((got - want) / want).abs();
                assert!(rel < 5e-7, "exp({x}) = {got}, std {want}, rel {rel}");
            }
            x += 0.0137;
        }
        assert_eq!(fast_exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(fast_exp(0.0), 1.0);
        assert!(fast_exp(f32::INFINITY).is_infinite());
        assert!(fast_exp(f32::NAN).is_nan());
    }
}
