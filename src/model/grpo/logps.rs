//! Each completion token's log-probability under the sampling temperature, and the entropy of
//! the distribution it was drawn from.

use crate::model::decoder::{IGNORE_INDEX, LOSS_CHUNK_TOKENS};
use crate::model::{kernels, ops, CausalLm, ModelError};
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
/// completion token, a chunk of rows at a time (the SFT loss's fused op when training).
/// `train`: with dropout and a graph for backward; otherwise detached.
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
    let rows = h
        .narrow(1, p - 1, c)?
        .contiguous()?
        .reshape((b * c, hidden))?;
    let ids = completion_ids.flatten_all()?;
    let mask = completion_mask.flatten_all()?;
    let out = if model.ops == kernels::OpsKind::Reference {
        // The reference ops keep the composite log-softmax over the whole batch's logits.
        let logits = model.head_matmul(&rows)?;
        let out = completion_logps(
            &logits.unsqueeze(0)?,
            &ids.unsqueeze(0)?,
            &mask.unsqueeze(0)?,
            temperature,
        )?;
        if train {
            out
        } else {
            out.detach()
        }
    } else {
        head_logps(model, &rows, &ids, &mask, temperature, train)?
    };
    Ok(CompletionLogps {
        logps: out.logps.reshape((b, c))?,
        entropies: out.entropies.reshape((b, c))?,
    })
}

/// Each of hidden `rows`' `[n, hidden]` log-probability of its `ids` `[n]` under
/// `softmax(head(rows) / T)`, and that distribution's entropy, through the SFT loss's head
/// op (each row's loss on its own, fused on the CPU, generic elsewhere): its logits exist a
/// chunk of [`LOSS_CHUNK_TOKENS`] rows at a time and are recomputed in the backward. The
/// whole batch's f32 logits were GRPO's peak before (2026-12-05): 1.6 GB a tensor for 16
/// completions × 512 tokens of a 49k vocabulary, about eleven of them live. The entropy comes
/// from the op's own pass over each row. The head has no bias, so `head(rows) / T` is the
/// head of `rows / T`. `train`: differentiable; otherwise without a graph.
fn head_logps(
    model: &CausalLm,
    rows: &Tensor,
    ids: &Tensor,
    mask: &Tensor,
    temperature: f64,
    train: bool,
) -> Result<CompletionLogps, ModelError> {
    let device = rows.device();
    let n = rows.dim(0)?;
    let rows = if train { rows.clone() } else { rows.detach() };
    let rows = if temperature == 1.0 {
        rows
    } else {
        rows.affine(1.0 / temperature, 0.0)?
    };
    let head = model.head_weight()?;
    let head = if train { head } else { head.detach() };
    let mask = mask.to_device(device)?.to_dtype(DType::F32)?;
    let missing = || ModelError::Input("the head op wrote no entropies (internal error)".into());
    let (ce, entropies) = if model.ops == kernels::OpsKind::Fused && ops::use_fused(&[&rows, &head])
    {
        // Masked rows are skipped by the op (their loss and entropy are 0).
        let keep: Vec<f32> = mask.to_vec1()?;
        let labels: Vec<i64> = ids
            .to_dtype(DType::U32)?
            .to_vec1::<u32>()?
            .into_iter()
            .zip(keep)
            .map(|(id, m)| if m > 0.0 { i64::from(id) } else { IGNORE_INDEX })
            .collect();
        let sink = ops::EntropySink::default();
        let (_, per_row) = ops::linear_cross_entropy_fused(
            &rows,
            &head,
            &labels,
            LOSS_CHUNK_TOKENS,
            if train { model.head_grad_sink() } else { None },
            Some(sink.clone()),
        )?;
        let entropies = lock_take(&sink).ok_or_else(missing)?;
        (per_row, Tensor::from_vec(entropies, n, device)?)
    } else {
        let sink = std::sync::Arc::default();
        let per_row = ops::generic::linear_cross_entropy_rows(
            &rows,
            &head,
            &ids.to_device(device)?.to_dtype(DType::U32)?,
            LOSS_CHUNK_TOKENS,
            train && !model.modules.lm_head_frozen,
            Some(std::sync::Arc::clone(&sink)),
        )?;
        (per_row, lock_take(&sink).ok_or_else(missing)?)
    };
    let logps = ce.neg()?.mul(&mask)?;
    Ok(CompletionLogps {
        logps: if train { logps } else { logps.detach() },
        entropies: entropies.detach().mul(&mask)?,
    })
}

/// What an op left in `sink`, taken out.
fn lock_take<T>(sink: &std::sync::Mutex<Option<T>>) -> Option<T> {
    sink.lock().ok().and_then(|mut s| s.take())
}
