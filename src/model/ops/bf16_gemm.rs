//! Products of bf16 operands on the CPU's bf16 dot-product instruction (`vdpbf16ps`,
//! AVX512-BF16), accumulated in f32.
//!
//! Half-precision layers used to widen their bf16 weights and multiply in f32 with gemm's
//! kernels. `vdpbf16ps` does two multiply-adds per f32 lane where an FMA does one: on the AMD
//! EPYC (Zen 4) bench machine one core ran 227 GFLOP/s of it against 115 GFLOP/s of
//! `vfmadd231ps` (12 independent accumulators, no loads). PyTorch's CPU autocast uses it through
//! oneDNN. The numerics are autocast's: each operand is rounded to bf16 (round to nearest even;
//! bf16 weights are already), the products are exact in f32 and summed in f32, and the
//! instruction treats subnormal inputs and outputs as zero.
//!
//! The layout is the classic packed GEMM: the right operand is packed per thread into panels of
//! [`NR`] columns holding bf16 pairs `(b[2p][j], b[2p+1][j])` (one `u32` per column and pair of
//! rows, the instruction's operand), the left one into panels of [`MR`] rows holding the pairs
//! `(a[i][2p], a[i][2p+1])`, and an `MR × NR` kernel keeps its sums in 24 of the 32 vector
//! registers. Operands are read through strided views, so transposed operands cost nothing
//! extra, and `f32` operands are rounded while they are packed.

use super::f32_to_bf16;
use super::matmul::{check_dims, for_each_thread_block, MatRef, SendPtr, ThreadBlock};
use candle_core::{bail, Result};
use half::bf16;

/// Rows of the kernel's tile.
const MR: usize = 12;
/// Columns of the kernel's tile (two 16-lane vectors); the AMX kernel's right-operand panels
/// are the same (`amx_gemm`).
pub(super) const NR: usize = 32;
/// Inner-dimension length of one packed block (a multiple of 2): one kernel call reads
/// `KC / 2 · NR · 4` = 16 KiB of the right operand, which stays in the 32 KiB L1 while the
/// kernel walks down the left operand's panels.
const KC: usize = 256;
/// Rows of the left operand packed at once (`MC · KC · 2` bytes = 48 KiB, in L2).
const MC: usize = 8 * MR;
/// Columns of the right operand packed at once (`KC · NC · 2` bytes = 512 KiB, in L2): the
/// lm head's 49,152 columns would otherwise pack 12.6 MB per thread.
const NC: usize = 1024;

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

