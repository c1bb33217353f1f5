//! The AMX tile kernel: a 32 × 32 block of the product on the AMX tile unit (`tdpbf16ps`,
//! AMX-BF16), on the CPUs that have tiles (Intel Sapphire Rapids and later).
//!
//! One `tdpbf16ps` multiplies a 16 × 32 bf16 tile by a 32 × 16 one into a 16 × 16 f32 tile:
//! 16,384 FLOP, against 64 for a 512-bit FMA. The kernel keeps a 32 × 32 block of the
//! destination in four accumulator tiles (`tmm0`–`tmm3`) and, for every 32 values of the inner
//! dimension, loads two tiles of the left operand (`tmm4`, `tmm5`) and two of the right
//! (`tmm6`, `tmm7`). Stable Rust has no AMX intrinsics, so the tile instructions are written
//! with `asm!`.
//!
//! Packing (the tile unit is so fast that packing is a large part of the time):
//! - the right operand into the driver's shared panels of [`NR`] = 32 columns of bf16 pairs
//!   ([`super::pack::pack_rhs`]); 16 pairs of rows of 16 columns are one 16-row × 64-byte
//!   tile (row stride 128 bytes), padded with zero pairs to whole tiles (the inner block is a
//!   multiple of [`KT`]); a transposed bf16 weight packs by 16 × 16 transposes of pairs;
//! - the left operand into panels of [`MR`] = 32 rows, stored tile by tile: for each 32 values
//!   of the inner dimension, 32 rows of 32 bf16 (two 16 × 64-byte tiles, row stride 64 bytes).
//!   Row-major `f32` rows convert 32 values at a time; column-contiguous `f32` (the transposed
//!   gradients `dyᵀ`) converts 16 rows of a column pair and transposes 16 × 16 pairs in
//!   registers.
//!
//! Linux hands out the tile state only on request: [`available`] asks once per process
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`); each thread loads the tile
//! configuration before its block of a product and releases the tiles after it
//! ([`TileKernel::begin`], [`TileKernel::end`]).

use super::driver::TileKernel;
use super::pack::{pack_rhs, NR};
use super::PackElem;
use crate::model::ops::matmul::MatRef;

/// Rows of the kernel's block (two tiles of 16 rows).
const MR: usize = 32;
/// Inner-dimension values per tile row (64 bytes of bf16); the driver's inner block
/// (`KC` = 256) is a multiple of it, so the kernel's two panels are `KC · 64` bytes each
/// (16 KiB), together in the 48 KiB L1.
const KT: usize = 32;
/// Rows of the left operand packed at once (`MC · KC · 2` = 128 KiB, in L2).
const MC: usize = 8 * MR;

/// The AMX tile kernel.
pub(crate) struct AmxTile;

impl TileKernel for AmxTile {
    const NAME: &'static str = "amx gemm";
    const MISSING: &'static str = "this CPU or OS gives no AMX-BF16 tiles";
    const MR: usize = MR;
    const MC: usize = MC;
    const K_STEP: usize = KT;

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
        pack_lhs::pack(packed, lhs, rows, inner);
    }

    #[inline(always)]
    unsafe fn pack_rhs<B: PackElem>(
        packed: &mut [u32],
        rhs: MatRef<'_, B>,
        inner: (usize, usize),
        panel_pairs: usize,
    ) {
        pack_right(packed, rhs, inner, panel_pairs);
    }

    #[inline(always)]
    unsafe fn tile(
        kp: usize,
        a: *const u32,
        b: *const u32,
        c: (*mut f32, usize),
        size: (usize, usize),
        overwrite: bool,
    ) {
        tiles::block(kp / KT, a.cast(), b, c, size, overwrite);
    }

    #[inline(always)]
    unsafe fn begin() {
        tiles::configure();
    }

    #[inline(always)]
    unsafe fn end() {
        tiles::release();
    }
}

/// Whether this CPU has AMX-BF16 and the kernel lets this process use the tiles (asked once).
fn available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(|| cpu_has_amx_bf16() && request_tile_state())
}

/// AMX-TILE and AMX-BF16 in CPUID leaf 7 (the standard library's detection of them is not
/// stable yet).
fn cpu_has_amx_bf16() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: CPUID exists on every x86-64 CPU; leaf 7 reads as zeros where it is absent.
        // (Safe to call from Rust 1.94 on; unsafe before, down to the crate's 1.89.)
        #[allow(unused_unsafe)]
        let leaf7 = unsafe { std::arch::x86_64::__cpuid_count(7, 0) };
        let (amx_bf16, amx_tile) = ((leaf7.edx >> 22) & 1 == 1, (leaf7.edx >> 24) & 1 == 1);
        amx_bf16 && amx_tile && std::arch::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Asks Linux for the tile data state (`XFEATURE_XTILEDATA`, 18) for this process; without it
/// the first tile instruction faults. False elsewhere, or when the kernel refuses (before 5.16).
fn request_tile_state() -> bool {
    #[cfg(all(target_os = "linux", target_arch = "x86_64"))]
    {
        const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
        const XFEATURE_XTILEDATA: libc::c_long = 18;
        // SAFETY: a plain system call with integer arguments; it only changes which register
        // state the kernel saves for this process.
        let r = unsafe {
            libc::syscall(
                libc::SYS_arch_prctl,
                ARCH_REQ_XCOMP_PERM,
                XFEATURE_XTILEDATA,
            )
        };
        r == 0
    }
    #[cfg(not(all(target_os = "linux", target_arch = "x86_64")))]
    {
        false
    }
}

/// Packs rows `k0 .. k0 + kc` of `rhs` as [`pack_rhs`] does; a bf16 operand whose columns are
/// contiguous (a transposed weight, `x Wᵀ`) by 16 × 16 transposes of pairs, one tile step
/// (32 values) at a time.
///
/// # Safety
/// As [`pack_rhs`].
#[inline(always)]
unsafe fn pack_right<B: PackElem>(
    packed: &mut [u32],
    rhs: MatRef<'_, B>,
    (k0, kc): (usize, usize),
    panel_pairs: usize,
) {
    if B::IS_F32 || rhs.row_stride != 1 || kc % KT != 0 {
        return pack_rhs(packed, rhs, (k0, kc), panel_pairs);
    }
    let n = rhs.cols;
    for (jp, panel) in packed
        .chunks_exact_mut(panel_pairs * NR)
        .take(n.div_ceil(NR))
        .enumerate()
    {
        let j0 = jp * NR;
        if n - j0 < NR {
            pack_rhs(
                panel,
                MatRef {
                    data: &rhs.data[j0 * rhs.col_stride..],
                    cols: n - j0,
                    ..rhs
                },
                (k0, kc),
                panel_pairs,
            );
            continue;
        }
        for half in 0..2 {
            let col = rhs
                .data
                .as_ptr()
                .add((j0 + 16 * half) * rhs.col_stride + k0);
            for s in 0..kc / KT {
                let dst = panel.as_mut_ptr().add(s * KT / 2 * NR + 16 * half);
                simd::pairs16(dst, col.add(s * KT).cast(), rhs.col_stride);
            }
        }
    }
}

/// Packing of the left operand: panel `ip` (rows `ip·32 ..`), step `s` (inner values
/// `s·32 ..`) is 32 rows of 32 bf16 at bf16 offset `(ip · steps + s) · 1024` of the driver's
/// `u32` buffer; values past the inner dimension are zero (rows past `mc` are left as they
/// are: they only reach discarded rows).
mod pack_lhs {
    use super::{PackElem, KT, MR};
    use crate::model::ops::matmul::MatRef;

    /// Packs rows `m0 .. m0 + mc`, inner values `k0 .. k0 + kc` of `lhs` into `packed`.
    ///
    /// # Safety
    /// `lhs` passed `MatRef::check`, `m0 + mc ≤ lhs.rows`, `k0 + kc ≤ lhs.cols`, `packed` holds
    /// every panel; AVX512-BF16 and BW (inlined into the caller's target features).
    #[inline(always)]
    pub(super) unsafe fn pack<A: PackElem>(
        packed: &mut [u32],
        lhs: MatRef<'_, A>,
        (m0, mc): (usize, usize),
        (k0, kc): (usize, usize),
    ) {
        let steps = kc.div_ceil(KT);
        let mut i = 0;
        while i < mc {
            if A::IS_F32 && lhs.row_stride == 1 && i + 16 <= mc {
                for s in 0..steps {
                    let (ks, len) = (k0 + s * KT, KT.min(kc - s * KT));
                    let dst = packed.as_mut_ptr().cast::<u16>().add(slot(i, s, steps));
                    if len == KT {
                        let col = lhs.data.as_ptr().add(m0 + i + ks * lhs.col_stride);
                        super::simd::columns16(dst, col.cast(), lhs.col_stride);
                    } else {
                        for r in 0..16 {
                            scalar_row(dst.add(r * KT), &lhs, m0 + i + r, (ks, len));
                        }
                    }
                }
                i += 16;
                continue;
            }
            for s in 0..steps {
                let (ks, len) = (k0 + s * KT, KT.min(kc - s * KT));
                let dst = packed.as_mut_ptr().cast::<u16>().add(slot(i, s, steps));
                if A::IS_F32 && lhs.col_stride == 1 {
                    let row = lhs.data.as_ptr().add((m0 + i) * lhs.row_stride + ks);
                    super::simd::row32(dst, row.cast(), len);
                } else {
                    scalar_row(dst, &lhs, m0 + i, (ks, len));
                }
            }
            i += 1;
        }
    }

    /// Where row `i` of the block, step `s`, starts in the packed buffer.
    #[inline(always)]
    fn slot(i: usize, s: usize, steps: usize) -> usize {
        ((i / MR) * steps + s) * KT * MR + (i % MR) * KT
    }

    /// The 32 bf16 of row `r`, inner values `ks .. ks + len` then zeros, one by one.
    ///
    /// # Safety
    /// `dst` is valid for 32 writes; the elements lie inside the checked view.
    #[inline(always)]
    unsafe fn scalar_row<A: PackElem>(
        dst: *mut u16,
        lhs: &MatRef<'_, A>,
        r: usize,
        (ks, len): (usize, usize),
    ) {
        for q in 0..KT {
            *dst.add(q) = if q < len {
                lhs.data
                    .get_unchecked(r * lhs.row_stride + (ks + q) * lhs.col_stride)
                    .bf16_bits()
            } else {
                0
            };
        }
    }
}

/// AVX-512 packing of the left operand's `f32` layouts.
#[cfg(target_arch = "x86_64")]
mod simd {
    use super::super::pack::simd::transpose16;
    use super::KT;
    use std::arch::x86_64::*;

    /// 32 consecutive `f32` (the first `len`, the rest zero) as 32 bf16 at `dst`.
    ///
    /// # Safety
    /// `src` is valid for `len ≤ 32` reads and `dst` for 32 writes; AVX512-BF16.
    #[inline(always)]
    pub(super) unsafe fn row32(dst: *mut u16, src: *const f32, len: usize) {
        let mask = |from: usize| -> __mmask16 {
            let n = len.saturating_sub(from).min(16);
            ((1u32 << n) - 1) as __mmask16
        };
        let lo = _mm512_maskz_loadu_ps(mask(0), src);
        let hi = _mm512_maskz_loadu_ps(mask(16), src.add(16));
        let v: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
        _mm512_storeu_si512(dst.cast(), v);
    }

    /// 16 rows of 32 columns of a view whose columns are contiguous (`row_stride == 1`; `col`
    /// points at the first row of the first column, `col_stride` apart), as 16 tile rows of 32
    /// bf16 at `dst` (64 bytes apart): each column pair converts to 16 rows' pairs, and the
    /// 16 × 16 pairs are transposed.
    ///
    /// # Safety
    /// The 16 × 32 values are readable; `dst` is valid for 16 · 32 writes; AVX512-BF16 and BW.
    #[inline(always)]
    pub(super) unsafe fn columns16(dst: *mut u16, col: *const f32, col_stride: usize) {
        let mut idx = [0u16; 32];
        for r in 0..16 {
            idx[2 * r] = r as u16;
            idx[2 * r + 1] = 16 + r as u16;
        }
        let idx = _mm512_loadu_si512(idx.as_ptr().cast());
        let mut v = [_mm512_setzero_si512(); 16];
        for (p, v) in v.iter_mut().enumerate() {
            let c0 = _mm512_loadu_ps(col.add(2 * p * col_stride));
            let c1 = _mm512_loadu_ps(col.add((2 * p + 1) * col_stride));
            let both: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(c1, c0));
            // Lane `r` (32 bits): row `r`'s pair `p`.
            *v = _mm512_permutexvar_epi16(idx, both);
        }
        let rows = transpose16(v);
        for (r, row) in rows.iter().enumerate() {
            _mm512_storeu_si512(dst.add(r * KT).cast(), *row);
        }
    }

    /// 16 columns of a bf16 view whose columns are contiguous (`col` the first, `col_stride`
    /// apart), 32 values each, as 16 rows of pairs [`super::NR`] apart at `dst`: row `p`,
    /// column `r` holds column `r`'s values `2p` and `2p + 1`.
    ///
    /// # Safety
    /// The 16 × 32 values are readable; `dst` is valid for 16 rows of 16 writes; AVX-512.
    #[inline(always)]
    pub(super) unsafe fn pairs16(dst: *mut u32, col: *const u16, col_stride: usize) {
        let mut v = [_mm512_setzero_si512(); 16];
        for (r, v) in v.iter_mut().enumerate() {
            *v = _mm512_loadu_si512(col.add(r * col_stride).cast());
        }
        for (p, row) in transpose16(v).iter().enumerate() {
            _mm512_storeu_si512(dst.add(p * super::NR).cast(), *row);
        }
    }
}

/// Never called off x86-64 ([`available`] is false there).
#[cfg(not(target_arch = "x86_64"))]
mod simd {
    pub(super) unsafe fn row32(_: *mut u16, _: *const f32, _: usize) {
        unreachable!("amx gemm off x86-64")
    }
    pub(super) unsafe fn columns16(_: *mut u16, _: *const f32, _: usize) {
        unreachable!("amx gemm off x86-64")
    }
    pub(super) unsafe fn pairs16(_: *mut u32, _: *const u16, _: usize) {
        unreachable!("amx gemm off x86-64")
    }
}

/// The tile instructions.
#[cfg(target_arch = "x86_64")]
mod tiles {
    use super::{KT, MR, NR};
    use std::arch::asm;

    /// The tile configuration: palette 1, all eight tiles 16 rows × 64 bytes.
    #[repr(C, align(64))]
    struct Config([u8; 64]);

    const CONFIG: Config = {
        let mut c = [0u8; 64];
        c[0] = 1;
        let mut t = 0;
        while t < 8 {
            c[16 + 2 * t] = 64;
            c[48 + t] = 16;
            t += 1;
        }
        Config(c)
    };

    /// Loads the tile configuration on this thread.
    ///
    /// # Safety
    /// [`super::available`].
    #[inline(always)]
    pub(super) unsafe fn configure() {
        let cfg = &CONFIG;
        asm!("ldtilecfg [{0}]", in(reg) cfg.0.as_ptr(), options(nostack, readonly));
    }

    /// Returns the tiles to their initial state (nothing left for context switches to save).
    ///
    /// # Safety
    /// [`super::available`].
    #[inline(always)]
    pub(super) unsafe fn release() {
        asm!("tilerelease", options(nostack, nomem));
    }

    /// `c[..rows][..cols] (+)= a · b` for one 32 × 32 block over `steps` packed steps of 32
    /// inner values: `a` is a left panel (per step two 16 × 32 bf16 tiles), `b` a right panel
    /// (per step 16 pair rows of [`NR`] columns).
    ///
    /// # Safety
    /// [`configure`] ran on this thread; `a` holds `steps · 1024` and `b` `steps · 512` values;
    /// `c` is valid for `rows ≤ 32` rows of `cols ≤ 32` elements, `ldc` apart.
    #[inline(always)]
    pub(super) unsafe fn block(
        steps: usize,
        a: *const u16,
        b: *const u32,
        (c, ldc): (*mut f32, usize),
        (rows, cols): (usize, usize),
        overwrite: bool,
    ) {
        let whole = rows == MR && cols == NR;
        let mut edge = [0f32; MR * NR];
        let (dst, ld) = if whole {
            (c, ldc)
        } else {
            if !overwrite {
                for i in 0..rows {
                    std::ptr::copy_nonoverlapping(
                        c.add(i * ldc),
                        edge.as_mut_ptr().add(i * NR),
                        cols,
                    );
                }
            }
            (edge.as_mut_ptr(), NR)
        };
        accumulators(dst, ld, overwrite);
        for s in 0..steps {
            step(a.add(s * KT * MR), b.add(s * KT / 2 * NR));
        }
        store(dst, ld);
        if !whole {
            for i in 0..rows {
                std::ptr::copy_nonoverlapping(edge.as_ptr().add(i * NR), c.add(i * ldc), cols);
            }
        }
    }

    /// Zeroes the four accumulators, or loads them from the 32 × 32 block at `c`.
    #[inline(always)]
    unsafe fn accumulators(c: *mut f32, ldc: usize, zero: bool) {
        if zero {
            asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                options(nostack, nomem)
            );
            return;
        }
        asm!(
            "tileloadd tmm0, [{c0} + {s}*1]",
            "tileloadd tmm1, [{c0} + {s}*1 + 64]",
            "tileloadd tmm2, [{c1} + {s}*1]",
            "tileloadd tmm3, [{c1} + {s}*1 + 64]",
            c0 = in(reg) c,
            c1 = in(reg) c.add(16 * ldc),
            s = in(reg) ldc * 4,
            options(nostack, readonly)
        );
    }

    /// Stores the four accumulators into the 32 × 32 block at `c`.
    #[inline(always)]
    unsafe fn store(c: *mut f32, ldc: usize) {
        asm!(
            "tilestored [{c0} + {s}*1], tmm0",
            "tilestored [{c0} + {s}*1 + 64], tmm1",
            "tilestored [{c1} + {s}*1], tmm2",
            "tilestored [{c1} + {s}*1 + 64], tmm3",
            c0 = in(reg) c,
            c1 = in(reg) c.add(16 * ldc),
            s = in(reg) ldc * 4,
            options(nostack)
        );
    }

    /// One step of 32 inner values: two left tiles times two right tiles into the accumulators.
    #[inline(always)]
    unsafe fn step(a: *const u16, b: *const u32) {
        asm!(
            "tileloadd tmm4, [{a0} + {sa}*1]",
            "tileloadd tmm6, [{b} + {sb}*1]",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tileloadd tmm7, [{b} + {sb}*1 + 64]",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "tileloadd tmm5, [{a1} + {sa}*1]",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "tdpbf16ps tmm3, tmm5, tmm7",
            a0 = in(reg) a,
            a1 = in(reg) a.add(16 * KT),
            b = in(reg) b,
            sa = in(reg) KT * 2,
            sb = in(reg) NR * 4,
            options(nostack, readonly)
        );
    }
}

/// Never called off x86-64 ([`available`] is false there).
#[cfg(not(target_arch = "x86_64"))]
mod tiles {
    pub(super) unsafe fn configure() {}
    pub(super) unsafe fn release() {}
    pub(super) unsafe fn block(
        _: usize,
        _: *const u16,
        _: *const u32,
        _: (*mut f32, usize),
        _: (usize, usize),
        _: bool,
    ) {
        unreachable!("amx gemm off x86-64")
    }
}
