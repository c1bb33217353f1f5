//! The causal-LM loss, computed over chunks of rows so the `[tokens × vocab]` f32
//! logits never exist all at once.
//!
//! What is kept: the final hidden states of the non-ignored positions (`[n, hidden]`)
//! and, per chunk of [`LOSS_CHUNK_TOKENS`] rows, whatever the cross-entropy op needs
//! for its backward pass. With the fused CPU `linear_cross_entropy` kernel and with its
//! device-generic twin (`ops::generic`, what a GPU runs) that is only the chunk's per-row
//! log-sum-exp (the logits are recomputed in backward); with the composite reference ops
//! each chunk's f32 logits stay in the graph until backward, so chunking bounds the size
//! of one allocation but not the total.

use super::decoder::{CausalLm, IGNORE_INDEX, LOSS_CHUNK_TOKENS};
use super::error::ModelError;
use super::kernels;
use super::ops;
use super::LossOutput;
use candle_core::{DType, Device, Tensor};

/// Shifted labels: `labels[:, 1:]` flattened, and the row indices (into the flattened
/// `hidden[:, :-1]`) whose label is not ignored.
fn shifted_labels(labels: &Tensor, b: usize, t: usize) -> Result<(Vec<i64>, Vec<u32>), ModelError> {
    if labels.dims() != [b, t] {
        return Err(ModelError::Input(format!(
            "labels have shape {:?} but input_ids have [{b}, {t}]",
            labels.dims()
        )));
    }
    if !labels.dtype().is_int() {
        return Err(ModelError::Input(format!(
            "labels must be integers (i64, -100 = ignored), got {:?}",
            labels.dtype()
        )));
    }
    let rows = labels
        .to_device(&Device::Cpu)?
        .to_dtype(DType::I64)?
        .to_vec2::<i64>()?;
    let mut flat = Vec::with_capacity(b * t.saturating_sub(1));
    let mut keep = Vec::new();
    for row in &rows {
        for &l in &row[1..] {
            if l != IGNORE_INDEX {
                keep.push(flat.len() as u32);
            }
            flat.push(l);
        }
    }
    Ok((flat, keep))
}

fn check_label_range(model: &CausalLm, labels: &[i64]) -> Result<(), ModelError> {
    let v = model.config.vocab_size as i64;
    if let Some(bad) = labels
        .iter()
        .find(|&&l| l != IGNORE_INDEX && (l < 0 || l >= v))
    {
        return Err(ModelError::Input(format!(
            "label {bad} is outside the vocabulary (0..{v}) and is not the ignore index -100"
        )));
    }
    Ok(())
}

/// Cross-entropy rows for `hidden` rows `[n, hidden]` against `labels` (`[n]` u32), in chunks.
fn chunked_ce(model: &CausalLm, rows: &Tensor, labels: &Tensor) -> Result<Tensor, ModelError> {
    let n = rows.dim(0)?;
    let head = model.head_weight()?;
    let mut parts = Vec::new();
    let mut start = 0;
    while start < n {
        let len = LOSS_CHUNK_TOKENS.min(n - start);
        let r = rows.narrow(0, start, len)?;
        let l = labels.narrow(0, start, len)?;
        let logits = model.head_matmul_with(&r, &head)?;
        parts.push(kernels::cross_entropy_rows(&logits, &l)?);
        start += len;
    }
    Ok(Tensor::cat(&parts, 0)?)
}

/// [`CausalLm::loss`] in its two parts, calling `between` after the decoder (embeddings,
/// layers, final norm) and before the head (`lm_head` and the chunked loss): a measuring
/// harness reads the heap there to tell the decoder's activations from the head's part
/// (`tests/plan_support/harness.rs`). The result is exactly `CausalLm::loss`'s.
pub fn loss_in_parts(
    model: &CausalLm,
    input_ids: &Tensor,
    attention_mask: Option<&Tensor>,
    labels: &Tensor,
    between: impl FnOnce(),
) -> Result<LossOutput, ModelError> {
    let h = model.hidden_states(input_ids, attention_mask, true)?;
    between();
    causal_lm_loss(model, &h, labels)
}