/// Whether this CPU has the bf16 dot-product instruction (AVX512-BF16).
pub(crate) fn available() -> bool {
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

/// `lhs @ rhs` as a new row-major `lhs.rows × rhs.cols` buffer, operands rounded to bf16
/// (multithreaded). An error when the CPU lacks AVX512-BF16 (check [`available`]).
///
/// The buffer is not zero-filled first: every tile is stored whole when the product does not
/// accumulate (the lm head's `vocab × hidden` gradient is 113 MB on SmolLM2-135M).
pub(crate) fn bf16_gemm_new<A: PackElem, B: PackElem>(
    lhs: MatRef<'_, A>,
    rhs: MatRef<'_, B>,
) -> Result<Vec<f32>> {
    let (m, n) = (lhs.rows, rhs.cols);
    check(lhs, rhs)?;
    let len = m * n;
    let mut out: Vec<f32> = Vec::with_capacity(len);
    // Test builds poison the buffer, so an element the kernel failed to write shows up as NaN.
    #[cfg(debug_assertions)]
    out.resize(len, f32::NAN);
    // SAFETY: the views were checked and the CPU has the instruction; `out` has room for the
    // row-major `m × n` destination and does not alias the inputs. Without `accumulate` every
    // element is written (each kernel tile stores its rows and columns whole, and `k = 0`
    // stores zeros) and none is read; only then is the length set.
    unsafe {
        product(out.as_mut_ptr(), n, false, lhs, rhs);
        out.set_len(len);
    }
    Ok(out)
}

/// `dst = lhs @ rhs` (or `dst += lhs @ rhs` when `accumulate`), `dst` being row-major with
/// `dst_row_stride` elements between rows; operands rounded to bf16, sums in f32. Splits the
/// product across rayon's threads. An error when the CPU lacks AVX512-BF16.
pub(crate) fn bf16_gemm<A: PackElem, B: PackElem>(
    dst: &mut [f32],
    dst_row_stride: usize,
    accumulate: bool,
    lhs: MatRef<'_, A>,
    rhs: MatRef<'_, B>,
) -> Result<()> {
    check(lhs, rhs)?;
    let (m, n) = (lhs.rows, rhs.cols);
    if m == 0 || n == 0 {
        return Ok(());
    }
    if dst_row_stride < n || dst.len() < (m - 1) * dst_row_stride + n {
        bail!("bf16 gemm: the destination does not hold a {m}x{n} matrix with row stride {dst_row_stride}");
    }
    // SAFETY: checked views, a checked destination (a unique borrow, so no aliasing), and the
    // CPU has the instruction (`check`).
    unsafe { product(dst.as_mut_ptr(), dst_row_stride, accumulate, lhs, rhs) };
    Ok(())
}

/// An error unless the CPU has the instruction, the inner dimensions agree and both views
/// lie inside their buffers.
fn check<A, B>(lhs: MatRef<'_, A>, rhs: MatRef<'_, B>) -> Result<()> {
    if !available() {
        bail!("bf16 gemm: this CPU has no AVX512-BF16 (internal error: check `available`)");
    }
    check_dims(lhs, rhs)
}

/// The product into `dst`, split across rayon's threads when it is large enough.
///
/// # Safety
/// The views passed [`check`]; `dst` is valid for writes (and reads when `accumulate`) over
/// `lhs.rows` rows of `rhs.cols` elements, `ldc` apart, and overlaps neither input.
unsafe fn product<A: PackElem, B: PackElem>(
    dst: *mut f32,
    ldc: usize,
    accumulate: bool,
    lhs: MatRef<'_, A>,
    rhs: MatRef<'_, B>,
) {
    let (m, n) = (lhs.rows, rhs.cols);
    if m == 0 || n == 0 {
        return;
    }
    let dst = SendPtr(dst);
    let threads = rayon::current_num_threads();
    let parallel = splits(m, lhs.cols, n, threads);
    let block = |b: ThreadBlock| {
        let (lhs, rhs, offset) = b.views(lhs, rhs, ldc, 1);
        // SAFETY: the block lies inside the destination, and blocks of different threads do
        // not overlap.
        unsafe { gemm_block(dst.get().add(offset), ldc, accumulate, lhs, rhs) }
    };
    if parallel {
        for_each_thread_block(m, n, threads, NR, block);
    } else {
        block(ThreadBlock::whole(m, n));
    }
}

/// One thread's product into `dst` (row-major, `ldc` between rows).
///
/// Compiled for AVX-512 (the packing loops vectorise with it).
///
/// # Safety
/// The CPU has AVX512-BF16; `lhs` and `rhs` are checked views with matching inner dimensions;
/// `dst` is valid for reads and writes over `lhs.rows` rows of `rhs.cols` elements, `ldc` apart.
#[cfg_attr(
    target_arch = "x86_64",
    target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")
)]
unsafe fn gemm_block<A: PackElem, B: PackElem>(
    dst: *mut f32,
    ldc: usize,
    accumulate: bool,
    lhs: MatRef<'_, A>,
    rhs: MatRef<'_, B>,
) {
    let (m, k, n) = (lhs.rows, lhs.cols, rhs.cols);
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                std::ptr::write_bytes(dst.add(i * ldc), 0, n);
            }
        }
        return;
    }
    let (mut packed_a, mut packed_b) = pack_buffers(m, k, n);
    for n0 in (0..n).step_by(NC) {
        let nc = NC.min(n - n0);
        let rhs_block = MatRef {
            data: &rhs.data[n0 * rhs.col_stride..],
            cols: nc,
            ..rhs
        };
        for k0 in (0..k).step_by(KC) {
            let kc = KC.min(k - k0);
            pack_rhs(&mut packed_b, rhs_block, (k0, kc), kc.div_ceil(2));
            let overwrite = k0 == 0 && !accumulate;
            for m0 in (0..m).step_by(MC) {
                let mc = MC.min(m - m0);
                pack_lhs(&mut packed_a, lhs, (m0, mc), (k0, kc));
                let c = dst.add(m0 * ldc + n0);
                tiles(&packed_a, &packed_b, (mc, kc, nc), c, ldc, overwrite);
            }
        }
    }
}

