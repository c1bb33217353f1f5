//! A step's rollouts: every prompt's group of sampled completions, their rewards from every
//! function, and the advantages; with TRL's metrics of them.

use crate::infer::{sample_group, InferModel, SamplingParams};
use crate::model::grpo::{advantages, completion_mask};
use crate::train::grpo_rewards::{RewardInput, RewardScores};
use crate::train::loader::derive_seed;

use super::super::error::TrainError;
use super::GrpoRun;

/// Stream id of GRPO's sampling seeds.
pub(crate) const ROLLOUT_STREAM: u64 = 5;

/// One sampled completion with what was computed of it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Rollout {
    /// Index into [`GrpoRun::prompts`].
    pub prompt: usize,
    /// The sampled tokens (EOS included when sampled).
    pub completion_ids: Vec<u32>,
    /// The completion as text, special tokens left out (what the reward functions read).
    pub text: String,
    /// 1 for every trained token: up to and including the first EOS; all 0 when the
    /// completion was truncated and `mask_truncated_completions` is on.
    pub mask: Vec<f32>,
    /// It hit `max_completion_length` without an EOS.
    pub truncated: bool,
    /// Each reward function's value, in `[[grpo.reward]]` order.
    pub rewards: Vec<f32>,
    /// The weighted sum of the rewards.
    pub reward: f32,
    /// Its advantage over its group.
    pub advantage: f32,
    /// The sampling policy's per-token log-probabilities of the completion (under the
    /// temperature, without dropout), when `num_iterations > 1` trains on it again after the
    /// policy moved (TRL's `old_per_token_logps`); empty otherwise (the ratio is then 1).
    #[serde(default)]
    pub old_logps: Vec<f32>,
}

/// Every rollout of one step, grouped: the `num_generations` completions of a prompt follow
/// each other, prompts in the step's order.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StepRollouts {
    /// The rollouts.
    pub rows: Vec<Rollout>,
    /// The reward functions' names, in order.
    pub reward_names: Vec<String>,
    /// TRL's metrics of them.
    pub metrics: RolloutMetrics,
}

impl StepRollouts {
    /// Completion tokens trained over the whole step (the `dapo` divisor).
    pub fn trained_tokens(&self) -> usize {
        self.rows
            .iter()
            .map(|r| r.mask.iter().filter(|&&m| m > 0.0).count())
            .sum()
    }
}

/// Rewards, advantages and completion lengths of one step, under TRL's names.
#[derive(Debug, Clone, PartialEq, Default, serde::Serialize, serde::Deserialize)]
pub struct RolloutMetrics {
    /// `rewards/<name>/mean` and `rewards/<name>/std`, `reward`, `reward_std`.
    pub rewards: Vec<(String, f64)>,
    /// `frac_reward_zero_std`.
    pub frac_reward_zero_std: f64,
    /// `completions/mean_length`, `min_length`, `max_length`.
    pub lengths: (f64, f64, f64),
    /// `completions/clipped_ratio`: the share that hit the length limit.
    pub clipped_ratio: f64,
    /// `completions/mean_terminated_length`, min, max (those that ended with EOS; 0 if none).
    pub terminated_lengths: (f64, f64, f64),
}

impl RolloutMetrics {
    /// Every metric by its TRL name.
    pub fn named(&self) -> Vec<(String, f64)> {
        let mut out: Vec<(String, f64)> = vec![
            ("completions/mean_length".into(), self.lengths.0),
            ("completions/min_length".into(), self.lengths.1),
            ("completions/max_length".into(), self.lengths.2),
            ("completions/clipped_ratio".into(), self.clipped_ratio),
            (
                "completions/mean_terminated_length".into(),
                self.terminated_lengths.0,
            ),
            (
                "completions/min_terminated_length".into(),
                self.terminated_lengths.1,
            ),
            (
                "completions/max_terminated_length".into(),
                self.terminated_lengths.2,
            ),
        ];
        out.extend(self.rewards.iter().cloned());
        out.push(("frac_reward_zero_std".into(), self.frac_reward_zero_std));
        out
    }
}

/// Mean, min and max of `xs` (zeros when empty).
fn summary(xs: &[f64]) -> (f64, f64, f64) {
    if xs.is_empty() {
        return (0.0, 0.0, 0.0);
    }
    let mean = xs.iter().sum::<f64>() / xs.len() as f64;
    let min = xs.iter().copied().fold(f64::INFINITY, f64::min);
    let max = xs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    (mean, min, max)
}

