//! The synchronous training loop: [`TrainingRun`] owns the model, optimizer, data order and
//! counters; [`TrainingRun::step`] runs one optimizer step (all accumulated micro-batches).
//!
//! Loss normalisation: each micro-batch's *summed* token loss is back-propagated as is, the
//! gradients are summed over the micro-batches, and the optimizer multiplies them by
//! `1 / total_label_tokens` (times the clipping coefficient and the inverse loss scale).
//! That is the gradient of the mean token loss over the whole accumulated batch, so
//! `micro_batch = 1, gradient_accumulation = 4` trains exactly like `micro_batch = 4`.
//!
//! Layout: this file holds the run's types and its read-only accessors; [`objective`] is what
//! the run optimises (one `TrainObjective` each for SFT, preference pairs and GRPO, owning its
//! training items); [`build`] builds a run
//! (data, models on their devices, optimizer, data order); [`accumulate`] runs forward and
//! backward over a step's micro-batches on every rank; [`run`] clips and applies the update,
//! skips fp16 overflows, and evaluates; [`checkpoint_io`] resumes and writes checkpoints.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};

use crate::model::{AdamW, CausalLm, Gradients};

use super::checkpoint;
use super::config::RunConfig;
use super::loader::DataLoader;
use super::precision::LossScaler;
use super::samples::{self, Splits};
use super::schedule::LrSchedule;

mod accumulate;
mod accumulate_grpo;
mod build;
mod checkpoint_io;
mod layer_stream;
mod objective;
mod run;
mod shard_reduce;
mod sharded;
mod sharded_layers;
mod world;

pub use accumulate_grpo::{last_prompts, last_rollouts};
pub use build::build_model;
pub(crate) use run::panic_message;
pub use world::launched_training;

/// Stream id of LoRA initialisation.
const LORA_STREAM: u64 = 2;
/// Stream id of dropout masks.
pub(crate) const DROPOUT_STREAM: u64 = 3;
/// fp16: this many skipped steps in a row means scaling cannot fix it.
const MAX_CONSECUTIVE_SKIPS: u64 = 64;

/// What one optimizer step did.
#[derive(Debug, Clone, PartialEq)]
pub struct StepOutcome {
    /// 1-based index of the step just done.
    pub step: u64,
    /// Mean token loss over the step's micro-batches.
    pub loss: f64,
    /// Learning rate used.
    pub lr: f64,
    /// Global norm of the token-normalised gradient, before clipping (NaN when skipped).
    pub grad_norm: f64,
    /// Label tokens in this step.
    pub tokens: u64,
    /// Label tokens per second of this step.
    pub tokens_per_sec: f64,
    /// Label tokens trained so far.
    pub trained_tokens: u64,
    /// Seconds spent training so far.
    pub elapsed_secs: f64,
    /// Fractional epoch reached.
    pub epoch: f64,
    /// fp16: the update was skipped (gradient overflow); the scale was halved.
    pub skipped: bool,
    /// fp16: the loss scale after this step.
    pub loss_scale: Option<f64>,
    /// `(rows, padded length)` of each micro-batch.
    pub batch_shapes: Vec<(usize, usize)>,
    /// A preference step's metrics under TRL's names (`rewards/chosen`, ...); `None` for SFT.
    pub preference: Option<crate::model::preference::PreferenceMetrics>,
    /// A GRPO step's metrics under TRL's names (`reward`, `rewards/<name>/mean`, `kl`, ...).
    pub grpo: Option<super::grpo::GrpoStepMetrics>,
}

/// An evaluation's result.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EvalResult {
    /// The step it followed.
    pub step: u64,
    /// Mean token loss.
    pub loss: f64,
    /// exp(loss).
    pub perplexity: f64,
    /// Label tokens evaluated.
    pub tokens: u64,
}

/// The gradient of the next step (for tests and diagnostics): token-normalised, unscaled, f32.
#[derive(Debug, Clone)]
pub struct StepGradients {
    /// Gradient of the mean token loss, by parameter name.
    pub grads: HashMap<String, Tensor>,
    /// Label tokens of the step.
    pub tokens: u64,
    /// Mean token loss.
    pub loss: f64,
}

