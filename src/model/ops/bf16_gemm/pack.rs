//! The packing both tile kernels share: the right operand's panels of [`NR`] columns of bf16
//! pairs, and the AVX-512 helpers the kernels' own left-operand packing uses (the pair
//! interleave, the 16 × 16 transpose of 32-bit lanes).
//!
//! Panel `jp`, pair `p`, column `j` holds `(b[2p][jp·NR + j], b[2p + 1][jp·NR + j])`, one `u32`
//! per column and pair of rows: the dot-product instruction's operand, and for AMX 16 pairs of
//! rows of 16 columns are one 16-row × 64-byte tile (row stride 128 bytes).

use super::PackElem;
use crate::model::ops::matmul::MatRef;

/// Columns of a right-operand panel: the dot-product kernel's tile width (two 16-lane
/// vectors) and the AMX kernel's (two 16-column tiles).
pub(super) const NR: usize = 32;

/// Two bf16 values as the instruction's pair (`lo` in the low half).
#[inline(always)]
pub(super) fn pair(lo: u16, hi: u16) -> u32 {
    u32::from(lo) | (u32::from(hi) << 16)
}

/// Element `(r, c)` of a checked view as bf16 bits.
///
/// # Safety
/// `(r, c)` lies inside the view, and the view passed [`MatRef::check`].
#[inline(always)]
pub(super) unsafe fn bits_at<T: PackElem>(m: &MatRef<'_, T>, r: usize, c: usize) -> u16 {
    m.data
        .get_unchecked(r * m.row_stride + c * m.col_stride)
        .bf16_bits()
}

/// The pair `(m[r0][c], m[r0 + 1][c])`, the second zero when row `r0 + 1` is past `end`.
///
/// # Safety
/// As [`bits_at`], for row `r0` (and `r0 + 1` when it is before `end`).
#[inline(always)]
unsafe fn row_pair<T: PackElem>(m: &MatRef<'_, T>, r0: usize, end: usize, c: usize) -> u32 {
    let hi = if r0 + 1 < end {
        bits_at(m, r0 + 1, c)
    } else {
        0
    };
    pair(bits_at(m, r0, c), hi)
}

/// Packs rows `k0 .. k0 + kc` of `rhs` into panels of [`NR`] columns and `panel_pairs`
/// (≥ `kc / 2`, rounded up) pairs of rows: panel `jp`, pair `p`, column `j` holds
/// `(rhs[k0 + 2p][jp·NR + j], rhs[k0 + 2p + 1][jp·NR + j])`, zero past the matrix (an odd last
/// row pairs with zero, and pairs past `kc` are zero). The loop runs along whichever direction
/// the view is contiguous in (columns of a row-major matrix, rows of a transposed one).
///
/// # Safety
/// `rhs` passed [`MatRef::check`] and `k0 + kc ≤ rhs.rows`; `packed` holds every panel; the
/// caller's CPU has AVX512-BF16 and BW (the SIMD panels are inlined into it).
#[inline(always)]
pub(super) unsafe fn pack_rhs<B: PackElem>(
    packed: &mut [u32],
    rhs: MatRef<'_, B>,
    (k0, kc): (usize, usize),
    panel_pairs: usize,
) {
    let pairs = kc.div_ceil(2);
    let (n, end) = (rhs.cols, k0 + kc);
    for (jp, panel) in packed
        .chunks_exact_mut(panel_pairs * NR)
        .take(n.div_ceil(NR))
        .enumerate()
    {
        let j0 = jp * NR;
        let cols = NR.min(n - j0);
        panel[pairs * NR..].fill(0);
        if cols == NR && simd::rhs_panel(panel, &rhs, (k0, kc), j0) {
            continue;
        }
        if rhs.row_stride == 1 {
            for j in 0..cols {
                for p in 0..pairs {
                    *panel.get_unchecked_mut(p * NR + j) = row_pair(&rhs, k0 + 2 * p, end, j0 + j);
                }
            }
        } else {
            for p in 0..pairs {
                let row = panel.get_unchecked_mut(p * NR..p * NR + cols);
                for (j, out) in row.iter_mut().enumerate() {
                    *out = row_pair(&rhs, k0 + 2 * p, end, j0 + j);
                }
            }
        }
        if cols < NR {
            for p in 0..pairs {
                panel[p * NR + cols..(p + 1) * NR].fill(0);
            }
        }
    }
}

