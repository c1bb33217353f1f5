//! Preference training (`[training] method = "dpo"` or `"orpo"`): the data's pairs, the
//! reference log-probabilities, and one micro-step's loss and TRL metrics.
//!
//! Why the reference is precomputed: a fresh LoRA adapter adds nothing (its `B` factor starts
//! at zero), so the model as loaded *is* the reference, for LoRA and for full fine-tuning
//! alike. One pass without a graph before the first step stores two numbers per pair, and no
//! second copy of the weights is ever held (TRL's `precompute_ref_log_probs`). A resumed run
//! repeats the pass before the checkpoint's weights are loaded, so it keeps the same reference.
//!
//! Normalisation: a micro-step returns the **sum** of its pairs' losses and counts pairs where
//! SFT counts tokens, so the trainer's division by the step's count is the mean over the
//! step's pairs, as one batch of all of them would give (gradient accumulation stays exact).

use candle_core::{Device, Tensor};

use crate::data::lints::Lint;
use crate::data::preference::{
    collate_pairs, is_preference_data, lint_pairs, PreferencePair, PreferencePipeline,
};
use crate::data::CollateOptions;
use crate::model::preference::{
    model_sequence_logps, preference_loss, PairLogps, PreferenceLossKind, PreferenceMetrics,
    SequenceLogps,
};
use crate::model::{CausalLm, Gradients, ModelError};

use super::config::{DpoLoss, RunConfig, TrainingMethod};
use super::error::{Phase, TrainError};
use super::samples::TensorBatch;

/// The tokenized pairs of the run's splits.
#[derive(Debug, Clone, Default)]
pub struct PairSplits {
    /// Training pairs.
    pub train: Vec<PreferencePair>,
    /// Validation pairs (empty: no evaluation).
    pub eval: Vec<PreferencePair>,
    /// The pair lints of the training split.
    pub lints: Vec<Lint>,
}

/// Reads the run's data as preference pairs (detected from the first row, as `tunestudio
/// preview` does), tokenized with `[preference]`'s lengths; an error-level pair lint that
/// `[data] allow` does not name, or no training pair, stops the run here.
pub fn load_pair_splits(
    config: &RunConfig,
    tok: &crate::data::TokenizerBundle,
) -> Result<PairSplits, TrainError> {
    let data_cfg = config.resolved_data();
    let data_error = |e: crate::data::DataError| TrainError::Data {
        context: format!(
            "cannot read the preference pairs of `{}` (data.path)",
            data_cfg.path
        ),
        message: e.to_string(),
    };
    let opened = crate::data::open_data(&data_cfg).map_err(data_error)?;
    if !is_preference_data(&data_cfg, &opened).map_err(data_error)? {
        return Err(TrainError::Data {
            context: format!(
                "training.method = \"{}\" trains on preference pairs",
                config.training.method.name()
            ),
            message: format!(
                "the first row of `{}` is not a pair: give `prompt`/`chosen`/`rejected` (TRL), \
                 `conversations` + `chosen` + `rejected` or `instruction` + `chosen` + `rejected` \
                 (LLaMA-Factory ranking), or `chosen_messages`/`rejected_messages` (LLaMA-Factory \
                 v1), with data.format = \"auto\"; or set training.method = \"sft\"",
                data_cfg.path
            ),
        });
    }
    let limits = config.preference.limits();
    let columns = data_cfg.columns.clone();
    let pipe = PreferencePipeline::for_dataset(tok, &opened.main, None, columns.clone(), limits)
        .map_err(data_error)?;
    let train = pipe
        .pairs(&opened.main, &opened.train_indices)
        .map_err(data_error)?;
    let mut eval = pipe
        .pairs(&opened.main, &opened.heldout_indices)
        .map_err(data_error)?;
    if let Some(v) = opened
        .separate_validation
        .as_ref()
        .filter(|v| !v.is_empty())
    {
        let vpipe =
            PreferencePipeline::for_dataset(tok, v, None, columns, limits).map_err(data_error)?;
        let all: Vec<usize> = (0..v.len()).collect();
        eval.extend(vpipe.pairs(v, &all).map_err(data_error)?);
    }
    let lints = lint_pairs(&train, &pipe.lint_context());
    let blocking = crate::data::lints::blocking(&lints, &config.data.allow);
    if !blocking.is_empty() {
        return Err(TrainError::Lints {
            lints: blocking.into_iter().cloned().collect(),
        });
    }
    if train.is_empty() {
        return Err(TrainError::EmptyDataset(format!(
            "`{}` gave 0 training pairs",
            config.data.path
        )));
    }
    Ok(PairSplits { train, eval, lints })
}

