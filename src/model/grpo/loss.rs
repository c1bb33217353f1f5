//! The clipped-surrogate policy loss with the k3 KL penalty and TRL's four aggregations.

use crate::model::ModelError;
use candle_core::{DType, Tensor};

/// How per-token losses become one number (TRL's `loss_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GrpoLossType {
    /// DAPO (TRL's default): the sum over every completion token of the optimizer step,
    /// divided by the step's completion tokens over all micro-batches and ranks, so every
    /// token weighs the same however the batch is split.
    #[default]
    Dapo,
    /// The original GRPO: each completion's mean over its tokens, then the mean over the
    /// completions (long completions weigh less per token).
    Grpo,
    /// Dr. GRPO: the sum divided by rows × `max_completion_length` (a constant: no length bias).
    DrGrpo,
    /// The sum divided by the micro-batch's own completion tokens.
    Bnpo,
}

impl GrpoLossType {
    /// The name in `run.toml` and TRL.
    pub fn name(self) -> &'static str {
        match self {
            GrpoLossType::Dapo => "dapo",
            GrpoLossType::Grpo => "grpo",
            GrpoLossType::DrGrpo => "dr_grpo",
            GrpoLossType::Bnpo => "bnpo",
        }
    }
}

/// Everything the loss needs besides the tensors.
#[derive(Debug, Clone, PartialEq)]
pub struct GrpoLossSettings {
    /// The aggregation.
    pub loss_type: GrpoLossType,
    /// The KL coefficient β (0: no reference model, no KL term).
    pub beta: f64,
    /// ε: ratios below `1 − ε` with a negative advantage are clipped.
    pub epsilon_low: f64,
    /// ε_high (DAPO's "clip higher"; TRL: `epsilon_high`, default ε): ratios above `1 + ε_high`
    /// with a positive advantage are clipped.
    pub epsilon_high: f64,
    /// `grpo.max_completion_length`: `dr_grpo`'s constant divisor.
    pub max_completion_length: usize,
    /// `dapo`: the completion tokens of the whole optimizer step (every micro-batch and rank).
    pub step_completion_tokens: f64,
    /// `grpo`, `bnpo`, `dr_grpo`: micro-batches per optimizer step (each is a mean).
    pub accumulation_steps: usize,
    /// TRL's `use_bias_correction_kl` (its default, true): the KL term is multiplied by the
    /// importance ratio, which is 1 in value but adds `kl · ∇log π` to the gradient.
    pub bias_correction_kl: bool,
    /// The whole micro-batch (this rank's share of it) when the forward holds one pass of it
    /// (`grpo.generations_per_micro_step` below G): `grpo`, `bnpo` and `dr_grpo` divide by its
    /// rows or tokens, so the passes' losses sum to the micro-batch's. `None`: the forward is
    /// the micro-batch.
    pub micro_batch: Option<MicroBatchTotals>,
}

/// The rows and completion tokens of a micro-batch that runs in several passes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MicroBatchTotals {
    /// Completions (rows).
    pub rows: usize,
    /// Completion tokens trained (the completion masks' sum).
    pub completion_tokens: f64,
}

/// The loss of one micro-batch, with the detached per-token numbers its metrics need.
#[derive(Debug, Clone)]
pub struct GrpoLoss {
    /// The scalar to back-propagate (already divided for the step, see [`GrpoLossType`]).
    pub loss: Tensor,
    /// `exp(ref − logp) − (ref − logp) − 1` per token (k3), when β > 0.
    pub per_token_kl: Option<Tensor>,
    /// 1 where a token with a negative advantage was clipped below `1 − ε`.
    pub low_clipped: Tensor,
    /// 1 where a token with a positive advantage was clipped above `1 + ε_high`.
    pub high_clipped: Tensor,
    /// The completion mask, f32.
    pub mask: Tensor,
}

fn check_same(what: &str, t: &Tensor, dims: &[usize]) -> Result<(), ModelError> {
    if t.dims() != dims {
        return Err(ModelError::Input(format!(
            "{what} has shape {:?} but the log-probabilities have {dims:?}",
            t.dims()
        )));
    }
    Ok(())
}

/// The importance ratio per token with clipped tokens cut from the graph: where PPO's
/// `min(r·A, clip(r)·A)` picks the clipped side its value is the clipped ratio and it has no
/// gradient, elsewhere it is `r`. Written with masks rather than `minimum`: at a tie candle
/// splits the gradient between the two sides (see `preference::log_sigmoid`).
fn clipped_ratio(
    ratio: &Tensor,
    advantages: &Tensor,
    settings: &GrpoLossSettings,
) -> Result<(Tensor, Tensor, Tensor), ModelError> {
    let r = ratio.detach();
    let low_bound = 1.0 - settings.epsilon_low;
    let high_bound = 1.0 + settings.epsilon_high;
    let negative = advantages.lt(0.0)?.to_dtype(DType::F32)?;
    let positive = advantages.gt(0.0)?.to_dtype(DType::F32)?;
    let low = r
        .lt(low_bound)?
        .to_dtype(DType::F32)?
        .broadcast_mul(&negative)?;
    let high = r
        .gt(high_bound)?
        .to_dtype(DType::F32)?
        .broadcast_mul(&positive)?;
    let clipped = low.add(&high)?;
    let kept = clipped.affine(-1.0, 1.0)?;
    let bounded = r.clamp(low_bound, high_bound)?;
    let coef = ratio.mul(&kept)?.add(&bounded.mul(&clipped)?)?;
    Ok((coef, low, high))
}

