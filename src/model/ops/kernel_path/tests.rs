use super::*;
use crate::model::ops::matmul::tests::filled;
use crate::model::ops::{bf16_to_f32, f32_to_bf16};

/// `lhs @ rhs` in f64, each operand rounded to bf16 when `round` says so.
fn reference(
    a: &[f32],
    b: &[f32],
    (m, k, n): (usize, usize, usize),
    round: (bool, bool),
) -> Vec<f64> {
    let r = |v: f32, on: bool| f64::from(if on { bf16_to_f32(f32_to_bf16(v)) } else { v });
    let mut out = vec![0f64; m * n];
    for i in 0..m {
        for p in 0..k {
            let x = r(a[i * k + p], round.0);
            for j in 0..n {
                out[i * n + j] += x * r(b[p * n + j], round.1);
            }
        }
    }
    out
}

fn transpose<T: Copy>(v: &[T], rows: usize, cols: usize) -> Vec<T> {
    (0..rows * cols)
        .map(|idx| v[(idx % rows) * cols + idx / rows])
        .collect()
}

/// Every layout of the products a layer and the fused head run on `kernel`, for the usual
/// ragged shapes and `extra` ones, against the f64 product of the operands as the path
/// sees them (rounded to bf16 on the bf16 paths; bf16 operands only on the f32 path).
pub(crate) fn check_products(kernel: Bf16Kernel, extra: &[(usize, usize, usize)]) {
    assert!(
        kernel.available(),
        "{} is not available here",
        kernel.name()
    );
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    let base = [
        (256, 576, 192),
        (37, 129, 251),
        (300, 513, 40),
        (5, 3, 33),
        (1, 1, 1),
    ];
    for &(m, k, n) in base.iter().chain(extra) {
        pool.install(|| check_shape(kernel, (m, k, n)));
    }
}

fn check_shape(kernel: Bf16Kernel, (m, k, n): (usize, usize, usize)) {
    let a = filled(m * k, 1 + m as u64);
    let b = filled(k * n, 7 + n as u64);
    let rounds = kernel != Bf16Kernel::F32;
    let want_f32 = reference(&a, &b, (m, k, n), (rounds, rounds));
    let want_half = reference(&a, &b, (m, k, n), (rounds, true));
    let a_t = transpose(&a, m, k);
    let b_half: Vec<bf16> = b.iter().map(|&v| f32_to_bf16(v)).collect();
    let b_half_t = transpose(&b_half, k, n);
    let tol = 1e-5 * (k as f64).sqrt() * 4.0;
    let check = |got: &[f32], want: &[f64], shift: f64, what: &str| {
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (f64::from(*g) - w - shift).abs() <= tol,
                "{} {m}x{k}x{n} {what}: element {i} is {g}, expected {}",
                kernel.name(),
                w + shift
            );
        }
    };
    let lhs = MatRef::row_major(&a, m, k);
    let lhs_t = MatRef::row_major(&a_t, k, m).t();
    let rhs = MatRef::row_major(&b, k, n);
    let rhs_half = MatRef::row_major(&b_half, k, n);
    let rhs_t = MatRef::row_major(&b_half_t, n, k).t();
    check(
        &kernel.gemm_new(lhs, rhs).unwrap(),
        &want_f32,
        0.0,
        "f32 · f32",
    );
    check(
        &kernel.gemm_new(lhs_t, rhs).unwrap(),
        &want_f32,
        0.0,
        "f32ᵀ · f32",
    );
    check(
        &kernel.gemm_new(lhs_t, rhs_half).unwrap(),
        &want_half,
        0.0,
        "f32ᵀ · bf16",
    );
    check(
        &kernel.gemm_new(lhs, rhs_t).unwrap(),
        &want_half,
        0.0,
        "f32 · bf16ᵀ",
    );
    // Accumulating into a wider destination leaves the padding alone.
    let mut acc = vec![0.5f32; m * (n + 3)];
    kernel.gemm(&mut acc, n + 3, true, lhs_t, rhs_t).unwrap();
    let inside: Vec<f32> = acc.chunks(n + 3).flat_map(|r| r[..n].to_vec()).collect();
    check(&inside, &want_half, 0.5, "accumulated");
    assert!(acc.chunks(n + 3).all(|r| r[n..] == [0.5; 3]));
}

/// Every path this machine has, through the dispatcher's entry points; the test names the
/// paths it checked and the ones this CPU lacks.
#[test]
fn every_available_path_matches_a_reference() {
    let (have, lack): (Vec<Bf16Kernel>, Vec<Bf16Kernel>) =
        Bf16Kernel::ALL.into_iter().partition(|k| k.available());
    for &k in &have {
        check_products(k, &[]);
    }
    let names = |v: &[Bf16Kernel]| v.iter().map(|k| k.name()).collect::<Vec<_>>().join(", ");
    eprintln!(
        "checked paths: {}; not on this CPU: {}",
        names(&have),
        names(&lack)
    );
}

#[test]
fn names_round_trip_and_the_cache_file_keeps_other_entries() {
    for k in Bf16Kernel::ALL {
        assert_eq!(Bf16Kernel::parse(k.name()), Some(k));
    }
    assert_eq!(Bf16Kernel::parse("AMX"), Some(Bf16Kernel::Amx));
    assert_eq!(Bf16Kernel::parse("fp16"), None);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("sub").join("kernel-paths.json");
    let g = [(Bf16Kernel::F32, 150.0), (Bf16Kernel::Avx512Bf16, 90.5)];
    cache::write(&file, "cpu A", Bf16Kernel::F32, &g).unwrap();
    cache::write(&file, "cpu B", Bf16Kernel::F32, &g[..1]).unwrap();
    let a = cache::read(&file, "cpu A").unwrap();
    assert_eq!(a.kernel, Bf16Kernel::F32);
    let mut got = a.gflops.clone();
    got.sort_by(|x, y| x.1.total_cmp(&y.1).reverse());
    assert_eq!(got, g.to_vec());
    assert_eq!(a.source, Source::Cached(file.clone()));
    assert!(cache::read(&file, "cpu B").is_some());
    assert!(cache::read(&file, "cpu C").is_none());
    assert!(!a.why().is_empty());
}

/// The process's choice is one of the paths this CPU has, and no slower than the f32 path
/// where it was measured.
#[test]
fn the_chosen_path_runs_here_and_is_no_slower_than_f32() {
    let c = choice();
    eprintln!("chosen path: {} ({})", c.kernel.name(), c.why());
    assert!(c.kernel.available());
    let f32_speed = c
        .gflops
        .iter()
        .find(|g| g.0 == Bf16Kernel::F32)
        .map(|g| g.1);
    if let (Some(f), Some(chosen)) = (f32_speed, c.gflops.iter().find(|g| g.0 == c.kernel)) {
        assert!(chosen.1 >= f, "{c:?}");
    }
}