/// [`load_pair_splits`] with the settings lints beside the pair lints, as the trainer starts a
/// preference run: the pairs, and the [`super::samples::Splits`] that carries the lints and
/// warnings (its samples are empty).
pub fn load_checked_pairs(
    config: &RunConfig,
    tok: &crate::data::TokenizerBundle,
    has_weights: bool,
) -> Result<(super::samples::Splits, PairRun), TrainError> {
    let pairs = load_pair_splits(config, tok)?;
    let ctx = super::settings_lints::SettingsContext {
        pretrained: super::settings_lints::SettingsContext::is_pretrained(
            config.model.init,
            has_weights,
        ),
        train_rows: pairs.train.len(),
        longest_row_tokens: pairs.train.iter().map(pair_len).max().unwrap_or(0),
        ranks: 1,
    };
    let mut lints = pairs.lints.clone();
    lints.extend(super::settings_lints::settings_lints(config, &ctx));
    let blocking = crate::data::lints::blocking(&lints, &config.data.allow);
    if !blocking.is_empty() {
        return Err(TrainError::Lints {
            lints: blocking.into_iter().cloned().collect(),
        });
    }
    let warnings = lints
        .iter()
        .filter(|l| l.severity != crate::data::lints::Severity::Info)
        .map(|l| l.message.clone())
        .collect();
    let splits = super::samples::Splits {
        train: Vec::new(),
        eval: Vec::new(),
        warnings,
        lints,
    };
    Ok((splits, PairRun::new(config, pairs)))
}

/// The loss `[training] method` and `[preference]` select.
pub fn loss_kind(config: &RunConfig) -> PreferenceLossKind {
    match (config.training.method, config.preference.loss) {
        (TrainingMethod::Orpo, _) => PreferenceLossKind::Orpo,
        (_, DpoLoss::Ipo) => PreferenceLossKind::Ipo,
        _ => PreferenceLossKind::DpoSigmoid {
            label_smoothing: config.preference.label_smoothing,
        },
    }
}

/// A preference run's data, loss and reference.
#[derive(Debug, Clone)]
pub struct PairRun {
    /// The pairs.
    pub splits: PairSplits,
    /// The loss.
    pub kind: PreferenceLossKind,
    /// β (ORPO's λ).
    pub beta: f64,
    /// The reference's log-probabilities, once computed; ORPO has none.
    reference: Option<ReferenceLogps>,
    /// Rows are cut at prompt + completion lengths.
    max_length: usize,
}

/// The reference's summed log-probabilities `[chosen, rejected]` of every pair.
#[derive(Debug, Clone)]
struct ReferenceLogps {
    train: Vec<[f32; 2]>,
    eval: Vec<[f32; 2]>,
}

/// One micro-step's figures.
#[derive(Debug, Clone, Copy)]
pub struct PairStep {
    /// The sum of the pairs' losses.
    pub loss_sum: f64,
    /// Pairs.
    pub pairs: usize,
    /// Completion tokens of both answers (for tokens per second).
    pub label_tokens: usize,
    /// TRL's metrics of the micro-batch.
    pub metrics: PreferenceMetrics,
}

impl PairRun {
    /// The run of `splits` under `config`'s loss (the reference still to compute).
    pub fn new(config: &RunConfig, splits: PairSplits) -> Self {
        let p = &config.preference;
        PairRun {
            splits,
            kind: loss_kind(config),
            beta: p.beta,
            reference: None,
            max_length: p.max_prompt_length + p.max_completion_length,
        }
    }

    /// Whether the loss compares with a reference model.
    pub fn needs_reference(&self) -> bool {
        self.kind != PreferenceLossKind::Orpo
    }

    /// The padded length the data loader groups by: each pair's longer row.
    pub fn train_lengths(&self) -> Vec<usize> {
        self.splits.train.iter().map(pair_len).collect()
    }

    /// The reference pass: `model` as loaded, without dropout or a graph, `micro_batch` pairs
    /// at a time over both splits.
    pub fn compute_reference(
        &mut self,
        model: &CausalLm,
        pad_id: u32,
        micro_batch: usize,
    ) -> Result<(), ModelError> {
        if !self.needs_reference() {
            return Ok(());
        }
        let mut sides = Vec::with_capacity(2);
        for split in [&self.splits.train, &self.splits.eval] {
            let mut out = Vec::with_capacity(split.len());
            for chunk in split.chunks(micro_batch.max(1)) {
                let picked: Vec<&PreferencePair> = chunk.iter().collect();
                let batch = self.collate(&picked, pad_id, model.device())?;
                let logps = sequence_logps(model, &batch, false)?;
                let pair = PairLogps::from_concatenated(&logps)?;
                let chosen = pair.chosen.sum.to_vec1::<f32>()?;
                let rejected = pair.rejected.sum.to_vec1::<f32>()?;
                out.extend(chosen.into_iter().zip(rejected).map(|(c, r)| [c, r]));
            }
            sides.push(out);
        }
        let eval = sides.pop().unwrap_or_default();
        let train = sides.pop().unwrap_or_default();
        self.reference = Some(ReferenceLogps { train, eval });
        Ok(())
    }

    /// The pairs `indices` of a split as one batch on `device` (chosen rows first).
    pub fn batch(
        &self,
        indices: &[usize],
        eval: bool,
        pad_id: u32,
        device: &Device,
    ) -> Result<TensorBatch, ModelError> {
        let split = if eval {
            &self.splits.eval
        } else {
            &self.splits.train
        };
        let picked: Vec<&PreferencePair> = indices.iter().map(|&i| &split[i]).collect();
        self.collate(&picked, pad_id, device)
    }

