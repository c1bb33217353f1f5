//! The AVX512-BF16 tile kernel: an [`MR`] × [`NR`] block of the product on the bf16
//! dot-product instruction (`vdpbf16ps`), its sums in 24 of the 32 vector registers.
//!
//! `vdpbf16ps` does two multiply-adds per f32 lane where an FMA does one: on the AMD EPYC
//! (Zen 4) bench machine one core ran 227 GFLOP/s of it against 115 GFLOP/s of `vfmadd231ps`
//! (12 independent accumulators, no loads). PyTorch's CPU autocast uses it through oneDNN.
//!
//! The left operand is packed into panels of [`MR`] rows holding the pairs
//! `(a[i][2p], a[i][2p + 1])`; the right one is the driver's shared panels
//! ([`super::pack::pack_rhs`]).

use super::driver::TileKernel;
use super::pack::{bits_at, pair, NR};
use super::PackElem;
use crate::model::ops::matmul::MatRef;

/// Rows of the kernel's tile.
const MR: usize = 12;
/// Rows of the left operand packed at once (`MC · KC · 2` bytes = 48 KiB, in L2).
const MC: usize = 8 * MR;

/// The AVX512-BF16 dot-product kernel.
pub(crate) struct Avx512Tile;

impl TileKernel for Avx512Tile {
    const NAME: &'static str = "bf16 gemm";
    const MISSING: &'static str = "this CPU has no AVX512-BF16";
    const MR: usize = MR;
    const MC: usize = MC;
    const K_STEP: usize = 2;

    fn available() -> bool {
        available()
    }

    #[inline(always)]
    unsafe fn pack_lhs<A: PackElem>(
        packed: &mut [u32],
        lhs: MatRef<'_, A>,
        rows: (usize, usize),
        inner: (usize, usize),
    ) {
        pack_lhs(packed, lhs, rows, inner);
    }

    #[inline(always)]
    unsafe fn tile(
        kp: usize,
        a: *const u32,
        b: *const u32,
        (c, ldc): (*mut f32, usize),
        (rows, cols): (usize, usize),
        overwrite: bool,
    ) {
        kernel(kp / 2, a, b, c, ldc, rows, cols, overwrite);
    }
}

/// Whether this CPU has the bf16 dot-product instruction (AVX512-BF16).
fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The pair `(m[r][c0], m[r][c0 + 1])`, the second zero when column `c0 + 1` is past `end`.
///
/// # Safety
/// As [`bits_at`], for column `c0` (and `c0 + 1` when it is before `end`).
#[inline(always)]
unsafe fn col_pair<T: PackElem>(m: &MatRef<'_, T>, r: usize, c0: usize, end: usize) -> u32 {
    let hi = if c0 + 1 < end {
        bits_at(m, r, c0 + 1)
    } else {
        0
    };
    pair(bits_at(m, r, c0), hi)
}

/// Packs rows `m0 .. m0 + mc`, columns `k0 .. k0 + kc` of `lhs` into panels of [`MR`] rows:
/// panel `ip`, pair `p`, row `i` holds `(lhs[m0 + ip·MR + i][k0 + 2p], … [k0 + 2p + 1])`, zero
/// past the matrix; along the view's contiguous direction, like [`super::pack::pack_rhs`].
///
/// # Safety
/// `lhs` passed [`MatRef::check`], `m0 + mc ≤ lhs.rows` and `k0 + kc ≤ lhs.cols`; `packed`
/// holds every panel.
#[inline(always)]
unsafe fn pack_lhs<A: PackElem>(
    packed: &mut [u32],
    lhs: MatRef<'_, A>,
    (m0, mc): (usize, usize),
    (k0, kc): (usize, usize),
) {
    let pairs = kc.div_ceil(2);
    let end = k0 + kc;
    for (ip, panel) in packed
        .chunks_exact_mut(pairs * MR)
        .take(mc.div_ceil(MR))
        .enumerate()
    {
        let i0 = m0 + ip * MR;
        let rows = MR.min(m0 + mc - i0);
        if rows == MR && simd::lhs_panel(panel, &lhs, (k0, kc), i0) {
            continue;
        }
        if lhs.col_stride == 1 {
            for i in 0..rows {
                for p in 0..pairs {
                    *panel.get_unchecked_mut(p * MR + i) = col_pair(&lhs, i0 + i, k0 + 2 * p, end);
                }
            }
        } else {
            for p in 0..pairs {
                for i in 0..rows {
                    *panel.get_unchecked_mut(p * MR + i) = col_pair(&lhs, i0 + i, k0 + 2 * p, end);
                }
            }
        }
        if rows < MR {
            for p in 0..pairs {
                panel[p * MR + rows..(p + 1) * MR].fill(0);
            }
        }
    }
}

