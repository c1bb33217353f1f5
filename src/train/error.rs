//! Errors of the trainer. Every message names the setting or file involved and what to do.

use std::path::PathBuf;

/// One problem with one field of a run config.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ConfigProblem {
    /// Dotted field name, e.g. `training.gradient_accumulation`.
    pub field: String,
    /// What is wrong and what is allowed.
    pub message: String,
}

impl ConfigProblem {
    /// A problem with `field`.
    pub fn new(field: &str, message: impl Into<String>) -> Self {
        ConfigProblem {
            field: field.to_string(),
            message: message.into(),
        }
    }
}

impl std::fmt::Display for ConfigProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

fn list(problems: &[ConfigProblem]) -> String {
    problems
        .iter()
        .map(|p| format!("\n  - {p}"))
        .collect::<String>()
}

/// Reading, parsing, validating or writing a run config failed.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read the run config `{path}`: {cause}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        cause: std::io::Error,
    },
    /// The file is not valid TOML.
    #[error("the run config {origin} is not valid TOML:\n{message}")]
    Syntax {
        /// The file (or `<text>`).
        origin: String,
        /// The parser's message with line and column.
        message: String,
    },
    /// Fields have wrong types or values; all of them are listed.
    #[error("the run config {origin} has {} problem(s); fix these settings:{}", problems.len(), list(problems))]
    Invalid {
        /// The file (or `<text>`).
        origin: String,
        /// Every problem found.
        problems: Vec<ConfigProblem>,
    },
    /// Writing failed.
    #[error("cannot write the run config `{path}`: {cause}")]
    Write {
        /// The file.
        path: PathBuf,
        /// The cause.
        cause: std::io::Error,
    },
    /// The config could not be turned into TOML.
    #[error("cannot serialise the run config: {0}")]
    Serialize(String),
}

impl ConfigError {
    /// The field problems, when this is a validation error.
    pub fn problems(&self) -> &[ConfigProblem] {
        match self {
            ConfigError::Invalid { problems, .. } => problems,
            _ => &[],
        }
    }
}

/// The phase of a training run in which something failed (the planner's
/// [`crate::plan::StepPhase`] is a different thing: the moments of a step whose memory it
/// predicts).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Loading the model, tokenizer or data.
    Setup,
    /// The forward pass and loss.
    Forward,
    /// The backward pass.
    Backward,
    /// The optimizer update.
    Optimizer,
    /// Evaluation.
    Eval,
    /// Writing or reading a checkpoint.
    Checkpoint,
}

impl std::fmt::Display for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = match self {
            Phase::Setup => "setup",
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::Optimizer => "optimizer",
            Phase::Eval => "evaluation",
            Phase::Checkpoint => "checkpoint",
        };
        f.write_str(s)
    }
}