/// The summed loss of the non-ignored shifted labels.
pub(crate) fn causal_lm_loss(
    model: &CausalLm,
    hidden: &Tensor,
    labels: &Tensor,
) -> Result<LossOutput, ModelError> {
    let (b, t, h) = hidden.dims3()?;
    let (flat, keep) = shifted_labels(labels, b, t)?;
    check_label_range(model, &flat)?;
    let head = model.head_weight()?;
    if keep.is_empty() {
        // Nothing to learn from; keep the graph connected so backward still reaches
        // every parameter (with zero gradients).
        let zero = Tensor::zeros((), hidden.dtype(), hidden.device())?;
        let reach = (hidden.sum_all()? + head.sum_all()?)?;
        let sum = reach.mul(&zero)?.to_dtype(DType::F32)?;
        return Ok(LossOutput { sum, num_tokens: 0 });
    }
    let shifted = hidden.narrow(1, 0, t - 1)?.reshape((b * (t - 1), h))?;
    let n = keep.len();
    if model.ops == kernels::OpsKind::Fused && shifted.device().is_cpu() {
        // The fused op skips ignored rows itself and recomputes chunk logits in backward.
        let (sum, _) = ops::linear_cross_entropy_with_sink(
            &shifted,
            &head,
            &flat,
            LOSS_CHUNK_TOKENS,
            model.head_grad_sink(),
        )?;
        return Ok(LossOutput { sum, num_tokens: n });
    }
    let device = hidden.device();
    let targets: Vec<u32> = keep.iter().map(|&i| flat[i as usize] as u32).collect();
    // Only the rows that carry a label go through lm_head (prompt-masked SFT batches
    // skip most of the vocab-sized work).
    let rows = if n == flat.len() {
        shifted
    } else {
        shifted.index_select(&Tensor::from_vec(keep, n, device)?, 0)?
    };
    let targets = Tensor::from_vec(targets, n, device)?;
    if model.ops != kernels::OpsKind::Reference {
        // Device-generic: one log-sum-exp per row kept, chunk logits recomputed in backward.
        let sum = ops::generic::linear_cross_entropy(
            &rows,
            &head,
            &targets,
            LOSS_CHUNK_TOKENS,
            !model.modules.lm_head_frozen,
        )?;
        return Ok(LossOutput { sum, num_tokens: n });
    }
    let sum = chunked_ce(model, &rows, &targets)?.sum_all()?;
    Ok(LossOutput {
        sum: sum.to_dtype(DType::F32)?,
        num_tokens: n,
    })
}

/// Per-position losses `[b, t-1]` (0 at ignored labels), f32.
pub(crate) fn token_losses(
    model: &CausalLm,
    hidden: &Tensor,
    labels: &Tensor,
) -> Result<Tensor, ModelError> {
    let (b, t, h) = hidden.dims3()?;
    let (flat, _) = shifted_labels(labels, b, t)?;
    check_label_range(model, &flat)?;
    let device = hidden.device();
    let shifted = hidden.narrow(1, 0, t - 1)?.reshape((b * (t - 1), h))?;
    // Diagnostics path: always the accurate composite cross-entropy (libm exp), chunk by
    // chunk; the fused training kernel trades a few ulps of per-row accuracy for speed.
    let shifted = shifted.detach();
    let targets: Vec<u32> = flat
        .iter()
        .map(|&l| if l == IGNORE_INDEX { 0 } else { l as u32 })
        .collect();
    let valid: Vec<f32> = flat
        .iter()
        .map(|&l| if l == IGNORE_INDEX { 0.0 } else { 1.0 })
        .collect();
    let n = flat.len();
    let losses = chunked_ce(model, &shifted, &Tensor::from_vec(targets, n, device)?)?;
    let losses = (losses.to_dtype(DType::F32)? * Tensor::from_vec(valid, n, device)?)?;
    Ok(losses.reshape((b, t - 1))?)
}