/// Gradients summed over the micro-batches of a step (and, under data parallel, over the
/// ranks), before normalisation.
struct Accumulated {
    /// One set per rank (on that rank's devices), equal after the all-reduce; empty when
    /// no micro-batch had a trained token.
    grads: Vec<Gradients>,
    loss_sum: f64,
    /// What the loss sum is divided by: trained tokens (SFT) or pairs (preference).
    tokens: u64,
    /// Trained (label) tokens, for the throughput figures.
    label_tokens: u64,
    /// A preference step's metrics (TRL's names), merged over its micro-batches.
    preference: Option<crate::model::preference::PreferenceMetrics>,
    /// A GRPO step's metrics (TRL's names).
    grpo: Option<super::grpo::GrpoStepMetrics>,
    shapes: Vec<(usize, usize)>,
    /// What the summed loss was multiplied by before backward.
    backward_factor: f64,
}

impl Accumulated {
    /// Nothing accumulated yet; the summed loss is multiplied by `backward_factor`.
    fn new(backward_factor: f64) -> Self {
        Accumulated {
            grads: Vec::new(),
            loss_sum: 0.0,
            tokens: 0,
            label_tokens: 0,
            preference: None,
            grpo: None,
            shapes: Vec::new(),
            backward_factor,
        }
    }

    /// Adds one rank's micro-step on preference pairs: its loss sum, its pairs (the count
    /// the loss is divided by), its label tokens and its metrics.
    fn add_pairs(&mut self, out: super::preference::PairStep) {
        self.loss_sum += out.loss_sum;
        self.tokens += out.pairs as u64;
        self.label_tokens += out.label_tokens as u64;
        self.preference = Some(match self.preference {
            Some(m) => m.merge(&out.metrics),
            None => out.metrics,
        });
    }

    /// `(rows, padded length)` of the last micro-batch (zeros when there was none).
    fn last_shape(&self) -> (usize, usize) {
        self.shapes.last().copied().unwrap_or((0, 0))
    }
}

/// A data-parallel rank other than rank 0: its own model replica and optimizer, on its device.
struct Replica {
    model: CausalLm,
    optimizer: AdamW,
}

/// A training run, driven synchronously.
pub struct TrainingRun {
    config: RunConfig,
    device: Device,
    placement: super::placement::RunPlacement,
    /// Rank 0 (the only rank unless the strategy is data parallel).
    model: CausalLm,
    /// Rank 0's optimizer; over no parameter under sharded data parallel, whose optimizer is
    /// `sharded`.
    optimizer: AdamW,
    /// `[devices] strategy = "sharded"`: every rank's AdamW over its ranges of the trainable
    /// tensors (ZeRO-2).
    sharded: Option<sharded::ShardedOptimizer>,
    /// ZeRO-3 (`shard = "everything"`): every rank's ranges of the decoder layers' tensors,
    /// which the ranks' models gather a layer at a time; made at the first step.
    layer_shards: Option<std::sync::Arc<sharded_layers::LayerShards>>,
    /// Parameters and trained parameters, counted as the model was loaded (ZeRO-3's models
    /// hold placeholders for their layers).
    parameter_counts: (u64, u64),
    /// Ranks 1.. under data parallel.
    replicas: Vec<Replica>,
    /// The rows SFT trains on, and the data's lints and warnings under every objective (the
    /// rows are empty for preference pairs and GRPO, whose objective owns its items).
    splits: Splits,
    /// What the run optimises and its training items (`objective::TrainObjective`): SFT's
    /// rows, DPO/ORPO's pairs, or GRPO's prompts and reward functions.
    objective: Box<dyn objective::TrainObjective>,
    /// `reference = "copy"`: each rank's frozen reference, rank 0 first (empty otherwise).
    reference_copies: Vec<CausalLm>,
    loader: DataLoader,
    schedule: LrSchedule,
    total_steps: u64,
    step: u64,
    trained_tokens: u64,
    elapsed_secs: f64,
    scaler: Option<LossScaler>,
    consecutive_skips: u64,
    last_loss: Option<f64>,
    last_eval_loss: Option<f64>,
    last_checkpoint: Option<PathBuf>,
    resumed_from: Option<PathBuf>,
    pad_id: u32,
    model_dir: PathBuf,
    /// Σ bytes of rank 0's gradient store when the last step's backward returned.
    last_gradient_bytes: Option<u64>,
    /// What each rank held as the last optimizer step began (weights, master weights,
    /// gradients, AdamW state), measured by the counting allocator's rank accounting
    /// ([`crate::mem::ranks`]); empty unless a measurement is on.
    state_bytes_by_rank: Vec<u64>,
    /// The NCCL communicators of a data-parallel run over distinct GPUs: created once per
    /// run (NCCL's setup costs far more than a step) and reused by every step.
    #[cfg(feature = "nccl")]
    nccl: Option<std::sync::Arc<crate::devices::parallel::nccl::NcclReducer>>,
    /// The step a launched sharded rank that writes no checkpoint last gave its share of one
    /// (`share_checkpoint_state`).
    shared_checkpoint_step: Option<u64>,
    /// One rank of a launched run (torchrun, Slurm): the process group its sums go through;
    /// `None` for a run in one process.
    world: Option<std::sync::Arc<crate::devices::parallel::process_group::ProcessGroup>>,
}

