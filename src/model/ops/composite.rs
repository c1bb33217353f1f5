//! The same ops written as compositions of plain differentiable candle ops.
//!
//! Used where the fused CPU kernels do not apply (CUDA/Metal tensors, f64), and as the reference
//! the fused kernels are tested against. Same signatures and semantics as the fused versions;
//! slower and more memory-hungry (every intermediate is a tensor kept for backward).

use super::IGNORE_INDEX;
use candle_core::{bail, DType, Tensor, D};

/// Composite [`super::rms_norm`].
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    let dtype = x.dtype();
    let x32 = x.to_dtype(DType::F32)?;
    let inv = (x32.sqr()?.mean_keepdim(D::Minus1)? + eps)?
        .sqrt()?
        .recip()?;
    let xhat = x32.broadcast_mul(&inv)?;
    // Round x̂ to the input dtype before the weight multiply, as HF does.
    let xhat = xhat.to_dtype(dtype)?.to_dtype(DType::F32)?;
    xhat.broadcast_mul(&weight.to_dtype(DType::F32)?)?
        .to_dtype(dtype)
}

/// Composite [`super::rope`].
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> candle_core::Result<Tensor> {
    let dtype = x.dtype();
    let d = x.dim(D::Minus1)?;
    let half = d / 2;
    let x32 = x.to_dtype(DType::F32)?;
    let (cos, sin) = match cos.rank() {
        2 => (cos.to_dtype(DType::F32)?, sin.to_dtype(DType::F32)?),
        // [b, t, d] -> [b, 1, t, d]
        3 => (
            cos.to_dtype(DType::F32)?.unsqueeze(1)?,
            sin.to_dtype(DType::F32)?.unsqueeze(1)?,
        ),
        r => bail!("rope: cos/sin must be [t, d] or [b, t, d], got rank {r}"),
    };
    let x1 = x32.narrow(D::Minus1, 0, half)?;
    let x2 = x32.narrow(D::Minus1, half, half)?;
    let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
    (x32.broadcast_mul(&cos)? + rotated.broadcast_mul(&sin)?)?.to_dtype(dtype)
}

/// Composite [`super::softmax_last_dim`] (fully `-inf` rows give zeros).
pub fn softmax_last_dim(x: &Tensor) -> candle_core::Result<Tensor> {
    let dtype = x.dtype();
    let x32 = x.to_dtype(DType::F32)?;
    // The max only shifts for stability; detaching it keeps it out of the gradient (the softmax
    // is shift-invariant). A -inf max (fully masked row) is replaced by 0 so no inf - inf occurs.
    let max = x32.max_keepdim(D::Minus1)?.detach();
    let finite = max.ne(f32::NEG_INFINITY)?.to_dtype(DType::F32)?;
    let max = (max.maximum(f32::MIN)? * &finite)?;
    let e = x32.broadcast_sub(&max)?.exp()?;
    let sum = e.sum_keepdim(D::Minus1)?;
    // A fully masked row has sum 0: divide by 1 instead (a constant, so no gradient effect).
    let zero_sum = sum.eq(0f32)?.to_dtype(DType::F32)?;
    e.broadcast_div(&(sum + zero_sum)?)?.to_dtype(dtype)
}

/// Composite [`super::silu_mul`].
pub fn silu_mul(gate: &Tensor, up: &Tensor) -> candle_core::Result<Tensor> {
    let dtype = gate.dtype();
    let g = gate.to_dtype(DType::F32)?;
    let u = up.to_dtype(DType::F32)?;
    (g.silu()? * u)?.to_dtype(dtype)
}

/// Composite [`super::cross_entropy_rows`]: per-row `f32` loss `[n]`, 0 for ignored rows.
pub fn cross_entropy_rows(logits: &Tensor, labels: &[i64]) -> candle_core::Result<Tensor> {
    let (n, _v) = logits.dims2()?;
    if labels.len() != n {
        bail!(
            "cross_entropy_rows: {} labels for {n} rows of logits",
            labels.len()
        );
    }
    let dev = logits.device();
    let x = logits.to_dtype(DType::F32)?;
    let max = x.max_keepdim(D::Minus1)?.detach();
    let lse = (x
        .broadcast_sub(&max)?
        .exp()?
        .sum_keepdim(D::Minus1)?
        .log()?
        + &max)?;
    let idx: Vec<i64> = labels
        .iter()
        .map(|&l| if l == IGNORE_INDEX { 0 } else { l })
        .collect();
    let mask: Vec<f32> = labels
        .iter()
        .map(|&l| if l == IGNORE_INDEX { 0.0 } else { 1.0 })
        .collect();
    let idx = Tensor::from_vec(idx, (n, 1), dev)?;
    let mask = Tensor::from_vec(mask, n, dev)?;
    let picked = x.contiguous()?.gather(&idx, 1)?;
    (lse - picked)?.squeeze(1)? * mask
}

/// Composite [`super::linear_cross_entropy`]: `(sum, per_row)`; keeps every chunk's logits for
/// backward.
pub fn linear_cross_entropy(
    hidden: &Tensor,
    weight: &Tensor,
    labels: &[i64],
    chunk_rows: usize,
) -> candle_core::Result<(Tensor, Tensor)> {
    let (n, _h) = hidden.dims2()?;
    if chunk_rows == 0 {
        bail!("linear_cross_entropy: chunk_rows is 0; use at least 1");
    }
    if labels.len() != n {
        bail!("linear_cross_entropy: {} labels for {n} rows", labels.len());
    }
    let w = weight.to_dtype(DType::F32)?;
    let wt = w.t()?;
    let mut parts = Vec::new();
    let mut start = 0;
    while start < n {
        let len = chunk_rows.min(n - start);
        let hc = hidden.narrow(0, start, len)?.to_dtype(DType::F32)?;
        let logits = hc.matmul(&wt)?;
        parts.push(cross_entropy_rows(&logits, &labels[start..start + len])?);
        start += len;
    }
    let per_row = if parts.is_empty() {
        Tensor::zeros(0, DType::F32, hidden.device())?
    } else {
        Tensor::cat(&parts, 0)?
    };
    Ok((per_row.sum_all()?, per_row))
}

/// Composite [`super::frozen_linear`]. The weight and bias are detached, so no gradient reaches
/// them (candle still computes the matmul's weight-side product; the fused CPU op does not).
pub fn frozen_linear(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
) -> candle_core::Result<Tensor> {
    let w = weight.detach().to_dtype(x.dtype())?;
    let y = x.broadcast_matmul(&w.t()?)?;
    match bias {
        Some(b) => y.broadcast_add(&b.detach().to_dtype(x.dtype())?),
        None => Ok(y),
    }
}