impl GrpoRun {
    /// The sampling settings of generation group `prompt` at `step` (its seed derived from the
    /// run's seed, the step and the prompt's row).
    fn sampling(&self, run_seed: u64, step: u64, prompt: usize) -> SamplingParams {
        let g = &self.settings;
        SamplingParams {
            max_new_tokens: g.max_completion_length,
            temperature: g.temperature,
            top_p: g.top_p,
            top_k: g.top_k,
            repetition_penalty: 1.0,
            seed: derive_seed(run_seed, ROLLOUT_STREAM, (step << 32) ^ prompt as u64),
            stop_strings: Vec::new(),
            stop_on_eos: true,
            forced_tokens: Vec::new(),
        }
    }

    /// Samples every prompt of `prompts` (indices into [`GrpoRun::prompts`]) with `model`,
    /// scores the completions and computes their advantages.
    pub fn rollouts(
        &self,
        model: &InferModel,
        prompts: &[usize],
        run_seed: u64,
        step: u64,
    ) -> Result<StepRollouts, TrainError> {
        let g = self.settings.num_generations;
        let mut rows = Vec::with_capacity(prompts.len() * g);
        for &p in prompts {
            let prompt = self.prompts.get(p).ok_or_else(|| {
                TrainError::EmptyDataset(format!(
                    "prompt {p} is outside the {} prompts",
                    self.prompts.len()
                ))
            })?;
            let group = sample_group(
                model,
                &prompt.prompt_ids,
                &self.sampling(run_seed, step, prompt.index),
                g,
                &self.eos_ids,
            )
            .map_err(|cause| TrainError::Rollout {
                step,
                context: format!("sampling the completions of prompt row {}", prompt.index),
                cause: Box::new(cause),
            })?;
            for c in group.completions {
                let mut mask = completion_mask(&c.ids, &self.eos_ids);
                if c.truncated && self.settings.mask_truncated_completions {
                    mask.iter_mut().for_each(|m| *m = 0.0);
                }
                rows.push(Rollout {
                    prompt: p,
                    text: self
                        .tokenizer
                        .tokenizer
                        .decode(&c.ids, true)
                        .unwrap_or_default(),
                    completion_ids: c.ids,
                    mask,
                    truncated: c.truncated,
                    rewards: Vec::new(),
                    reward: 0.0,
                    advantage: 0.0,
                    old_logps: Vec::new(),
                });
            }
        }
        self.score(rows, step)
    }

    /// Every reward function on every rollout, then the advantages and the metrics.
    pub fn score(&self, mut rows: Vec<Rollout>, step: u64) -> Result<StepRollouts, TrainError> {
        let inputs: Vec<RewardInput<'_>> = rows
            .iter()
            .map(|r| {
                let p = &self.prompts[r.prompt];
                RewardInput {
                    prompt: &p.prompt_text,
                    completion: &r.text,
                    completion_tokens: r.completion_ids.len(),
                    row: &p.columns,
                }
            })
            .collect();
        let scores: RewardScores = self
            .rewards
            .lock()
            .map_err(|_| TrainError::Panic {
                step,
                message: "the reward functions were left unusable by an earlier failure".into(),
            })?
            .score(&inputs)
            .map_err(|cause| TrainError::Reward {
                step,
                cause: Box::new(cause),
            })?;
        let weighted = scores.weighted();
        let adv = advantages(
            &weighted,
            self.settings.num_generations,
            self.settings.scale_rewards,
        )
        .map_err(|cause| TrainError::Model {
            context: format!("step {step}: the advantages of the rewards"),
            cause,
        })?;
        for (i, r) in rows.iter_mut().enumerate() {
            r.rewards = scores.per_function.iter().map(|f| f[i]).collect();
            r.reward = weighted[i];
            r.advantage = adv.values[i];
        }
        let lengths: Vec<f64> = rows.iter().map(|r| r.completion_ids.len() as f64).collect();
        let terminated: Vec<f64> = rows
            .iter()
            .filter(|r| !r.truncated)
            .map(|r| r.completion_ids.len() as f64)
            .collect();
        let n = rows.len().max(1) as f64;
        let metrics = RolloutMetrics {
            rewards: scores.metrics(),
            frac_reward_zero_std: adv.frac_zero_std(),
            lengths: summary(&lengths),
            clipped_ratio: rows.iter().filter(|r| r.truncated).count() as f64 / n,
            terminated_lengths: summary(&terminated),
        };
        let out = StepRollouts {
            rows,
            reward_names: scores.names.clone(),
            metrics,
        };
        if let Ok(mut last) = self.last.lock() {
            *last = Some(out.clone());
        }
        Ok(out)
    }
}
