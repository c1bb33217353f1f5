//! Messages between the trainer thread and its front end (GUI or CLI).
//! Events are serde-serialisable: the same objects are the lines of `metrics.jsonl`.
//! Front ends turn them into state or text through [`EventRenderer`](crate::train::EventRenderer): a new
//! kind of event is added there (the trait's doc says how).

use serde::{Deserialize, Serialize};
use std::path::PathBuf;

use super::error::Phase;

/// Serialises non-finite floats as `null` (JSON has no NaN/inf) and reads `null` back as NaN,
/// so a skipped fp16 step or a diverged loss still round-trips through `metrics.jsonl`.
pub mod float_or_null {
    use serde::{Deserialize, Deserializer, Serializer};

    /// Writes `v`, or `null` when it is not finite.
    pub fn serialize<S: Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
        if v.is_finite() {
            s.serialize_f64(*v)
        } else {
            s.serialize_none()
        }
    }

    /// Reads a number, or NaN for `null`.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
    }
}

/// A data lint as events carry it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LintFinding {
    /// Its name (`labels-mismatch`), the one `[data] allow` and `--allow-lint` take.
    pub lint: String,
    /// Rows affected.
    pub count: usize,
    /// Up to 5 example rows.
    pub examples: Vec<usize>,
    /// What is wrong and the fix.
    pub message: String,
}

impl From<&crate::data::lints::Lint> for LintFinding {
    fn from(l: &crate::data::lints::Lint) -> Self {
        LintFinding {
            lint: l.kind.id().to_string(),
            count: l.count,
            examples: l.examples.clone(),
            message: l.message.clone(),
        }
    }
}

/// Whose memory a [`Event::Memory`] reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MemoryScope {
    /// This process (CPU: its resident set or counted heap; GPU: what NVML attributes to it).
    #[default]
    Process,
    /// Everything on the device (NVML's used memory, as `nvidia-smi` shows it).
    Device,
}

fn one() -> usize {
    1
}

fn rows_unit() -> String {
    "rows".into()
}

/// What the front end asks the trainer thread to do.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Command {
    /// Load everything and start training (the thread waits for this).
    Start,
    /// Stop after the current step; no step events until `Resume`.
    Pause,
    /// Continue after `Pause`.
    Resume,
    /// End the run after the current step (no checkpoint; send `SaveNow` first to keep one).
    Stop,
    /// Write a checkpoint after the current step.
    SaveNow,
}

/// Why a run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// All steps done.
    Completed,
    /// The user stopped it.
    Stopped,
    /// An error ended it (see the preceding `Error` event).
    Failed,
    /// The loss diverged and `[training] on_divergence = "stop"` ended it (see the
    /// preceding `Divergence` event).
    Diverged,
}

/// A prompt's group of sampled completions as the front ends show it ([`Event::Completions`]):
/// texts cut at [`SampledGroup::TEXT_CHARS`] characters so `metrics.jsonl` stays small.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SampledGroup {
    /// The prompt's dataset row.
    pub row: usize,
    /// The prompt as the model saw it (its end, when cut).
    pub prompt: String,
    /// The reward functions' names.
    pub reward_names: Vec<String>,
    /// The completions, in generation order.
    pub completions: Vec<SampledText>,
}

impl SampledGroup {
    /// Characters kept of a prompt or a completion.
    pub const TEXT_CHARS: usize = 400;
}

/// One completion of a [`SampledGroup`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SampledText {
    /// The completion's text (its start, when cut).
    pub text: String,
    /// Each reward function's value.
    pub rewards: Vec<f32>,
    /// The weighted sum.
    pub reward: f32,
    /// Its advantage over its group.
    pub advantage: f32,
    /// It hit `max_completion_length` without an EOS.
    pub truncated: bool,
}

