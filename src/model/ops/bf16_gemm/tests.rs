use super::*;
use crate::model::ops::kernel_path::{tests::check_products, Bf16Kernel};

/// Every layout of the products a layer runs, ragged edges included, on the dot-product
/// kernel, against the f64 product of the operands as the path sees them. On a CPU without
/// AVX512-BF16 the path a bf16 run takes there (the f32 widening) is checked against the same
/// reference instead, so the test runs everywhere and says which path it checked.
#[test]
fn products_of_rounded_operands_match_a_reference() {
    let available = Avx512Tile::available();
    let kernel = if available {
        Bf16Kernel::Avx512Bf16
    } else {
        Bf16Kernel::F32
    };
    check_products(kernel, &[(64, 1000, 70)]);
    eprintln!(
        "bf16 products checked on the {} path{}",
        kernel.name(),
        if available {
            ""
        } else {
            " (this CPU has no AVX512-BF16)"
        }
    );
}

/// Every layout of the products a layer and the fused head run (row-major and transposed
/// `f32` left operands, row-major and transposed bf16 or `f32` right ones), ragged edges
/// (m, k, n off multiples of 16 and 32, several inner and column blocks) and accumulation,
/// on the AMX kernel, against the f64 product of the rounded operands. On a CPU without AMX
/// the path the products run on instead is checked, and the test says so.
#[test]
fn amx_products_of_rounded_operands_match_a_reference() {
    let kernel = if AmxTile::available() {
        eprintln!("checked path: amx (AMX-BF16 tiles)");
        Bf16Kernel::Amx
    } else {
        let instead = crate::model::ops::kernel_path::choice().kernel;
        eprintln!(
            "this CPU (or OS) has no AMX-BF16: checked the {} path instead",
            instead.name()
        );
        instead
    };
    check_products(kernel, &[(64, 600, 1100), (33, 700, 70), (48, 64, 2100)]);
}

/// Wrong shapes are errors, never a product; without the instruction every call is one,
/// naming what is missing.
#[test]
fn mismatched_views_are_errors() {
    let a = vec![1f32; 6];
    let new = gemm_new::<Avx512Tile, f32, f32>;
    assert!(new(MatRef::row_major(&a, 2, 3), MatRef::row_major(&a, 2, 3)).is_err());
    let mut small = vec![0f32; 3];
    let err = gemm::<Avx512Tile, f32, f32>(
        &mut small,
        2,
        false,
        MatRef::row_major(&a, 2, 3),
        MatRef::row_major(&a, 3, 2),
    );
    assert!(err.is_err());
    if !Avx512Tile::available() {
        let err = new(MatRef::row_major(&a, 2, 3), MatRef::row_major(&a, 3, 2))
            .expect_err("refused without AVX512-BF16");
        assert!(err.to_string().contains("AVX512-BF16"), "{err}");
    }
}

#[test]
fn amx_mismatched_views_are_errors() {
    let a = vec![1f32; 6];
    let bad =
        gemm_new::<AmxTile, f32, f32>(MatRef::row_major(&a, 2, 3), MatRef::row_major(&a, 2, 3));
    assert!(bad.is_err());
    let mut small = vec![0f32; 3];
    let lhs = MatRef::row_major(&a, 2, 3);
    let rhs = MatRef::row_major(&a, 3, 2);
    assert!(gemm::<AmxTile, f32, f32>(&mut small, 2, false, lhs, rhs).is_err());
}
