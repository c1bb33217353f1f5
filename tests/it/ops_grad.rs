//! The fused training ops (`tunestudio::model::ops`) against composite references built from
//! plain differentiable candle ops, plus finite differences and edge cases.
use crate::support::max_abs;

use candle_core::{backprop::GradStore, DType, Device, Result, Tensor, Var, D};
use rand::{rngs::StdRng, Rng, SeedableRng};
use tunestudio::model::ops::{self, composite, IGNORE_INDEX};

fn randn(rng: &mut StdRng, shape: &[usize], scale: f32) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|_| {
            // Sum of uniforms: roughly normal, no extra dependency.
            let s: f32 = (0..4).map(|_| rng.gen::<f32>() - 0.5).sum();
            s * scale * 1.7
        })
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// max |a - b| <= tol * max(1, max |b|)
#[track_caller]
fn assert_close(what: &str, a: &Tensor, b: &Tensor, tol: f32) {
    assert_eq!(a.dims(), b.dims(), "{what}: shapes differ");
    let a32 = a.to_dtype(DType::F32).unwrap();
    let b32 = b.to_dtype(DType::F32).unwrap();
    let diff = max_abs(&(&a32 - &b32).unwrap());
    let scale = max_abs(&b32).max(1.0);
    assert!(
        diff.is_finite() && diff <= tol * scale,
        "{what}: max abs diff {diff} > {tol} * {scale}"
    );
}

fn grad(grads: &GradStore, v: &Var) -> Tensor {
    grads
        .get(v.as_tensor())
        .expect("a gradient for the variable")
        .clone()
}

/// A random upstream gradient: loss = sum(out * r), so backward sees non-uniform gradients.
fn weighted_loss(out: &Tensor, r: &Tensor) -> Tensor {
    out.to_dtype(DType::F32)
        .unwrap()
        .mul(r)
        .unwrap()
        .sum_all()
        .unwrap()
}

fn to_var(t: &Tensor, dtype: DType) -> Var {
    Var::from_tensor(&t.to_dtype(dtype).unwrap()).unwrap()
}

// ---------------------------------------------------------------------------------------------
// rms_norm
// ---------------------------------------------------------------------------------------------

fn check_rms_norm(dtype: DType, tol: f32) {
    let mut rng = StdRng::seed_from_u64(1);
    let x = randn(&mut rng, &[3, 5, 37], 2.0);
    let w = (randn(&mut rng, &[37], 0.3) + 1.0).unwrap();
    let r = randn(&mut rng, &[3, 5, 37], 1.0);
    let run = |fused: bool| -> (Tensor, Tensor, Tensor) {
        let xv = to_var(&x, dtype);
        let wv = to_var(&w, dtype);
        let out = if fused {
            ops::rms_norm(xv.as_tensor(), wv.as_tensor(), 1e-5).unwrap()
        } else {
            composite::rms_norm(xv.as_tensor(), wv.as_tensor(), 1e-5).unwrap()
        };
        assert_eq!(out.dtype(), dtype);
        let g = weighted_loss(&out, &r).backward().unwrap();
        (out, grad(&g, &xv), grad(&g, &wv))
    };
    let (o1, gx1, gw1) = run(true);
    let (o2, gx2, gw2) = run(false);
    assert_eq!(gx1.dtype(), dtype);
    assert_eq!(gw1.dtype(), dtype);
    assert_close("rms_norm forward", &o1, &o2, tol);
    assert_close("rms_norm grad x", &gx1, &gx2, tol);
    assert_close("rms_norm grad w", &gw1, &gw2, tol);
}

#[test]
fn rms_norm_matches_composite_f32() {
    check_rms_norm(DType::F32, 1e-5);
}

#[test]
fn rms_norm_matches_composite_half() {
    check_rms_norm(DType::BF16, 2e-2);
    check_rms_norm(DType::F16, 4e-3);
}

#[test]
fn rms_norm_non_contiguous_input() -> Result<()> {
    let mut rng = StdRng::seed_from_u64(2);
    let x = randn(&mut rng, &[6, 4, 16], 1.0).transpose(0, 1)?; // [4, 6, 16], strided
    assert!(!x.is_contiguous());
    let w = (randn(&mut rng, &[16], 0.2) + 1.0)?;
    let a = ops::rms_norm(&x, &w, 1e-6)?;
    let b = composite::rms_norm(&x, &w, 1e-6)?;
    assert_close("rms_norm strided", &a, &b, 1e-5);
    Ok(())
}