    fn collate(
        &self,
        pairs: &[&PreferencePair],
        pad_id: u32,
        device: &Device,
    ) -> Result<TensorBatch, ModelError> {
        let batch = collate_pairs(pairs, &CollateOptions::new(pad_id, self.max_length));
        Ok(TensorBatch::from_batch(&batch, device)?)
    }

    /// The stored reference of pairs `indices` of a split (`None` for ORPO).
    fn reference_of(&self, indices: &[usize], eval: bool) -> Option<Vec<[f32; 2]>> {
        let r = self.reference.as_ref()?;
        let stored = if eval { &r.eval } else { &r.train };
        Some(indices.iter().map(|&i| stored[i]).collect())
    }

    /// Forward and backward of the pairs `indices` of the training split in `batch`, adding
    /// the gradient of the sum of their losses × `backward_factor` into `acc`.
    pub fn micro_step(
        &self,
        model: &CausalLm,
        indices: &[usize],
        batch: &TensorBatch,
        backward_factor: f64,
        acc: &mut Gradients,
    ) -> Result<PairStep, (Phase, ModelError)> {
        let forward = |e: ModelError| (Phase::Forward, e);
        let (loss, metrics) = self
            .loss(model, indices, false, batch, true)
            .map_err(forward)?;
        let pairs = metrics.pairs;
        let scaled = loss
            .affine(pairs as f64 * backward_factor, 0.0)
            .map_err(|e| (Phase::Backward, e.into()))?;
        model
            .backward_into(&scaled, acc)
            .map_err(|e| (Phase::Backward, e))?;
        Ok(PairStep {
            loss_sum: metrics.loss * pairs as f64,
            pairs,
            label_tokens: batch.trained_tokens,
            metrics,
        })
    }

    /// The mean preference loss and metrics over the validation pairs (no dropout, no graph),
    /// `micro_batch` pairs at a time, at most `max_batches` batches (0: all).
    pub fn evaluate(
        &self,
        model: &CausalLm,
        pad_id: u32,
        micro_batch: usize,
        max_batches: usize,
    ) -> Result<Option<PreferenceMetrics>, ModelError> {
        let n = self.splits.eval.len();
        let all: Vec<usize> = (0..n).collect();
        let take = if max_batches == 0 {
            usize::MAX
        } else {
            max_batches
        };
        let mut merged: Option<PreferenceMetrics> = None;
        for chunk in all.chunks(micro_batch.max(1)).take(take) {
            let batch = self.batch(chunk, true, pad_id, model.device())?;
            let (_, m) = self.loss(model, chunk, true, &batch, false)?;
            merged = Some(merged.map_or(m, |a| a.merge(&m)));
        }
        Ok(merged)
    }

    /// The loss tensor (mean over the pairs) and its metrics.
    fn loss(
        &self,
        model: &CausalLm,
        indices: &[usize],
        eval: bool,
        batch: &TensorBatch,
        train: bool,
    ) -> Result<(Tensor, PreferenceMetrics), ModelError> {
        let logps = sequence_logps(model, batch, train)?;
        let policy = PairLogps::from_concatenated(&logps)?;
        let reference = match self.reference_of(indices, eval) {
            Some(stored) => Some(stored_reference(&stored, &policy)?),
            None if self.needs_reference() => {
                return Err(ModelError::Input(
                    "the reference log-probabilities were not computed before the step".into(),
                ))
            }
            None => None,
        };
        let loss = preference_loss(self.kind, &policy, reference.as_ref(), self.beta)?;
        let metrics = loss.metrics()?;
        Ok((loss.loss, metrics))
    }
}

/// A pair's longer row: prompt + the longer answer.
fn pair_len(p: &PreferencePair) -> usize {
    p.prompt_ids.len() + p.chosen.ids.len().max(p.rejected.ids.len())
}

fn sequence_logps(
    model: &CausalLm,
    batch: &TensorBatch,
    train: bool,
) -> Result<SequenceLogps, ModelError> {
    model_sequence_logps(
        model,
        &batch.input_ids,
        Some(&batch.attention_mask),
        &batch.labels,
        train,
    )
}

/// The stored reference sums as log-probabilities beside `policy`'s (the same completion
/// tokens: the same labels), on its device.
fn stored_reference(stored: &[[f32; 2]], policy: &PairLogps) -> Result<PairLogps, ModelError> {
    let device = policy.chosen.sum.device();
    let side = |k: usize| -> Result<Tensor, ModelError> {
        let v: Vec<f32> = stored.iter().map(|r| r[k]).collect();
        Ok(Tensor::new(v, device)?)
    };
    Ok(PairLogps {
        chosen: SequenceLogps {
            sum: side(0)?,
            tokens: policy.chosen.tokens.detach(),
        },
        rejected: SequenceLogps {
            sum: side(1)?,
            tokens: policy.rejected.tokens.detach(),
        },
    })
}
