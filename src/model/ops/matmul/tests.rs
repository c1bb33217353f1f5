//! The products against an f64 reference, in every layout, split and chunked.

use super::*;

/// A deterministic pseudo-random matrix in [-1, 1).
pub(crate) fn filled(len: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// `lhs @ rhs` in f64, element by element.
fn reference(lhs: MatRef<'_>, rhs: MatRef<'_>) -> Vec<f64> {
    let mut out = vec![0f64; lhs.rows * rhs.cols];
    for i in 0..lhs.rows {
        for p in 0..lhs.cols {
            let a = lhs.data[i * lhs.row_stride + p * lhs.col_stride] as f64;
            for j in 0..rhs.cols {
                out[i * rhs.cols + j] +=
                    a * rhs.data[p * rhs.row_stride + j * rhs.col_stride] as f64;
            }
        }
    }
    out
}

fn assert_close(got: &[f32], want: &[f64], k: usize, what: &str) {
    // Inputs in [-1, 1): the f32 error of a length-k dot product grows about like sqrt(k).
    let tol = 1e-5 * (k as f64).sqrt() * 4.0;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (*g as f64 - w).abs() <= tol,
            "{what}: element {i} is {g}, expected {w} (tolerance {tol})"
        );
    }
}

/// The products of a training step (activations × weights, their transposes for the
/// gradients) and ragged shapes that end in partial micro-tiles, through whichever kernel
/// the gemm crate picks on this CPU at run time.
#[test]
fn products_match_a_reference_in_every_layout() {
    // Two threads, as on the bench machines, so the products split across threads (by
    // columns, or by rows for the tall one) as well as running whole.
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    pool.install(|| {
        check_products_against_reference(&[
            (256, 576, 1536),
            (37, 129, 251),
            (300, 200, 40),
            (5, 3, 300),
            (17, 1000, 9),
        ])
    });
}

#[test]
fn uneven_splits_cover_every_column_and_row() {
    // 97 columns (or rows) over 3 threads: blocks with boundaries rounded to 16.
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(3)
        .build()
        .unwrap();
    pool.install(|| check_products_against_reference(&[(40, 300, 97), (97, 300, 40)]));
}

/// The fused head's weight gradient (`dW[v, h] = dᵀ · h`) on one thread: gemm would pack
/// more than [`PACK_CHUNK_ABOVE_BYTES`], so the product runs in [`PACK_CHUNK_COLS`]-row
/// chunks (3,000 rows: three whole chunks and a partial one), every layout still exact.
#[test]
fn a_product_cut_into_pack_chunks_matches_the_reference() {
    let (m, k, n) = (3000, 512, 160);
    let chunks = PackChunks::of(
        (m, k, n),
        Strides { row: 1, col: m },
        Strides::row_major(n),
        Strides::row_major(n),
    );
    assert!(
        chunks.is_some_and(|c| !c.split_cols && c.len == m),
        "{chunks:?}"
    );
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    pool.install(|| check_products_against_reference(&[(m, k, n)]));
}

fn check_products_against_reference(shapes: &[(usize, usize, usize)]) {
    for (seed, &(m, k, n)) in shapes.iter().enumerate() {
        let a = filled(m * k, seed as u64 + 1);
        let b = filled(k * n, seed as u64 + 100);
        // Row-major and transposed storage of the same logical matrices.
        let a_t: Vec<f32> = (0..k * m).map(|idx| a[(idx % m) * k + idx / m]).collect();
        let b_t: Vec<f32> = (0..n * k).map(|idx| b[(idx % k) * n + idx / k]).collect();
        let lhs_views = [
            MatRef::row_major(&a, m, k),
            MatRef::row_major(&a_t, k, m).t(),
        ];
        let rhs_views = [
            MatRef::row_major(&b, k, n),
            MatRef::row_major(&b_t, n, k).t(),
        ];
        let want = reference(lhs_views[0], rhs_views[0]);
        for (li, lhs) in lhs_views.iter().enumerate() {
            for (ri, rhs) in rhs_views.iter().enumerate() {
                let what = format!("{m}x{k}x{n}, layout {li}{ri}");
                let fresh = sgemm_new(*lhs, *rhs).unwrap();
                assert_close(&fresh, &want, k, &format!("new {what}"));

                // Accumulating adds onto what is there.
                let mut acc = vec![0.5f32; m * n];
                sgemm(&mut acc, n, 1, true, *lhs, *rhs).unwrap();
                let shifted: Vec<f64> = want.iter().map(|w| w + 0.5).collect();
                assert_close(&acc, &shifted, k, &format!("accumulate {what}"));
            }
        }
    }
}

#[test]
fn mismatched_or_out_of_bounds_views_are_errors() {
    let a = vec![1f32; 6];
    let b = vec![1f32; 6];
    assert!(sgemm_new(MatRef::row_major(&a, 2, 3), MatRef::row_major(&b, 2, 3)).is_err());
    let short = MatRef {
        data: &a,
        rows: 3,
        cols: 3,
        row_stride: 3,
        col_stride: 1,
    };
    assert!(sgemm_new(short, MatRef::row_major(&b, 3, 2)).is_err());
}
