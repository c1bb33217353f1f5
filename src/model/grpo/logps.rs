//! Each completion token's log-probability under the sampling temperature, and the entropy of
//! the distribution it was drawn from.

use crate::model::{CausalLm, ModelError};
use candle_core::{DType, Tensor, D};

/// Per-token numbers of a batch of completions, `[rows, completion width]` f32, 0 where the
/// completion mask is 0.
#[derive(Debug, Clone)]
pub struct CompletionLogps {
    /// `log softmax(logits / T)[token]`: differentiable when computed for training.
    pub logps: Tensor,
    /// The entropy of `softmax(logits / T)` at each position (detached; TRL's `entropy`).
    pub entropies: Tensor,
}

impl CompletionLogps {
    /// The same numbers, cut from the graph.
    pub fn detach(&self) -> Self {
        CompletionLogps {
            logps: self.logps.detach(),
            entropies: self.entropies.detach(),
        }
    }
}

/// The log-probabilities of `completion_ids` `[b, c]` under `logits` `[b, c, vocab]` (the
/// logits of the positions that predict them, i.e. one position earlier), after dividing the
/// logits by `temperature` as the sampler did (TRL divides on every log-probability: the
/// policy's, the old policy's and the reference's). `mask` `[b, c]` zeroes padding.
pub fn completion_logps(
    logits: &Tensor,
    completion_ids: &Tensor,
    mask: &Tensor,
    temperature: f64,
) -> Result<CompletionLogps, ModelError> {
    let (b, c, v) = logits.dims3()?;
    if completion_ids.dims() != [b, c] || mask.dims() != [b, c] {
        return Err(ModelError::Input(format!(
            "completion ids {:?} and mask {:?} must be [{b}, {c}] like the logits [{b}, {c}, {v}]",
            completion_ids.dims(),
            mask.dims()
        )));
    }
    if !(temperature > 0.0 && temperature.is_finite()) {
        return Err(ModelError::Input(format!(
            "grpo.temperature = {temperature}: it must be a positive number (1.0 samples the model as it is)"
        )));
    }
    let device = logits.device();
    let scaled = logits
        .to_dtype(DType::F32)?
        .affine(1.0 / temperature, 0.0)?;
    // log-softmax at the target: logit − logsumexp, the max a detached constant shift.
    let max = scaled.max_keepdim(D::Minus1)?.detach();
    let shifted = scaled.broadcast_sub(&max)?;
    let lse = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
    let targets = completion_ids
        .to_device(device)?
        .to_dtype(DType::U32)?
        .unsqueeze(D::Minus1)?;
    let picked = shifted.contiguous()?.gather(&targets, D::Minus1)?;
    let mask = mask.to_device(device)?.to_dtype(DType::F32)?;
    let logps = picked.sub(&lse)?.squeeze(D::Minus1)?.mul(&mask)?;
    // H = −Σ p log p, from the same log-softmax, without a graph.
    let log_p = shifted.detach().broadcast_sub(&lse.detach())?;
    let entropies = log_p
        .exp()?
        .mul(&log_p)?
        .sum(D::Minus1)?
        .neg()?
        .mul(&mask)?;
    Ok(CompletionLogps { logps, entropies })
}

/// The model's [`completion_logps`] for `prompt_ids` `[b, p]` (left-padded, `prompt_mask` 0 on
/// the padding) followed by `completion_ids` `[b, c]` (`completion_mask` 0 after the EOS): one
/// forward over `[b, p + c]`, the head applied only to the `c` positions that predict a
/// completion token. `train`: with dropout and a graph for backward; otherwise detached.
///
/// Positions count the prompt's left padding, as transformers does when no `position_ids` are
/// passed (TRL passes none); RoPE is relative, so this moves log-probabilities by ≤ 2e-6
/// (measured by the fixture's maker).
pub fn model_completion_logps(
    model: &CausalLm,
    prompt_ids: &Tensor,
    prompt_mask: &Tensor,
    completion_ids: &Tensor,
    completion_mask: &Tensor,
    temperature: f64,
    train: bool,
) -> Result<CompletionLogps, ModelError> {
    let (b, p) = prompt_ids.dims2()?;
    let (bc, c) = completion_ids.dims2()?;
    if bc != b || p == 0 || c == 0 {
        return Err(ModelError::Input(format!(
            "prompts [{b}, {p}] and completions [{bc}, {c}] must have the same rows and be non-empty"
        )));
    }
    let ids = Tensor::cat(
        &[
            prompt_ids.to_dtype(DType::U32)?,
            completion_ids.to_dtype(DType::U32)?,
        ],
        1,
    )?;
    let mask = Tensor::cat(
        &[
            prompt_mask.to_dtype(DType::U32)?,
            completion_mask.to_dtype(DType::U32)?,
        ],
        1,
    )?;
    let h = model.hidden_states(&ids, Some(&mask), train)?;
    let hidden = h.dim(2)?;
    // Position p − 1 + t predicts completion token t.
    let h = h.narrow(1, p - 1, c)?.contiguous()?;
    let logits = model.head_matmul(&h.reshape((b * c, hidden))?)?.reshape((
        b,
        c,
        model.config().vocab_size,
    ))?;
    let out = completion_logps(&logits, completion_ids, completion_mask, temperature)?;
    Ok(if train { out } else { out.detach() })
}
