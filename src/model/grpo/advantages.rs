//! The advantage of each completion over its group, and which completion tokens are trained.
//! Rewards are a handful of numbers per step computed on the host by the reward functions, so
//! this is host arithmetic.

use crate::model::ModelError;

/// Added to the standard deviation before dividing (TRL's `1e-4`): a group whose rewards are
/// all equal gets advantage 0, not NaN.
pub const ADVANTAGE_STD_EPS: f64 = 1e-4;

/// How the advantages are scaled (TRL's `scale_rewards`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ScaleRewards {
    /// `(r − group mean) / (group std + 1e-4)`: GRPO's, TRL's default.
    #[default]
    Group,
    /// `(r − group mean) / (std of the whole batch + 1e-4)` (as in "REINFORCE++" /
    /// Dr. GRPO's recommendation to avoid the per-group difficulty bias).
    Batch,
    /// `r − group mean`, unscaled (Dr. GRPO).
    None,
}

/// The advantages of one generation batch and what TRL logs about them.
#[derive(Debug, Clone, PartialEq)]
pub struct Advantages {
    /// One per completion, in the rewards' order.
    pub values: Vec<f32>,
    /// Per completion: whether the standard deviation it was scaled by is 0 (its group's, or
    /// the batch's under `batch` scaling) — nothing to learn from it.
    pub zero_std: Vec<bool>,
}

impl Advantages {
    /// `frac_reward_zero_std`: the share of completions whose group had equal rewards.
    pub fn frac_zero_std(&self) -> f64 {
        let n = self.zero_std.len().max(1) as f64;
        self.zero_std.iter().filter(|&&z| z).count() as f64 / n
    }
}

/// Mean and standard deviation with Bessel's correction (`torch.std`'s default); a single
/// value has standard deviation 0 (TRL's choice for `num_generations = 1`).
pub(super) fn mean_std(xs: &[f64]) -> (f64, f64) {
    let n = xs.len();
    if n == 0 {
        return (0.0, 0.0);
    }
    let mean = xs.iter().sum::<f64>() / n as f64;
    if n == 1 {
        return (mean, 0.0);
    }
    let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
    (mean, var.sqrt())
}

/// TRL's `torch.isclose(std, 0)`: `|std| <= 1e-8` (its default `atol`).
fn is_zero(std: f64) -> bool {
    std.abs() <= 1e-8
}

/// The advantages of `rewards`, laid out as consecutive groups of `group_size` completions of
/// the same prompt (TRL's `repeat_interleave` order).
pub fn advantages(
    rewards: &[f32],
    group_size: usize,
    scale: ScaleRewards,
) -> Result<Advantages, ModelError> {
    if group_size == 0 || !rewards.len().is_multiple_of(group_size) {
        return Err(ModelError::Input(format!(
            "{} rewards do not make whole groups of grpo.num_generations = {group_size}",
            rewards.len()
        )));
    }
    let all: Vec<f64> = rewards.iter().map(|&r| f64::from(r)).collect();
    let (_, batch_std) = mean_std(&all);
    let mut values = Vec::with_capacity(all.len());
    let mut zero_std = Vec::with_capacity(all.len());
    for group in all.chunks(group_size) {
        let (mean, group_std) = mean_std(group);
        let std = match scale {
            ScaleRewards::Group | ScaleRewards::None => group_std,
            ScaleRewards::Batch => batch_std,
        };
        for &r in group {
            let a = match scale {
                ScaleRewards::None => r - mean,
                _ => (r - mean) / (std + ADVANTAGE_STD_EPS),
            };
            values.push(a as f32);
            zero_std.push(is_zero(std));
        }
    }
    Ok(Advantages { values, zero_std })
}

/// Which tokens of each sampled completion are trained: 1 up to **and including** the first
/// end-of-sequence token, 0 after it (TRL's mask). A mask of `id != pad` would be wrong for
/// the many chat models whose pad token is their EOS (`<|im_end|>`): it drops the EOS, and
/// the model never learns to stop.
pub fn completion_mask(completion: &[u32], eos_ids: &[u32]) -> Vec<f32> {
    let end = completion
        .iter()
        .position(|t| eos_ids.contains(t))
        .map_or(completion.len(), |i| i + 1);
    (0..completion.len())
        .map(|i| if i < end { 1.0 } else { 0.0 })
        .collect()
}
