//! Preference losses (DPO with the sigmoid loss, IPO, ORPO) and TRL's metrics, as pure candle
//! functions of tensors: no model, no I/O, any device.
//!
//! The conventions are TRL's (`DPOTrainer` for `sigmoid` and `ipo`, `ORPOTrainer` for
//! `odds_ratio_loss`):
//! * a sequence's log-probability is the **sum** over its completion tokens (labels other
//!   than [`IGNORE_INDEX`], shifted as the causal-LM loss shifts them); IPO and ORPO use the
//!   **mean** per completion token instead;
//! * the implicit reward of an answer is `β · (log π − log π_ref)` (ORPO, which has no
//!   reference: `β · mean log π`), detached;
//! * losses are means over the pairs of the batch.
//!
//! A batch of pairs runs as one forward pass over `2B` rows (chosen rows first, see
//! [`crate::data::preference::collate_pairs`]); [`PairLogps::from_concatenated`] splits the
//! result. Reference log-probabilities are detached here whatever their origin (a frozen
//! copy, the adapter-disabled model, or stored numbers), so no gradient can reach them.

use super::decoder::IGNORE_INDEX;
use super::error::ModelError;
use candle_core::{DType, Device, Tensor, D};

/// The model's log-probabilities of each row's completion tokens (labels other than
/// [`IGNORE_INDEX`]): a forward pass (`train`: with dropout and a graph for backward), the
/// head's full logits in f32, and [`sequence_logps`]. The logits of every position exist at
/// once (TRL's `concatenated_forward` does the same); the planner counts them.
pub fn model_sequence_logps(
    model: &super::CausalLm,
    input_ids: &Tensor,
    attention_mask: Option<&Tensor>,
    labels: &Tensor,
    train: bool,
) -> Result<SequenceLogps, ModelError> {
    let h = model.hidden_states(input_ids, attention_mask, train)?;
    let (b, t, hidden) = h.dims3()?;
    let logits = model
        .head_matmul(&h.reshape((b * t, hidden))?)?
        .to_dtype(DType::F32)?
        .reshape((b, t, model.config().vocab_size))?;
    let logps = sequence_logps(&logits, &labels.to_device(logits.device())?)?;
    Ok(if train { logps } else { logps.detach() })
}

/// Log-probabilities of the completion tokens of each row of a batch.
#[derive(Debug, Clone)]
pub struct SequenceLogps {
    /// Sum over each row's scored tokens, `[rows]` f32.
    pub sum: Tensor,
    /// Each row's number of scored tokens, `[rows]` f32.
    pub tokens: Tensor,
}

impl SequenceLogps {
    /// Number of rows.
    pub fn rows(&self) -> Result<usize, ModelError> {
        Ok(self.sum.dim(0)?)
    }

    /// Mean per scored token, `[rows]` (a row with no scored token counts as one, so its
    /// mean is 0 and not NaN; the pair lints reject such rows before training).
    pub fn mean(&self) -> Result<Tensor, ModelError> {
        Ok(self.sum.div(&self.tokens.maximum(1.0)?)?)
    }

    /// The same numbers, cut from the graph.
    pub fn detach(&self) -> Self {
        SequenceLogps {
            sum: self.sum.detach(),
            tokens: self.tokens.detach(),
        }
    }

    /// Rows `start..start + len`.
    fn narrow(&self, start: usize, len: usize) -> Result<Self, ModelError> {
        Ok(SequenceLogps {
            sum: self.sum.narrow(0, start, len)?,
            tokens: self.tokens.narrow(0, start, len)?,
        })
    }
}

/// Shifted targets and their mask for `labels` `[b, t]`: position `i` scores `labels[i+1]`;
/// the last position and ignored labels are masked (target 0, mask 0). Built on the CPU and
/// sent to `device`: the labels are small, and integer compare/select ops are not on every
/// backend.
fn shifted_targets(labels: &Tensor, device: &Device) -> Result<(Tensor, Tensor), ModelError> {
    let (b, t) = labels.dims2()?;
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
    let mut targets = vec![0u32; b * t];
    let mut mask = vec![0f32; b * t];
    for (r, row) in rows.iter().enumerate() {
        for (i, &l) in row.iter().enumerate().skip(1) {
            if l == IGNORE_INDEX {
                continue;
            }
            let id = u32::try_from(l).map_err(|_| {
                ModelError::Input(format!(
                    "label {l} is not a token id and not the ignore index -100"
                ))
            })?;
            targets[r * t + i - 1] = id;
            mask[r * t + i - 1] = 1.0;
        }
    }
    Ok((
        Tensor::from_vec(targets, (b, t, 1), device)?,
        Tensor::from_vec(mask, (b, t), device)?,
    ))
}

