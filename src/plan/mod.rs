//! The memory planner: predicts every device's memory for a training run before
//! it starts, says where and by how much it runs out, ranks the fixes, and fits
//! the run to the devices.
//!
//! The planner is pure (no I/O, no tensors; a plan takes well under a
//! millisecond) and models tunestudio's *own* training step on candle, not a
//! generic formula: which precision copies exist, that accumulated gradients
//! stay alive across micro-batches, that candle's autograd keeps every forward
//! tensor of the graph alive until the loss is dropped, that its backward
//! allocates a zero tensor per gradient edge and adds into it, that the loss is
//! computed in vocabulary chunks, and so on. See [`step_model`] for every term
//! and why it exists; the coefficients were measured with the counting
//! allocator of [`crate::mem`] (`tests/plan_accuracy.rs`).
//!
//! Data flow: [`PlanRequest`] → [`plan`] → [`Plan`] (per device: a breakdown by
//! kind of memory, the peak and its phase, the verdict) → [`auto_fit`] when it
//! does not fit. [`dry_run`] checks the prediction against one real step.

mod components;
mod device;
mod dry_run;
mod estimate;
mod fit;
mod gpu_catalog;
mod model_source;
pub mod placement;
mod process;
mod reference;
pub mod step_model;

pub use components::{
    Component, ComponentReport, ComponentRow, ComponentSet, RestOfPeak, StepComponents,
    StepReadings, TensorBytes, Total,
};
pub use device::{
    format_bytes, parse_bytes, parse_devices, parse_devices_with, DeviceKind, DeviceSpec,
    GemmGeometry,
};
pub use dry_run::{
    dry_run, dry_run_with_components, dry_run_with_readings, DryRunOutcome, DryRunReport,
    MeasureMethod, Meter, StepMeasured,
};
pub use estimate::{balance_layers, layer_costs, layer_ranges, plan, LayerCosts};
pub use fit::{auto_fit, relative_throughput, AutoFit};
pub use gpu_catalog::{find_gpu_model, gpu_model_by_size_text, GpuModel, GPU_CATALOG};
pub use model_source::model_config_path;
pub use process::{ProcessFootprint, ProcessInputs, ProcessTerm};
pub use reference::ReferencePlan;

use crate::model::{ModelConfig, OpsMode};
use std::fmt;
use std::ops::Range;