/// Central differences of `loss(x) = sum(f(x) * r)` at a few coordinates against autograd.
fn finite_difference_check(
    x: &Tensor,
    f: &dyn Fn(&Tensor) -> Tensor,
    r: &Tensor,
    analytic: &Tensor,
    coords: &[usize],
) {
    let flat = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let ga = analytic.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let eps = 1e-2f32;
    for &i in coords {
        let mut plus = flat.clone();
        plus[i] += eps;
        let mut minus = flat.clone();
        minus[i] -= eps;
        let lp = weighted_loss(
            &f(&Tensor::from_vec(plus, x.shape(), &Device::Cpu).unwrap()),
            r,
        )
        .to_scalar::<f32>()
        .unwrap();
        let lm = weighted_loss(
            &f(&Tensor::from_vec(minus, x.shape(), &Device::Cpu).unwrap()),
            r,
        )
        .to_scalar::<f32>()
        .unwrap();
        let fd = (lp - lm) / (2.0 * eps);
        assert!(
            (fd - ga[i]).abs() <= 2e-2 * fd.abs().max(1.0),
            "finite difference at {i}: {fd} vs autograd {}",
            ga[i]
        );
    }
}

#[test]
fn rms_norm_finite_differences() {
    let mut rng = StdRng::seed_from_u64(3);
    let x = randn(&mut rng, &[4, 12], 1.0);
    let w = (randn(&mut rng, &[12], 0.3) + 1.0).unwrap();
    let r = randn(&mut rng, &[4, 12], 1.0);
    let xv = Var::from_tensor(&x).unwrap();
    let wv = Var::from_tensor(&w).unwrap();
    let out = ops::rms_norm(xv.as_tensor(), wv.as_tensor(), 1e-5).unwrap();
    let g = weighted_loss(&out, &r).backward().unwrap();
    let coords: Vec<usize> = (0..48).step_by(5).collect();
    finite_difference_check(
        &x,
        &|x| ops::rms_norm(x, &w, 1e-5).unwrap(),
        &r,
        &grad(&g, &xv),
        &coords,
    );
    let rw = r.clone();
    finite_difference_check(
        &w,
        &|w| ops::rms_norm(&x, w, 1e-5).unwrap(),
        &rw,
        &grad(&g, &wv),
        &[0, 3, 7, 11],
    );
}

// ---------------------------------------------------------------------------------------------
// rope
// ---------------------------------------------------------------------------------------------

/// HF-style tables: emb = cat(freqs, freqs), positions `pos`.
fn rope_tables(pos: &[f32], d: usize, theta: f32) -> (Tensor, Tensor) {
    let half = d / 2;
    let mut cos = Vec::new();
    let mut sin = Vec::new();
    for &p in pos {
        for rep in 0..2 {
            let _ = rep;
            for i in 0..half {
                let inv = 1.0 / theta.powf(2.0 * i as f32 / d as f32);
                cos.push((p * inv).cos());
                sin.push((p * inv).sin());
            }
        }
    }
    let t = pos.len();
    (
        Tensor::from_vec(cos, (t, d), &Device::Cpu).unwrap(),
        Tensor::from_vec(sin, (t, d), &Device::Cpu).unwrap(),
    )
}

fn check_rope(dtype: DType, tol: f32, per_batch: bool) {
    let mut rng = StdRng::seed_from_u64(4);
    let (b, h, t, d) = (2, 3, 5, 12);
    let x = randn(&mut rng, &[b, h, t, d], 1.0);
    let r = randn(&mut rng, &[b, h, t, d], 1.0);
    let (cos, sin) = if per_batch {
        let (c0, s0) = rope_tables(&[0., 1., 2., 3., 4.], d, 100.0);
        let (c1, s1) = rope_tables(&[7., 8., 9., 10., 11.], d, 100.0);
        (
            Tensor::stack(&[c0, c1], 0).unwrap(),
            Tensor::stack(&[s0, s1], 0).unwrap(),
        )
    } else {
        rope_tables(&[0., 1., 2., 3., 4.], d, 100.0)
    };
    let run = |fused: bool| -> (Tensor, Tensor) {
        let xv = to_var(&x, dtype);
        let out = if fused {
            ops::rope(xv.as_tensor(), &cos, &sin).unwrap()
        } else {
            composite::rope(xv.as_tensor(), &cos, &sin).unwrap()
        };
        assert_eq!(out.dtype(), dtype);
        let g = weighted_loss(&out, &r).backward().unwrap();
        (out, grad(&g, &xv))
    };
    let (o1, g1) = run(true);
    let (o2, g2) = run(false);
    assert_close("rope forward", &o1, &o2, tol);
    assert_close("rope grad x", &g1, &g2, tol);
}

#[test]
fn rope_matches_composite() {
    check_rope(DType::F32, 1e-5, false);
    check_rope(DType::F32, 1e-5, true);
    check_rope(DType::BF16, 2e-2, false);
    check_rope(DType::F16, 4e-3, true);
}

