//! The parity steps' judgement: what a bf16 or fp32 gradient must be to pass.

use super::*;

/// A reference like the fixture's: two `grad.*` tensors and a loss.
fn reference() -> HashMap<String, Tensor> {
    let w = Tensor::arange(-24f32, 24f32, &Device::Cpu)
        .and_then(|t| t.affine(1e-3, 0.0))
        .and_then(|t| t.reshape((6, 8)))
        .expect("reference weight gradient");
    let b = Tensor::new(&[0.5f32, -0.25, 0.125, 2.0], &Device::Cpu).expect("reference bias");
    HashMap::from([
        ("grad.w".to_string(), w),
        ("grad.b".to_string(), b),
        (
            "loss".to_string(),
            Tensor::new(&[10.8f32], &Device::Cpu).expect("loss"),
        ),
    ])
}

/// The reference gradients as the run's, each mapped by `f`.
fn run_gradients(f: impl Fn(&Tensor) -> Tensor) -> Gradients {
    let mut grads = Gradients::new();
    for (key, t) in reference() {
        if let Some(name) = key.strip_prefix("grad.") {
            grads.insert(name, f(&t));
        }
    }
    grads
}

fn judged(dtype: DType, grads: &Gradients) -> (bool, String) {
    let tolerance = ParityTolerance::of(dtype, CheckMode::Cpu);
    let comparison = compare_with_reference(grads, &reference()).expect("comparison");
    (
        tolerance.admits(0.0, &comparison),
        comparison.describe(&tolerance),
    )
}

#[test]
fn bf16_gradients_rounded_from_the_reference_pass() {
    let grads = run_gradients(|t| t.to_dtype(DType::BF16).expect("bf16"));
    let (passed, detail) = judged(DType::BF16, &grads);
    assert!(passed, "{detail}");
}

#[test]
fn a_bf16_gradient_in_the_right_direction_but_twice_the_size_fails() {
    // Cosine 1: before the size tolerance this passed the bf16 step.
    let grads = run_gradients(|t| {
        t.affine(2.0, 0.0)
            .and_then(|t| t.to_dtype(DType::BF16))
            .expect("doubled")
    });
    let (passed, detail) = judged(DType::BF16, &grads);
    assert!(!passed, "a doubled gradient passed: {detail}");
    assert!(detail.contains("min cosine 1.00000"), "{detail}");
    let on_gpu = ParityTolerance::of(DType::BF16, CheckMode::Gpu);
    let comparison = compare_with_reference(&grads, &reference()).expect("comparison");
    assert!(
        !on_gpu.admits(0.0, &comparison),
        "a doubled gradient passed on the GPU"
    );
}

#[test]
fn a_parameter_without_a_gradient_fails_and_is_named() {
    let mut grads = run_gradients(|t| t.clone());
    grads.remove("b");
    let (passed, detail) = judged(DType::F32, &grads);
    assert!(!passed, "a missing gradient passed: {detail}");
    assert!(detail.contains("no gradient for b"), "{detail}");
}

#[test]
fn an_fp32_gradient_off_by_more_than_float_rounding_fails() {
    let grads = run_gradients(|t| t.affine(1.01, 0.0).expect("scaled"));
    assert!(!judged(DType::F32, &grads).0);
    assert!(judged(DType::F32, &run_gradients(|t| t.clone())).0);
}