/// Everything that can stop a plan from being made.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// The request lists no device.
    #[error(
        "no devices to plan for: give at least one, e.g. --devices cpu:24GiB or --devices 2x80GiB"
    )]
    NoDevices,
    /// A device string could not be parsed.
    #[error("cannot read device `{spec}`: {reason} (examples: `2x80GiB`, `80GB,80GB`, `cpu:24GiB`, `cuda:0=80GiB`, `2xh100`)")]
    InvalidDevice {
        /// The text that was given.
        spec: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A byte size could not be parsed.
    #[error("cannot read the size `{text}`: {reason} (write e.g. `80GiB`, `80GB`, `512MiB`)")]
    InvalidSize {
        /// The text that was given.
        text: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A CUDA device cannot even hold the CUDA context.
    #[error("{device} has {capacity} but the CUDA context alone takes about {overhead}: that device cannot train anything (check its size; GiB vs MiB?)")]
    DeviceTooSmall {
        /// The device's name.
        device: String,
        /// Its capacity, formatted.
        capacity: String,
        /// The CUDA context estimate, formatted.
        overhead: String,
    },
    /// A setting has a value the planner cannot use.
    #[error("invalid setting {setting} = {value}: {fix}")]
    InvalidSetting {
        /// The setting's name as the run config / CLI spells it.
        setting: &'static str,
        /// The value given.
        value: String,
        /// How to fix it.
        fix: String,
    },
    /// The model config could not be read (unknown `model_type`, missing fields, ...).
    #[error(transparent)]
    Model(#[from] crate::model::ModelError),
    /// A run config could not be read.
    #[error("cannot use the run config {origin}: {message}")]
    RunConfig {
        /// The file.
        origin: String,
        /// What is wrong and how to fix it.
        message: String,
    },
}

/// Numeric precision and device strategy: the run config's own types, shared through
/// [`crate::settings`] (the planner imports nothing from the trainer).
pub use crate::settings::{Precision, Quantization, Strategy};

impl From<crate::settings::UnknownPrecision> for PlanError {
    fn from(e: crate::settings::UnknownPrecision) -> Self {
        PlanError::InvalidSetting {
            setting: "training.precision",
            value: e.0,
            fix: "use fp32, bf16-mixed, bf16 or fp16-mixed".into(),
        }
    }
}

impl From<crate::settings::UnknownStrategy> for PlanError {
    fn from(e: crate::settings::UnknownStrategy) -> Self {
        PlanError::InvalidSetting {
            setting: "devices.strategy",
            value: e.0,
            fix: "use single, layer-split or data-parallel".into(),
        }
    }
}

/// LoRA settings that matter for memory.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LoraSpec {
    /// Adapter rank.
    pub r: usize,
    /// Short names of the adapted linear layers (`q_proj`, `v_proj`, ...).
    pub target_modules: Vec<String>,
    /// How the frozen base linears are stored (QLoRA: `q8_0`, `q4_k`; see
    /// [`crate::settings::Quantization`]).
    #[serde(default)]
    pub quantize: Quantization,
}

impl LoraSpec {
    /// Rank `r` on every linear layer of the decoder (what auto-fit proposes).
    pub fn all_linear(r: usize) -> Self {
        LoraSpec {
            r,
            target_modules: crate::model::LINEAR_MODULES
                .iter()
                .map(|s| s.to_string())
                .collect(),
            quantize: Quantization::None,
        }
    }

    /// The same adapters on a base quantized as `q`.
    pub fn quantized(mut self, q: Quantization) -> Self {
        self.quantize = q;
        self
    }
}

/// What to plan: a model shape, the training settings, and the devices. Two requests are
/// equal exactly when they plan the same (the studio's "plan is stale" test).
#[derive(Debug, Clone, PartialEq)]
pub struct PlanRequest {
    /// The model's architecture (from its `config.json`).
    pub model: ModelConfig,
    /// Numeric precision.
    pub precision: Precision,
    /// Rows per forward/backward pass (per device under data parallel).
    pub micro_batch: usize,
    /// Micro-batches per optimizer step.
    pub gradient_accumulation: usize,
    /// Tokens per row (the longest batch the run will see).
    pub seq_len: usize,
    /// Recompute each layer in the backward pass instead of keeping its activations.
    pub activation_checkpointing: bool,
    /// Keep AdamW's state (and fp32 master weights) in host RAM when training on GPUs.
    pub optimizer_offload: bool,
    /// Train LoRA adapters on a frozen base instead of every weight.
    pub lora: Option<LoraSpec>,
    /// How the model is spread over `devices`.
    pub strategy: Strategy,
    /// The devices, in order (layer split puts the embeddings on the first).
    pub devices: Vec<DeviceSpec>,
    /// The training-ops path the trainer will run (`TUNESTUDIO_OPS`): under `Generic` a CPU
    /// runs the GPU's code, so the plan models graphs of ops instead of the native layers.
    pub ops: OpsMode,
    /// What the process loads besides the model (tokenizer, dataset, mapped weights, the
    /// GUI): with it the first CPU device's peak is the process's resident set
    /// ([`ProcessFootprint`]); `None` plans the training tensors only.
    pub process: Option<ProcessInputs>,
    /// The trained tokens of the data's samples, when the data has been tokenized: the loss
    /// computes logits for those rows only, on the CPU's fused op and the generic one (a dataset
    /// that trains completions has far fewer than every position). `None` plans every position of every row, the upper
    /// bound.
    pub trained_tokens: Option<TrainedTokens>,
    /// What the loss holds of the head's output: the causal-LM loss's chunks of the trained
    /// rows (SFT, the default), or the full logits of every row (preference training).
    pub head_loss: HeadLoss,
    /// A DPO run's reference: stored (nothing during the step), the base with the adapters
    /// switched off, or a frozen copy of the weights (`plan/reference.rs`).
    pub reference: ReferencePlan,
}

/// What the step's loss holds of the head's output, for the `Head` block of the plan
/// ([`step_model`]). Set by the run-config adapter from `[training] method`.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "kebab-case")]
pub enum HeadLoss {
    /// The causal-LM loss (SFT): the fused CPU op or the generic one computes the logits of
    /// the trained rows only, at most 1024 rows at a time.
    #[default]
    Chunked,
    /// Sequence log-probabilities from the full logits (preference training: DPO, IPO,
    /// ORPO; `model::preference::model_sequence_logps`): the f32 logits of every position of
    /// every row exist at once, with their log-softmax temporaries and gradients.
    /// [`PlanRequest::trained_tokens`] (counts of SFT samples) does not apply.
    FullLogits,
}

/// The trained tokens (rows the loss sees) of a tokenized dataset's samples, for the loss's
/// share of the plan ([`PlanRequest::loss_rows`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TrainedTokens {
    /// The length the samples were truncated at (`[data] max_length`).
    pub max_length: usize,
    /// Trained tokens per sample, largest first: the largest [`TrainedTokens::KEPT`].
    pub largest_first: Vec<usize>,
    /// Tokens of the longest sample (after truncation at `max_length`); 0 when unknown.
    /// The collator pads each micro-batch to its own longest row (dynamic padding), so no
    /// micro-batch of the data is longer than this, rounded up to the collator's multiple.
    #[serde(default)]
    pub longest_row_tokens: usize,
}