/// Log-probability of each scored token, `[b, t]` f32 (0 where masked), and the mask: entry
/// `i` is `log p(labels[i+1] | tokens ..=i)`, the last column always masked.
fn masked_token_logps(logits: &Tensor, labels: &Tensor) -> Result<(Tensor, Tensor), ModelError> {
    let (b, t, v) = logits.dims3()?;
    if labels.dims() != [b, t] {
        return Err(ModelError::Input(format!(
            "labels have shape {:?} but the logits have [{b}, {t}, {v}]",
            labels.dims()
        )));
    }
    let (targets, mask) = shifted_targets(labels, logits.device())?;
    if let Some(bad) = labels
        .to_device(&Device::Cpu)?
        .to_dtype(DType::I64)?
        .flatten_all()?
        .to_vec1::<i64>()?
        .into_iter()
        .find(|&l| l != IGNORE_INDEX && (l < 0 || l as usize >= v))
    {
        return Err(ModelError::Input(format!(
            "label {bad} is outside the vocabulary (0..{v}) and is not the ignore index -100"
        )));
    }
    let logits = logits.to_dtype(DType::F32)?;
    // log-softmax at the target only: logit − logsumexp. The max is a constant shift for
    // stability, detached so the gradient is exactly softmax − one-hot.
    let max = logits.max_keepdim(D::Minus1)?.detach();
    let lse = logits
        .broadcast_sub(&max)?
        .exp()?
        .sum_keepdim(D::Minus1)?
        .log()?
        .add(&max)?;
    let picked = logits.contiguous()?.gather(&targets, D::Minus1)?;
    let logp = picked.sub(&lse)?.squeeze(D::Minus1)?.mul(&mask)?;
    Ok((logp, mask))
}

/// Per-token log-probabilities of the shifted labels, `[b, t-1]` f32, 0 where the label is
/// ignored (the convention of [`crate::model::CausalLm::token_losses`], negated).
pub fn token_logps(logits: &Tensor, labels: &Tensor) -> Result<Tensor, ModelError> {
    let (logp, _) = masked_token_logps(logits, labels)?;
    let t = logp.dim(1)?;
    Ok(logp.narrow(1, 0, t.saturating_sub(1))?)
}

/// Each row's summed log-probability of its completion tokens and their count, from the
/// logits `[b, t, vocab]` and the unshifted labels `[b, t]` (-100 on prompt and padding).
/// Differentiable in `logits`.
pub fn sequence_logps(logits: &Tensor, labels: &Tensor) -> Result<SequenceLogps, ModelError> {
    let (logp, mask) = masked_token_logps(logits, labels)?;
    Ok(SequenceLogps {
        sum: logp.sum(1)?,
        tokens: mask.sum(1)?,
    })
}

/// The log-probabilities of the two answers of each pair.
#[derive(Debug, Clone)]
pub struct PairLogps {
    /// Of the chosen answers, `[pairs]`.
    pub chosen: SequenceLogps,
    /// Of the rejected answers, `[pairs]`.
    pub rejected: SequenceLogps,
}

impl PairLogps {
    /// Splits the log-probabilities of a concatenated batch (chosen rows, then rejected rows).
    pub fn from_concatenated(all: &SequenceLogps) -> Result<Self, ModelError> {
        let n = all.rows()?;
        if n % 2 != 0 {
            return Err(ModelError::Input(format!(
                "a batch of pairs has an even number of rows (chosen, then rejected); got {n}"
            )));
        }
        Ok(PairLogps {
            chosen: all.narrow(0, n / 2)?,
            rejected: all.narrow(n / 2, n / 2)?,
        })
    }

    /// The same numbers, cut from the graph.
    pub fn detach(&self) -> Self {
        PairLogps {
            chosen: self.chosen.detach(),
            rejected: self.rejected.detach(),
        }
    }

    fn check_pairs(&self, other: Option<&PairLogps>) -> Result<usize, ModelError> {
        let n = self.chosen.rows()?;
        let mut counts = vec![("rejected", self.rejected.rows()?)];
        if let Some(o) = other {
            counts.push(("reference chosen", o.chosen.rows()?));
            counts.push(("reference rejected", o.rejected.rows()?));
        }
        if let Some((what, m)) = counts.into_iter().find(|&(_, m)| m != n) {
            return Err(ModelError::Input(format!(
                "{n} chosen log-probabilities but {m} {what}; every pair needs both answers"
            )));
        }
        Ok(n)
    }
}

