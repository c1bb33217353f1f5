//! Errors as the studio shows them: what kind of problem it is (so the UI matches on a kind,
//! never on words), what happened, and what to do about it, said once.
//!
//! Every background job turns the library's typed error into a [`JobError`] at the edge
//! (`From` impls below); panels draw it with [`crate::gui::theme::job_error`].

use std::fmt;

use tunestudio::data::DataError;
use tunestudio::infer::InferError;
use tunestudio::model::ModelError;
use tunestudio::plan::PlanError;
use tunestudio::train::oom::RefitError;
use tunestudio::train::{ConfigError, TrainError};

/// What kind of problem an error is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ErrorKind {
    /// A device ran out of memory (the planner's fixes apply).
    OutOfMemory,
    /// A setting is missing or wrong.
    Config,
    /// The dataset cannot be read or used.
    Data,
    /// A file or folder cannot be read or written.
    Io,
    /// The model (its files, weights or adapter) cannot be loaded or run.
    Model,
    /// Anything else.
    #[default]
    Other,
}

/// An error of a background job: its kind, the message, and the hint (shown once).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct JobError {
    /// What kind of problem it is.
    pub kind: ErrorKind,
    /// What happened.
    pub message: String,
    /// What to do about it, when the library says.
    pub hint: Option<String>,
}

impl JobError {
    /// An error of `kind`; a hint the message already ends with is not repeated.
    pub fn new(kind: ErrorKind, message: impl Into<String>, hint: Option<String>) -> Self {
        let mut message = message.into();
        let hint = hint.filter(|h| !h.trim().is_empty());
        if let Some(h) = &hint {
            for suffix in [format!("\nhint: {h}"), format!("\n{h}"), format!(" — {h}")] {
                if let Some(stripped) = message.strip_suffix(&suffix) {
                    message = stripped.to_string();
                    break;
                }
            }
        }
        JobError {
            kind,
            message,
            hint,
        }
    }

    /// An error without a library type behind it (the studio's own checks).
    pub fn other(message: impl Into<String>) -> Self {
        JobError::new(ErrorKind::Other, message, None)
    }

    /// An error of `kind` without a hint.
    pub fn of(kind: ErrorKind, message: impl Into<String>) -> Self {
        JobError::new(kind, message, None)
    }

    /// The same error with `context` put before the message.
    pub fn context(mut self, context: impl fmt::Display) -> Self {
        self.message = format!("{context}: {}", self.message);
        self
    }
}

/// The message, then the hint on its own line.
impl fmt::Display for JobError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)?;
        if let Some(h) = &self.hint {
            write!(f, "\nWhat to do: {h}")?;
        }
        Ok(())
    }
}

impl std::error::Error for JobError {}

impl From<String> for JobError {
    fn from(message: String) -> Self {
        JobError::other(message)
    }
}

impl From<&str> for JobError {
    fn from(message: &str) -> Self {
        JobError::other(message)
    }
}

impl From<ModelError> for JobError {
    fn from(e: ModelError) -> Self {
        let kind = match &e {
            ModelError::Io { .. } | ModelError::MissingFile { .. } => ErrorKind::Io,
            ModelError::Config { .. } | ModelError::UnsupportedArchitecture { .. } => {
                ErrorKind::Config
            }
            _ => ErrorKind::Model,
        };
        JobError::new(kind, e.to_string(), None)
    }
}

impl From<DataError> for JobError {
    fn from(e: DataError) -> Self {
        let kind = match &e {
            DataError::Io { .. } | DataError::NotFound { .. } => ErrorKind::Io,
            DataError::Config { .. } => ErrorKind::Config,
            _ => ErrorKind::Data,
        };
        JobError::new(kind, e.to_string(), None)
    }
}

impl From<InferError> for JobError {
    fn from(e: InferError) -> Self {
        match e {
            InferError::Model(m) => m.into(),
            InferError::Data(d) => d.into(),
            other => {
                let kind = match &other {
                    InferError::InvalidSetting { .. } | InferError::EmptyPrompt => {
                        ErrorKind::Config
                    }
                    _ => ErrorKind::Model,
                };
                JobError::new(kind, other.to_string(), None)
            }
        }
    }
}