impl TrainedTokens {
    /// Counts kept: enough for any micro-batch the planner or the auto-fit considers (the
    /// studio's counts come capped at the same number, `data::stats::LARGEST_TRAINED_KEPT`).
    pub const KEPT: usize = 1024;

    /// The multiple the collator rounds a padded row up to (`data::CollateOptions::new`).
    pub const PAD_TO_MULTIPLE_OF: usize = 8;

    /// From every sample's trained tokens, truncated at `max_length`, and the tokens of the
    /// longest sample (0: unknown, plan `max_length`).
    pub fn from_counts(
        max_length: usize,
        longest_row_tokens: usize,
        counts: impl IntoIterator<Item = usize>,
    ) -> Self {
        let mut largest_first: Vec<usize> = counts.into_iter().collect();
        largest_first.sort_unstable_by(|a, b| b.cmp(a));
        largest_first.truncate(Self::KEPT);
        TrainedTokens {
            max_length,
            largest_first,
            longest_row_tokens,
        }
    }

    /// The padded length of the data's longest micro-batch at rows cut at `seq_len`: its
    /// longest row rounded up as the collator pads it, never above `seq_len`. `None` when the
    /// longest row is unknown or `seq_len` is longer than the samples were cut at (a longer
    /// cut keeps more of them).
    pub fn longest_batch_len(&self, seq_len: usize) -> Option<usize> {
        if self.longest_row_tokens == 0 || seq_len > self.max_length {
            return None;
        }
        let longest = self.longest_row_tokens.min(seq_len);
        Some(
            longest
                .next_multiple_of(Self::PAD_TO_MULTIPLE_OF)
                .min(seq_len),
        )
    }