impl TrainingRun {
    /// What each rank held as the last optimizer step began, rank 0 first: its weights,
    /// master weights, gradients and AdamW state, as the counting allocator's rank accounting
    /// measured them ([`crate::mem::ranks::track_ranks`]). Empty unless a test or bench
    /// binary installed the counting allocator and turned the measurement on.
    pub fn measured_state_bytes_by_rank(&self) -> &[u64] {
        &self.state_bytes_by_rank
    }

    /// The run config.
    pub fn config(&self) -> &RunConfig {
        &self.config
    }

    /// The model being trained (rank 0's). Under ZeRO-3 its decoder layers run from the
    /// ranks' ranges once a step ran, and hold placeholders: [`Self::gather_weights`] makes it
    /// whole (a checkpoint does).
    pub fn model(&self) -> &CausalLm {
        &self.model
    }

    /// Mutable access to the model (e.g. to export it).
    pub fn model_mut(&mut self) -> &mut CausalLm {
        &mut self.model
    }

    /// The device trained on (rank 0's, the first stage's under a layer split).
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The run's devices, strategy and layer split.
    pub fn placement(&self) -> &super::placement::RunPlacement {
        &self.placement
    }

    /// Rows of one micro-step over every rank (of every process of a launched run).
    fn rows_per_micro_batch(&self) -> usize {
        self.config.training.micro_batch * self.total_ranks()
    }

    /// Samples (rows, pairs or prompts) per optimizer step ([`RunConfig::effective_batch`],
    /// times the processes of a launched run).
    pub fn effective_batch(&self) -> usize {
        self.config.effective_batch() * self.world_size()
    }

    /// The model's folder (config, tokenizer).
    pub fn model_dir(&self) -> &Path {
        &self.model_dir
    }

    /// Optimizer steps done.
    pub fn step_index(&self) -> u64 {
        self.step
    }

    /// Optimizer steps of the whole run.
    pub fn total_steps(&self) -> u64 {
        self.total_steps
    }

    /// After a divergence at `spike_step`: the checkpoints written from step `spike_step − 1`
    /// on hold the weights that spiked; they are set aside and the last good one becomes the
    /// run's last checkpoint (what `--resume latest` and the report name).
    pub fn fall_back_before(&mut self, spike_step: u64) -> Option<&Path> {
        let good =
            checkpoint::set_aside_after(&self.config.output_path(), spike_step.saturating_sub(2));
        self.last_checkpoint = good;
        self.last_checkpoint.as_deref()
    }

    /// Warm-up steps of the learning-rate schedule.
    pub fn warmup_steps(&self) -> u64 {
        self.schedule.warmup_steps
    }

    /// Whether every step of the run is done.
    pub fn is_done(&self) -> bool {
        self.step >= self.total_steps
    }

    /// Rows in the training and validation splits.
    pub fn split_sizes(&self) -> (usize, usize) {
        self.objective.split_sizes(self)
    }

    /// The training split's trained tokens and longest row, for the memory plan
    /// ([`crate::plan::PlanRequest::trained_tokens`]; `None` with packing).
    pub fn data_trained_tokens(&self) -> Option<crate::plan::TrainedTokens> {
        if !self.objective.plans_data_trained_tokens() {
            // The plan counts every position of the pairs' (and rollouts') rows.
            return None;
        }
        samples::split_trained_tokens(&self.config, &self.splits.train)
    }

    /// The trained tokens and longest row of the batch [`Self::step_longest`] steps on, for the
    /// dry run's plan of that step (`None` for preference pairs and with packing, as
    /// [`Self::data_trained_tokens`]).
    pub fn longest_step_trained_tokens(&self) -> Option<crate::plan::TrainedTokens> {
        if !self.objective.plans_data_trained_tokens() {
            return None;
        }
        let accumulation = self.config.training.gradient_accumulation;
        let rows = self.loader.longest_step(accumulation);
        let samples = rows
            .iter()
            .flatten()
            .filter_map(|&i| self.splits.train.get(i));
        samples::rows_trained_tokens(&self.config, samples)
    }

