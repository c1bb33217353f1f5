//! GRPO's reward functions (`[[grpo.reward]]`): the built-in `accuracy`, `format` and
//! `length` rewards, `command` rewards run by a program the user writes, and TRL's reward
//! metrics (`reward`, `reward_std`, `rewards/<name>/mean` and `/std`).
//!
//! A [`RewardSet`] is started once per run from the specs ([`RewardSet::start`]: command
//! programs are spawned then and live until the set is dropped) and scores a batch of
//! completions at a time ([`RewardSet::score`]). As in TRL's `GRPOTrainer`, the reward of a
//! completion is Σ_k w_k r_k over the functions ([`RewardScores::weighted`]).
//!
//! The rules each kind follows are on [`RewardKind`]'s variants.

mod answer;
mod builtin;
mod command;
mod reward_error;
mod spec;
#[cfg(test)]
mod tests;

use std::path::Path;

use serde_json::{Map, Value};

use builtin::Builtin;
use command::CommandReward;
pub use reward_error::RewardError;
pub use spec::{validate, RewardKind, RewardSpec, DEFAULT_COLUMN, DEFAULT_TIMEOUT_SECS};

/// What a reward function sees of one completion.
#[derive(Debug, Clone, Copy)]
pub struct RewardInput<'a> {
    /// The prompt as text (rendered by the chat template, as the model saw it).
    pub prompt: &'a str,
    /// The sampled completion as text, without special tokens (TRL decodes with
    /// `skip_special_tokens=True`).
    pub completion: &'a str,
    /// The completion's length in tokens (its EOS included when it has one).
    pub completion_tokens: usize,
    /// The dataset row's own columns (e.g. `answer`).
    pub row: &'a Map<String, Value>,
}

/// The scores of one batch: every function's reward for every completion.
#[derive(Debug, Clone, PartialEq)]
pub struct RewardScores {
    /// `[function][completion]`, unweighted.
    pub per_function: Vec<Vec<f32>>,
    /// The functions' names, in the order of the specs.
    pub names: Vec<String>,
    /// The functions' weights, in the same order.
    pub weights: Vec<f32>,
}

impl RewardScores {
    /// Number of completions scored.
    pub fn len(&self) -> usize {
        self.per_function.first().map_or(0, Vec::len)
    }

    /// No completion was scored.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Each completion's reward Σ_k w_k r_k, in f32 as TRL sums it.
    pub fn weighted(&self) -> Vec<f32> {
        (0..self.len())
            .map(|i| {
                self.per_function
                    .iter()
                    .zip(&self.weights)
                    .map(|(rewards, w)| w * rewards[i])
                    .sum()
            })
            .collect()
    }

    /// TRL's reward metrics over this batch: `rewards/<name>/mean` and `rewards/<name>/std`
    /// for each function (unweighted), then `reward` and `reward_std` of the weighted sums.
    /// Standard deviations use Bessel's correction (n − 1), as `torch.std`; one value has
    /// std 0. Empty when no completion was scored.
    pub fn metrics(&self) -> Vec<(String, f64)> {
        if self.is_empty() {
            return Vec::new();
        }
        let mut out = Vec::with_capacity(2 * self.names.len() + 2);
        for (name, rewards) in self.names.iter().zip(&self.per_function) {
            let (mean, std) = mean_std(rewards);
            out.push((format!("rewards/{name}/mean"), mean));
            out.push((format!("rewards/{name}/std"), std));
        }
        let (mean, std) = mean_std(&self.weighted());
        out.push(("reward".to_string(), mean));
        out.push(("reward_std".to_string(), std));
        out
    }
}

/// Mean and sample standard deviation (n − 1; 0 for a single value).
fn mean_std(values: &[f32]) -> (f64, f64) {
    let n = values.len() as f64;
    let mean = values.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
    if values.len() < 2 {
        return (mean, 0.0);
    }
    let squares: f64 = values.iter().map(|&v| (f64::from(v) - mean).powi(2)).sum();
    (mean, (squares / (n - 1.0)).sqrt())
}

/// One reward function, ready to score.
struct RewardFunction {
    name: String,
    weight: f32,
    scorer: Scorer,
}

enum Scorer {
    Builtin(Builtin),
    Command(CommandReward),
}

/// The run's reward functions, started: built-ins compiled, command programs running.
pub struct RewardSet {
    functions: Vec<RewardFunction>,
}

impl RewardSet {
    /// Validates the specs, compiles the built-ins and starts every command program, in
    /// `work_dir` (the run config's folder: a command's relative paths start there). A program
    /// already started is stopped again if a later one fails.
    pub fn start(specs: &[RewardSpec], work_dir: &Path) -> Result<Self, RewardError> {
        validate(specs)?;
        let mut functions = Vec::with_capacity(specs.len());
        for spec in specs {
            let name = spec.name();
            let scorer = match spec.kind {
                RewardKind::Command => {
                    Scorer::Command(CommandReward::start(&name, spec, work_dir)?)
                }
                _ => Scorer::Builtin(Builtin::compile(&name, spec)?),
            };
            functions.push(RewardFunction {
                name,
                // `validate` checked the weight is finite in f32.
                weight: spec.weight as f32,
                scorer,
            });
        }
        Ok(RewardSet { functions })
    }

    /// The functions' names, in the order of the specs.
    pub fn names(&self) -> Vec<String> {
        self.functions.iter().map(|f| f.name.clone()).collect()
    }

    /// The functions' weights, in the order of the specs.
    pub fn weights(&self) -> Vec<f32> {
        self.functions.iter().map(|f| f.weight).collect()
    }

    /// Scores a batch of completions with every function. A command program is sent the
    /// whole batch at once. The first error stops scoring; a command program that failed is
    /// killed and fails every later call.
    pub fn score(&mut self, inputs: &[RewardInput]) -> Result<RewardScores, RewardError> {
        let mut per_function = Vec::with_capacity(self.functions.len());
        for f in &mut self.functions {
            let rewards = match &mut f.scorer {
                Scorer::Builtin(b) => inputs
                    .iter()
                    .enumerate()
                    .map(|(i, input)| b.score(&f.name, i, input))
                    .collect::<Result<Vec<f32>, RewardError>>()?,
                Scorer::Command(c) => c.score(inputs)?,
            };
            per_function.push(rewards);
        }
        Ok(RewardScores {
            per_function,
            names: self.names(),
            weights: self.weights(),
        })
    }
}