/// GRPO's loss for one micro-batch: `logps` `[b, c]` (the policy's, with a graph),
/// `old_logps` (the sampling policy's when `num_iterations > 1`; `None`: the policy's own,
/// detached, so the ratio is 1), `ref_logps` (needed when β > 0), `advantages` `[b]`, `mask`
/// `[b, c]`. Per token: `−min(r·A, clip(r, 1−ε, 1+ε_high)·A) + β·kl·(r if bias-corrected)`.
pub fn grpo_loss(
    logps: &Tensor,
    old_logps: Option<&Tensor>,
    ref_logps: Option<&Tensor>,
    advantages: &Tensor,
    mask: &Tensor,
    settings: &GrpoLossSettings,
) -> Result<GrpoLoss, ModelError> {
    let (b, c) = logps.dims2()?;
    let device = logps.device();
    let mask = mask.to_device(device)?.to_dtype(DType::F32)?;
    check_same("the completion mask", &mask, &[b, c])?;
    let advantages = advantages
        .to_device(device)?
        .to_dtype(DType::F32)?
        .reshape((b, 1))?;
    let old = match old_logps {
        Some(o) => {
            check_same("the old log-probabilities", o, &[b, c])?;
            o.to_device(device)?.detach()
        }
        None => logps.detach(),
    };
    let ratio = logps.sub(&old)?.exp()?;
    let (coef, low, high) = clipped_ratio(&ratio, &advantages, settings)?;
    let mut per_token = coef.broadcast_mul(&advantages)?.neg()?;
    let mut per_token_kl = None;
    if settings.beta != 0.0 {
        let reference = ref_logps.ok_or_else(|| {
            ModelError::Input(
                "grpo.beta > 0 needs the reference model's log-probabilities (set beta = 0 to train without a reference)".into(),
            )
        })?;
        check_same("the reference log-probabilities", reference, &[b, c])?;
        let delta = reference.to_device(device)?.detach().sub(logps)?;
        let kl = delta.exp()?.sub(&delta)?.affine(1.0, -1.0)?;
        let term = if settings.bias_correction_kl {
            kl.mul(&ratio)?
        } else {
            kl.clone()
        };
        per_token = per_token.add(&term.affine(settings.beta, 0.0)?)?;
        per_token_kl = Some(kl.detach());
    }
    let masked = per_token.mul(&mask)?;
    let loss = aggregate(&masked, &mask, settings)?;
    Ok(GrpoLoss {
        loss,
        per_token_kl,
        low_clipped: low.mul(&mask)?,
        high_clipped: high.mul(&mask)?,
        mask,
    })
}

/// The masked per-token losses `[b, c]` as one scalar, by [`GrpoLossType`].
fn aggregate(
    masked: &Tensor,
    mask: &Tensor,
    settings: &GrpoLossSettings,
) -> Result<Tensor, ModelError> {
    let micro_steps = settings.accumulation_steps.max(1) as f64;
    let rows = match settings.micro_batch {
        Some(whole) => whole.rows,
        None => masked.dim(0)?,
    };
    let loss = match settings.loss_type {
        GrpoLossType::Grpo => masked
            .sum(1)?
            .div(&mask.sum(1)?.maximum(1.0)?)?
            .sum_all()?
            .affine(1.0 / (rows.max(1) as f64 * micro_steps), 0.0)?,
        GrpoLossType::Bnpo => {
            let summed = masked.sum_all()?;
            match settings.micro_batch {
                Some(whole) => {
                    summed.affine(1.0 / (whole.completion_tokens.max(1.0) * micro_steps), 0.0)?
                }
                None => summed
                    .div(&mask.sum_all()?.maximum(1.0)?)?
                    .affine(1.0 / micro_steps, 0.0)?,
            }
        }
        GrpoLossType::DrGrpo => {
            let divisor = (rows * settings.max_completion_length.max(1)) as f64 * micro_steps;
            masked.sum_all()?.affine(1.0 / divisor, 0.0)?
        }
        GrpoLossType::Dapo => {
            let tokens = settings.step_completion_tokens;
            if tokens.is_nan() || tokens <= 0.0 {
                return Err(ModelError::Input(
                    "the dapo loss needs the optimizer step's completion-token count (> 0)".into(),
                ));
            }
            masked
                .sum_all()?
                .affine(1.0 / settings.step_completion_tokens, 0.0)?
        }
    };
    Ok(loss)
}

