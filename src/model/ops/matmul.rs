//! A bounds-checked wrapper around the `gemm` crate's f32 kernel (the one candle uses), so the
//! fused ops can multiply straight out of storage slices with arbitrary strides and accumulate
//! into an existing buffer without a zero-fill-then-add.

use candle_core::{bail, Result};

use super::gemm_pack::{self, Strides};

/// A read-only strided matrix view over a slice (of `f32` unless said otherwise).
pub(crate) struct MatRef<'a, T = f32> {
    pub data: &'a [T],
    pub rows: usize,
    pub cols: usize,
    /// Distance between consecutive rows, in elements.
    pub row_stride: usize,
    /// Distance between consecutive columns, in elements.
    pub col_stride: usize,
}

// Not derived: a derive would require `T: Copy`, and the view is a shared borrow either way.
impl<T> Clone for MatRef<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for MatRef<'_, T> {}

impl<'a, T> MatRef<'a, T> {
    /// A row-major `rows × cols` matrix.
    pub fn row_major(data: &'a [T], rows: usize, cols: usize) -> Self {
        Self {
            data,
            rows,
            cols,
            row_stride: cols,
            col_stride: 1,
        }
    }

    /// The transpose of this view (no copy).
    pub fn t(self) -> Self {
        Self {
            data: self.data,
            rows: self.cols,
            cols: self.rows,
            row_stride: self.col_stride,
            col_stride: self.row_stride,
        }
    }

    /// An error unless every element of the view lies inside its buffer.
    pub(crate) fn check(&self, what: &str) -> Result<()> {
        if self.rows == 0 || self.cols == 0 {
            return Ok(());
        }
        let last = (self.rows - 1) * self.row_stride + (self.cols - 1) * self.col_stride;
        if last >= self.data.len() {
            bail!(
                "gemm: {what} view {}x{} (strides {}, {}) exceeds its buffer of {} elements",
                self.rows,
                self.cols,
                self.row_stride,
                self.col_stride,
                self.data.len()
            );
        }
        Ok(())
    }
}

/// `dst = lhs @ rhs` (or `dst += lhs @ rhs` when `accumulate`), `dst` being a `lhs.rows × rhs.cols`
/// matrix stored in `dst` with the given strides. Uses rayon's pool.
/// The L2 cache size gemm sizes its per-thread workspace by: gemm-common's `L2_SLAB`, one
/// buffer of this many bytes on every thread that packs a product, allocated on its first
/// product and kept for the thread's life. gemm reads it from sysfs (per core: the L2 divided by
/// the cores sharing it), so it follows the machine: 2 MiB on a Sapphire Rapids Xeon, 1 MiB
/// on Zen 4.
pub fn gemm_l2_slab_bytes() -> u64 {
    gemm_common::cache::CACHE_INFO[1].cache_bytes as u64
}

/// Threads that may hold a gemm workspace during a CPU run: rayon's workers (the products'
/// blocks, native layers and the fused head run there) and the thread that calls them
/// (products below gemm's threading threshold run on the caller).
pub fn gemm_workspace_threads() -> u64 {
    rayon::current_num_threads() as u64 + 1
}

pub(crate) fn sgemm(
    dst: &mut [f32],
    dst_row_stride: usize,
    dst_col_stride: usize,
    accumulate: bool,
    lhs: MatRef<'_>,
    rhs: MatRef<'_>,
) -> Result<()> {
    sgemm_on(
        dst,
        dst_row_stride,
        dst_col_stride,
        accumulate,
        lhs,
        rhs,
        true,
    )
}

/// [`sgemm`] on the calling thread only when `parallel` is false (for many small products
/// that are already spread over rayon's pool, such as one attention head per task).
pub(crate) fn sgemm_on(
    dst: &mut [f32],
    dst_row_stride: usize,
    dst_col_stride: usize,
    accumulate: bool,
    lhs: MatRef<'_>,
    rhs: MatRef<'_>,
    parallel: bool,
) -> Result<()> {
    let (m, n) = (lhs.rows, rhs.cols);
    check_dims(lhs, rhs)?;
    MatRef {
        data: dst,
        rows: m,
        cols: n,
        row_stride: dst_row_stride,
        col_stride: dst_col_stride,
    }
    .check("dst")?;
    // SAFETY: the views were checked against their buffers, and `dst` is a unique borrow
    // (it cannot alias `lhs` or `rhs`) whose checked view is the one passed.
    unsafe {
        gemm_unchecked(
            dst.as_mut_ptr(),
            dst_row_stride,
            dst_col_stride,
            accumulate,
            lhs,
            rhs,
            parallel,
        )
    };
    Ok(())
}

