//! The one packed-GEMM driver both tile kernels run under: the threads' split of the
//! destination, the blocking of the three dimensions, the packing buffers and the loops over
//! a block's tiles. A [`TileKernel`] brings its tile size, its left-operand packing and its
//! tile; the right operand's panels are shared ([`super::pack`]).
//!
//! Per thread: the right operand is packed [`KC`] rows × [`NC`] columns at a time, the left one
//! `MC` rows × [`KC`] at a time, and the kernel's tile walks the packed blocks (the right panel
//! stays in L1 while the tile walks down the left operand's panels).

use super::pack::{pack_rhs, NR};
use super::PackElem;
use crate::model::ops::matmul::{for_each_thread_block, MatRef, SendPtr, ThreadBlock};

/// Inner-dimension length of one packed block (a multiple of both kernels' `K_STEP`): one
/// right panel is `KC / 2 · NR · 4` = 16 KiB, which stays in the 32 KiB L1 while the tile walks
/// down the left operand's panels (AMX's two panels, 16 KiB each, fit its 48 KiB L1).
const KC: usize = 256;
/// Columns of the right operand packed at once (`KC · NC · 2` bytes = 512 KiB, in L2): the
/// lm head's 49,152 columns would otherwise pack 12.6 MB per thread.
const NC: usize = 1024;

/// A tile kernel the driver runs: its tile's rows (its columns are [`NR`]), how it packs the
/// left operand (and, when it has a faster way for some layout, the right one), and the tile.
/// Packed operands are `u32` words: bf16 pairs, or two bf16 of an AMX tile row.
pub(crate) trait TileKernel {
    /// The product's name in error messages (`bf16 gemm`, `amx gemm`).
    const NAME: &'static str;
    /// Why [`Self::available`] is false, as an error says it.
    const MISSING: &'static str;
    /// Rows of the tile (of a packed left panel).
    const MR: usize;
    /// Rows of the left operand packed at once.
    const MC: usize;
    /// The packed inner dimension is padded with zeros to a multiple of this.
    const K_STEP: usize;

    /// Whether this CPU (and OS) can run the kernel.
    fn available() -> bool;

    /// Packs rows `m0 .. m0 + mc`, inner values `k0 .. k0 + kc` of `lhs` into panels of
    /// [`Self::MR`] rows, each `kp / 2 · MR` words (`kp` = `kc` rounded up to [`Self::K_STEP`]).
    ///
    /// # Safety
    /// `lhs` passed `MatRef::check`, `m0 + mc ≤ lhs.rows`, `k0 + kc ≤ lhs.cols`; `packed`
    /// holds every panel; [`Self::available`] (inlined into the driver's AVX-512 features).
    unsafe fn pack_lhs<A: PackElem>(
        packed: &mut [u32],
        lhs: MatRef<'_, A>,
        rows: (usize, usize),
        inner: (usize, usize),
    );

    /// Packs rows `k0 .. k0 + kc` of `rhs` into the shared panels ([`pack_rhs`]).
    ///
    /// # Safety
    /// As [`pack_rhs`].
    #[inline(always)]
    unsafe fn pack_rhs<B: PackElem>(
        packed: &mut [u32],
        rhs: MatRef<'_, B>,
        inner: (usize, usize),
        panel_pairs: usize,
    ) {
        pack_rhs(packed, rhs, inner, panel_pairs);
    }

    /// `c[..rows][..cols] (+)= a · b` for one [`Self::MR`] × [`NR`] tile over `kp` packed
    /// inner values (a multiple of [`Self::K_STEP`]); `c` is `(pointer, row stride)`.
    ///
    /// # Safety
    /// [`Self::begin`] ran on this thread; `a` holds `kp / 2 · MR` and `b` `kp / 2 · NR` words;
    /// `c` is valid for `rows ≤ MR` rows of `cols ≤ NR` elements.
    unsafe fn tile(
        kp: usize,
        a: *const u32,
        b: *const u32,
        c: (*mut f32, usize),
        size: (usize, usize),
        overwrite: bool,
    );

    /// Prepares this thread before its block of a product (AMX loads the tile configuration).
    ///
    /// # Safety
    /// [`Self::available`].
    #[inline(always)]
    unsafe fn begin() {}

    /// Undoes [`Self::begin`] after the block (AMX releases the tiles).
    ///
    /// # Safety
    /// [`Self::available`].
    #[inline(always)]
    unsafe fn end() {}
}

/// The product into `dst`, split across rayon's threads when it is large enough.
///
/// # Safety
/// `K` is available; the views passed `check_dims`; `dst` is valid for writes (and reads when
/// `accumulate`) over `lhs.rows` rows of `rhs.cols` elements, `ldc` apart, and overlaps neither
/// input.
pub(super) unsafe fn product<K: TileKernel, A: PackElem, B: PackElem>(
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
    let block = |b: ThreadBlock| {
        let (lhs, rhs, offset) = b.views(lhs, rhs, ldc, 1);
        // SAFETY: the block lies inside the destination, and blocks of different threads do
        // not overlap.
        unsafe { gemm_block::<K, A, B>(dst.get().add(offset), ldc, accumulate, lhs, rhs) }
    };
    if splits::<K>(m, lhs.cols, n, threads) {
        for_each_thread_block(m, n, threads, K::MR.max(NR), block);
    } else {
        block(ThreadBlock::whole(m, n));
    }
}