/// AVX-512 packing of whole right panels from the layouts a layer's products use (scalar
/// packing was ≈ 40 % of the products' time), and the helpers the kernels' left packing shares.
#[cfg(target_arch = "x86_64")]
pub(super) mod simd {
    use super::{PackElem, NR};
    use crate::model::ops::matmul::MatRef;
    use std::arch::x86_64::*;

    /// Lane `2i` takes bf16 lane `i` of the first operand, lane `2i + 1` lane `i` of the second
    /// (`_mm512_permutex2var_epi16` indices: 0–31 the first, 32–63 the second).
    pub(in crate::model::ops::bf16_gemm) const INTERLEAVE_LO: [u16; 32] = interleave(0);
    const INTERLEAVE_HI: [u16; 32] = interleave(16);

    const fn interleave(from: u16) -> [u16; 32] {
        let mut idx = [0u16; 32];
        let mut i = 0;
        while i < 16 {
            idx[2 * i] = from + i as u16;
            idx[2 * i + 1] = 32 + from + i as u16;
            i += 1;
        }
        idx
    }

    #[inline(always)]
    pub(in crate::model::ops::bf16_gemm) unsafe fn index(table: &[u16; 32]) -> __m512i {
        _mm512_loadu_si512(table.as_ptr().cast())
    }