/// `lhs @ rhs` as a new row-major `lhs.rows × rhs.cols` buffer (multithreaded).
///
/// The buffer is not zero-filled first: gemm writes every element of its destination when it
/// does not accumulate, and at these sizes the memset of fresh buffers was ≈ 6 % of a training
/// step in profiles. Small or degenerate products (which gemm routes to gemv/gevv kernels that
/// may read the destination) get a zeroed buffer instead.
pub(crate) fn sgemm_new(lhs: MatRef<'_>, rhs: MatRef<'_>) -> Result<Vec<f32>> {
    let (m, k, n) = (lhs.rows, lhs.cols, rhs.cols);
    check_dims(lhs, rhs)?;
    let len = m * n;
    if m < 2 || n < 2 || k < 3 || len <= 16 * 16 {
        let mut out = vec![0f32; len];
        sgemm(&mut out, n, 1, false, lhs, rhs)?;
        return Ok(out);
    }
    let mut out: Vec<f32> = Vec::with_capacity(len);
    // Test builds poison the buffer, so an element gemm failed to write shows up as NaN.
    #[cfg(debug_assertions)]
    out.resize(len, f32::NAN);
    // SAFETY: `out` has capacity for the whole `m × n` row-major destination, which does not
    // alias the inputs (it is freshly allocated). With `accumulate` false, gemm's general path
    // (taken for m, n ≥ 2, k ≥ 3 and more than 16×16 outputs) stores `lhs @ rhs` into every
    // destination element without reading it; only then is the length set.
    unsafe {
        gemm_unchecked(out.as_mut_ptr(), n, 1, false, lhs, rhs, true);
        out.set_len(len);
    }
    Ok(out)
}

/// The inner dimensions agree and both views lie inside their buffers (any element types:
/// the bf16 product checks its views here too).
pub(crate) fn check_dims<A, B>(lhs: MatRef<'_, A>, rhs: MatRef<'_, B>) -> Result<()> {
    if rhs.rows != lhs.cols {
        bail!(
            "gemm: inner dimensions differ ({}x{} @ {}x{})",
            lhs.rows,
            lhs.cols,
            rhs.rows,
            rhs.cols
        );
    }
    lhs.check("lhs")?;
    rhs.check("rhs")
}

/// gemm into `dst` with the given strides.
///
/// # Safety
/// `lhs` and `rhs` must have passed [`check_dims`], `dst` must be valid for writes (and for
/// reads when `accumulate`) over the whole `lhs.rows × rhs.cols` view with these strides, and
/// must not overlap the inputs.
unsafe fn gemm_unchecked(
    dst: *mut f32,
    dst_row_stride: usize,
    dst_col_stride: usize,
    accumulate: bool,
    lhs: MatRef<'_>,
    rhs: MatRef<'_>,
    parallel: bool,
) {
    let (m, k, n) = (lhs.rows, lhs.cols, rhs.cols);
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                for j in 0..n {
                    *dst.add(i * dst_row_stride + j * dst_col_stride) = 0.0;
                }
            }
        }
        return;
    }
    let threads = rayon::current_num_threads();
    if parallel && threads > 1 && split_ok(m, k, n, threads) {
        split_across_threads(
            dst,
            dst_row_stride,
            dst_col_stride,
            accumulate,
            lhs,
            rhs,
            threads,
        );
        return;
    }
    let parallelism = if parallel && threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        let strides = |row, col| Strides { row, col };
        if let Some(chunks) = PackChunks::of(
            (m, k, n),
            strides(lhs.row_stride, lhs.col_stride),
            strides(rhs.row_stride, rhs.col_stride),
            strides(dst_row_stride, dst_col_stride),
        ) {
            for block in chunks.blocks() {
                let (lhs_part, rhs_part, dst_offset) =
                    block.views(lhs, rhs, dst_row_stride, dst_col_stride);
                // SAFETY: each chunk is a disjoint part of the checked destination view.
                unsafe {
                    gemm_unchecked(
                        dst.add(dst_offset),
                        dst_row_stride,
                        dst_col_stride,
                        accumulate,
                        lhs_part,
                        rhs_part,
                        false,
                    )
                };
            }
            return;
        }
        gemm::Parallelism::None
    };
    gemm::gemm(
        m,
        n,
        k,
        dst,
        dst_col_stride as isize,
        dst_row_stride as isize,
        accumulate,
        lhs.data.as_ptr(),
        lhs.col_stride as isize,
        lhs.row_stride as isize,
        rhs.data.as_ptr(),
        rhs.col_stride as isize,
        rhs.row_stride as isize,
        1.0f32,
        1.0f32,
        false,
        false,
        false,
        parallelism,
    );
}