/// The packed operands' buffers for one thread's `m × k × n` product: at most
/// [`MC`] × [`KC`] and [`KC`] × [`NC`] bf16 values (48 KiB and 512 KiB), fewer for smaller
/// products (the planner counts them: `plan::step_model::bf16_pack_bytes`).
fn pack_buffers(m: usize, k: usize, n: usize) -> (Vec<u32>, Vec<u32>) {
    let pairs = KC.min(k).div_ceil(2);
    let a = MC.min(m).div_ceil(MR) * MR * pairs;
    let b = NC.min(n).div_ceil(NR) * NR * pairs;
    (vec![0u32; a], vec![0u32; b])
}

/// Bytes of [`pack_buffers`] for an `m × k × n` product on one thread.
fn pack_bytes(m: usize, k: usize, n: usize) -> usize {
    let pairs = KC.min(k).div_ceil(2);
    (MC.min(m).div_ceil(MR) * MR + NC.min(n).div_ceil(NR) * NR) * pairs * 4
}

/// Bytes of packing buffers an `m × k × n` product holds at once, over all of rayon's
/// threads (what the planner counts for it).
pub(crate) fn product_pack_bytes(m: usize, k: usize, n: usize) -> usize {
    let threads = rayon::current_num_threads();
    if !splits(m, k, n, threads) {
        return pack_bytes(m, k, n);
    }
    let (part_m, part_n) = if n >= m {
        (m, n.div_ceil(threads))
    } else {
        (m.div_ceil(threads), n)
    };
    threads * pack_bytes(part_m, k, part_n)
}

/// Whether an `m × k × n` product is split across `threads` (small ones stay on one thread,
/// like gemm's own threshold).
fn splits(m: usize, k: usize, n: usize, threads: usize) -> bool {
    threads > 1 && m * n * k >= 48 * 48 * 256 && m.max(n) >= NR * threads
}

/// Every kernel tile of one packed `mc × kc` by `kc × nc` block into `c`.
///
/// # Safety
/// As [`kernel`], for every tile of the block.
#[inline(always)]
unsafe fn tiles(
    packed_a: &[u32],
    packed_b: &[u32],
    (mc, kc, nc): (usize, usize, usize),
    c: *mut f32,
    ldc: usize,
    overwrite: bool,
) {
    let pairs = kc.div_ceil(2);
    for jp in 0..nc.div_ceil(NR) {
        let b = packed_b.as_ptr().add(jp * pairs * NR);
        let cols = NR.min(nc - jp * NR);
        for ip in 0..mc.div_ceil(MR) {
            let a = packed_a.as_ptr().add(ip * pairs * MR);
            let rows = MR.min(mc - ip * MR);
            kernel(
                pairs,
                a,
                b,
                c.add(ip * MR * ldc + jp * NR),
                ldc,
                rows,
                cols,
                overwrite,
            );
        }
    }
}

/// Two bf16 values as the instruction's pair (`lo` in the low half).
#[inline(always)]
fn pair(lo: u16, hi: u16) -> u32 {
    u32::from(lo) | (u32::from(hi) << 16)
}