#[test]
fn rope_non_contiguous_input_and_finite_differences() -> Result<()> {
    let mut rng = StdRng::seed_from_u64(5);
    let (b, h, t, d) = (1, 2, 4, 8);
    // [b, t, h, d] transposed to [b, h, t, d], as attention code produces it.
    let x = randn(&mut rng, &[b, t, h, d], 1.0).transpose(1, 2)?;
    let (cos, sin) = rope_tables(&[3., 4., 5., 6.], d, 10_000.0);
    assert_close(
        "rope strided",
        &ops::rope(&x, &cos, &sin)?,
        &composite::rope(&x, &cos, &sin)?,
        1e-5,
    );
    let x = x.contiguous()?;
    let r = randn(&mut rng, &[b, h, t, d], 1.0);
    let xv = Var::from_tensor(&x)?;
    let out = ops::rope(xv.as_tensor(), &cos, &sin)?;
    let g = weighted_loss(&out, &r).backward()?;
    let coords: Vec<usize> = (0..b * h * t * d).step_by(3).collect();
    finite_difference_check(
        &x,
        &|x| ops::rope(x, &cos, &sin).unwrap(),
        &r,
        &grad(&g, &xv),
        &coords,
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// softmax
// ---------------------------------------------------------------------------------------------

/// Scores with a causal mask (-inf above the diagonal) over [b, h, t, t].
fn masked_scores(rng: &mut StdRng, b: usize, h: usize, t: usize) -> Tensor {
    let x = randn(rng, &[b, h, t, t], 3.0);
    let mut mask = vec![0f32; t * t];
    for i in 0..t {
        for j in (i + 1)..t {
            mask[i * t + j] = f32::NEG_INFINITY;
        }
    }
    let mask = Tensor::from_vec(mask, (t, t), &Device::Cpu).unwrap();
    x.broadcast_add(&mask).unwrap()
}

fn check_softmax(dtype: DType, tol: f32) {
    let mut rng = StdRng::seed_from_u64(6);
    let x = masked_scores(&mut rng, 2, 3, 19);
    let r = randn(&mut rng, &[2, 3, 19, 19], 1.0);
    let run = |fused: bool| -> (Tensor, Tensor) {
        let xv = to_var(&x, dtype);
        let out = if fused {
            ops::softmax_last_dim(xv.as_tensor()).unwrap()
        } else {
            composite::softmax_last_dim(xv.as_tensor()).unwrap()
        };
        assert_eq!(out.dtype(), dtype);
        let g = weighted_loss(&out, &r).backward().unwrap();
        (out, grad(&g, &xv))
    };
    let (o1, g1) = run(true);
    let (o2, g2) = run(false);
    assert_close("softmax forward", &o1, &o2, tol);
    assert_close("softmax grad", &g1, &g2, tol);
    // Rows sum to 1.
    let sums = o1.to_dtype(DType::F32).unwrap().sum(D::Minus1).unwrap();
    let ones = Tensor::ones(sums.shape(), DType::F32, &Device::Cpu).unwrap();
    assert_close("softmax row sums", &sums, &ones, tol.max(1e-5) * 4.0);
}

#[test]
fn softmax_matches_composite() {
    check_softmax(DType::F32, 1e-5);
    check_softmax(DType::BF16, 2e-2);
}

#[test]
fn softmax_matches_plain_exp_formula() -> Result<()> {
    // Independent of the composite helper: exp(x) / sum(exp(x)) for moderate scores.
    let mut rng = StdRng::seed_from_u64(7);
    let x = randn(&mut rng, &[5, 40], 2.0);
    let e = x.exp()?;
    let want = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
    assert_close("softmax", &ops::softmax_last_dim(&x)?, &want, 1e-6);
    Ok(())
}

#[test]
fn softmax_fully_masked_rows_are_zero_not_nan() -> Result<()> {
    let mut rng = StdRng::seed_from_u64(8);
    let mut data = randn(&mut rng, &[3, 10], 1.0)
        .flatten_all()?
        .to_vec1::<f32>()?;
    for v in &mut data[10..20] {
        *v = f32::NEG_INFINITY; // row 1 fully masked
    }
    let x = Tensor::from_vec(data, (3, 10), &Device::Cpu)?;
    let xv = Var::from_tensor(&x)?;
    let y = ops::softmax_last_dim(xv.as_tensor())?;
    let rows = y.to_vec2::<f32>()?;
    assert!(
        rows[1].iter().all(|&v| v == 0.0),
        "masked row: {:?}",
        rows[1]
    );
    assert!(rows.iter().flatten().all(|v| v.is_finite()));
    let r = randn(&mut rng, &[3, 10], 1.0);
    let g = weighted_loss(&y, &r).backward()?;
    let gx = grad(&g, &xv).to_vec2::<f32>()?;
    assert!(
        gx[1].iter().all(|&v| v == 0.0),
        "masked row grad: {:?}",
        gx[1]
    );
    assert!(gx.iter().flatten().all(|v| v.is_finite()));
    // bf16 too.
    let yb = ops::softmax_last_dim(&x.to_dtype(DType::BF16)?)?.to_dtype(DType::F32)?;
    assert!(yb.to_vec2::<f32>()?[1].iter().all(|&v| v == 0.0));
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// silu_mul
// ---------------------------------------------------------------------------------------------

fn check_silu_mul(dtype: DType, tol: f32) {
    let mut rng = StdRng::seed_from_u64(9);
    let gate = randn(&mut rng, &[3, 4, 53], 3.0);
    let up = randn(&mut rng, &[3, 4, 53], 1.0);
    let r = randn(&mut rng, &[3, 4, 53], 1.0);
    let run = |fused: bool| -> (Tensor, Tensor, Tensor) {
        let gv = to_var(&gate, dtype);
        let uv = to_var(&up, dtype);
        let out = if fused {
            ops::silu_mul(gv.as_tensor(), uv.as_tensor()).unwrap()
        } else {
            composite::silu_mul(gv.as_tensor(), uv.as_tensor()).unwrap()
        };
        assert_eq!(out.dtype(), dtype);
        let g = weighted_loss(&out, &r).backward().unwrap();
        (out, grad(&g, &gv), grad(&g, &uv))
    };
    let (o1, gg1, gu1) = run(true);
    let (o2, gg2, gu2) = run(false);
    assert_close("silu_mul forward", &o1, &o2, tol);
    assert_close("silu_mul grad gate", &gg1, &gg2, tol);
    assert_close("silu_mul grad up", &gu1, &gu2, tol);
}

#[test]
fn silu_mul_matches_composite() {
    check_silu_mul(DType::F32, 1e-5);
    check_silu_mul(DType::BF16, 2e-2);
}

#[test]
fn silu_mul_rejects_shape_mismatch() {
    let a = Tensor::zeros((2, 3), DType::F32, &Device::Cpu).unwrap();
    let b = Tensor::zeros((3, 2), DType::F32, &Device::Cpu).unwrap();
    assert!(ops::silu_mul(&a, &b).is_err());
}

// ---------------------------------------------------------------------------------------------
// cross-entropy
// ---------------------------------------------------------------------------------------------

/// Cross-entropy written independently of both the fused op and `composite`: log_softmax by
/// hand + gather, masked.
fn reference_ce_rows(logits: &Tensor, labels: &[i64]) -> Tensor {
    let n = labels.len();
    let x = logits.to_dtype(DType::F32).unwrap();
    let max = x.max_keepdim(D::Minus1).unwrap().detach();
    let shifted = x.broadcast_sub(&max).unwrap();
    let log_z = shifted
        .exp()
        .unwrap()
        .sum_keepdim(D::Minus1)
        .unwrap()
        .log()
        .unwrap();
    let log_softmax = shifted.broadcast_sub(&log_z).unwrap();
    let idx: Vec<u32> = labels.iter().map(|&l| l.max(0) as u32).collect();
    let mask: Vec<f32> = labels
        .iter()
        .map(|&l| if l == IGNORE_INDEX { 0.0 } else { 1.0 })
        .collect();
    let idx = Tensor::from_vec(idx, (n, 1), &Device::Cpu).unwrap();
    let picked = log_softmax.gather(&idx, 1).unwrap().squeeze(1).unwrap();
    (picked.neg().unwrap() * Tensor::from_vec(mask, n, &Device::Cpu).unwrap()).unwrap()
}

fn labels_for(rng: &mut StdRng, n: usize, v: usize) -> Vec<i64> {
    (0..n)
        .map(|i| {
            if i % 4 == 1 {
                IGNORE_INDEX
            } else {
                rng.gen_range(0..v as i64)
            }
        })
        .collect()
}

fn check_ce_rows(dtype: DType, tol: f32) {
    let mut rng = StdRng::seed_from_u64(10);
    let (n, v) = (11, 29);
    let logits = randn(&mut rng, &[n, v], 3.0);
    let labels = labels_for(&mut rng, n, v);
    let r = randn(&mut rng, &[n], 1.0);
    let run = |fused: bool| -> (Tensor, Tensor) {
        let lv = to_var(&logits, dtype);
        let out = if fused {
            ops::cross_entropy_rows(lv.as_tensor(), &labels).unwrap()
        } else {
            reference_ce_rows(lv.as_tensor(), &labels)
        };
        assert_eq!(out.dtype(), DType::F32);
        let g = weighted_loss(&out, &r).backward().unwrap();
        (out, grad(&g, &lv))
    };
    let (o1, g1) = run(true);
    let (o2, g2) = run(false);
    assert_close("cross_entropy_rows forward", &o1, &o2, tol);
    assert_close("cross_entropy_rows grad", &g1, &g2, tol);
    // Ignored rows: zero loss, zero gradient.
    let o = o1.to_vec1::<f32>().unwrap();
    let g = g1.to_dtype(DType::F32).unwrap().to_vec2::<f32>().unwrap();
    for (i, &l) in labels.iter().enumerate() {
        if l == IGNORE_INDEX {
            assert_eq!(o[i], 0.0);
            assert!(g[i].iter().all(|&x| x == 0.0));
        }
    }
    // The composite fallback agrees too.
    let c = composite::cross_entropy_rows(&logits.to_dtype(dtype).unwrap(), &labels).unwrap();
    assert_close("composite cross_entropy_rows", &c, &o2, tol);
}

#[test]
fn cross_entropy_rows_matches_reference() {
    check_ce_rows(DType::F32, 1e-5);
    check_ce_rows(DType::BF16, 1e-5); // same bf16 logits, both computed in f32
}

#[test]
fn cross_entropy_rejects_bad_labels() {
    let logits = Tensor::zeros((2, 5), DType::F32, &Device::Cpu).unwrap();
    assert!(ops::cross_entropy_rows(&logits, &[0, 5]).is_err());
    assert!(ops::cross_entropy_rows(&logits, &[0, -1]).is_err());
    assert!(ops::cross_entropy_rows(&logits, &[0]).is_err());
    let h = Tensor::zeros((2, 4), DType::F32, &Device::Cpu).unwrap();
    let w = Tensor::zeros((5, 4), DType::F32, &Device::Cpu).unwrap();
    assert!(ops::linear_cross_entropy(&h, &w, &[0, 7], 8).is_err());
    assert!(ops::linear_cross_entropy(&h, &w, &[0, 1], 0).is_err());
}

/// (sum, per_row, grad hidden, grad weight-var) for the fused op or the plain reference.
#[allow(clippy::too_many_arguments)]
fn run_linear_ce(
    hidden: &Tensor,
    weight_vh: &Tensor,
    labels: &[i64],
    chunk_rows: usize,
    dtype: DType,
    transposed_weight: bool,
    r: &Tensor,
    fused: bool,
) -> (Tensor, Tensor, Tensor, Tensor) {
    let hv = to_var(hidden, dtype);
    // Optionally keep the parameter as [h, v] and pass a transposed view.
    let wv = if transposed_weight {
        to_var(&weight_vh.t().unwrap().contiguous().unwrap(), dtype)
    } else {
        to_var(weight_vh, dtype)
    };
    let w = if transposed_weight {
        wv.as_tensor().t().unwrap()
    } else {
        wv.as_tensor().clone()
    };
    let (sum, per_row) = if fused {
        ops::linear_cross_entropy(hv.as_tensor(), &w, labels, chunk_rows).unwrap()
    } else {
        let logits = hv
            .as_tensor()
            .to_dtype(DType::F32)
            .unwrap()
            .matmul(&w.to_dtype(DType::F32).unwrap().t().unwrap())
            .unwrap();
        let per_row = reference_ce_rows(&logits, labels);
        (per_row.sum_all().unwrap(), per_row)
    };
    assert_eq!(sum.dtype(), DType::F32);
    assert_eq!(per_row.dtype(), DType::F32);
    // Upstream gradient: total = sum + sum(per_row * r), exercising both outputs.
    let total = (&sum + weighted_loss(&per_row, r)).unwrap();
    let g = total.backward().unwrap();
    (sum, per_row, grad(&g, &hv), grad(&g, &wv))
}

fn check_linear_ce(dtype: DType, tol: f32, chunk_rows: usize, transposed: bool) {
    let mut rng = StdRng::seed_from_u64(11);
    let (n, h, v) = (13, 16, 37);
    let hidden = randn(&mut rng, &[n, h], 1.0);
    let weight = randn(&mut rng, &[v, h], 0.5);
    let labels = labels_for(&mut rng, n, v);
    let r = randn(&mut rng, &[n], 0.5);
    let a = run_linear_ce(
        &hidden, &weight, &labels, chunk_rows, dtype, transposed, &r, true,
    );
    let b = run_linear_ce(
        &hidden, &weight, &labels, chunk_rows, dtype, transposed, &r, false,
    );
    let what = format!("linear_cross_entropy {dtype:?} chunk {chunk_rows} transposed {transposed}");
    assert_close(&format!("{what}: sum"), &a.0, &b.0, tol);
    assert_close(&format!("{what}: per row"), &a.1, &b.1, tol);
    assert_close(&format!("{what}: grad hidden"), &a.2, &b.2, tol);
    assert_close(&format!("{what}: grad weight"), &a.3, &b.3, tol);
    assert_eq!(a.2.dtype(), dtype);
    assert_eq!(a.3.dtype(), dtype);
    if transposed {
        assert_eq!(a.3.dims(), &[h, v]);
    }
}

#[test]
fn linear_cross_entropy_matches_reference() {
    for chunk in [1, 4, 5, 100] {
        check_linear_ce(DType::F32, 1e-5, chunk, false);
    }
    check_linear_ce(DType::F32, 1e-5, 4, true);
    check_linear_ce(DType::F32, 1e-5, 100, true);
    // bf16 inputs are widened to f32 on both sides: same numbers.
    check_linear_ce(DType::BF16, 1e-4, 3, false);
}

#[test]
fn linear_cross_entropy_composite_fallback_agrees() -> Result<()> {
    let mut rng = StdRng::seed_from_u64(12);
    let hidden = randn(&mut rng, &[6, 8], 1.0);
    let weight = randn(&mut rng, &[11, 8], 0.5);
    let labels = [3, IGNORE_INDEX, 0, 10, 4, IGNORE_INDEX];
    let (s1, p1) = ops::linear_cross_entropy(&hidden, &weight, &labels, 4)?;
    let (s2, p2) = composite::linear_cross_entropy(&hidden, &weight, &labels, 4)?;
    assert_close("sum", &s1, &s2, 1e-5);
    assert_close("per row", &p1, &p2, 1e-5);
    Ok(())
}

#[test]
fn linear_cross_entropy_all_ignored() -> Result<()> {
    let mut rng = StdRng::seed_from_u64(13);
    let hv = Var::from_tensor(&randn(&mut rng, &[3, 4], 1.0))?;
    let wv = Var::from_tensor(&randn(&mut rng, &[5, 4], 1.0))?;
    let labels = [IGNORE_INDEX; 3];
    let (sum, per_row) = ops::linear_cross_entropy(hv.as_tensor(), wv.as_tensor(), &labels, 2)?;
    assert_eq!(sum.to_scalar::<f32>()?, 0.0);
    assert!(per_row.to_vec1::<f32>()?.iter().all(|&x| x == 0.0));
    let g = sum.backward()?;
    assert_eq!(max_abs(&grad(&g, &hv)), 0.0);
    assert_eq!(max_abs(&grad(&g, &wv)), 0.0);
    Ok(())
}

#[test]
fn linear_cross_entropy_twice_backward_is_stable() -> Result<()> {
    // The cached last chunk is consumed by the first backward; a second backward recomputes it.
    let mut rng = StdRng::seed_from_u64(14);
    let hv = Var::from_tensor(&randn(&mut rng, &[5, 6], 1.0))?;
    let wv = Var::from_tensor(&randn(&mut rng, &[9, 6], 1.0))?;
    let labels = [1, 2, 3, IGNORE_INDEX, 8];
    let (sum, _) = ops::linear_cross_entropy(hv.as_tensor(), wv.as_tensor(), &labels, 2)?;
    let g1 = sum.backward()?;
    let g2 = sum.backward()?;
    assert_close("grad hidden", &grad(&g1, &hv), &grad(&g2, &hv), 1e-6);
    assert_close("grad weight", &grad(&g1, &wv), &grad(&g2, &wv), 1e-6);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// frozen_linear
// ---------------------------------------------------------------------------------------------

fn check_frozen_linear(dtype: DType, tol: f32, transposed: bool, with_bias: bool) {
    let mut rng = StdRng::seed_from_u64(15);
    let x = randn(&mut rng, &[2, 3, 24], 1.0);
    let w = randn(&mut rng, &[10, 24], 0.3);
    let bias = randn(&mut rng, &[10], 0.3);
    let r = randn(&mut rng, &[2, 3, 10], 1.0);

    let xv = to_var(&x, dtype);
    let wv = if transposed {
        to_var(&w.t().unwrap().contiguous().unwrap(), dtype)
    } else {
        to_var(&w, dtype)
    };
    let bv = to_var(&bias, dtype);
    let wt = if transposed {
        wv.as_tensor().t().unwrap()
    } else {
        wv.as_tensor().clone()
    };
    let out = ops::frozen_linear(xv.as_tensor(), &wt, with_bias.then(|| bv.as_tensor())).unwrap();
    assert_eq!(out.dtype(), dtype);
    assert_eq!(out.dims(), &[2, 3, 10]);
    let g = weighted_loss(&out, &r).backward().unwrap();
    let gx = grad(&g, &xv);
    assert_eq!(gx.dtype(), dtype);
    assert!(
        g.get(wv.as_tensor()).is_none(),
        "frozen weight got a gradient"
    );
    assert!(
        g.get(bv.as_tensor()).is_none(),
        "frozen bias got a gradient"
    );

    // Reference: a plain differentiable matmul (+ bias), in f32.
    let xr = Var::from_tensor(&x.to_dtype(dtype).unwrap().to_dtype(DType::F32).unwrap()).unwrap();
    let w32 = w.to_dtype(dtype).unwrap().to_dtype(DType::F32).unwrap();
    let mut want = xr.as_tensor().broadcast_matmul(&w32.t().unwrap()).unwrap();
    if with_bias {
        let b32 = bias.to_dtype(dtype).unwrap().to_dtype(DType::F32).unwrap();
        want = want.broadcast_add(&b32).unwrap();
    }
    let gr = weighted_loss(&want, &r).backward().unwrap();
    assert_close("frozen_linear forward", &out, &want, tol);
    assert_close("frozen_linear grad x", &gx, &grad(&gr, &xr), tol);
}

#[test]
fn frozen_linear_matches_matmul_and_freezes_weight() {
    for transposed in [false, true] {
        for with_bias in [false, true] {
            check_frozen_linear(DType::F32, 1e-5, transposed, with_bias);
        }
    }
    check_frozen_linear(DType::BF16, 2e-2, false, true);
    check_frozen_linear(DType::F16, 4e-3, true, false);
}

#[test]
fn frozen_linear_composite_agrees() -> Result<()> {
    let mut rng = StdRng::seed_from_u64(16);
    let x = randn(&mut rng, &[4, 7], 1.0);
    let w = randn(&mut rng, &[5, 7], 1.0);
    let b = randn(&mut rng, &[5], 1.0);
    assert_close(
        "frozen_linear",
        &ops::frozen_linear(&x, &w, Some(&b))?,
        &composite::frozen_linear(&x, &w, Some(&b))?,
        1e-5,
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The ops inside a bigger graph: gradients reach every variable.
// ---------------------------------------------------------------------------------------------

type OpSet = (
    fn(&Tensor, &Tensor, f64) -> Result<Tensor>,
    fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>,
    fn(&Tensor) -> Result<Tensor>,
    fn(&Tensor, &Tensor) -> Result<Tensor>,
);

#[test]
fn gradients_flow_through_a_chain_of_fused_ops() -> Result<()> {
    let mut rng = StdRng::seed_from_u64(17);
    let (b, h, t, d) = (1, 2, 6, 8);
    let hidden = h * d;
    let xv = Var::from_tensor(&randn(&mut rng, &[b, t, hidden], 1.0))?;
    let norm_w = Var::from_tensor(&(randn(&mut rng, &[hidden], 0.1) + 1.0)?)?;
    let gate_w = Var::from_tensor(&randn(&mut rng, &[hidden, hidden], 0.2))?;
    let lm = Var::from_tensor(&randn(&mut rng, &[20, hidden], 0.2))?;
    let (cos, sin) = rope_tables(&[0., 1., 2., 3., 4., 5.], d, 10_000.0);

    let run = |fused: bool| -> Result<Vec<Tensor>> {
        let (norm, rope, soft, silu): OpSet = if fused {
            (
                ops::rms_norm,
                ops::rope,
                ops::softmax_last_dim,
                ops::silu_mul,
            )
        } else {
            (
                composite::rms_norm,
                composite::rope,
                composite::softmax_last_dim,
                composite::silu_mul,
            )
        };
        let n = norm(xv.as_tensor(), norm_w.as_tensor(), 1e-5)?;
        let q = n.reshape((b, t, h, d))?.transpose(1, 2)?; // [b, h, t, d], strided
        let q = rope(&q, &cos, &sin)?;
        let scores = (q.matmul(&q.transpose(2, 3)?)? * 0.3)?;
        let p = soft(&scores)?;
        let att = p.matmul(&q)?.transpose(1, 2)?.reshape((b, t, hidden))?;
        let g = att.broadcast_matmul(&gate_w.as_tensor().t()?)?;
        let m = silu(&g, &att)?;
        let labels = [1, 5, IGNORE_INDEX, 19, 0, 7];
        let (loss, _) = if fused {
            ops::linear_cross_entropy(&m.reshape((t, hidden))?, lm.as_tensor(), &labels, 4)?
        } else {
            composite::linear_cross_entropy(&m.reshape((t, hidden))?, lm.as_tensor(), &labels, 4)?
        };
        let grads = loss.backward()?;
        Ok([&xv, &norm_w, &gate_w, &lm]
            .iter()
            .map(|v| grad(&grads, v))
            .collect())
    };
    let fused = run(true)?;
    let reference = run(false)?;
    for (i, (a, b)) in fused.iter().zip(&reference).enumerate() {
        assert!(max_abs(b) > 0.0, "reference gradient {i} is zero");
        assert_close(&format!("chain grad {i}"), a, b, 1e-4);
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Shapes large enough that the kernels split rows over several rayon tasks.
// ---------------------------------------------------------------------------------------------

#[test]
fn multi_task_shapes_match_composite() -> Result<()> {
    let mut rng = StdRng::seed_from_u64(18);
    // rms_norm: 320 rows of 512 (several tasks and a partial-sum reduction for the weight grad).
    let x = Var::from_tensor(&randn(&mut rng, &[320, 512], 1.0))?;
    let w = Var::from_tensor(&(randn(&mut rng, &[512], 0.2) + 1.0)?)?;
    let r = randn(&mut rng, &[320, 512], 1.0);
    let ga = weighted_loss(&ops::rms_norm(x.as_tensor(), w.as_tensor(), 1e-6)?, &r).backward()?;
    let gb = weighted_loss(
        &composite::rms_norm(x.as_tensor(), w.as_tensor(), 1e-6)?,
        &r,
    )
    .backward()?;
    assert_close("rms_norm grad x", &grad(&ga, &x), &grad(&gb, &x), 1e-5);
    assert_close("rms_norm grad w", &grad(&ga, &w), &grad(&gb, &w), 1e-5);

    // softmax over [2, 4, 128, 128] with a causal mask.
    let s = Var::from_tensor(&masked_scores(&mut rng, 2, 4, 128))?;
    let r = randn(&mut rng, &[2, 4, 128, 128], 1.0);
    let ya = ops::softmax_last_dim(s.as_tensor())?;
    let yb = composite::softmax_last_dim(s.as_tensor())?;
    assert_close("softmax", &ya, &yb, 1e-5);
    let ga = weighted_loss(&ya, &r).backward()?;
    let gb = weighted_loss(&yb, &r).backward()?;
    assert_close("softmax grad", &grad(&ga, &s), &grad(&gb, &s), 1e-5);

    // rope over [2, 8, 128, 64] with per-sequence positions.
    let x = Var::from_tensor(&randn(&mut rng, &[2, 8, 128, 64], 1.0))?;
    let pos0: Vec<f32> = (0..128).map(|p| p as f32).collect();
    let pos1: Vec<f32> = (0..128).map(|p| (p + 9) as f32).collect();
    let (c0, s0) = rope_tables(&pos0, 64, 10_000.0);
    let (c1, s1) = rope_tables(&pos1, 64, 10_000.0);
    let cos = Tensor::stack(&[c0, c1], 0)?;
    let sin = Tensor::stack(&[s0, s1], 0)?;
    let r = randn(&mut rng, &[2, 8, 128, 64], 1.0);
    let ya = ops::rope(x.as_tensor(), &cos, &sin)?;
    let yb = composite::rope(x.as_tensor(), &cos, &sin)?;
    assert_close("rope", &ya, &yb, 1e-5);
    let ga = weighted_loss(&ya, &r).backward()?;
    let gb = weighted_loss(&yb, &r).backward()?;
    assert_close("rope grad", &grad(&ga, &x), &grad(&gb, &x), 1e-5);

    // silu_mul over 150k elements.
    let g = Var::from_tensor(&randn(&mut rng, &[300, 500], 2.0))?;
    let u = Var::from_tensor(&randn(&mut rng, &[300, 500], 1.0))?;
    let r = randn(&mut rng, &[300, 500], 1.0);
    let ga = weighted_loss(&ops::silu_mul(g.as_tensor(), u.as_tensor())?, &r).backward()?;
    let gb = weighted_loss(&composite::silu_mul(g.as_tensor(), u.as_tensor())?, &r).backward()?;
    assert_close("silu_mul grad gate", &grad(&ga, &g), &grad(&gb, &g), 1e-5);
    assert_close("silu_mul grad up", &grad(&ga, &u), &grad(&gb, &u), 1e-5);

    // cross_entropy_rows and linear_cross_entropy with a 3000-token vocabulary.
    let (n, h, v) = (40, 32, 3000);
    let labels = labels_for(&mut rng, n, v);
    let logits = Var::from_tensor(&randn(&mut rng, &[n, v], 3.0))?;
    let r = randn(&mut rng, &[n], 1.0);
    let ya = ops::cross_entropy_rows(logits.as_tensor(), &labels)?;
    let yb = reference_ce_rows(logits.as_tensor(), &labels);
    assert_close("ce rows", &ya, &yb, 1e-5);
    let ga = weighted_loss(&ya, &r).backward()?;
    let gb = weighted_loss(&yb, &r).backward()?;
    assert_close(
        "ce rows grad",
        &grad(&ga, &logits),
        &grad(&gb, &logits),
        1e-5,
    );
    let hidden = randn(&mut rng, &[n, h], 1.0);
    let weight = randn(&mut rng, &[v, h], 0.3);
    let a = run_linear_ce(&hidden, &weight, &labels, 16, DType::F32, false, &r, true);
    let b = run_linear_ce(&hidden, &weight, &labels, 16, DType::F32, false, &r, false);
    assert_close("lce sum", &a.0, &b.0, 1e-5);
    assert_close("lce grad hidden", &a.2, &b.2, 1e-5);
    assert_close("lce grad weight", &a.3, &b.3, 1e-5);
    Ok(())
}

#[test]
fn silu_mul_same_tensor_twice() -> Result<()> {
    // Both arguments share one storage (nested read locks in backward must not deadlock).
    let mut rng = StdRng::seed_from_u64(19);
    let x = Var::from_tensor(&randn(&mut rng, &[4, 9], 1.0))?;
    let ga = ops::silu_mul(x.as_tensor(), x.as_tensor())?
        .sum_all()?
        .backward()?;
    let gb = composite::silu_mul(x.as_tensor(), x.as_tensor())?
        .sum_all()?
        .backward()?;
    assert_close("silu_mul(x, x) grad", &grad(&ga, &x), &grad(&gb, &x), 1e-5);
    Ok(())
}
