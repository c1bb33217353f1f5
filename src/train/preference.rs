//! Preference training (`[training] method = "dpo"` or `"orpo"`): the data's pairs, the
//! reference log-probabilities, and one micro-step's loss and TRL metrics.
//!
//! # The reference (`[preference] reference`, see [`ReferenceSource`])
//! - `precomputed`: one pass without a graph before the first step stores two numbers per pair
//!   (TRL's `precompute_ref_log_probs`); no second copy of the weights is ever held. A resumed
//!   run repeats the pass before the checkpoint's weights are loaded, so it keeps the same
//!   reference.
//! - `adapter-disabled` (LoRA, QLoRA): each micro-step first runs the batch through the policy
//!   with its adapters switched off ([`CausalLm::without_adapters`]: a flag the linear layers
//!   read), without a graph — the base, as TRL computes it for a PEFT model with no
//!   `ref_model`.
//! - `copy` (full fine-tuning): a frozen copy of the starting weights on each rank's devices
//!   (laid out like the policy under a layer split), run without a graph each micro-step — TRL's
//!   `ref_model` made by `create_reference_model`.
//! - `auto` is `precomputed`, for LoRA and full fine-tuning alike. A fresh LoRA adapter adds
//!   nothing (its `B` factor starts at zero) and a run never starts from a trained adapter, so
//!   the model as loaded *is* TRL's reference either way and the three modes give the same
//!   numbers (`tests/it/preference_train.rs`); precomputed costs one forward per pair for the
//!   whole run instead of one per pair per epoch, and holds no second copy of the weights (the
//!   memory a reference model costs is the users' first complaint about DPO elsewhere).
//!   `adapter-disabled` and `copy` remain for runs far shorter than an epoch (the pass covers
//!   every pair) and for TRL's exact schedule of work.
//!
//! Normalisation: a micro-step returns the **sum** of its pairs' losses and counts pairs where
//! SFT counts tokens, so the trainer's division by the step's count is the mean over the
//! step's pairs, as one batch of all of them would give (gradient accumulation stays exact).

use candle_core::{Device, Tensor};

use crate::data::preference::{collate_pairs, PreferencePair};
use crate::data::CollateOptions;
use crate::model::preference::{
    model_sequence_logps, preference_loss, PairLogps, PreferenceLossKind, PreferenceMetrics,
    SequenceLogps,
};
use crate::model::{CausalLm, Gradients, ModelError};

use super::config::{DpoLoss, ReferenceMode, RunConfig, TrainingMethod};
use super::error::{Phase, TrainError};
use super::samples::TensorBatch;

pub use super::pairs::{load_pair_splits, PairSplits};

/// [`load_pair_splits`] with the settings lints beside the pair lints, as the trainer starts a
/// preference run: the pairs, and the [`super::samples::Splits`] that carries the lints and
/// warnings (its samples are empty).
pub fn load_checked_pairs(
    config: &RunConfig,
    tok: &crate::data::TokenizerBundle,
    has_weights: bool,
) -> Result<(super::samples::Splits, PairRun), TrainError> {
    let pairs = load_pair_splits(config, tok)?;
    let ctx = super::settings_lints::SettingsContext::new(
        config,
        has_weights,
        pairs.train.len(),
        pairs.train.iter().map(pair_len).max().unwrap_or(0),
    );
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

/// Where a run's reference log-probabilities come from: `[preference] reference` resolved
/// (see the module doc for `auto`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReferenceSource {
    /// ORPO compares with no reference.
    None,
    /// Stored by one pass before the first step.
    Precomputed,
    /// The policy with its LoRA adapters switched off, each micro-step.
    AdapterDisabled,
    /// A frozen copy of the starting weights, each micro-step.
    Copy,
}