/// Element `(r, c)` of a checked view as bf16 bits.
///
/// # Safety
/// `(r, c)` lies inside the view, and the view passed [`MatRef::check`].
#[inline(always)]
unsafe fn bits_at<T: PackElem>(m: &MatRef<'_, T>, r: usize, c: usize) -> u16 {
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
        if cols == NR && simd_pack::rhs_panel(panel, &rhs, (k0, kc), j0) {
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

/// Packs rows `m0 .. m0 + mc`, columns `k0 .. k0 + kc` of `lhs` into panels of [`MR`] rows:
/// panel `ip`, pair `p`, row `i` holds `(lhs[m0 + ip·MR + i][k0 + 2p], … [k0 + 2p + 1])`, zero
/// past the matrix; along the view's contiguous direction, like [`pack_rhs`].
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
        if rows == MR && simd_pack::lhs_panel(panel, &lhs, (k0, kc), i0) {
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

/// AVX-512 packing of whole panels from the layouts a layer's products use (scalar packing
/// was ≈ 40 % of the products' time).
#[cfg(target_arch = "x86_64")]
pub(super) mod simd_pack {
    use super::{PackElem, MR, NR};
    use crate::model::ops::matmul::MatRef;
    use std::arch::x86_64::*;

    /// Lane `2i` takes bf16 lane `i` of the first operand, lane `2i + 1` lane `i` of the second
    /// (`_mm512_permutex2var_epi16` indices: 0–31 the first, 32–63 the second).
    const INTERLEAVE_LO: [u16; 32] = interleave(0);
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
    unsafe fn index(table: &[u16; 32]) -> __m512i {
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

    /// `cols[q]` lane `i` = `r[i]` lane `q`: the 16 × 16 transpose of 32-bit lanes (pairs,
    /// then quads within 128-bit blocks, then the blocks). The AMX kernel's packing uses it
    /// too.
    ///
    /// # Safety
    /// AVX-512 (inlined into the caller's target features).
    #[inline(always)]
    pub(in crate::model::ops) unsafe fn transpose16(r: [__m512i; 16]) -> [__m512i; 16] {
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
pub(super) mod simd_pack {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ops::kernel_path::{tests::check_products, Bf16Kernel};

    /// Every layout of the products a layer runs, ragged edges included, against the f64
    /// product of the operands as the path sees them. On a CPU without AVX512-BF16 the path a
    /// bf16 run takes there (the f32 widening) is checked against the same reference instead,
    /// so the test runs everywhere and says which path it checked.
    #[test]
    fn products_of_rounded_operands_match_a_reference() {
        let kernel = if available() {
            Bf16Kernel::Avx512Bf16
        } else {
            Bf16Kernel::F32
        };
        check_products(kernel, &[(64, 1000, 70)]);
        eprintln!(
            "bf16 products checked on the {} path{}",
            kernel.name(),
            if available() {
                ""
            } else {
                " (this CPU has no AVX512-BF16)"
            }
        );
    }

    /// Wrong shapes are errors, never a product; without the instruction every call is one,
    /// naming what is missing.
    #[test]
    fn mismatched_views_are_errors() {
        let a = vec![1f32; 6];
        assert!(bf16_gemm_new(MatRef::row_major(&a, 2, 3), MatRef::row_major(&a, 2, 3)).is_err());
        let mut small = vec![0f32; 3];
        let err = bf16_gemm(
            &mut small,
            2,
            false,
            MatRef::row_major(&a, 2, 3),
            MatRef::row_major(&a, 3, 2),
        );
        assert!(err.is_err());
        if !available() {
            let err = bf16_gemm_new(MatRef::row_major(&a, 2, 3), MatRef::row_major(&a, 3, 2))
                .expect_err("refused without AVX512-BF16");
            assert!(err.to_string().contains("AVX512-BF16"), "{err}");
        }
    }
}
