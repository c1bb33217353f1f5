//! Runtime choice of the vector width for the elementwise loops of our own kernels.
//!
//! The crate is built for baseline x86-64 (SSE2), so that one binary runs on every x86 CPU;
//! gemm picks its AVX2 / AVX-512 kernels at run time, but our loops (AdamW, the bf16 ↔ f32
//! conversions, ...) were 4-wide SSE2 code. [`wide_fn`] defines a function that runs its body
//! compiled for AVX2 + FMA when the CPU has them: the body is inlined into a
//! `#[target_feature]` function, so its loops are vectorised 8-wide there. Results are bit for bit those of the SSE2 build: Rust
//! never contracts `a * b + c` into an FMA on its own, and the integer rounding of
//! `f32_to_bf16` is exact either way. Measured on the SmolLM2-135M bf16-mixed step (AMD EPYC,
//! Zen 4): the SSE2 AdamW update with a master copy took 0.19–0.20 s of the 2.2 s step.

/// Whether this CPU has AVX2 and FMA (cached by the standard library after the first call).
#[inline]
pub(crate) fn has_avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Defines `fn $name(args)` that runs `$body(args)` (an `#[inline(always)]` function) compiled
/// for AVX2 + FMA when [`has_avx2_fma`], and the baseline build otherwise. A closure handed to
/// a `#[target_feature]` function is not reliably inlined into it (the AdamW update stayed
/// SSE2 that way), an `#[inline(always)]` function always is.
macro_rules! wide_fn {
    ($(#[$meta:meta])* $vis:vis fn $name:ident<$($g:ident: $bound:path),*>($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? => $body:path) => {
        $(#[$meta])*
        $vis fn $name<$($g: $bound),*>($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                unsafe fn fast<$($g: $bound),*>($($arg: $ty),*) $(-> $ret)? {
                    $body($($arg),*)
                }
                if $crate::model::ops::simd::has_avx2_fma() {
                    // SAFETY: `fast` only requires AVX2 and FMA, which the CPU has.
                    return unsafe { fast($($arg),*) };
                }
            }
            $body($($arg),*)
        }
    };
}
pub(crate) use wide_fn;

use super::Elem;
use half::f16;
use rayon::prelude::*;
use std::mem::MaybeUninit;

/// Half-precision data as `f32` (multithreaded, no zero-fill first: the output is written
/// once; the zero-fill was ≈ 1 % of the SmolLM2-135M bf16-mixed step).
pub(crate) fn widen_par<T: Elem>(s: &[T]) -> Vec<f32> {
    if let Some(h) = as_f16(s) {
        if has_f16c() {
            return convert_par(h, widen_f16_chunk);
        }
    }
    convert_par(s, widen_chunk_wide::<T>)
}

/// `s` as `f16` values when `T` is `f16`.
fn as_f16<T: Elem>(s: &[T]) -> Option<&[f16]> {
    (std::any::TypeId::of::<T>() == std::any::TypeId::of::<f16>()).then(|| {
        // SAFETY: `T` is `f16` (same type id), so the slice is reinterpreted as itself.
        unsafe { std::slice::from_raw_parts(s.as_ptr().cast::<f16>(), s.len()) }
    })
}

/// Whether this CPU converts f16 ↔ f32 in hardware (F16C, with AVX).
fn has_f16c() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("f16c") && std::arch::is_x86_feature_detected!("avx")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Writes `s` widened into `o` (same length), eight values per F16C instruction. `half`
/// converts one value per call (through the same instruction): on the fp16-mixed LoRA step of
/// the SmolLM2-135M shape its calls and the loop around them were 16 % of the time.
fn widen_f16_chunk(o: &mut [MaybeUninit<f32>], s: &[f16]) {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx,f16c")]
        unsafe fn f16c(o: &mut [MaybeUninit<f32>], s: &[f16]) {
            use std::arch::x86_64::{__m128i, _mm256_cvtph_ps, _mm256_storeu_ps, _mm_loadu_si128};
            let whole = s.len() / 8 * 8;
            for i in (0..whole).step_by(8) {
                let v = _mm_loadu_si128(s.as_ptr().add(i).cast::<__m128i>());
                _mm256_storeu_ps(o.as_mut_ptr().add(i).cast::<f32>(), _mm256_cvtph_ps(v));
            }
            widen_chunk(&mut o[whole..], &s[whole..]);
        }
        // SAFETY: only called when `has_f16c`; `o` and `s` have the same length (the loop
        // reads and writes whole groups of eight below it).
        unsafe { f16c(o, s) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    widen_chunk(o, s)
}

/// `v` rounded to `T` (multithreaded, no zero-fill first).
pub(crate) fn narrow_par<T: Elem>(v: &[f32]) -> Vec<T> {
    convert_par(v, narrow_chunk_wide::<T>)
}

/// `src` converted element by element by `chunk` (which writes every element of its output
/// chunk), on every thread, into a vector that is never zero-filled.
fn convert_par<S: Sync, D: Send>(src: &[S], chunk: fn(&mut [MaybeUninit<D>], &[S])) -> Vec<D> {
    let mut out = Vec::with_capacity(src.len());
    out.spare_capacity_mut()
        .par_chunks_mut(1 << 14)
        .zip(src.par_chunks(1 << 14))
        .for_each(|(o, s)| chunk(o, s));
    // SAFETY: the chunks of the spare capacity and of `src` pair up one to one and cover
    // `src.len()` elements, and `chunk` wrote every element of each.
    unsafe { out.set_len(src.len()) };
    out
}

/// Writes `s` widened into `o` (same length).
#[inline(always)]
fn widen_chunk<T: Elem>(o: &mut [MaybeUninit<f32>], s: &[T]) {
    o.iter_mut().zip(s).for_each(|(o, s)| {
        o.write(s.f());
    });
}

wide_fn!(
    /// [`widen_chunk`], compiled for the CPU's vector width.
    fn widen_chunk_wide<T: Elem>(o: &mut [MaybeUninit<f32>], s: &[T]) => widen_chunk
);

/// Writes `v` rounded into `o` (same length).
#[inline(always)]
fn narrow_chunk<T: Elem>(o: &mut [MaybeUninit<T>], v: &[f32]) {
    o.iter_mut().zip(v).for_each(|(o, v)| {
        o.write(T::of(*v));
    });
}

wide_fn!(
    /// [`narrow_chunk`], compiled for the CPU's vector width.
    fn narrow_chunk_wide<T: Elem>(o: &mut [MaybeUninit<T>], v: &[f32]) => narrow_chunk
);

#[cfg(test)]
mod tests {
    use crate::model::ops::{bf16_to_f32, f32_to_bf16, Elem};
    use half::{bf16, f16};

    #[inline(always)]
    fn narrow_into<T: Elem>(out: &mut [T], xs: &[f32]) {
        out.iter_mut().zip(xs).for_each(|(o, &x)| *o = T::of(x));
    }
    #[inline(always)]
    fn widen_into<T: Elem>(out: &mut [f32], xs: &[T]) {
        out.iter_mut().zip(xs).for_each(|(o, &x)| *o = x.f());
    }
    super::wide_fn!(fn narrow_wide<T: Elem>(out: &mut [T], xs: &[f32]) => narrow_into);
    super::wide_fn!(fn widen_wide<T: Elem>(out: &mut [f32], xs: &[T]) => widen_into);

    /// The wide build rounds and widens exactly like the baseline one, NaNs and subnormals
    /// included.
    #[test]
    fn wide_loops_match_the_baseline_bit_for_bit() {
        let xs: Vec<f32> = (0..4096u32)
            .map(|i| f32::from_bits(i.wrapping_mul(2_654_435_761)))
            .chain([f32::NAN, -0.0, f32::INFINITY, 1e-40, -1e-39])
            .collect();
        let base: Vec<bf16> = xs.iter().map(|&x| f32_to_bf16(x)).collect();
        let mut fast = vec![bf16::ZERO; xs.len()];
        narrow_wide(&mut fast, &xs);
        let bits = |v: &[bf16]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&base), bits(&fast));
        let back: Vec<u32> = base.iter().map(|&x| bf16_to_f32(x).to_bits()).collect();
        let mut wide_back = vec![0f32; xs.len()];
        widen_wide(&mut wide_back, &base);
        let wide_back: Vec<u32> = wide_back.iter().map(|x| x.to_bits()).collect();
        assert_eq!(back, wide_back);
        // And the multithreaded, no-zero-fill conversions the kernels use.
        assert_eq!(bits(&super::narrow_par::<bf16>(&xs)), bits(&base));
        let par: Vec<u32> = super::widen_par(&base)
            .iter()
            .map(|x| x.to_bits())
            .collect();
        assert_eq!(par, back);
        // f16 rounding in the wide build (the AdamW update's loop) equals `half`'s.
        let f16_bits = |v: &[f16]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let mut wide_f16 = vec![f16::ZERO; xs.len()];
        narrow_wide(&mut wide_f16, &xs);
        let want_f16: Vec<f16> = xs.iter().map(|&x| f16::from_f32(x)).collect();
        assert_eq!(f16_bits(&wide_f16), f16_bits(&want_f16));
        // f16 through F16C, eight at a time, equals `half`'s conversion (every bit pattern,
        // NaNs and subnormals included, and a tail shorter than eight).
        let halves: Vec<f16> = (0..=u16::MAX)
            .chain([1, 2, 3])
            .map(f16::from_bits)
            .collect();
        let want: Vec<u32> = halves.iter().map(|h| h.to_f32().to_bits()).collect();
        let got: Vec<u32> = super::widen_par(&halves)
            .iter()
            .map(|x| x.to_bits())
            .collect();
        assert_eq!(got, want);
    }
}