    /// The most trained tokens any `micro_batch` samples hold at rows of `seq_len`, whatever
    /// the sampler's order; `None` when `seq_len` is longer than the samples were cut at (they
    /// may train more there) or a micro-batch is larger than the counts kept.
    pub fn max_per_micro_batch(&self, micro_batch: usize, seq_len: usize) -> Option<usize> {
        let truncated = self.largest_first.len() >= Self::KEPT;
        if seq_len > self.max_length || (truncated && micro_batch > self.largest_first.len()) {
            return None;
        }
        // A shorter cut trains no more tokens than it keeps.
        let cap = seq_len.saturating_sub(1);
        Some(
            self.largest_first
                .iter()
                .take(micro_batch)
                .map(|&c| c.min(cap))
                .sum(),
        )
    }
}

impl PlanRequest {
    /// Rows the loss computes logits for per micro-batch: the most trained tokens a
    /// micro-batch of the data holds ([`Self::trained_tokens`]), else every position after the
    /// first of each row; with [`HeadLoss::FullLogits`], every position of every row.
    pub fn loss_rows(&self) -> usize {
        if self.head_loss == HeadLoss::FullLogits {
            // Every position of every row, the last one included.
            return self.micro_batch * self.planned_seq_len();
        }
        let rows = self.micro_batch * self.planned_seq_len().saturating_sub(1);
        self.trained_tokens
            .as_ref()
            .and_then(|t| t.max_per_micro_batch(self.micro_batch, self.seq_len))
            .map_or(rows, |t| t.min(rows))
    }

    /// The padded length of the longest micro-batch the plan sizes activations, logits and
    /// temporaries for: the data's longest batch when the data is known
    /// ([`TrainedTokens::longest_batch_len`]: dynamic padding never pads beyond it), else
    /// `seq_len` (`[data] max_length`, the bound).
    pub fn planned_seq_len(&self) -> usize {
        // A preference run's counts carry its longest pair (prompt + the longer completion,
        // `train::samples::trained_tokens`), which its collator pads to as the SFT one does.
        self.trained_tokens
            .as_ref()
            .and_then(|t| t.longest_batch_len(self.seq_len))
            .unwrap_or(self.seq_len)
    }

    /// Whether the plan is sized by the data's longest batch, shorter than `seq_len`.
    pub fn planned_for_the_data(&self) -> bool {
        self.planned_seq_len() < self.seq_len
    }

    /// Rows per optimizer step: micro-batch × accumulation × data-parallel ranks.
    pub fn effective_batch(&self) -> usize {
        self.micro_batch * self.gradient_accumulation * self.data_parallel_ranks()
    }

    /// Replicas that each process a micro-batch (1 unless data parallel).
    pub fn data_parallel_ranks(&self) -> usize {
        match self.strategy {
            Strategy::DataParallel => self.devices.len().max(1),
            _ => 1,
        }
    }

    /// The devices this strategy actually uses (single uses the first only).
    pub fn used_devices(&self) -> &[DeviceSpec] {
        match self.strategy {
            Strategy::Single => &self.devices[..self.devices.len().min(1)],
            _ => &self.devices,
        }
    }

    /// The request of the planner's dry run of this run: one training step, no evaluation.
    /// The dry run does not evaluate, so the evaluation's heap is left out of its prediction,
    /// and one step leaves no allocator retention from other batch shapes.
    pub fn for_dry_run(&self) -> PlanRequest {
        let mut req = self.clone();
        if let Some(p) = req.process.as_mut() {
            p.evaluation = false;
            p.single_step = true;
        }
        req
    }