/// AVX-512 packing of whole left panels from the layouts a layer's products use.
#[cfg(target_arch = "x86_64")]
mod simd {
    use super::super::pack::simd::{index, transpose16, INTERLEAVE_LO};
    use super::{PackElem, MR};
    use crate::model::ops::matmul::MatRef;
    use std::arch::x86_64::*;

    /// Packs one full [`MR`]-row panel of `lhs` (columns `k0 .. k0 + kc`, from row `i0`):
    /// rows contiguous (each row's pairs are consecutive) or columns contiguous (a pair joins
    /// two columns); false for other layouts or element types. Any `kc`: the last chunk of a
    /// row is a masked load, and an odd last column pairs with zero. (The lm head's weight
    /// gradient has one row per trained token, 255 for a 256-token row and any count under
    /// prompt masking; with only multiples of 32 packed here, its 49,152 × 255 left operand
    /// went through the scalar loop, the hottest spot of the packing in a profile on a Zen 5
    /// EPYC. The step did not get measurably faster without it: those reads are strided.)
    ///
    /// # Safety
    /// As `pack_lhs`, for a panel of [`MR`] rows inside the view; AVX512-BF16 and BW.
    #[inline(always)]
    pub(super) unsafe fn lhs_panel<T: PackElem>(
        panel: &mut [u32],
        lhs: &MatRef<'_, T>,
        (k0, kc): (usize, usize),
        i0: usize,
    ) -> bool {
        if !T::IS_F32 {
            return false;
        }
        let base = lhs.data.as_ptr().cast::<f32>();
        let out = panel.as_mut_ptr();
        if lhs.col_stride == 1 {
            // Pairs `p .. p + 16` of row `i` are 32 consecutive values: one conversion per
            // row gives the 12 × 16 pairs of the panel's rows, transposed in registers into
            // 16 columns of 12 pairs, each one masked store (it was 16 scalar stores per row:
            // the bf16-mixed step went from 470 to 474–485 tokens/s, SmolLM2-135M, Zen 5).
            for chunk in 0..kc.div_ceil(32) {
                let left = (kc - 32 * chunk).min(32);
                // The four rows past the panel's MR stay zero.
                let mut rows = [_mm512_setzero_si512(); 16];
                for (i, v) in rows.iter_mut().take(MR).enumerate() {
                    let row = base.add((i0 + i) * lhs.row_stride + k0 + 32 * chunk);
                    *v = load32_f32_masked(row, left);
                }
                let cols = transpose16(rows);
                for (q, col) in cols.iter().enumerate().take(left.div_ceil(2)) {
                    _mm512_mask_storeu_epi32(
                        out.add((16 * chunk + q) * MR).cast(),
                        ROWS_MASK,
                        *col,
                    );
                }
            }
            return true;
        }
        if lhs.row_stride == 1 {
            // Columns `2p` and `2p + 1` hold the panel's rows contiguously: their first 16
            // rows interleave into the pairs of 16 rows, of which the panel stores MR.
            let lo_idx = index(&INTERLEAVE_LO);
            let mask = ROWS_MASK;
            for p in 0..kc.div_ceil(2) {
                let c0 = base.add((k0 + 2 * p) * lhs.col_stride + i0);
                let v0 = _mm512_maskz_loadu_ps(mask, c0);
                let v1 = if 2 * p + 1 < kc {
                    _mm512_maskz_loadu_ps(mask, c0.add(lhs.col_stride))
                } else {
                    _mm512_setzero_ps()
                };
                let both: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(v1, v0));
                // bf16 lanes 0–15 are column 2p, 16–31 column 2p + 1.
                let pairs = _mm512_permutexvar_epi16(lo_idx_single(lo_idx), both);
                _mm512_mask_storeu_epi32(out.add(p * MR).cast(), mask, pairs);
            }
            return true;
        }
        false
    }

    /// The lanes of a panel column: [`MR`] rows.
    const ROWS_MASK: __mmask16 = ((1u32 << MR) - 1) as __mmask16;

    /// The first `n` (≤ 32) of 32 `f32` values from `ptr` as bf16 lanes, zero past `n`; only
    /// the `n` values are read.
    #[inline(always)]
    unsafe fn load32_f32_masked(ptr: *const f32, n: usize) -> __m512i {
        let bits = |count: usize| -> __mmask16 { ((1u32 << count.min(16)) - 1) as __mmask16 };
        let lo = _mm512_maskz_loadu_ps(bits(n), ptr);
        let hi = _mm512_maskz_loadu_ps(bits(n.saturating_sub(16)), ptr.wrapping_add(16));
        std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(hi, lo))
    }

    /// The two-operand interleave indices as a one-operand permutation of a vector whose
    /// halves are the two operands (index `32 + i` becomes `16 + i`).
    #[inline(always)]
    unsafe fn lo_idx_single(lo_idx: __m512i) -> __m512i {
        let sixteen = _mm512_set1_epi16(16);
        let second = _mm512_cmpge_epu16_mask(lo_idx, _mm512_set1_epi16(32));
        _mm512_mask_sub_epi16(lo_idx, second, lo_idx, sixteen)
    }
}