/// The most columns of gemm's (transposed) problem one single-threaded call takes when its
/// buffers would pass [`PACK_CHUNK_ABOVE_BYTES`].
///
/// Why: gemm packs its right operand into `kc × nc` elements per call, `nc` sized by the L3
/// cache, and allocates that buffer afresh each call. On AVX2 (a 16-row register tile) the
/// fused head's weight gradient on the demo packed 23.8 MiB per thread, and whether the two
/// threads' buffers were alive at once was rayon's scheduling: 60 demo steps peaked at
/// 210–230 MiB from run to run. In chunks of 960 columns (a multiple of gemm's 6-column tile
/// and of the 16-lane SIMD width) the buffer is at most `kc × 960` floats (1.9 MiB at `kc` =
/// 512): the same 60 steps peak at 156–158 MiB, in the same time (`farm-bench`, 10 pairs on a
/// 2-vCPU EPYC: wall ratio 0.99, spread 0.81–1.18).
pub(super) const PACK_CHUNK_COLS: usize = 960;

/// gemm buffers of one call above which it is cut into chunks. Smaller buffers are left whole:
/// every chunk re-packs the left operand, and a product that packs little gains nothing.
pub(super) const PACK_CHUNK_ABOVE_BYTES: u64 = 4 << 20;

/// A single-threaded product cut along gemm's column dimension into [`PACK_CHUNK_COLS`]
/// chunks: gemm transposes a destination whose columns are closer than its rows, so for a
/// row-major destination its columns are the destination's rows.
#[derive(Debug, Clone, Copy)]
pub(super) struct PackChunks {
    /// Whether the chunks are ranges of the destination's columns (else of its rows).
    pub split_cols: bool,
    /// The length of the dimension cut.
    pub len: usize,
}

impl PackChunks {
    /// The chunks of `dst[m, n] = lhs[m, k] @ rhs[k, n]` with these strides; `None` when one
    /// call takes it (its buffers are small, or it is no wider than a chunk).
    pub(super) fn of(
        (m, k, n): (usize, usize, usize),
        lhs: Strides,
        rhs: Strides,
        dst: Strides,
    ) -> Option<Self> {
        let split_cols = dst.col >= dst.row;
        let len = if split_cols { n } else { m };
        let chunks = Self { split_cols, len };
        (len > PACK_CHUNK_COLS
            && gemm_pack::single_call_bytes(m, k, n, lhs, rhs, dst) > PACK_CHUNK_ABOVE_BYTES)
            .then_some(chunks)
    }

    /// The widest chunk.
    pub(super) fn widest(self) -> usize {
        PACK_CHUNK_COLS.min(self.len)
    }

    fn blocks(self) -> impl Iterator<Item = ThreadBlock> {
        (0..self.len)
            .step_by(PACK_CHUNK_COLS)
            .map(move |start| ThreadBlock {
                split_cols: self.split_cols,
                start,
                count: PACK_CHUNK_COLS.min(self.len - start),
            })
    }
}

/// Columns or rows per thread are rounded to this many (a multiple of every SIMD width gemm uses).
pub(super) const SPLIT_ALIGN: usize = 16;

/// The widest pool that splits products itself.
const MAX_SPLIT_THREADS: usize = 4;

/// Whether [`split_across_threads`] takes the product rather than gemm's own threading.
pub(super) fn split_ok(m: usize, k: usize, n: usize, threads: usize) -> bool {
    // Below this gemm itself stays on one thread (its threading threshold is 48·48·256). The gain
    // was measured on 2 threads; with many threads each block would re-pack the whole shared
    // operand, so wider pools keep gemm's own scheme.
    threads <= MAX_SPLIT_THREADS
        && m * n * k >= 48 * 48 * 256
        && m.max(n) >= 2 * SPLIT_ALIGN * threads
}

/// A raw pointer to a product's destination that may cross to another rayon worker: each
/// thread's block writes its own part (`split_across_threads`, `bf16_gemm`).
#[derive(Clone, Copy)]
pub(crate) struct SendPtr(pub(crate) *mut f32);
// SAFETY: the threads write disjoint blocks of the destination (see `for_each_thread_block`).
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