    /// A one-line description of the settings ("fp32, micro-batch 1 × 4, seq 512, ...").
    pub fn settings_summary(&self) -> String {
        let mut s = format!(
            "{}, micro-batch {} × accumulation {}, seq {}, {}",
            self.precision,
            self.micro_batch,
            self.gradient_accumulation,
            self.seq_len,
            self.strategy
        );
        if self.planned_for_the_data() {
            s.push_str(&format!(
                ", planned for the longest batch of this data: {} × {} tokens",
                self.micro_batch,
                self.planned_seq_len()
            ));
        }
        if self.head_loss == HeadLoss::FullLogits {
            s.push_str(", loss on full logits (preference pairs)");
        }
        match self.reference {
            ReferencePlan::Stored => {}
            ReferencePlan::AdapterDisabled => {
                s.push_str(", reference forward with the adapters disabled")
            }
            ReferencePlan::Copy => s.push_str(", frozen reference copy of the weights"),
        }
        if self.activation_checkpointing {
            s.push_str(", checkpointing");
        }
        if self.optimizer_offload {
            s.push_str(", optimizer state in host RAM");
        }
        if let Some(l) = &self.lora {
            s.push_str(&format!(
                ", LoRA r={} on {}",
                l.r,
                l.target_modules.join("/")
            ));
            if l.quantize.is_on() {
                s.push_str(&format!(", base quantized {}", l.quantize));
            }
        }
        s
    }
}

/// A moment of the training step, in time order, whose memory the planner predicts. (Where a
/// run *failed* — setup, evaluation and checkpoints included — is the trainer's `Phase`, in
/// `train/error.rs`.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub enum StepPhase {
    /// The forward pass and the loss (the autograd graph grows).
    Forward,
    /// The backward pass (graph alive, gradients being produced).
    Backward,
    /// The AdamW update (activations freed, gradients + moments alive).
    OptimizerStep,
}

impl fmt::Display for StepPhase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            StepPhase::Forward => "forward",
            StepPhase::Backward => "backward",
            StepPhase::OptimizerStep => "optimizer step",
        })
    }
}

/// The moment of a run at which a device's memory peaks: a phase of the training step or,
/// when the peak is the process's resident set ([`ProcessFootprint`]), the evaluation or the
/// loading of the weights when that moment is the process's largest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub enum PeakMoment {
    /// A phase of the training step.
    Step(StepPhase),
    /// The evaluation on the validation split (`CausalLm::eval_loss`).
    Evaluation,
    /// The loading of the weights (mapped files and the loaded tensors at once).
    Loading,
    /// The resume from a checkpoint ([`DevicePlan::resume_peak_bytes`]).
    Resume,
}

impl fmt::Display for PeakMoment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PeakMoment::Step(phase) => phase.fmt(f),
            PeakMoment::Evaluation => f.write_str("evaluation"),
            PeakMoment::Loading => f.write_str("loading of the weights"),
            PeakMoment::Resume => f.write_str("resume from a checkpoint"),
        }
    }
}

/// Bytes in use on one device at one phase's high-water mark.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct PhaseBytes {
    /// The phase.
    pub phase: StepPhase,
    /// Its peak bytes.
    pub bytes: u64,
}