/// Off x86-64 nothing is packed with SIMD (and nothing runs: [`available`] is false).
#[cfg(not(target_arch = "x86_64"))]
mod simd {
    use super::PackElem;
    use crate::model::ops::matmul::MatRef;
    pub(super) unsafe fn lhs_panel<T: PackElem>(
        _: &mut [u32],
        _: &MatRef<'_, T>,
        _: (usize, usize),
        _: usize,
    ) -> bool {
        false
    }
}

/// `c[..rows][..cols] (+)= a · b` for one `MR × NR` tile over `pairs` packed pairs.
///
/// # Safety
/// AVX512-BF16; `a` holds `pairs · MR` and `b` `pairs · NR` values; `c` is valid for `rows`
/// rows of `cols` elements, `ldc` apart.
#[allow(clippy::too_many_arguments)]
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn kernel(
    pairs: usize,
    a: *const u32,
    b: *const u32,
    c: *mut f32,
    ldc: usize,
    rows: usize,
    cols: usize,
    overwrite: bool,
) {
    use std::arch::x86_64::*;
    let mut lo = [_mm512_setzero_ps(); MR];
    let mut hi = [_mm512_setzero_ps(); MR];
    for p in 0..pairs {
        let b0: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(p * NR).cast()));
        let b1: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(p * NR + 16).cast()));
        let ap = a.add(p * MR);
        for i in 0..MR {
            let av: __m512bh = std::mem::transmute(_mm512_set1_epi32(*ap.add(i) as i32));
            lo[i] = _mm512_dpbf16_ps(lo[i], av, b0);
            hi[i] = _mm512_dpbf16_ps(hi[i], av, b1);
        }
    }
    let mask = |from: usize| -> __mmask16 {
        let n = cols.saturating_sub(from).min(16);
        ((1u32 << n) - 1) as __mmask16
    };
    let (m0, m1) = (mask(0), mask(16));
    for i in 0..rows {
        let row = c.add(i * ldc);
        let (v0, v1) = if overwrite {
            (lo[i], hi[i])
        } else {
            (
                _mm512_add_ps(lo[i], _mm512_maskz_loadu_ps(m0, row)),
                _mm512_add_ps(hi[i], _mm512_maskz_loadu_ps(m1, row.add(16))),
            )
        };
        _mm512_mask_storeu_ps(row, m0, v0);
        _mm512_mask_storeu_ps(row.add(16), m1, v1);
    }
}

/// Never called: [`available`] is false off x86-64.
#[allow(clippy::too_many_arguments)]
#[cfg(not(target_arch = "x86_64"))]
unsafe fn kernel(
    _: usize,
    _: *const u32,
    _: *const u32,
    _: *mut f32,
    _: usize,
    _: usize,
    _: usize,
    _: bool,
) {
    unreachable!("bf16 gemm without AVX512-BF16")
}