    /// Label tokens trained so far.
    pub fn trained_tokens(&self) -> u64 {
        self.trained_tokens
    }

    /// Seconds spent in steps, evaluations and checkpoints.
    pub fn elapsed_secs(&self) -> f64 {
        self.elapsed_secs
    }

    /// Warnings about the data (lints, ignored loss weights), for the front end to show.
    pub fn data_warnings(&self) -> &[String] {
        &self.splits.warnings
    }

    /// The error-level lints this run trains despite, because `[data] allow` names them.
    pub fn allowed_lints(&self) -> Vec<&crate::data::lints::Lint> {
        let errors = self
            .splits
            .lints
            .iter()
            .filter(|l| l.severity == crate::data::lints::Severity::Error);
        let blocking = crate::data::lints::blocking(&self.splits.lints, &self.config.data.allow);
        errors
            .filter(|l| !blocking.iter().any(|b| std::ptr::eq(*b, *l)))
            .collect()
    }

    /// Loss of the last step.
    pub fn last_loss(&self) -> Option<f64> {
        self.last_loss
    }

    /// Loss of the last evaluation.
    pub fn last_eval_loss(&self) -> Option<f64> {
        self.last_eval_loss
    }

    /// The newest checkpoint written or resumed from.
    pub fn last_checkpoint(&self) -> Option<&Path> {
        self.last_checkpoint.as_deref()
    }

    /// The checkpoint this run resumed from.
    pub fn resumed_from(&self) -> Option<&Path> {
        self.resumed_from.as_deref()
    }

    /// The fp16 loss scaler.
    pub fn loss_scaler(&self) -> Option<&LossScaler> {
        self.scaler.as_ref()
    }

    /// Number of parameters and of trainable parameters.
    pub fn parameter_counts(&self) -> (u64, u64) {
        self.parameter_counts
    }

    /// Whether an evaluation is due after the step just done.
    pub fn eval_due(&self) -> bool {
        let every = self.config.eval.eval_every;
        self.split_sizes().1 > 0
            && self.step > 0
            && ((every > 0 && self.step.is_multiple_of(every)) || self.is_done())
    }

    /// Whether a periodic checkpoint is due after the step just done.
    pub fn save_due(&self) -> bool {
        let every = self.config.checkpoint.save_every;
        (every > 0 && self.step > 0 && self.step.is_multiple_of(every))
            || (self.is_done() && self.config.checkpoint.save_final)
    }

    /// The settings that decide memory, for error hints.
    fn settings_summary(&self) -> String {
        let t = &self.config.training;
        format!(
            "micro_batch {}, gradient_accumulation {}, max_length {}, precision {}, activation_checkpointing {}, lora {}",
            t.micro_batch,
            t.gradient_accumulation,
            self.config.data.max_length,
            t.precision,
            t.activation_checkpointing,
            self.config.lora.enabled
        )
    }

    /// The bytes of the tensors rank 0 holds, counted from the tensors themselves (any
    /// device, no allocator needed): its weights, its AdamW state, and its gradient store as
    /// the last step's backward left it (the per-component report's definitions,
    /// `plan::components`). Under a layer split they span every device of rank 0.
    pub fn tensor_bytes(&self) -> crate::plan::TensorBytes {
        crate::plan::TensorBytes {
            weights_bytes: self.model.weights_bytes(),
            optimizer_bytes: match &self.sharded {
                Some(s) => s.rank_state_bytes(0),
                None => self.optimizer.state_bytes(),
            },
            gradients_bytes: self.last_gradient_bytes,
        }
    }

    /// The weights and AdamW state of every data-parallel rank after the first, each counted
    /// from its own tensors (empty unless data parallel).
    pub fn replica_tensor_bytes(&self) -> Vec<crate::plan::TensorBytes> {
        self.replicas
            .iter()
            .enumerate()
            .map(|(i, r)| crate::plan::TensorBytes {
                weights_bytes: r.model.weights_bytes(),
                optimizer_bytes: match &self.sharded {
                    Some(s) => s.rank_state_bytes(i + 1),
                    None => r.optimizer.state_bytes(),
                },
                gradients_bytes: None,
            })
            .collect()
    }

    /// Every rank's model, rank 0 first.
    fn rank_models(&self) -> Vec<&CausalLm> {
        std::iter::once(&self.model)
            .chain(self.replicas.iter().map(|r| &r.model))
            .collect()
    }
}
