//! Helpers the integration tests share: fixture folders and tensor comparisons.

use candle_core::{DType, Tensor};
use std::path::PathBuf;

/// A fixture model folder under `../shared/fixtures`.
pub fn fixture(name: &str) -> PathBuf {
    tunestudio::paths::shared_dir().join("fixtures").join(name)
}

/// Largest absolute element, compared in f32.
pub fn max_abs(t: &Tensor) -> f32 {
    t.to_dtype(DType::F32)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// Largest absolute difference of two tensors of one shape, compared in f32.
pub fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims(), "shapes differ");
    max_abs(&(a.to_dtype(DType::F32).unwrap() - b.to_dtype(DType::F32).unwrap()).unwrap())
}