/// One device's share of the run. The component fields are what is alive at the
/// device's peak, so they add up to `peak_bytes`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DevicePlan {
    /// The device.
    pub device: DeviceSpec,
    /// Decoder layers on this device (empty when it holds none).
    pub layers: Range<usize>,
    /// Whether the token embeddings live here (first device).
    pub holds_embeddings: bool,
    /// Whether the final norm, `lm_head` and the loss live here (last device).
    pub holds_head: bool,
    /// Compute copy of the weights (trainable and frozen).
    pub weights_bytes: u64,
    /// f32 master copy of the trainable weights (mixed precision only).
    pub master_weights_bytes: u64,
    /// Gradients alive at the peak (incl. the accumulation buffer).
    pub gradients_bytes: u64,
    /// AdamW first and second moments (f32).
    pub optimizer_states_bytes: u64,
    /// Forward tensors kept by the autograd graph for backward.
    pub activations_bytes: u64,
    /// The f32 logits chunk, its softmax pieces and the per-row logsumexp.
    pub logits_and_loss_bytes: u64,
    /// Short-lived buffers at the peak (backward's zero-then-add, copies, optimizer scratch).
    pub temporaries_bytes: u64,
    /// Runtime overhead (≈ 500 MiB CUDA context per CUDA device; 0 on CPU).
    pub overhead_bytes: u64,
    /// The predicted high-water mark (on the first CPU device of a request with
    /// [`PlanRequest::process`], the process's peak resident set).
    pub peak_bytes: u64,
    /// The training step's tensors at their peak (the components above plus the overhead):
    /// `peak_bytes` without the process terms.
    pub training_tensors_bytes: u64,
    /// The high-water mark while a resume (or an out-of-memory refit) loads a checkpoint
    /// onto this device: the overhead, the weights and the optimizer's state (allocated before
    /// the load) plus [`DevicePlan::resume_transient_bytes`]. `peak_bytes` covers it.
    pub resume_peak_bytes: u64,
    /// The resume's transient: the largest trainable tensor held here, in its dtype, on its
    /// way from the file into its parameter (the loader reads one tensor at a time, and each
    /// parameter's optimizer state is freed before its saved one is read).
    pub resume_transient_bytes: u64,
    /// The process's resident set, term by term (first CPU device, with
    /// [`PlanRequest::process`]).
    pub process: Option<ProcessFootprint>,
    /// The phase in which the peak occurs.
    pub peak_phase: StepPhase,
    /// The step's full-size components (weights, optimizer state, gradients, activations,
    /// logits/loss) for the per-component report ([`DevicePlan::predicted_components`]).
    pub components: StepComponents,
    /// Each phase's high-water mark, in time order.
    pub phases: Vec<PhaseBytes>,
    /// The first phase (in time order) whose need exceeds the capacity, if any.
    pub first_oom_phase: Option<StepPhase>,
    /// Peak ≤ capacity.
    pub fits: bool,
    /// Capacity − peak (0 when it does not fit).
    pub headroom_bytes: u64,
    /// Peak − capacity (0 when it fits).
    pub shortfall_bytes: u64,
}

impl DevicePlan {
    /// Headroom as a fraction of the capacity (negative when short).
    pub fn headroom_fraction(&self) -> f64 {
        let cap = self.device.capacity_bytes.max(1) as f64;
        (self.device.capacity_bytes as f64 - self.peak_bytes as f64) / cap
    }

    /// The moment `peak_bytes` belongs to: the resume when its figure is the largest, the
    /// process's largest moment when the peak is the process's resident set (the evaluation
    /// or the loading can be larger than the step), else the step's phase
    /// ([`DevicePlan::peak_phase`]).
    pub fn peak_moment(&self) -> PeakMoment {
        let others = self
            .process
            .as_ref()
            .map_or(self.training_tensors_bytes, |p| p.peak_bytes);
        if self.resume_peak_bytes > others {
            return PeakMoment::Resume;
        }
        match self.process.as_ref().map(|p| p.largest_moment) {
            Some(process::EVALUATION) => PeakMoment::Evaluation,
            Some(process::LOADING) => PeakMoment::Loading,
            _ => PeakMoment::Step(self.peak_phase),
        }
    }
}

/// Memory of one block of the model (embeddings, a decoder layer, or norm + head),
/// independent of the device it lands on. Used to balance a layer split.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct LayerMemory {
    /// "embeddings", "layer 7", "norm + lm_head".
    pub name: String,
    /// Parameters in the block.
    pub parameters: u64,
    /// Compute copy of the weights.
    pub weights_bytes: u64,
    /// f32 master weights.
    pub master_weights_bytes: u64,
    /// Gradients (×2 with gradient accumulation: accumulated + current).
    pub gradients_bytes: u64,
    /// AdamW moments.
    pub optimizer_states_bytes: u64,
    /// Forward tensors kept for backward.
    pub activations_bytes: u64,
}

impl LayerMemory {
    /// Everything the block holds at the end of backward.
    pub fn total_bytes(&self) -> u64 {
        self.weights_bytes
            + self.master_weights_bytes
            + self.gradients_bytes
            + self.optimizer_states_bytes
            + self.activations_bytes
    }
}

