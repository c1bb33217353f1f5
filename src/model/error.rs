//! The typed errors of the model engine: every message names the file, tensor or
//! setting involved and says how to fix it.

use std::path::PathBuf;

/// Everything that can go wrong while loading, running, training or saving a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// Tensors owned by two logical devices (stages or ranks) were combined without the
    /// explicit transfer: on two GPUs candle would refuse the op.
    #[error("{what}: tensors of logical device {left} and logical device {right} were combined without a transfer (a placement bug: on two GPUs this op fails with a device mismatch; please report it)")]
    CrossDevice {
        /// What was being combined.
        what: String,
        /// The first operand's logical device.
        left: usize,
        /// The second operand's logical device.
        right: usize,
    },
    /// A file could not be read or written.
    #[error(
        "cannot access {path}: {source} (check that the path exists and is readable/writable)"
    )]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// The operating-system error.
        #[source]
        source: std::io::Error,
    },
    /// A required file of a model folder is absent.
    #[error("{path} does not exist: {hint}")]
    MissingFile {
        /// The path that was expected.
        path: PathBuf,
        /// What the file is for and how to provide it.
        hint: String,
    },
    /// `config.json` (or another JSON file) is not valid JSON or misses a required field.
    #[error("invalid configuration in {origin}: {message}")]
    Config {
        /// The file (or other origin) of the JSON.
        origin: String,
        /// What is wrong and how to fix it.
        message: String,
    },
    /// `model_type` names an architecture this engine does not implement.
    #[error(
        "unsupported model_type `{model_type}` in {origin}: supported are llama, mistral and qwen2"
    )]
    UnsupportedArchitecture {
        /// The file the config came from.
        origin: String,
        /// The `model_type` found.
        model_type: String,
    },
    /// A weight the architecture needs is absent from the checkpoint.
    #[error("tensor `{name}` is missing from {file} (the checkpoint does not match config.json; re-download or re-export the model)")]
    MissingTensor {
        /// The HF parameter name.
        name: String,
        /// The weights file (or index) that was searched.
        file: String,
    },
    /// A weight has a different shape from the one config.json implies.
    #[error("tensor `{name}` in {file} has shape {found:?} but config.json implies {expected:?} (the checkpoint does not match config.json)")]
    ShapeMismatch {
        /// The HF parameter name.
        name: String,
        /// The weights file.
        file: String,
        /// The shape the config implies.
        expected: Vec<usize>,
        /// The shape stored in the file.
        found: Vec<usize>,
    },
    /// A tensor has a dtype that cannot be converted (e.g. an integer weight).
    #[error("tensor `{name}` in {file} has unsupported dtype {dtype} (expected f32, bf16 or f16)")]
    UnsupportedDtype {
        /// The HF parameter name.
        name: String,
        /// The weights file.
        file: String,
        /// The stored dtype.
        dtype: String,
    },
    /// A safetensors file could not be parsed.
    #[error("{path} is not a valid safetensors file: {message} (the file may be truncated; re-download it)")]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// The parser's message.
        message: String,
    },
    /// A hub id was requested while `HF_HUB_OFFLINE` is set and it is not in the cache.
    #[error("model `{model}` is not in the Hugging Face cache at {cache} and HF_HUB_OFFLINE is set: download it once online, or point to a local folder")]
    HubOffline {
        /// The hub id.
        model: String,
        /// The cache folder that was searched.
        cache: PathBuf,
    },
    /// Downloading from the hub failed: refused (gated or private, naming HF_TOKEN), not
    /// found, unreachable, or broken off.
    /// (Boxed: the error names so much that it would make every `Result` large.)
    #[error(transparent)]
    Hub(Box<crate::hub_env::HubError>),
    /// A trainable parameter received no gradient in a backward pass.
    #[error("trainable parameter `{name}` got no gradient from this backward pass: the graph is cut somewhere (a non-differentiable op) or the loss does not depend on it")]
    MissingGradient {
        /// The HF parameter name.
        name: String,
    },
    /// The caller passed tensors of the wrong shape or dtype.
    #[error("invalid input: {0}")]
    Input(String),
    /// A LoRA adapter could not be applied, loaded or saved.
    #[error("LoRA adapter: {0}")]
    Lora(String),
    /// The optimizer's state or gradients do not fit the parameters.
    #[error("optimizer: {0}")]
    Optimizer(String),
    /// A tensor operation failed inside candle.
    #[error("tensor operation failed: {0}")]
    Candle(#[from] candle_core::Error),
}

impl ModelError {
    /// Wraps an `io::Error` with the path it concerns.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ModelError::Io {
            path: path.into(),
            source,
        }
    }
}