/// Whether an `m × k × n` product is split across `threads` (small ones stay on one thread,
/// like gemm's own threshold).
fn splits<K: TileKernel>(m: usize, k: usize, n: usize, threads: usize) -> bool {
    threads > 1 && m * n * k >= 48 * 48 * 256 && m.max(n) >= K::MR.max(NR) * threads
}

/// The packed operands' buffers for one thread's `m × k × n` product: at most `MC` × [`KC`]
/// and [`KC`] × [`NC`] bf16 values, fewer for smaller products (the planner counts them:
/// `plan::step_model::bf16_pack_bytes`).
fn pack_buffers<K: TileKernel>(m: usize, k: usize, n: usize) -> (Vec<u32>, Vec<u32>) {
    let pairs = KC.min(k).next_multiple_of(K::K_STEP) / 2;
    let a = K::MC.min(m).next_multiple_of(K::MR) * pairs;
    let b = NC.min(n).next_multiple_of(NR) * pairs;
    (vec![0u32; a], vec![0u32; b])
}

/// Bytes of [`pack_buffers`] for an `m × k × n` product on one thread.
fn pack_bytes<K: TileKernel>(m: usize, k: usize, n: usize) -> usize {
    let pairs = KC.min(k).next_multiple_of(K::K_STEP) / 2;
    (K::MC.min(m).next_multiple_of(K::MR) + NC.min(n).next_multiple_of(NR)) * pairs * 4
}

/// Bytes of packing buffers an `m × k × n` product holds at once on kernel `K`, over all of
/// rayon's threads (what the planner counts for it).
pub(crate) fn product_pack_bytes<K: TileKernel>(m: usize, k: usize, n: usize) -> usize {
    let threads = rayon::current_num_threads();
    if !splits::<K>(m, k, n, threads) {
        return pack_bytes::<K>(m, k, n);
    }
    let (part_m, part_n) = if n >= m {
        (m, n.div_ceil(threads))
    } else {
        (m.div_ceil(threads), n)
    };
    threads * pack_bytes::<K>(part_m, k, part_n)
}

/// One thread's product into `dst` (row-major, `ldc` between rows), between the kernel's
/// [`TileKernel::begin`] and [`TileKernel::end`].
///
/// Compiled for AVX-512 (the packing loops vectorise with it, and the kernels' packing and
/// tiles are inlined into it).
///
/// # Safety
/// `K` is available; `lhs` and `rhs` are checked views with matching inner dimensions; `dst`
/// is valid for reads and writes over `lhs.rows` rows of `rhs.cols` elements, `ldc` apart.
#[cfg_attr(
    target_arch = "x86_64",
    target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")
)]
unsafe fn gemm_block<K: TileKernel, A: PackElem, B: PackElem>(
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
    let (mut packed_a, mut packed_b) = pack_buffers::<K>(m, k, n);
    K::begin();
    for n0 in (0..n).step_by(NC) {
        let nc = NC.min(n - n0);
        let rhs_block = MatRef {
            data: &rhs.data[n0 * rhs.col_stride..],
            cols: nc,
            ..rhs
        };
        for k0 in (0..k).step_by(KC) {
            let kc = KC.min(k - k0);
            let kp = kc.next_multiple_of(K::K_STEP);
            K::pack_rhs(&mut packed_b, rhs_block, (k0, kc), kp / 2);
            let overwrite = k0 == 0 && !accumulate;
            for m0 in (0..m).step_by(K::MC) {
                let mc = K::MC.min(m - m0);
                K::pack_lhs(&mut packed_a, lhs, (m0, mc), (k0, kc));
                let c = dst.add(m0 * ldc + n0);
                tiles::<K>(&packed_a, &packed_b, (mc, kp, nc), (c, ldc), overwrite);
            }
        }
    }
    K::end();
}

/// Every tile of one packed `mc × kp` by `kp × nc` block into `c`.
///
/// # Safety
/// As [`TileKernel::tile`], for every tile of the block.
#[inline(always)]
unsafe fn tiles<K: TileKernel>(
    packed_a: &[u32],
    packed_b: &[u32],
    (mc, kp, nc): (usize, usize, usize),
    (c, ldc): (*mut f32, usize),
    overwrite: bool,
) {
    let (a_panel, b_panel) = (kp / 2 * K::MR, kp / 2 * NR);
    for jp in 0..nc.div_ceil(NR) {
        let b = packed_b.as_ptr().add(jp * b_panel);
        let cols = NR.min(nc - jp * NR);
        for ip in 0..mc.div_ceil(K::MR) {
            let a = packed_a.as_ptr().add(ip * a_panel);
            let rows = K::MR.min(mc - ip * K::MR);
            let c = c.add(ip * K::MR * ldc + jp * NR);
            K::tile(kp, a, b, (c, ldc), (rows, cols), overwrite);
        }
    }
}