/// The overall answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Verdict {
    /// Every device fits with at least 5 % headroom.
    Fits,
    /// Every device fits, but one has less than 5 % headroom (fragmentation may tip it over).
    Tight,
    /// At least one device runs out of memory.
    OutOfMemory,
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Verdict::Fits => "fits",
            Verdict::Tight => "fits (tight)",
            Verdict::OutOfMemory => "out of memory",
        })
    }
}

/// One change of settings.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub enum Change {
    /// Switch the device strategy.
    Strategy(Strategy),
    /// Switch the precision.
    Precision(Precision),
    /// Turn activation checkpointing on.
    ActivationCheckpointing,
    /// Smaller micro-batch with more accumulation (same effective batch).
    MicroBatch {
        /// New micro-batch.
        micro_batch: usize,
        /// New accumulation.
        gradient_accumulation: usize,
    },
    /// Train LoRA adapters instead of every weight.
    Lora(LoraSpec),
    /// Shorter sequences (changes what is trained: never chosen by auto-fit).
    SeqLen(usize),
    /// Keep the optimizer's state in host RAM (GPU runs).
    OptimizerOffload,
    /// Quantize the frozen base (QLoRA); turns LoRA on (rank 16 on every linear) when it is off.
    Quantize(Quantization),
}

impl Change {
    /// Applies the change to a request. Strategy changes that alter the number of
    /// data-parallel ranks re-split accumulation so the effective batch stays the same
    /// when it divides.
    pub fn apply(&self, req: &PlanRequest) -> PlanRequest {
        let mut r = req.clone();
        match self {
            Change::Strategy(s) => {
                let effective = req.effective_batch();
                r.strategy = *s;
                let ranks = r.data_parallel_ranks();
                if effective.is_multiple_of(ranks * r.micro_batch) {
                    r.gradient_accumulation = effective / (ranks * r.micro_batch);
                }
            }
            Change::Precision(p) => r.precision = *p,
            Change::ActivationCheckpointing => r.activation_checkpointing = true,
            Change::MicroBatch {
                micro_batch,
                gradient_accumulation,
            } => {
                r.micro_batch = *micro_batch;
                r.gradient_accumulation = *gradient_accumulation;
            }
            Change::Lora(l) => r.lora = Some(l.clone()),
            Change::SeqLen(t) => r.seq_len = *t,
            Change::OptimizerOffload => r.optimizer_offload = true,
            Change::Quantize(q) => {
                let lora = r
                    .lora
                    .take()
                    .unwrap_or_else(|| LoraSpec::all_linear(fit::AUTO_LORA_RANK));
                r.lora = Some(lora.quantized(*q));
            }
        }
        r
    }

    /// The change in words ("bf16 mixed precision", "layer split over 2 GPUs").
    pub fn describe(&self, req: &PlanRequest) -> String {
        match self {
            Change::Strategy(Strategy::LayerSplit) => {
                format!("split the layers over the {} devices", req.devices.len())
            }
            Change::Strategy(Strategy::DataParallel) => {
                let r = self.apply(req);
                format!(
                    "data parallel on {} devices (accumulation {} → {})",
                    req.devices.len(),
                    req.gradient_accumulation,
                    r.gradient_accumulation
                )
            }
            Change::Strategy(Strategy::Single) => "train on a single device".into(),
            Change::Precision(p) => match p {
                Precision::Bf16Mixed => "bf16 mixed precision".into(),
                Precision::Fp16Mixed => "fp16 mixed precision".into(),
                Precision::Bf16 => "pure bf16 (no f32 master weights)".into(),
                Precision::Fp32 => "fp32".into(),
            },
            Change::ActivationCheckpointing => "activation checkpointing".into(),
            Change::MicroBatch {
                micro_batch,
                gradient_accumulation,
            } => format!(
                "micro-batch {} × accumulation {} (was {} × {})",
                micro_batch, gradient_accumulation, req.micro_batch, req.gradient_accumulation
            ),
            Change::Lora(l) if l.quantize.is_on() => format!(
                "QLoRA r={} on {} (base frozen, quantized {})",
                l.r,
                l.target_modules.join(", "),
                l.quantize
            ),
            Change::Lora(l) => format!(
                "LoRA r={} on {} (base frozen)",
                l.r,
                l.target_modules.join(", ")
            ),
            Change::Quantize(q) => {
                let bits = match q {
                    Quantization::Q4K => "QLoRA 4-bit",
                    Quantization::Q8_0 => "QLoRA 8-bit",
                    Quantization::None => "dense base",
                };
                match &req.lora {
                    Some(l) => format!("{bits} (base linears as {q}, LoRA r={} kept)", l.r),
                    None => format!(
                        "{bits} (base linears as {q}, LoRA r={} on every linear)",
                        fit::AUTO_LORA_RANK
                    ),
                }
            }
            Change::SeqLen(t) => format!("sequence length {} (was {})", t, req.seq_len),
            Change::OptimizerOffload => {
                "optimizer state in host RAM (training.optimizer_offload = \"host\")".into()
            }
        }
    }
}