/// TRL's per-micro-batch loss metrics, by its names (`kl`, `entropy`, `clip_ratio/…`).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct GrpoLossMetrics {
    /// Completion tokens averaged over (the weight when merging).
    pub tokens: f64,
    /// `kl`: the mean k3 KL over completion tokens (when β > 0).
    pub kl: Option<f64>,
    /// `entropy`: the mean entropy over completion tokens.
    pub entropy: f64,
    /// `clip_ratio/low_mean`: the share of completion tokens clipped below.
    pub clip_low_mean: f64,
    /// `clip_ratio/low_min`: the lowest share of one completion's tokens clipped below.
    pub clip_low_min: f64,
    /// `clip_ratio/high_mean`: the share clipped above.
    pub clip_high_mean: f64,
    /// `clip_ratio/high_max`: the highest share of one completion's tokens clipped above.
    pub clip_high_max: f64,
    /// `clip_ratio/region_mean`: the share clipped on either side.
    pub clip_region_mean: f64,
}

/// Host copy of a small `[b, c]` tensor, by rows.
fn rows_of(t: &Tensor) -> Result<Vec<Vec<f32>>, ModelError> {
    Ok(t.to_dtype(DType::F32)?.to_vec2::<f32>()?)
}

impl GrpoLoss {
    /// The metrics, given the entropies of the same forward (reads back to the host: call
    /// once per logging interval's micro-batch, not inside the graph).
    pub fn metrics(&self, entropies: &Tensor) -> Result<GrpoLossMetrics, ModelError> {
        let mask = rows_of(&self.mask)?;
        let lens: Vec<f64> = mask
            .iter()
            .map(|r| r.iter().map(|&x| f64::from(x)).sum())
            .collect();
        let tokens: f64 = lens.iter().sum();
        let mean = |t: &Tensor| -> Result<f64, ModelError> {
            let total: f64 = rows_of(t)?.iter().flatten().map(|&x| f64::from(x)).sum();
            Ok(total / tokens.max(1.0))
        };
        let per_row = |t: &Tensor| -> Result<Vec<f64>, ModelError> {
            Ok(rows_of(t)?
                .iter()
                .zip(&lens)
                .map(|(r, &n)| r.iter().map(|&x| f64::from(x)).sum::<f64>() / n.max(1.0))
                .collect())
        };
        let low_rows = per_row(&self.low_clipped)?;
        let high_rows = per_row(&self.high_clipped)?;
        Ok(GrpoLossMetrics {
            tokens,
            kl: self.per_token_kl.as_ref().map(&mean).transpose()?,
            entropy: mean(&entropies.to_device(self.mask.device())?.mul(&self.mask)?)?,
            clip_low_mean: mean(&self.low_clipped)?,
            clip_low_min: low_rows.iter().copied().fold(f64::INFINITY, f64::min),
            clip_high_mean: mean(&self.high_clipped)?,
            clip_high_max: high_rows.iter().copied().fold(0.0, f64::max),
            clip_region_mean: mean(&self.low_clipped.add(&self.high_clipped)?)?,
        })
    }
}

impl GrpoLossMetrics {
    /// The metrics under TRL's names, in TRL's order (`kl` only when β > 0).
    pub fn named(&self) -> Vec<(&'static str, f64)> {
        let mut out = Vec::new();
        if let Some(kl) = self.kl {
            out.push(("kl", kl));
        }
        out.extend([
            ("entropy", self.entropy),
            ("clip_ratio/low_mean", self.clip_low_mean),
            ("clip_ratio/low_min", self.clip_low_min),
            ("clip_ratio/high_mean", self.clip_high_mean),
            ("clip_ratio/high_max", self.clip_high_max),
            ("clip_ratio/region_mean", self.clip_region_mean),
        ]);
        out
    }

    /// Two micro-batches' metrics as one: means weighted by tokens, the min and max kept.
    pub fn merge(&self, other: &GrpoLossMetrics) -> GrpoLossMetrics {
        let n = (self.tokens + other.tokens).max(1.0);
        let (a, b) = (self.tokens / n, other.tokens / n);
        let mix = |x: f64, y: f64| a * x + b * y;
        GrpoLossMetrics {
            tokens: self.tokens + other.tokens,
            kl: match (self.kl, other.kl) {
                (Some(x), Some(y)) => Some(mix(x, y)),
                (x, y) => x.or(y),
            },
            entropy: mix(self.entropy, other.entropy),
            clip_low_mean: mix(self.clip_low_mean, other.clip_low_mean),
            clip_low_min: self.clip_low_min.min(other.clip_low_min),
            clip_high_mean: mix(self.clip_high_mean, other.clip_high_mean),
            clip_high_max: self.clip_high_max.max(other.clip_high_max),
            clip_region_mean: mix(self.clip_region_mean, other.clip_region_mean),
        }
    }
}