/// Which loss, with its own setting.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PreferenceLossKind {
    /// DPO with TRL's `sigmoid` loss; `label_smoothing` is cDPO's ε (0 = plain DPO).
    DpoSigmoid {
        /// The probability that a pair's labels are flipped, in `[0, 0.5)`.
        label_smoothing: f64,
    },
    /// IPO: the squared distance of the margin of mean log-probabilities from `1/(2β)`.
    Ipo,
    /// ORPO: the chosen answers' NLL minus `β`·log σ(log-odds ratio); no reference.
    Orpo,
}

/// A preference loss with everything TRL logs beside it. Every tensor except `loss` and
/// `losses` is detached.
#[derive(Debug, Clone)]
pub struct PreferenceLoss {
    /// The loss to minimise: the mean over the pairs (ORPO: plus the NLL), scalar f32.
    pub loss: Tensor,
    /// Each pair's preference term, `[pairs]` (ORPO: `−β·log σ(log-odds)`, without the NLL).
    pub losses: Tensor,
    /// `rewards/chosen` per pair.
    pub rewards_chosen: Tensor,
    /// `rewards/rejected` per pair.
    pub rewards_rejected: Tensor,
    /// `logps/chosen` per pair: the log-probabilities the loss used (summed for DPO, mean
    /// per token for IPO and ORPO).
    pub logps_chosen: Tensor,
    /// `logps/rejected` per pair.
    pub logps_rejected: Tensor,
    /// ORPO: the log-odds ratio per pair (TRL's `log_odds_chosen` is its mean).
    pub log_odds: Option<Tensor>,
    /// ORPO: `nll_loss`, the chosen answers' cross-entropy over all their tokens.
    pub nll_loss: Option<Tensor>,
}

/// `log σ(x)` without overflow: `min(x, 0) − log(1 + e^{−|x|})`, with `min(x, 0)` written
/// `(x − |x|)/2` so that the gradient is `σ(−x)` at `x = 0` too.
///
/// Both terms have a kink at 0, and candle's subgradients there do not cancel: `minimum`
/// splits a tie (½ to `x`) while `abs` takes +1, so `x.minimum(0.0)` gave the derivative
/// ½ + ½ = 1 at 0, twice `σ(0)`. That is exactly where DPO starts when the policy is its own
/// reference (every margin 0): the step-0 gradient of full fine-tuning came out doubled.
/// With `(x − |x|)/2` the derivative at 0 is `(1 − s)/2 + s/2 = ½` whatever `abs`'s
/// subgradient `s`.
pub fn log_sigmoid(x: &Tensor) -> Result<Tensor, ModelError> {
    let abs = x.abs()?;
    let soft = abs.neg()?.exp()?.affine(1.0, 1.0)?.log()?;
    Ok(x.sub(&abs)?.affine(0.5, 0.0)?.sub(&soft)?)
}

/// `(π_c − π_r) − (ρ_c − ρ_r)` and the rewards `β(π − ρ)` from the given per-pair numbers.
fn margin_and_rewards(
    pc: &Tensor,
    pr: &Tensor,
    rc: &Tensor,
    rr: &Tensor,
    beta: f64,
) -> Result<(Tensor, Tensor, Tensor), ModelError> {
    let rc = rc.detach();
    let rr = rr.detach();
    let margin = pc.sub(pr)?.sub(&rc.sub(&rr)?)?;
    let rewards_chosen = pc.detach().sub(&rc)?.affine(beta, 0.0)?;
    let rewards_rejected = pr.detach().sub(&rr)?.affine(beta, 0.0)?;
    Ok((margin, rewards_chosen, rewards_rejected))
}

/// DPO with the sigmoid loss: `−(1−ε)·log σ(β·m) − ε·log σ(−β·m)` per pair, where `m` is the
/// margin of summed log-probabilities over the reference's.
pub fn dpo_sigmoid_loss(
    policy: &PairLogps,
    reference: &PairLogps,
    beta: f64,
    label_smoothing: f64,
) -> Result<PreferenceLoss, ModelError> {
    policy.check_pairs(Some(reference))?;
    let (pc, pr) = (&policy.chosen.sum, &policy.rejected.sum);
    let (margin, rewards_chosen, rewards_rejected) =
        margin_and_rewards(pc, pr, &reference.chosen.sum, &reference.rejected.sum, beta)?;
    let z = margin.affine(beta, 0.0)?;
    let mut losses = log_sigmoid(&z)?.affine(-(1.0 - label_smoothing), 0.0)?;
    if label_smoothing != 0.0 {
        losses = losses.sub(&log_sigmoid(&z.neg()?)?.affine(label_smoothing, 0.0)?)?;
    }
    Ok(PreferenceLoss {
        loss: losses.mean_all()?,
        losses,
        rewards_chosen,
        rewards_rejected,
        logps_chosen: pc.detach(),
        logps_rejected: pr.detach(),
        log_odds: None,
        nll_loss: None,
    })
}