    /// 32 values of a row from `ptr` as bf16 lanes (`f32` values rounded to nearest even).
    #[inline(always)]
    unsafe fn load32<T: PackElem>(ptr: *const T) -> __m512i {
        if T::IS_F32 {
            let f = ptr.cast::<f32>();
            let lo = _mm512_loadu_ps(f);
            let hi = _mm512_loadu_ps(f.add(16));
            std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(hi, lo))
        } else {
            _mm512_loadu_si512(ptr.cast())
        }
    }

    /// Packs one full [`NR`]-column panel of `rhs` (rows `k0 .. k0 + kc`, from column `j0`) when
    /// its rows are contiguous; false (nothing written) for other layouts.
    ///
    /// # Safety
    /// As `pack_rhs`, for a panel of [`NR`] columns inside the view; AVX512-BF16 and BW.
    #[inline(always)]
    pub(super) unsafe fn rhs_panel<T: PackElem>(
        panel: &mut [u32],
        rhs: &MatRef<'_, T>,
        (k0, kc): (usize, usize),
        j0: usize,
    ) -> bool {
        if rhs.row_stride == 1 && !T::IS_F32 && kc % 2 == 0 {
            transposed_rhs_panel(panel, rhs, (k0, kc), j0);
            return true;
        }
        if rhs.col_stride != 1 {
            return false;
        }
        let (lo_idx, hi_idx) = (index(&INTERLEAVE_LO), index(&INTERLEAVE_HI));
        let base = rhs.data.as_ptr();
        let out = panel.as_mut_ptr();
        for p in 0..kc / 2 {
            let r0 = load32(base.add((k0 + 2 * p) * rhs.row_stride + j0));
            let r1 = load32(base.add((k0 + 2 * p + 1) * rhs.row_stride + j0));
            let dst = out.add(p * NR);
            _mm512_storeu_si512(dst.cast(), _mm512_permutex2var_epi16(r0, lo_idx, r1));
            _mm512_storeu_si512(
                dst.add(16).cast(),
                _mm512_permutex2var_epi16(r0, hi_idx, r1),
            );
        }
        if kc % 2 == 1 {
            // The odd last row pairs with zero.
            let p = kc / 2;
            let r0 = load32(base.add((k0 + 2 * p) * rhs.row_stride + j0));
            let zero = _mm512_setzero_si512();
            let dst = out.add(p * NR);
            _mm512_storeu_si512(dst.cast(), _mm512_permutex2var_epi16(r0, lo_idx, zero));
            _mm512_storeu_si512(
                dst.add(16).cast(),
                _mm512_permutex2var_epi16(r0, hi_idx, zero),
            );
        }
        true
    }

    /// [`rhs_panel`] for bf16 data whose columns are contiguous (a transposed row-major
    /// weight, `x @ Wᵀ`): pair `p` of column `j` is one `u32` of column `j`'s data. For 16
    /// columns at a time, 16 pairs of each column are one load, and a transpose in registers
    /// turns them into 16 pairs of 16 columns, as the AMX kernel packs it. (It was one
    /// 16-lane gather per pair and 16 columns, ≈ 20 % of the packing's samples in a profile
    /// of the bf16-mixed step on a Zen 5 EPYC; the step did not get measurably faster there,
    /// 498 → 501 tokens/s, but gathers are microcoded on Intel CPUs under the Gather Data
    /// Sampling mitigation.)
    ///
    /// # Safety
    /// As [`rhs_panel`], with `rhs.row_stride == 1`, bf16 elements and an even `kc`.
    #[inline(always)]
    unsafe fn transposed_rhs_panel<T: PackElem>(
        panel: &mut [u32],
        rhs: &MatRef<'_, T>,
        (k0, kc): (usize, usize),
        j0: usize,
    ) {
        let pairs = kc / 2;
        let out = panel.as_mut_ptr();
        for half in 0..NR / 16 {
            let col0 = rhs
                .data
                .as_ptr()
                .add((j0 + 16 * half) * rhs.col_stride + k0)
                .cast::<u16>();
            for p0 in (0..pairs).step_by(16) {
                let n = (pairs - p0).min(16);
                let mask: __mmask32 = if n == 16 { !0 } else { (1u32 << (2 * n)) - 1 };
                let mut cols = [_mm512_setzero_si512(); 16];
                for (j, v) in cols.iter_mut().enumerate() {
                    let at = col0.add(j * rhs.col_stride + 2 * p0);
                    *v = _mm512_maskz_loadu_epi16(mask, at.cast());
                }
                let rows = transpose16(cols);
                for (q, row) in rows.iter().enumerate().take(n) {
                    _mm512_storeu_si512(out.add((p0 + q) * NR + 16 * half).cast(), *row);
                }
            }
        }
    }

    /// `cols[q]` lane `i` = `r[i]` lane `q`: the 16 × 16 transpose of 32-bit lanes (pairs,
    /// then quads within 128-bit blocks, then the blocks). Both kernels' left packing and
    /// the right packing of transposed bf16 use it.
    ///
    /// # Safety
    /// AVX-512 (inlined into the caller's target features).
    #[inline(always)]
    pub(in crate::model::ops::bf16_gemm) unsafe fn transpose16(r: [__m512i; 16]) -> [__m512i; 16] {
        // Plain loops, no closures: a closure does not inherit the caller's target features,
        // and written with `std::array::from_fn` this transpose made the bf16-mixed step 13 %
        // slower than the scalar stores it replaces (405 against 465 tokens/s, Zen 5).
        let zero = _mm512_setzero_si512();
        // t[2h] / t[2h + 1]: rows 2h, 2h + 1 interleaved (low / high halves of each block).
        let mut t = [zero; 16];
        for h in 0..8 {
            t[2 * h] = _mm512_unpacklo_epi32(r[2 * h], r[2 * h + 1]);
            t[2 * h + 1] = _mm512_unpackhi_epi32(r[2 * h], r[2 * h + 1]);
        }
        // u[4g + j]: in block L, rows 4g .. 4g + 4 of column 4L + j.
        let mut u = [zero; 16];
        for g in 0..4 {
            u[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
            u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
            u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
            u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
        }
        let mut cols = [zero; 16];
        for j in 0..4 {
            // Blocks 0–1 (`0x44`) and 2–3 (`0xEE`) of rows 0–7, then of rows 8–15.
            let lo01 = _mm512_shuffle_i32x4::<0x44>(u[j], u[4 + j]);
            let hi01 = _mm512_shuffle_i32x4::<0x44>(u[8 + j], u[12 + j]);
            let lo23 = _mm512_shuffle_i32x4::<0xEE>(u[j], u[4 + j]);
            let hi23 = _mm512_shuffle_i32x4::<0xEE>(u[8 + j], u[12 + j]);
            // Column 4L + j: the even blocks (`0x88`) or the odd ones (`0xDD`) of the two.
            cols[j] = _mm512_shuffle_i32x4::<0x88>(lo01, hi01);
            cols[4 + j] = _mm512_shuffle_i32x4::<0xDD>(lo01, hi01);
            cols[8 + j] = _mm512_shuffle_i32x4::<0x88>(lo23, hi23);
            cols[12 + j] = _mm512_shuffle_i32x4::<0xDD>(lo23, hi23);
        }
        cols
    }
}

/// Off x86-64 nothing is packed with SIMD (and nothing runs: neither kernel is available).
#[cfg(not(target_arch = "x86_64"))]
pub(super) mod simd {
    use super::PackElem;
    use crate::model::ops::matmul::MatRef;
    pub(super) unsafe fn rhs_panel<T: PackElem>(
        _: &mut [u32],
        _: &MatRef<'_, T>,
        _: (usize, usize),
        _: usize,
    ) -> bool {
        false
    }
}