impl From<PlanError> for JobError {
    fn from(e: PlanError) -> Self {
        match e {
            PlanError::Model(m) => m.into(),
            other => JobError::new(ErrorKind::Config, other.to_string(), None),
        }
    }
}

impl From<RefitError> for JobError {
    fn from(e: RefitError) -> Self {
        match e {
            RefitError::Plan(p) => p.into(),
            // What the device held fits no resumable settings: a setting to change (the
            // message names it).
            other => JobError::new(ErrorKind::Config, other.to_string(), None),
        }
    }
}

impl From<ConfigError> for JobError {
    fn from(e: ConfigError) -> Self {
        let kind = match &e {
            ConfigError::Read { .. } | ConfigError::Write { .. } => ErrorKind::Io,
            _ => ErrorKind::Config,
        };
        JobError::new(kind, e.to_string(), None)
    }
}

impl From<TrainError> for JobError {
    fn from(e: TrainError) -> Self {
        let kind = if tunestudio::train::oom::is_out_of_memory(&e) {
            ErrorKind::OutOfMemory
        } else {
            match &e {
                TrainError::Config(c) => match c {
                    ConfigError::Read { .. } | ConfigError::Write { .. } => ErrorKind::Io,
                    _ => ErrorKind::Config,
                },
                TrainError::Device { .. } | TrainError::Placement { .. } => ErrorKind::Config,
                TrainError::Model { .. } | TrainError::VocabMismatch { .. } => ErrorKind::Model,
                TrainError::Data { .. }
                | TrainError::EmptyDataset(_)
                | TrainError::Lints { .. } => ErrorKind::Data,
                TrainError::Checkpoint { .. } | TrainError::Io { .. } => ErrorKind::Io,
                _ => ErrorKind::Other,
            }
        };
        JobError::new(kind, e.to_string(), Some(e.hint()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hint_the_message_already_carries_is_shown_once() {
        let e: JobError = TrainError::NonFiniteLoss {
            step: 3,
            value: "NaN".into(),
            hint: "lower the learning rate".into(),
        }
        .into();
        assert_eq!(e.hint.as_deref(), Some("lower the learning rate"));
        let shown = e.to_string();
        assert_eq!(
            shown.matches("lower the learning rate").count(),
            1,
            "{shown}"
        );
        assert!(shown.contains("the loss became NaN at step 3"), "{shown}");
    }

    #[test]
    fn kinds_come_from_the_library_types_not_the_words() {
        let oom: JobError = TrainError::Step {
            phase: tunestudio::train::Phase::Forward,
            step: 1,
            batch_rows: 2,
            batch_tokens: 8,
            message: "CUDA_ERROR_OUT_OF_MEMORY: out of memory".into(),
            hint: "lower training.micro_batch".into(),
            allocation_failure: tunestudio::mem::alloc_failure::classify(
                tunestudio::mem::alloc_failure::FailedApi::CudaDriver,
                tunestudio::mem::alloc_failure::CUDA_ERROR_OUT_OF_MEMORY,
            ),
            device: None,
        }
        .into();
        assert_eq!(oom.kind, ErrorKind::OutOfMemory);
        let io: JobError = TrainError::Io {
            path: "/nope".into(),
            cause: std::io::Error::other("read-only"),
        }
        .into();
        assert_eq!(io.kind, ErrorKind::Io);
        // A message that merely mentions memory is not an out-of-memory error.
        let data: JobError = TrainError::EmptyDataset("out of memory is a phrase".into()).into();
        assert_eq!(data.kind, ErrorKind::Data);
        let plan: JobError = PlanError::NoDevices.into();
        assert_eq!(plan.kind, ErrorKind::Config);
        assert!(JobError::other("x").hint.is_none());
    }
}