/// IPO: `(m − 1/(2β))²` per pair, where `m` is the margin of *mean* per-token
/// log-probabilities over the reference's.
pub fn ipo_loss(
    policy: &PairLogps,
    reference: &PairLogps,
    beta: f64,
) -> Result<PreferenceLoss, ModelError> {
    policy.check_pairs(Some(reference))?;
    if beta <= 0.0 {
        return Err(ModelError::Input(format!(
            "IPO needs beta > 0 (its target margin is 1/(2·beta)); got {beta}"
        )));
    }
    let pc = policy.chosen.mean()?;
    let pr = policy.rejected.mean()?;
    let (margin, rewards_chosen, rewards_rejected) = margin_and_rewards(
        &pc,
        &pr,
        &reference.chosen.mean()?,
        &reference.rejected.mean()?,
        beta,
    )?;
    let losses = margin.affine(1.0, -1.0 / (2.0 * beta))?.sqr()?;
    Ok(PreferenceLoss {
        loss: losses.mean_all()?,
        losses,
        rewards_chosen,
        rewards_rejected,
        logps_chosen: pc.detach(),
        logps_rejected: pr.detach(),
        log_odds: None,
        nll_loss: None,
    })
}

/// ORPO (`lambda` is TRL's `beta`): the chosen answers' NLL (mean over all their tokens) minus
/// `λ · mean log σ(log-odds)`, where the log-odds ratio of mean per-token log-probabilities
/// `a`, `b` is `(a − b) − (log(1 − eᵃ) − log(1 − eᵇ))`.
pub fn orpo_loss(policy: &PairLogps, lambda: f64) -> Result<PreferenceLoss, ModelError> {
    policy.check_pairs(None)?;
    let pc = policy.chosen.mean()?;
    let pr = policy.rejected.mean()?;
    // log(1 − eˣ) for x < 0 (TRL: log1p(−exp(x))); candle has no log1p/expm1, and for the
    // mean log-probabilities of real answers (well below 0) 1 − eˣ loses nothing that matters.
    let log1m_exp =
        |x: &Tensor| -> Result<Tensor, ModelError> { Ok(x.exp()?.affine(-1.0, 1.0)?.log()?) };
    let log_odds = pc.sub(&pr)?.sub(&log1m_exp(&pc)?.sub(&log1m_exp(&pr)?)?)?;
    let ratio = log_sigmoid(&log_odds)?;
    let losses = ratio.affine(-lambda, 0.0)?;
    let tokens = policy.chosen.tokens.sum_all()?.maximum(1.0)?;
    let nll = policy.chosen.sum.sum_all()?.neg()?.div(&tokens)?;
    Ok(PreferenceLoss {
        loss: nll.add(&losses.mean_all()?)?,
        rewards_chosen: pc.detach().affine(lambda, 0.0)?,
        rewards_rejected: pr.detach().affine(lambda, 0.0)?,
        logps_chosen: pc.detach(),
        logps_rejected: pr.detach(),
        log_odds: Some(log_odds.detach()),
        nll_loss: Some(nll.detach()),
        losses,
    })
}

/// The loss `kind` with strength `beta` (ORPO's λ). `reference` is ignored by ORPO and
/// required by the others.
pub fn preference_loss(
    kind: PreferenceLossKind,
    policy: &PairLogps,
    reference: Option<&PairLogps>,
    beta: f64,
) -> Result<PreferenceLoss, ModelError> {
    let need_ref = || {
        reference
            .ok_or_else(|| ModelError::Input("DPO and IPO need reference log-probabilities".into()))
    };
    match kind {
        PreferenceLossKind::DpoSigmoid { label_smoothing } => {
            dpo_sigmoid_loss(policy, need_ref()?, beta, label_smoothing)
        }
        PreferenceLossKind::Ipo => ipo_loss(policy, need_ref()?, beta),
        PreferenceLossKind::Orpo => orpo_loss(policy, beta),
    }
}

