//! Differentiable reference implementations of the decoder's building blocks, made only
//! of basic candle ops that all record a backward pass.
//!
//! They follow transformers' eager code step by step (RMSNorm in f32, rotate_half RoPE,
//! softmax in f32), so they are the parity reference the fused kernels in
//! [`super::ops`] are tested against. They are slower and keep more intermediates alive.

use candle_core::{DType, Result, Tensor, D};

/// `w * (x / sqrt(mean(x²) + eps))`, normalised in f32 and cast back to `x`'s dtype
/// before the weight multiply, exactly as `LlamaRMSNorm`.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let dtype = x.dtype();
    let x32 = x.to_dtype(DType::F32)?;
    let var = x32.sqr()?.mean_keepdim(D::Minus1)?;
    let inv = (var + eps)?.sqrt()?.recip()?;
    let normed = x32.broadcast_mul(&inv)?.to_dtype(dtype)?;
    normed.broadcast_mul(w)
}

/// Rotary embedding with HF's `rotate_half` convention: `x·cos + rotate_half(x)·sin`, where
/// `x` is `[b, heads, t, d]` and `cos`/`sin` are `[t, d]` (frequencies repeated twice).
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let d = x.dim(D::Minus1)?;
    let half = d / 2;
    let x1 = x.narrow(D::Minus1, 0, half)?;
    let x2 = x.narrow(D::Minus1, half, half)?;
    let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
    x.broadcast_mul(cos)? + rotated.broadcast_mul(sin)?
}

/// Softmax over the last dimension (the max is subtracted for stability; it carries no
/// gradient, which leaves the softmax gradient unchanged).
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    let m = x.max_keepdim(D::Minus1)?.detach();
    let e = x.broadcast_sub(&m)?.exp()?;
    let s = e.sum_keepdim(D::Minus1)?;
    e.broadcast_div(&s)
}

/// `silu(gate) * up` (the SwiGLU activation).
pub fn silu_mul(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    gate.silu()? * up
}

/// Cross-entropy of each row of `logits` (`[n, vocab]`, any float dtype, computed in f32)
/// against `labels` (`[n]` u32): `logsumexp(row) - row[label]`, shape `[n]`.
pub fn cross_entropy_rows(logits: &Tensor, labels: &Tensor) -> Result<Tensor> {
    let z = logits.to_dtype(DType::F32)?;
    let lse = logsumexp_rows(&z)?;
    let picked = z
        .gather(&labels.unsqueeze(1)?.contiguous()?, 1)?
        .squeeze(1)?;
    lse - picked
}

/// `log(sum(exp(row)))` of each row of a `[n, vocab]` tensor, shape `[n]`.
pub fn logsumexp_rows(z: &Tensor) -> Result<Tensor> {
    let m = z.max_keepdim(D::Minus1)?.detach();
    let s = z.broadcast_sub(&m)?.exp()?.sum_keepdim(D::Minus1)?.log()?;
    (s + m)?.squeeze(D::Minus1)
}