/// What the trainer thread reports, in order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    /// Setup progress (loading the model, tokenising the data...).
    Status {
        /// What is happening, for a status line.
        message: String,
    },
    /// Training begins (or continues from a checkpoint).
    Started {
        /// Optimizer steps of the whole run.
        total_steps: u64,
        /// Steps already done (non-zero when resumed).
        start_step: u64,
        /// Checkpoint resumed from, if any.
        resumed_from: Option<PathBuf>,
        /// Parameters of the model.
        num_parameters: u64,
        /// Parameters being trained.
        trainable_parameters: u64,
        /// Rows in the training split.
        train_rows: usize,
        /// Rows in the validation split.
        eval_rows: usize,
        /// The output folder.
        output_dir: PathBuf,
        /// Samples per optimizer step: micro-batch × gradient accumulation × data-parallel
        /// ranks, in `batch_unit`.
        #[serde(default)]
        effective_batch: usize,
        /// What `micro_batch` and `effective_batch` count: `rows` (SFT), `pairs` (DPO, ORPO)
        /// or `prompts` (GRPO).
        #[serde(default = "rows_unit")]
        batch_unit: String,
        /// Data-parallel ranks (1 unless `strategy = "data-parallel"`).
        #[serde(default = "one")]
        ranks: usize,
        /// The decoder layers each device holds (under a layer split, the planner's ranges).
        #[serde(default)]
        placement: Vec<super::placement::DeviceLayers>,
    },
    /// One optimizer step finished.
    Step {
        /// 1-based optimizer step.
        step: u64,
        /// Mean token loss over the step's accumulated micro-batches.
        #[serde(with = "float_or_null")]
        loss: f64,
        /// Learning rate used.
        lr: f64,
        /// Global gradient norm before clipping (token-normalised); NaN when skipped.
        #[serde(with = "float_or_null")]
        grad_norm: f64,
        /// Trained (label) tokens per second in this step.
        #[serde(with = "float_or_null")]
        tokens_per_sec: f64,
        /// Label tokens trained so far.
        trained_tokens: u64,
        /// Seconds of training so far (excluding pauses and setup).
        elapsed_secs: f64,
        /// Fractional epoch reached.
        epoch: f64,
        /// fp16: the update was skipped because the gradients overflowed.
        #[serde(default)]
        skipped: bool,
        /// fp16: the loss scale after this step.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        loss_scale: Option<f64>,
        /// Preference training: TRL's metrics of the step by their names (`rewards/chosen`,
        /// `rewards/rejected`, `rewards/accuracies`, `rewards/margins`, `logps/chosen`,
        /// `logps/rejected`; ORPO's `nll_loss`, `log_odds_ratio`, `log_odds_chosen`).
        #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
        metrics: std::collections::BTreeMap<String, f64>,
    },
    /// Evaluation on the validation split.
    Eval {
        /// The optimizer step it followed.
        step: u64,
        /// Mean token loss.
        #[serde(with = "float_or_null")]
        loss: f64,
        /// exp(loss).
        #[serde(with = "float_or_null")]
        perplexity: f64,
        /// Tokens evaluated.
        tokens: u64,
    },
    /// A memory sample.
    Memory {
        /// Device name (`cpu`, `cuda:0`).
        device: String,
        /// Bytes in use now.
        used_bytes: u64,
        /// Peak bytes so far.
        peak_bytes: u64,
        /// Capacity of the device, when known.
        total_bytes: Option<u64>,
        /// Step when sampled.
        step: u64,
        /// Whose memory the figures are: this process's, or the whole device's (a GPU whose
        /// driver does not attribute memory to processes, e.g. inside some containers).
        #[serde(default)]
        scope: MemoryScope,
    },
    /// A checkpoint was written.
    CheckpointSaved {
        /// Step it holds.
        step: u64,
        /// Its folder.
        path: PathBuf,
    },
    /// Training is paused.
    Paused {
        /// Steps done.
        step: u64,
    },
    /// Training continues.
    Resumed {
        /// Steps done.
        step: u64,
    },
    /// The loss jumped well above its recent level after the warm-up (or is not finite).
    Divergence {
        /// The step whose loss spiked.
        step: u64,
        /// Its loss.
        loss: f64,
        /// The median of the recent losses.
        median_loss: f64,
        /// A tenth of the step's learning rate: what to resume with.
        suggested_learning_rate: f64,
        /// Whether the run stops here (`on_divergence = "stop"`).
        stopped: bool,
    },
    /// Something worth knowing that does not stop training.
    Warning {
        /// The message.
        message: String,
    },
    /// Something stopped training. The thread still answers commands until `Finished`.
    Error {
        /// What happened.
        message: String,
        /// What to do about it.
        hint: String,
        /// The phase, when it happened inside a step.
        phase: Option<Phase>,
        /// The step, when known.
        step: Option<u64>,
    },
    /// Training was refused because the data has error-level lints no `[data] allow` names
    /// (the `error` event follows). Nothing was loaded beyond the tokenizer and the data.
    LintsBlocked {
        /// The blocking findings.
        lints: Vec<LintFinding>,
    },
    /// An error-level lint the run trains despite, because `[data] allow` names it.
    LintAllowed {
        /// The finding.
        lint: LintFinding,
    },
    /// A step ran out of memory: the run stops with a checkpoint of the last good step (the
    /// `error` event follows). `refit` is what resuming with fitted settings would change.
    OutOfMemory {
        /// The step that failed.
        step: u64,
        /// Where in the step.
        phase: Phase,
        /// The device (`[devices]` entry) that ran out.
        device: String,
        /// What the memory plan gave that device (its peak).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        planned_bytes: Option<u64>,
        /// The most it was seen to hold (the memory sampler's peak for it).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        observed_bytes: Option<u64>,
        /// The allocation failure's error value (CUDA driver, cuBLAS, NCCL, the OS).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        failure: Option<crate::mem::alloc_failure::AllocationFailure>,
        /// The checkpoint of the last good step, to resume from.
        checkpoint: Option<PathBuf>,
        /// Settings that fit what the device held (same effective batch), in words; empty
        /// with `refit_error` when none keeps the checkpoint resumable.
        refit: Vec<String>,
        /// Why no resumable refit exists.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        refit_error: Option<String>,
    },
    /// GRPO: one prompt's group of the step just taken, as sampled and scored (the first
    /// prompt of the step), for a front end to show beside the reward chart.
    Completions {
        /// The step.
        step: u64,
        /// The prompt and its completions.
        group: SampledGroup,
    },
    /// The run is over; the thread ends after this.
    Finished {
        /// Why.
        reason: FinishReason,
        /// Steps done.
        step: u64,
        /// Loss of the last step.
        final_loss: Option<f64>,
        /// Last evaluation loss.
        final_eval_loss: Option<f64>,
        /// Seconds of training.
        elapsed_secs: f64,
        /// The last checkpoint written, if any.
        last_checkpoint: Option<PathBuf>,
    },
}

impl Event {
    /// A short name of the variant (`step`, `eval`, ...), for logs and tests.
    pub fn kind(&self) -> &'static str {
        match self {
            Event::Status { .. } => "status",
            Event::Started { .. } => "started",
            Event::Step { .. } => "step",
            Event::Eval { .. } => "eval",
            Event::Memory { .. } => "memory",
            Event::CheckpointSaved { .. } => "checkpoint_saved",
            Event::Paused { .. } => "paused",
            Event::Resumed { .. } => "resumed",
            Event::Divergence { .. } => "divergence",
            Event::Warning { .. } => "warning",
            Event::Error { .. } => "error",
            Event::LintsBlocked { .. } => "lints_blocked",
            Event::OutOfMemory { .. } => "out_of_memory",
            Event::LintAllowed { .. } => "lint_allowed",
            Event::Completions { .. } => "completions",
            Event::Finished { .. } => "finished",
        }
    }
}