impl ReferenceSource {
    /// The source `config` selects.
    pub fn of(config: &RunConfig) -> Self {
        if config.training.method == TrainingMethod::Orpo {
            return ReferenceSource::None;
        }
        match config.preference.reference {
            ReferenceMode::Auto | ReferenceMode::Precomputed => ReferenceSource::Precomputed,
            ReferenceMode::AdapterDisabled => ReferenceSource::AdapterDisabled,
            ReferenceMode::Copy => ReferenceSource::Copy,
        }
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
    /// Where the reference comes from.
    pub source: ReferenceSource,
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
            source: ReferenceSource::of(config),
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

    /// The reference pass of `precomputed` (nothing for the other sources): `model` as
    /// loaded, without dropout or a graph, `micro_batch` pairs at a time over both splits.
    pub fn compute_reference(
        &mut self,
        model: &CausalLm,
        pad_id: u32,
        micro_batch: usize,
    ) -> Result<(), ModelError> {
        if self.source != ReferenceSource::Precomputed {
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
    /// the gradient of the sum of their losses × `backward_factor` into `acc`. `copy` is the
    /// frozen reference on `model`'s devices (`reference = "copy"`).
    pub fn micro_step(
        &self,
        model: &CausalLm,
        copy: Option<&CausalLm>,
        indices: &[usize],
        batch: &TensorBatch,
        backward_factor: f64,
        acc: &mut Gradients,
    ) -> Result<PairStep, (Phase, ModelError)> {
        let forward = |e: ModelError| (Phase::Forward, e);
        let (loss, metrics) = self
            .loss(model, copy, (indices, false), batch, true)
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
    /// `micro_batch` pairs at a time, at most `max_batches` batches (0: all); `copy` as for
    /// [`Self::micro_step`].
    pub fn evaluate(
        &self,
        model: &CausalLm,
        copy: Option<&CausalLm>,
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
            let (_, m) = self.loss(model, copy, (chunk, true), &batch, false)?;
            merged = Some(merged.map_or(m, |a| a.merge(&m)));
        }
        Ok(merged)
    }

    /// The reference of `batch` computed now (`adapter-disabled`, `copy`; `None` for the
    /// other sources): a forward without dropout or a graph.
    fn live_reference(
        &self,
        model: &CausalLm,
        copy: Option<&CausalLm>,
        batch: &TensorBatch,
    ) -> Result<Option<PairLogps>, ModelError> {
        let logps = |m: &CausalLm| -> Result<PairLogps, ModelError> {
            PairLogps::from_concatenated(&sequence_logps(m, batch, false)?)
        };
        match self.source {
            ReferenceSource::AdapterDisabled => {
                if model.lora_config().is_none() {
                    return Err(ModelError::Input(
                        "reference = \"adapter-disabled\" needs LoRA adapters".into(),
                    ));
                }
                model.without_adapters(logps).map(Some)
            }
            ReferenceSource::Copy => {
                let copy = copy.ok_or_else(|| {
                    ModelError::Input("reference = \"copy\": the frozen copy is missing".into())
                })?;
                logps(copy).map(Some)
            }
            ReferenceSource::None | ReferenceSource::Precomputed => Ok(None),
        }
    }

    /// The loss tensor (mean over the pairs) and its metrics; `at` is the pairs' indices and
    /// whether they are the validation split's.
    fn loss(
        &self,
        model: &CausalLm,
        copy: Option<&CausalLm>,
        at: (&[usize], bool),
        batch: &TensorBatch,
        train: bool,
    ) -> Result<(Tensor, PreferenceMetrics), ModelError> {
        let (indices, eval) = at;
        // The reference first: its forward's tensors are gone before the policy's graph grows.
        let live = self.live_reference(model, copy, batch)?;
        let logps = sequence_logps(model, batch, train)?;
        let policy = PairLogps::from_concatenated(&logps)?;
        let reference = match (self.source, live) {
            (_, Some(live)) => Some(live),
            (ReferenceSource::Precomputed, None) => match self.reference_of(indices, eval) {
                Some(stored) => Some(stored_reference(&stored, &policy)?),
                None => {
                    return Err(ModelError::Input(
                        "the reference log-probabilities were not computed before the step".into(),
                    ))
                }
            },
            _ => None,
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