impl SendPtr {
    /// The pointer (a method, so closures capture the whole `Send` wrapper, not its field).
    pub(crate) fn get(self) -> *mut f32 {
        self.0
    }
}

/// One thread's block of a product's destination: a range of its columns, or of its rows.
#[derive(Clone, Copy)]
pub(crate) struct ThreadBlock {
    split_cols: bool,
    start: usize,
    count: usize,
}

impl ThreadBlock {
    /// The whole `m × n` destination as one block.
    pub(crate) fn whole(m: usize, _n: usize) -> Self {
        Self {
            split_cols: false,
            start: 0,
            count: m,
        }
    }

    /// The operand views this block multiplies, and the offset of its first destination
    /// element (in elements, for a destination with the given strides).
    pub(crate) fn views<'a, A, B>(
        self,
        lhs: MatRef<'a, A>,
        rhs: MatRef<'a, B>,
        dst_row_stride: usize,
        dst_col_stride: usize,
    ) -> (MatRef<'a, A>, MatRef<'a, B>, usize) {
        if self.split_cols {
            let cols = MatRef {
                data: &rhs.data[self.start * rhs.col_stride..],
                cols: self.count,
                ..rhs
            };
            (lhs, cols, self.start * dst_col_stride)
        } else {
            let rows = MatRef {
                data: &lhs.data[self.start * lhs.row_stride..],
                rows: self.count,
                ..lhs
            };
            (rows, rhs, self.start * dst_row_stride)
        }
    }
}

/// Runs `block` once per thread on rayon's pool, each on a contiguous block of an `m × n`
/// destination's columns (or rows, when there are more rows than columns), with inner
/// boundaries rounded up to `align`.
pub(crate) fn for_each_thread_block(
    m: usize,
    n: usize,
    threads: usize,
    align: usize,
    block: impl Fn(ThreadBlock) + Sync + Send,
) {
    use rayon::prelude::*;
    let split_cols = n >= m;
    let len = if split_cols { n } else { m };
    (0..threads).into_par_iter().for_each(|part| {
        let (start, end) = block_bounds(len, threads, align, part);
        if end > start {
            block(ThreadBlock {
                split_cols,
                start,
                count: end - start,
            });
        }
    });
}

/// Where part `part` of `threads` starts and ends along a dimension of `len`, inner
/// boundaries rounded up to `align`.
pub(super) fn block_bounds(
    len: usize,
    threads: usize,
    align: usize,
    part: usize,
) -> (usize, usize) {
    let bound = |part: usize| {
        if part == threads {
            len
        } else {
            (len * part / threads).next_multiple_of(align).min(len)
        }
    };
    (bound(part), bound(part + 1))
}

/// One single-threaded gemm per thread, each on a contiguous block of the destination's columns
/// (or rows, when there are more rows than columns).
///
/// For the products of a training step at 256 tokens this beat gemm's own rayon scheme: with its
/// AVX-512 kernels, in a micro-benchmark of one step's layer products, 0.67 → 0.57 s (the forward
/// products 0.26 → 0.20 s), and 1.06–1.12 → 1.00–1.04 s per step in interleaved runs.
///
/// # Safety
/// As [`gemm_unchecked`].
unsafe fn split_across_threads(
    dst: *mut f32,
    dst_row_stride: usize,
    dst_col_stride: usize,
    accumulate: bool,
    lhs: MatRef<'_>,
    rhs: MatRef<'_>,
    threads: usize,
) {
    let (m, n) = (lhs.rows, rhs.cols);
    let dst = SendPtr(dst);
    // With `max(m, n) ≥ 2·SPLIT_ALIGN·threads` (see `split_ok`) every block is at least
    // SPLIT_ALIGN wide.
    for_each_thread_block(m, n, threads, SPLIT_ALIGN, |block| {
        let (lhs_part, rhs_part, dst_offset) =
            block.views(lhs, rhs, dst_row_stride, dst_col_stride);
        // SAFETY: the block starts inside the checked destination view and blocks of different
        // parts do not overlap.
        unsafe {
            gemm_unchecked(
                dst.get().add(dst_offset),
                dst_row_stride,
                dst_col_stride,
                accumulate,
                lhs_part,
                rhs_part,
                false,
            )
        };
    });
}

#[cfg(test)]
pub(crate) mod tests;
