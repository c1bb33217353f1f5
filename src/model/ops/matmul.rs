//! A bounds-checked wrapper around the `gemm` crate's f32 kernel (the one candle uses), so the
//! fused ops can multiply straight out of storage slices with arbitrary strides and accumulate
//! into an existing buffer without a zero-fill-then-add.

use candle_core::{bail, Result};

/// A read-only strided matrix view over an `f32` slice.
#[derive(Clone, Copy)]
pub(crate) struct MatRef<'a> {
    pub data: &'a [f32],
    pub rows: usize,
    pub cols: usize,
    /// Distance between consecutive rows, in elements.
    pub row_stride: usize,
    /// Distance between consecutive columns, in elements.
    pub col_stride: usize,
}

impl<'a> MatRef<'a> {
    /// A row-major `rows × cols` matrix.
    pub fn row_major(data: &'a [f32], rows: usize, cols: usize) -> Self {
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

    fn check(&self, what: &str) -> Result<()> {
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
    let (m, k, n) = (lhs.rows, lhs.cols, rhs.cols);
    if rhs.rows != k {
        bail!("gemm: inner dimensions differ ({m}x{k} @ {}x{n})", rhs.rows);
    }
    lhs.check("lhs")?;
    rhs.check("rhs")?;
    let dst_view = MatRef {
        data: dst,
        rows: m,
        cols: n,
        row_stride: dst_row_stride,
        col_stride: dst_col_stride,
    };
    dst_view.check("dst")?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                for j in 0..n {
                    dst[i * dst_row_stride + j * dst_col_stride] = 0.0;
                }
            }
        }
        return Ok(());
    }
    let threads = rayon::current_num_threads();
    let parallelism = if parallel && threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: every view was bounds-checked above for its full index range, `dst` is borrowed
    // mutably (so it cannot alias `lhs`/`rhs`, which are shared borrows), and the strides passed
    // are exactly the ones checked.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
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
    Ok(())
}