/// A ranked suggestion for a plan that does not fit.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Fix {
    /// The fix in words, with its saving ("bf16 mixed precision: −4.1 GiB on GPU 0").
    pub description: String,
    /// Bytes saved on the device that is shortest of memory.
    pub saving_bytes: u64,
    /// Whether this change alone makes every device fit.
    pub fits_alone: bool,
    /// Relative throughput of the run after the change (1.0 = as requested).
    pub relative_throughput: f64,
    /// The change itself (apply it with [`Change::apply`]).
    pub change: Change,
}

/// The planner's answer for one request.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Plan {
    /// One entry per device the strategy uses, in order.
    pub per_device: Vec<DevicePlan>,
    /// Overall verdict.
    pub verdict: Verdict,
    /// The verdict in words, naming the device, the phase and the shortfall.
    pub summary: String,
    /// Ranked fixes (empty when it fits): those that fit alone first, fastest first.
    pub fixes: Vec<Fix>,
    /// Memory per block of the model (embeddings, each layer, head).
    pub per_layer: Vec<LayerMemory>,
    /// Total parameters and trainable parameters.
    pub parameters: u64,
    /// Parameters the optimizer updates.
    pub trainable_parameters: u64,
    /// Rows per optimizer step.
    pub effective_batch: usize,
    /// The settings planned, in words.
    pub settings: String,
    /// Optimizer state and master weights kept in host RAM (optimizer offload on GPUs).
    pub host_offload_bytes: u64,
}

impl Plan {
    /// Whether every device fits.
    pub fn fits(&self) -> bool {
        self.per_device.iter().all(|d| d.fits)
    }

    /// The resume peak of the plan's CPU devices together: logical CPU devices
    /// (`cpu:0,cpu:1`) share the host's memory and load the checkpoint one tensor at a time,
    /// so their resume figures add up but for one transient (the largest). 0 without CPU
    /// devices. The training tensors only, as [`DevicePlan::resume_peak_bytes`].
    pub fn cpu_resume_peak_bytes(&self) -> u64 {
        let cpus = self
            .per_device
            .iter()
            .filter(|d| d.device.kind == DeviceKind::Cpu);
        let steady: u64 = cpus
            .clone()
            .map(|d| d.resume_peak_bytes - d.resume_transient_bytes)
            .sum();
        let transient = cpus.map(|d| d.resume_transient_bytes).max().unwrap_or(0);
        steady + transient
    }

    /// The device with the least headroom (largest shortfall).
    pub fn worst_device(&self) -> Option<&DevicePlan> {
        self.per_device.iter().min_by(|a, b| {
            a.headroom_fraction()
                .partial_cmp(&b.headroom_fraction())
                .unwrap_or(std::cmp::Ordering::Equal)
        })
    }
}