/// Anything that can stop a training run.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// The run config is unusable.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A GGUF export failed (the message names the file and the fix).
    #[error(transparent)]
    Gguf(Box<crate::gguf::GgufError>),
    /// Loading or running the model failed outside a step.
    #[error("{context}: {cause}")]
    Model {
        /// What was being done.
        context: String,
        /// The model's error.
        cause: crate::model::ModelError,
    },
    /// The dataset could not be read or prepared.
    #[error("{context}: {message}")]
    Data {
        /// What was being done.
        context: String,
        /// The data module's message.
        message: String,
    },
    /// The tokenizer has ids the model has no embedding rows for.
    #[error("the tokenizer `{tokenizer}` has {tokenizer_vocab} tokens but the model `{model_config}` has only {model_vocab} embedding rows (vocab_size); use the tokenizer that belongs to the model, or a model whose vocab_size is at least {tokenizer_vocab}")]
    VocabMismatch {
        /// The tokenizer file.
        tokenizer: PathBuf,
        /// Its vocabulary size (largest id + 1).
        tokenizer_vocab: usize,
        /// The model's config.json.
        model_config: PathBuf,
        /// The model's embedding rows.
        model_vocab: usize,
    },
    /// The training split is empty after filtering.
    #[error("the training split has no usable rows ({0}); check `[data]` (path, format, max_length) in the run config")]
    EmptyDataset(String),
    /// A step failed; the message names the phase, step, batch shape and what to change.
    #[error("{phase} of step {step} failed (batch {batch_rows}×{batch_tokens} tokens): {message}\nhint: {hint}")]
    Step {
        /// Where it failed.
        phase: Phase,
        /// The optimizer step (1-based).
        step: u64,
        /// Rows in the micro-batch.
        batch_rows: usize,
        /// Padded length of the micro-batch.
        batch_tokens: usize,
        /// The underlying message.
        message: String,
        /// What to change.
        hint: String,
        /// The allocation failure the error's value reports (`None`: not out of memory).
        allocation_failure: Option<crate::mem::alloc_failure::AllocationFailure>,
        /// The device (`[devices]` position) that failed, when the step knows it (the rank
        /// under data parallel).
        device: Option<usize>,
    },
    /// The loss became NaN or infinite.
    #[error("the loss became {value} at step {step}; training stopped so the weights are not destroyed.\nhint: {hint}")]
    NonFiniteLoss {
        /// The step (1-based).
        step: u64,
        /// `NaN` or `inf`.
        value: String,
        /// What to change.
        hint: String,
    },
    /// Reading or writing a checkpoint failed.
    #[error("checkpoint `{path}`: {message}")]
    Checkpoint {
        /// The checkpoint folder.
        path: PathBuf,
        /// What went wrong and what to do.
        message: String,
    },
    /// Writing metrics or other output failed.
    #[error("cannot access `{path}`: {cause}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        cause: std::io::Error,
    },
    /// No device matches a `[devices]` entry.
    #[error("device `{device}` is not available: {message}; set `[devices] devices = [\"cpu\"]` or build with the matching feature")]
    Device {
        /// The config entry.
        device: String,
        /// Why.
        message: String,
    },
    /// The data has error-level lints the config does not allow; nothing was loaded.
    #[error("training was not started: the data or the settings have {} error-level finding(s):{}", lints.len(), lint_list(lints))]
    Lints {
        /// The blocking lints.
        lints: Vec<crate::data::lints::Lint>,
    },
    /// The model could not be placed on the run's devices (the planner's layer split failed).
    #[error("cannot place the model on `[devices] devices`: {message}")]
    Placement {
        /// Why.
        message: String,
    },
    /// The step code panicked (a bug); the trainer thread survives.
    /// A GRPO reward function failed (a command that crashed, printed something other than one
    /// number per completion, or timed out; an accuracy reward without its answer column).
    #[error("step {step}: {cause}")]
    Reward {
        /// The step whose completions were being scored (0: while starting the functions).
        step: u64,
        /// What failed, naming the function (boxed: it carries the offending line and the
        /// stderr tail, and every `Result<_, TrainError>` would otherwise be that large).
        #[source]
        cause: Box<crate::train::grpo_rewards::RewardError>,
    },
    /// Sampling a GRPO step's completions failed.
    #[error("step {step}: {context}: {cause}")]
    Rollout {
        /// The step.
        step: u64,
        /// What was being sampled.
        context: String,
        /// The generation error (boxed, as the reward's).
        #[source]
        cause: Box<crate::infer::InferError>,
    },
    #[error("internal error during step {step}: {message}; please report it. The run can be resumed from the last checkpoint")]
    Panic {
        /// The step.
        step: u64,
        /// The panic payload.
        message: String,
    },
}

fn lint_list(lints: &[crate::data::lints::Lint]) -> String {
    lints
        .iter()
        .map(|l| {
            let rows: Vec<String> = l.examples.iter().map(usize::to_string).collect();
            if rows.is_empty() {
                // A finding about the settings, not about rows.
                format!("\n  - {}: {}", l.kind.id(), l.message)
            } else {
                format!(
                    "\n  - {} ({} rows; e.g. rows {}): {}",
                    l.kind.id(),
                    l.count,
                    rows.join(", "),
                    l.message
                )
            }
        })
        .collect()
}

impl From<crate::gguf::GgufError> for TrainError {
    fn from(e: crate::gguf::GgufError) -> Self {
        // Boxed: every training result carries this type; the GGUF error is large.
        TrainError::Gguf(Box::new(e))
    }
}