/// TRL's logged numbers for one batch (means over its pairs), by their TRL names.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PreferenceMetrics {
    /// Pairs averaged over (the weight when merging batches).
    pub pairs: usize,
    /// The loss.
    pub loss: f64,
    /// `rewards/chosen`.
    pub rewards_chosen: f64,
    /// `rewards/rejected`.
    pub rewards_rejected: f64,
    /// `rewards/accuracies`: the share of pairs whose chosen reward is the higher.
    pub rewards_accuracies: f64,
    /// `rewards/margins`: mean of chosen minus rejected reward.
    pub rewards_margins: f64,
    /// `logps/chosen`.
    pub logps_chosen: f64,
    /// `logps/rejected`.
    pub logps_rejected: f64,
    /// ORPO `log_odds_ratio`: mean `log σ(log-odds)`.
    pub log_odds_ratio: Option<f64>,
    /// ORPO `log_odds_chosen`: mean log-odds.
    pub log_odds_chosen: Option<f64>,
    /// ORPO `nll_loss`.
    pub nll_loss: Option<f64>,
}

/// Mean of a small tensor, summed on the host in f64 (a share like 1/3 stays exact).
fn mean_of(t: &Tensor) -> Result<f64, ModelError> {
    let v = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    Ok(v.iter().map(|&x| f64::from(x)).sum::<f64>() / v.len().max(1) as f64)
}

impl PreferenceLoss {
    /// The batch's metrics (reads the numbers back from the device).
    pub fn metrics(&self) -> Result<PreferenceMetrics, ModelError> {
        let pairs = self.rewards_chosen.dim(0)?;
        let accurate = self
            .rewards_chosen
            .gt(&self.rewards_rejected)?
            .to_dtype(DType::F32)?;
        let ratio = match &self.log_odds {
            Some(l) => Some(mean_of(&log_sigmoid(l)?)?),
            None => None,
        };
        Ok(PreferenceMetrics {
            pairs,
            loss: mean_of(&self.loss.detach())?,
            rewards_chosen: mean_of(&self.rewards_chosen)?,
            rewards_rejected: mean_of(&self.rewards_rejected)?,
            rewards_accuracies: mean_of(&accurate)?,
            rewards_margins: mean_of(&self.rewards_chosen.sub(&self.rewards_rejected)?)?,
            logps_chosen: mean_of(&self.logps_chosen)?,
            logps_rejected: mean_of(&self.logps_rejected)?,
            log_odds_ratio: ratio,
            log_odds_chosen: self.log_odds.as_ref().map(mean_of).transpose()?,
            nll_loss: self.nll_loss.as_ref().map(mean_of).transpose()?,
        })
    }
}

impl PreferenceMetrics {
    /// The metrics under TRL's names, in TRL's order (the ORPO ones only when present).
    pub fn named(&self) -> Vec<(&'static str, f64)> {
        let mut out = vec![
            ("loss", self.loss),
            ("rewards/chosen", self.rewards_chosen),
            ("rewards/rejected", self.rewards_rejected),
            ("rewards/accuracies", self.rewards_accuracies),
            ("rewards/margins", self.rewards_margins),
            ("logps/chosen", self.logps_chosen),
            ("logps/rejected", self.logps_rejected),
        ];
        for (name, v) in [
            ("nll_loss", self.nll_loss),
            ("log_odds_ratio", self.log_odds_ratio),
            ("log_odds_chosen", self.log_odds_chosen),
        ] {
            if let Some(v) = v {
                out.push((name, v));
            }
        }
        out
    }

    /// The pair-weighted mean of two batches' metrics (micro-batches of one step, or steps
    /// of one logging interval).
    pub fn merge(&self, other: &PreferenceMetrics) -> PreferenceMetrics {
        let n = (self.pairs + other.pairs).max(1) as f64;
        let (a, b) = (self.pairs as f64 / n, other.pairs as f64 / n);
        let mix = |x: f64, y: f64| a * x + b * y;
        let mix_opt = |x: Option<f64>, y: Option<f64>| match (x, y) {
            (Some(x), Some(y)) => Some(mix(x, y)),
            (x, y) => x.or(y),
        };
        PreferenceMetrics {
            pairs: self.pairs + other.pairs,
            loss: mix(self.loss, other.loss),
            rewards_chosen: mix(self.rewards_chosen, other.rewards_chosen),
            rewards_rejected: mix(self.rewards_rejected, other.rewards_rejected),
            rewards_accuracies: mix(self.rewards_accuracies, other.rewards_accuracies),
            rewards_margins: mix(self.rewards_margins, other.rewards_margins),
            logps_chosen: mix(self.logps_chosen, other.logps_chosen),
            logps_rejected: mix(self.logps_rejected, other.logps_rejected),
            log_odds_ratio: mix_opt(self.log_odds_ratio, other.log_odds_ratio),
            log_odds_chosen: mix_opt(self.log_odds_chosen, other.log_odds_chosen),
            nll_loss: mix_opt(self.nll_loss, other.nll_loss),
        }
    }
}

#[cfg(test)]
mod tests;
