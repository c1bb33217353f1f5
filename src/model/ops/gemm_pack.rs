//! What gemm allocates for one `f32` product as [`super::matmul::sgemm`] runs it: the
//! planner's model of gemm-common 0.19's packing buffers, next to the code that calls gemm.

use super::matmul::{block_bounds, split_ok, PackChunks, SPLIT_ALIGN};

/// Element strides of a product's operand or destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Strides {
    /// Elements from one row to the next.
    pub row: usize,
    /// Elements from one column to the next.
    pub col: usize,
}

impl Strides {
    /// A row-major matrix of `cols` columns.
    pub fn row_major(cols: usize) -> Self {
        Strides { row: cols, col: 1 }
    }

    /// The transpose of a row-major matrix of `cols` columns (`MatRef::t`).
    pub fn transposed(cols: usize) -> Self {
        Strides { row: 1, col: cols }
    }
}

/// Bytes gemm allocates for `dst[m, n] = lhs[m, k] @ rhs[k, n]` (strides as given) the way
/// [`super::matmul::sgemm`] runs it on rayon's pool: its packed right operand and pre-packed left operand,
/// summed over the per-thread blocks of `matmul::split_across_threads` (which run at once) or once
/// for gemm's own threading; a single-threaded product whose buffers are large is cut into
/// `matmul::PackChunks`, one after another, and counts its widest chunk. Freed when the
/// product returns.
///
/// Why the planner needs it: gemm packs the right operand, `kc × nc` elements with `nc` sized
/// by the L3 cache, whenever the (transposed) left operand has more than two register tiles
/// of rows, and the tile follows the SIMD width (64 rows with AVX-512, 16 with AVX2). The
/// fused head's weight gradient on the demo (hidden 64, vocabulary 49,152, 508 rows) thus
/// packs nothing on a Sapphire Rapids Xeon and, uncut, 23.8 MiB per thread on an AVX2 EPYC
/// (L3 32 MiB): the demo's peak heap there was 175.9 / 199.7 / 248.4 MiB at 1 / 2 / 4 rayon
/// threads (`examples/rss_breakdown.rs`), the plan 24 MiB a thread low until this term. Cut
/// into chunks it packs 1.9 MiB a thread.
pub fn sgemm_pack_bytes(
    m: usize,
    k: usize,
    n: usize,
    lhs: Strides,
    rhs: Strides,
    dst: Strides,
) -> u64 {
    let threads = rayon::current_num_threads();
    if threads > 1 && split_ok(m, k, n, threads) {
        let split_cols = n >= m;
        let len = if split_cols { n } else { m };
        return (0..threads)
            .map(|part| {
                let (start, end) = block_bounds(len, threads, SPLIT_ALIGN, part);
                let count = end.saturating_sub(start);
                if count == 0 {
                    0
                } else if split_cols {
                    chunked_pack_bytes(m, k, count, lhs, rhs, dst)
                } else {
                    chunked_pack_bytes(count, k, n, lhs, rhs, dst)
                }
            })
            .sum();
    }
    if threads > 1 {
        gemm_pack_bytes(m, k, n, lhs, rhs, dst, true)
    } else {
        chunked_pack_bytes(m, k, n, lhs, rhs, dst)
    }
}

/// One thread's single-threaded product, cut into `matmul::PackChunks` that run one after
/// another: the widest chunk's buffers (each chunk's are freed before the next allocates).
fn chunked_pack_bytes(
    m: usize,
    k: usize,
    n: usize,
    lhs: Strides,
    rhs: Strides,
    dst: Strides,
) -> u64 {
    match PackChunks::of((m, k, n), lhs, rhs, dst) {
        Some(c) if c.split_cols => gemm_pack_bytes(m, k, c.widest(), lhs, rhs, dst, false),
        Some(c) => gemm_pack_bytes(c.widest(), k, n, lhs, rhs, dst, false),
        None => gemm_pack_bytes(m, k, n, lhs, rhs, dst, false),
    }
}

/// gemm's register tile for `f32` on this CPU, as gemm-f32 0.19 dispatches it: rows (MR),
/// columns (NR) and SIMD lanes. AVX-512 4 × 16 rows × 6, FMA 2 × 8 × 6, otherwise its
/// scalar 2 × 4 (other architectures are planned with the scalar tile).
fn f32_register_tile() -> (usize, usize, usize) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return (64, 6, 16);
        }
        if std::arch::is_x86_feature_detected!("fma") {
            return (16, 6, 8);
        }
    }
    (2, 4, 1)
}

/// gemm's buffers for one single-threaded call on the whole product (no chunks).
pub(super) fn single_call_bytes(
    m: usize,
    k: usize,
    n: usize,
    lhs: Strides,
    rhs: Strides,
    dst: Strides,
) -> u64 {
    gemm_pack_bytes(m, k, n, lhs, rhs, dst, false)
}

/// gemm-common 0.19's `gemm_basic_generic` buffers for one call: the same transposition,
/// early exits, blocking (`cache::kernel_params`) and packing decisions.
fn gemm_pack_bytes(
    m: usize,
    k: usize,
    n: usize,
    lhs: Strides,
    rhs: Strides,
    dst: Strides,
    rayon: bool,
) -> u64 {
    // gemm computes a column-oriented destination's transpose: dstᵀ = rhsᵀ @ lhsᵀ.
    let (m, n, lhs, rhs) = if dst.col < dst.row {
        let t = |s: Strides| Strides {
            row: s.col,
            col: s.row,
        };
        (n, m, t(rhs), t(lhs))
    } else {
        (m, n, lhs, rhs)
    };
    let small_kernel = lhs.col == 1 && rhs.row == 1 && m * n <= 16 * 16;
    if m <= 1 || n <= 1 || k <= 2 || small_kernel {
        return 0;
    }
    let (mr, nr, lanes) = f32_register_tile();
    let (kc, mc, nc) = if m <= 64 && n <= 64 {
        let kc = k.min(512);
        let l2_floats = gemm_common::cache::CACHE_INFO[1].cache_bytes / 4;
        (kc, (l2_floats / kc) / mr * mr, n.next_multiple_of(nr))
    } else {
        let p = gemm_common::cache::kernel_params(m, n, k, mr, nr, 4);
        (p.kc, p.mc, p.nc)
    };
    let nc = match (nc, rayon) {
        (0, true) => n.next_multiple_of(nr),
        (0, false) => 128 * nr,
        (nc, _) => nc,
    };
    let pack_rhs = (rhs.row != 1 && m > 2 * mr) || (rhs.row == 1 && m > 128 * mr);
    let prepack_lhs = m <= 2 * mc && (m % lanes != 0 || lhs.row != 1);
    let rhs_elems = if pack_rhs { kc * nr * (nc / nr) } else { 0 };
    let lhs_elems = if prepack_lhs {
        kc * mr * m.div_ceil(mr)
    } else {
        0
    };
    4 * (rhs_elems + lhs_elems) as u64
}