impl TrainError {
    /// A short suggestion of what to do, for the GUI's error banner.
    pub fn hint(&self) -> String {
        match self {
            TrainError::Config(_) => "fix the listed settings and start again".into(),
            TrainError::Gguf(_) => {
                "the message names the file or setting; a Hugging Face export (--kind full) works for every model".into()
            }
            TrainError::Model { .. } => {
                "check `[model] source` (a folder with config.json and *.safetensors, or a hub id)"
                    .into()
            }
            TrainError::Data { .. } | TrainError::EmptyDataset(_) => {
                "check the `[data]` settings; `tunestudio preview` shows what the trainer sees".into()
            }
            TrainError::VocabMismatch { .. } => {
                "use the tokenizer shipped with the model".into()
            }
            TrainError::Step { hint, .. } | TrainError::NonFiniteLoss { hint, .. } => hint.clone(),
            TrainError::Checkpoint { .. } => {
                "resume from another checkpoint (an older `checkpoint-<step>` folder) or start fresh"
                    .into()
            }
            TrainError::Io { .. } => "choose an output_dir you can write to with free space".into(),
            TrainError::Device { .. } => "train on `cpu`".into(),
            TrainError::Lints { lints } => {
                let names: Vec<String> = lints.iter().map(|l| format!("\"{}\"", l.kind.id())).collect();
                format!(
                    "fix the data (`tunestudio preview` shows the rows) or the setting named; to train anyway, allow each by name: [data] allow = [{}] in the run config, or --allow-lint {}",
                    names.join(", "),
                    lints.iter().map(|l| l.kind.id()).collect::<Vec<_>>().join(" --allow-lint ")
                )
            }
            TrainError::Placement { .. } => {
                "check `[devices]` (`tunestudio plan --config` shows the split) or use fewer devices"
                    .into()
            }
            TrainError::Panic { .. } => "resume from the last checkpoint".into(),
            TrainError::Reward { .. } => {
                "fix the reward function named above (`tunestudio preview` runs every reward on sampled completions before a run), then resume with --resume latest".into()
            }
            TrainError::Rollout { .. } => {
                "check `[grpo]` (temperature, top_p, top_k, max_completion_length) and resume from the last checkpoint".into()
            }
        }
    }
}

/// Turns a model error raised inside a step into a [`TrainError::Step`] with advice: an
/// allocation failure gets the settings that reduce memory, anything else the generic advice.
pub(crate) fn step_error(
    phase: Phase,
    step: u64,
    shape: (usize, usize),
    err: impl StepCause,
    settings: &str,
) -> TrainError {
    let message = err.to_string();
    let allocation_failure = err.allocation_failure();
    let hint = if allocation_failure.is_some() {
        format!(
            "ran out of memory in the {phase} pass ({settings}); lower `training.micro_batch` \
             (raise `training.gradient_accumulation` to keep the effective batch), lower \
             `data.max_length`, turn on `training.activation_checkpointing`, or use `[lora]`"
        )
    } else {
        format!(
            "the {phase} pass failed ({settings}); check that the model folder and the data \
             belong together, and resume from the last checkpoint"
        )
    };
    TrainError::Step {
        phase,
        step,
        batch_rows: shape.0,
        batch_tokens: shape.1,
        message,
        hint,
        allocation_failure,
        device: None,
    }
}

/// What failed inside a step: its message, and the allocation failure its error value
/// reports ([`crate::mem::alloc_failure`]).
pub(crate) trait StepCause: std::fmt::Display {
    /// The allocation failure, when the error is one.
    fn allocation_failure(&self) -> Option<crate::mem::alloc_failure::AllocationFailure>;
}

impl StepCause for crate::model::ModelError {
    fn allocation_failure(&self) -> Option<crate::mem::alloc_failure::AllocationFailure> {
        crate::mem::alloc_failure::from_error(self)
    }
}

impl StepCause for crate::devices::DevicesError {
    fn allocation_failure(&self) -> Option<crate::mem::alloc_failure::AllocationFailure> {
        crate::mem::alloc_failure::from_error(self)
    }
}

impl StepCause for candle_core::Error {
    fn allocation_failure(&self) -> Option<crate::mem::alloc_failure::AllocationFailure> {
        crate::mem::alloc_failure::from_candle(self)
    }
}

/// The out-of-memory failure `TUNESTUDIO_INJECT_OOM` makes (`train::oom`).
pub(crate) struct InjectedOom(pub String);

impl std::fmt::Display for InjectedOom {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl StepCause for InjectedOom {
    fn allocation_failure(&self) -> Option<crate::mem::alloc_failure::AllocationFailure> {
        crate::mem::alloc_failure::classify(crate::mem::alloc_failure::FailedApi::Injected, 0)
    }
}
